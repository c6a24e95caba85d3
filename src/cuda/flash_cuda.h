// Host interface of the CUDA kernels: what the FFI handlers call.
//
// Every function returns a cudaError_t instead of aborting; the handlers turn
// it into an ffi::Error. Scratch memory comes from XLA's allocator through the
// FFI and lives only for one call.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../flash_params.h"

namespace jax_flash2::cuda {

struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  size_t max_smem_per_block_optin = 0;  // bytes a block may use after opting in
  size_t l2_bytes = 0;
};

// Properties of the calling thread's current device, queried once per device
// and cached thread-safely (several GPUs run handlers concurrently).
cudaError_t GetCurrentDeviceInfo(DeviceInfo* info);

// Empty when the kernels can serve p on dev, else why not (dtype, head dim,
// compute capability). The handlers return it as InvalidArgument.
std::string Unsupported(const FlashParams& p, const DeviceInfo& dev);

// Forward. Scratch holds split-KV partial results; 0 bytes when not split.
size_t ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev);
cudaError_t RunForward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                       cudaStream_t stream);

// Forward calls run so far in this process by the sm80 prefill, the Hopper
// (sm90) and the decode kernels: lets tests assert which path served a call.
struct ForwardCallCounts {
  int64_t sm80 = 0;
  int64_t sm90 = 0;
  int64_t decode = 0;
};
ForwardCallCounts GetForwardCallCounts();

// True when this build includes the Hopper forward (sm_90a in the archs).
constexpr bool kHaveSm90 =
#if JF2_HAVE_SM90
    true;
#else
    false;
#endif

// Backward. Scratch holds D = rowsum(dO * O) - dLSE and the fp32 dQ (and, for
// GQA, dK/dV) accumulators.
size_t BackwardScratchBytes(const FlashParams& p, const DeviceInfo& dev);
cudaError_t RunBackward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                        cudaStream_t stream);

// Backward calls run so far in this process by the sm80 and the Hopper main
// kernels (as ForwardCallCounts).
struct BackwardCallCounts {
  int64_t sm80 = 0;
  int64_t sm90 = 0;
};
BackwardCallCounts GetBackwardCallCounts();

}  // namespace jax_flash2::cuda
