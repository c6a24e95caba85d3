// FlashAttention-2 backward main kernel for Hopper at D = 256 (and the head
// dims in its bucket, head_dim.h): the D-split tile of bwd_sm90.h.
//
// Why a kernel of its own: BwdSm90Kernel keeps a 64-key slice's dK and dV (64
// x D fp32 each) in one consumer warpgroup's registers, 256 per thread at D =
// 256, past the 240 budget; and its K, V (128 keys) plus two stages of Q and
// dO would take 256 KB of shared memory. Here a CTA owns 64 keys of one
// (batch, K/V head), and its two consumer warpgroups split D instead of the
// keys: consumer c accumulates dK and dV columns [128 c, + 128) (64 + 64 fp32
// registers per thread, as at D = 128). The products that reduce over D are
// shared out rather than computed twice:
//   consumer 0:  S^T  = K Q^T             (64 x 64 over D: 16 wgmma SS)
//                P^T  = exp2(S^T * scale * log2(e) - lse2)   (0 where masked)
//                -> shared memory (Elem, [key][query])
//   consumer 1:  dP^T = V dO^T            (likewise, side by side with S^T)
//                P^T  <- shared memory, dS^T = P^T o (dP^T - Dvec)
//                -> shared memory
//   each c:      dV_c += P^T dO_c         wgmma RS, dO's columns of c MN-major
//                dK_c += dS^T Q_c         wgmma RS
//                dQ_c  = dS K_c           two m64n64 SS pieces (both MN-major)
// dQ (64 x 256 fp32 per query block) is added into dq_acc by bulk tensor
// reductions, staged where nothing else has room for it: in the block's own
// Q / dO stage once both consumers' products are done with it (consumer 0's
// columns over Q, consumer 1's over dO: 32 KB each, four boxes of 64 rows x
// 32 columns). The producer's dQ warp issues the reductions and hands the
// stage back to the TMA thread once the copy engine has read it. The dQ
// reduction sets the speed: 64 keys per CTA add twice the dQ bytes per
// product of BwdSm90Kernel's 128, and a build without it (wrong dQ, timing
// only) ran 580-600 TFLOP/s.
//
// The consumers hand tiles to each other through mbarriers (128 arrivals,
// one per thread of the signalling consumer; the waits acquire what the
// arrivals release):
//   p_full:      0 arrives after storing P^T, 1 waits before loading it.
//   ds_full:     1 arrives after storing dS^T, 0 waits before loading it.
// One buffer of each is enough: consumer 0 writes the next P^T only after
// ds_full of this block, which consumer 1 signals after its last read of
// P^T; consumer 1 writes the next dS^T only after the stage_done rendezvous
// below, which consumer 0 reaches once its dQ products, the last readers of
// dS^T, are done. No barrier can run a phase ahead of its waiter: each side
// waits on the other's signal between two of its own. (Named-barrier arrive
// / sync pairs would do the same, but racecheck does not count an arrive as
// ordering the arriving threads' shared-memory accesses.)
// A stage's dQ: stage_done[s] (every consumer thread, once its products of
// the block are done: the stage's Q and dO may be overwritten), then
// dq_staged[s] (every consumer thread, after its staging stores), then the
// dQ warp's reductions and its q_empty[s] arrival after their reads.
// Epilogue: dq_drained (the dQ warp's last reductions have read their
// staging), named barriers 7 over both consumers (Q and dO stages free for
// the dK, dV staging), 8 + c per consumer (staged, to its TMA store thread).
//
// Softcap and ALiBi (score_options.h): consumer 0 transforms S^T before the
// exponentials and, with softcap, hands consumer 1 the cap's derivative 1 -
// th^2 in a tile beside P^T (published by p_full with it).
//
// The producer warpgroup: one thread issues the TMA loads (K and V once, Q
// and dO per query block into a two-stage ring), one warp stages lse2 and
// Dvec as in BwdSm90Kernel, one issues the dQ reductions. One tile per CTA
// (no persistent grid, no stream-K). Masking, rows past T and keys past S as
// in BwdSm90Kernel; the dQ map drops rows past T and columns past D.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../flash_mask.h"
#include "../sm80/primitives.cuh"
#include "bwd_sm90.h"
#include "bwd_sm90_common.cuh"
#include "primitives.cuh"
#include "segments.cuh"
#include "score_options.h"
#include "wgmma.cuh"

