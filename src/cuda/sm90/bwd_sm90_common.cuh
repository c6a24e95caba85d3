// Pieces both Hopper backward kernels share (bwd_sm90_kernel.cuh,
// bwd_sm90_dsplit_kernel.cuh): the producer's TMA loads of a key tile and of
// a query block, and the causal / window mask of a 64-key P^T tile.
#pragma once

#include <climits>
#include <cstdint>

#include "../../flash_mask.h"
#include "bwd_sm90.h"
#include "primitives.cuh"
#include "segments.cuh"

namespace jax_flash2::cuda::sm90 {

// Rows [row0, + block) of (b, head) of two tensors (K and V, or Q and dO)
// into dst_a and dst_b, as `panels` 64-column panels of panel_bytes each,
// completing on `bar`.
__device__ __forceinline__ void LoadRowPanelPair(const CUtensorMap* map_a, bool a_heads_inner,
                                                 unsigned char* dst_a, const CUtensorMap* map_b,
                                                 bool b_heads_inner, unsigned char* dst_b,
                                                 uint64_t* bar, int panels, int panel_bytes,
                                                 int row0, int head, int b) {
#pragma unroll
  for (int panel = 0; panel < panels; ++panel) {
    TmaLoadRows(dst_a + panel * panel_bytes, map_a, a_heads_inner, bar, panel * 64, row0, head, b);
    TmaLoadRows(dst_b + panel * panel_bytes, map_b, b_heads_inner, bar, panel * 64, row0, head, b);
  }
}

// K and V rows [n_begin, + block) of (b, kv_head) into s_k and s_v.
__device__ __forceinline__ void LoadKvTile(const BwdSm90Args& args, unsigned char* s_k,
                                           unsigned char* s_v, uint64_t* bar, int panels,
                                           int panel_bytes, int n_begin, int kv_head, int b) {
  LoadRowPanelPair(&args.tma_k, args.k_heads_inner, s_k, &args.tma_v, args.v_heads_inner, s_v,
                   bar, panels, panel_bytes, n_begin, kv_head, b);
}

// Q and dO rows [m_begin, + block) of (b, head h) into one ring stage.
__device__ __forceinline__ void LoadQDoBlock(const BwdSm90Args& args, unsigned char* q_dst,
                                             unsigned char* do_dst, uint64_t* bar, int panels,
                                             int panel_bytes, int m_begin, int h, int b) {
  LoadRowPanelPair(&args.tma_q, args.q_heads_inner, q_dst, &args.tma_do, args.do_heads_inner,
                   do_dst, bar, panels, panel_bytes, m_begin, h, b);
}

// Which queries see a thread's two key rows of a 64-key tile [key0, + 64)
// (rows key0 + 16 warp + g + 8 rh, none past S): [q_lo[rh], q_hi[rh]). Query
// blocks inside [full_lo, full_hi) see all 64 keys (the tile's
// WindowMask::BlockFullyVisible). 32-bit ints computed once per tile: 64-bit
// tests in every iteration cost the D = 64 consumers spills.
struct KeyRowWindow {
  int q_lo[2], q_hi[2];
  int full_lo, full_hi;

  __device__ __forceinline__ bool FullyVisible(int m_begin, int block_m) const {
    return m_begin >= full_lo && m_begin + block_m <= full_hi;
  }
};

__device__ __forceinline__ KeyRowWindow KeyRowWindowFor(const WindowMask& mask, int key0,
                                                        int warp, int g, int64_t seqlen_q,
                                                        int seqlen_k) {
  KeyRowWindow w;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int key = key0 + 16 * warp + g + 8 * rh;
    int64_t lo = 0, hi = 0;
    if (key < seqlen_k) mask.QueryRange(key, key + 1, seqlen_q, &lo, &hi);
    w.q_lo[rh] = static_cast<int>(lo);
    w.q_hi[rh] = static_cast<int>(hi);
  }
  w.full_lo = INT_MAX;
  int64_t lo, hi;
  if (key0 + 64 <= seqlen_k) {
    mask.QueryRange(key0 + 63, key0 + 64, INT_MAX, &lo, &hi);
    w.full_lo = static_cast<int>(lo);
  }
  mask.QueryRange(key0, key0 + 1, INT_MAX, &lo, &hi);
  w.full_hi = static_cast<int>(hi);
  return w;
}

// Zeroes the masked elements of a 64-key x (kAcc / 4 * 8)-query P^T
// accumulator (element i: key row 16 warp + g + 8 ((i / 2) % 2), query
// m_begin + 8 (i / 4) + 2 t4 + i % 2). For blocks not fully visible only:
// one branch per block, none per element (a per-element mask call made
// ptxas wrap every exponential in its own branch).
template <int kAcc>
__device__ __forceinline__ void ZeroMaskedScores(float (&p)[kAcc], int m_begin, int t4,
                                                 const KeyRowWindow& window) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int query = m_begin + 8 * (i / 4) + 2 * t4 + (i & 1);
    const int rh = (i / 2) % 2;
    if (query < window.q_lo[rh] || query >= window.q_hi[rh]) p[i] = 0.f;
  }
}

