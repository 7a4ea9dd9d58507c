// A trivial kernel for toolchain checks (`dsv4jit info --check`) and loader tests on the GPU:
// out = x * alpha + beta. With PDL it waits for the upstream grid before reading x.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <algorithm>

#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"

namespace dsv4 {

template <typename T, bool kPDL>
__global__ void affine_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n, float alpha, float beta) {
  pdl_wait_upstream<kPDL>();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = from_f32<T>(to_f32(x[i]) * alpha + beta);
  }
  pdl_launch_dependents<kPDL>();
}

template <typename T, bool kPDL>
struct SelfTestEntry {
  static void affine(tvm::ffi::TensorView x, tvm::ffi::TensorView out, double alpha, double beta) {
    Size n{"n"};
    Device dev;
    Check("selftest.affine", "x", x).shape({n}).dtype(DTypeInfo<T>::dtype).cuda(dev).contiguous();
    Check("selftest.affine", "out", out).shape({n}).dtype(DTypeInfo<T>::dtype).cuda(dev).contiguous();
    const unsigned blocks = std::min(div_ceil(n.value, 256), 1024u);
    launch("selftest.affine", dev.dev, {blocks, 256}, kPDL, affine_kernel<T, kPDL>, static_cast<const T*>(x.data_ptr()),
           static_cast<T*>(out.data_ptr()), n.value, static_cast<float>(alpha), static_cast<float>(beta));
  }
};

}  // namespace dsv4