namespace jax_flash2::cuda::sm90 {

struct BwdSm90DSplitTraits {
  static constexpr BwdSm90Tile kTile = BwdSm90TileFor(256);
  static_assert(BwdSm90SplitsD(kTile));
  static constexpr int kHeadDim = kTile.head_dim;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kPanels = kHeadDim / 64;  // 64-column panels of 128-byte rows
  static constexpr int kKvPanelBytes = kBlockN * 128;
  static constexpr int kQPanelBytes = kBlockM * 128;
  static constexpr int kKvBytes = kPanels * kKvPanelBytes;  // one K or V tile
  static constexpr int kQBytes = kPanels * kQPanelBytes;    // one Q or dO tile
  // P^T or dS^T ([key][query], one panel of kBlockM = 64 queries).
  static constexpr int kPBytes = kBlockN * kBlockM * 2;
  static constexpr int kSlices = kBlockM / 16;  // k16 slices of P^T, dS^T over queries
  // A consumer's share of D: dK, dV columns [kHalf c, + kHalf), 2 panels.
  static constexpr int kHalf = kHeadDim / kBwdConsumerWarpgroups;
  static_assert(kBlockM == 64 && kBlockN == 64 && kHeadDim == 256 && kHalf == 128);
  static_assert(kBwdRowPad % kBlockM == 0);
};

// Shared-memory carve-up (byte offsets from the 1024-aligned base).
struct BwdSm90DSplitSmem {
  using Tr = BwdSm90DSplitTraits;
  static constexpr int kK = 0;
  static constexpr int kV = kK + Tr::kKvBytes;
  static constexpr int kQ = kV + Tr::kKvBytes;
  static constexpr int kDo = kQ + Tr::kStages * Tr::kQBytes;
  static constexpr int kP = kDo + Tr::kStages * Tr::kQBytes;
  static constexpr int kDs = kP + Tr::kPBytes;
  // [stage] lse2 then Dvec of the stage's query block (kBlockM floats each).
  static constexpr int kRows = kDs + Tr::kPBytes;
  static constexpr int kBars = kRows + Tr::kStages * 2 * Tr::kBlockM * 4;
  // kv_full; q_full, q_empty, stage_done, dq_staged per stage; p_full,
  // ds_full, dq_drained.
  static constexpr int kEnd = kBars + (4 + 4 * Tr::kStages) * 8;
  // The host's size (bwd_sm90.h) is this carve-up plus the alignment slack.
  static_assert(kEnd + 1024 == BwdSm90SmemBytes(Tr::kTile));
  // With the score options, after it: softcap's 1 - th^2 (th = tanh, before
  // ALiBi) of the block, from consumer 0 to consumer 1 as P^T (8 KB more).
  static constexpr int kDcap = (kEnd + 1023) / 1024 * 1024;
  static constexpr int kOptionsSmemBytes = kDcap + Tr::kPBytes + 1024;
  static_assert(kOptionsSmemBytes <= 232448);  // cc 9.0's opt-in limit per block
  static_assert(kV % 1024 == 0 && kQ % 1024 == 0 && kDo % 1024 == 0 && kP % 1024 == 0 &&
                kDs % 1024 == 0 && kRows % 16 == 0);
};

// kScoreOptions: softcap and / or ALiBi (score_options.h), a template flag
// as in BwdSm90Kernel.
template <typename Elem, bool kScoreOptions>
__global__ void __launch_bounds__(kBwdSm90Threads, 1)
    BwdSm90DSplitKernel(const __grid_constant__ BwdSm90Args args) {
  using Tr = BwdSm90DSplitTraits;
  using Smem = BwdSm90DSplitSmem;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;

  unsigned char* smem = AlignedDynamicSmem();
  unsigned char* s_k = smem + Smem::kK;
  unsigned char* s_v = smem + Smem::kV;
  unsigned char* s_q = smem + Smem::kQ;
  unsigned char* s_do = smem + Smem::kDo;
  unsigned char* s_p = smem + Smem::kP;
  unsigned char* s_ds = smem + Smem::kDs;
  unsigned char* s_dcap = smem + Smem::kDcap;
  float* s_rows = reinterpret_cast<float*>(smem + Smem::kRows);
  // kv_full: K and V landed. q_full[s]: Q, dO, lse2, Dvec of stage s landed;
  // q_empty[s]: every consumer thread is done with them and the dQ staged
  // over them has been read. stage_done, dq_staged: see the top.
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem + Smem::kBars);
  uint64_t* q_full = kv_full + 1;
  uint64_t* q_empty = q_full + kStages;
  uint64_t* stage_done = q_empty + kStages;
  uint64_t* dq_staged = stage_done + kStages;
  // Consumer to consumer (see the top): P^T stored, dS^T stored; then the dQ
  // warp's last reads.
  uint64_t* p_full = dq_staged + kStages;
  uint64_t* ds_full = p_full + 1;
  uint64_t* dq_drained = ds_full + 1;

