// Host side of the Hopper forward: what it supports, the tensor maps (encoded
// through the driver entry point the runtime hands out, so nothing links
// libcuda), and the launch with its runtime -> template dispatch.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../../flash_mask.h"
#include "../smem_optin.h"
#include "fwd_sm90.h"
#include "fwd_sm90_kernel.cuh"
#include "segments.cuh"
#include "tensor_map.h"

#ifndef JF2_SM90_ALL_SCHEDULES
#define JF2_SM90_ALL_SCHEDULES 0
#endif

namespace jax_flash2::cuda {
namespace {

using sm90::FwdSm90Args;
using sm90::FwdSm90Tile;
using sm90::Sm90Schedule;
using sm90::EncodeTensorMap;
using sm90::EncodeTiledFn;
using sm90::GetEncodeTiled;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename Elem, int kTileIndex, Sm90Schedule kSchedule, bool kPersistent,
          bool kScoreOptions>
cudaError_t LaunchFwdSm90Kernel(const FwdSm90Args& args, int grid_blocks, cudaStream_t stream) {
  constexpr FwdSm90Tile tile = sm90::kFwdSm90TileTable[kTileIndex];
  constexpr int smem_bytes = sm90::FwdSm90SmemBytes(tile);
  const auto kernel =
      &sm90::FwdSm90Kernel<Elem, kTileIndex, kSchedule, kPersistent, kScoreOptions>;
  static std::atomic<uint64_t> opted_in{0};
  const cudaError_t err =
      OptInSharedMemoryOnce(reinterpret_cast<const void*>(kernel), opted_in, smem_bytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid_blocks, sm90::FwdSm90Threads(tile), smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

// The kernel with or without the score options (its template flag).
template <typename Elem, int kTileIndex, Sm90Schedule kSchedule, bool kPersistent>
cudaError_t LaunchFwdSm90(const FwdSm90Args& args, int grid_blocks, cudaStream_t stream) {
  if (sm90::HasSm90ScoreOptions(args.p)) {
    return LaunchFwdSm90Kernel<Elem, kTileIndex, kSchedule, kPersistent, true>(args, grid_blocks,
                                                                                stream);
  }
  return LaunchFwdSm90Kernel<Elem, kTileIndex, kSchedule, kPersistent, false>(args, grid_blocks,
                                                                               stream);
}

// The package builds each tile with its table row's schedule only, its
// persistent form only where the row ever runs it, and its one-tile form
// only where it does not always run the persistent one (which then also
// serves grids of one block per tile).
template <typename Elem, int kTileIndex, Sm90Schedule kSchedule>
cudaError_t LaunchForGrid(const FwdSm90Args& args, int grid_blocks, cudaStream_t stream) {
  constexpr FwdSm90Tile tile = sm90::kFwdSm90TileTable[kTileIndex];
  constexpr bool kBuilt = JF2_SM90_ALL_SCHEDULES || tile.schedule == kSchedule;
  constexpr bool kBuiltPersistent =
      kBuilt && (JF2_SM90_ALL_SCHEDULES || sm90::FwdSm90EverPersistent(tile));
  constexpr bool kBuiltOneTile =
      kBuilt && (JF2_SM90_ALL_SCHEDULES || !sm90::FwdSm90AlwaysPersistent(tile));
  if constexpr (kBuiltOneTile) {
    if (grid_blocks == args.num_tiles) {
      return LaunchFwdSm90<Elem, kTileIndex, kSchedule, false>(args, grid_blocks, stream);
    }
  }
  if constexpr (kBuiltPersistent) {
    return LaunchFwdSm90<Elem, kTileIndex, kSchedule, true>(args, grid_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename Elem, Sm90Schedule kSchedule>
cudaError_t LaunchForTile(const FwdSm90Args& args, int tile_index, int grid_blocks,
                          cudaStream_t stream) {
  switch (tile_index) {
    case 0: return LaunchForGrid<Elem, 0, kSchedule>(args, grid_blocks, stream);
    case 1: return LaunchForGrid<Elem, 1, kSchedule>(args, grid_blocks, stream);
    case 2: return LaunchForGrid<Elem, 2, kSchedule>(args, grid_blocks, stream);
    case 3: return LaunchForGrid<Elem, 3, kSchedule>(args, grid_blocks, stream);
    case 4: return LaunchForGrid<Elem, 4, kSchedule>(args, grid_blocks, stream);
#if JF2_SM90_ALL_SCHEDULES
    case 5: return LaunchForGrid<Elem, 5, kSchedule>(args, grid_blocks, stream);
    case 6: return LaunchForGrid<Elem, 6, kSchedule>(args, grid_blocks, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}
static_assert(sm90::kFwdSm90NumTiles == 7, "LaunchForTile dispatches every tile");

template <typename Elem>
cudaError_t LaunchForSchedule(const FwdSm90Args& args, int tile_index, int grid_blocks,
                              Sm90Schedule schedule, cudaStream_t stream) {
  switch (schedule) {
    case Sm90Schedule::kOverlap:
      return LaunchForTile<Elem, Sm90Schedule::kOverlap>(args, tile_index, grid_blocks, stream);
    case Sm90Schedule::kPingpong:
      return LaunchForTile<Elem, Sm90Schedule::kPingpong>(args, tile_index, grid_blocks, stream);
#if JF2_SM90_ALL_SCHEDULES
    case Sm90Schedule::kSerial:
      return LaunchForTile<Elem, Sm90Schedule::kSerial>(args, tile_index, grid_blocks, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

// The package's tile for p (a row of kFwdSm90TileTable), or -1.
// Segment ids count as a mask: their tiles differ in length, and their
// diagonal-like blocks (document edges) pay a per-element test, as the
// masked rows' 128-key blocks are chosen for.
bool Masked(const FlashParams& p) { return HasWindow(p) || sm90::HasSegmentIds(p); }

int PackageTileIndex(const FlashParams& p) {
  return sm90::FwdSm90TileIndex(p.head_dim, Masked(p), p.seqlen_k);
}

// The grid of a call, shared by the scratch size and the launch so that they
// cannot disagree.
struct FwdSm90Plan {
  int tile_index = -1;
  int num_m_blocks = 0;
  int num_tiles = 0;
  int grid_blocks = 0;
  int sk_first_tile = 0;  // == num_tiles: no stream-K pieces
  int sk_blocks_per_tile = 0;
};

FwdSm90Plan MakePlan(const FlashParams& p, const DeviceInfo& dev, sm90::FwdSm90Choice choice) {
  FwdSm90Plan plan;
  plan.tile_index = choice.tile >= 0 ? choice.tile : PackageTileIndex(p);
  if (plan.tile_index < 0 || plan.tile_index >= sm90::kFwdSm90NumTiles) {
    plan.tile_index = -1;
    return plan;
  }
  const FwdSm90Tile tile = sm90::kFwdSm90TileTable[plan.tile_index];
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
                              : sm90::FwdSm90Persistent(tile, Masked(p), p.seqlen_k);
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
  const FwdSm90Tile tile = sm90::kFwdSm90TileTable[plan.tile_index];
  return static_cast<size_t>(plan.grid_blocks) * sm90::FwdSm90ConsumerWarpgroups(tile);
}

size_t FlagBytes(const FwdSm90Plan& plan) {
  return (PieceSlots(plan) * 2 * sizeof(int) + 255) / 256 * 256;
}

size_t StreamKScratchBytes(const FwdSm90Plan& plan) {
  if (plan.tile_index < 0 || plan.sk_first_tile >= plan.num_tiles) return 0;
  const int head_dim = sm90::kFwdSm90TileTable[plan.tile_index].head_dim;
  const size_t partial_floats = sm90::FwdSm90PiecePartialRegs(head_dim) * 128;  // per thread
  return FlagBytes(plan) + PieceSlots(plan) * partial_floats * sizeof(float);
}

// The segment-id summaries (segments.cuh): chunks of 64 query rows (a
// consumer warpgroup's) and of the tile's block_n keys.
sm90::SegmentScratch SegmentLayout(const FlashParams& p, const FwdSm90Plan& plan) {
  if (plan.tile_index < 0) return {};
  const FwdSm90Tile tile = sm90::kFwdSm90TileTable[plan.tile_index];
  return sm90::SegmentScratchLayout(p, 64, tile.block_n, tile.block_m / 64, 1);
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

size_t sm90::Sm90ForwardScratchBytesFor(const FlashParams& p, const DeviceInfo& dev,
                                        sm90::FwdSm90Choice choice) {
  if (!Sm90ForwardSupports(p) || p.batch * p.seqlen_q * p.num_heads_q == 0) return 0;
  return PlanScratchBytes(p, MakePlan(p, dev, choice));
}

size_t Sm90ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  return sm90::Sm90ForwardScratchBytesFor(p, dev, {});
}

bool Sm90ForwardSupports(const FlashParams& p) {
  // One grid dimension of tiles (m-blocks x H x B; 128 rows bounds every tile).
  const int64_t tiles = CeilDiv(p.seqlen_q, 128) * p.num_heads_q * p.batch;
  // Segment ids come in pairs (q and kv), or not at all.
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return false;
  return PackageTileIndex(p) >= 0 && sm90::Sm90CommonSupports(p) &&
         tiles < (int64_t{1} << 31);
}

cudaError_t RunForwardSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                           cudaStream_t stream) {
  sm90::FwdSm90Choice choice;
  choice.tile = PackageTileIndex(p);
  if (choice.tile < 0) return cudaErrorInvalidValue;
  return sm90::RunForwardSm90Schedule(p, scratch, dev, stream,
                                      sm90::kFwdSm90TileTable[choice.tile].schedule, choice);
}

cudaError_t sm90::RunForwardSm90Schedule(const FlashParams& p, void* scratch,
                                         const DeviceInfo& dev, cudaStream_t stream,
                                         Sm90Schedule schedule, sm90::FwdSm90Choice choice) {
  if (!Sm90ForwardSupports(p) || dev.cc_major != 9) return cudaErrorInvalidValue;
  const FwdSm90Plan plan = MakePlan(p, dev, choice);
  const int tile_index = plan.tile_index;
  if (tile_index < 0) return cudaErrorInvalidValue;
  const FwdSm90Tile tile = sm90::kFwdSm90TileTable[tile_index];
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
  }
  if (err != cudaSuccess) return err;
  switch (p.dtype) {
    case DType::kFloat16:
      return LaunchForSchedule<__half>(args, tile_index, grid_blocks, schedule, stream);
    case DType::kBFloat16:
      return LaunchForSchedule<__nv_bfloat16>(args, tile_index, grid_blocks, schedule, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