// Segment ids: the queries [x, y) whose ids all equal the one id of the 64
// keys from key0 (a multiple of 64, the pre-pass's key chunk) of batch entry
// b, from the chunk's span (.z, .w, in query chunks of block_m, the kernel's
// query block). Empty past the last chunk: keys past S only (masked).
__device__ __forceinline__ int2 UniformIdQueries(const SegmentBlocks& seg, int b, int key0,
                                                 int block_m) {
  if (key0 / 64 >= seg.num_kv_chunks) return make_int2(0, 0);
  const int4 span = seg.kv_span[b * seg.num_kv_chunks + key0 / 64];
  return make_int2(span.z * block_m, span.w * block_m);
}

// Narrows the window's fully visible query blocks ([full_lo, full_hi), in
// queries) to UniformIdQueries; the blocks outside take ZeroUnequalIds after
// the window's mask, unless InUniformIdRun.
__device__ __forceinline__ void NarrowToUniformIds(const SegmentBlocks& seg, int b, int key0,
                                                   int block_m, KeyRowWindow* window) {
  if (seg.kv_span == nullptr) return;
  const int2 run = UniformIdQueries(seg, b, key0, block_m);
  window->full_lo = max(window->full_lo, run.x);
  window->full_hi = min(window->full_hi, run.y);
}

// Whether the query block [m_begin, + block_m) lies in UniformIdQueries: it
// holds only the keys' one id, so the window's mask alone applies. A causal
// diagonal block of one document is such a block (two in three blocks of
// 256-key documents at block_m 128) and skips ZeroUnequalIds.
__device__ __forceinline__ bool InUniformIdRun(const SegmentBlocks& seg, int b, int key0,
                                               int m_begin, int block_m) {
  const int2 run = UniformIdQueries(seg, b, key0, block_m);
  return m_begin >= run.x && m_begin + block_m <= run.y;
}

// Zeroes the elements of a P^T tile (the 64 keys from key0 of batch entry b
// x the queries from m_begin, MaskUnequalIds' layout) whose key and query ids
// differ. A key chunk past the last one holds keys past S only (masked,
// never written): it tests against the last chunk's ids.
template <int kAcc>
__device__ __forceinline__ void ZeroUnequalIds(float (&pt)[kAcc], const SegmentBlocks& seg, int b,
                                               int key0, int m_begin, int warp, int g, int t4) {
  const int chunk = b * seg.num_kv_chunks + min(key0 / 64, seg.num_kv_chunks - 1);
  const int32_t* key_ids = seg.kv_ids + chunk * 64 + 16 * warp + g;
  const int row_id[2] = {key_ids[0], key_ids[8]};
  MaskUnequalIds(pt, seg.q_ids + b * seg.num_q_chunks * seg.q_chunk + m_begin + 2 * t4, row_id,
                 0.f);
}

// The deterministic dQ order (Sm90BackwardDqTurns, bwd_sm90.h): the last
// of the key blocks (of block_n keys, num_n_blocks of them) whose QueryRange
// reaches the query block [m_begin, + block_m); it adds its dQ first, key
// block n as the (last - n)-th. QueryRange's start and end grow with the key
// block (and its start stays below T), so the key blocks that reach a query
// block are a contiguous run; only the window's right edge bounds its end:
// key block n reaches the block when n block_n < m_begin + block_m + S - T
// + right.
__device__ __forceinline__ int LastKeyBlockOf(const WindowMask& mask, int m_begin, int block_m,
                                              int block_n, int num_n_blocks) {
  if (mask.right < 0) return num_n_blocks - 1;
  const int64_t y = m_begin + block_m + mask.offset + mask.right;  // >= 1 for a reached block
  return static_cast<int>(min(static_cast<int64_t>(num_n_blocks - 1), (y - 1) / block_n));
}

// The key block of tile index t's position i = t % num_n_blocks within its
// (batch, K/V head), flip = BwdSm90Args::key_block_flip: i itself (flip 0),
// or in the deterministic backward flip - i, the key blocks from the last,
// so that each query block's first writer (the last key block that reaches
// it) is the first launched (bwd_sm90.h). (Of the forms tried, this one
// left ptxas's spills in the main loops as they were; a test of
// args.dq_turns here added some to the score options' kernels.)
__device__ __forceinline__ int KeyBlockAt(int i, int flip) { return flip + (flip > 0 ? -i : i); }

// The dQ warp's turn on a query block's counter: spin (acquire) until `turn`
// earlier key blocks have added theirs, then order the reductions that
// follow (async proxy) after that.
__device__ __forceinline__ void WaitDqTurn(const int* counter, int turn) {
  while (LoadAcquire(counter) != turn) {
  }
  FenceProxyAsyncGlobal();
}

// Once this thread's reductions have landed (BulkWaitGroup<0>), hands the
// block to the next key block: counter = turn + 1 (release), after the
// async proxy's writes.
__device__ __forceinline__ void PassDqTurn(int* counter, int next_turn) {
  FenceProxyAsyncGlobal();
  StoreRelease(counter, next_turn);
}

}  // namespace jax_flash2::cuda::sm90
