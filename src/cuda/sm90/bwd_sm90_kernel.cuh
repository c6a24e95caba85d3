// FlashAttention-2 backward main kernel for Hopper (sm_90a): TMA loads of Q
// and dO into a ring of shared-memory stages synchronised by mbarriers, wgmma
// for all five products, one producer warpgroup (a TMA thread, a warp that
// stages lse2 and Dvec, and a warp that issues the dQ reductions) and two
// consumer warpgroups. It
// replaces BwdMainKernel (bwd_kernel.cuh) only: the preprocess (lse2 = LSE *
// log2(e), Dvec = rowsum(dO * O) - dLSE, dq_acc = 0) and the convert (dq =
// dq_acc * scale) are that file's kernels, and the scratch layout is
// bwd_traits.h's.
//
// A tile is (key block of kBlockN = 128 keys, batch, K/V head); a CTA takes
// one tile, or in the persistent grid (unmasked D = 64, bwd_sm90.h) walks
// every gridDim.x-th tile with its rings and barriers running on, so that
// the next tile's K, V and first Q, dO load under this tile's epilogue.
// Unmasked calls whose tiles do not fill whole rounds of the SMs end in a
// stream-K tail: the last two rounds' tiles shared out as query blocks over
// the grid's last sm_count CTAs, a tile cut between two of them summing its
// dK, dV through the scratch (bwd_sm90.h).
// Consumer warpgroup c owns keys [64 c, 64 c + 64) of a tile and keeps their
// dK, dV (64 x D fp32) in registers while the CTA loops over every query head
// of the K/V head's group and every query block of kBlockM rows (128 at D =
// 64, 64 at D = 128; bwd_sm90.h) that can see the key block (so GQA sums dK,
// dV over the group in registers, as the sm80 kernel does). Per query block, in warpgroup
// c (64 keys x kBlockM queries):
//   S^T  = K_c Q^T                    wgmma SS, both operands K-major (over D)
//   dP^T = V_c dO^T                   wgmma SS
//   P^T  = exp2(S^T * scale * log2(e) - lse2)   (0 where masked)
//   dS^T = P^T o (dP^T - Dvec)        (o: elementwise)
//   dV  += P^T dO                     wgmma RS: P^T from registers, dO MN-major
//   dK  += dS^T Q                     wgmma RS: dS^T from registers, Q MN-major
//   dQ   = dS K                       wgmma SS from the dS^T tile in smem (both
//                                     operands MN-major), staged in smem as fp32
//                                     and added into dq_acc by one bulk tensor
//                                     reduction (cp.reduce.async.bulk.tensor)
// P^T and dS^T come out of the S^T and dP^T accumulators in the register
// A-fragment layout of the next products (the forward's P V trick), which is
// why the kernel computes the transposed products, keys as the M dimension.
//
// dQ needs dS over all 128 keys of the block, so each warpgroup reads both
// halves of dS^T from shared memory: a named barrier over both warpgroups each
// query block, and two dS^T buffers so one warpgroup may write the next
// block's while the other still reads this one's. The warpgroups split dQ
// into 64 x 64 tiles: by columns at D = 128, by queries at D = 64. (Splitting
// it by keys, each warpgroup over its own 64, needs no barrier but reduces
// twice the bytes into dq_acc; it measured slower.)
//
// What made it fast (docs/design.md has the numbers): no branch per exponential
// (the mask compares 32-bit query bounds, only on blocks that need it); dQ
// reduced by the copy engine from shared memory, one instruction per 32
// columns, where float2 atomics from every thread took a third of the time;
// lse2 and Dvec staged in shared memory by the producer's row warp, so the
// consumers never wait on L2 for them. Staging them with the copy engine was
// what racecheck flagged once; plain stores published by per-thread mbarrier
// arrivals are clean. Shared memory reached as shared memory (STS/LDS; see
// AlignedDynamicSmem), with conflict-free dQ staging stores, and the lse2 /
// Dvec loads issued ahead of the wgmmas: +8-13% together.
//
// Softcap and ALiBi (score_options.h, kernels with kScoreOptions): S^T
// transformed before the exponentials as in the forward, and dS^T times the
// cap's derivative 1 - th^2, computed beside the exponential and parked in
// shared memory until dS^T (see the loop).
// Dropout (../dropout_bits.cuh, kernels with kScoreOptions), with Z the forward's
// keep mask regenerated: dV += (Z o P^T) dO (1 / (1 - rate) in the
// epilogue) and dS^T = P^T o (Z o dP^T / (1 - rate) - Dvec), Dvec being
// rowsum(dO o O) of the dropped O.
// Masking as in the sm80 backward: query blocks outside the key block's
// window are skipped (QueryRange), and only blocks not fully visible to a
// warpgroup's 64 keys pay for the per-element WindowMask predicate. TMA
// zero-fills rows past T (Q, dO) and S (K, V); query rows past T have lse2 =
// +inf and Dvec = 0 (preprocess), so their P and dS are 0; keys past S are
// masked, and their dK, dV rows are never written.
//
// Deterministic backward (args.dq_turns; Sm90BackwardDqTurns, bwd_sm90.h):
// the dQ warp takes turns with the other key blocks of the (batch, K/V head)
// on a counter per (batch, query head, query block), in descending key block
// order, and tiles take a group's key blocks from the last (KeyBlockAt); no
// stream-K; no segment-id narrowing of the tile's query blocks.
//
// Segment ids (segments.cuh): a tile's query blocks are narrowed to those
// whose ids may match its keys' (the pre-pass's per-tile span), and a
// warpgroup's fully visible blocks to those holding only its keys' one id;
// the others take the per-element id test after the window's. Rows that see
// no key have LSE -inf, hence lse2 = +inf and P = 0: no gradient.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../flash_mask.h"
#include "../sm80/primitives.cuh"
#include "bwd_sm90.h"
#include "bwd_sm90_common.cuh"
#include "dq_order.h"
#include "../dropout_bits.cuh"
#include "primitives.cuh"
#include "segments.cuh"
#include "score_options.h"
#include "wgmma.cuh"

