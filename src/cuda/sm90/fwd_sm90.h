// Hopper (sm_90a) forward: host interface, tile table and the kernel's
// argument block. Built as its own library for sm_90a only (CMakeLists.txt);
// RunForward (fwd_launch.cu) calls it on cc 9.0 devices when
// Sm90ForwardSupports(p) holds and the call needs neither split-KV nor GQA
// packing, and runs the sm80 kernels otherwise.
#pragma once

#include <cuda.h>  // CUtensorMap (type only)
#include <cuda_runtime.h>

#include <cstdint>

#include "../../flash_params.h"
#include "../flash_cuda.h"
#include "head_dim.h"
#include "segments.h"
#include "score_options.h"

namespace jax_flash2::cuda {

// True when the Hopper forward can serve p: bf16/fp16, D <= 256 (run by the
// tile of D's bucket, 64, 128 or 256: head_dim.h), only the score options
// src/sm90_options.h lists (softcap, ALiBi, segment ids in pairs), every stride
// a multiple of 8 elements and
// every pointer 16-byte aligned (TMA), sizes within the grid and tensor-map
// limits. Split-KV and GQA packing for decode are not implemented here: such
// calls still run (one block per 128 query rows), but the dispatcher sends
// them to the decode kernel or the sm80 split-KV path, which serve them better.
bool Sm90ForwardSupports(const FlashParams& p);

// Bytes of scratch RunForwardSm90 needs for p on dev (the stream-K pieces'
// partial O and their flags; 0 when the call runs none).
size_t Sm90ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev);

// Runs the forward on the current device (must be cc 9.0). `scratch` holds
// Sm90ForwardScratchBytes(p, dev) bytes (may be null when that is 0). Returns
// cudaErrorInvalidValue when !Sm90ForwardSupports(p), and the driver's error
// (as cudaErrorInvalidValue) when a tensor map cannot be encoded.
cudaError_t RunForwardSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                           cudaStream_t stream);

