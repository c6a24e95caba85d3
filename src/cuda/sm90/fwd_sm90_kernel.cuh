// FlashAttention-2 forward for Hopper (sm_90a): TMA loads into a K/V ring of
// shared-memory stages synchronised by mbarriers, wgmma for both products,
// and warp specialisation (one producer warpgroup, two or three consumer
// warpgroups of 64 query rows).
//
// A tile is kBlockM (128 or 192) query rows of one (batch, head); tiles are
// numbered with the m-blocks of a head fastest, in reverse order so that under
// a causal mask the longest blocks start first. Each block computes one
// tile when the grid has a block per tile, and several, in rounds of
// gridDim.x tiles (see FwdSm90Walk::TileOfRound), when the host makes the grid
// persistent (one block per SM, for short sequences). Then the producer
// loads the next tile's Q and first K/V stages while the consumers finish
// the current one, and the load latency at the start of each tile is hidden.
// With segment ids a tile is as long as its documents, which only the device
// knows: there the persistent blocks draw tiles from a counter (the
// producer's atomicAdd, handed to the consumers through next_tile) as they
// finish the previous one, in the same order as the hardware starts a grid
// of one tile per block.
// Without a mask every tile has the same length, and a grid of G blocks
// walking N tiles in whole rounds ends with a partial round (2048 tiles on
// 132 SMs: 16 rounds for 15.5 rounds of work). The host then makes the last
// two rounds stream-K (FwdSm90Args::sk_*): their key blocks are shared out
// evenly, a contiguous range per block, so a block's range may begin or end
// inside a tile. A block computes the piece that ends its range first and the
// one that begins it last; the two pieces of a cut tile meet through a flag
// pair in global memory: the first to finish stores its unnormalised O, row
// max and row sum (fp32, in its threads' fragment order) and sets "ready";
// the second waits for that (never long: the first was already storing),
// merges, and writes O and LSE. No block ever waits on one that may not have
// started, so any grid size is safe.
//
// Producer (warpgroup 0, one thread; setmaxnreg down to its budget), per
//   tile: wait q_empty, Q -> q_full; then for each visible key block n, from
//   the last down: wait k_empty[stage], K_n -> k_full[stage]; wait
//   v_empty[stage], V_n -> v_full[stage]. The ring position carries over
//   from tile to tile.
// Consumers (warpgroups 1.., setmaxnreg up to their budget), 64 rows each,
// per key block n:
//   S = Q K_n^T                       wgmma SS, fp32, both operands in smem
//   mask (diagonal / window / ragged blocks only)
//   m' = max(m, rowmax S);  P = exp2(S * scale_log2 - m' * scale_log2)
//   l = l * exp2((m - m') * scale_log2) + rowsum P;  O = O * (same)
//   O += P V_n                        wgmma RS: P (bf16/fp16) in registers
// releasing K_n once S is done, V_n once PV is done and Q after the tile's
// last S; at the end O / l and LSE = m * scale + log(l). Each warpgroup
// stages its 64 rows of O in shared memory (the TMA's swizzled layout) and
// one of its threads stores them with TMA, so the next tile starts while the
// copy engine writes: in a region of their own where it fits
// (FwdSm90StagesO), else in the warpgroup's Q rows, which a kernel of one
// tile per block no longer reads then (the 128 x 176 tile).
// Three schedules of that loop (Sm90Schedule, fwd_sm90.h): kSerial runs it
// as written; kOverlap pipelines it by one block so that O += P_{n+1} V_{n+1}
// executes on the tensor cores while the softmax of block n runs (see the
// loop); kPingpong adds turns between the consumer warpgroups so that their
// wgmma batches alternate. Without turns, each waits only on the shared K/V
// stages, and one's softmax overlaps another's wgmma only as far as they
// happen to drift apart.
//
// Softcap and ALiBi (score_options.h, kernels with kScoreOptions) transform S
// before the mask: with softcap S holds tanh(S * scale / cap) and the cap
// takes the scale's place in exp2 and in the LSE (FwdSm90Args::units).
// Dropout (../dropout_bits.cuh, kernels with kScoreOptions): P <- Z o P after the row
// sums, which stay those of the undropped softmax (as the LSE does), and
// 1 / (1 - rate) joins 1 / l in the epilogue.
// Masking follows WindowMask (flash_mask.h); key blocks outside the window of
// every row are skipped, and only blocks not fully visible to all 64 rows of
// a warpgroup pay for the per-element predicate. Ragged tails: TMA zero-fills
// rows past T (Q) and S (K, V); the mask removes the zero keys, and zero V
// rows add nothing. Rows past T are computed but never written.
//
// Segment ids (segments.cuh): a pre-pass summarises the ids per block. A
// tile whose rows are all one document whose keys are one run sees exactly
// that run, as a key range like the window's, in key blocks that start at
// the run (FwdSm90TileSpan::key_base), so that a document takes as many
// blocks as it would alone. Any other tile's key blocks are narrowed to
// those whose ids may match its rows', and [full_begin, full_end) to the
// blocks that hold only the one id of a warpgroup's rows; every other
// visited block takes the per-element id test after the window's. Only the
// tile rows that serve masked calls carry that code (segment calls count as
// masked).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>

#include "../../flash_mask.h"
#include "../../online_softmax.h"
#include "../launch.h"
#include "../sm80/primitives.cuh"
#include "../dropout_bits.cuh"
#include "../smem_optin.h"
#include "fwd_sm90.h"
#include "primitives.cuh"
#include "segments.cuh"
#include "score_options.h"
#include "wgmma.cuh"

