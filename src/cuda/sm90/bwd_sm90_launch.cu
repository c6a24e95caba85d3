// Host side of the Hopper backward main kernel: what it supports, the kill
// switch, the tensor maps, and the launch with its runtime -> template
// dispatch.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../bwd_kernel.cuh"
#include "bwd_sm90.h"
#include "bwd_sm90_kernel.cuh"
#include "tensor_map.h"

namespace jax_flash2::cuda {
namespace {

using sm90::BwdSm90Args;
using sm90::BwdSm90Tile;

template <typename Elem, int kHeadDim>
cudaError_t LaunchBwdSm90(const BwdSm90Args& args, cudaStream_t stream) {
  constexpr BwdSm90Tile tile = sm90::BwdSm90TileFor(kHeadDim);
  constexpr int smem_bytes = sm90::BwdSm90SmemBytes(tile);
  const auto kernel = &sm90::BwdSm90Kernel<Elem, kHeadDim>;
  // Opt in once per device (the limit is a per-device function attribute).
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || !(opted_in.load(std::memory_order_acquire) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    opted_in.fetch_or(bit, std::memory_order_release);
  }
  const dim3 grid(static_cast<unsigned>((args.p.seqlen_k + tile.block_n - 1) / tile.block_n),
                  static_cast<unsigned>(args.p.batch), static_cast<unsigned>(args.p.num_heads_kv));
  kernel<<<grid, sm90::kBwdSm90Threads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

template <typename Elem>
cudaError_t LaunchForHeadDim(const BwdSm90Args& args, cudaStream_t stream) {
  switch (args.p.head_dim) {
    case 64: return LaunchBwdSm90<Elem, 64>(args, stream);
    case 128: return LaunchBwdSm90<Elem, 128>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool Sm90BackwardSupports(const FlashParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (sm90::BwdSm90TileFor(p.head_dim).head_dim == 0) return false;
  // Score modifiers the kernel does not implement; and the deterministic
  // backward, whose fixed dQ summation order (dQ slices, bwd_kernel.cuh) it
  // does not follow: its dQ reductions land in any order.
  if (p.softcap != 0.f || p.alibi_slopes != nullptr || p.q_segment_ids != nullptr ||
      p.kv_segment_ids != nullptr || p.dropout_seeds != nullptr || p.deterministic) {
    return false;
  }
  if (p.num_heads_kv <= 0 || p.num_heads_q % p.num_heads_kv != 0 ||
      p.group_size != p.num_heads_q / p.num_heads_kv) {
    return false;
  }
  // TMA: global strides multiples of 16 bytes, base addresses 16-byte aligned
  // (dq, dk, dv: 4-byte stores; the sm80 checks ask for 16 anyway).
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0 || s < 0 || s >= (int64_t{1} << 39)) return false;
  }
  const void* ptrs[] = {p.q, p.k, p.v, p.d_o, p.dq, p.dk, p.dv};
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  }
  // Grid (key blocks, B, K) and 32-bit row/key indices in the kernel.
  if (p.batch > 65535 || p.num_heads_kv > 65535 || p.seqlen_q >= (int64_t{1} << 31) - 256 ||
      p.seqlen_k >= (int64_t{1} << 31) - 256) {
    return false;
  }
  return true;
}

bool Sm90BackwardEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_FLASH2_SM90_BACKWARD");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

cudaError_t RunBackwardSm90(const FlashParams& p, const BwdScratchPtrs& s, const DeviceInfo& dev,
                            cudaStream_t stream) {
  // One dQ accumulator (dq_splits == 1): deterministic calls are not served.
  if (!Sm90BackwardSupports(p) || dev.cc_major != 9 || s.dq_splits != 1) {
    return cudaErrorInvalidValue;
  }
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  if (static_cast<size_t>(sm90::BwdSm90SmemBytes(tile)) > dev.max_smem_per_block_optin) {
    return cudaErrorInvalidValue;
  }
  // Nothing to compute; RunBackward returns before this, but a tensor map
  // cannot have a zero extent either.
  if (p.batch * p.num_heads_q * p.seqlen_k == 0) return cudaSuccess;
  const sm90::EncodeTiledFn encode = sm90::GetEncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;

  BwdSm90Args args;
  args.p = p;
  args.lse2 = s.lse2;
  args.dvec = s.dvec;
  args.dq_acc = s.dq_acc;
  args.t_pad = s.t_pad;
  cudaError_t err = cudaSuccess;
  // T == 0: no query block is visited (QueryRange is empty), so the Q and dO
  // maps stay zeroed (unused) and the kernel writes dK = dV = 0.
  if (p.seqlen_q > 0) {
    err = sm90::EncodeTensorMap(&args.tma_q, encode, p.dtype, p.q, p.batch, p.seqlen_q,
                                p.num_heads_q, p.head_dim, p.q_batch_stride, p.q_row_stride,
                                p.q_head_stride, tile.block_m, &args.q_heads_inner);
    if (err == cudaSuccess) {
      err = sm90::EncodeTensorMap(&args.tma_do, encode, p.dtype, p.d_o, p.batch, p.seqlen_q,
                                  p.num_heads_q, p.head_dim, p.o_batch_stride, p.o_row_stride,
                                  p.o_head_stride, tile.block_m, &args.do_heads_inner);
    }
  }
  if (err == cudaSuccess) {
    err = sm90::EncodeTensorMap(&args.tma_k, encode, p.dtype, p.k, p.batch, p.seqlen_k,
                                p.num_heads_kv, p.head_dim, p.k_batch_stride, p.k_row_stride,
                                p.k_head_stride, tile.block_n, &args.k_heads_inner);
  }
  if (err == cudaSuccess) {
    err = sm90::EncodeTensorMap(&args.tma_v, encode, p.dtype, p.v, p.batch, p.seqlen_k,
                                p.num_heads_kv, p.head_dim, p.v_batch_stride, p.v_row_stride,
                                p.v_head_stride, tile.block_n, &args.v_heads_inner);
  }
  if (err != cudaSuccess) return err;
  switch (p.dtype) {
    case DType::kFloat16: return LaunchForHeadDim<__half>(args, stream);
    case DType::kBFloat16: return LaunchForHeadDim<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