namespace sm90 {
// Consumer schedules (a kernel template argument; see fwd_sm90_kernel.cuh).
// All three pass the self-test on the H200; the package builds each tile
// with the schedule of its table row only, the self-test all three
// (tests/cuda/sm90_fwd_variants.cuh), for timing and for localising a
// failure.
//   kSerial:   S -> softmax -> PV per key block. The simplest.
//   kOverlap:  S_{n-1} = Q K_{n-1}^T and O += P_n V_n issued back to back; the
//              softmax of block n-1 runs while the PV product executes
//              (FlashAttention-3's intra-warpgroup overlap). Fastest at most
//              shapes measured (619 vs 596 serial and 613 pingpong TFLOP/s at
//              B4 T=S=4096 H16 D128).
//   kPingpong: kOverlap, plus the consumer warpgroups take turns issuing
//              their wgmmas (named barriers, round robin), so one's softmax
//              runs while another's products occupy the tensor cores. With
//              three warpgroups (D 64) 4-6% faster at T >= 2048; with two
//              (D 128) within 1-2% of kOverlap with one tile per block, and
//              2-8% faster in the persistent grid at S <= 4096 (8192 masked).
enum class Sm90Schedule : int { kSerial = 0, kOverlap = 1, kPingpong = 2 };

// Overrides of the plan's grid choices (-1: the package's rule), for the
// self-test's comparisons: 0 / 1 for the one-tile / persistent grid, and 0 /
// 1 for the persistent grid's last rounds without / with stream-K pieces.
struct FwdSm90Choice {
  int persistent = -1;
  int stream_k = -1;
};

// The kernel's tiles. block_m query rows per block, 64 per consumer
// warpgroup; block_n keys per pipeline stage. A row serves the calls of its
// head dim with a causal or window mask (`masked`) and / or without one
// (`unmasked`) whose S lies in [min_keys, max_keys]; FwdSm90TileIndex takes
// the first row that serves a call. Shared memory: Q (block_m x D) plus
// `stages` x (K + V) (block_n x D each), 2-byte elements:
//   D 64,  192 x 128: 24 KB + 3 x 32 KB = 120 KB
//   D 64,  128 x 128: 16 KB + 3 x 32 KB = 112 KB (S <= kFwdSm90ShortKeys)
//   D 128, 128 x 176: 32 KB + 2 x 88 KB = 208 KB (a third stage does not fit)
//   D 128, 128 x 128: 32 KB + 2 x 64 KB = 160 KB
//   D 256, 128 x 80:  64 KB + 2 x 80 KB = 224 KB
// Registers per consumer thread: S (block_n / 2 fp32) + O (D / 2 fp32) + P
// (block_n / 4 b32): 88 + 64 + 44 at D 128 x 176, within 240; 64 + 32 + 32
// at D 64, within the 160 that three consumer warpgroups leave; 40 + 128 +
// 20 at D 256 x 80.
// Why these (docs/design.md has the timings): at D 64 the softmax per key
// costs as much as the products, and a third consumer warpgroup gives the
// scheduler more independent work to hide it, except on sequences of at
// most 256 keys: there a sequence's last 192-row tile is mostly empty (T =
// S = 197: a second tile of 5 rows) and its idle warpgroups take their turns
// for nothing, so 128-row tiles run 10-30% faster; at D 128 a longer key block
// spreads each block's fixed costs (barrier waits, the row max and sum
// reductions, the O rescale) over more keys, but only from S > 4096: below,
// the last, partial 176-key block wastes about as much as that saves (128
// keys measured +3-5% at T = S = 2048). Masked calls (segment ids included)
// keep 128 keys: their diagonal blocks pay the per-element mask over the
// whole block.
//
// `schedule` is the consumer schedule the package builds the tile with, and
// `persistent_keys_*` the largest S (with / without a mask) at which it runs
// the persistent grid (one block per SM walking tiles; 0: never), whose
// blocks start each tile's loads under the previous tile's end. A row whose
// persistent range covers all it serves is built only in the persistent
// form, which also runs grids of one tile per block. Chosen with
// sm90_fwd_selftest --grid:
// - D 128, 128 keys: pingpong, persistent up to S = 8192 masked and 4096
//   unmasked (+3-8% causal at T = S = 2048-8192). Above that, the persistent
//   grid's fixed walk loses to the hardware's longest-first order of one
//   tile per block under a causal mask (25-30% at 16k), so masked calls
//   above S = 8192 run overlap in one tile per block (T 16k causal 645 vs
//   615 TFLOP/s pingpong), and unmasked ones the 176-key tile, pingpong.
// - D 64: pingpong (+1-5% over overlap from S = 1024). At S <= 256 the
//   two-warpgroup tile, pingpong, always persistent (`--filter short`).
// - D 256: 80-key blocks (the most that fit two stages beside Q), pingpong,
//   one tile per block (O staged in Q), masked or not: T 2048 689 TFLOP/s
//   against 636 overlap and 620 with 64-key blocks.
inline constexpr int64_t kAnyKeys = INT64_MAX;
// D 64 calls of at most this many keys (self-attention on short sequences)
// run 128-row tiles on two consumer warpgroups instead of 192 rows on three.
inline constexpr int64_t kFwdSm90ShortKeys = 256;

struct FwdSm90Tile {
  int head_dim;
  int block_m;
  int block_n;
  int stages;
  bool masked;
  bool unmasked;
  int64_t min_keys;
  int64_t max_keys;
  Sm90Schedule schedule;  // the package's
  int64_t persistent_keys_masked;
  int64_t persistent_keys_unmasked;
};

inline constexpr FwdSm90Tile kFwdSm90TileTable[] = {
    // D, block_m x block_n, stages; masked, unmasked, S range; schedule;
    // persistent up to S (masked, unmasked).
    {64, 192, 128, 3, true, true, kFwdSm90ShortKeys + 1, kAnyKeys, Sm90Schedule::kPingpong, 2048,
     1024},
    {128, 128, 176, 2, false, true, 4096 + 1, kAnyKeys, Sm90Schedule::kPingpong, 0, 0},
    {128, 128, 128, 2, true, false, 8192 + 1, kAnyKeys, Sm90Schedule::kOverlap, 0, 0},
    {128, 128, 128, 2, true, true, 0, kAnyKeys, Sm90Schedule::kPingpong, 8192, 4096},
    {256, 128, 80, 2, true, true, 0, kAnyKeys, Sm90Schedule::kPingpong, 0, 0},
    {64, 128, 128, 3, true, true, 0, kFwdSm90ShortKeys, Sm90Schedule::kPingpong,
     kFwdSm90ShortKeys, kFwdSm90ShortKeys},
};
inline constexpr int kFwdSm90NumTiles = sizeof(kFwdSm90TileTable) / sizeof(FwdSm90Tile);

// A tile as a type, the kernel's template argument: row kIndex of the table
// here (the self-test passes rows of its own).
template <int kIndex>
struct FwdSm90TableTile {
  static constexpr FwdSm90Tile kTile = kFwdSm90TileTable[kIndex];
};

// Whether the package runs tile t's persistent grid for a call; whether it
// ever does; whether it always does (then only that form is built).
constexpr bool FwdSm90Persistent(const FwdSm90Tile& t, bool masked, int64_t seqlen_k) {
  const int64_t limit = masked ? t.persistent_keys_masked : t.persistent_keys_unmasked;
  return limit > 0 && seqlen_k <= limit;
}
constexpr bool FwdSm90EverPersistent(const FwdSm90Tile& t) {
  return t.persistent_keys_masked > 0 || t.persistent_keys_unmasked > 0;
}
constexpr bool FwdSm90AlwaysPersistent(const FwdSm90Tile& t) {
  return (!t.masked || t.persistent_keys_masked >= t.max_keys) &&
         (!t.unmasked || t.persistent_keys_unmasked >= t.max_keys);
}

// The first row serving a call of this head dim, mask and key count, or -1.
constexpr int FwdSm90TileIndex(int64_t head_dim, bool masked, int64_t seqlen_k) {
  const int64_t bucket = Sm90HeadDimBucket(head_dim);
  for (int i = 0; i < kFwdSm90NumTiles; ++i) {
    const FwdSm90Tile& t = kFwdSm90TileTable[i];
    if (t.head_dim == bucket && (masked ? t.masked : t.unmasked) && seqlen_k >= t.min_keys &&
        seqlen_k <= t.max_keys) {
      return i;
    }
  }
  return -1;
}
static_assert(FwdSm90TileIndex(64, false, 512) == 0 && FwdSm90TileIndex(64, true, 16384) == 0);
static_assert(FwdSm90TileIndex(64, true, 256) == 5 && FwdSm90TileIndex(40, false, 1) == 5 &&
              FwdSm90TileIndex(64, false, 257) == 0);
static_assert(FwdSm90TileIndex(128, false, 4096) == 3 && FwdSm90TileIndex(128, false, 4097) == 1);
static_assert(FwdSm90TileIndex(128, true, 8192) == 3 && FwdSm90TileIndex(128, true, 8193) == 2);
static_assert(FwdSm90TileIndex(96, false, 4097) == 1 && FwdSm90TileIndex(40, true, 512) == 0);
static_assert(FwdSm90TileIndex(256, true, 512) == 4 && FwdSm90TileIndex(136, false, 9000) == 4);
static_assert(FwdSm90TileIndex(264, false, 512) == -1);
static_assert(FwdSm90Persistent(kFwdSm90TileTable[3], true, 8192) &&
              FwdSm90Persistent(kFwdSm90TileTable[3], false, 4096) &&
              FwdSm90Persistent(kFwdSm90TileTable[0], true, 2048) &&
              !FwdSm90Persistent(kFwdSm90TileTable[0], false, 2048) &&
              !FwdSm90EverPersistent(kFwdSm90TileTable[1]) &&
              !FwdSm90EverPersistent(kFwdSm90TileTable[2]) &&
              !FwdSm90AlwaysPersistent(kFwdSm90TileTable[0]) &&
              FwdSm90AlwaysPersistent(kFwdSm90TileTable[5]));

// Warp roles: warpgroup 0 produces (one thread issues every TMA copy), the
// block_m / 64 others consume (wgmma + softmax), 64 query rows each.
constexpr int FwdSm90ConsumerWarpgroups(const FwdSm90Tile& t) { return t.block_m / 64; }
constexpr int FwdSm90Threads(const FwdSm90Tile& t) {
  return 128 * (1 + FwdSm90ConsumerWarpgroups(t));
}
// setmaxnreg budgets, 128 x producer + consumer threads x consumer <= 65536:
// 128 x 24 + 256 x 240 with two consumer warpgroups, 128 x 32 + 384 x 160
// with three.
constexpr int FwdSm90ProducerRegs(const FwdSm90Tile& t) {
  return FwdSm90ConsumerWarpgroups(t) == 2 ? 24 : 32;
}
constexpr int FwdSm90ConsumerRegs(const FwdSm90Tile& t) {
  return FwdSm90ConsumerWarpgroups(t) == 2 ? 240 : 160;
}

// The epilogue stages O (block_m x D) in shared memory and writes it with TMA
// stores: in a region of its own where that fits beside the ring (all but the
// 128 x 176 D 128 tile, which stages it in Q). Direct stores of the
// accumulator fragments (4-byte pieces of 8 rows per instruction) kept the
// tensor cores idle between tiles: 5-10% at D 128 T 2048.
constexpr int FwdSm90RingSmemBytes(const FwdSm90Tile& t) {
  const int tiles = (t.block_m + 2 * t.stages * t.block_n) * t.head_dim * 2;
  // q full/empty; k/v full and empty per stage; the next tile's full/empty
  const int barriers = (4 + 4 * t.stages) * 8;
  const int piece_roles = 16;  // a stream-K piece's arrival order, per consumer warpgroup
  const int next_tile = 16;
  return tiles + barriers + piece_roles + next_tile + 1024;  // + 1 KB: tiles on the 1024-byte swizzle atom
}
inline constexpr int kSm90SmemBytesMax = 232448;  // cc 9.0's opt-in limit per block
constexpr int FwdSm90OBytes(const FwdSm90Tile& t) { return t.block_m * t.head_dim * 2; }
constexpr bool FwdSm90StagesO(const FwdSm90Tile& t) {
  return FwdSm90RingSmemBytes(t) + FwdSm90OBytes(t) <= kSm90SmemBytesMax;
}
// Bytes of dynamic shared memory: Q, the K/V ring, O where staged, barriers.
constexpr int FwdSm90SmemBytes(const FwdSm90Tile& t) {
  return FwdSm90RingSmemBytes(t) + (FwdSm90StagesO(t) ? FwdSm90OBytes(t) : 0);
}
static_assert(FwdSm90StagesO(kFwdSm90TileTable[3]) && !FwdSm90StagesO(kFwdSm90TileTable[1]) &&
              !FwdSm90StagesO(kFwdSm90TileTable[4]));
static_assert(FwdSm90SmemBytes(kFwdSm90TileTable[4]) <= kSm90SmemBytesMax);

// A stream-K piece's parked state, per consumer warpgroup: its threads'
// O accumulators (D / 2 each), then row max and row sum of their two rows,
// stored [register][thread] (fwd_sm90_kernel.cuh).
constexpr int FwdSm90PiecePartialRegs(int head_dim) { return head_dim / 2 + 4; }

// The kernel's by-value argument block (__grid_constant__), so the tensor maps
// sit in parameter space where the TMA unit may read them. Each map is 4-D
// over (D, rows, heads, B) or (D, heads, rows, B), whichever keeps strides
// increasing (the tensor-map encoding expects that); `*_heads_inner` says
// which, and only swaps the two middle coordinates (the box is 1 along the
// head dim, so the shared-memory image is the same either way).
struct FwdSm90Args {
  CUtensorMap tma_q;
  CUtensorMap tma_k;
  CUtensorMap tma_v;
  CUtensorMap tma_o;  // boxes of 64 rows (one consumer warpgroup's)
  FlashParams p;
  int num_m_blocks = 0;
  int num_tiles = 0;  // num_m_blocks * H * B; the grid has one block per tile, or fewer
  // Stream-K (persistent grid, no mask): tiles [0, sk_first_tile) run in
  // whole-tile rounds; the key blocks of the rest (sk_blocks_per_tile each)
  // are shared out evenly, a contiguous range per block, and a tile cut
  // between two blocks is merged through sk_partial (fp32 O, row max and
  // sum per consumer thread) and sk_flags (zeroed before the launch).
  // sk_first_tile == num_tiles: whole tiles only.
  int sk_first_tile = 0;
  int sk_blocks_per_tile = 0;
  float* sk_partial = nullptr;
  int* sk_flags = nullptr;
  bool q_heads_inner = true;
  bool k_heads_inner = true;
  bool v_heads_inner = true;
  bool o_heads_inner = true;
  // Segment ids: the pre-pass's summaries in chunks of 64 query rows (one
  // consumer warpgroup's) and block_n keys (segments.cuh); empty without.
  SegmentBlocks seg;
  // Drawn segment tiles (fwd_sm90_kernel.cuh, Locate) in query-block order
  // with every (batch, head) of a block together, not head by head.
  bool seg_heads_inner = false;
  Sm90ScoreUnits units;  // the score units of p's softcap (score_options.h)
};

// The row of kFwdSm90TileTable the package runs p with, or -1.
int FwdSm90PackageTileIndex(const FlashParams& p);

// The host side of a call run by `tile` (a row of the table, or a
// self-test's): the scratch it needs, then everything before the kernel's
// launch (the plan, the tensor maps, the segment pre-pass) into *launch.
// PrepareForwardSm90 returns cudaErrorInvalidValue where the tile cannot
// serve p; launch->grid_blocks == 0 when there is nothing to run.
struct FwdSm90Launch {
  FwdSm90Args args;
  int grid_blocks = 0;
};
size_t Sm90ForwardScratchBytesFor(const FlashParams& p, const DeviceInfo& dev,
                                  const FwdSm90Tile& tile, FwdSm90Choice choice);
cudaError_t PrepareForwardSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                               cudaStream_t stream, const FwdSm90Tile& tile,
                               FwdSm90Choice choice, FwdSm90Launch* launch);

}  // namespace sm90
}  // namespace jax_flash2::cuda
