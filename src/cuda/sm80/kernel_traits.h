// Tile sizes of the forward kernel: one row per head-dim bucket.
//
// Every head dim that is a multiple of 8 up to 256 runs in the smallest bucket
// that holds it; the columns past head_dim are zero-filled in shared memory
// and never written back, so no padded copy is made in HBM.
//
// Plain C++ (no CUDA headers): the host planner reads the same table.
#pragma once

#include <cstdint>

namespace jax_flash2::cuda {

struct FwdTileSizes {
  int head_dim;  // bucket: the kernel's compile-time head dim
  int block_m;   // query rows per thread block
  int block_n;   // keys per inner-loop step
  int warps;     // each warp owns block_m / warps query rows (split-Q)
};

// Why these: a warp holds its O slice (rows/warp x head_dim fp32) and one S
// tile (rows/warp x block_n fp32) in registers. 32 rows per warp up to d128
// keeps that under ~200 accumulators (no spills at 255 registers) and reuses
// every K/V fragment twice; d192/d256 drop to 16 rows per warp for the same
// reason. Shared memory is Q + K + V, one tile each, for prefill: at most
// 101 KB (d256), which also fits sm86's 99 KB opt-in limit; split-KV/decode
// launches add a second K/V stage where the device has room (fwd_kernel.cuh).
inline constexpr FwdTileSizes kFwdTileTable[] = {
    {32, 128, 128, 4}, {64, 128, 64, 4}, {96, 128, 64, 4},
    {128, 128, 64, 4}, {192, 64, 64, 4}, {256, 64, 64, 4},
};

// The bucket serving head_dim, or {0, ...} when none does.
constexpr FwdTileSizes FwdTileFor(int64_t head_dim) {
  for (const FwdTileSizes& t : kFwdTileTable) {
    if (head_dim <= t.head_dim) return t;
  }
  return FwdTileSizes{0, 0, 0, 0};
}

// Shared memory rows are padded by 8 elements (16 bytes): a row is then an odd
// number of 16-byte chunks long (every bucket is a multiple of 16), so the 8
// rows one ldmatrix phase reads fall into 8 distinct bank groups.
inline constexpr int kSmemPad = 8;

// Q tile plus `stages` K and V tiles, of 2-byte elements. Dropout's keep bits
// of one key block (per m16 tile, 2 words for each of 32 lanes) live in the Q
// rows' padding, which holds exactly that (fwd_kernel.cuh KeepWordsOfLane).
constexpr int FwdSmemBytes(const FwdTileSizes& t, int stages) {
  return (t.block_m + 2 * stages * t.block_n) * (t.head_dim + kSmemPad) * 2;
}

// The decode kernel (decode_kernel.cu): calls with few packed rows (T * group
// size, DecodeMaxRows). Its warps split the keys, each streaming its own
// warp_keys-key chunks through a private `stages`-deep ring, and the block
// merges the four warps' softmax states at the end. Two stages of 32 keys
// (16 at d256) keep ~128 KB per block in flight, which the memory-bound
// decode needs, and fit sm80's 163 KB; blocks_per_sm is what the split
// planner assumes resident (d64's 68-70 KB allow two).
struct DecodeTileSizes {
  int head_dim;  // bucket
  int warp_keys;
  int stages;
  int blocks_per_sm;
};

inline constexpr int kDecodeWarps = 4;

inline constexpr DecodeTileSizes kDecodeTileTable[] = {
    {64, 32, 2, 2}, {128, 32, 2, 1}, {256, 16, 2, 1}};

constexpr DecodeTileSizes DecodeTileFor(int64_t head_dim) {
  for (const DecodeTileSizes& t : kDecodeTileTable) {
    if (head_dim <= t.head_dim) return t;
  }
  return DecodeTileSizes{0, 0, 0, 0};
}

// The d128 tile where a block may use only 99 KB (cc 8.6 / 8.9), whose
// 135-140 KB the row above exceeds: 16-key warp steps, as at d256 (68 KB),
// for up to 16 rows (DecodeMaxMTiles). d256 has none (its 16-key tile is
// already 136 KB), nor do 17-32 rows: they run the prefill kernel there.
inline constexpr DecodeTileSizes kDecodeTileSmallSmem = {128, 16, 2, 1};

// A bucket's decode tile: the small-smem one (small_smem; d128 only) or the
// row of kDecodeTileTable; {0, ...} when there is none.
constexpr DecodeTileSizes DecodeTileOfRow(int bucket, bool small_smem) {
  if (small_smem) {
    return kDecodeTileSmallSmem.head_dim == bucket ? kDecodeTileSmallSmem
                                                   : DecodeTileSizes{0, 0, 0, 0};
  }
  const DecodeTileSizes t = DecodeTileFor(bucket);
  return t.head_dim == bucket ? t : DecodeTileSizes{0, 0, 0, 0};
}

// m16 tiles of rows a block can hold: two (32 rows), except at d256, whose
// 32 x 4 O accumulators per tile leave no registers for a second, and with
// 16-key warp steps, whose K/V rings (where the warps' states merge) are too
// small for two tiles' states.
constexpr int DecodeMaxMTiles(const DecodeTileSizes& t) {
  return t.head_dim <= 128 && t.warp_keys >= 32 ? 2 : 1;
}

// The decode kernel's calls have at most this many packed rows: one block
// holds them all. Splitting more rows over blocks that each stream the keys
// again (from L2) measured slower than the prefill kernel at T 16 and at B8
// T8 S128k.
constexpr int64_t DecodeMaxRows(const DecodeTileSizes& t) { return 16 * DecodeMaxMTiles(t); }

// m16 tiles of rows per block for `rows` (<= DecodeMaxRows) packed rows.
constexpr int DecodeMTiles(const DecodeTileSizes& t, int64_t rows) {
  return rows > 16 ? DecodeMaxMTiles(t) : 1;
}
static_assert(DecodeMaxRows(DecodeTileFor(128)) == 32 && DecodeMaxRows(DecodeTileFor(256)) == 16);

// Q tile (16 rows per m16 tile, padded rows), then each warp's stages of K
// and V tiles (unpadded, swizzled rows; 2-byte elements).
constexpr int DecodeSmemBytes(const DecodeTileSizes& t, int m_tiles) {
  return (16 * m_tiles * (t.head_dim + kSmemPad) +
          kDecodeWarps * t.stages * 2 * t.warp_keys * t.head_dim) *
         2;
}

template <int kHeadDim_>
struct FwdTraits {
  static constexpr FwdTileSizes kTile = FwdTileFor(kHeadDim_);
  static_assert(kTile.head_dim == kHeadDim_, "not a head-dim bucket");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);  // m16 mma tiles per warp
  static constexpr int kNTiles = kBlockN / 8;              // n8 tiles of S per m16 tile
  static constexpr int kDTiles = kHeadDim / 8;             // n8 tiles of O per m16 tile
  static constexpr int kSmemStride = kHeadDim + kSmemPad;  // elements per smem row
  static constexpr int kKeepWordStride = 4 * kSmemStride;  // words: 8 rows
  static constexpr int kChunksPerRow = kHeadDim / 8;       // 16-byte cp.async chunks
  static_assert(kBlockM % (16 * kWarps) == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0);
};

}  // namespace jax_flash2::cuda
