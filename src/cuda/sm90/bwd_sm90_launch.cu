// Host side of the Hopper backward main kernel: what it supports, the tensor
// maps, and the launch with its runtime -> template dispatch.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../../flash_mask.h"
#include "../launch.h"
#include "../sm80/bwd_kernel.cuh"
#include "../smem_optin.h"
#include "bwd_sm90.h"
#include "bwd_sm90_dsplit_kernel.cuh"
#include "bwd_sm90_kernel.cuh"
#include "segments.cuh"
#include "tensor_map.h"

namespace jax_flash2::cuda {
namespace {

using sm90::BwdSm90Args;
using sm90::BwdSm90Tile;

// The kernel of the tile of kHeadDim, with or without the score options:
// BwdSm90Kernel, or at D = 256 BwdSm90DSplitKernel (one CTA per tile).
template <typename Elem, int kHeadDim, bool kScoreOptions>
constexpr auto BwdSm90KernelFor() {
  if constexpr (sm90::BwdSm90SplitsD(sm90::BwdSm90TileFor(kHeadDim))) {
    return &sm90::BwdSm90DSplitKernel<Elem, kScoreOptions>;
  } else {
    return &sm90::BwdSm90Kernel<Elem, kHeadDim, kScoreOptions>;
  }
}

// Its dynamic shared memory (the D-split kernel's options take a tile more).
template <int kHeadDim, bool kScoreOptions>
constexpr int BwdSm90KernelSmemBytes() {
  constexpr BwdSm90Tile tile = sm90::BwdSm90TileFor(kHeadDim);
  if constexpr (sm90::BwdSm90SplitsD(tile) && kScoreOptions) {
    return sm90::BwdSm90DSplitSmem::kOptionsSmemBytes;
  } else {
    return sm90::BwdSm90SmemBytes(tile);
  }
}

template <typename Elem, int kHeadDim, bool kScoreOptions>
cudaError_t LaunchBwdSm90Kernel(const BwdSm90Args& args, int num_ctas, cudaStream_t stream) {
  constexpr int smem_bytes = BwdSm90KernelSmemBytes<kHeadDim, kScoreOptions>();
  const auto kernel = BwdSm90KernelFor<Elem, kHeadDim, kScoreOptions>();
  static std::atomic<uint64_t> opted_in{0};
  const cudaError_t err =
      OptInSharedMemoryOnce(reinterpret_cast<const void*>(kernel), opted_in, smem_bytes);
  if (err != cudaSuccess) return err;
  // With segment ids after the pre-pass, which lets it start early.
  return LaunchKernel(kernel, dim3(static_cast<unsigned>(num_ctas)), dim3(sm90::kBwdSm90Threads),
                      smem_bytes, stream, args.seg.kv_span != nullptr, args);
}

// The score options' template flag.
template <typename Elem, int kHeadDim>
cudaError_t LaunchBwdSm90(const BwdSm90Args& args, int num_ctas, cudaStream_t stream) {
  if (sm90::HasSm90ScoreOptions(args.p)) {
    return LaunchBwdSm90Kernel<Elem, kHeadDim, true>(args, num_ctas, stream);
  }
  return LaunchBwdSm90Kernel<Elem, kHeadDim, false>(args, num_ctas, stream);
}

template <typename Elem>
cudaError_t LaunchForHeadDim(const BwdSm90Args& args, int num_ctas, cudaStream_t stream) {
  switch (sm90::BwdSm90TileFor(args.p.head_dim).head_dim) {
    case 64: return LaunchBwdSm90<Elem, 64>(args, num_ctas, stream);
    case 128: return LaunchBwdSm90<Elem, 128>(args, num_ctas, stream);
    case 256: return LaunchBwdSm90<Elem, 256>(args, num_ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The grid of a call with num_tiles tiles: CTAs, and the stream-K tail
// (BwdSm90Args::sk_*) where it applies and allow_stream_k holds.
struct BwdSm90Grid {
  int num_ctas;
  int sk_first_tile;
  int sk_ctas;
  bool rotated_dq = false;  // the rotated dQ order, which needs this grid
};

// Key blocks of the tile's block_n per (batch, K/V head).
int64_t NumNBlocks(const FlashParams& p) {
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  return (p.seqlen_k + tile.block_n - 1) / tile.block_n;
}

// Whether a deterministic call takes the rotated dQ order (bwd_sm90.h): no
// mask (every tile sees every query block), BwdSm90Kernel, at least as many
// iterations per tile as key blocks (each key block starts on an iteration
// of its own), and whole (batch, K/V head) groups of N tiles per round of
// the SMs, with at most an eighth of them idle (132 SMs: every N <= 18,
// and N 32, 64, 128 of S = 4k, 8k, 16k). Det backward, H100, B2 H16 T 4k:
// D 64 1.08 -> 0.75 ms (plain 0.73), D 128 1.59 -> 1.38 (plain 1.23).
bool RotatesDqOrder(const FlashParams& p, const DeviceInfo& dev) {
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  if (!p.deterministic || HasWindow(p) || sm90::HasSegmentIds(p) || sm90::BwdSm90SplitsD(tile)) {
    return false;
  }
  const int64_t n = NumNBlocks(p), sms = dev.sm_count;
  return n >= 2 && n <= sm90::BwdSm90FullTileIters(p.seqlen_q, p.group_size, tile.block_m) &&
         n <= sms && sms % n <= sms / 8;
}

BwdSm90Grid PlanGrid(const FlashParams& p, const DeviceInfo& dev, int num_tiles,
                     bool allow_stream_k) {
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  if (RotatesDqOrder(p, dev)) {
    // Rounds of whole groups (a persistent walk; no stream-K).
    const int per_round = static_cast<int>(dev.sm_count / NumNBlocks(p) * NumNBlocks(p));
    return BwdSm90Grid{std::min(num_tiles, per_round), num_tiles, 0, true};
  }
  // A persistent grid (BwdSm90Tile::persistent) only without a mask: masked
  // tiles differ in length, and one CTA per tile lets the hardware balance
  // them.
  const bool masked = HasWindow(p) || sm90::HasSegmentIds(p);  // segment ids: uneven tiles too
  const int sms = dev.sm_count;
  BwdSm90Grid grid{tile.persistent && !masked ? std::min(num_tiles, sms) : num_tiles, num_tiles,
                   0};
  // Stream-K needs BwdSm90Kernel (the D-split kernel has no stream-K walk),
  // tiles of one length (no mask), more tiles than SMs (so that every CTA's
  // range covers a whole tile), a partial last round, tiles of two
  // iterations or more to cut, and any dQ order (a CTA's pieces would add
  // their dQ out of the deterministic order: Sm90BackwardDqTurns).
  const int64_t iters = sm90::BwdSm90FullTileIters(p.seqlen_q, p.group_size, tile.block_m);
  if (!allow_stream_k || p.deterministic || sm90::BwdSm90SplitsD(tile) || masked || sms <= 0 ||
      num_tiles <= sms || num_tiles % sms == 0 || iters < 2) {
    return grid;
  }
  grid.sk_ctas = sms;
  grid.sk_first_tile = (num_tiles / sms - 1) * sms;
  grid.num_ctas = tile.persistent ? sms : grid.sk_first_tile + sms;
  return grid;
}

// Tiles (key blocks x B x K); Sm90BackwardSupports keeps them within an int.
int64_t NumTiles(const FlashParams& p) { return NumNBlocks(p) * p.batch * p.num_heads_kv; }

// The segment-id summaries (segments.cuh): chunks of block_m query rows and
// 64 keys (a consumer warpgroup's, the D-split tile's).
sm90::SegmentScratch SegmentLayout(const FlashParams& p) {
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  return sm90::SegmentScratchLayout(p, tile.block_m, 64, 1, tile.block_n / 64);
}

}  // namespace

int64_t Sm90BackwardStreamKSlots(const FlashParams& p, const DeviceInfo& dev) {
  if (!Sm90BackwardSupports(p)) return 0;
  if (sm90::HasSegmentIds(p)) {
    // No stream-K with segment ids (their tiles differ in length): the
    // slots' fp32 area holds the segment summaries instead.
    const size_t slot_bytes = sm90::BwdSm90SlotFloats(p.head_dim) * sizeof(float);
    return static_cast<int64_t>((SegmentLayout(p).bytes + slot_bytes - 1) / slot_bytes);
  }
  return PlanGrid(p, dev, static_cast<int>(NumTiles(p)), true).sk_ctas;
}

int64_t Sm90BackwardDqTurns(const FlashParams& p) {
  return p.deterministic ? p.batch * p.num_heads_q * ((p.seqlen_q + 63) / 64) : 0;
}

bool Sm90BackwardSupports(const FlashParams& p) {
  // d_o, dq, dk, dv: 16-byte aligned like q, k, v, o. Tiles (key blocks x B
  // x K) and the deterministic counters' indices counted in an int.
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return false;
  return tile.head_dim != 0 && sm90::Sm90CommonSupports(p) &&
         Sm90BackwardUnservedOption(p) == nullptr &&
         Aligned16({p.d_o, p.dq, p.dk, p.dv}) && NumTiles(p) <= INT32_MAX &&
         Sm90BackwardDqTurns(p) <= INT32_MAX;
}

cudaError_t RunBackwardSm90(const FlashParams& p, const BwdScratchPtrs& s, const DeviceInfo& dev,
                            cudaStream_t stream) {
  // One dQ accumulator (dq_splits == 1); deterministic calls with their
  // counters (none when T = 0).
  if (!Sm90BackwardSupports(p) || dev.cc_major != 9 || s.dq_splits != 1 ||
      (Sm90BackwardDqTurns(p) > 0 && s.dq_turns == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const BwdSm90Tile tile = sm90::BwdSm90TileFor(p.head_dim);
  const int smem_bytes = sm90::BwdSm90SplitsD(tile) && sm90::HasSm90ScoreOptions(p)
                             ? sm90::BwdSm90DSplitSmem::kOptionsSmemBytes
                             : sm90::BwdSm90SmemBytes(tile);
  if (static_cast<size_t>(smem_bytes) > dev.max_smem_per_block_optin) {
    return cudaErrorInvalidValue;
  }
  // Nothing to compute; RunBackward returns before this, but a tensor map
  // cannot have a zero extent either.
  if (p.batch * p.num_heads_q * p.seqlen_k == 0) return cudaSuccess;
  const sm90::EncodeTiledFn encode = sm90::GetEncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;

  BwdSm90Args args;
  args.p = p;
  args.units = sm90::MakeSm90ScoreUnits(p);
  args.lse2 = s.lse2;
  args.dvec = s.dvec;
  args.dq_acc = s.dq_acc;
  args.t_pad = s.t_pad;
  args.num_n_blocks = static_cast<int>(NumNBlocks(p));
  args.num_tiles = static_cast<int>(NumTiles(p));
  // Stream-K only with its slots in the scratch.
  const BwdSm90Grid probe = PlanGrid(p, dev, args.num_tiles, true);
  const BwdSm90Grid grid =
      probe.sk_ctas <= s.sk_slots ? probe : PlanGrid(p, dev, args.num_tiles, false);
  args.sk_first_tile = grid.sk_first_tile;
  args.sk_ctas = grid.sk_ctas;
  args.sk_flags = s.sk_flags;
  args.sk_partial = s.sk_partial;
  if (p.deterministic) {
    args.dq_turns = s.dq_turns;
    args.num_q_blocks = static_cast<int>((p.seqlen_q + tile.block_m - 1) / tile.block_m);
    args.key_block_flip = args.num_n_blocks - 1;
    args.rotated_dq = grid.rotated_dq;
  }
  const int num_ctas = grid.num_ctas;
  cudaError_t err = cudaSuccess;
  // T == 0: no query block is visited (QueryRange is empty), so the Q, dO and
  // dQ maps stay zeroed (unused) and the kernel writes dK = dV = 0.
  if (p.seqlen_q > 0) {
    err = sm90::EncodeTensorMap(&args.tma_q, encode, p.dtype, p.q, p.batch, p.seqlen_q,
                                p.num_heads_q, p.head_dim, p.q_batch_stride, p.q_row_stride,
                                p.q_head_stride, tile.block_m, &args.q_heads_inner);
    if (err == cudaSuccess) {
      err = sm90::EncodeTensorMap(&args.tma_do, encode, p.dtype, p.d_o, p.batch, p.seqlen_q,
                                  p.num_heads_q, p.head_dim, p.o_batch_stride, p.o_row_stride,
                                  p.o_head_stride, tile.block_m, &args.do_heads_inner);
    }
    if (err == cudaSuccess) {
      err = sm90::EncodeDqAccTensorMap(&args.tma_dq, encode, s.dq_acc, p.batch, p.seqlen_q,
                                       p.num_heads_q, p.head_dim, /*box_rows=*/64);
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
  // dK and dV leave through TMA stores, a consumer warpgroup's 64 keys each.
  if (err == cudaSuccess) {
    err = sm90::EncodeTensorMap(&args.tma_dk, encode, p.dtype, p.dk, p.batch, p.seqlen_k,
                                p.num_heads_kv, p.head_dim, p.k_batch_stride, p.k_row_stride,
                                p.k_head_stride, 64, &args.kv_grad_heads_inner);
  }
  if (err == cudaSuccess) {
    err = sm90::EncodeTensorMap(&args.tma_dv, encode, p.dtype, p.dv, p.batch, p.seqlen_k,
                                p.num_heads_kv, p.head_dim, p.k_batch_stride, p.k_row_stride,
                                p.k_head_stride, 64, &args.kv_grad_heads_inner);
  }
  if (err == cudaSuccess && sm90::HasSegmentIds(p)) {
    const size_t slot_bytes = sm90::BwdSm90SlotFloats(p.head_dim) * sizeof(float);
    if (s.sk_partial == nullptr ||
        static_cast<size_t>(s.sk_slots) * slot_bytes < SegmentLayout(p).bytes) {
      return cudaErrorInvalidValue;
    }
    err = sm90::RunSegmentPrepass(p, tile.block_m, 64, 1, tile.block_n / 64, s.sk_partial,
                                  dev.sm_count, &args.seg, stream);
  }
  if (err != cudaSuccess) return err;
  switch (p.dtype) {
    case DType::kFloat16: return LaunchForHeadDim<__half>(args, num_ctas, stream);
    case DType::kBFloat16: return LaunchForHeadDim<__nv_bfloat16>(args, num_ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
