// The sm80 forward's launch: the plan's kernel (prefill bucket or decode),
// then the split-KV combine when the keys were split.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fwd_launch.h"

namespace jax_flash2::cuda {
namespace {

template <typename Elem>
cudaError_t LaunchBucket(const FwdArgs& args, int bucket, cudaStream_t stream) {
  switch (bucket) {
    case 32: return LaunchFwdKernel<Elem, 32>(args, stream);
    case 64: return LaunchFwdKernel<Elem, 64>(args, stream);
    case 96: return LaunchFwdKernel<Elem, 96>(args, stream);
    case 128: return LaunchFwdKernel<Elem, 128>(args, stream);
    case 192: return LaunchFwdKernel<Elem, 192>(args, stream);
    case 256: return LaunchFwdKernel<Elem, 256>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Elem>
cudaError_t LaunchTyped(const FwdArgs& args, bool decode, bool small_smem, int bucket,
                        int m_tiles, cudaStream_t stream) {
  const cudaError_t err =
      !decode ? LaunchBucket<Elem>(args, bucket, stream)
      : args.p.kv_quant != KvQuant::kNone
          ? LaunchQuantizedDecodeKernel(args, bucket, m_tiles, small_smem, stream)
          : LaunchDecodeKernel<Elem>(args, bucket, m_tiles, small_smem, stream);
  if (err != cudaSuccess || args.num_splits <= 1) return err;
  return LaunchFwdCombine<Elem>(args, stream);
}

}  // namespace

cudaError_t LaunchSm80Forward(const FwdArgs& args, bool decode, bool decode_small_smem, int bucket,
                              int m_tiles, cudaStream_t stream) {
  switch (args.p.dtype) {
    case DType::kFloat16:
      return LaunchTyped<__half>(args, decode, decode_small_smem, bucket, m_tiles, stream);
    case DType::kBFloat16:
      return LaunchTyped<__nv_bfloat16>(args, decode, decode_small_smem, bucket, m_tiles, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