  const FlashParams& p = args.p;
  const int seqlen_k = static_cast<int>(p.seqlen_k);
  const int group = static_cast<int>(p.group_size);
  const WindowMask mask = MakeWindowMask(p);

  // Tile blockIdx.x (BwdSm90Args): key block n_begin of (b, kv_head), and the
  // query blocks [m_block_begin, + num_m_blocks) that may see one of its
  // keys, once per query head of the group: num_iters iterations, heads outer.
  const int tile = static_cast<int>(blockIdx.x);
  const int n_begin =
      KeyBlockAt(tile % args.num_n_blocks, args.key_block_flip) * kBlockN;
  const int b = tile / args.num_n_blocks % static_cast<int>(p.batch);
  const int kv_head = tile / args.num_n_blocks / static_cast<int>(p.batch);
  int m_block_begin, num_m_blocks;
  {
    int64_t q_begin, q_end;
    mask.QueryRange(n_begin, min(n_begin + kBlockN, seqlen_k), p.seqlen_q, &q_begin, &q_end);
    m_block_begin = static_cast<int>(q_begin / kBlockM);
    num_m_blocks =
        q_end > q_begin ? static_cast<int>((q_end + kBlockM - 1) / kBlockM) - m_block_begin : 0;
    if (args.seg.kv_span != nullptr && args.dq_turns == nullptr) {
      // Segment ids: only the query blocks whose ids may match one of the
      // tile's (its 64 keys are one pre-pass chunk). Not in the
      // deterministic backward (as in BwdSm90Kernel's locate).
      int m_end = m_block_begin + num_m_blocks;
      NarrowToTileSpan(args.seg.kv_tiles[b * args.seg.num_kv_tiles + n_begin / kBlockN],
                       &m_block_begin, &m_end);
      num_m_blocks = m_end - m_block_begin;
    }
  }
  const int num_iters = num_m_blocks * group;
  // Iteration it visits block (it + rotation) mod num_iters: CTAs of
  // neighbouring key blocks, which run at the same time, start one block
  // apart, so that their dQ reductions do not all land on the same rows at
  // once (+2-3% unmasked with the earlier dQ atomics; not
  // re-measured since). None in the deterministic backward: there key block
  // n adds its dQ after key block n + 1, so starting where n + 1 does lets
  // n follow it block by block.
  const int rotation =
      num_iters > 0 && args.dq_turns == nullptr ? tile % args.num_n_blocks % num_iters : 0;
  const auto visit = [&](int it) {
    const int v = it + rotation;
    return v >= num_iters ? v - num_iters : v;
  };
  const auto head_of = [&](int it) { return kv_head * group + visit(it) / num_m_blocks; };
  const auto m_begin_of = [&](int it) {
    return (m_block_begin + visit(it) % num_m_blocks) * kBlockM;
  };

