// The sm80 backward's main kernel, as the backward dispatch (backward.cu)
// calls it; the preprocess and convert kernels are in bwd_kernel.cuh.
#pragma once

#include <cuda_runtime.h>

#include "../../flash_params.h"
#include "bwd_traits.h"

namespace jax_flash2::cuda {

struct BwdScratchPtrs;

// BwdMainKernel of p's dtype and head-dim bucket (bwd_hdim*.cu) with the
// tile of `row` (the plan's, plan.h).
cudaError_t LaunchSm80BwdMain(const FlashParams& p, const BwdScratchPtrs& s, BwdTileRow row,
                              cudaStream_t stream);

}  // namespace jax_flash2::cuda
