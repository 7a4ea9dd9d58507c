// Kernel launch on torch's current stream of the tensors' device, with an optional
// programmatic-dependent-launch attribute and a checked launch status.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>

#include <atomic>
#include <utility>

namespace dsv4 {

/// Torch's current stream for `device` (set by the tvm-ffi call path from the torch arguments).
inline cudaStream_t current_stream(DLDevice device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device.device_id));
}

inline void check_cuda(const char* op, cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "dsv4jit." << op << ": " << what << " failed: " << cudaGetErrorName(err) << ": "
                                << cudaGetErrorString(err);
  }
}

struct LaunchShape {
  dim3 grid;
  dim3 block;
  size_t smem = 0;
};

/// Launch `kernel` on the current stream of `device`. Empty grids launch nothing. The caller
/// holds the device guard when it issues other work (copies) for the same call.
template <typename... Params, typename... Args>
void launch(const char* op, DLDevice device, LaunchShape shape, bool pdl, void (*kernel)(Params...), Args&&... args) {
  if (shape.grid.x == 0 || shape.grid.y == 0 || shape.grid.z == 0) return;
  tvm::ffi::CUDADeviceGuard guard(device.device_id);
  cudaLaunchConfig_t config{};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem;
  config.stream = current_stream(device);
  cudaLaunchAttribute attr[1];
  config.attrs = attr;
  if (pdl) {
    attr[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  check_cuda(op, cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "kernel launch");
}

/// Whether torch's current stream of `device` is capturing a CUDA graph (whose launches replay later
/// on whatever their buffers then hold).
inline bool capturing(const char* op, DLDevice device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(op, cudaStreamIsCapturing(current_stream(device), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

/// The SMs of `device`, asked once per device (grids of resident blocks size themselves by it).
inline int multiprocessors(const char* op, DLDevice device) {
  static std::atomic<int> counts[64] = {};
  std::atomic<int>* known = device.device_id >= 0 && device.device_id < 64 ? &counts[device.device_id] : nullptr;
  if (known != nullptr && known->load(std::memory_order_relaxed) > 0) return known->load(std::memory_order_relaxed);
  int count = 0;
  check_cuda(op, cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.device_id),
             "cudaDeviceGetAttribute");
  if (known != nullptr) known->store(count, std::memory_order_relaxed);
  return count;
}

inline unsigned div_ceil(uint64_t a, uint64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace dsv4
