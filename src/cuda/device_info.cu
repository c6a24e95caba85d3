// GetCurrentDeviceInfo (flash_cuda.h): device properties, queried once per
// device and cached. Its own file so that the standalone self-tests of the
// backward can link it without the forward.
#include <cuda_runtime.h>

#include <mutex>

#include "../test_switches.h"
#include "flash_cuda.h"

namespace jax_flash2::cuda {
namespace {

constexpr int kMaxDevices = 64;

cudaError_t QueryDeviceInfo(int device, DeviceInfo* info) {
  int sm_count = 0, major = 0, minor = 0, smem_optin = 0, l2_bytes = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
  if (err != cudaSuccess) return err;
  info->device = device;
  info->sm_count = sm_count;
  info->cc_major = major;
  info->cc_minor = minor;
  info->max_smem_per_block_optin = static_cast<size_t>(smem_optin);
  // The test switch JAX_FLASH2_MAX_SMEM_PER_BLOCK: plan (and opt in) as a GPU
  // with less shared memory would.
  const int64_t cap = GetTestSwitches().max_smem_per_block;
  if (cap > 0 && static_cast<size_t>(cap) < info->max_smem_per_block_optin) {
    info->max_smem_per_block_optin = static_cast<size_t>(cap);
  }
  info->l2_bytes = static_cast<size_t>(l2_bytes);
  return cudaSuccess;
}

}  // namespace

cudaError_t GetCurrentDeviceInfo(DeviceInfo* info) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return QueryDeviceInfo(device, info);
  // Only successful queries are cached, so a transient failure is retried.
  static std::mutex mutex;
  static DeviceInfo cache[kMaxDevices];
  static bool cached[kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (!cached[device]) {
    err = QueryDeviceInfo(device, &cache[device]);
    if (err != cudaSuccess) return err;
    cached[device] = true;
  }
  *info = cache[device];
  return cudaSuccess;
}

}  // namespace jax_flash2::cuda