namespace jax_flash2::cuda::sm90 {

template <int kHeadDim_>
struct BwdSm90Traits {
  static constexpr BwdSm90Tile kTile = BwdSm90TileFor(kHeadDim_);
  static_assert(kTile.head_dim == kHeadDim_, "no sm90 backward tile for this head dim");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kPanelCols = 64;  // one 128-byte swizzled row of 2-byte elements
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // one K or V tile
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q or dO tile
  static constexpr int kKvPanelBytes = kBlockN * 128;
  static constexpr int kQPanelBytes = kBlockM * 128;
  // dS^T: [key][query], in panels of 64 queries (128-byte rows) of kBlockN keys.
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsPanelBytes = kBlockN * 128;
  static constexpr int kAcc = kHeadDim / 2;       // fp32 dK (or dV) accumulators
  static constexpr int kSAcc = kBlockM / 2;       // fp32 S^T (or dP^T) accumulators
  static constexpr int kSlices = kBlockM / 16;    // k16 slices of P^T, dS^T over queries
  // dQ (kBlockM x D) is split between the warpgroups into 64 x 64 tiles: by
  // queries at D = 64 (block_m = 128), by columns at D = 128 (block_m = 64).
  static constexpr bool kDqByQueries = kBlockM == 128;
  // Consumer warpgroup c's tile: queries [DqRow0(c), +64) of the block =
  // dS^T panel DqRow0(c) / 64, columns [DqCol0(c), +64) = K panel DqCol0 / 64.
  static constexpr int DqRow0(int c) { return kDqByQueries ? 64 * c : 0; }
  static constexpr int DqCol0(int c) { return kDqByQueries ? 0 : 64 * c; }
  // A warpgroup's dQ (64 queries x 64 columns, fp32) staged for the bulk
  // reduction: two panels of 32 columns (one 128-byte swizzled row each).
  static constexpr int kDqTileBytes = 64 * 64 * 4;
  static constexpr int kDqPanelBytes = 64 * 128;
  // dV staged in the dS^T buffers (else in a tile of its own); bwd_sm90.h.
  static constexpr bool kDvInDs = BwdSm90DvStagedInDs(kTile);
  static_assert(kHeadDim == 64 || kHeadDim == 128);
  static_assert(kDvInDs ? kPanels == 1 && kBlockM == 128 : kPanels == 2 && kBlockM == 64);
  static_assert(kBlockM * kHeadDim == 64 * 128 && kBlockN == 64 * kBwdConsumerWarpgroups);
  static_assert(kBlockM <= kBwdRowPad && kBwdRowPad % kBlockM == 0);
};

// Shared-memory carve-up (byte offsets from the 1024-aligned base); every
// swizzled tile and panel starts on a 1024-byte boundary.
template <class Tr>
struct BwdSm90Smem {
  static constexpr int kK = 0;
  static constexpr int kV = kK + Tr::kKvBytes;
  static constexpr int kQ = kV + Tr::kKvBytes;
  static constexpr int kDo = kQ + Tr::kStages * Tr::kQBytes;
  static constexpr int kDs = kDo + Tr::kStages * Tr::kQBytes;
  static constexpr int kDq = kDs + 2 * Tr::kDsBytes;  // [warpgroup] dQ tiles
  // dV's staging tile where the dS^T buffers have no room for it (D = 128):
  // [warpgroup] 64 keys x D.
  static constexpr int kDvStage = kDq + kBwdConsumerWarpgroups * Tr::kDqTileBytes;
  static constexpr int kDvStageBytes = Tr::kDvInDs ? 0 : Tr::kKvBytes;
  // [stage] lse2 then Dvec of the stage's query block (kBlockM floats each).
  static constexpr int kRows = kDvStage + kDvStageBytes;
  static constexpr int kRowsStageBytes = 2 * Tr::kBlockM * 4;
  static constexpr int kBars = kRows + Tr::kStages * kRowsStageBytes;
  // After the barriers (kv_full, kv_empty, then q_full and q_empty per
  // stage): a stream-K piece's role (an int in 8 bytes) and the CTA's walk
  // (8 ints; see the kernel).
  static constexpr int kPieceRole = kBars + (2 + 2 * Tr::kStages) * 8;
  static constexpr int kWalk = kPieceRole + 8;
  static constexpr int kWalkBytes = 32;
  static_assert(kWalk + kWalkBytes + 1024 <= BwdSm90SmemBytes(Tr::kTile));
  static_assert(kV % 1024 == 0 && kQ % 1024 == 0 && kDo % 1024 == 0 && kDs % 1024 == 0);
  static_assert(kDq % 1024 == 0 && Tr::kDqTileBytes % 1024 == 0 && kDvStage % 1024 == 0);
  static_assert(Tr::kQBytes % 1024 == 0 && Tr::kDsBytes % 1024 == 0 && kBars % 8 == 0);
};

// Tile t (BwdSm90Args): key block n_begin of (b, kv_head), and the query
// blocks [m_block_begin, + num_m_blocks) that may see one of its keys, once
// per query head of the group: num_iters iterations, heads outer.
struct BwdSm90TileSpan {
  int n_begin, b, kv_head;
  int m_block_begin, num_m_blocks, num_iters;
};

// The iteration that step `it` of a tile's walk visits: `it` itself, or
// RotatedDqVisit's in the rotated dQ order. Derived from n_begin here (a
// field of the tile spilled the producer warps' 24 registers more).
template <int kBlockN>
__device__ __forceinline__ int VisitOf(const BwdSm90TileSpan& tile, int it, bool rotated) {
  return rotated ? RotatedDqVisit(it, tile.n_begin / kBlockN, tile.num_iters) : it;
}

// A consumer thread: warpgroup cg owns keys [64 cg, 64 cg + 64) of a tile,
// warp w of it 16 keys (accumulator rows g, g + 8), lane column pair t4.
struct BwdSm90Thread {
  int cg, wg_tid, warp, lane, g, t4;
};

// A stream-K piece (BwdSm90Tile): the first of a tile's two pieces to get
// here parks its dK, dV (BwdSm90ParkPiece); the second adds them to its own
// (BwdSm90AddPiece) and goes on to the epilogue. Both warpgroups take the
// same role (barrier 7 spans them); a thread's registers go to [register]
// [consumer thread], so each store and load is one coalesced row.
struct BwdSm90Piece {
  int* ready;
  float* partial;
};

template <int kHeadDim>
__device__ __forceinline__ BwdSm90Piece BwdSm90ArrivePiece(const BwdSm90Args& args,
                                                           const BwdSm90Thread& me,
                                                           int* piece_role, int slot) {
  int* arrivals = args.sk_flags + 2 * slot;
  BwdSm90Piece piece;
  piece.ready = arrivals + 1;
  piece.partial = args.sk_partial + slot * BwdSm90SlotFloats(kHeadDim) + 128 * me.cg + me.wg_tid;
  if (me.cg == 0 && me.wg_tid == 0) *piece_role = atomicAdd(arrivals, 1);
  NamedBarrierSync(7, 256);
  return piece;
}

template <class Tr>
__device__ __forceinline__ void BwdSm90ParkPiece(const BwdSm90Piece& piece,
                                                 const BwdSm90Thread& me,
                                                 const float (&acc_dk)[Tr::kAcc],
                                                 const float (&acc_dv)[Tr::kAcc]) {
  constexpr int kRow = 128 * kBwdConsumerWarpgroups;
  float* partial = piece.partial;
#pragma unroll
  for (int r = 0; r < Tr::kAcc; ++r) {
    __stcg(partial + r * kRow, acc_dk[r]);
    __stcg(partial + (Tr::kAcc + r) * kRow, acc_dv[r]);
  }
  __threadfence();
  NamedBarrierSync(7, 256);
  if (me.cg == 0 && me.wg_tid == 0) StoreRelease(piece.ready, 1);
}

template <class Tr>
__device__ __forceinline__ void BwdSm90AddPiece(const BwdSm90Piece& piece,
                                                const BwdSm90Thread& me,
                                                float (&acc_dk)[Tr::kAcc],
                                                float (&acc_dv)[Tr::kAcc]) {
  constexpr int kRow = 128 * kBwdConsumerWarpgroups;
  const float* partial = piece.partial;
  // The other piece is storing already (it arrived first): a short wait.
  if (me.cg == 0 && me.wg_tid == 0) {
    while (LoadAcquire(piece.ready) == 0) {
    }
  }
  NamedBarrierSync(7, 256);
#pragma unroll
  for (int r = 0; r < Tr::kAcc; ++r) {
    acc_dk[r] += __ldcg(partial + r * kRow);
    acc_dv[r] += __ldcg(partial + (Tr::kAcc + r) * kRow);
  }
}

// The epilogue: dK = scale * acc_dk, dV = acc_dv into [B, S, K, D] (dk and
// dv share k's strides), staged in the TMA's swizzled layout and written by
// TMA stores: direct stores of the accumulator fragments are 4-byte pieces
// of 8 rows per instruction. The staging is this warpgroup's own key rows
// of the dS^T buffers (dK panel i in buffer i; dV at D = 64 in buffer 0's
// second panel, at D = 128 in a tile of its own), not K and V, so the next
// tile's K and V load meanwhile. The other warpgroup's dQ products read
// these rows too: barrier 7 over both warpgroups first. Keys no query sees
// get zeros (num_iters == 0); keys past S are dropped by the copy engine.
// Named barriers: 7 over both consumer warpgroups, 8 + cg over warpgroup cg
// (1 and 3-6 are the loop's). The caller has waited for the warpgroup's
// previous stores to read their staging.
template <typename Elem, class Tr>
__device__ __forceinline__ void BwdSm90Epilogue(const BwdSm90Args& args,
                                                const BwdSm90Thread& me,
                                                const BwdSm90TileSpan& tile,
                                                unsigned char* s_dk_stage, int dk_panel_stride,
                                                unsigned char* s_dv_stage, int dv_panel_stride,
                                                const float (&acc_dk)[Tr::kAcc],
                                                const float (&acc_dv)[Tr::kAcc], bool dropout,
                                                int seqlen_k) {
  const FlashParams& p = args.p;
  const int key0 = tile.n_begin + 64 * me.cg;
  NamedBarrierSync(7, 256);
  const float dk_scale[2] = {p.softmax_scale, p.softmax_scale};
  // dV = (Z o P)^T dO / (1 - rate) with dropout.
  const float dv_scale[2] = {dropout ? p.dropout_scale : 1.f, dropout ? p.dropout_scale : 1.f};
  StageAccumulatorTile<Elem>(s_dk_stage, dk_panel_stride, me.warp, me.lane, acc_dk, dk_scale);
  StageAccumulatorTile<Elem>(s_dv_stage, dv_panel_stride, me.warp, me.lane, acc_dv, dv_scale);
  FenceProxyAsync();
  NamedBarrierSync(8 + me.cg, 128);
  if (me.wg_tid == 0 && key0 < seqlen_k) {
    const RowHeadCoords at(args.kv_grad_heads_inner, key0, tile.kv_head);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      TmaStore4d(s_dk_stage + panel * dk_panel_stride, &args.tma_dk, panel * Tr::kPanelCols,
                 at.c1, at.c2, tile.b);
      TmaStore4d(s_dv_stage + panel * dv_panel_stride, &args.tma_dv, panel * Tr::kPanelCols,
                 at.c1, at.c2, tile.b);
    }
    BulkCommitGroup();
  }
}

