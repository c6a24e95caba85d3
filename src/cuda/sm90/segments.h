// The summaries of a call's segment ids that the Hopper kernels read
// (segments.cuh computes them): types and scratch layout only, so the
// kernels' argument blocks can hold them.
#pragma once

#include <cuda_runtime.h>  // int4

#include <cstddef>
#include <cstdint>

#include "../../flash_params.h"

namespace jax_flash2::cuda::sm90 {

// What the kernels read (FwdSm90Args::seg, BwdSm90Args::seg); q_span == null
// when the call has no segment ids.
struct SegmentBlocks {
  const int4* q_span = nullptr;   // [B, num_q_chunks]: key chunks {first, end, full_first, full_end}
  const int4* kv_span = nullptr;  // [B, num_kv_chunks]: query chunks, likewise
  const int32_t* q_ids = nullptr;   // [B, num_q_chunks * q_chunk], padded copy
  const int32_t* kv_ids = nullptr;  // [B, num_kv_chunks * kv_chunk], padded copy
  int q_chunk = 0, kv_chunk = 0;
  int num_q_chunks = 0, num_kv_chunks = 0;  // per batch entry
  // The spans' unions per kernel tile of q_tile_chunks query chunks (the
  // forward's tiles) and kv_tile_chunks key chunks (the backward's), as
  // {first, end}: one load where a tile starts, for roles with few registers.
  // A query tile also carries {key_first, key_end}: when all its rows hold one
  // id and that id's keys are the one run [key_first, key_end), the tile is a
  // key range (no id test; its key blocks start at the run); -1, -1 otherwise.
  const int4* q_tiles = nullptr;   // [B, num_q_tiles]: {first, end, key_first, key_end}
  const int2* kv_tiles = nullptr;  // [B, num_kv_tiles]
  int q_tile_chunks = 1, kv_tile_chunks = 1;
  int num_q_tiles = 0, num_kv_tiles = 0;  // per batch entry
  // The persistent forward's next tile (fwd_sm90_kernel.cuh), zeroed by the
  // pre-pass.
  int* tile_counter = nullptr;
};

inline bool HasSegmentIds(const FlashParams& p) { return p.q_segment_ids != nullptr; }

// Scratch of the pre-pass, laid out from `base` (256-byte aligned parts).
struct SegmentScratch {
  size_t q_mm = 0, kv_mm = 0, q_group_mm = 0, kv_group_mm = 0, q_span = 0, kv_span = 0;
  size_t q_ids = 0, kv_ids = 0, q_keys = 0, q_tiles = 0, kv_tiles = 0, tile_counter = 0;
  size_t bytes = 0;
};

// Where a row has more than kSegmentFlatScanChunks chunks on either side,
// the pre-pass also takes the [min, max] id of each group of
// kSegmentGroupChunks chunks, and a chunk looks for the chunks whose ids can
// meet its own among the other side's groups first, reading only the chunks
// of the groups that meet: for sorted ids (varlen's one row of many
// sequences) O(chunks / 32 + chunks that meet) per chunk instead of
// O(chunks), so the pre-pass stops growing with the square of the row (1M
// tokens, 4,096 documents, H100: forward 210 -> 41 us, backward 398 -> 55
// us). Shorter rows keep the flat scan and no group summaries: computed
// there too, the groups cost rows of 16k 0.6-0.8 us of their 7.3-8.8 us.
inline constexpr int kSegmentGroupChunks = 32;
inline constexpr int kSegmentFlatScanChunks = 1024;

// Whether a side of `chunks` chunks is searched through its group summaries
// (the host then computes them; the device reads them).
__host__ __device__ inline bool SearchesSegmentGroups(int64_t chunks) {
  return chunks > kSegmentFlatScanChunks;
}

__host__ __device__ inline int64_t SegmentGroups(int64_t chunks) {
  return (chunks + kSegmentGroupChunks - 1) / kSegmentGroupChunks;
}

// Chunks of q_chunk query rows / kv_chunk keys; kernel tiles of
// q_tile_chunks / kv_tile_chunks chunks.
inline SegmentScratch SegmentScratchLayout(const FlashParams& p, int q_chunk, int kv_chunk,
                                           int q_tile_chunks, int kv_tile_chunks) {
  SegmentScratch s;
  if (!HasSegmentIds(p)) return s;
  const size_t per_q = static_cast<size_t>((p.seqlen_q + q_chunk - 1) / q_chunk);
  const size_t per_kv = static_cast<size_t>((p.seqlen_k + kv_chunk - 1) / kv_chunk);
  const size_t nq = per_q * p.batch, nk = per_kv * p.batch;
  const size_t tq = (per_q + q_tile_chunks - 1) / q_tile_chunks * p.batch;
  const size_t tk = (per_kv + kv_tile_chunks - 1) / kv_tile_chunks * p.batch;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  s.q_mm = 0;
  s.kv_mm = s.q_mm + align(nq * 8);
  s.q_group_mm = s.kv_mm + align(nk * 8);
  s.kv_group_mm = s.q_group_mm + align(SegmentGroups(per_q) * p.batch * 8);
  s.q_span = s.kv_group_mm + align(SegmentGroups(per_kv) * p.batch * 8);
  s.kv_span = s.q_span + align(nq * 16);
  s.q_ids = s.kv_span + align(nk * 16);
  s.kv_ids = s.q_ids + align(nq * q_chunk * 4);
  s.q_keys = s.kv_ids + align(nk * kv_chunk * 4);
  s.q_tiles = s.q_keys + align(nq * 8);
  s.kv_tiles = s.q_tiles + align(tq * 16);
  s.tile_counter = s.kv_tiles + align(tk * 8);
  s.bytes = s.tile_counter + align(sizeof(int));
  return s;
}

}  // namespace jax_flash2::cuda::sm90
