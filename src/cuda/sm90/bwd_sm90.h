// Hopper (sm_90a) backward: host interface, tile table and the kernel's
// argument block. Built into the sm_90a-only library (CMakeLists.txt).
// RunBackward (bwd_launch.cu) runs its preprocess kernel (lse2, Dvec, dq_acc =
// 0), then RunBackwardSm90 in place of the sm80 main kernel where the call's
// plan (MakeBackwardPlan, src/plan.h) picks the Hopper backward, then its
// convert kernel: the scratch layout (bwd_traits.h) is the same for both.
#pragma once

#include <cuda.h>  // CUtensorMap (type only)
#include <cuda_runtime.h>

#include "../../flash_params.h"
#include "../flash_cuda.h"
#include "head_dim.h"
#include "segments.h"
#include "score_options.h"

namespace jax_flash2::cuda {

struct BwdScratchPtrs;  // bwd_kernel.cuh

// True when the Hopper backward can serve p: bf16/fp16, D <= 256 (by the
// tile of D's bucket, head_dim.h), only the score options
// src/sm90_options.h lists (softcap, ALiBi, segment ids in pairs), every
// stride a multiple of 8 elements and every pointer 16-byte aligned (TMA),
// sizes within the grid limits. Deterministic calls included (see
// Sm90BackwardDqTurns).
bool Sm90BackwardSupports(const FlashParams& p);

// The main backward kernel (dK, dV, and dQ / scale accumulated into
// s.dq_acc), on the current device (must be cc 9.0); the caller runs the
// preprocess before and the convert after, as for the sm80 kernel.
// dQ goes into dq_acc by bulk tensor reductions of whole 64 x 32 fp32 tiles
// (a dq_acc tensor map): float2 atomics from every thread measured 404
// against 450 TFLOP/s at B4 T=S=4096 H16 D128 (and a per-row bulk reduction
// was slower than the atomics). The D-split kernel (D > 128) stages its dQ
// over the Q and dO stages it has just used.
// Returns cudaErrorInvalidValue when !Sm90BackwardSupports(p), s has more
// than one dQ slice, or s lacks the dq_turns p needs.
cudaError_t RunBackwardSm90(const FlashParams& p, const BwdScratchPtrs& s, const DeviceInfo& dev,
                            cudaStream_t stream);

// Stream-K slots (BwdScratchLayout::sk_slots) RunBackwardSm90 uses for p on
// dev: 0 when the call's tiles fill whole rounds of the SMs or differ in
// length (a mask). With fewer in the scratch it runs whole tiles only.
int64_t Sm90BackwardStreamKSlots(const FlashParams& p, const DeviceInfo& dev);

// The deterministic backward (p.deterministic): dQ in one accumulator, each
// element summed in one fixed order. Every (batch, query head, query block)
// has a counter in the scratch (BwdScratchLayout::dq_turns, zeroed per call):
// how many key blocks have added their dQ to that block so far. Key block n
// has a turn j per query block; its dQ warp waits (acquire) until the
// counter is j, issues the reductions, waits until they have landed, and
// stores j + 1 (release). Two orders:
// - Descending: the key blocks that see a query block are a contiguous run
//   ..., n1 - 1, n1 (window masks are bands; segment ids do not narrow a
//   tile's query blocks here), and key block n1 - j adds its dQ as the j-th.
//   Tiles take a (batch, K/V head)'s key blocks from the last
//   (BwdSm90Args::key_block_flip), so a CTA waits only on tiles of lower
//   index: launched before it (one CTA per tile, started in blockIdx order),
//   or taken earlier in the persistent grid's walk, whose CTAs are all
//   resident. Under a causal mask each query block's first writer is then its
//   diagonal key block, and key block n, whose first query block comes before
//   n + 1's, meets each later one after n + 1 has: no waiting. (In ascending
//   order key block n would wait for key block 0 to reach its first query
//   block, holding its SM meanwhile.) Unmasked, every tile starts at the
//   same query block and waits there for all the key blocks after its own: a
//   chain of one reduction latency per key block, once per tile.
// - Rotated (unmasked calls that fit; RotatesDqOrder, bwd_sm90_launch.cu):
//   key block n walks its I iterations from iteration n on, and iteration w
//   takes the key blocks in the order they reach it (dq_order.h). In step,
//   key block n + 1 has added its dQ to w one iteration before n gets there,
//   so no tile waits out a chain; but the last key blocks' last iterations
//   wait for the first ones' first, so all tiles of a (batch, K/V head) must
//   run at once: the grid takes whole groups of tiles per round (a
//   persistent walk of (SMs / N) N CTAs).
// No stream-K (a tile's pieces would run out of either order). Counters
// needed by p (0 unless deterministic), counted with the smallest block_m of
// the tiles (64).
int64_t Sm90BackwardDqTurns(const FlashParams& p);

namespace sm90 {

// One row per head dim. At D <= 128 a CTA's tile is kBlockN = 128 keys of
// one (batch, K/V head), 64 per consumer warpgroup, and it loops over block_m
// query rows at a time (of every query head of its group): 128 at D = 64,
// where the five products are half as long per query, so that the
// per-block costs (waits, barriers, the dQ reduction) are paid half as
// often; 64 at D = 128, whose dK, dV accumulators leave no registers for
// more. Shared memory, 2-byte elements: K, V (block_n x D each), `stages` x
// (Q, dO) (block_m x D each), two dS^T buffers (block_n x block_m), in fp32
// the dQ staging tiles (64 x 64 per consumer warpgroup), at D = 128 a dV
// staging tile (block_n x D; see the kernel's epilogue), and `stages` x
// (lse2, Dvec) (block_m each):
//   D = 64:  32 KB + 2 x 32 KB + 64 KB + 32 KB + 2 KB = 194 KB
//   D = 128: 64 KB + 2 x 32 KB + 32 KB + 32 KB + 32 KB + 1 KB = 225 KB
// Registers per consumer thread: dK, dV (D / 2 fp32 each), S^T and dP^T
// (block_m / 2 fp32 each), dQ (32 fp32), P^T and dS^T as A fragments
// (block_m / 4 b32 each), lse2 and Dvec of the block (block_m / 4 fp32
// each): about 230 at the peak (S^T, dP^T beside dK, dV).
// persistent: unmasked calls run one CTA per SM, each walking tiles (key
// blocks) in rounds, so that a tile's K, V and first Q, dO load under the
// previous tile's dK, dV epilogue: +4-5% at D = 64. At D = 128, whose tiles
// are as long with half as many query rows per iteration, it gained nothing
// and lost 2-3% at T = 16k (a static walk cannot even out tiles that happen
// to run slow), so D = 128 keeps one CTA per tile. Masked calls (segment ids
// included) keep one CTA per tile: their tiles differ in length, and the
// hardware starts them in order, longest (key block 0 under a causal mask)
// first.
// Stream-K (unmasked calls whose tiles do not fill whole rounds of the SMs):
// 2048 tiles of equal length on 132 SMs take 16 rounds for 15.5 rounds of
// work. The last two rounds' tiles are then shared out as iterations (query
// blocks), a contiguous range per CTA, so a tile may be cut between two CTAs
// (each cut once at most: every range covers a tile or more). The piece that
// finishes first parks its fp32 dK, dV in a slot of the scratch; the other
// adds them and writes dK, dV. dQ needs nothing: it is a sum in dq_acc anyway.
// Whole backward at B4 T 4096 D 128: 559 -> 570 TFLOP/s.
struct BwdSm90Tile {
  int head_dim;
  int block_m;
  int block_n;
  int stages;
  bool persistent;
};

// D = 256 has a tile of its own (block_n 64, BwdSm90SplitsD): its
// accumulators and operands fit neither the registers nor the shared memory
// of the 128-key tile; bwd_sm90_dsplit_kernel.cuh says how it splits D.
inline constexpr BwdSm90Tile kBwdSm90TileTable[] = {
    {64, 128, 128, 2, true},
    {128, 64, 128, 2, false},
    {256, 64, 64, 2, false},
};

// The row of D's bucket (head_dim.h: D = 40 runs the D = 64 kernel, D = 96
// the D = 128 one, D = 200 the D = 256 one), or zeros (D > 256).
constexpr BwdSm90Tile BwdSm90TileFor(int64_t head_dim) {
  const int64_t bucket = Sm90HeadDimBucket(head_dim);
  for (const BwdSm90Tile& t : kBwdSm90TileTable) {
    if (t.head_dim == bucket) return t;
  }
  return BwdSm90Tile{0, 0, 0, 0, false};
}
static_assert(BwdSm90TileFor(40).head_dim == 64 && BwdSm90TileFor(96).head_dim == 128 &&
              BwdSm90TileFor(136).head_dim == 256 && BwdSm90TileFor(264).head_dim == 0);

// Whether the tile is BwdSm90DSplitKernel's (its consumer warpgroups split D,
// not the keys): one tile per CTA, no stream-K.
constexpr bool BwdSm90SplitsD(const BwdSm90Tile& t) { return t.head_dim > 128; }

// Warp roles: warpgroup 0 produces (one thread issues every TMA load, one
// warp stages lse2 and Dvec, one issues the dQ reductions), warpgroups 1
// and 2 consume, 64 keys each.
inline constexpr int kBwdConsumerWarpgroups = 2;
inline constexpr int kBwdSm90Threads = 128 * (1 + kBwdConsumerWarpgroups);
// setmaxnreg budget: 128 x 24 + 256 x 240 = 64512 registers, what the launch
// allocates (168 x 384): the consumers' increase waits until the producer's
// decrease has returned as many, so 32 here hangs the kernel. The producer
// only computes coordinates (ptxas spills 16 bytes in the D = 64 row warp);
// the consumers hold dK and dV.
inline constexpr int kBwdProducerRegs = 24;
inline constexpr int kBwdConsumerRegs = 240;

// dK and dV are staged for their TMA stores in each warpgroup's own key rows
// of the two dS^T buffers, which hold 2 block_m / 64 panels of 64 columns
// per row: dK needs head_dim / 64 of them and dV as many. At D = 64 both
// fit; at D = 128 only dK does, and dV gets a tile of its own.
constexpr bool BwdSm90DvStagedInDs(const BwdSm90Tile& t) { return t.block_m >= t.head_dim; }

// Iterations of an unmasked tile (every query block of every head of the
// group): the unit that stream-K shares out, for the host's plan and the
// kernel's walk alike.
__host__ __device__ constexpr int64_t BwdSm90FullTileIters(int64_t seqlen_q, int64_t group_size,
                                                           int block_m) {
  return (seqlen_q + block_m - 1) / block_m * group_size;
}

// fp32 per stream-K slot: dK and dV accumulators (D / 2 each, D the tile's
// head dim) of the 256 consumer threads.
constexpr int64_t BwdSm90SlotFloats(int64_t head_dim) {
  return 128 * kBwdConsumerWarpgroups * BwdSm90TileFor(head_dim).head_dim;
}

constexpr int BwdSm90SmemBytes(const BwdSm90Tile& t) {
  if (BwdSm90SplitsD(t)) {
    // K, V, `stages` x (Q, dO), P^T and dS^T (block_n x block_m), `stages` x
    // (lse2, Dvec), the mbarriers (kv_full; four per stage; three between the
    // consumers and the dQ warp): 64 + 128 + 16 + 1 KB + 1 KB slack = 210 KB
    // at D = 256. (dQ is staged over the Q and dO stages; the score options'
    // kernel has a tile more: BwdSm90DSplitSmem::kOptionsSmemBytes.)
    return 2 * t.block_n * t.head_dim * 2 + t.stages * 2 * t.block_m * t.head_dim * 2 +
           2 * t.block_n * t.block_m * 2 + t.stages * 2 * t.block_m * 4 + (4 + 4 * t.stages) * 8 +
           1024;
  }
  const int kv = 2 * t.block_n * t.head_dim * 2;
  const int q_do = t.stages * 2 * t.block_m * t.head_dim * 2;
  const int ds = 2 * t.block_n * t.block_m * 2;
  // fp32 dQ staging: 64 x 64 per consumer warpgroup.
  const int dq = kBwdConsumerWarpgroups * 64 * 64 * 4;
  const int dv = BwdSm90DvStagedInDs(t) ? 0 : t.block_n * t.head_dim * 2;
  const int rows = t.stages * 2 * t.block_m * 4;  // lse2 and Dvec per stage
  // kv_full, kv_empty; q_full, q_empty per stage; a stream-K piece's role
  // (8 bytes) and the CTA's walk (8 ints; see the kernel)
  const int barriers = (2 + 2 * t.stages) * 8 + 8 + 32;
  return kv + q_do + ds + dq + dv + rows + barriers + 1024;  // 1 KB: alignment slack
}

// The kernel's by-value argument block (__grid_constant__, so the tensor maps
// sit in parameter space). Maps as in FwdSm90Args: 4-D, `*_heads_inner` says
// whether the head dimension precedes the row dimension. d_o shares o's
// strides.
struct BwdSm90Args {
  CUtensorMap tma_q;
  CUtensorMap tma_do;
  CUtensorMap tma_k;
  CUtensorMap tma_v;
  CUtensorMap tma_dq;  // fp32 dq_acc [B, T, H, D], boxes of 32 columns x 64 rows
  CUtensorMap tma_dk;  // dk, dv [B, S, K, D] (k's strides): boxes of 64 rows
  CUtensorMap tma_dv;
  FlashParams p;
  const float* lse2 = nullptr;  // [B, H, t_pad]
  const float* dvec = nullptr;  // [B, H, t_pad]
  float* dq_acc = nullptr;      // [B, T, H, D]
  int64_t t_pad = 0;
  // Tiles: key block n of (b, K/V head) is tile n + num_n_blocks (b + B k),
  // and CTA i takes tiles i, i + gridDim.x, ... (one each, or a persistent
  // grid of one CTA per SM) below the stream-K tiles.
  int num_n_blocks = 0;
  int num_tiles = 0;  // < 2^31 (Sm90BackwardSupports)
  // Stream-K (see BwdSm90Tile): the last sk_ctas CTAs of the grid share the
  // iterations of tiles [sk_first_tile, num_tiles); the others take whole
  // tiles below sk_first_tile. sk_ctas == 0: whole tiles only. A cut tile's
  // pieces meet in slot sk_flags[2 i] (arrivals), [2 i + 1] (ready), and
  // sk_partial + i * BwdSm90SlotFloats(D), i < sk_ctas.
  int sk_first_tile = 0;
  int sk_ctas = 0;
  int* sk_flags = nullptr;
  float* sk_partial = nullptr;
  // Deterministic dQ (Sm90BackwardDqTurns): counter (b H + h) num_q_blocks +
  // m of query block m (of the tile's block_m rows); nullptr: any order.
  int* dq_turns = nullptr;
  int num_q_blocks = 0;
  // Tiles' key blocks (KeyBlockAt): 0, in order; num_n_blocks - 1 when
  // deterministic, from the last.
  int key_block_flip = 0;
  // The rotated dQ order (Sm90BackwardDqTurns, dq_order.h) instead of the
  // descending one.
  bool rotated_dq = false;
  bool q_heads_inner = true;
  bool do_heads_inner = true;
  bool k_heads_inner = true;
  bool v_heads_inner = true;
  bool kv_grad_heads_inner = true;
  // Segment ids: the pre-pass's summaries in chunks of block_m query rows
  // and 64 keys (one consumer warpgroup's; the D-split tile's 64);
  // segments.cuh. Empty without.
  SegmentBlocks seg;
  Sm90ScoreUnits units;  // the score units of p's softcap (score_options.h)
};

}  // namespace sm90
}  // namespace jax_flash2::cuda