  if (threadIdx.x == 0) {
    MbarInit(kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&q_full[s], 1 + 32);  // the TMA thread's expect-tx, the row warp's lanes
      // Every consumer thread after its staging, and the dQ warp once the
      // reductions have read it.
      MbarInit(&q_empty[s], 128 * kBwdConsumerWarpgroups + 1);
      MbarInit(&stage_done[s], 128 * kBwdConsumerWarpgroups);
      MbarInit(&dq_staged[s], 128 * kBwdConsumerWarpgroups);
    }
    MbarInit(p_full, 128);
    MbarInit(ds_full, 128);
    MbarInit(dq_drained, 1);
    FenceBarrierInit();
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
    if (threadIdx.x == 0 && num_iters > 0) {
      PrefetchTensorMap(&args.tma_q);
      PrefetchTensorMap(&args.tma_do);
      PrefetchTensorMap(&args.tma_k);
      PrefetchTensorMap(&args.tma_v);
      MbarArriveExpectTx(kv_full, 2 * Tr::kKvBytes);
      LoadKvTile(args, s_k, s_v, kv_full, Tr::kPanels, Tr::kKvPanelBytes, n_begin, kv_head, b);
      RingPos<kStages> ring;
      for (int it = 0; it < num_iters; ++it) {
        const int h = head_of(it), m_begin = m_begin_of(it);
        MbarWait(&q_empty[ring.stage], ring.phase ^ 1);
        MbarArriveExpectTx(&q_full[ring.stage], 2 * Tr::kQBytes);
        LoadQDoBlock(args, s_q + ring.stage * Tr::kQBytes, s_do + ring.stage * Tr::kQBytes,
                     &q_full[ring.stage], Tr::kPanels, Tr::kQPanelBytes, m_begin, h, b);
        ring.Advance();
      }
    } else if (threadIdx.x / 32 == 1) {
      // The row warp (as in BwdSm90Kernel): lanes 0-15 copy the block's 64
      // lse2 values as float4, lanes 16-31 its Dvec values, published by
      // their q_full arrivals. Rows are t_pad long, a multiple of kBlockM.
      const int lane = threadIdx.x % 32;
      constexpr int kVecs = kBlockM / 4;
      static_assert(2 * kVecs == 32);
      RingPos<kStages> ring;
      for (int it = 0; it < num_iters; ++it) {
        const int64_t row0 = (static_cast<int64_t>(b) * p.num_heads_q + head_of(it)) * args.t_pad +
                             m_begin_of(it);
        const float* src = (lane < kVecs ? args.lse2 : args.dvec) + row0 + 4 * (lane % kVecs);
        const float4 v = __ldg(reinterpret_cast<const float4*>(src));
        MbarWait(&q_empty[ring.stage], ring.phase ^ 1);
        reinterpret_cast<float4*>(s_rows + ring.stage * 2 * kBlockM)[lane] = v;
        MbarArrive(&q_full[ring.stage]);
        ring.Advance();
      }
    } else if (threadIdx.x / 32 == 2) {
      // The dQ warp: each stage's staged dQ (consumer c's columns [128 c, +
      // 128) over its Q (c = 0) or dO (1) tile, four boxes of 32 columns)
      // into dq_acc by the copy engine, then the stage back to the TMA
      // thread once read. Its lane 0 does it all. Deterministic
      // (args.dq_turns, Sm90BackwardDqTurns): the block's turn first, and
      // passed on once the reductions have landed.
      if (threadIdx.x % 32 == 0 && num_iters > 0) {
        PrefetchTensorMap(&args.tma_dq);
        RingPos<kStages> ring;
        for (int it = 0; it < num_iters; ++it) {
          const int h = head_of(it), m_begin = m_begin_of(it);
          MbarWait(&dq_staged[ring.stage], ring.phase);
          int* turn_counter = nullptr;
          int turn = 0;
          if (args.dq_turns != nullptr) {
            turn_counter = args.dq_turns +
                           (b * static_cast<int>(p.num_heads_q) + h) * args.num_q_blocks +
                           m_begin / kBlockM;
            turn = LastKeyBlockOf(mask, m_begin, kBlockM, kBlockN, args.num_n_blocks) -
                   n_begin / kBlockN;
            WaitDqTurn(turn_counter, turn);
          }
#pragma unroll
          for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
            const unsigned char* staging = (c == 0 ? s_q : s_do) + ring.stage * Tr::kQBytes;
#pragma unroll
            for (int box = 0; box < Tr::kHalf / 32; ++box) {
              TmaReduceAdd4d(staging + box * Tr::kQPanelBytes, &args.tma_dq,
                             Tr::kHalf * c + 32 * box, h, m_begin, b);
            }
          }
          BulkCommitGroup();
          BulkWaitGroupRead<0>();
          MbarArrive(&q_empty[ring.stage]);
          if (turn_counter != nullptr) {
            BulkWaitGroup<0>();
            PassDqTurn(turn_counter, turn + 1);
          }
          ring.Advance();
        }
        MbarArrive(dq_drained);
        // The reductions must land before the convert kernel reads dq_acc.
        BulkWaitGroup<0>();
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  SetMaxNRegInc<kBwdConsumerRegs>();
  const int cg = warpgroup - 1;  // consumer: dK, dV columns [128 cg, + 128)
  const int wg_tid = threadIdx.x % 128;
  const int warp = wg_tid / 32;  // 16 keys (accumulator rows) per warp
  const int lane = wg_tid % 32;
  const int g = lane / 4;   // accumulator row (and g + 8)
  const int t4 = lane % 4;  // accumulator column pair

  // Consumer 0 multiplies K by Q, consumer 1 V by dO (both K-major over D);
  // each then reads the dO and Q columns of its half MN-major (for dV, dK),
  // and K's (for dQ). dS as A of dQ: 64 queries = one 128-byte row per key
  // (one panel), so the leading byte offset is unused.
  const uint64_t desc_rows = MakeDescK(SmemAddr(cg == 0 ? s_k : s_v));
  const uint64_t desc_cols = MakeDescK(SmemAddr(cg == 0 ? s_q : s_do));
  const uint32_t half_q = cg * 2 * Tr::kQPanelBytes;  // the first panel of this half
  const uint64_t desc_q_mn = MakeDescMN(SmemAddr(s_q) + half_q, Tr::kQPanelBytes);
  const uint64_t desc_do_mn = MakeDescMN(SmemAddr(s_do) + half_q, Tr::kQPanelBytes);
  const uint64_t desc_k_mn =
      MakeDescMN(SmemAddr(s_k) + cg * 2 * Tr::kKvPanelBytes, Tr::kKvPanelBytes);
  const uint64_t desc_ds_mn = MakeDescMN(SmemAddr(s_ds), Tr::kPBytes);

  // The queries that see this thread's key rows; fully visible blocks skip
  // the mask.
  // With segment ids, only the query blocks of the keys' one id skip the id
  // test (NarrowToUniformIds).
  KeyRowWindow window = KeyRowWindowFor(mask, n_begin, warp, g, p.seqlen_q, seqlen_k);
  NarrowToUniformIds(args.seg, b, n_begin, kBlockM, &window);

  // P^T and dS^T tiles: fragment r of slice kk (key row 16 warp + g + 8 (r %
  // 2), queries 16 kk + 8 (r / 2) + 2 t4, + 1) at chunk 2 kk + r / 2 of the
  // key's 128-byte row, swizzled by row % 8 = g as TMA would lay it out: the
  // MN-major A operand of dQ. The 8 rows of a warp's store hit 8 distinct
  // chunks: no bank conflicts.
  const auto fragment_offset = [&](int kk, int r) {
    const int row = 16 * warp + g + 8 * (r % 2);
    return row * 128 + ((2 * kk + r / 2) ^ g) * 16 + 4 * t4;
  };
  using Fragments = uint32_t[Tr::kSlices][4];
  const auto store_tile = [&](unsigned char* tile, const Fragments& f) {
#pragma unroll
    for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        *reinterpret_cast<uint32_t*>(tile + fragment_offset(kk, r)) = f[kk][r];
      }
    }
  };
  const auto load_tile = [&](const unsigned char* tile, Fragments& f) {
#pragma unroll
    for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        f[kk][r] = *reinterpret_cast<const uint32_t*>(tile + fragment_offset(kk, r));
      }
    }
  };

  // dQ piece `piece` = dS K_c over the block's 64 keys (4 k16 slices of 16
  // keys: 2048 bytes into the dS^T tile and K), committed as one group.
  const auto issue_dq = [&](float (&dq)[32], int piece) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      Wgmma<Elem, 64>::SSMN(dq, DescAdd(desc_ds_mn, kk * 2048),
                            DescAdd(desc_k_mn, piece * Tr::kKvPanelBytes + kk * 2048), kk > 0);
    }
    WgmmaCommit();
  };

  // The exp2 factor per unit of score (score_options.h).
  const float scale_log2 = kScoreOptions ? args.units.log2 : p.softmax_scale_log2;
  float acc_dk[64], acc_dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc_dk[i] = acc_dv[i] = 0.f;
  if (num_iters > 0) MbarWait(kv_full, 0);
  RingPos<kStages> ring;
  for (int it = 0; it < num_iters; ++it) {
    const int h = head_of(it), m_begin = m_begin_of(it);
    const uint32_t q_off = ring.stage * Tr::kQBytes;
    MbarWait(&q_full[ring.stage], ring.phase);
    // lse2 (consumer 0) or Dvec (1) at this thread's accumulator columns 8 j
    // + 2 t4, + 1, loaded before the products flood shared memory.
    float2 rows[kBlockM / 8];
    {
      const float* src = s_rows + (2 * ring.stage + cg) * kBlockM + 2 * t4;
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) rows[j] = *reinterpret_cast<const float2*>(src + 8 * j);
    }
    // acc = S^T = K Q^T (consumer 0) or dP^T = V dO^T (1), unscaled.
    // Accumulator element i: key row 16 warp + g + 8 ((i / 2) % 2), query
    // column 8 (i / 4) + 2 t4 + i % 2.
    float acc[32];
    WgmmaFence();
    WgmmaSSOverPanels<Elem, 64, Tr::kHeadDim>(acc, desc_rows, Tr::kKvPanelBytes,
                                              DescAdd(desc_cols, q_off), Tr::kQPanelBytes);
    WgmmaCommit();
    WgmmaWaitFenced<0>(acc);

    uint32_t pa[Tr::kSlices][4], dsa[Tr::kSlices][4];
    if (cg == 0) {
      if constexpr (!kScoreOptions) {
        // P^T = exp2(S^T * scale_log2 - lse2[query]); lse2 = +inf (rows past
        // T, rows that see no key) gives exactly 0.
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const float2 l = rows[i / 4];
          acc[i] = FastExp2(fmaf(acc[i], scale_log2, -((i & 1) ? l.y : l.x)));
        }
      } else {
        // Softcap, ALiBi (score_options.h): P^T = exp2(u * log2 - lse2), and
        // with softcap 1 - th^2 (th before ALiBi) for consumer 1's dS^T, into a tile of its own
        // (through dsa, free until this consumer loads dS^T; published with
        // P^T by p_full).
        // Element i: key row n_begin + 16 warp + g + 8 ((i / 2) % 2), query
        // m_begin + 8 (i / 4) + 2 t4 + i % 2.
        const float slope_u = AlibiSlopeUnits(
            p, args.units, b * static_cast<int>(p.num_heads_q) + Opaque(h));
        const int col_base = Opaque(m_begin) + 2 * t4 + seqlen_k -
                             static_cast<int>(p.seqlen_q) - n_begin - 16 * warp - g;
        const float base[2] = {static_cast<float>(col_base), static_cast<float>(col_base - 8)};
        if (p.softcap > 0.f) {
          SoftcapScores(acc, args.units.tanh_in);
#pragma unroll
          for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int i = 8 * kk + 2 * r;
              dsa[kk][r] = PackFloat2<Elem>(fmaf(-acc[i], acc[i], 1.f),
                                            fmaf(-acc[i + 1], acc[i + 1], 1.f));
            }
          }
          store_tile(s_dcap, dsa);
        }
        if (p.alibi_slopes != nullptr) AlibiScores<32, 1>(acc, slope_u, base);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const float2 l = rows[i / 4];
          acc[i] = FastExp2(fmaf(acc[i], scale_log2, -((i & 1) ? l.y : l.x)));
        }
      }
      if (!window.FullyVisible(m_begin, kBlockM)) {
        ZeroMaskedScores(acc, m_begin, t4, window);
        if (args.seg.kv_span != nullptr &&
            !InUniformIdRun(args.seg, b, n_begin, m_begin, kBlockM)) {
          ZeroUnequalIds(acc, args.seg, b, n_begin, m_begin, warp, g, t4);
        }
      }
      // As A fragments (rounded to Elem, as in FlashAttention-2): n8 tiles 2
      // kk and 2 kk + 1 form k16 slice kk; and into the P^T tile for
      // consumer 1 (read from registers before the dV wgmmas are issued:
      // their A fragments may not be touched until those complete).