namespace jax_flash2::cuda::sm90 {

// TileRow: a type whose kTile is the tile (FwdSm90TableTile, or a self-test's row).
template <class TileRow>
struct FwdSm90Traits {
  static constexpr FwdSm90Tile kTile = TileRow::kTile;
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kPanelCols = 64;  // one 128-byte swizzled row of 2-byte elements
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // one K or V tile
  static constexpr int kQPanelBytes = kBlockM * 128;
  static constexpr int kKvPanelBytes = kBlockN * 128;
  static constexpr int kSAcc = kBlockN / 2;   // fp32 S accumulators per thread
  static constexpr int kOAcc = kHeadDim / 2;  // fp32 O accumulators per thread
  static constexpr int kPSlices = kBlockN / 16;  // k16 slices of P
  static constexpr int kConsumerWarpgroups = FwdSm90ConsumerWarpgroups(kTile);
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  static constexpr bool kStagesO = FwdSm90StagesO(kTile);  // in a region of its own
  static constexpr int kOWarpgroupBytes = 64 * kHeadDim * 2;  // panels of 64 rows x 128 bytes
  static_assert(kBlockM == 64 * kConsumerWarpgroups, "each consumer warpgroup owns 64 rows");
  static_assert(kHeadDim % kPanelCols == 0 && kBlockN % 16 == 0 && kBlockN <= 256);
};

// Shared-memory carve-up (byte offsets from the 1024-aligned base). Every tile
// and every panel starts on a 1024-byte boundary (the swizzle atom).
template <class Tr>
struct FwdSm90Smem {
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + Tr::kQBytes;
  static constexpr int kV = kK + Tr::kStages * Tr::kKvBytes;
  static constexpr int kO = kV + Tr::kStages * Tr::kKvBytes;  // where Tr::kStagesO
  static constexpr int kBars =
      kO + (Tr::kStagesO ? Tr::kConsumerWarpgroups * Tr::kOWarpgroupBytes : 0);
  static_assert(kK % 1024 == 0 && kV % 1024 == 0 && kO % 1024 == 0 && Tr::kKvBytes % 1024 == 0);
};
// A kernel's compile-time choices (see FwdSm90Kernel) and what follows from
// them.
// kPersistent: the grid may be smaller than the tile count (see the top).
// Otherwise each block runs its one tile, and the loops below compile to that.
// kScoreOptions: softcap, ALiBi and / or dropout (score_options.h). A template flag,
// not a runtime branch: the branch alone cost the plain kernels 2.5-3.7%
// (H200, B4 T=S=4096 H16, D 64, 96, 128, causal or not, two runs of each
// binary alternated).
template <class TileRow, Sm90Schedule kSchedule_, bool kPersistent_, bool kScoreOptions_>
struct FwdSm90Config {
  using Tr = FwdSm90Traits<TileRow>;
  using Smem = FwdSm90Smem<Tr>;
  static constexpr Sm90Schedule kSchedule = kSchedule_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kScoreOptions = kScoreOptions_;
  // Tiles taller than a key block: under a causal mask a consumer
  // warpgroup's rows can end a block or more before the tile's last row, and
  // it skips those key blocks (see the mainloop). Elsewhere the skip is
  // compiled out: its loop cost the 128-row D 128 kernels 2-4% at T 512-2048
  // for nothing.
  static constexpr bool kSkipsKeyBlocks = Tr::kBlockM > Tr::kBlockN;
  // O goes out through shared memory and TMA (see the top) unless there is
  // no room: the persistent grid's Q buffer holds the next tile's Q by then.
  static constexpr bool kTmaStoreO = Tr::kStagesO || !kPersistent;
  // Segment ids run on the rows that serve masked calls only (the launch
  // checks): elsewhere their code is compiled out (the 176-key D 128 tile
  // spilled 44 bytes with it).
  static constexpr bool kServesSegments = Tr::kTile.masked;
  // Pingpong turns (kPingpong only): consumer warpgroup cg issues its wgmmas
  // after a bar.sync on named barrier 1 + cg, then hands the turn to the next
  // warpgroup (round robin) with a bar.arrive on its barrier (each completes
  // at 256 = 128 syncing + 128 arriving threads). Every warpgroup takes the
  // same number of turns per tile (one per key block, plus one). The last
  // warpgroup hands warpgroup 0 the first turn, and warpgroup 0 takes one
  // extra turn at the end to consume the last one's final hand-over, so no
  // barrier is left half-arrived when the block exits.
  // With two consumer warpgroups (and in a grid of one tile per block) the
  // round robin runs on from tile to tile: a warpgroup that has written its O
  // takes its turn for the next tile's first S while the other finishes its
  // last PV and its epilogue (D 128 T 1024-4096 +0-7% over a barrier
  // between tiles in the self-test). With three (D 64,
  // persistent) the turns start and end with each tile, and named barrier
  // 1 + kConsumerWarpgroups closes it: running on measured 2-6% slower there.
  static constexpr bool kPingpong = kSchedule == Sm90Schedule::kPingpong;
  static constexpr bool kTurnsAcrossTiles =
      kPingpong && (Tr::kConsumerWarpgroups == 2 || !kPersistent);
  static constexpr bool kTurnsPerTile = kPingpong && !kTurnsAcrossTiles;
  static constexpr int kLastGroup = Tr::kConsumerWarpgroups - 1;
  // O staging of a warpgroup (kTmaStoreO): panels of 64 rows x 128 bytes
  // kOPanelStride apart, in the O region or in the warpgroup's Q rows; and
  // its named barrier (the pingpong turns use 1 .. warpgroups, the tile's
  // closing barrier the next).
  static constexpr int kOPanelStride = Tr::kStagesO ? 64 * 128 : Tr::kQPanelBytes;
  static constexpr int kOStagedBarrier = 2 + Tr::kConsumerWarpgroups;
};

// The block's shared memory: Q, the K/V ring and the barriers.
template <typename Elem, class Cfg>
struct FwdSm90Buffers {
  using Tr = typename Cfg::Tr;
  using Smem = typename Cfg::Smem;
  unsigned char* smem;
  Elem* s_q;
  Elem* s_k;
  Elem* s_v;
  // K and V have their own full/empty barriers: a K slot is released as soon
  // as S = Q K^T has completed, a V slot only after O += P V, so the next K
  // can land while the current V is still being read.
  uint64_t* q_full;
  uint64_t* q_empty;
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  // The drawn tile (next_tile) of the persistent grid with segment ids: the
  // producer writes it, the consumer warps read it.
  uint64_t* next_full;
  uint64_t* next_empty;
  int* piece_role;  // per consumer warpgroup
  int* next_tile;

  __device__ __forceinline__ explicit FwdSm90Buffers(unsigned char* base)
      : smem(base),
        s_q(reinterpret_cast<Elem*>(base + Smem::kQ)),
        s_k(reinterpret_cast<Elem*>(base + Smem::kK)),
        s_v(reinterpret_cast<Elem*>(base + Smem::kV)),
        q_full(reinterpret_cast<uint64_t*>(base + Smem::kBars)),
        q_empty(q_full + 1),
        k_full(q_empty + 1),
        v_full(k_full + Tr::kStages),
        k_empty(v_full + Tr::kStages),
        v_empty(k_empty + Tr::kStages),
        next_full(v_empty + Tr::kStages),
        next_empty(next_full + 1),
        piece_role(reinterpret_cast<int*>(next_empty + 1)),
        next_tile(piece_role + 4) {}
};

// Where a tile lies, and the key blocks [n_first, n_end) that some query of
// it may see.
struct FwdSm90TileSpan {
  int head, b, row_begin, row_end, n_first, n_end;
  // Key block n holds keys key_base + n kBlockN onwards: 0, or (a multiple of
  // 16, for dropout's words) where a one-document tile's keys begin.
  int key_base;
  bool id_test;  // segment ids that are not one key run: the per-element id test
};

// An item of a block's walk: a tile or a stream-K piece of one (key blocks
// [lo, hi) counted from its first visible block, merged through `slot`;
// slot -1: the whole tile).
struct FwdSm90Item {
  static constexpr int kAllBlocks = 1 << 30;  // hi of a piece that runs to the tile's end
  int tile, lo, hi, slot;
  __device__ static FwdSm90Item Whole(int tile) { return {tile, 0, kAllBlocks, -1}; }
};

// A block's walk (see the top): items 0 .. num_items - 1, each a tile or a
// stream-K piece of one, and where each lies. The producer and the
// consumers take the same items in the same order.
template <class Cfg>
struct FwdSm90Walk {
  using Tr = typename Cfg::Tr;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  const FwdSm90Args& args;
  const WindowMask& mask;
  int seqlen_q;
  bool segments;
  bool stream_k;
  // With segment ids the tiles' lengths follow the documents, unknown to the
  // host: the persistent grid's blocks draw their tiles from a counter in
  // the tiles' order (longest first per head under a causal mask) as they
  // finish the previous one, instead of a fixed walk. (S == 0: the producer
  // loads nothing and hands out nothing; every tile writes O = 0 alone.)
  bool draws_tiles;
  int num_items = 1;
  // After sk_rounds rounds of whole tiles: the tail piece [0, sk_tail_end)
  // of sk_tail_tile (if sk_tail_end > 0), the whole tiles [sk_whole_begin,
  // sk_tail_tile), then the head piece of sk_head_tile from key block
  // sk_head_begin (if sk_head_begin > 0).
  int sk_rounds = 0, sk_tail_tile = 0, sk_tail_end = 0, sk_whole_begin = 0;
  int sk_head_tile = 0, sk_head_begin = 0;

  __device__ __forceinline__ FwdSm90Walk(const FwdSm90Args& args_, const WindowMask& mask_,
                                         int seqlen_q_, bool segments_)
      : args(args_),
        mask(mask_),
        seqlen_q(seqlen_q_),
        segments(segments_),
        stream_k(Cfg::kPersistent && args_.sk_first_tile < args_.num_tiles),
        draws_tiles(Cfg::kPersistent && segments_ && args_.p.seqlen_k > 0) {
    if constexpr (Cfg::kPersistent) {
      const int grid = static_cast<int>(gridDim.x);
      if (stream_k) {
        // This block's share [u0, u1) of the stream-K key blocks; tile t of
        // them covers [t L, t L + L).
        const int blocks_per_tile = args.sk_blocks_per_tile;
        const int64_t units =
            static_cast<int64_t>(args.num_tiles - args.sk_first_tile) * blocks_per_tile;
        const int64_t u0 = units * blockIdx.x / grid;
        const int64_t u1 = units * (blockIdx.x + 1) / grid;
        sk_rounds = args.sk_first_tile / grid;
        sk_head_tile = args.sk_first_tile + static_cast<int>(u0 / blocks_per_tile);
        sk_head_begin = static_cast<int>(u0 % blocks_per_tile);
        sk_tail_tile = args.sk_first_tile + static_cast<int>(u1 / blocks_per_tile);
        sk_tail_end = static_cast<int>(u1 % blocks_per_tile);
        sk_whole_begin = sk_head_tile + (sk_head_begin > 0);
        num_items = sk_rounds + (sk_tail_end > 0) + (sk_tail_tile - sk_whole_begin) +
                    (sk_head_begin > 0);
      } else {
        num_items = draws_tiles ? INT_MAX : (args.num_tiles + grid - 1) / grid;
      }
    }
  }

