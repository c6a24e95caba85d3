// The sm80 backward's main kernel, as the backward dispatch (backward.cu)
// calls it; the preprocess and convert kernels are in bwd_kernel.cuh.
#pragma once

#include <cuda_runtime.h>

#include "../../flash_params.h"
#include "../flash_cuda.h"

namespace jax_flash2::cuda {

struct BwdScratchPtrs;

// BwdMainKernel of p's dtype and head-dim bucket (bwd_hdim*.cu); a bucket's
// large-smem tiles where the device holds them.
cudaError_t LaunchSm80BwdMain(const FlashParams& p, const BwdScratchPtrs& s, const DeviceInfo& dev,
                              cudaStream_t stream);

}  // namespace jax_flash2::cuda
