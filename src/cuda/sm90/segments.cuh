// Segment ids (packed sequences) on the Hopper kernels. Query i sees key j
// only when q_segment_ids[b, i] == kv_segment_ids[b, j] (and the window
// allows it). A pre-pass summarises the ids per block into scratch, so that
// each kernel visits only the block pairs whose ids can match and applies the
// per-element id test only to the pairs whose ids are not all one and the
// same. Two kernels:
//   chunk kernel: the [min, max] id of every query chunk (q_chunk rows) and
//     key chunk (kv_chunk keys), on long rows also of every group of
//     kSegmentGroupChunks chunks, and copies of both id rows padded to whole
//     chunks (so the kernels load id pairs as aligned int2, never past a row);
//   span-tile kernel: for every chunk, the chunks of the other side whose id
//     ranges intersect its own ([first, end): disjoint ranges cannot match;
//     for sorted ids that is exactly the documents it touches), and within
//     them a run [full_first, full_end) of chunks whose ids all equal its
//     single id (empty unless its ids are uniform): blocks there need no
//     per-element id test. A uniform query chunk whose id's keys form one
//     run also gets that run's exact bounds. Then, a block's chunks being
//     whole kernel tiles, the spans' unions per tile, and the key run of a
//     query tile whose chunks all share one (one document: the forward
//     treats it as a key range and starts its key blocks at the run, so a
//     document shorter than a few blocks takes as many blocks as it would
//     alone in a batch).
// Scanning the other side's ids inside the kernels instead costs every tile
// an O(S) pass over L2 at the start; the spans read O(groups + chunks of the
// groups that meet) summaries per chunk.
// The tiles ride in the span kernel because each dependent launch costs
// about 3 us (three kernels took 10.5-12.9 us), and the span kernel and the
// attention kernel after it launch as programmatic dependents: at T = S =
// 16k on an H100 the pre-pass takes 7.5-8.9 us (GPU time, back to back;
// sm90_prepass_selftest), 8.7-9.9 us launched plainly.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../../flash_params.h"
#include "../launch.h"
#include "primitives.cuh"
#include "segments.h"