  // The pre-pass's summary of the query tile at row_begin of batch entry b
  // (SegmentBlocks::q_tiles).
  __device__ __forceinline__ int4 QTileSpan(int b, int row_begin) const {
    return args.seg.q_tiles[b * args.seg.num_q_tiles + row_begin / kBlockM];
  }

  // Where tile `tile` lies, and the key blocks [n_first, n_end) that some
  // query of it may see.
  __device__ __forceinline__ FwdSm90TileSpan Locate(int tile) const {
    const FlashParams& p = args.p;
    FwdSm90TileSpan t;
    const int num_m = args.num_m_blocks;
    // Head by head, each head's query blocks last first; drawn segment tiles
    // take the query blocks last first with all heads of a block together,
    // so the grid's last tiles are the first blocks of rows (short under a
    // causal mask) rather than a whole head's blocks.
    const int heads_batch = static_cast<int>(p.num_heads_q * p.batch);
    const bool heads_inner = draws_tiles && args.seg_heads_inner;
    const int hb = heads_inner ? tile % heads_batch : tile / num_m;
    const int m = heads_inner ? tile / heads_batch : tile % num_m;
    t.head = hb % static_cast<int>(p.num_heads_q);
    t.b = hb / static_cast<int>(p.num_heads_q);
    t.row_begin = (num_m - 1 - m) * kBlockM;
    t.row_end = min(t.row_begin + kBlockM, seqlen_q);
    int64_t key_begin, key_end;
    mask.KeyRange(t.row_begin, t.row_end, &key_begin, &key_end);
    t.key_base = 0;
    t.id_test = false;
    if (segments) {
      // Segment ids: only the key blocks whose ids may match an id of the
      // tile's rows; a one-document tile sees exactly its document's keys,
      // in blocks that start where they do.
      const int4 span = QTileSpan(t.b, t.row_begin);
      if (span.z >= 0) {
        key_begin = max(key_begin, int64_t{span.z});
        key_end = min(key_end, int64_t{span.w});
        t.key_base = span.z & ~15;
      } else {
        key_begin = max(key_begin, int64_t{span.x} * kBlockN);
        key_end = min(key_end, int64_t{span.y} * kBlockN);
        t.id_test = true;
      }
    }
    t.n_first = static_cast<int>((key_begin - t.key_base) / kBlockN);
    t.n_end = key_end > key_begin
                  ? static_cast<int>((key_end - t.key_base + kBlockN - 1) / kBlockN)
                  : t.n_first;
    return t;
  }

  // The tile this block takes in round r of the walk: rounds of gridDim.x
  // tiles, every other one in reverse block order. Under a causal mask the
  // tiles of a head run longest first, so a block that drew a long tile in
  // one round draws a short one in the next (a static stride would hand
  // some blocks only long tiles whenever gridDim.x is a multiple of the
  // m-blocks per head).
  __device__ __forceinline__ int TileOfRound(int r) const {
    return r * static_cast<int>(gridDim.x) +
           ((r & 1) ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x));
  }

  // Item i of a walk that does not draw its tiles.
  __device__ __forceinline__ FwdSm90Item ItemAt(int i) const {
    if (!stream_k || i < sk_rounds) return FwdSm90Item::Whole(TileOfRound(i));
    i -= sk_rounds;
    // The piece that ends this block's range starts its tile: the next block
    // computes the rest of it last, so this one goes first.
    if (sk_tail_end > 0) {
      if (i == 0) return FwdSm90Item{sk_tail_tile, 0, sk_tail_end, static_cast<int>(blockIdx.x)};
      --i;
    }
    if (i < sk_tail_tile - sk_whole_begin) return FwdSm90Item::Whole(sk_whole_begin + i);
    return FwdSm90Item{sk_head_tile, sk_head_begin, FwdSm90Item::kAllBlocks,
                       static_cast<int>(blockIdx.x) - 1};
  }

  // Where item `it` lies: its tile, with the key blocks narrowed to the piece.
  __device__ __forceinline__ FwdSm90TileSpan LocateItem(const FwdSm90Item& it) const {
    FwdSm90TileSpan t = Locate(it.tile);
    if (it.slot >= 0) {
      t.n_end = min(t.n_end, t.n_first + it.hi);
      t.n_first += it.lo;
    }
    return t;
  }
};

// The producer (warpgroup 0; one thread loads): per item, Q, then K and V
// of each visible key block from the last down, into the ring.
template <typename Elem, class Cfg>
__device__ __forceinline__ void FwdSm90Producer(const FwdSm90Args& args,
                                                const FwdSm90Walk<Cfg>& walk,
                                                const FwdSm90Buffers<Elem, Cfg>& buf) {
  using Tr = typename Cfg::Tr;
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  const FlashParams& p = args.p;
  SetMaxNRegDec<FwdSm90ProducerRegs(Tr::kTile)>();
  if (threadIdx.x == 0 && p.seqlen_k > 0) {  // S == 0: no tile loads anything
    PrefetchTensorMap(&args.tma_q);
    PrefetchTensorMap(&args.tma_k);
    PrefetchTensorMap(&args.tma_v);
    if constexpr (Cfg::kTmaStoreO) PrefetchTensorMap(&args.tma_o);
    RingPos<kStages> ring;
    uint32_t q_phase = 0;
    for (int i = 0; i < walk.num_items; ++i) {
      FwdSm90Item it;
      if (walk.draws_tiles) {
        // The next tile from the shared counter (the kernel's top), handed
        // to the consumers through next_tile; past the last: the end.
        const int tile = i == 0 ? static_cast<int>(blockIdx.x)
                                : static_cast<int>(gridDim.x) + atomicAdd(args.seg.tile_counter, 1);
        MbarWait(buf.next_empty, (i & 1) ^ 1);  // the consumers have read the previous one
        *buf.next_tile = tile;
        MbarArrive(buf.next_full);
        if (tile >= args.num_tiles) break;
        it = FwdSm90Item::Whole(tile);
      } else {
        it = walk.ItemAt(i);
        if (it.tile >= args.num_tiles) continue;
      }
      const FwdSm90TileSpan t = walk.LocateItem(it);
      if (t.n_first >= t.n_end) continue;  // the consumers write O = 0 alone
      const int kv_head = t.head / static_cast<int>(p.group_size);  // GQA by index
      const int b = t.b;
      if constexpr (Cfg::kPersistent) {
        // The consumers are done with the previous tile's Q (first tile: free).
        MbarWait(buf.q_empty, q_phase ^ 1);
        q_phase ^= 1;
      }
      // Rows [row, + panel_bytes / 128) of `head` into dst, one panel of
      // 64 columns at a time, completing on `full`.
      const auto load_tile = [&](Elem* dst, int panel_bytes, const CUtensorMap* map,
                                 bool heads_inner, uint64_t* full, int row, int head) {
        MbarArriveExpectTx(full, Tr::kPanels * panel_bytes);
#pragma unroll
        for (int panel = 0; panel < Tr::kPanels; ++panel) {
          TmaLoadRows(reinterpret_cast<unsigned char*>(dst) + panel * panel_bytes, map,
                      heads_inner, full, panel * Tr::kPanelCols, row, head, b);
        }
      };
      load_tile(buf.s_q, Tr::kQPanelBytes, &args.tma_q, args.q_heads_inner, buf.q_full,
                t.row_begin, t.head);
      for (int n = t.n_end - 1; n >= t.n_first; --n) {
        const int key0 = t.key_base + n * kBlockN;
        const int kv_elems = ring.stage * kBlockN * kHeadDim;  // the stage's tile
        // Slot free? (Parity phase ^ 1: the first pass over the ring finds
        // every slot free.)
        MbarWait(&buf.k_empty[ring.stage], ring.phase ^ 1);
        load_tile(buf.s_k + kv_elems, Tr::kKvPanelBytes, &args.tma_k, args.k_heads_inner,
                  &buf.k_full[ring.stage], key0, kv_head);
        MbarWait(&buf.v_empty[ring.stage], ring.phase ^ 1);
        load_tile(buf.s_v + kv_elems, Tr::kKvPanelBytes, &args.tma_v, args.v_heads_inner,
                  &buf.v_full[ring.stage], key0, kv_head);
        ring.Advance();
      }
    }
  }
}

