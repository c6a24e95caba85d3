// The sm80 backward's main launch: the one runtime (dtype, head dim) ->
// template dispatch of BwdMainKernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bwd_kernel.cuh"
#include "bwd_launch.h"

namespace jax_flash2::cuda {

// The main kernels are instantiated in bwd_hdim{32,64,128,256}.cu.
#define JF2_EXTERN_BWD(ELEM, D)                                                               \
  extern template cudaError_t LaunchBwdMain<ELEM, D>(const FlashParams&, const BwdScratchPtrs&, \
                                                     BwdTileRow, cudaStream_t);
JF2_EXTERN_BWD(__half, 32)
JF2_EXTERN_BWD(__half, 64)
JF2_EXTERN_BWD(__half, 128)
JF2_EXTERN_BWD(__half, 256)
JF2_EXTERN_BWD(__nv_bfloat16, 32)
JF2_EXTERN_BWD(__nv_bfloat16, 64)
JF2_EXTERN_BWD(__nv_bfloat16, 128)
JF2_EXTERN_BWD(__nv_bfloat16, 256)
#undef JF2_EXTERN_BWD

namespace {

template <typename Elem>
cudaError_t LaunchTyped(const FlashParams& p, const BwdScratchPtrs& s, BwdTileRow row,
                        cudaStream_t stream) {
  switch (BwdTileFor(p.head_dim).head_dim) {
    case 32: return LaunchBwdMain<Elem, 32>(p, s, row, stream);
    case 64: return LaunchBwdMain<Elem, 64>(p, s, row, stream);
    case 128: return LaunchBwdMain<Elem, 128>(p, s, row, stream);
    case 256: return LaunchBwdMain<Elem, 256>(p, s, row, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchSm80BwdMain(const FlashParams& p, const BwdScratchPtrs& s, BwdTileRow row,
                              cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat16: return LaunchTyped<__half>(p, s, row, stream);
    case DType::kBFloat16: return LaunchTyped<__nv_bfloat16>(p, s, row, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
