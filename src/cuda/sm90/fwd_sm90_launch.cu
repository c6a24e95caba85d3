// Host side of the Hopper forward: what it supports, the tensor maps (encoded
// through the driver entry point the runtime hands out, so nothing links
// libcuda), and the launch with its runtime -> template dispatch.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../../flash_mask.h"
#include "fwd_sm90.h"
#include "fwd_sm90_kernel.cuh"
#include "segments.cuh"
#include "tensor_map.h"

namespace jax_flash2::cuda {
namespace {

using sm90::FwdSm90Args;
using sm90::FwdSm90Launch;
using sm90::FwdSm90Tile;
using sm90::EncodeTensorMap;
using sm90::EncodeTiledFn;
using sm90::GetEncodeTiled;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Row kIndex as the package builds it: its table schedule only, its
// persistent form only where the row ever runs it, and its one-tile form
// only where it does not always run the persistent one (which then also
// serves grids of one block per tile).
template <typename Elem, int kIndex>
cudaError_t LaunchPackageTile(const FwdSm90Launch& launch, cudaStream_t stream) {
  using Row = sm90::FwdSm90TableTile<kIndex>;
  constexpr FwdSm90Tile tile = Row::kTile;
  if constexpr (!sm90::FwdSm90AlwaysPersistent(tile)) {
    if (launch.grid_blocks == launch.args.num_tiles) {
      return sm90::LaunchFwdSm90<Elem, Row, tile.schedule, false>(launch, stream);
    }
  }
  if constexpr (sm90::FwdSm90EverPersistent(tile)) {
    return sm90::LaunchFwdSm90<Elem, Row, tile.schedule, true>(launch, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename Elem>
cudaError_t LaunchPackage(const FwdSm90Launch& launch, int tile_index, cudaStream_t stream) {
  switch (tile_index) {
    case 0: return LaunchPackageTile<Elem, 0>(launch, stream);
    case 1: return LaunchPackageTile<Elem, 1>(launch, stream);
    case 2: return LaunchPackageTile<Elem, 2>(launch, stream);
    case 3: return LaunchPackageTile<Elem, 3>(launch, stream);
    case 4: return LaunchPackageTile<Elem, 4>(launch, stream);
    case 5: return LaunchPackageTile<Elem, 5>(launch, stream);
    default: return cudaErrorInvalidValue;
  }
}
static_assert(sm90::kFwdSm90NumTiles == 6, "LaunchPackage dispatches every tile");

// Whether p counts as masked for the tile and grid choice. Segment ids do:
// their tiles differ in length, and their diagonal-like blocks (document
// edges) pay a per-element test, as the masked rows' 128-key blocks are
// chosen for.
bool Masked(const FlashParams& p) { return HasWindow(p) || sm90::HasSegmentIds(p); }

// The key count the tile and the grid are chosen for. With segment ids a
// tile sees its documents' keys only, which the host cannot read: plan as
// for at most 2048 keys, where every head dim's masked row that has a
// persistent form runs it, since the persistent grid draws segment calls'
// tiles as they finish (fwd_sm90_kernel.cuh) and hides each tile's start
// under the previous one's end; fewer where the caller bounds the segments'
// key counts (max_segment_keys), so that rows of short documents take the
// tile their documents would take as a batch.
int64_t PlanKeys(const FlashParams& p) {
  if (!sm90::HasSegmentIds(p)) return p.seqlen_k;
  const int64_t keys = std::min<int64_t>(p.seqlen_k, 2048);
  return p.max_segment_keys > 0 ? std::min(keys, p.max_segment_keys) : keys;
}

// The grid of a call, shared by the scratch size and the launch so that they
// cannot disagree.
struct FwdSm90Plan {
  FwdSm90Tile tile{};
  int num_m_blocks = 0;
  int num_tiles = 0;
  int grid_blocks = 0;
  int sk_first_tile = 0;  // == num_tiles: no stream-K pieces
  int sk_blocks_per_tile = 0;
};

FwdSm90Plan MakePlan(const FlashParams& p, const DeviceInfo& dev, const FwdSm90Tile& tile,
                     sm90::FwdSm90Choice choice) {
  FwdSm90Plan plan;
  plan.tile = tile;
  plan.num_m_blocks = static_cast<int>(CeilDiv(p.seqlen_q, tile.block_m));
  plan.num_tiles = static_cast<int>(plan.num_m_blocks * p.num_heads_q * p.batch);
  // Persistent (one block per SM, each walking tiles in rounds; see the
  // kernel) when the tiles are short, so that the start of one (Q and the
  // first K/V loads) hides under the end of the previous one: up to the
  // tile's persistent_keys_* (fwd_sm90.h). Measured on the H200:
  // +14-19% at T = S = 512, causal or not; D 64 at S = 2048 without a mask
  // 1-3% slower than a block per tile.
  const bool persistent = choice.persistent >= 0
                              ? choice.persistent == 1
                              : sm90::FwdSm90Persistent(tile, Masked(p), PlanKeys(p));
  plan.grid_blocks =
      persistent ? static_cast<int>(std::min<int64_t>(plan.num_tiles, dev.sm_count))
                 : plan.num_tiles;
  plan.sk_first_tile = plan.num_tiles;
  // Stream-K for the last two rounds when the tiles do not fill whole rounds
  // (without a mask, where every tile has the same key blocks). Two rounds
  // give each block at least a tile's worth of key blocks, so a tile is cut
  // at most once. Measured on the H200 (sm90_fwd_selftest --grid):
  // B8 T=S=2048 H16 D128 575 -> 581 TFLOP/s, B4 T 4096 611 -> 616-626.
  const int grid = plan.grid_blocks;
  if (persistent && choice.stream_k != 0 && !Masked(p) && p.seqlen_k > 0 &&
      plan.num_tiles > grid && plan.num_tiles % grid != 0) {
    plan.sk_first_tile = (plan.num_tiles / grid - 1) * grid;
    plan.sk_blocks_per_tile = static_cast<int>(CeilDiv(p.seqlen_k, tile.block_n));
  }
  return plan;
}

// Scratch of a stream-K plan: the flag pairs (padded to 256 bytes), then the
// partial state, both per (cut tile, consumer warpgroup); a cut tile per
// boundary between two blocks' ranges, so at most one per block.
size_t PieceSlots(const FwdSm90Plan& plan) {
  return static_cast<size_t>(plan.grid_blocks) * sm90::FwdSm90ConsumerWarpgroups(plan.tile);
}

size_t FlagBytes(const FwdSm90Plan& plan) {
  return (PieceSlots(plan) * 2 * sizeof(int) + 255) / 256 * 256;
}

size_t StreamKScratchBytes(const FwdSm90Plan& plan) {
  if (plan.sk_first_tile >= plan.num_tiles) return 0;
  const size_t partial_floats =
      sm90::FwdSm90PiecePartialRegs(plan.tile.head_dim) * 128;  // per thread
  return FlagBytes(plan) + PieceSlots(plan) * partial_floats * sizeof(float);
}

// The segment-id summaries (segments.cuh): chunks of 64 query rows (a
// consumer warpgroup's) and of the tile's block_n keys.
sm90::SegmentScratch SegmentLayout(const FlashParams& p, const FwdSm90Plan& plan) {
  return sm90::SegmentScratchLayout(p, 64, plan.tile.block_n, plan.tile.block_m / 64, 1);
}

// The stream-K part, then (256-byte aligned) the segment part.
size_t SegmentScratchOffset(const FwdSm90Plan& plan) {
  return (StreamKScratchBytes(plan) + 255) / 256 * 256;
}

size_t PlanScratchBytes(const FlashParams& p, const FwdSm90Plan& plan) {
  const size_t seg = SegmentLayout(p, plan).bytes;
  return seg > 0 ? SegmentScratchOffset(plan) + seg : StreamKScratchBytes(plan);
}

}  // namespace

int sm90::FwdSm90PackageTileIndex(const FlashParams& p) {
  return sm90::FwdSm90TileIndex(p.head_dim, Masked(p), PlanKeys(p));
}

size_t sm90::Sm90ForwardScratchBytesFor(const FlashParams& p, const DeviceInfo& dev,
                                        const FwdSm90Tile& tile, sm90::FwdSm90Choice choice) {
  if (!Sm90ForwardSupports(p) || p.batch * p.seqlen_q * p.num_heads_q == 0) return 0;
  return PlanScratchBytes(p, MakePlan(p, dev, tile, choice));
}

size_t Sm90ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  const int tile_index = sm90::FwdSm90PackageTileIndex(p);
  if (tile_index < 0) return 0;
  return sm90::Sm90ForwardScratchBytesFor(p, dev, sm90::kFwdSm90TileTable[tile_index], {});
}

bool Sm90ForwardSupports(const FlashParams& p) {
  // One grid dimension of tiles (m-blocks x H x B; 128 rows bounds every tile).
  const int64_t tiles = CeilDiv(p.seqlen_q, 128) * p.num_heads_q * p.batch;
  // Segment ids come in pairs (q and kv), or not at all.
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return false;
  return sm90::FwdSm90PackageTileIndex(p) >= 0 && sm90::Sm90CommonSupports(p) &&
         tiles < (int64_t{1} << 31);
}

cudaError_t RunForwardSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                           cudaStream_t stream) {
  const int tile_index = sm90::FwdSm90PackageTileIndex(p);
  if (tile_index < 0) return cudaErrorInvalidValue;
  FwdSm90Launch launch;
  const cudaError_t err = sm90::PrepareForwardSm90(
      p, scratch, dev, stream, sm90::kFwdSm90TileTable[tile_index], {}, &launch);
  if (err != cudaSuccess || launch.grid_blocks == 0) return err;
  switch (p.dtype) {
    case DType::kFloat16: return LaunchPackage<__half>(launch, tile_index, stream);
    case DType::kBFloat16: return LaunchPackage<__nv_bfloat16>(launch, tile_index, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t sm90::PrepareForwardSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                                     cudaStream_t stream, const FwdSm90Tile& tile,
                                     sm90::FwdSm90Choice choice, FwdSm90Launch* launch) {
  launch->grid_blocks = 0;
  if (!Sm90ForwardSupports(p) || dev.cc_major != 9) return cudaErrorInvalidValue;
  const FwdSm90Plan plan = MakePlan(p, dev, tile, choice);
  if (tile.head_dim != sm90::Sm90HeadDimBucket(p.head_dim)) return cudaErrorInvalidValue;
  if (sm90::HasSegmentIds(p) && !tile.masked) return cudaErrorInvalidValue;  // no segment code
  if (static_cast<size_t>(sm90::FwdSm90SmemBytes(tile)) > dev.max_smem_per_block_optin) {
    return cudaErrorInvalidValue;
  }
  if (p.batch * p.seqlen_q * p.num_heads_q == 0) return cudaSuccess;  // nothing to write
  const EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;

  FwdSm90Args args;
  args.p = p;
  args.units = sm90::MakeSm90ScoreUnits(p);
  args.num_m_blocks = plan.num_m_blocks;
  args.num_tiles = plan.num_tiles;
  args.sk_first_tile = plan.sk_first_tile;
  args.sk_blocks_per_tile = plan.sk_blocks_per_tile;
  const int grid_blocks = plan.grid_blocks;
  if (plan.sk_first_tile < plan.num_tiles) {
    if (scratch == nullptr) return cudaErrorInvalidValue;
    args.sk_flags = static_cast<int*>(scratch);
    args.sk_partial = reinterpret_cast<float*>(static_cast<char*>(scratch) + FlagBytes(plan));
  }
  cudaError_t err = EncodeTensorMap(&args.tma_q, encode, p.dtype, p.q, p.batch, p.seqlen_q,
                                    p.num_heads_q, p.head_dim, p.q_batch_stride,
                                    p.q_row_stride, p.q_head_stride, tile.block_m,
                                    &args.q_heads_inner);
  // S == 0: every row sees no key; the kernel loads nothing (not even Q) and
  // writes O = 0, LSE = -inf. A map cannot have a zero extent, so the K/V maps
  // stay zeroed (unused) then.
  const int64_t kv_rows = p.seqlen_k;
  if (err == cudaSuccess && kv_rows > 0) {
    err = EncodeTensorMap(&args.tma_k, encode, p.dtype, p.k, p.batch, kv_rows, p.num_heads_kv,
                          p.head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                          tile.block_n, &args.k_heads_inner);
  }
  if (err == cudaSuccess && kv_rows > 0) {
    err = EncodeTensorMap(&args.tma_v, encode, p.dtype, p.v, p.batch, kv_rows, p.num_heads_kv,
                          p.head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                          tile.block_n, &args.v_heads_inner);
  }
  if (err == cudaSuccess) {  // O leaves through shared memory and TMA stores
    err = EncodeTensorMap(&args.tma_o, encode, p.dtype, p.o, p.batch, p.seqlen_q, p.num_heads_q,
                          p.head_dim, p.o_batch_stride, p.o_row_stride, p.o_head_stride, 64,
                          &args.o_heads_inner);
  }
  if (err == cudaSuccess && args.sk_flags != nullptr) {
    err = cudaMemsetAsync(args.sk_flags, 0, FlagBytes(plan), stream);  // the pieces' flags
  }
  if (err == cudaSuccess && sm90::HasSegmentIds(p)) {
    if (scratch == nullptr) return cudaErrorInvalidValue;
    err = sm90::RunSegmentPrepass(p, 64, tile.block_n, tile.block_m / 64, 1,
                                  static_cast<char*>(scratch) + SegmentScratchOffset(plan),
                                  dev.sm_count, &args.seg, stream);
    args.seg_heads_inner = GetTestSwitches().segment_heads_inner;
  }
  if (err != cudaSuccess) return err;
  launch->args = args;
  launch->grid_blocks = grid_blocks;
  return cudaSuccess;
}

}  // namespace jax_flash2::cuda