// A consumer thread: warpgroup cg owns rows [64 cg, 64 cg + 64) of a tile;
// what stays the same from tile to tile.
template <typename Elem, class Cfg>
struct FwdSm90Consumer {
  using Tr = typename Cfg::Tr;
  const FwdSm90Args& args;
  const WindowMask& mask;
  const FwdSm90Buffers<Elem, Cfg>& buf;
  int seqlen_q;
  bool segments;
  int cg;
  int wg_tid;
  int warp;  // warp within the warpgroup: 16 rows each
  int lane;
  int g;     // accumulator row (and g + 8)
  int t4;    // accumulator column pair
  // The exp2 factor per unit of score: scale * log2(e), or cap * log2(e)
  // with softcap (score_options.h).
  float scale_log2;
  // Descriptors: Q rows of this warpgroup (panel 0); K and V of stage 0.
  uint64_t desc_q;
  uint64_t desc_k0;
  uint64_t desc_v0;
  bool dropout;
  bool fixed_max;  // softcap alone: a constant softmax max (score_options.h)
  unsigned char* s_o_staged;  // this warpgroup's O staging (Cfg::kOPanelStride)

  __device__ __forceinline__ FwdSm90Consumer(const FwdSm90Args& args_, const WindowMask& mask_,
                                             const FwdSm90Buffers<Elem, Cfg>& buf_, int seqlen_q_,
                                             bool segments_, int warpgroup)
      : args(args_),
        mask(mask_),
        buf(buf_),
        seqlen_q(seqlen_q_),
        segments(segments_),
        cg(warpgroup - 1),
        wg_tid(threadIdx.x % 128),
        warp(wg_tid / 32),
        lane(wg_tid % 32),
        g(lane / 4),
        t4(lane % 4),
        scale_log2(Cfg::kScoreOptions ? args_.units.log2 : args_.p.softmax_scale_log2),
        desc_q(MakeDescK(SmemAddr(buf_.s_q) + 64 * cg * 128)),
        desc_k0(MakeDescK(SmemAddr(buf_.s_k))),
        desc_v0(MakeDescMN(SmemAddr(buf_.s_v), Tr::kKvPanelBytes)),
        dropout(Cfg::kScoreOptions && args_.p.dropout_seeds != nullptr),
        fixed_max(Cfg::kScoreOptions && args_.units.fixed_max > -INFINITY),
        s_o_staged(Tr::kStagesO
                       ? buf_.smem + Cfg::Smem::kO + cg * Tr::kOWarpgroupBytes
                       : buf_.smem + Cfg::Smem::kQ + cg * 64 * 128) {}
};

// A consumer thread's online-softmax state of its two rows, in the kernel's
// own arrays (one struct of them compiled to other code): O, row max, and
// the row sums of this lane's columns (quad-reduced at the end).
template <class Tr>
struct FwdSm90Rows {
  float (&o)[Tr::kOAcc];
  float (&row_max)[2];
  float (&row_sum)[2];
};

// A stream-K piece (see the top): the first of a tile's two pieces to get
// here parks its state (FwdSm90ParkPiece) and writes nothing; the second
// merges the parked state into its own (FwdSm90MergePiece).
struct FwdSm90Piece {
  int* ready;
  float* partial;  // [register][thread]: each store and load is one coalesced row
};

template <typename Elem, class Cfg>
__device__ __forceinline__ FwdSm90Piece FwdSm90ArrivePiece(const FwdSm90Consumer<Elem, Cfg>& c,
                                                           const FwdSm90Item& it) {
  using Tr = typename Cfg::Tr;
  constexpr int kPartialRegs = FwdSm90PiecePartialRegs(Tr::kHeadDim);
  static_assert(kPartialRegs == Tr::kOAcc + 4, "O, then row max and row sum of both rows");
  const int pair = it.slot * Tr::kConsumerWarpgroups + c.cg;
  int* arrivals = c.args.sk_flags + 2 * pair;
  FwdSm90Piece piece;
  piece.ready = arrivals + 1;
  piece.partial =
      c.args.sk_partial + static_cast<int64_t>(pair) * kPartialRegs * 128 + c.wg_tid;
  if (c.wg_tid == 0) c.buf.piece_role[c.cg] = atomicAdd(arrivals, 1);
  NamedBarrierSync(Cfg::kOStagedBarrier + c.cg, 128);
  return piece;
}

// Whether this warpgroup's piece arrived first (FwdSm90ArrivePiece).
template <typename Elem, class Cfg>
__device__ __forceinline__ bool FwdSm90FirstPiece(const FwdSm90Consumer<Elem, Cfg>& c) {
  return c.buf.piece_role[c.cg] == 0;
}

template <typename Elem, class Cfg>
__device__ __forceinline__ void FwdSm90ParkPiece(const FwdSm90Consumer<Elem, Cfg>& c,
                                                 const FwdSm90Piece& piece,
                                                 const FwdSm90Rows<typename Cfg::Tr>& rows) {
  using Tr = typename Cfg::Tr;
  float* partial = piece.partial;
#pragma unroll
  for (int i = 0; i < Tr::kOAcc; ++i) __stcg(partial + i * 128, rows.o[i]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    __stcg(partial + (Tr::kOAcc + h) * 128, rows.row_max[h]);
    __stcg(partial + (Tr::kOAcc + 2 + h) * 128, rows.row_sum[h]);
  }
  __threadfence();
  NamedBarrierSync(Cfg::kOStagedBarrier + c.cg, 128);
  if (c.wg_tid == 0) StoreRelease(piece.ready, 1);
}

template <typename Elem, class Cfg>
__device__ __forceinline__ void FwdSm90MergePiece(const FwdSm90Consumer<Elem, Cfg>& c,
                                                  const FwdSm90Piece& piece,
                                                  const FwdSm90Rows<typename Cfg::Tr>& rows) {
  using Tr = typename Cfg::Tr;
  const float* partial = piece.partial;
  float (&o)[Tr::kOAcc] = rows.o;
  float (&row_max)[2] = rows.row_max;
  float (&row_sum)[2] = rows.row_sum;
  // The other piece is storing already (it arrived first): a short wait.
  if (c.wg_tid == 0) {
    while (LoadAcquire(piece.ready) == 0) {
    }
  }
  NamedBarrierSync(Cfg::kOStagedBarrier + c.cg, 128);
  float own[2], parked[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float other_max = __ldcg(partial + (Tr::kOAcc + h) * 128);
    const float other_sum = __ldcg(partial + (Tr::kOAcc + 2 + h) * 128);
    const MergeWeights w = MergeTwoStates(row_max[h], other_max, c.scale_log2, FastExp2);
    own[h] = w.own;
    parked[h] = w.other;
    row_max[h] = w.m;
    row_sum[h] = row_sum[h] * own[h] + other_sum * parked[h];
  }
#pragma unroll
  for (int i = 0; i < Tr::kOAcc; ++i) {
    const int h = (i / 2) % 2;
    o[i] = o[i] * own[h] + __ldcg(partial + i * 128) * parked[h];
  }
}

