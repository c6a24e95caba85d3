// Backward kernels of head-dim bucket 128, both dtypes (one file per bucket so
// the buckets compile in parallel).
#include "bwd_kernel.cuh"

namespace jax_flash2::cuda {

template cudaError_t LaunchBwdMain<__half, 128>(const FlashParams&, const BwdScratchPtrs&,
                                              BwdTileRow, cudaStream_t);
template cudaError_t LaunchBwdMain<__nv_bfloat16, 128>(const FlashParams&, const BwdScratchPtrs&,
                                                     BwdTileRow, cudaStream_t);

}  // namespace jax_flash2::cuda
