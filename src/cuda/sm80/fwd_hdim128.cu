// Forward kernels of the head-dim-128 bucket; one file per bucket so that the
// buckets compile in parallel.
#include "fwd_kernel.cuh"

namespace jax_flash2::cuda {

template cudaError_t LaunchFwdKernel<__half, 128>(const FwdArgs&, cudaStream_t);
template cudaError_t LaunchFwdKernel<__nv_bfloat16, 128>(const FwdArgs&, cudaStream_t);

}  // namespace jax_flash2::cuda