// The end of a tile: O / l (through the warpgroup's staging and TMA, or
// direct stores) and LSE.
template <typename Elem, class Cfg>
__device__ __forceinline__ void FwdSm90Epilogue(const FwdSm90Consumer<Elem, Cfg>& c,
                                                const FwdSm90TileSpan& tl,
                                                const FwdSm90Rows<typename Cfg::Tr>& rows) {
  using Tr = typename Cfg::Tr;
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr bool kTmaStoreO = Cfg::kTmaStoreO;
  constexpr int kOStagedBarrier = Cfg::kOStagedBarrier;
  const FwdSm90Args& args = c.args;
  const FlashParams& p = args.p;
  const int seqlen_q = c.seqlen_q;
  const int cg = c.cg, wg_tid = c.wg_tid, warp = c.warp, lane = c.lane, g = c.g, t4 = c.t4;
  float (&o)[Tr::kOAcc] = rows.o;
  const int wg_row0 = tl.row_begin + 64 * cg;
  const int64_t num_heads = p.num_heads_q;
  const int head = tl.head;
  const int b = tl.b;
  if constexpr (kTmaStoreO) {
    // This warpgroup's previous store has finished reading its staging.
    if (wg_tid == 0) BulkWaitGroupRead<0>();
    NamedBarrierSync(kOStagedBarrier + cg, 128);
  }
  float lse[2], inv_l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = QuadSum(rows.row_sum[h]);
    // A row that saw a key has l >= 1, where the MUFU reciprocal and
    // logarithm are within a few ulp, without the IEEE forms' special-case
    // paths. Dropout's 1 / (1 - rate) goes with 1 / l (O sums Z o P, l the
    // undropped P).
    const float o_scale = c.dropout ? p.dropout_scale : 1.f;
    inv_l[h] = RowNormalizer(l, o_scale, FastDivide{});
    const float natural = Cfg::kScoreOptions ? args.units.natural : p.softmax_scale;
    lse[h] = RowLse(rows.row_max[h] * natural, l, FastLog{});
    if constexpr (!kTmaStoreO) {
      const int t = wg_row0 + warp * 16 + g + 8 * h;
      if (t >= tl.row_end) continue;
      Elem* o_row = static_cast<Elem*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
                    head * p.o_head_stride;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        *reinterpret_cast<uint32_t*>(o_row + 8 * j + 2 * t4) =
            PackFloat2<Elem>(o[4 * j + 2 * h] * inv_l[h], o[4 * j + 2 * h + 1] * inv_l[h]);
      }
    }
  }
  if constexpr (kTmaStoreO) {
    StageAccumulatorTile<Elem>(c.s_o_staged, Cfg::kOPanelStride, warp, lane, o, inv_l);
    FenceProxyAsync();
    NamedBarrierSync(kOStagedBarrier + cg, 128);
    // Rows past T are dropped by the copy engine (out of the map's bounds).
    if (wg_tid == 0 && wg_row0 < tl.row_end) {
      const RowHeadCoords at(args.o_heads_inner, wg_row0, head);
#pragma unroll
      for (int panel = 0; panel < Tr::kPanels; ++panel) {
        TmaStore4d(c.s_o_staged + panel * Cfg::kOPanelStride, &args.tma_o,
                   panel * Tr::kPanelCols, at.c1, at.c2, b);
      }
      BulkCommitGroup();
    }
  }
  // LSE last: the proxy fence above compiles to MEMBAR.ALL.CTA, which also
  // waits for this thread's earlier global stores (D 128 T 1024 +6% with
  // the LSE stored after it).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = wg_row0 + warp * 16 + g + 8 * h;
    if (t4 == 0 && t < tl.row_end) p.lse[(b * num_heads + head) * seqlen_q + t] = lse[h];
  }
}

template <typename Elem, class TileRow, Sm90Schedule kSchedule, bool kPersistent,
          bool kScoreOptions>