// The producer's TMA thread: per item, K and V of the tile, then Q and dO of
// each query block into the ring.
template <class Tr, class Walk, class ItemAt, class Locate, class QueryBlockAt>
__device__ __forceinline__ void BwdSm90LoadTiles(const BwdSm90Args& args, const Walk* walk,
                                                 const ItemAt& item_at, const Locate& locate,
                                                 const QueryBlockAt& query_block,
                                                 unsigned char* s_k, unsigned char* s_v,
                                                 unsigned char* s_q, unsigned char* s_do,
                                                 uint64_t* kv_full, uint64_t* kv_empty,
                                                 uint64_t* q_full, uint64_t* q_empty) {
  constexpr int kStages = Tr::kStages;
  RingPos<kStages> ring;
  int kv_loads = 0;  // items whose K and V this thread loaded
  for (int item_index = 0; item_index < walk->num_items; ++item_index) {
    const auto item = item_at(item_index);
    const BwdSm90TileSpan tile = locate(item.tile);
    const int it_end = min(item.it_end, tile.num_iters);
    if (item.it_begin >= it_end) continue;  // nothing to load (dK = dV = 0)
    if (kv_loads == 0) {
      // (The Q, dO and dQ maps are zeroed when T = 0: no tile then gets here.)
      PrefetchTensorMap(&args.tma_q);
      PrefetchTensorMap(&args.tma_do);
      PrefetchTensorMap(&args.tma_k);
      PrefetchTensorMap(&args.tma_v);
      PrefetchTensorMap(&args.tma_dq);
    }
    // K and V free? (The first tile finds them free.) The consumers free
    // them after their last products, so this tile's loads run under the
    // previous tile's dK, dV epilogue.
    MbarWait(kv_empty, (kv_loads & 1) ^ 1);
    ++kv_loads;
    const int kv_head = tile.kv_head, n_begin = tile.n_begin;
    MbarArriveExpectTx(kv_full, 2 * Tr::kKvBytes);
    LoadKvTile(args, s_k, s_v, kv_full, Tr::kPanels, Tr::kKvPanelBytes, n_begin, kv_head,
               tile.b);
    for (int it = item.it_begin; it < it_end; ++it) {
      const auto [h, m_begin] = query_block(tile, it);
      // Slot free? (Parity phase ^ 1: the first pass finds every slot free.)
      MbarWait(&q_empty[ring.stage], ring.phase ^ 1);
      MbarArriveExpectTx(&q_full[ring.stage], 2 * Tr::kQBytes);
      LoadQDoBlock(args, s_q + ring.stage * Tr::kQBytes, s_do + ring.stage * Tr::kQBytes,
                   &q_full[ring.stage], Tr::kPanels, Tr::kQPanelBytes, m_begin, h, tile.b);
      ring.Advance();
    }
  }
}

// The row warp: lse2 and Dvec of each stage's query block into shared
// memory by plain loads and stores, published by the lanes' q_full
// arrivals (release; the consumers' wait acquires). The consumers read
// them there, with the L2 latency paid here, ahead of them. (Staged by
// the copy engine they raced with the consumers' plain loads in
// racecheck's eyes; read from global memory by the consumers, their
// latency stalled the softmax.) lse2 and Dvec rows are t_pad long, a
// multiple of kBlockM, so the rows of a block are always in bounds.
template <class Tr, class Walk, class ItemAt, class Locate>
__device__ __forceinline__ void BwdSm90StageRows(const BwdSm90Args& args, const Walk* walk,
                                                 const ItemAt& item_at, const Locate& locate,
                                                 float* s_rows, uint64_t* q_full,
                                                 uint64_t* q_empty) {
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kStages = Tr::kStages;
  const FlashParams& p = args.p;
  const int lane = threadIdx.x % 32;
  RingPos<kStages> ring;
  for (int item_index = 0; item_index < walk->num_items; ++item_index) {
    const auto item = item_at(item_index);
    const BwdSm90TileSpan tile = locate(item.tile);
    const int it_end = min(item.it_end, tile.num_iters);
    // The tile's first query block, of its group's first head: the
    // iterations (query_block) walk heads outer, blocks inner.
    const int64_t first_row =
        (static_cast<int64_t>(tile.b) * p.num_heads_q +
         tile.kv_head * static_cast<int>(p.group_size)) * args.t_pad +
        tile.m_block_begin * kBlockM;
    for (int it = item.it_begin; it < it_end; ++it) {
      // float4 x of the stage: lse2 rows 4 x.. for x < kBlockM / 4, then
      // Dvec's.
      constexpr int kVecs = kBlockM / 4;
      const int visit = VisitOf<Tr::kBlockN>(tile, it, args.rotated_dq);
      const int64_t row0 = first_row + (visit / tile.num_m_blocks) * args.t_pad +
                           (visit % tile.num_m_blocks) * kBlockM;
      float4 v[kVecs / 16];
#pragma unroll
      for (int k = 0; k < kVecs / 16; ++k) {
        const int x = lane + 32 * k;
        const float* src = (x < kVecs ? args.lse2 : args.dvec) + row0 + 4 * (x % kVecs);
        v[k] = __ldg(reinterpret_cast<const float4*>(src));
      }
      MbarWait(&q_empty[ring.stage], ring.phase ^ 1);
#pragma unroll
      for (int k = 0; k < kVecs / 16; ++k) {
        reinterpret_cast<float4*>(s_rows + ring.stage * 2 * kBlockM)[lane + 32 * k] = v[k];
      }
      MbarArrive(&q_full[ring.stage]);
      ring.Advance();
    }
  }
}

