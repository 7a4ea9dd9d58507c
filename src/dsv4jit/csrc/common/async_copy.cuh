// Asynchronous global -> shared copies (cp.async, sm_80+): a prefetch that holds no registers
// while the kernel's main loads are in flight; and L2 prefetches, for loads another block makes.
#pragma once

#include <cstdint>

#include "types.cuh"

namespace dsv4 {

/// Copies kBytes (4, 8 or 16; both addresses aligned to it) from global to shared memory.
template <int kBytes>
DSV4_DEV void cp_async(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(gmem), "n"(kBytes) : "memory");
}

/// Waits for every cp.async this thread issued (other threads' copies need a barrier after).
DSV4_DEV void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

/// Brings the 128-byte line holding `gmem` into L2 (no register, nothing to wait for).
DSV4_DEV void prefetch_l2(const void* gmem) { asm volatile("prefetch.global.L2 [%0];" ::"l"(gmem)); }

/// Brings `bytes` (a multiple of 16) from `gmem` (16-byte aligned) into L2 in one instruction (sm_90+).
DSV4_DEV void prefetch_l2_bulk(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}

}  // namespace dsv4
