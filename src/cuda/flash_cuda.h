// Host interface of the CUDA kernels: what the FFI handlers call.
//
// Every function returns a cudaError_t instead of aborting; the handlers turn
// it into an ffi::Error. Scratch memory comes from XLA's allocator through the
// FFI and lives only for one call. Which kernel serves a call, and whether
// one does (ForwardUnsupported, BackwardUnsupported), is the plan's
// (src/plan.h), which the entry points below run.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../flash_params.h"
#include "../plan.h"

namespace jax_flash2::cuda {

using ::jax_flash2::DeviceInfo;

// Properties of the calling thread's current device, queried once per device
// and cached thread-safely (several GPUs run handlers concurrently).
cudaError_t GetCurrentDeviceInfo(DeviceInfo* info);

// True when this build includes the Hopper kernels (sm_90a in the archs).
constexpr bool kHaveSm90 =
#if JF2_HAVE_SM90
    true;
#else
    false;
#endif

// The plan options of this build and process (kHaveSm90, the test switches).
inline PlanOptions CudaPlanOptions() { return PlanOptionsFrom(kHaveSm90, GetTestSwitches()); }

// Forward. Scratch holds split-KV partial results; 0 bytes when not split.
size_t ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev);
cudaError_t RunForward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                       cudaStream_t stream);

// Backward. Scratch holds D = rowsum(dO * O) - dLSE and the fp32 dQ (and, for
// GQA, dK/dV) accumulators.
size_t BackwardScratchBytes(const FlashParams& p, const DeviceInfo& dev);
cudaError_t RunBackward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                        cudaStream_t stream);

}  // namespace jax_flash2::cuda