#pragma unroll
      for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[kk][r] = PackFloat2<Elem>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
        }
      }
      store_tile(s_p, pa);
      MbarArrive(p_full);
    } else {
      MbarWait(p_full, it & 1);
      load_tile(s_p, pa);
      // dS^T = P^T o (dP^T - Dvec[query]) (o (1 - th^2) with softcap), from
      // the P^T fragments: element pair (8 kk + 2 r, + 1) is fragment r of
      // slice kk, column block 2 kk + r / 2.
      const bool softcap = kScoreOptions && p.softcap > 0.f;
#pragma unroll
      for (int kk = 0; kk < Tr::kSlices; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float2 dc = make_float2(1.f, 1.f);
          if (softcap) {
            dc = UnpackFloat2<Elem>(
                *reinterpret_cast<const uint32_t*>(s_dcap + fragment_offset(kk, r)));
          }
          const float2 pr = UnpackFloat2<Elem>(pa[kk][r]);
          const float2 d = rows[2 * kk + r / 2];
          const int i = 8 * kk + 2 * r;
          dsa[kk][r] = PackFloat2<Elem>(pr.x * ((acc[i] - d.x) * dc.x),
                                        pr.y * ((acc[i + 1] - d.y) * dc.y));
        }
      }
    }

    // dV_c += P^T dO_c (wgmma RS: P^T from registers, dO MN-major). k16 slice
    // kk: queries [16 kk, +16) = 2048 bytes into the MN-major tile.
    WgmmaFenceOperands(pa);
    WgmmaFenceOperands(acc_dv);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tr::kSlices; ++kk) {
      Wgmma<Elem, 128>::RS(acc_dv, pa[kk], DescAdd(desc_do_mn, q_off + kk * 2048), 1);
    }
    WgmmaCommit();

    if (cg == 1) {
      // The previous block's dS^T is done with: both consumers passed its
      // stage_done rendezvous after their dQ products, its last readers.
      store_tile(s_ds, dsa);
      FenceProxyAsync();  // the dQ wgmmas read it through the async proxy
      MbarArrive(ds_full);
    } else {
      MbarWait(ds_full, it & 1);
      load_tile(s_ds, dsa);
    }

    // dQ piece 0, then dK_c += dS^T Q_c (wgmma RS, Q MN-major), then dQ
    // piece 1 (issued once piece 0 and dV are done: all three in flight
    // beside the fragments would not fit the registers).
    float dq0[32], dq1[32];
    WgmmaFence();
    issue_dq(dq0, 0);
    WgmmaFenceOperands(dsa);
    WgmmaFenceOperands(acc_dk);
