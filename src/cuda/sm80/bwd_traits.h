// Tile sizes of the backward kernel: one row per head-dim bucket, plus the
// scratch layout shared by BackwardScratchBytes and RunBackward.
//
// Plain C++ (no CUDA headers): the host planner reads the same table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_flash2::cuda {

struct BwdTileSizes {
  int head_dim;  // bucket: the kernel's compile-time head dim
  int block_m;   // query rows per inner-loop step
  int warps_n;   // warps along the key block; block_n = 16 * warps_n
  int warps_d;   // warps splitting head_dim (of dK/dV) and block_m (of S^T)
  int do_stages = 2;  // dO buffers: 2 loads the next block's under this one's
                      // products; 1 loads it after dV += P^T dO (99 KB rows)
};

// Why these: the CTA owns block_n = 16 * warps_n keys and each warp owns 16 of
// them for every product on the key side (S^T, dP^T, dV, dK), so dK and dV
// (16 x head_dim / warps_d each, fp32) live in registers for the whole loop.
// That is head_dim / warps_d accumulators per thread for the pair: d128 keeps
// all of head_dim in one warp (128 registers) with a short block_m = 32 so
// that S^T and dP^T (16 x block_m each) fit beside it under 255 registers;
// d256 splits head_dim over 2 warps for the same reason. Shared memory (K, V,
// double-buffered Q and dO, P^T and dS^T; rows padded by 16 bytes) stays
// under 150 KB, which fits sm80's 163 KB opt-in limit (not the 99 KB of cc 8.6
// / 8.9 above d32: kBwdTileTableSmallSmem).
inline constexpr BwdTileSizes kBwdTileTable[] = {
    {32, 64, 8, 1},
    {64, 64, 8, 1},
    {128, 32, 8, 1},
    {256, 32, 4, 2},
};

// Rows used instead where the device's opt-in shared memory holds them (sm90:
// 227 KB): block_m = 64 with 16 warps, head_dim split over 2 warps so that
// each thread stays under 128 registers. Measured on an H200 at B=4,
// T=S=4096, H*D=2048, bf16: d128 169 -> 190 TFLOP/s (non-causal), 152 -> 170
// (causal) against the row above. Only buckets listed here get a second
// kernel. d256 has none: its 16-warp row {256, 64, 4, 4} spilled (112 bytes
// at the 128 registers of 512 threads) and measured 139.0 / 129.9 TFLOP/s
// against 144.0 / 134.5 for the row above.
inline constexpr BwdTileSizes kBwdTileTableLargeSmem[] = {
    {128, 64, 8, 2},
};

// Rows for GPUs with 99 KB (101,376 B) of opt-in shared memory per block (cc
// 8.6 / 8.9), where the rows above need 111,616 B (d64), 125,440 B (d128)
// and 145,920 B (d256). Each keeps its default row's dK, dV per warp (16 keys
// x head_dim / warps_d): d64 halves block_m (76,288 B; 206-215 registers, no
// spill on sm_80), d128 halves the warps along the keys (block_n 64: 80,384
// B; 255 registers, no spill; with dropout 64 bytes, its dQ share per warp
// being twice the default row's). d256 halves them too (block_n 32) and keeps
// one dO buffer (90,112 B; with two, 107,008 B): the next block's dO loads
// once dV += P^T dO is done, under the dQ product only. d32 fits as it is
// (78,848 B).
inline constexpr BwdTileSizes kBwdTileTableSmallSmem[] = {
    {64, 32, 8, 1},
    {128, 32, 4, 1},
    {256, 32, 2, 2, 1},
};

// The largest block_m of the backward kernels (these tables' and the Hopper
// kernel's, sm90/bwd_sm90.h): Dvec and LSE rows are padded to it so that
// every tile of them is a whole, aligned, in-bounds 16-byte copy.
inline constexpr int kBwdRowPad = 128;

constexpr BwdTileSizes BwdTileFor(int64_t head_dim) {
  for (const BwdTileSizes& t : kBwdTileTable) {
    if (head_dim <= t.head_dim) return t;
  }
  return BwdTileSizes{0, 0, 0, 0};
}

// Which table a bucket's kernel takes its tile from.
enum class BwdTileRow : int { kDefault = 0, kLargeSmem = 1, kSmallSmem = 2 };

// The row of a bucket in `table`, or {0, ...} when it has none there.
template <size_t kRows>
constexpr BwdTileSizes BwdTileOfBucket(const BwdTileSizes (&table)[kRows], int bucket) {
  for (const BwdTileSizes& t : table) {
    if (t.head_dim == bucket) return t;
  }
  return BwdTileSizes{0, 0, 0, 0};
}

