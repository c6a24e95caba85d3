// The CUDA backward's entry points: the plan (src/plan.h: support check,
// Hopper or sm80 main kernel, tile, dQ slices), its scratch, and the three
// launches (preprocess, main, convert; sm80/bwd_kernel.cuh), the main one
// from the Hopper (sm90/) or the sm80 (sm80/) kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../plan.h"
#include "flash_cuda.h"
#include "sm80/bwd_kernel.cuh"
#include "sm80/bwd_launch.h"
#if JF2_HAVE_SM90
#include "sm90/bwd_sm90.h"
#endif

namespace jax_flash2::cuda {

namespace {

template <typename Elem>
cudaError_t RunBackwardTyped(const FlashParams& p, const BwdPlan& plan, const BwdScratchPtrs& s,
                             size_t zeroed_bytes, const DeviceInfo& dev, cudaStream_t stream) {
  // 1. Dvec, lse2; dQ accumulator (and stream-K flags) = 0.
  cudaError_t err = cudaMemsetAsync(s.dq_acc, 0, zeroed_bytes, stream);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.batch * p.num_heads_q * s.t_pad;
  if (rows > 0) {
    BwdPreprocessKernel<Elem><<<BwdPreprocessBlocks<Elem>(p, s, dev.sm_count), 256, 0, stream>>>(p, s);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  // 2. dK, dV, dQ accumulator: the Hopper kernel where it applies (same
  // scratch, same preprocess and convert), else the sm80 kernel per bucket.
#if JF2_HAVE_SM90
  err = plan.kernel == BwdKernel::kSm90 ? RunBackwardSm90(p, s, dev, stream)
                                        : LaunchSm80BwdMain(p, s, plan.row, stream);
#else
  err = LaunchSm80BwdMain(p, s, plan.row, stream);
#endif
  if (err != cudaSuccess) return err;

  // 3. dq = dq_acc * scale. Grid-stride: a few waves of blocks are enough.
  if (p.seqlen_q > 0) {
    const int64_t chunks = p.batch * p.seqlen_q * p.num_heads_q * (p.head_dim / 8);
    const int64_t max_blocks = static_cast<int64_t>(dev.sm_count > 0 ? dev.sm_count : 128) * 16;
    const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, max_blocks);
    BwdConvertKernel<Elem><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, s);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

BwdScratchLayout ScratchLayout(const FlashParams& p, const BwdPlan& plan, const DeviceInfo& dev) {
  int64_t sk_slots = 0, sk_slot_floats = 0, dq_turns = 0;
#if JF2_HAVE_SM90
  if (plan.kernel == BwdKernel::kSm90) {
    sk_slots = Sm90BackwardStreamKSlots(p, dev);
    sk_slot_floats = sm90::BwdSm90SlotFloats(p.head_dim);
    dq_turns = Sm90BackwardDqTurns(p);
  }
#endif
  BwdScratchLayout layout = MakeBwdScratchLayout(p.batch, p.seqlen_q, p.num_heads_q, p.head_dim,
                                                 plan.dq_splits, sk_slots, sk_slot_floats,
                                                 dq_turns);
  if (plan.kernel == BwdKernel::kSm90 && p.deterministic) {
    // A workspace sized for the Hopper kernel may meet the sm80 one at run
    // time (dropout, which the lowering's size does not see; a cc 8.x GPU
    // of a mixed host): it covers that kernel's dQ slices too.
    const int splits = BwdDqSplits(true, p.batch, p.seqlen_q, p.seqlen_k, p.num_heads_q,
                                   p.num_heads_kv, p.head_dim, dev.sm_count);
    layout.total_bytes = std::max(
        layout.total_bytes,
        MakeBwdScratchLayout(p.batch, p.seqlen_q, p.num_heads_q, p.head_dim, splits)
            .total_bytes);
  }
  return layout;
}

}  // namespace

size_t BackwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  return ScratchLayout(p, MakeBackwardPlan(p, dev, CudaPlanOptions()), dev).total_bytes;
}

cudaError_t RunBackward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                        cudaStream_t stream) {
  const BwdPlan plan = MakeBackwardPlan(p, dev, CudaPlanOptions());
  if (plan.kernel == BwdKernel::kUnsupported || p.lse == nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_k == 0 || p.num_heads_q == 0) return cudaSuccess;
  const BwdScratchLayout layout = ScratchLayout(p, plan, dev);
  if (scratch == nullptr || !Aligned16({scratch})) return cudaErrorInvalidValue;
  const BwdScratchPtrs s = BwdScratchPointers(scratch, layout, p.deterministic);
  const size_t zeroed = layout.zeroed_bytes;
  if (p.dtype == DType::kFloat16) return RunBackwardTyped<__half>(p, plan, s, zeroed, dev, stream);
  return RunBackwardTyped<__nv_bfloat16>(p, plan, s, zeroed, dev, stream);
}

}  // namespace jax_flash2::cuda