__global__ void __launch_bounds__(FwdSm90Threads(TileRow::kTile), 1)
    FwdSm90Kernel(const __grid_constant__ FwdSm90Args args) {
  using Cfg = FwdSm90Config<TileRow, kSchedule, kPersistent, kScoreOptions>;
  using Tr = typename Cfg::Tr;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  const bool segments = Cfg::kServesSegments && args.seg.q_span != nullptr;

  const FwdSm90Buffers<Elem, Cfg> buf(AlignedDynamicSmem());
  const FlashParams& p = args.p;
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const WindowMask mask = MakeWindowMask(p);
  const FwdSm90Walk<Cfg> walk(args, mask, seqlen_q, segments);

  if (threadIdx.x == 0) {
    MbarInit(buf.q_full, 1);
    MbarInit(buf.q_empty, Tr::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&buf.k_full[s], 1);
      MbarInit(&buf.v_full[s], 1);
      // Every consumer warp arrives once its own wait for the last wgmma
      // reading the slot has returned: all of them, so no warp's view of a
      // warpgroup-wide wgmma is assumed to cover another's.
      MbarInit(&buf.k_empty[s], Tr::kConsumerWarps);
      MbarInit(&buf.v_empty[s], Tr::kConsumerWarps);
    }
    MbarInit(buf.next_full, 1);
    MbarInit(buf.next_empty, Tr::kConsumerWarps);
    FenceBarrierInit();
  }
  __syncthreads();
  // With segment ids the pre-pass kernel runs just before (LaunchFwdSm90Kernel)
  // and this grid may start under its end. Unconditional: a no-op for a plain
  // launch, and a branch around it changed the persistent kernels' main loops.
  WaitForPrimaryGrid();

  // The pingpong kernels that skip key blocks take the warpgroup index
  // through a broadcast, so the compiler knows it warp-uniform: their address
  // and descriptor arithmetic then stays on the uniform datapath (+4% at D 64
  // causal T 2048; no gain, or a loss of up to 7%, measured for the other
  // kernels, which keep the plain index).
  // The consumers' ring position, declared before the producer's branch:
  // declared with q_phase below, its stage and phase compiled to other
  // registers.
  RingPos<kStages> ring;
  const int warpgroup = Cfg::kPingpong && Cfg::kSkipsKeyBlocks
                            ? __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0)
                            : static_cast<int>(threadIdx.x / 128);
  if (warpgroup == 0) {
    FwdSm90Producer<Elem, Cfg>(args, walk, buf);
    return;
  }

  // ------------------------------------------------------------------ consumers
  SetMaxNRegInc<FwdSm90ConsumerRegs(Tr::kTile)>();
  const FwdSm90Consumer<Elem, Cfg> c(args, mask, buf, seqlen_q, segments, warpgroup);
  // The online-softmax state of this thread's two rows (FwdSm90Rows).
  float o[Tr::kOAcc];
  float row_max[2];
  float row_sum[2];
  const FwdSm90Rows<Tr> rows{o, row_max, row_sum};
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr bool kSkipsKeyBlocks = Cfg::kSkipsKeyBlocks;
  constexpr bool kPingpong = Cfg::kPingpong;
  constexpr bool kTurnsPerTile = Cfg::kTurnsPerTile;
  constexpr int kLastGroup = Cfg::kLastGroup;
  const int cg = c.cg, warp = c.warp, lane = c.lane, g = c.g, t4 = c.t4;
  const float scale_log2 = c.scale_log2;
  const bool fixed_max = c.fixed_max;
  // The D 256 tile (80-key blocks) takes each row's max and sum in four
  // interleaved chains instead of one dependent chain: its forward 3-4%
  // faster; the D 64 and D 128 tiles up to 7% slower that way (H100 self-test).
  constexpr bool kFourChains = Tr::kHeadDim > 128;
  const uint64_t desc_q = c.desc_q, desc_k0 = c.desc_k0, desc_v0 = c.desc_v0;
  uint64_t* const q_full = c.buf.q_full;
  uint64_t* const q_empty = c.buf.q_empty;
  uint64_t* const k_full = c.buf.k_full;
  uint64_t* const v_full = c.buf.v_full;
  uint64_t* const k_empty = c.buf.k_empty;
  uint64_t* const v_empty = c.buf.v_empty;
  // Keys [full_begin, full_end) are visible to all 64 rows of this
  // warpgroup (rows past T included: that only makes the test stricter), so a
  // key block inside it skips the per-element mask; keys [key_lo[h],
  // key_hi[h]) are visible to the two rows this thread holds.
  // With segment ids, [full_begin, full_end) is narrowed to the key blocks
  // that hold only the one id of this warpgroup's rows, and a block outside
  // takes the id test (MaskUnequalIds) after the window's: no register more
  // through the loop (one more spilled the D 256 consumers, 28-44 bytes).
  int full_begin, full_end;
  int key_lo[2], key_hi[2];

  // The consumer's steps are lambdas over the kernel's locals: as member
  // functions of FwdSm90Consumer (forceinline) they compiled the plain
  // 128 x 176 kernels' key loop to other code.

  // S = Q K^T of the K tile in `stage` (unscaled: the scale folds into exp2).
  // Issued and committed as one wgmma group; the caller waits.
  auto issue_s = [&](float (&s)[Tr::kSAcc], int stage) {
    WgmmaSSOverPanels<Elem, kBlockN, kHeadDim>(s, desc_q, Tr::kQPanelBytes,
                                               DescAdd(desc_k0, stage * Tr::kKvBytes),
                                               Tr::kKvPanelBytes);
    WgmmaCommit();
  };

  // O += P V of the V tile in `stage`. V is [key][D] in smem: MN-major for
  // this product; k16 slice kk starts 16 keys = 2048 bytes further.
  auto issue_pv = [&](const uint32_t (&pa)[Tr::kPSlices][4], int stage) {
    const uint32_t stage_off = stage * Tr::kKvBytes;
#pragma unroll
    for (int kk = 0; kk < Tr::kPSlices; ++kk) {
      Wgmma<Elem, kHeadDim>::RS(o, pa[kk], DescAdd(desc_v0, stage_off + kk * 16 * 128), 1);
    }
    WgmmaCommit();
  };

  // Softcap and ALiBi (score_options.h) of key block n of tile tl, whose
  // warpgroup rows start at wg_row0: element i of this thread is query
  // wg_row0 + 16 warp + g + 8 ((i / 2) % 2), key n kBlockN + 8 (i / 4) + 2 t4
  // + i % 2. A block whose keys all lie on one side of every row's diagonal
  // (all but the diagonal band) takes ALiBi as one term per score and one
  // per thread, row_shift, which the softmax adds to its maxima (units of u;
  // 0 for the other blocks). Not at D 256, whose options consumers it
  // spilled (160 bytes against 32). Indices through Opaque: hoisted out of
  // the key loop, the slope and the row terms would hold registers in the
  // plain path too.
  constexpr bool kAlibiRowShift = Tr::kHeadDim <= 128;
  auto transform_scores = [&](float (&s)[Tr::kSAcc], int n, const FwdSm90TileSpan& tl,
                              int wg_row0, float& row_shift) {
    if (p.softcap > 0.f) SoftcapScores(s, args.units.tanh_in);
    if (p.alibi_slopes == nullptr) return;
    const int bh = Opaque(tl.b) * static_cast<int>(p.num_heads_q) + Opaque(tl.head);
    const float slope_u = AlibiSlopeUnits(p, args.units, bh);
    // The warpgroup's first row minus the block's first key, both on the
    // diagonal's scale: distances in the block lie in [diag - kBlockN + 1,
    // diag + 63].
    const int diag = Opaque(wg_row0) + static_cast<int>(p.seqlen_k - p.seqlen_q) - tl.key_base -
                     n * kBlockN;
    // |t + S - T - key| = |base[row] - column|
    const int row_base = diag + 16 * warp + g - 2 * t4;
    const float base[2] = {static_cast<float>(row_base), static_cast<float>(row_base + 8)};
    if (kAlibiRowShift && diag - (kBlockN - 1) >= 0) {  // keys at or before the diagonal
      AlibiColumnScores(s, slope_u);
      row_shift = -slope_u * base[0];
    } else if (kAlibiRowShift && diag + 63 <= 0) {  // keys at or after it
      AlibiColumnScores(s, -slope_u);
      row_shift = slope_u * base[0];
    } else {
      AlibiScores<Tr::kSAcc, -1>(s, slope_u, base);
    }
  };

  // Dropout's keep bits of key block n (../dropout_bits.cuh): this thread's rows
  // are queries wg_row0 + 16 warp + g, + 8. The Philox calls run before S =
  // Q K_n^T is issued, while S holds no registers: beside S (in the softmax)
  // they spilled the D 256 and 176-key consumers 12-64 bytes. The D 64 tile
  // compares (one LOP3 a word) and packs the words first and transposes the
  // packed bits after the issue, under the wgmma (FwdKeepPack /
  // FwdKeepTranspose): 294 SASS instructions a block against 367, forward
  // 3% faster (H100, D 64 T 4k unmasked and T 8k causal). The others
  // transpose the words first and compare in C (FwdKeepBitsByWords):
  // packing first made the D 128 forward 3% slower, transposed before the
  // issue or under it, and the LOP3 compare 2-4% slower. Indices through
  // Opaque, as for ALiBi.
  const bool dropout = c.dropout;
  constexpr bool kPackKeepBits = Tr::kHeadDim == 64;
  auto keep_bits = [&](uint32_t (&keep)[KeepWords<Tr::kSAcc>()], int n, const FwdSm90TileSpan& tl,
                       int wg_row0) {
    if (!dropout) return;
    const int bh = Opaque(tl.b) * static_cast<int>(p.num_heads_q) + Opaque(tl.head);
    const DropoutMask mask = LoadDropoutMask(p, bh);
    const int64_t row = Opaque(wg_row0) + 16 * warp + g, key0 = tl.key_base + n * kBlockN;
    if constexpr (kPackKeepBits) {
      FwdKeepPack<Tr::kSAcc>(keep, mask, row, key0, t4);
    } else {
      FwdKeepBitsByWords<Tr::kSAcc>(keep, mask, row, key0, t4);
    }
  };
  auto place_keep_bits = [&](uint32_t (&keep)[KeepWords<Tr::kSAcc>()]) {
    if constexpr (kPackKeepBits) {
      if (dropout) FwdKeepTranspose<Tr::kSAcc>(keep, t4);
    }
  };

  // Score options, mask, then the online softmax in place (S becomes
  // unnormalised P in fp32, dropped by Z with dropout after its row sums);
  // returns in correction[] the factor the caller applies to O.
  // seg_chunk(): the warpgroup's query chunk of the pre-pass (b * chunks +
  // row chunk), evaluated only for the id test.
  auto softmax = [&](float (&s)[Tr::kSAcc], const uint32_t (&keep)[KeepWords<Tr::kSAcc>()],
                     int n, float (&correction)[2], auto&& seg_chunk, const FwdSm90TileSpan& tl,
                     int wg_row0) {
    // Before the mask: its -inf must stay -inf (tanh would make it -1).
    float row_shift = 0.f;
    if constexpr (kScoreOptions) transform_scores(s, n, tl, wg_row0, row_shift);
    // Per-element mask only where some (row, key) pair of the warpgroup's
    // block is hidden: the diagonal band, window edges, the ragged last block.
    const int key0 = tl.key_base + n * kBlockN;
    if (key0 < full_begin || key0 + kBlockN > full_end) {
#pragma unroll
      for (int i = 0; i < Tr::kSAcc; ++i) {
        const int key = key0 + (i / 4) * 8 + 2 * t4 + (i & 1);
        const int h = (i / 2) % 2;
        if (key < key_lo[h] || key >= key_hi[h]) s[i] = -INFINITY;
      }
      if (segments && tl.id_test) {
        const int chunk = seg_chunk();
        const int32_t* row_ids = args.seg.q_ids + chunk * 64 + warp * 16 + g;
        const int row_id[2] = {row_ids[0], row_ids[8]};
        const int kv_row = chunk / args.seg.num_q_chunks * args.seg.num_kv_chunks * kBlockN;
        MaskUnequalIds(s, args.seg.kv_ids + kv_row + key0 + 2 * t4, row_id, -INFINITY);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float max_scaled;
      if (fixed_max) {
        // row_max holds the constant; O and l keep their scale.
        max_scaled = row_max[h] * scale_log2;
        correction[h] = 1.f;
      } else {
        // One chain, or four (part[j % 4], merged after), in this thread's
        // frame (the row's max less row_shift, which differs between the
        // quad's threads: it holds their key offset 2 t4), then back to the
        // row's for the quad's max.
        const float prev_max = kScoreOptions ? row_max[h] - row_shift : row_max[h];
        float part[kFourChains ? 4 : 1] = {prev_max};
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const float pair = fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
          float& m = part[kFourChains ? j % 4 : 0];
          m = kFourChains && j < 4 ? pair : fmaxf(m, pair);
        }
        float mx = part[0];
        if constexpr (kFourChains) {
          mx = fmaxf(fmaxf(prev_max, fmaxf(part[0], part[1])), fmaxf(part[2], part[3]));
        }
        if constexpr (kScoreOptions) {
          mx = QuadMax(mx + row_shift);
          max_scaled = ExpOffset(mx - row_shift, scale_log2);
        } else {
          mx = QuadMax(mx);
          max_scaled = ExpOffset(mx, scale_log2);
        }
        correction[h] = RescaleFactor(row_max[h], mx, scale_log2, FastExp2);
        row_max[h] = mx;
        row_sum[h] *= correction[h];
      }
      // Summed into row_sum (one chain) or into sum[] and added after.
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = FastExp2(fmaf(s[4 * j + 2 * h + e], scale_log2, -max_scaled));
          s[4 * j + 2 * h + e] = pv;
          (kFourChains ? sum[(2 * j + e) % 4] : row_sum[h]) += pv;
        }
      }
      if constexpr (kFourChains) row_sum[h] += (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
  };

  // P as the register A operand: n8 tiles 2kk and 2kk + 1 of S form k16
  // slice kk (same fragment layout as mma.sync; see wgmma.cuh). Rounded to
  // Elem as in FlashAttention-2. With dropout the packed pairs are masked by
  // Z (FwdKeepPairMask); l has summed P undropped.
  auto convert_p = [&](const float (&s)[Tr::kSAcc], const uint32_t (&keep)[KeepWords<Tr::kSAcc>()],
                       uint32_t (&pa)[Tr::kPSlices][4]) {
    WithOptionFlag(dropout, [&](auto dropped) {
#pragma unroll
      for (int kk = 0; kk < Tr::kPSlices; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 8 * kk + 2 * r;
          pa[kk][r] = PackFloat2<Elem>(s[i], s[i + 1]);
          if constexpr (dropped) pa[kk][r] &= FwdKeepPairMask<Tr::kSAcc>(keep, i);
        }
      }
    });
  };

  // This warp no longer reads the slot (its wgmma wait has returned).
  auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (lane == 0) MbarArrive(bar);
  };

  auto rescale_o = [&](const float (&correction)[2]) {
    if (fixed_max) return;  // correction is 1
#pragma unroll
    for (int i = 0; i < Tr::kOAcc; ++i) o[i] *= correction[(i / 2) % 2];
  };

  // The pingpong turns (FwdSm90Config).
  auto take_turn = [&] {
    if constexpr (kPingpong) NamedBarrierSync(1 + cg, 256);
  };
  auto pass_turn = [&] {
    if constexpr (kPingpong) NamedBarrierArrive(1 + (cg == kLastGroup ? 0 : cg + 1), 256);
  };

  // The pre-pass's query chunk of the warpgroup rows from wg_row0 (b *
  // chunks + row chunk); a chunk past the last one holds rows past T only
  // (never written): it tests against the last chunk's ids.
  const auto seg_chunk_of = [&](const FwdSm90TileSpan& tl, int wg_row0) {
    return tl.b * args.seg.num_q_chunks + min(wg_row0 / 64, args.seg.num_q_chunks - 1);
  };

  // Key blocks consumed without computing: wait until they land (the ring's
  // phases stay in step), release them, and take their pingpong turns empty
  // (every warpgroup takes the same number of turns per tile).
  const auto skip_blocks = [&](int count) {
    for (int i = 0; i < count; ++i) {
      MbarWait(&k_full[ring.stage], ring.phase);
      MbarWait(&v_full[ring.stage], ring.phase);
      take_turn();
      pass_turn();
      release(&k_empty[ring.stage]);
      release(&v_empty[ring.stage]);
      ring.Advance();
    }
  };

  uint32_t q_phase = 0;
  if (Cfg::kTurnsAcrossTiles && c.cg == Cfg::kLastGroup) NamedBarrierArrive(1, 256);
  for (int item = 0; item < walk.num_items; ++item) {
    FwdSm90Item it;
    if (walk.draws_tiles) {
      MbarWait(c.buf.next_full, item & 1);
      const int tile = *static_cast<volatile int*>(c.buf.next_tile);
      release(c.buf.next_empty);
      if (tile >= args.num_tiles) break;
      it = FwdSm90Item::Whole(tile);
    } else {
      it = walk.ItemAt(item);
      if (it.tile >= args.num_tiles) continue;
    }
    const FwdSm90TileSpan tl = walk.LocateItem(it);
    // The mainloop: resets the row state, then per key block S = Q K^T, the
    // softmax, O += P V, in the kernel's schedule. Here in the kernel body:
    // as a function of its own (forceinline) it compiled to other code.
    const int wg_row0 = tl.row_begin + 64 * cg;
    int64_t lo, hi;
    mask.KeyRange(wg_row0 + 63, wg_row0 + 64, &lo, &hi);
    full_begin = static_cast<int>(lo);
    mask.KeyRange(wg_row0, wg_row0 + 1, &lo, &hi);
    full_end = static_cast<int>(hi);
    // Key blocks of the tile that no row of this warpgroup sees are
    // consumed without computing (at least one block is computed): under a
    // causal mask the first 64 rows of a 192-row tile end a block or more
    // before its last row, and with segment ids a tile's rows may span two
    // documents, each warpgroup's rows one (their key chunks, q_span).
    int wg_n_first = tl.n_first, wg_n_end = tl.n_end;
    if constexpr (kSkipsKeyBlocks) {
      if (wg_row0 < tl.row_end) {
        mask.KeyRange(wg_row0, min(wg_row0 + 64, tl.row_end), &lo, &hi);
        const int n_seen_end = static_cast<int>((hi - tl.key_base + kBlockN - 1) / kBlockN);
        wg_n_end = max(tl.n_first + 1, min(tl.n_end, n_seen_end));
        if (segments && tl.id_test && wg_row0 / 64 < args.seg.num_q_chunks) {
          // Id-test tiles count their key blocks from key 0 (key_base 0).
          const int4 span = args.seg.q_span[seg_chunk_of(tl, wg_row0)];
          wg_n_end = max(tl.n_first + 1, min(wg_n_end, span.y));
          wg_n_first = min(max(tl.n_first, span.x), wg_n_end - 1);
        }
      }
      // Warp-uniform, but derived from the warpgroup index: broadcast, so
      // the compiler keeps the ring's stage and phase (hence the wgmma
      // descriptors) in uniform registers after the skip loop.
      wg_n_end = __shfl_sync(0xffffffffu, wg_n_end, 0);
      wg_n_first = __shfl_sync(0xffffffffu, wg_n_first, 0);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = wg_row0 + warp * 16 + g + 8 * h;
      mask.KeyRange(t, t + 1, &lo, &hi);
      key_lo[h] = static_cast<int>(lo);
      key_hi[h] = static_cast<int>(hi);
      row_max[h] = fixed_max ? args.units.fixed_max : -INFINITY;
      row_sum[h] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < Tr::kOAcc; ++i) o[i] = 0.f;
    const auto seg_chunk = [&] { return seg_chunk_of(tl, wg_row0); };
    if (segments) {
      int seg_begin = 0, seg_end = 0;  // keys of the blocks that skip the id test
      if (!tl.id_test) {
        // One document: its key run, a range like the window's.
        const int4 span = walk.QTileSpan(tl.b, tl.row_begin);
        seg_begin = span.z;
        seg_end = span.w;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          key_lo[h] = max(key_lo[h], seg_begin);
          key_hi[h] = min(key_hi[h], seg_end);
        }
      } else if (wg_row0 / 64 < args.seg.num_q_chunks) {
        const int4 span = args.seg.q_span[seg_chunk()];
        seg_begin = span.z * kBlockN;
        seg_end = span.w * kBlockN;
      }
      full_begin = max(full_begin, seg_begin);
      full_end = min(full_end, seg_end);
    }

    if (tl.n_first < tl.n_end) {
      // Blocks walk from the last: those past wg_n_end are skipped first,
      // those before wg_n_first after the tile's last product.
      const int n_first = wg_n_first;
      if (kTurnsPerTile && cg == kLastGroup) NamedBarrierArrive(1, 256);
      MbarWait(q_full, q_phase);
      q_phase ^= 1;
      if constexpr (kSkipsKeyBlocks) skip_blocks(tl.n_end - wg_n_end);
      const int n_end = wg_n_end;
      float s[Tr::kSAcc];
      uint32_t keep[KeepWords<Tr::kSAcc>()];  // dropout's, of the block in s
      uint32_t pa[Tr::kPSlices][4];
      float correction[2];
      if constexpr (kSchedule == Sm90Schedule::kSerial) {
        // Per key block: S = Q K^T; wait; softmax; O *= c; O += P V; wait.
        for (int n = n_end - 1; n >= n_first; --n) {
          keep_bits(keep, n, tl, wg_row0);
          MbarWait(&k_full[ring.stage], ring.phase);
          WgmmaFence();
          issue_s(s, ring.stage);
          place_keep_bits(keep);
          WgmmaWaitFenced<0>(s);
          release(&k_empty[ring.stage]);
          softmax(s, keep, n, correction, seg_chunk, tl, wg_row0);
          convert_p(s, keep, pa);
          rescale_o(correction);
          MbarWait(&v_full[ring.stage], ring.phase);
          WgmmaFenceOperands(pa);
          WgmmaFence();
          issue_pv(pa, ring.stage);
          WgmmaWaitFenced<0>(o);
          release(&v_empty[ring.stage]);
          ring.Advance();
        }
        if constexpr (kPersistent) release(q_empty);  // every S of the tile is done
        if constexpr (kSkipsKeyBlocks) skip_blocks(n_first - tl.n_first);
      } else {  // kOverlap, kPingpong
        // Software-pipelined by one key block. Prologue: S and P of the first
        // (last-indexed) block. Steady state, for block n with P_{n+1} in pa:
        //   issue S_n = Q K_n^T; issue O += P_{n+1} V_{n+1}
        //   wait S_n (PV still running) -> release K_n; softmax S_n
        //   wait PV -> release V_{n+1}; O *= c_n; pa = P_n
        // Epilogue: O += P V of the last block. The tensor cores run PV while
        // the softmax runs on the CUDA cores and MUFU.
        int n = n_end - 1;
        keep_bits(keep, n, tl, wg_row0);
        MbarWait(&k_full[ring.stage], ring.phase);
        take_turn();
        WgmmaFence();
        issue_s(s, ring.stage);
        pass_turn();
        place_keep_bits(keep);
        WgmmaWaitFenced<0>(s);
        release(&k_empty[ring.stage]);
        // After the tile's last S the next tile's Q may land: released as
        // soon as that S is done, its load starts a softmax and a PV earlier
        // than at the end of the tile.
        if (kPersistent && n == n_first) release(q_empty);
        // (correction is 0 here and O is still 0)
        softmax(s, keep, n, correction, seg_chunk, tl, wg_row0);
        convert_p(s, keep, pa);
        RingPos<kStages> v_ring = ring;  // the V tile of the block whose P is in pa
        ring.Advance();
        for (--n; n >= n_first; --n) {
          keep_bits(keep, n, tl, wg_row0);
          // Both waits come before the fence: a wait loop between the fence
          // and a wgmma makes ptxas inject another fence (C7519).
          MbarWait(&k_full[ring.stage], ring.phase);
          MbarWait(&v_full[v_ring.stage], v_ring.phase);
          take_turn();
          WgmmaFenceOperands(pa);
          WgmmaFenceOperands(o);
          WgmmaFence();  // orders the register writes of pa and o before the wgmmas
          issue_s(s, ring.stage);
          issue_pv(pa, v_ring.stage);
          pass_turn();
          place_keep_bits(keep);
          WgmmaWaitFenced<1>(s);  // S_n done; the PV group may still run
          release(&k_empty[ring.stage]);
          if (kPersistent && n == n_first) release(q_empty);
          softmax(s, keep, n, correction, seg_chunk, tl, wg_row0);
          WgmmaWaitFenced<0>(o, pa);
          release(&v_empty[v_ring.stage]);
          rescale_o(correction);
          convert_p(s, keep, pa);
          v_ring = ring;
          ring.Advance();
        }
        MbarWait(&v_full[v_ring.stage], v_ring.phase);
        take_turn();
        WgmmaFenceOperands(pa);
        WgmmaFenceOperands(o);
        WgmmaFence();
        issue_pv(pa, v_ring.stage);
        pass_turn();
        WgmmaWaitFenced<0>(o);
        release(&v_empty[v_ring.stage]);
        if constexpr (kSkipsKeyBlocks) skip_blocks(n_first - tl.n_first);
        if constexpr (kTurnsPerTile) {
          if (cg == 0) NamedBarrierSync(1, 256);
          // The warpgroups leave the tile together: otherwise the last one's
          // first hand-over of the next tile could join this tile's last turn.
          NamedBarrierSync(1 + Tr::kConsumerWarpgroups, 128 * Tr::kConsumerWarpgroups);
        }
      }
    }
    if (walk.stream_k && it.slot >= 0) {
      const FwdSm90Piece piece = FwdSm90ArrivePiece<Elem, Cfg>(c, it);
      if (FwdSm90FirstPiece<Elem, Cfg>(c)) {
        FwdSm90ParkPiece<Elem, Cfg>(c, piece, rows);
        continue;
      }
      FwdSm90MergePiece<Elem, Cfg>(c, piece, rows);
    }
    FwdSm90Epilogue<Elem, Cfg>(c, tl, rows);
  }
  if (Cfg::kTurnsAcrossTiles && c.cg == 0) NamedBarrierSync(1, 256);
  // The staging must stay valid until the last store has read it (the
  // grid's completion covers the global writes, as for plain stores).
  if (Cfg::kTmaStoreO && c.wg_tid == 0) BulkWaitGroupRead<0>();
}