// The row of a bucket in the table of `row`, or {0, ...} when it has none there.
constexpr BwdTileSizes BwdTileOfRow(int bucket, BwdTileRow row) {
  return row == BwdTileRow::kDefault     ? BwdTileOfBucket(kBwdTileTable, bucket)
         : row == BwdTileRow::kLargeSmem ? BwdTileOfBucket(kBwdTileTableLargeSmem, bucket)
                                         : BwdTileOfBucket(kBwdTileTableSmallSmem, bucket);
}

// Shared memory rows are padded by 8 elements (16 bytes): a row is then an odd
// number of 16-byte chunks, so the 8 rows of one ldmatrix phase hit 8
// distinct bank groups.
inline constexpr int kBwdSmemPad = 8;

// Shared memory of a tile: K, V, double-buffered Q, do_stages dO buffers
// (padded rows of 2-byte elements), P^T and dS^T, and double-buffered LSE and
// Dvec rows.
constexpr int BwdSmemBytes(const BwdTileSizes& t) {
  const int block_n = 16 * t.warps_n;
  return (2 * block_n + (2 + t.do_stages) * t.block_m) * (t.head_dim + kBwdSmemPad) * 2 +
         2 * block_n * (t.block_m + kBwdSmemPad) * 2 + 4 * t.block_m * 4;
}
static_assert(BwdSmemBytes(kBwdTileTableSmallSmem[0]) <= 101376 &&
              BwdSmemBytes(kBwdTileTableSmallSmem[1]) <= 101376 &&
              BwdSmemBytes(kBwdTileTableSmallSmem[2]) <= 101376 &&
              BwdSmemBytes(BwdTileFor(32)) <= 101376);

template <int kHeadDim_, BwdTileRow kRow_ = BwdTileRow::kDefault>
struct BwdTraits {
  static constexpr BwdTileRow kRow = kRow_;
  static constexpr bool kLargeSmem = kRow_ == BwdTileRow::kLargeSmem;
  static constexpr BwdTileSizes kTile = BwdTileOfRow(kHeadDim_, kRow_);
  static_assert(kTile.head_dim == kHeadDim_, "not a head-dim bucket (of this table)");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kWarpsN = kTile.warps_n;
  static constexpr int kWarpsD = kTile.warps_d;
  static constexpr int kWarps = kWarpsN * kWarpsD;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarpsN;
  // S^T, dP^T: warp (wn, wd) computes keys [16 wn, +16) x queries [wd * kMw, +kMw).
  static constexpr int kMw = kBlockM / kWarpsD;
  // dK, dV: warp (wn, wd) owns keys [16 wn, +16) x dims [wd * kDw, +kDw).
  static constexpr int kDw = kHeadDim / kWarpsD;
  // dQ = dS K: warps tile (block_m x head_dim) as kDqWarpsM x kDqWarpsD.
  static constexpr int kDqWarpsM = kBlockM / 16 < kWarps ? kBlockM / 16 : kWarps;
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;
  static constexpr int kDqDw = kHeadDim / kDqWarpsD;
  // dQ's columns per pass: all of a warp's up to 64; above (the 4-warp d256
  // row) passes of 32, whose 16 accumulators fit beside dK, dV without
  // spilling (passes of 64 spilled 24-32 bytes).
  static constexpr int kDqPassDw = kDqDw <= 64 ? kDqDw : 32;
  static constexpr int kDqPasses = kDqDw / kDqPassDw;
  static constexpr int kDoStages = kTile.do_stages;
  static constexpr int kStride = kHeadDim + kBwdSmemPad;  // Q, dO, K, V rows (elements)
  static constexpr int kPStride = kBlockM + kBwdSmemPad;  // P^T, dS^T rows (elements)
  static constexpr int kChunksPerRow = kHeadDim / 8;      // 16-byte cp.async chunks
  static constexpr int kSmemBytes = BwdSmemBytes(kTile);
  static_assert(kMw % 16 == 0 && kDw % 16 == 0 && kDqDw % 16 == 0);
  static_assert(kBlockM % 16 == 0 && kDqWarpsM * kDqWarpsD == kWarps);
  static_assert(kDqDw % kDqPassDw == 0 && (kDoStages == 1 || kDoStages == 2));
  static_assert(kBlockM <= kBwdRowPad && kBwdRowPad % kBlockM == 0);
};