// The dQ warp: hands each consumer warpgroup's staged dQ tile (see
// stage_dq) to the copy engine as two bulk tensor reductions of 32
// columns. Named barriers of 128 + 32 threads: 3 + c, tile c staged
// (the consumers arrive, this warp waits); 5 + c, tile c read by the
// copy engine and free again (this warp arrives, the consumers wait).
// Issued by a consumer thread instead, behind a barrier of its
// warpgroup and a wait for the previous reduction's read, they cost
// the consumers 4-7% at D = 128.
// Deterministic (args.dq_turns, Sm90BackwardDqTurns): before a query
// block's reductions, lane 0 waits for its turn on the block's
// counter; once they have landed (checked when the next block's
// staging is due, so the consumers never wait for it), it passes the
// turn on.
template <class Tr, class Walk, class ItemAt, class Locate, class QueryBlockAt>
__device__ __forceinline__ void BwdSm90ReduceDq(const BwdSm90Args& args, const Walk* walk,
                                                const ItemAt& item_at, const Locate& locate,
                                                const QueryBlockAt& query_block,
                                                const WindowMask& mask, unsigned char* s_dq) {
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  const FlashParams& p = args.p;
  const int lane = threadIdx.x % 32;
  for (int c = 0; c < kBwdConsumerWarpgroups; ++c) NamedBarrierArrive(5 + c, 160);
  bool first = true;
  int* turn_counter = nullptr;  // lane 0: the counter of reductions in flight
  int next_turn = 0;
  for (int item_index = 0; item_index < walk->num_items; ++item_index) {
    const auto item = item_at(item_index);
    const BwdSm90TileSpan tile = locate(item.tile);
    const int it_end = min(item.it_end, tile.num_iters);
    for (int it = item.it_begin; it < it_end; ++it) {
      const auto [h, m_begin] = query_block(tile, it);
      // dQ tiles 0 and 1 free again once the previous query block's
      // groups are read (the oldest first): one arrival per staging
      // after the first, so the CTA's last tiles are never handed back.
      if (!first) {
        static_assert(kBwdConsumerWarpgroups == 2);
        if (lane == 0) BulkWaitGroupRead<1>();
        __syncwarp();
        NamedBarrierArrive(5, 160);
        if (lane == 0) BulkWaitGroupRead<0>();
        __syncwarp();
        NamedBarrierArrive(6, 160);
      }
      first = false;
      if (lane == 0 && turn_counter != nullptr) {
        BulkWaitGroup<0>();
        PassDqTurn(turn_counter, next_turn);
        turn_counter = nullptr;
      }
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
        const int row0 = m_begin + Tr::DqRow0(c);
        const int col0 = Tr::DqCol0(c);
        unsigned char* dq_tile = s_dq + c * Tr::kDqTileBytes;
        NamedBarrierSync(3 + c, 160);  // the warpgroup's tile is staged
        if (lane == 0) {
          if (c == 0 && args.dq_turns != nullptr) {
            turn_counter = args.dq_turns +
                           (tile.b * static_cast<int>(p.num_heads_q) + h) * args.num_q_blocks +
                           m_begin / kBlockM;
            const int n = tile.n_begin / kBlockN;
            const int turn =
                args.rotated_dq
                    ? RotatedDqTurn(n, VisitOf<kBlockN>(tile, it, true), args.num_n_blocks)
                    : LastKeyBlockOf(mask, m_begin, kBlockM, kBlockN, args.num_n_blocks) - n;
            WaitDqTurn(turn_counter, turn);
            next_turn = turn + 1;
          }
          TmaReduceAdd4d(dq_tile, &args.tma_dq, col0, h, row0, tile.b);
          TmaReduceAdd4d(dq_tile + Tr::kDqPanelBytes, &args.tma_dq, col0 + 32, h, row0,
                         tile.b);
          BulkCommitGroup();
        }
        __syncwarp();
      }
    }
  }
  // The reductions must land before the convert kernel reads dq_acc
  // (and before the last turn is passed on).
  if (lane == 0) {
    BulkWaitGroup<0>();
    if (turn_counter != nullptr) PassDqTurn(turn_counter, next_turn);
  }
}