#pragma unroll
    for (int kk = 0; kk < Tr::kSlices; ++kk) {
      Wgmma<Elem, 128>::RS(acc_dk, dsa[kk], DescAdd(desc_q_mn, q_off + kk * 2048), 1);
    }
    WgmmaCommit();
    WgmmaWaitFenced<1>(acc_dv, pa, dq0);  // dV and dQ piece 0 done; dK may still run
    WgmmaFence();
    issue_dq(dq1, 1);
    WgmmaWaitFenced<0>(acc_dk, dsa, dq0, dq1);
    // Every product of the block is done. Once both consumers are here, the
    // stage's Q and dO and the dS^T tile are free: this consumer's dQ columns
    // go over its Q (c = 0) or dO (1) tile, piece p as boxes 2 p and 2 p + 1,
    // for the dQ warp's reductions.
    MbarArrive(&stage_done[ring.stage]);
    MbarWait(&stage_done[ring.stage], ring.phase);
    unsigned char* staging = (cg == 0 ? s_q : s_do) + q_off;
    StageDqTile(staging, Tr::kQPanelBytes, warp, g, t4, dq0);
    StageDqTile(staging + 2 * Tr::kQPanelBytes, Tr::kQPanelBytes, warp, g, t4, dq1);
    FenceProxyAsync();
    MbarArrive(&dq_staged[ring.stage]);
    MbarArrive(&q_empty[ring.stage]);
    ring.Advance();
  }

  // Epilogue: dK = scale * acc_dk, dV = acc_dv, columns [128 c, + 128) into
  // [B, S, K, D] by TMA stores (keys past S and columns past D dropped),
  // staged in the 128-byte swizzled layout in the Q (dK) and dO (dV) stages,
  // which no product reads any more once both consumers get here. Keys no
  // query sees get zeros (num_iters == 0).
  if (num_iters > 0) MbarWait(dq_drained, 0);  // the last dQ staging has been read
  NamedBarrierSync(7, 256);
  unsigned char* dk_stage = s_q + cg * 2 * Tr::kQPanelBytes;
  unsigned char* dv_stage = s_do + cg * 2 * Tr::kQPanelBytes;
  const float dk_scale[2] = {p.softmax_scale, p.softmax_scale};
  const float dv_scale[2] = {1.f, 1.f};
  StageAccumulatorTile<Elem>(dk_stage, Tr::kQPanelBytes, warp, lane, acc_dk, dk_scale);
  StageAccumulatorTile<Elem>(dv_stage, Tr::kQPanelBytes, warp, lane, acc_dv, dv_scale);
  FenceProxyAsync();
  NamedBarrierSync(8 + cg, 128);
  if (wg_tid == 0 && n_begin < seqlen_k) {
    const RowHeadCoords at(args.kv_grad_heads_inner, n_begin, kv_head);
#pragma unroll
    for (int panel = 0; panel < 2; ++panel) {
      const int col = Tr::kHalf * cg + 64 * panel;
      TmaStore4d(dk_stage + panel * Tr::kQPanelBytes, &args.tma_dk, col, at.c1, at.c2, b);
      TmaStore4d(dv_stage + panel * Tr::kQPanelBytes, &args.tma_dv, col, at.c1, at.c2, b);
    }
    BulkCommitGroup();
    BulkWaitGroupRead<0>();  // the staging must outlive the copy engine's reads
  }
}

}  // namespace jax_flash2::cuda::sm90