// Scratch of one backward call, in this order, each part 256-byte aligned:
//   lse2  [B, H, T_pad] fp32: LSE * log2(e), +inf for rows with LSE = -inf and
//                             for the padding rows T..T_pad (P = exp2(s - inf) = 0)
//   dvec  [B, H, T_pad] fp32: rowsum(dO * O) - dLSE, 0 on padding rows
//   dq_acc [splits, B, T, H, D] fp32: dQ / scale, summed over key blocks by
//                             atomics; splits > 1 only for the deterministic
//                             backward (one slice per CTA, summed in order)
//   sk_flags [sk_slots, 2] int32 and sk_partial [sk_slots, sk_slot_floats]
//                             fp32: the Hopper backward's stream-K pieces
//                             (bwd_sm90.h); none for other calls
//   dq_turns [dq_turns] int32: the Hopper deterministic backward's dQ
//                             writer counters (bwd_sm90.h), between the two
// dq_acc, sk_flags and dq_turns start at zero: the caller clears
// zeroed_bytes from dq_acc_offset.
struct BwdScratchLayout {
  int64_t t_pad = 0;
  int dq_splits = 1;
  size_t dq_split_elems = 0;  // B * T * H * D
  int64_t sk_slots = 0;
  size_t lse2_offset = 0;
  size_t dvec_offset = 0;
  size_t dq_acc_offset = 0;
  size_t sk_flags_offset = 0;
  size_t dq_turns_offset = 0;
  size_t sk_partial_offset = 0;
  size_t zeroed_bytes = 0;
  size_t total_bytes = 0;
};

inline BwdScratchLayout MakeBwdScratchLayout(int64_t batch, int64_t seqlen_q, int64_t heads_q,
                                             int64_t head_dim, int dq_splits,
                                             int64_t sk_slots = 0, int64_t sk_slot_floats = 0,
                                             int64_t dq_turns = 0) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  BwdScratchLayout s;
  s.t_pad = (seqlen_q + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad;
  s.dq_splits = dq_splits;
  s.dq_split_elems = static_cast<size_t>(batch * seqlen_q * heads_q * head_dim);
  s.sk_slots = sk_slots;
  const size_t row_bytes = static_cast<size_t>(batch * heads_q * s.t_pad) * sizeof(float);
  s.lse2_offset = 0;
  s.dvec_offset = align(row_bytes);
  s.dq_acc_offset = s.dvec_offset + align(row_bytes);
  s.sk_flags_offset = s.dq_acc_offset + align(dq_splits * s.dq_split_elems * 4);
  s.dq_turns_offset = s.sk_flags_offset + align(static_cast<size_t>(sk_slots) * 2 * 4);
  s.sk_partial_offset = s.dq_turns_offset + align(static_cast<size_t>(dq_turns) * 4);
  s.zeroed_bytes = s.sk_partial_offset - s.dq_acc_offset;
  s.total_bytes = s.sk_partial_offset + align(static_cast<size_t>(sk_slots * sk_slot_floats) * 4);
  return s;
}

// Scratch cap of the deterministic backward's dQ slices: more splits buy
// parallelism (grid = splits * B * K CTAs) at B * T * H * D * 4 bytes each.
inline constexpr size_t kDeterministicDqBytes = size_t{1} << 30;

// dQ slices of a backward call: 1 (atomics from every key block into one
// accumulator, order varies) unless deterministic. Then CTA i of each
// (b, kv head) walks key blocks i, i + splits, ... in order into slice i, and
// the convert kernel adds the slices in order: enough CTAs to fill sm_count
// multiprocessors, at most one per key block, within kDeterministicDqBytes.
inline int BwdDqSplits(bool deterministic, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                       int64_t heads_q, int64_t heads_kv, int64_t head_dim, int sm_count) {
  if (!deterministic) return 1;
  const int64_t block_n = 16 * BwdTileFor(head_dim).warps_n;
  const int64_t n_blocks = block_n > 0 ? (seqlen_k + block_n - 1) / block_n : 1;
  const int64_t ctas = batch * heads_kv > 0 ? batch * heads_kv : 1;
  int64_t splits = (sm_count + ctas - 1) / ctas;
  const size_t slice = static_cast<size_t>(batch * seqlen_q * heads_q * head_dim) * 4;
  if (slice > 0 && splits * slice > kDeterministicDqBytes) {
    splits = static_cast<int64_t>(kDeterministicDqBytes / slice);
  }
  if (splits > n_blocks) splits = n_blocks;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

}  // namespace jax_flash2::cuda