// kScoreOptions: softcap, ALiBi and / or dropout (score_options.h). A template
// flag, not a runtime branch: the branch alone cost the plain D = 64 kernel 8-9%
// (spills in its main loop; H200, B4 T=S=4096 H32, causal or not).
template <typename Elem, int kHeadDim, bool kScoreOptions>
__global__ void __launch_bounds__(kBwdSm90Threads, 1)
    BwdSm90Kernel(const __grid_constant__ BwdSm90Args args) {
  using Tr = BwdSm90Traits<kHeadDim>;
  using Smem = BwdSm90Smem<Tr>;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;

  unsigned char* smem = AlignedDynamicSmem();
  unsigned char* s_k = smem + Smem::kK;
  unsigned char* s_v = smem + Smem::kV;
  unsigned char* s_q = smem + Smem::kQ;
  unsigned char* s_do = smem + Smem::kDo;
  unsigned char* s_ds = smem + Smem::kDs;
  unsigned char* s_dq = smem + Smem::kDq;
  float* s_rows = reinterpret_cast<float*>(smem + Smem::kRows);
  // kv_full: K and V of a tile landed; kv_empty: every consumer thread is
  // done with them. q_full[s]: Q, dO, lse2, Dvec of stage s landed;
  // q_empty[s]: every consumer thread is done with them.
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem + Smem::kBars);
  uint64_t* kv_empty = kv_full + 1;
  uint64_t* q_full = kv_full + 2;
  uint64_t* q_empty = q_full + kStages;
  int* piece_role = reinterpret_cast<int*>(smem + Smem::kPieceRole);  // a stream-K arrival

  const FlashParams& p = args.p;
  const int seqlen_k = static_cast<int>(p.seqlen_k);
  const WindowMask mask = MakeWindowMask(p);

  // Tile t (BwdSm90TileSpan). Every role walks the same tiles, so the rings
  // and barriers run on from tile to tile.
  using Tile = BwdSm90TileSpan;
  const auto locate = [&](int t) {
    Tile tile;
    tile.n_begin = KeyBlockAt(t % args.num_n_blocks, args.key_block_flip) * kBlockN;
    const int bk = t / args.num_n_blocks;
    tile.b = bk % static_cast<int>(p.batch);
    tile.kv_head = bk / static_cast<int>(p.batch);
    int64_t q_begin, q_end;
    mask.QueryRange(tile.n_begin, min(tile.n_begin + kBlockN, seqlen_k), p.seqlen_q, &q_begin,
                    &q_end);
    tile.m_block_begin = static_cast<int>(q_begin / kBlockM);
    tile.num_m_blocks = q_end > q_begin
                            ? static_cast<int>((q_end + kBlockM - 1) / kBlockM) - tile.m_block_begin
                            : 0;
    if (args.seg.kv_span != nullptr && args.dq_turns == nullptr) {
      // Segment ids: only the query blocks whose ids may match an id of the
      // tile's keys. (Not in the deterministic backward, whose dQ order
      // needs the window's contiguous runs of key blocks per query block:
      // there the id test masks the others.)
      int m_end = tile.m_block_begin + tile.num_m_blocks;
      NarrowToTileSpan(
          args.seg.kv_tiles[tile.b * args.seg.num_kv_tiles + tile.n_begin / kBlockN],
          &tile.m_block_begin, &m_end);
      tile.num_m_blocks = m_end - tile.m_block_begin;
    }
    tile.num_iters = tile.num_m_blocks * static_cast<int>(p.group_size);
    return tile;
  };
  // Iteration it of a tile, in every role's loop: query head h of the group,
  // query rows from m_begin.
  struct QueryBlock {
    int h;
    int m_begin;
  };
  const auto query_block = [&](const Tile& tile, int it) {
    const int v = VisitOf<kBlockN>(tile, it, args.rotated_dq);
    return QueryBlock{tile.kv_head * static_cast<int>(p.group_size) + v / tile.num_m_blocks,
                      (tile.m_block_begin + v % tile.num_m_blocks) * kBlockM};
  };

  // The CTA's walk, the same in every role: items 0 .. num_items - 1, each
  // iterations [it_begin, it_end) of a tile (clipped to its num_iters),
  // slot -1 for a whole tile, else the stream-K slot where its two pieces
  // meet (BwdSm90Tile). First the whole tiles blockIdx.x, + gridDim.x, ...
  // below sk_first_tile (num_tiles without stream-K); then, in one of the
  // grid's last sk_ctas CTAs, its range [u0, u1) of the tail's iterations
  // (I per tile): the piece that begins tile u1 / I (it ends the range, and
  // the next CTA computes the rest of that tile last, so this one goes
  // first), the whole tiles between, and last the piece that ends tile
  // u0 / I (its beginning was the previous CTA's first piece).
  struct Item {
    int tile, it_begin, it_end, slot;
  };
  // The walk's bounds, computed by one thread into shared memory and read
  // per item: kept in registers, they spilled the producer's 24 (setmaxnreg).
  struct Walk {
    int num_whole, num_items, sk;  // sk: stream-K index, < 0: none
    int tail_tile, tail_end, mid_begin, head_tile, head_begin;
  };
  static_assert(sizeof(Walk) == Smem::kWalkBytes);
  Walk* walk = reinterpret_cast<Walk*>(smem + Smem::kWalk);
  constexpr int kAllIters = 1 << 30;
  const auto item_at = [&](int i) {
    const Walk& w = *walk;
    if (i < w.num_whole) {
      return Item{static_cast<int>(blockIdx.x + i * gridDim.x), 0, kAllIters, -1};
    }
    i -= w.num_whole;
    if (w.tail_end > 0) {
      if (i == 0) return Item{w.tail_tile, 0, w.tail_end, w.sk};
      --i;
    }
    if (i < w.tail_tile - w.mid_begin) return Item{w.mid_begin + i, 0, kAllIters, -1};
    return Item{w.head_tile, w.head_begin, kAllIters, w.sk - 1};
  };

  if (threadIdx.x == 0) {
    MbarInit(kv_full, 1);
    MbarInit(kv_empty, 128 * kBwdConsumerWarpgroups);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      // The TMA thread's expect-tx arrival and one per lane of the row warp.
      MbarInit(&q_full[s], 1 + 32);
      // Every consumer thread arrives after its last read of the stage.
      MbarInit(&q_empty[s], 128 * kBwdConsumerWarpgroups);
    }
    FenceBarrierInit();
    Walk w{};
    const int whole_end = args.sk_ctas > 0 ? args.sk_first_tile : args.num_tiles;
    const int cta = static_cast<int>(blockIdx.x);
    w.num_whole = cta < whole_end ? (whole_end - 1 - cta) / static_cast<int>(gridDim.x) + 1 : 0;
    w.num_items = w.num_whole;
    w.sk = cta - (static_cast<int>(gridDim.x) - args.sk_ctas);
    if (args.sk_ctas > 0 && w.sk >= 0) {
      // Every tile alike (no mask): all query blocks of every head of the group.
      const int iters = static_cast<int>(BwdSm90FullTileIters(p.seqlen_q, p.group_size, kBlockM));
      const int64_t units = static_cast<int64_t>(args.num_tiles - args.sk_first_tile) * iters;
      const int64_t u0 = units * w.sk / args.sk_ctas;
      const int64_t u1 = units * (w.sk + 1) / args.sk_ctas;
      w.head_tile = args.sk_first_tile + static_cast<int>(u0 / iters);
      w.head_begin = static_cast<int>(u0 % iters);
      w.tail_tile = args.sk_first_tile + static_cast<int>(u1 / iters);
      w.tail_end = static_cast<int>(u1 % iters);
      w.mid_begin = w.head_tile + (w.head_begin > 0);
      w.num_items += (w.tail_end > 0) + (w.tail_tile - w.mid_begin) + (w.head_begin > 0);
    }
    *walk = w;
  }
  __syncthreads();
  // With segment ids the pre-pass kernel runs just before (LaunchBwdSm90Kernel)
  // and this grid may start under its end. Unconditional: a no-op for a plain
  // launch (as in the forward).
  WaitForPrimaryGrid();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    SetMaxNRegDec<kBwdProducerRegs>();
    if (threadIdx.x == 0) {
      BwdSm90LoadTiles<Tr>(args, walk, item_at, locate, query_block, s_k, s_v, s_q, s_do,
                           kv_full, kv_empty, q_full, q_empty);
    } else if (threadIdx.x / 32 == 1) {
      BwdSm90StageRows<Tr>(args, walk, item_at, locate, s_rows, q_full, q_empty);
    } else if (threadIdx.x / 32 == 2) {
      BwdSm90ReduceDq<Tr>(args, walk, item_at, locate, query_block, mask, s_dq);
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  SetMaxNRegInc<kBwdConsumerRegs>();
  const int cg = warpgroup - 1;  // consumer warpgroup: keys [64 cg, 64 cg + 64) of the block
  const int wg_tid = threadIdx.x % 128;
  const int warp = wg_tid / 32;  // 16 keys (accumulator rows) per warp
  const int lane = wg_tid % 32;
  const int g = lane / 4;        // accumulator row (and g + 8)
  const int t4 = lane % 4;       // accumulator column pair
  const BwdSm90Thread me{cg, wg_tid, warp, lane, g, t4};
  // The exp2 factor per unit of score (score_options.h).
  const float scale_log2 = kScoreOptions ? args.units.log2 : p.softmax_scale_log2;
  const bool dropout = kScoreOptions && p.dropout_seeds != nullptr;

  // Descriptors of stage 0 / buffer 0: K and V rows of this warpgroup
  // (K-major, for S^T and dP^T), Q and dO (K-major for S^T and dP^T, MN-major
  // for dK and dV), the dS^T tile and K as the MN-major operands of dQ.
  const uint64_t desc_k_rows = MakeDescK(SmemAddr(s_k) + 64 * cg * 128);
  const uint64_t desc_v_rows = MakeDescK(SmemAddr(s_v) + 64 * cg * 128);
  const uint64_t desc_q_k = MakeDescK(SmemAddr(s_q));
  const uint64_t desc_do_k = MakeDescK(SmemAddr(s_do));
  const uint64_t desc_q_mn = MakeDescMN(SmemAddr(s_q), Tr::kQPanelBytes);
  const uint64_t desc_do_mn = MakeDescMN(SmemAddr(s_do), Tr::kQPanelBytes);
  // dS as A of dQ: 64 queries = one 128-byte row per key (one dS^T panel),
  // so M needs one panel and the leading byte offset is unused.
  const uint64_t desc_ds_mn = MakeDescMN(SmemAddr(s_ds), Tr::kDsPanelBytes);
  const uint64_t desc_k_mn = MakeDescMN(SmemAddr(s_k), Tr::kKvPanelBytes);
  // This warpgroup's dQ tile (Traits::DqRow0, DqCol0).
  const int dq_row0 = Tr::DqRow0(cg);
  const int dq_col0 = Tr::DqCol0(cg);

  // lse2 (which = 0) or Dvec (1) of the stage's query block at this thread's
  // accumulator columns 8 j + 2 t4, + 1, from the row warp's copy, into
  // registers. The loads are issued ahead of the products that flood shared
  // memory with operand reads: lse2 before S^T and dP^T are issued, Dvec
  // once S^T is done (its loads then run under the exponentials). Loaded
  // where they were used, the first use waited out their latency behind the
  // wgmma reads (ncu: 4-7% of the stall samples on one FFMA at D = 128).
  // This thread's first entry of lse2 (which 0) or Dvec (1) of a stage.
  const auto rows_at = [&](int stage, int which) {
    return s_rows + (2 * stage + which) * kBlockM + 2 * t4;
  };
  const auto load_rows = [&](int stage, int which, float2 (&out)[kBlockM / 8]) {
    const float* row = rows_at(stage, which);
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) out[j] = *reinterpret_cast<const float2*>(row + 8 * j);
  };

  // This warpgroup's dQ tile (64 x 64, unscaled; the convert kernel scales)
  // into its staging tile (StageDqTile); the producer's dQ warp then adds it
  // into dq_acc [B, T, H, D] at rows m_begin + dq_row0, columns dq_col0 by
  // the copy engine. Float2 atomics from every thread, the earlier way, took
  // a third of the kernel's time. Rows past T fall outside the
  // map and are dropped.
  const auto stage_dq = [&](const float (&dq)[32]) {
    unsigned char* tile = s_dq + cg * Tr::kDqTileBytes;
    NamedBarrierSync(5 + cg, 160);  // ids 5, 6: the dQ warp's last reduction has read the tile
    StageDqTile(tile, Tr::kDqPanelBytes, warp, g, t4, dq);
    FenceProxyAsync();
    NamedBarrierArrive(3 + cg, 160);  // ids 3, 4: the tile is staged, to the dQ warp
  };

  // dK and dV staging (see the epilogue): this warpgroup's key rows of the
  // dS^T buffers, and dV's own tile at D = 128.
  unsigned char* s_dk_stage = s_ds + 64 * cg * 128;
  constexpr int kDkPanelStride = Tr::kDsBytes;
  unsigned char* s_dv_stage = Tr::kDvInDs ? s_ds + Tr::kDsPanelBytes + 64 * cg * 128
                                          : smem + Smem::kDvStage + cg * (Tr::kKvBytes / 2);
  constexpr int kDvPanelStride = Tr::kDvInDs ? Tr::kDsBytes : 64 * 128;
  // Whether a TMA store of this warpgroup may still read that staging, and
  // the wait for it (its issuing thread's bulk group, then the warpgroup).
  bool store_pending = false;
  const auto wait_staging_read = [&] {
    if (!store_pending) return;
    if (wg_tid == 0) BulkWaitGroupRead<0>();
    NamedBarrierSync(8 + cg, 128);
    store_pending = false;
  };

  // Each query block commits five wgmma groups, in this order: S^T, dP^T, dV,
  // dQ, dK. Every wait but the last leaves the newest group running, so the
  // tensor cores have queued work while the warps compute: dP^T runs under
  // the P^T exponentials, dV under dS^T, dK under the dQ staging. (No group
  // stays in flight into the next block: ptxas serialized every wgmma,
  // warnings C7514/C7515, when one did.)
  RingPos<kStages> ring;
  int kv_uses = 0;  // items whose K and V this warpgroup used
  for (int item_index = 0; item_index < walk->num_items; ++item_index) {
    const Item item = item_at(item_index);
    const Tile tile = locate(item.tile);
    const int it_begin = item.it_begin;
    const int it_end = min(item.it_end, tile.num_iters);
    const int key0 = tile.n_begin + 64 * cg;
    // The queries that see this thread's key rows; fully visible blocks skip
    // the mask, without branches per element.
    // With segment ids, the fully visible query blocks are narrowed to those
    // that hold only the one id of this warpgroup's keys; the others take
    // the id test after the window's (NarrowToUniformIds).
    KeyRowWindow window = KeyRowWindowFor(mask, key0, warp, g, p.seqlen_q, seqlen_k);
    NarrowToUniformIds(args.seg, tile.b, key0, kBlockM, &window);
    float acc_dk[Tr::kAcc], acc_dv[Tr::kAcc];
#pragma unroll
    for (int i = 0; i < Tr::kAcc; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    if (it_begin < it_end) MbarWait(kv_full, kv_uses & 1);
    // The mainloop, here in the kernel body: as a function of its own (per
    // query block, or per item) it compiled to other code.
    for (int it = it_begin; it < it_end; ++it) {
      // Named, not structured bindings: the lambdas below capture them.
      const auto block = query_block(tile, it);
      const int h = block.h, m_begin = block.m_begin;
      const uint32_t q_off = ring.stage * Tr::kQBytes;
      const int ds_buf = it % 2;
      // With dropout, P^T's dropped elements carry a minus sign from the
      // exponentials on (P^T >= 0 otherwise), so no keep bits are held
      // through the dS^T math, the consumers' register peak (held there, they
      // spilled the D = 64 consumers 12 bytes more). Z o P^T = P^T where not
      // negative; P^T = |P^T|.
      const auto kept = [](float pt) { return !(pt < 0.f); };  // a NaN stays in

      // acc = (64 key rows of K or V) x (Q or dO of the stage)^T, both
      // K-major over D, committed as one group: S^T and dP^T (unscaled).
      const auto issue_keys_x_queries = [&](float (&acc)[Tr::kSAcc], uint64_t desc_rows,
                                            uint64_t desc_tile) {
        WgmmaSSOverPanels<Elem, kBlockM, kHeadDim>(acc, desc_rows, Tr::kKvPanelBytes,
                                                   DescAdd(desc_tile, q_off), Tr::kQPanelBytes);
        WgmmaCommit();
      };
      float s[Tr::kSAcc], dp[Tr::kSAcc];
      MbarWait(&q_full[ring.stage], ring.phase);
      float2 lse2[kBlockM / 8], dvec[kBlockM / 8];
      // The options kernels read lse2 from shared memory in their exponential
      // loop, as they read Dvec in the dS^T loop: held from here, it spilled
      // the D = 64 consumers.
      if constexpr (!kScoreOptions) load_rows(ring.stage, 0, lse2);
      WgmmaFence();
      issue_keys_x_queries(s, desc_k_rows, desc_q_k);    // S^T = K_c Q^T
      issue_keys_x_queries(dp, desc_v_rows, desc_do_k);  // dP^T = V_c dO^T

      // Accumulator element i of the 64 x kBlockM tiles: key row 16 warp + g +
      // 8 rh, query column 8 j + 2 t4 + e, with j = i / 4, rh = (i / 2) % 2,
      // e = i % 2.
      const bool full = window.FullyVisible(m_begin, kBlockM);
      // Segment ids: the id test on the masked blocks outside the uniform
      // run (its load under the products).
      const bool test_ids = !full && args.seg.kv_span != nullptr &&
                            !InUniformIdRun(args.seg, tile.b, key0, m_begin, kBlockM);
      WgmmaWaitFenced<1>(s);  // S^T done; dP^T may still run
      uint32_t pa[Tr::kSlices][4], dsa[Tr::kSlices][4];
      // dV += P^T dO (wgmma RS: P^T from registers, dO MN-major). At block_m =
      // 64 it is issued before dS^T is computed, to run under that math; at
      // 128, S^T in fp32 (for dS^T), P^T, dP^T, dK and dV do not all fit in
      // registers, so it is issued after, as FlashAttention-3 does.
      const auto issue_dv = [&] {
        WithOptionFlag(dropout, [&](auto dropped) {
#pragma unroll
          for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int i = 8 * kk + 2 * r;
              pa[kk][r] = PackFloat2<Elem>(s[i], s[i + 1]);
              if constexpr (dropped) pa[kk][r] = ZeroNegativeHalves<Elem>(pa[kk][r]);
            }
          }
        });
        WgmmaFenceOperands(pa);
        WgmmaFenceOperands(acc_dv);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < Tr::kSlices; ++kk) {
          // k16 slice kk: queries [16 kk, +16) = 2048 bytes into the MN-major tile.
          Wgmma<Elem, kHeadDim>::RS(acc_dv, pa[kk], DescAdd(desc_do_mn, q_off + kk * 2048), 1);
        }
        WgmmaCommit();
      };
      constexpr bool kDvUnderDs = kBlockM == 64;
      // Softcap, ALiBi (score_options.h): u from S^T, P^T = exp2(u * log2 -
      // lse2) while dP^T runs; once it is done, dS^T = P^T o (dP^T - Dvec) o
      // (1 - th^2), th = tanh(S^T scale / cap), 1 - th^2 the cap's derivative
      // (parked at ds_slot). Both kernels keep one dV issue point and one dP^T wait
      // (issued or waited in branches of their own, ptxas serialized every
      // wgmma: C7512, C7514).
      constexpr bool options = kScoreOptions;
      // Element i: key row key0 + 16 warp + g + 8 ((i / 2) % 2), query
      // m_begin + 8 (i / 4) + 2 t4 + i % 2; |query + S - T - key| = |base[key
      // row] + column|. Indices through Opaque, as in the forward.
      const auto alibi_base = [&](float (&base)[2]) {
        const int col_base = Opaque(m_begin) + 2 * t4 + seqlen_k -
                             static_cast<int>(p.seqlen_q) - key0 - 16 * warp - g;
        base[0] = static_cast<float>(col_base);
        base[1] = static_cast<float>(col_base - 8);
      };
      const auto alibi_slope = [&] {
        return AlibiSlopeUnits(p, args.units,
                               Opaque(tile.b) * static_cast<int>(p.num_heads_q) + Opaque(h));
      };
      // P^T = exp2(S^T * scale_log2 - lse2[query]); lse2 = +inf (rows past T,
      // rows that see no key) gives exactly 0. P^T and dS^T become A fragments
      // (rounded to Elem, as in FlashAttention-2): n8 tiles 2 kk and 2 kk + 1
      // form k16 slice kk (see wgmma.cuh).
      // Softcap's 1 - th^2: per score while computed, then pairs of Elem
      // parked at ds_slot(q), the slot where this thread stores the same
      // pair of dS^T below (pair q = 4 kk + r is dsa[kk][r]): buffer ds_buf
      // is free from this block on (see the dQ barrier). Held in registers
      // (with lse2), the pairs spilled the D = 64 consumers 334 bytes.
      float cap_deriv[Tr::kSAcc];
      unsigned char* const ds_tile = s_ds + ds_buf * Tr::kDsBytes;
      const auto ds_slot = [&](int q) {
        const int kk = q / 4, r = q % 4;
        const int row = 64 * cg + 16 * warp + g + 8 * (r % 2);
        const int chunk = (2 * (kk % 4) + r / 2) ^ g;  // row % 8 == g
        return reinterpret_cast<uint32_t*>(ds_tile + (kk / 4) * Tr::kDsPanelBytes + row * 128 +
                                           chunk * 16 + 4 * t4);
      };
      if constexpr (!options) {
        load_rows(ring.stage, 1, dvec);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 l = lse2[j];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = 4 * j + r;
            s[i] = FastExp2(fmaf(s[i], scale_log2, -((r & 1) ? l.y : l.x)));
          }
        }
      } else {
        // The options score by score with its exponential. The cap's
        // derivative is kept in Elem pairs, the rounding dS^T gets anyway
        // (bf16 pairs under fp16 inputs gave 5x the same-dtype error in dQ);
        // recovering th from P^T instead took a MUFU.LG2 per score, a third
        // special-function op beside tanh and exp2, and lost th at caps
        // below about 0.1.
        float base[2];
        alibi_base(base);
        const float slope_u = alibi_slope();
        if (p.softcap > 0.f) wait_staging_read();  // the parked pairs share the staging rows
        const float* lse2_row = rows_at(ring.stage, 0);
        WithOptionFlags(p.softcap > 0.f, p.alibi_slopes != nullptr, [&](auto softcap, auto alibi) {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const float2 l = *reinterpret_cast<const float2*>(lse2_row + 8 * j);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int i = 4 * j + r;
              float u = s[i];
              if constexpr (softcap) {
                u = TanhApprox(u * args.units.tanh_in);
                cap_deriv[i] = fmaf(-u, u, 1.f);
              }
              if constexpr (alibi) {
                u = fmaf(-slope_u, fabsf(base[r / 2] + static_cast<float>(8 * j + (r & 1))), u);
              }
              s[i] = FastExp2(fmaf(u, scale_log2, -((r & 1) ? l.y : l.x)));
            }
            if constexpr (softcap) {
              *ds_slot(2 * j) = PackFloat2<Elem>(cap_deriv[4 * j], cap_deriv[4 * j + 1]);
              *ds_slot(2 * j + 1) = PackFloat2<Elem>(cap_deriv[4 * j + 2], cap_deriv[4 * j + 3]);
            }
          }
        });
        if (dropout) {
          // The keep bits while dP^T runs, after lse2's last use (the fewest
          // registers live). Indices through Opaque, as for ALiBi.
          uint32_t keep[KeepWords<Tr::kSAcc>()];
          const DropoutMask drop_mask =
              LoadDropoutMask(p, Opaque(tile.b) * static_cast<int>(p.num_heads_q) + Opaque(h));
          BwdKeepBits<Tr::kSAcc>(keep, drop_mask, key0 + 16 * warp + g, Opaque(m_begin), g, t4);
#pragma unroll
          for (int i = 0; i < Tr::kSAcc; ++i) {
            if (!BwdKept<Tr::kSAcc>(keep, i)) s[i] = -s[i];
          }
        }
      }
      if (!full) {
        ZeroMaskedScores(s, m_begin, t4, window);
        if (test_ids) ZeroUnequalIds(s, args.seg, tile.b, key0, m_begin, warp, g, t4);
      }
      if constexpr (kDvUnderDs) issue_dv();

      WgmmaWaitFenced<kDvUnderDs ? 1 : 0>(dp);  // dP^T done; dV may still run
      // dS^T = P^T o (dP^T - Dvec[query]); with dropout P^T o (Z o dP^T /
      // (1 - rate) - Dvec[query]).
      // With softcap times 1 - th^2 (the cap's derivative, at ds_slot).
      const float dp_scale = dropout ? p.dropout_scale : 1.f;
      const float* dvec_row = rows_at(ring.stage, 1);
      WithOptionFlags(dropout, options && p.softcap > 0.f, [&](auto dropped, auto capped) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 d = options ? *reinterpret_cast<const float2*>(dvec_row + 8 * j) : dvec[j];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = 4 * j + r;
            float pt = s[i], dpz = dp[i];
            if constexpr (dropped) {
              dpz = kept(pt) ? dpz * dp_scale : 0.f;
              pt = fabsf(pt);
            }
            dp[i] = pt * (dpz - ((r & 1) ? d.y : d.x));
            if constexpr (capped) {
              // A bf16 half is the top of its fp32: a shift or a mask, where
              // UnpackFloat2 cost one more instruction per pair.
              const uint32_t pair = *ds_slot(i / 2);
              if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
                dp[i] *= __uint_as_float((r & 1) ? pair & 0xFFFF0000u : pair << 16);
              } else {
                const float2 cap = UnpackFloat2<Elem>(pair);
                dp[i] *= (r & 1) ? cap.y : cap.x;
              }
            }
          }
        }
      });
