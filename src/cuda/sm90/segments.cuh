// Segment ids (packed sequences) on the Hopper kernels. Query i sees key j
// only when q_segment_ids[b, i] == kv_segment_ids[b, j] (and the window
// allows it). A pre-pass summarises the ids per block into scratch, so that
// each kernel visits only the block pairs whose ids can match and applies the
// per-element id test only to the pairs whose ids are not all one and the
// same:
//   chunk kernel: the [min, max] id of every query chunk (q_chunk rows) and
//     key chunk (kv_chunk keys), and copies of both id rows padded to whole
//     chunks (so the kernels load id pairs as aligned int2, never past a row);
//   span kernel: for every chunk, the chunks of the other side whose id
//     ranges intersect its own ([first, end): disjoint ranges cannot match;
//     for sorted ids that is exactly the documents it touches), and within
//     them a run [full_first, full_end) of chunks whose ids all equal its
//     single id (empty unless its ids are uniform): blocks there need no
//     per-element id test. A uniform query chunk whose id's keys form one
//     run also gets that run's exact bounds;
//   tile kernel: the spans' unions per kernel tile, and the key run of a
//     query tile whose chunks all share one (one document: the forward
//     treats it as a key range and starts its key blocks at the run, so a
//     document shorter than a few blocks takes as many blocks as it would
//     alone in a batch).
// Scanning the other side's ids inside the kernels instead costs every tile
// an O(S) pass over L2 at the start; the summaries are O(chunks) per chunk
// and the two launches take a few microseconds at T = S = 16k.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../../flash_params.h"
#include "segments.h"

namespace jax_flash2::cuda::sm90 {

namespace segments_detail {

// One warp per chunk, query chunks first: its [min, max] id into mm, and its
// padded copy (INT32_MIN past the row: those rows / keys are outside the
// window anyway).
static __global__ void __launch_bounds__(256) SegmentChunkKernel(const FlashParams p, SegmentBlocks s,
                                                          int2* q_mm, int2* kv_mm) {
  const int lane = threadIdx.x % 32;
  const int64_t nq = static_cast<int64_t>(s.num_q_chunks) * p.batch;
  const int64_t total = nq + static_cast<int64_t>(s.num_kv_chunks) * p.batch;
  for (int64_t w = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; w < total;
       w += gridDim.x * int64_t{blockDim.x} / 32) {
    const bool q_side = w < nq;
    const int64_t c = q_side ? w : w - nq;
    const int per_row = q_side ? s.num_q_chunks : s.num_kv_chunks;
    const int chunk = q_side ? s.q_chunk : s.kv_chunk;
    const int64_t len = q_side ? p.seqlen_q : p.seqlen_k;
    const int64_t b = c / per_row;
    const int64_t x0 = (c % per_row) * chunk;
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
    if (lane == 0) (q_side ? q_mm : kv_mm)[c] = make_int2(lo, hi);
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

// One warp per chunk: its span over the other side's chunks (see the top),
// and for a uniform query chunk its id's key run into q_keys.
static __global__ void __launch_bounds__(256) SegmentSpanKernel(const FlashParams p, SegmentBlocks s,
                                                         const int2* q_mm, const int2* kv_mm,
                                                         int2* q_keys) {
  const int lane = threadIdx.x % 32;
  const int64_t nq = static_cast<int64_t>(s.num_q_chunks) * p.batch;
  const int64_t total = nq + static_cast<int64_t>(s.num_kv_chunks) * p.batch;
  for (int64_t w = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; w < total;
       w += gridDim.x * int64_t{blockDim.x} / 32) {
    const bool q_side = w < nq;
    const int64_t c = q_side ? w : w - nq;
    const int per_row = q_side ? s.num_q_chunks : s.num_kv_chunks;
    const int other_n = q_side ? s.num_kv_chunks : s.num_q_chunks;
    const int2* other = (q_side ? kv_mm : q_mm) + c / per_row * other_n;
    const int2 own = (q_side ? q_mm : kv_mm)[c];
    const bool uniform = own.x == own.y;
    int first = INT_MAX, last = -1, full_first = INT_MAX, full_last = -1, full_count = 0;
    for (int j = lane; j < other_n; j += 32) {
      const int2 o = other[j];
      if (o.x <= own.y && own.x <= o.y) {
        first = min(first, j);
        last = max(last, j);
      }
      if (uniform && o.x == o.y && o.x == own.x) {
        full_first = min(full_first, j);
        full_last = max(full_last, j);
        ++full_count;
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
    if (q_side) {
      int2 run = make_int2(-1, -1);
      if (uniform && first <= last) {
        const int64_t b = c / per_row;
        run = KeyRunOf(other, s.kv_ids + b * other_n * s.kv_chunk, s.kv_chunk, own.x, first,
                       last, lane);
      }
      if (lane == 0) q_keys[c] = run;
    }
    if (lane != 0) continue;
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
    const_cast<int4*>(q_side ? s.q_span : s.kv_span)[c] = span;
  }
}

// One thread per kernel tile (query tiles first): the union of its chunks'
// spans, and for a query tile the key run its chunks share (if they do).
static __global__ void __launch_bounds__(256) SegmentTileKernel(const FlashParams p,
                                                                SegmentBlocks s,
                                                                const int2* q_keys) {
  const int64_t nq = static_cast<int64_t>(s.num_q_tiles) * p.batch;
  const int64_t total = nq + static_cast<int64_t>(s.num_kv_tiles) * p.batch;
  if (blockIdx.x == 0 && threadIdx.x == 0) *s.tile_counter = 0;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += gridDim.x * int64_t{blockDim.x}) {
    const bool q_side = t < nq;
    const int64_t i = q_side ? t : t - nq;
    const int per_row = q_side ? s.num_q_tiles : s.num_kv_tiles;
    const int chunks = q_side ? s.num_q_chunks : s.num_kv_chunks;
    const int k = q_side ? s.q_tile_chunks : s.kv_tile_chunks;
    const int4* spans = (q_side ? s.q_span : s.kv_span) + i / per_row * chunks;
    const int c0 = static_cast<int>(i % per_row) * k;
    int a = INT_MAX, z = INT_MIN;
    for (int c = c0; c < min(c0 + k, chunks); ++c) {
      const int4 r = spans[c];
      if (r.x < r.y) {
        a = min(a, r.x);
        z = max(z, r.y);
      }
    }
    if (!q_side) {
      const_cast<int2*>(s.kv_tiles)[i] = a < z ? make_int2(a, z) : make_int2(0, 0);
      continue;
    }
    const int2* keys = q_keys + i / per_row * chunks;
    int2 run = keys[c0];
    for (int c = c0 + 1; c < min(c0 + k, chunks); ++c) {
      if (keys[c].x != run.x || keys[c].y != run.y) run = make_int2(-1, -1);
    }
    const_cast<int4*>(s.q_tiles)[i] =
        a < z ? make_int4(a, z, run.x, run.y) : make_int4(0, 0, -1, -1);
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
  const int64_t warps = (static_cast<int64_t>(s.num_q_chunks) + s.num_kv_chunks) * p.batch;
  if (warps > 0) {
    const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 132) * 16;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((warps + 7) / 8, cap));
    segments_detail::SegmentChunkKernel<<<blocks, 256, 0, stream>>>(p, s, q_mm, kv_mm);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    segments_detail::SegmentSpanKernel<<<blocks, 256, 0, stream>>>(p, s, q_mm, kv_mm, q_keys);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    segments_detail::SegmentTileKernel<<<blocks, 256, 0, stream>>>(p, s, q_keys);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
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
