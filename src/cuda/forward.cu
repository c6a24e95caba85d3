// The CUDA forward's entry points: the plan (src/plan.h: support check,
// decode or prefill kernel, split-KV, Hopper or sm80) run as it says, on the
// Hopper kernel (sm90/) or the sm80 ones (sm80/).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../plan.h"
#include "flash_cuda.h"
#include "launch.h"
#include "sm80/fwd_launch.h"
#if JF2_HAVE_SM90
#include "sm90/fwd_sm90.h"
#endif

namespace jax_flash2::cuda {

size_t ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  if (!ForwardUnsupported(p, dev).empty() || p.batch * p.seqlen_q * p.num_heads_q == 0) return 0;
  const PlanOptions opts = CudaPlanOptions();
  const FwdPlan prefill = plan_detail::MakePrefillPlan(p, dev);
  size_t bytes = SplitScratchBytes(p, prefill);
#if JF2_HAVE_SM90
  if (plan_detail::Sm90ForwardUnserved(p, dev, opts, prefill).empty()) {
    bytes = std::max(bytes, Sm90ForwardScratchBytes(p, dev));
  }
#endif
  // The lowering sizes the workspace without the score options, which decide
  // between the decode and prefill kernels, and for the largest shared memory
  // of its compute capability, which decides the decode tile: enough for any.
  // It is sized without the KV-cache operands either, whose calls split finer.
  if (plan_detail::IsDecodeShape(p)) {
    const int bucket = DecodeTileFor(p.head_dim).head_dim;
    static const int32_t kStandIn = 0;
    FlashParams kv = p;
    kv.kv_seqlens = &kStandIn;  // MakeDecodePlan reads only whether it is set
    const FlashParams* const calls[] = {&p, &kv};
    for (const FlashParams* q : calls) {
      for (bool small_smem : {false, true}) {
        const DecodeTileSizes tile = DecodeTileOfRow(bucket, small_smem);
        if (tile.head_dim == 0) continue;
        bytes = std::max(bytes, SplitScratchBytes(
                                    *q, plan_detail::MakeDecodePlan(*q, dev, opts, tile, small_smem)));
      }
    }
  }
  return bytes;
}

cudaError_t RunForward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                       cudaStream_t stream) {
  const FwdPlan plan = MakeForwardPlan(p, dev, CudaPlanOptions());
  if (plan.kernel == FwdKernel::kUnsupported) return cudaErrorInvalidValue;
  if (p.batch * p.seqlen_q * p.num_heads_q == 0) return cudaSuccess;  // nothing to write
  if (plan.kernel == FwdKernel::kSm90) {
#if JF2_HAVE_SM90
    return RunForwardSm90(p, scratch, dev, stream);
#else
    return cudaErrorInvalidValue;
#endif
  }
  const bool decode = plan.kernel == FwdKernel::kSm80Decode;
  FwdArgs args;
  args.p = p;
  args.pack = plan.pack;
  args.num_m_blocks = plan.num_m_blocks;
  args.kv_stages = decode ? 1 : plan.kv_stages;
  args.num_splits = plan.num_splits;
  args.n_blocks_per_split = plan.n_blocks_per_split;
  args.programmatic_launch = decode && LaunchesDecodeEarly(dev);
  const double kv_bytes = 2.0 * p.batch * p.seqlen_k * p.num_heads_kv * p.head_dim * 2;
  args.kv_read_once = decode && kv_bytes > 0.5 * static_cast<double>(dev.l2_bytes);
  if (plan.num_splits > 1) {
    if (scratch == nullptr) return cudaErrorInvalidValue;
    args.lse_partial = static_cast<float*>(scratch);
    args.o_partial = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                              SplitPartialLseBytes(p, plan));
  }
  return LaunchSm80Forward(args, decode, plan.decode_small_smem, plan.bucket, plan.m_tiles,
                           stream);
}

}  // namespace jax_flash2::cuda