// Launches the kernel of TileRow with schedule kSchedule and grid form
// kPersistent, with the score-options variant where p needs it (its
// template flag), after opting in to its shared memory once.
template <typename Elem, class TileRow, Sm90Schedule kSchedule, bool kPersistent,
          bool kScoreOptions>
cudaError_t LaunchFwdSm90Kernel(const FwdSm90Launch& launch, cudaStream_t stream) {
  constexpr FwdSm90Tile tile = TileRow::kTile;
  constexpr int smem_bytes = FwdSm90SmemBytes(tile);
  const auto kernel = &FwdSm90Kernel<Elem, TileRow, kSchedule, kPersistent, kScoreOptions>;
  static std::atomic<uint64_t> opted_in{0};
  const cudaError_t err =
      OptInSharedMemoryOnce(reinterpret_cast<const void*>(kernel), opted_in, smem_bytes);
  if (err != cudaSuccess) return err;
  // With segment ids after the pre-pass, which lets it start early.
  return LaunchKernel(kernel, dim3(launch.grid_blocks), dim3(FwdSm90Threads(tile)), smem_bytes,
                      stream, launch.args.seg.q_span != nullptr, launch.args);
}

template <typename Elem, class TileRow, Sm90Schedule kSchedule, bool kPersistent>
cudaError_t LaunchFwdSm90(const FwdSm90Launch& launch, cudaStream_t stream) {
  if (HasSm90ScoreOptions(launch.args.p)) {
    return LaunchFwdSm90Kernel<Elem, TileRow, kSchedule, kPersistent, true>(launch, stream);
  }
  return LaunchFwdSm90Kernel<Elem, TileRow, kSchedule, kPersistent, false>(launch, stream);
}

}  // namespace jax_flash2::cuda::sm90
