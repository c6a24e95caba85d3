// Forward kernels of the head-dim-64 bucket; one file per bucket so that the
// buckets compile in parallel.
#include "fwd_kernel.cuh"

namespace jax_flash2::cuda {

template cudaError_t LaunchFwdKernel<__half, 64>(const FwdArgs&, cudaStream_t);
template cudaError_t LaunchFwdKernel<__nv_bfloat16, 64>(const FwdArgs&, cudaStream_t);

}  // namespace jax_flash2::cuda
