// Dynamic shared memory above 48 KB needs a per-kernel opt-in
// (cudaFuncAttributeMaxDynamicSharedMemorySize), and the attribute is per
// device. Setting it once per device keeps a driver call off every launch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace jax_flash2::cuda {

// Opts `kernel` in to bytes_for(device, &bytes) bytes of dynamic shared memory
// on the current device, unless `opted_in` (one bit per device, one flag per
// kernel, owned by the caller) says it was done there. Devices >= 64 have no
// bit and opt in at every call.
template <typename BytesFor>
cudaError_t OptInSharedMemoryOnce(const void* kernel, std::atomic<uint64_t>& opted_in,
                                  BytesFor bytes_for) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  int bytes = 0;
  err = bytes_for(device, &bytes);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  opted_in.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

// The same for a size known without asking the device.
inline cudaError_t OptInSharedMemoryOnce(const void* kernel, std::atomic<uint64_t>& opted_in,
                                         int bytes) {
  return OptInSharedMemoryOnce(kernel, opted_in, [bytes](int, int* out) {
    *out = bytes;
    return cudaSuccess;
  });
}

}  // namespace jax_flash2::cuda