namespace jax_flash2::cuda::sm90 {

namespace segments_detail {

// Chunk c of row b of one side (a warp): its padded id copy (INT32_MIN past
// the row: those rows / keys are outside the window anyway) and its [min,
// max] id into mm; every lane gets the [min, max].
__device__ __forceinline__ int2 SummarizeChunk(const FlashParams& p, const SegmentBlocks& s,
                                               bool q_side, int64_t b, int c, int lane,
                                               int2* q_mm, int2* kv_mm) {
  const int per_row = q_side ? s.num_q_chunks : s.num_kv_chunks;
  const int chunk = q_side ? s.q_chunk : s.kv_chunk;
  const int64_t len = q_side ? p.seqlen_q : p.seqlen_k;
  const int64_t x0 = int64_t{c} * chunk;
  const int32_t* ids = (q_side ? p.q_segment_ids : p.kv_segment_ids) + b * len;
  int32_t* pad = const_cast<int32_t*>(q_side ? s.q_ids : s.kv_ids) + b * per_row * chunk;
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  for (int x = lane; x < chunk; x += 32) {
    const int64_t pos = x0 + x;
    const int32_t id = pos < len ? ids[pos] : INT32_MIN;
    if (pos < len) {
      lo = min(lo, id);
      hi = max(hi, id);
    }
    pad[pos] = id;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  if (lane == 0) (q_side ? q_mm : kv_mm)[b * per_row + c] = make_int2(lo, hi);
  return make_int2(lo, hi);
}

// Rows of at most kSegmentFlatScanChunks chunks: a warp per chunk, query
// chunks first, no group summaries.
static __global__ void __launch_bounds__(256) SegmentChunkKernel(const FlashParams p, SegmentBlocks s,
                                                          int2* q_mm, int2* kv_mm) {
  AllowDependentLaunch();
  const int lane = threadIdx.x % 32;
  const int64_t nq = static_cast<int64_t>(s.num_q_chunks) * p.batch;
  const int64_t total = nq + static_cast<int64_t>(s.num_kv_chunks) * p.batch;
  for (int64_t w = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; w < total;
       w += gridDim.x * int64_t{blockDim.x} / 32) {
    const bool q_side = w < nq;
    const int64_t c = q_side ? w : w - nq;
    const int per_row = q_side ? s.num_q_chunks : s.num_kv_chunks;
    SummarizeChunk(p, s, q_side, c / per_row, static_cast<int>(c % per_row), lane, q_mm, kv_mm);
  }
}

// Longer rows: a block per group of kSegmentGroupChunks chunks, a warp per
// chunk, query groups first; also each group's [min, max] into group_mm.
inline constexpr int kGroupKernelThreads = 32 * kSegmentGroupChunks;

static __global__ void __launch_bounds__(kGroupKernelThreads)
    SegmentGroupKernel(const FlashParams p, SegmentBlocks s, int2* q_mm, int2* kv_mm,
                       int2* q_group_mm, int2* kv_group_mm) {
  AllowDependentLaunch();
  __shared__ int2 warp_mm[kSegmentGroupChunks];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q_groups = static_cast<int>(SegmentGroups(s.num_q_chunks));
  const int kv_groups = static_cast<int>(SegmentGroups(s.num_kv_chunks));
  const int64_t nq = int64_t{q_groups} * p.batch;
  const int64_t total = nq + int64_t{kv_groups} * p.batch;
  for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
    const bool q_side = g < nq;
    const int64_t row_group = q_side ? g : g - nq;
    const int groups = q_side ? q_groups : kv_groups;
    const int per_row = q_side ? s.num_q_chunks : s.num_kv_chunks;
    const int64_t b = row_group / groups;
    const int c = static_cast<int>(row_group % groups) * kSegmentGroupChunks + warp;
    int2 m = make_int2(INT32_MAX, INT32_MIN);
    if (c < per_row) m = SummarizeChunk(p, s, q_side, b, c, lane, q_mm, kv_mm);
    if (lane == 0) warp_mm[warp] = m;
    __syncthreads();
    if (warp == 0) {
      m = lane < kSegmentGroupChunks ? warp_mm[lane] : make_int2(INT32_MAX, INT32_MIN);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        m.x = min(m.x, __shfl_xor_sync(0xffffffffu, m.x, off));
        m.y = max(m.y, __shfl_xor_sync(0xffffffffu, m.y, off));
      }
      if (lane == 0) (q_side ? q_group_mm : kv_group_mm)[row_group] = m;
    }
    __syncthreads();  // warp_mm is rewritten by the next group
  }
}

// Where id x lies among the kv_chunk padded ids of a key chunk (a warp's
// scan): the first and last position holding it and how many do.
struct IdRun {
  int first, last, count;
};
__device__ __forceinline__ IdRun FindIdRun(const int32_t* chunk_ids, int kv_chunk, int32_t x,
                                           int lane) {
  IdRun r{INT_MAX, -1, 0};
  for (int i = lane; i < kv_chunk; i += 32) {
    if (chunk_ids[i] == x) {
      r.first = min(r.first, i);
      r.last = max(r.last, i);
      ++r.count;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    r.first = min(r.first, __shfl_xor_sync(0xffffffffu, r.first, off));
    r.last = max(r.last, __shfl_xor_sync(0xffffffffu, r.last, off));
    r.count += __shfl_xor_sync(0xffffffffu, r.count, off);
  }
  return r;
}

// The keys [first, end) of id x when they form one run within key chunks
// [c0, c1] (every chunk strictly between holds only x), else {-1, -1}.
// Warp-wide; every lane gets the answer.
__device__ __forceinline__ int2 KeyRunOf(const int2* kv_mm_row, const int32_t* kv_ids_row,
                                         int kv_chunk, int32_t x, int c0, int c1, int lane) {
  bool interior = true;
  for (int j = c0 + 1 + lane; j < c1; j += 32) {
    const int2 o = kv_mm_row[j];
    interior = interior && o.x == x && o.y == x;
  }
  if (!__all_sync(0xffffffffu, interior)) return make_int2(-1, -1);
  const int n = kv_chunk;
  const IdRun a = FindIdRun(kv_ids_row + c0 * n, n, x, lane);
  if (a.count == 0 || a.count != a.last - a.first + 1) return make_int2(-1, -1);
  if (c0 == c1) return make_int2(c0 * n + a.first, c0 * n + a.last + 1);
  const IdRun z = FindIdRun(kv_ids_row + c1 * n, n, x, lane);
  // A suffix of chunk c0, a prefix of chunk c1.
  if (a.last != n - 1 || z.first != 0 || z.count != z.last + 1) return make_int2(-1, -1);
  return make_int2(c0 * n + a.first, c1 * n + z.last + 1);
}

// Chunk c of a row (a warp): its span over the other side's chunks (see the
// top) into span_row[c], and for a uniform query chunk its id's key run into
// q_keys_row[c] (q_keys_row null on the key side; kv_ids_row: the padded key
// ids of the row). Past kSegmentFlatScanChunks chunks, only the chunks of
// the other side's groups whose ids meet its own are read: a chunk outside
// them meets none of its ids, and a chunk of its uniform id lies in one.
__device__ __forceinline__ void SpanOfChunk(const int2* own_mm_row, const int2* other_mm_row,
                                            const int2* other_group_mm_row, int other_n,
                                            const int32_t* kv_ids_row, int kv_chunk, int c,
                                            int lane, int4* span_row, int2* q_keys_row) {
  const int2 own = own_mm_row[c];
  const bool uniform = own.x == own.y;
  int first = INT_MAX, last = -1, full_first = INT_MAX, full_last = -1, full_count = 0;
  auto visit = [&](int j) {
    const int2 o = other_mm_row[j];
    if (o.x <= own.y && own.x <= o.y) {
      first = min(first, j);
      last = max(last, j);
    }
    if (uniform && o.x == o.y && o.x == own.x) {
      full_first = min(full_first, j);
      full_last = max(full_last, j);
      ++full_count;
    }
  };
  if (!SearchesSegmentGroups(other_n)) {
    for (int j = lane; j < other_n; j += 32) visit(j);
  } else {
    // A warp tests 32 groups at once, then reads each group that meets
    // this chunk's ids: one group of 32 chunks, a chunk a lane.
    static_assert(kSegmentGroupChunks == 32, "a group is read in one warp pass");
    const int other_groups = static_cast<int>(SegmentGroups(other_n));
    for (int g0 = 0; g0 < other_groups; g0 += 32) {
      bool meets = false;
      if (g0 + lane < other_groups) {
        const int2 o = other_group_mm_row[g0 + lane];
        meets = o.x <= own.y && own.x <= o.y;
      }
      for (unsigned hits = __ballot_sync(0xffffffffu, meets); hits != 0; hits &= hits - 1) {
        const int j = (g0 + __ffs(hits) - 1) * kSegmentGroupChunks + lane;
        if (j < other_n) visit(j);
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    first = min(first, __shfl_xor_sync(0xffffffffu, first, off));
    last = max(last, __shfl_xor_sync(0xffffffffu, last, off));
    full_first = min(full_first, __shfl_xor_sync(0xffffffffu, full_first, off));
    full_last = max(full_last, __shfl_xor_sync(0xffffffffu, full_last, off));
    full_count += __shfl_xor_sync(0xffffffffu, full_count, off);
  }
  if (q_keys_row != nullptr) {
    int2 run = make_int2(-1, -1);
    if (uniform && first <= last) {
      run = KeyRunOf(other_mm_row, kv_ids_row, kv_chunk, own.x, first, last, lane);
    }
    if (lane == 0) q_keys_row[c] = run;
  }
  if (lane != 0) return;
  int4 span = make_int4(0, 0, 0, 0);
  if (first <= last) {
    span.x = first;
    span.y = last + 1;
    // Only a contiguous run of uniform, equal chunks skips the id test; ids
    // that repeat after a gap (unsorted) keep it everywhere.
    if (full_count > 0 && full_count == full_last - full_first + 1) {
      span.z = full_first;
      span.w = full_last + 1;
    }
  }
  span_row[c] = span;
}

// Kernel tile i of a row (a thread): the union of its chunks' spans into
// kv_tiles_row[i] (a key tile: q_keys_row null), or, with the key run its
// chunks share if they do, into q_tiles_row[i].
__device__ __forceinline__ void SummarizeTile(const int4* spans_row, int chunks, int tile_chunks,
                                              int i, const int2* q_keys_row, int4* q_tiles_row,
                                              int2* kv_tiles_row) {
  const int c0 = i * tile_chunks;
  const int c_end = min(c0 + tile_chunks, chunks);
  int a = INT_MAX, z = INT_MIN;
  for (int c = c0; c < c_end; ++c) {
    const int4 r = spans_row[c];
    if (r.x < r.y) {
      a = min(a, r.x);
      z = max(z, r.y);
    }
  }
  if (q_keys_row == nullptr) {
    kv_tiles_row[i] = a < z ? make_int2(a, z) : make_int2(0, 0);
    return;
  }
  int2 run = q_keys_row[c0];
  for (int c = c0 + 1; c < c_end; ++c) {
    if (q_keys_row[c].x != run.x || q_keys_row[c].y != run.y) run = make_int2(-1, -1);
  }
  q_tiles_row[i] = a < z ? make_int4(a, z, run.x, run.y) : make_int4(0, 0, -1, -1);
}

// Chunks a span-tile block takes at most: one per warp.
inline constexpr int kSpanTileWarps = 8;

// A span-tile block's items per row: runs of q_per query tiles or kv_per
// key tiles, as many whole tiles as its warps have chunks for (at least one).
struct SpanTileItems {
  int q_per, kv_per, q_items, kv_items;
};
__host__ __device__ inline SpanTileItems SpanTileItemsOf(const SegmentBlocks& s) {
  SpanTileItems r;
  r.q_per = s.q_tile_chunks >= kSpanTileWarps ? 1 : kSpanTileWarps / s.q_tile_chunks;
  r.kv_per = s.kv_tile_chunks >= kSpanTileWarps ? 1 : kSpanTileWarps / s.kv_tile_chunks;
  r.q_items = (s.num_q_tiles + r.q_per - 1) / r.q_per;
  r.kv_items = (s.num_kv_tiles + r.kv_per - 1) / r.kv_per;
  return r;
}

// Items (query side of each row first, then key side): a run of whole
// tiles of one side of one row. The block's warps take its chunks' spans,
// then, after a block barrier, its threads the tiles, so the tiles need no
// launch of their own.
static __global__ void __launch_bounds__(32 * kSpanTileWarps)
    SegmentSpanTileKernel(const FlashParams p, SegmentBlocks s, const int2* q_mm,
                          const int2* kv_mm, const int2* q_group_mm, const int2* kv_group_mm,
                          int2* q_keys) {
  WaitForPrimaryGrid();  // the chunk kernel's summaries
  AllowDependentLaunch();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nq = s.num_q_chunks, nk = s.num_kv_chunks;
  const auto [q_per, kv_per, q_items, kv_items] = SpanTileItemsOf(s);
  const int64_t total = static_cast<int64_t>(q_items + kv_items) * p.batch;
  if (blockIdx.x == 0 && threadIdx.x == 0) *s.tile_counter = 0;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t b = item / (q_items + kv_items);
    const int i = static_cast<int>(item % (q_items + kv_items));
    const bool q_side = i < q_items;
    const int per = q_side ? q_per : kv_per;
    const int tile_chunks = q_side ? s.q_tile_chunks : s.kv_tile_chunks;
    const int chunks = q_side ? nq : nk;
    const int t0 = (q_side ? i : i - q_items) * per;
    const int t1 = min(t0 + per, q_side ? s.num_q_tiles : s.num_kv_tiles);
    const int c1 = min(chunks, t1 * tile_chunks);
    const int2* q_mm_row = q_mm + b * nq;
    const int2* kv_mm_row = kv_mm + b * nk;
    const int2* q_group_row = q_group_mm + b * SegmentGroups(nq);
    const int2* kv_group_row = kv_group_mm + b * SegmentGroups(nk);
    int4* span_row = const_cast<int4*>(q_side ? s.q_span + b * nq : s.kv_span + b * nk);
    int2* q_keys_row = q_keys + b * nq;
    for (int c = t0 * tile_chunks + warp; c < c1; c += kSpanTileWarps) {
      if (q_side) {
        SpanOfChunk(q_mm_row, kv_mm_row, kv_group_row, nk, s.kv_ids + b * nk * s.kv_chunk,
                    s.kv_chunk, c, lane, span_row, q_keys_row);
      } else {
        SpanOfChunk(kv_mm_row, q_mm_row, q_group_row, nq, nullptr, 0, c, lane, span_row,
                    nullptr);
      }
    }
    __syncthreads();  // the spans and key runs above (global) are read back below
    for (int t = t0 + static_cast<int>(threadIdx.x); t < t1; t += blockDim.x) {
      if (q_side) {
        SummarizeTile(span_row, nq, tile_chunks, t, q_keys_row,
                      const_cast<int4*>(s.q_tiles) + b * s.num_q_tiles, nullptr);
      } else {
        SummarizeTile(span_row, nk, tile_chunks, t, nullptr, nullptr,
                      const_cast<int2*>(s.kv_tiles) + b * s.num_kv_tiles);
      }
    }
  }
}

}  // namespace segments_detail

// Runs the pre-pass of p's segment ids in chunks of q_chunk query rows and
// kv_chunk keys into scratch (SegmentScratchLayout(p, q_chunk, kv_chunk)
// bytes) and fills *out for the kernel. Nothing to do (out stays empty)
// without segment ids.
static inline cudaError_t RunSegmentPrepass(const FlashParams& p, int q_chunk, int kv_chunk,
                                            int q_tile_chunks, int kv_tile_chunks,
                                            void* scratch, int sm_count, SegmentBlocks* out,
                                            cudaStream_t stream) {
  *out = SegmentBlocks{};
  if (!HasSegmentIds(p)) return cudaSuccess;
  if (scratch == nullptr || p.kv_segment_ids == nullptr) return cudaErrorInvalidValue;
  const SegmentScratch lay =
      SegmentScratchLayout(p, q_chunk, kv_chunk, q_tile_chunks, kv_tile_chunks);
  char* base = static_cast<char*>(scratch);
  SegmentBlocks s;
  s.q_chunk = q_chunk;
  s.kv_chunk = kv_chunk;
  s.num_q_chunks = static_cast<int>((p.seqlen_q + q_chunk - 1) / q_chunk);
  s.num_kv_chunks = static_cast<int>((p.seqlen_k + kv_chunk - 1) / kv_chunk);
  s.q_span = reinterpret_cast<const int4*>(base + lay.q_span);
  s.kv_span = reinterpret_cast<const int4*>(base + lay.kv_span);
  s.q_ids = reinterpret_cast<const int32_t*>(base + lay.q_ids);
  s.kv_ids = reinterpret_cast<const int32_t*>(base + lay.kv_ids);
  s.q_tile_chunks = q_tile_chunks;
  s.kv_tile_chunks = kv_tile_chunks;
  s.num_q_tiles = (s.num_q_chunks + q_tile_chunks - 1) / q_tile_chunks;
  s.num_kv_tiles = (s.num_kv_chunks + kv_tile_chunks - 1) / kv_tile_chunks;
  s.q_tiles = reinterpret_cast<const int4*>(base + lay.q_tiles);
  s.kv_tiles = reinterpret_cast<const int2*>(base + lay.kv_tiles);
  s.tile_counter = reinterpret_cast<int*>(base + lay.tile_counter);
  int2* q_mm = reinterpret_cast<int2*>(base + lay.q_mm);
  int2* kv_mm = reinterpret_cast<int2*>(base + lay.kv_mm);
  int2* q_keys = reinterpret_cast<int2*>(base + lay.q_keys);
  int2* q_group_mm = reinterpret_cast<int2*>(base + lay.q_group_mm);
  int2* kv_group_mm = reinterpret_cast<int2*>(base + lay.kv_group_mm);
  const int64_t chunks = (static_cast<int64_t>(s.num_q_chunks) + s.num_kv_chunks) * p.batch;
  if (chunks > 0) {
    using namespace segments_detail;
    const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 132) * 16;
    if (SearchesSegmentGroups(std::max(s.num_q_chunks, s.num_kv_chunks))) {
      const int64_t groups =
          (SegmentGroups(s.num_q_chunks) + SegmentGroups(s.num_kv_chunks)) * p.batch;
      // At most the chunk kernel's cap in warps (8 a block there, a warp a
      // chunk of the group here).
      const unsigned blocks =
          static_cast<unsigned>(std::min<int64_t>(groups, cap * 8 / kSegmentGroupChunks));
      SegmentGroupKernel<<<blocks, kGroupKernelThreads, 0, stream>>>(p, s, q_mm, kv_mm,
                                                                     q_group_mm, kv_group_mm);
    } else {
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((chunks + 7) / 8, cap));
      SegmentChunkKernel<<<blocks, 256, 0, stream>>>(p, s, q_mm, kv_mm);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const SpanTileItems per_row = SpanTileItemsOf(s);
    const int64_t items = static_cast<int64_t>(per_row.q_items + per_row.kv_items) * p.batch;
    err = LaunchKernel(SegmentSpanTileKernel, dim3(static_cast<unsigned>(std::min(items, cap))),
                       dim3(32 * kSpanTileWarps), 0, stream, /*after_previous=*/true, p, s,
                       static_cast<const int2*>(q_mm), static_cast<const int2*>(kv_mm),
                       static_cast<const int2*>(q_group_mm),
                       static_cast<const int2*>(kv_group_mm), q_keys);
    if (err != cudaSuccess) return err;
  }
  *out = s;
  return cudaSuccess;
}

// ------------------------------------------------------------- kernel pieces

// Narrows a key tile's query block range [*lo, *hi) (in query chunks) to its
// span {first, end} (SegmentBlocks::kv_tiles); empty (*hi = *lo) when the
// span is.
__device__ __forceinline__ void NarrowToTileSpan(int2 span, int* lo, int* hi) {
  *lo = max(*lo, span.x);
  *hi = max(*lo, min(*hi, span.y));
}

// The per-element id test of an accumulator tile whose element i lies in
// accumulator row 16 warp + g + 8 ((i / 2) % 2) and column 8 (i / 4) + 2 t4
// + i % 2 (the wgmma C layout): elements whose column id differs from their
// row's id get `fill` (-inf for scores, 0 for probabilities). row_id: this
// thread's two rows' ids; col_ids: the padded id row at the tile's first
// column + 2 t4 (8-byte aligned).
// The ids are loaded four pairs at a time, behind a compiler barrier: all
// of them at once (22 pairs at 176 keys) raised the kernels' peak register
// use and spilled the plain path of the D 128 176-key and D 256 tiles.
template <int kAcc>
__device__ __forceinline__ void MaskUnequalIds(float (&x)[kAcc], const int32_t* col_ids,
                                               const int (&row_id)[2], float fill) {
  constexpr int kPairs = kAcc / 4;
#pragma unroll
  for (int j0 = 0; j0 < kPairs; j0 += 4) {
    int2 ids[4];
#pragma unroll
    for (int j = j0; j < j0 + 4 && j < kPairs; ++j) {
      ids[j - j0] = __ldg(reinterpret_cast<const int2*>(col_ids + 8 * j));
    }
#pragma unroll
    for (int j = j0; j < j0 + 4 && j < kPairs; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ids[j - j0].x != row_id[h]) x[4 * j + 2 * h] = fill;
        if (ids[j - j0].y != row_id[h]) x[4 * j + 2 * h + 1] = fill;
      }
    }
    asm volatile("" ::: "memory");
  }
}

}  // namespace jax_flash2::cuda::sm90
