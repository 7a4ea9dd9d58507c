// Split-phase barrier over a thread-block cluster (sm_90): every thread of the cluster arrives
// once per phase; waiting is optional, so a block can publish its results and exit while
// another block of the cluster waits for them. Executed by whole warps (.aligned).
#pragma once

#include "types.cuh"

namespace dsv4 {

/// Arrive without ordering memory (e.g. "this block has started").
DSV4_DEV void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

/// Arrive after this thread's writes (local or distributed shared memory) are made visible.
DSV4_DEV void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

/// Wait until every thread of the cluster has arrived at the current phase.
DSV4_DEV void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

}  // namespace dsv4