#pragma unroll
      for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          dsa[kk][r] = PackFloat2<Elem>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
        }
      }
      if constexpr (!kDvUnderDs) issue_dv();

      // dS^T into buffer ds_buf in the 128-byte swizzled layout TMA would give
      // a [key][query] tile, per panel of 64 queries: row r = key, 16-byte chunk
      // c at (c ^ (r % 8)). Fragment r of slice kk holds key row 16 warp + g
      // (+8 for r odd) and queries 16 kk + 8 (r / 2) + 2 t4, + 1: panel kk / 4,
      // chunk 2 (kk % 4) + r / 2, bytes 4 t4. The 8 rows g of a warp hit 8
      // distinct chunks: no bank conflicts. Stored before the dK wgmmas are
      // issued: their A fragments (dsa) may not be touched, not even read,
      // until those complete.
      // (The previous tile's dK and dV staging shares these rows: once read by
      // the copy engine they are free.)
      wait_staging_read();  // (a no-op after the item's first iteration)
#pragma unroll
      for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) *ds_slot(4 * kk + r) = dsa[kk][r];
      }
      FenceProxyAsync();

      // dQ reads the dS^T rows of both warpgroups: barrier 1 over both (0 is
      // __syncthreads'). Buffer ds_buf was last read by dQ of block it - 2,
      // which each warpgroup waited for before block it - 1's barrier.
      NamedBarrierSync(1, 256);

      // dQ = dS K for this warpgroup's 64 x 64 tile, over all kBlockN keys,
      // then dK += dS^T Q (wgmma RS, Q MN-major).
      float dq[32];
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        // k16 slice kk: keys [16 kk, +16), 2048 bytes into a dS^T panel and K.
        Wgmma<Elem, 64>::SSMN(
            dq,
            DescAdd(desc_ds_mn,
                    ds_buf * Tr::kDsBytes + (dq_row0 / 64) * Tr::kDsPanelBytes + kk * 2048),
            DescAdd(desc_k_mn, (dq_col0 / 64) * Tr::kKvPanelBytes + kk * 2048), kk > 0);
      }
      WgmmaCommit();
      WgmmaFenceOperands(dsa);
      WgmmaFenceOperands(acc_dk);
