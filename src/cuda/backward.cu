// The CUDA backward's entry points: scratch size, argument checks, and the
// three launches (preprocess, main, convert; sm80/bwd_kernel.cuh), the main
// one from the Hopper (sm90/) or the sm80 (sm80/) kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "flash_cuda.h"
#include "sm80/bwd_kernel.cuh"
#include "sm80/bwd_launch.h"
#if JF2_HAVE_SM90
#include "sm90/bwd_sm90.h"
#endif

namespace jax_flash2::cuda {

namespace {

// Calls served by each main kernel (sm80, sm90) in this process.
std::atomic<int64_t> backward_calls[2];

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// What the kernels assume and do not re-check per element: 16-byte vector
// access (every stride a multiple of 8 elements, every pointer 16-byte
// aligned) and a head dim that is a multiple of 8 up to 256.
bool BackwardSupported(const FlashParams& p, const DeviceInfo& dev) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  if (dev.cc_major < 8) return false;
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) return false;
  if (p.num_heads_kv <= 0 || p.group_size * p.num_heads_kv != p.num_heads_q) return false;
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0) return false;
  }
  const void* ptrs[] = {p.q, p.k, p.v, p.o, p.d_o, p.dq, p.dk, p.dv};
  for (const void* ptr : ptrs) {
    if (!Aligned16(ptr)) return false;
  }
  return p.lse != nullptr;
}

// The Hopper main kernel serves the cc 9.0 calls it supports, unless switched
// off by JAX_FLASH2_SM90_BACKWARD=0.
bool UseSm90Backward(const FlashParams& p, const DeviceInfo& dev) {
#if JF2_HAVE_SM90
  return dev.cc_major == 9 && Sm90BackwardEnabled() &&
         Sm90BackwardSupports(p);
#else
  (void)p;
  (void)dev;
  return false;
#endif
}

template <typename Elem>
cudaError_t RunBackwardTyped(const FlashParams& p, const BwdScratchPtrs& s, size_t zeroed_bytes,
                             const DeviceInfo& dev, cudaStream_t stream) {
  // 1. Dvec, lse2; dQ accumulator (and stream-K flags) = 0.
  cudaError_t err = cudaMemsetAsync(s.dq_acc, 0, zeroed_bytes, stream);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.batch * p.num_heads_q * s.t_pad;
  if (rows > 0) {
    BwdPreprocessKernel<Elem><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(p, s);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  // 2. dK, dV, dQ accumulator: the Hopper kernel where it applies (same
  // scratch, same preprocess and convert), else the sm80 kernel per bucket.
  const bool sm90 = UseSm90Backward(p, dev);
  ++backward_calls[sm90 ? 1 : 0];
#if JF2_HAVE_SM90
  err = sm90 ? RunBackwardSm90(p, s, dev, stream) : LaunchSm80BwdMain(p, s, dev, stream);
#else
  err = LaunchSm80BwdMain(p, s, dev, stream);
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

BwdScratchLayout ScratchLayout(const FlashParams& p, const DeviceInfo& dev) {
  const int splits = BwdDqSplits(p.deterministic, p.batch, p.seqlen_q, p.seqlen_k, p.num_heads_q,
                                 p.num_heads_kv, p.head_dim, dev.sm_count);
  int64_t sk_slots = 0, sk_slot_floats = 0;
#if JF2_HAVE_SM90
  if (UseSm90Backward(p, dev)) {
    sk_slots = Sm90BackwardStreamKSlots(p, dev);
    sk_slot_floats = sm90::BwdSm90SlotFloats(p.head_dim);
  }
#endif
  return MakeBwdScratchLayout(p.batch, p.seqlen_q, p.num_heads_q, p.head_dim, splits, sk_slots,
                              sk_slot_floats);
}

}  // namespace

BackwardCallCounts GetBackwardCallCounts() {
  return {backward_calls[0].load(), backward_calls[1].load()};
}

size_t BackwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  return ScratchLayout(p, dev).total_bytes;
}

cudaError_t RunBackward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                        cudaStream_t stream) {
  if (!BackwardSupported(p, dev)) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_k == 0 || p.num_heads_q == 0) return cudaSuccess;
  const BwdScratchLayout layout = ScratchLayout(p, dev);
  if (scratch == nullptr || !Aligned16(scratch)) return cudaErrorInvalidValue;
  const BwdScratchPtrs s = BwdScratchPointers(scratch, layout, p.deterministic);
  const size_t zeroed = layout.zeroed_bytes;
  if (p.dtype == DType::kFloat16) return RunBackwardTyped<__half>(p, s, zeroed, dev, stream);
  return RunBackwardTyped<__nv_bfloat16>(p, s, zeroed, dev, stream);
}

}  // namespace jax_flash2::cuda
