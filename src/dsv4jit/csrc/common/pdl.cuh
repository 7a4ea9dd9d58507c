// Programmatic dependent launch (sm_90+): a kernel launched with the PDL attribute may start
// before its predecessor finishes, so it must wait before reading anything produced upstream
// (plans included); before that wait it reads only what no running kernel writes (an L2 prefetch
// reads nothing into the kernel, so it may go first, and so may a hint: a plan or metadata entry
// read only to aim such a prefetch and read again after the wait). It may let its own dependents
// start early, once it has waited itself (then everything before it is complete).
#pragma once

#include "types.cuh"

namespace dsv4 {

template <bool kPDL>
DSV4_DEV void pdl_wait_upstream() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kPDL) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// A write pass that loads before it waits for the pass just before it (whose inputs it shares)
/// must still wait before it exits, so that a kernel waiting for it also waits for that pass: the
/// wait runs when this guard leaves scope (waiting twice costs nothing).
template <bool kPDL>
struct WaitUpstreamOnExit {
  bool armed;
  DSV4_DEV ~WaitUpstreamOnExit() {
    if (armed) pdl_wait_upstream<kPDL>();
  }
};

template <bool kPDL>
DSV4_DEV void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kPDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace dsv4