#pragma unroll
      for (int kk = 0; kk < Tr::kSlices; ++kk) {
        Wgmma<Elem, kHeadDim>::RS(acc_dk, dsa[kk], DescAdd(desc_q_mn, q_off + kk * 2048), 1);
      }
      WgmmaCommit();

      // dV and dQ done (dK may still run): stage dQ for the dQ warp.
      WgmmaWaitFenced<1>(acc_dv, pa, dq);
      stage_dq(dq);

      // dK done: the stage's Q, dO, lse2 and Dvec are free. Every thread
      // arrives (not one per warp): racecheck orders the row warp's next
      // stores after each reading thread's own arrival only.
      WgmmaWaitFenced<0>(acc_dk, dsa);
      MbarArrive(&q_empty[ring.stage]);
      ring.Advance();
    }

    // This tile's K and V are free for the next one's loads.
    if (it_begin < it_end) {
      MbarArrive(kv_empty);
      ++kv_uses;
    }

    // A stream-K piece (BwdSm90Piece). (The slot is read again here, not
    // kept in a register through the loop.)
    const int slot = item_at(item_index).slot;
    if (slot >= 0) {
      const BwdSm90Piece piece = BwdSm90ArrivePiece<kHeadDim>(args, me, piece_role, slot);
      if (*piece_role == 0) {
        BwdSm90ParkPiece<Tr>(piece, me, acc_dk, acc_dv);
        continue;
      }
      BwdSm90AddPiece<Tr>(piece, me, acc_dk, acc_dv);
    }

    wait_staging_read();  // (an item without iterations did not wait above)
    BwdSm90Epilogue<Elem, Tr>(args, me, tile, s_dk_stage, kDkPanelStride, s_dv_stage,
                              kDvPanelStride, acc_dk, acc_dv, dropout, seqlen_k);
    store_pending = true;
  }
  // The staging must outlive the copy engine's reads (the grid's completion
  // covers the global writes, as for plain stores).
  if (wg_tid == 0) BulkWaitGroupRead<0>();
}

}  // namespace jax_flash2::cuda::sm90
