// Backward kernels of head-dim bucket 256, both dtypes (one file per bucket so
// the buckets compile in parallel).
#include "bwd_kernel.cuh"

namespace jax_flash2::cuda {

template cudaError_t LaunchBwdMain<__half, 256>(const FlashParams&, const BwdScratchPtrs&,
                                              BwdTileRow, cudaStream_t);
template cudaError_t LaunchBwdMain<__nv_bfloat16, 256>(const FlashParams&, const BwdScratchPtrs&,
                                                     BwdTileRow, cudaStream_t);

}  // namespace jax_flash2::cuda
