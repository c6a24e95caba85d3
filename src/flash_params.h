// The one description of an attention call, shared by the CPU and CUDA paths.
//
// Shape letters (as in the Python API): B batch, T query length, S key length,
// H query heads, K key/value heads, D head dim. Every tensor is [B, T|S, H|K, D]
// with D contiguous; strides are in elements so that a kernel never needs a
// transposed copy. LSE is [B, H, T] float32, contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>

namespace jax_flash2 {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The element type of a quantized KV cache (k and v); kNone: q's dtype.
enum class KvQuant : int { kNone = 0, kInt8 = 1, kFloat8E4M3 = 2 };

struct FlashParams {
  DType dtype = DType::kFloat32;

  // Forward: q, k, v in; o, lse out. Backward: q, k, v, o, lse, d_o, d_lse in;
  // dq, dk, dv out (dk/dv are [B, S, K, D]: summed over each query-head group).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  const void* d_o = nullptr;
  const float* d_lse = nullptr;  // cotangent of lse; may be all zeros
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;

  int64_t batch = 0;
  int64_t seqlen_q = 0;      // T
  int64_t seqlen_k = 0;      // S
  int64_t num_heads_q = 0;   // H
  int64_t num_heads_kv = 0;  // K; H % K == 0
  int64_t head_dim = 0;      // D
  int64_t group_size = 1;    // H / K: query heads sharing one K/V head

  // Strides in elements. d_o and dq share q/o's layout; dk, dv share k's.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  float softmax_scale = 1.0f;
  float softmax_scale_log2 = 1.4426950408889634f;  // scale * log2(e): exp folds into exp2

  // Local window relative to the bottom-right-aligned diagonal: query i sees
  // key j iff i + S - T - window_left <= j <= i + S - T + window_right.
  // -1 means unbounded. causal == (window_left = -1, window_right = 0).
  int64_t window_left = -1;
  int64_t window_right = -1;

  // Gemma-2 style score capping: S = softcap * tanh(S / softcap) after the
  // softmax scale; 0 = off.
  float softcap = 0.0f;

  // ALiBi: [B, H] float32, or null when off. The score of query i and key j
  // gets -slope * |i + S - T - j|, after the scale and after softcap (as in
  // FlashAttention-2), in natural-log units.
  const float* alibi_slopes = nullptr;

  // Packed sequences: [B, T] and [B, S] int32, both null when off. Query i
  // sees key j only if q_segment_ids[b, i] == kv_segment_ids[b, j] (and the
  // window allows it).
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  // The caller's bound on any segment's key count, 0 when unknown: the
  // Hopper forward chooses its tile for it (the ids are on the device). A
  // wrong bound costs speed, never correctness.
  int64_t max_segment_keys = 0;

  // Backward only: dQ must be bit-identical run to run. The CPU backward
  // always is; the CUDA one then sums dQ in a fixed order (bwd_launch.cu).
  bool deterministic = false;

  // Dropout on the softmax (flash_dropout.h): [B, H, 2] uint32 seeds, or null
  // when off. A score survives when its Philox byte is >= dropout_threshold
  // (the rate, a multiple of 1/256, in 256ths); survivors are scaled by
  // dropout_scale = 1 / (1 - rate).
  // The LSE is of the undropped softmax.
  const uint32_t* dropout_seeds = nullptr;
  float dropout_rate = 0.0f;
  uint32_t dropout_threshold = 0;
  float dropout_scale = 1.0f;

  // KV cache, forward only. kv_seqlens: [B] int32 or null; sequence b's keys
  // are [0, kv_seqlens[b]) (clamped to [0, S]), and the window, causal and
  // ALiBi align to that length (offset kv_seqlens[b] - T) instead of S.
  // block_table: [B, max_pages] int32 or null; when set, k and v are a pool of
  // num_pages pages of page_size keys whose page stride is k/v_batch_stride,
  // key j of sequence b sits in page block_table[b, j / page_size] at row
  // j % page_size, and S = max_pages * page_size.
  const int32_t* kv_seqlens = nullptr;
  const int32_t* block_table = nullptr;
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  int64_t page_size = 0;
  // Quantized KV cache (forward only, with kv_seqlens): k and v hold int8 or
  // float8_e4m3fn x_q standing for x_q * scale. kv_scales: float32 [B, 2,
  // kv_scale_pages, K] (k's, then v's): one scale per KV head
  // (kv_scale_pages 1) or per page slot of the block table and KV head
  // (kv_scale_pages max_pages; KvScale).
  KvQuant kv_quant = KvQuant::kNone;
  const float* kv_scales = nullptr;
  int64_t kv_scale_pages = 0;
};

// The scale of key j of sequence b, KV head kv_head, for k (which 0) or v
// (which 1); 1 for a cache that is not quantized.
inline
#if defined(__CUDACC__)
__host__ __device__
#endif
float KvScale(const FlashParams& p, int64_t b, int which, int64_t j, int64_t kv_head) {
  if (p.kv_scales == nullptr) return 1.0f;
  const int64_t slot = p.kv_scale_pages > 1 ? j / p.page_size : 0;
  return p.kv_scales[((b * 2 + which) * p.kv_scale_pages + slot) * p.num_heads_kv + kv_head];
}

// Valid keys of sequence b: kv_seqlens[b] clamped to [0, S], else S.
inline
#if defined(__CUDACC__)
__host__ __device__
#endif
int64_t KvLength(const FlashParams& p, int64_t b) {
  if (p.kv_seqlens == nullptr) return p.seqlen_k;
  const int64_t n = p.kv_seqlens[b];
  return n < 0 ? 0 : n > p.seqlen_k ? p.seqlen_k : n;
}

// Index of key j of sequence b along k/v's leading axis (the batch entry, or
// its page) and its row there; -1 for a page id outside the pool, whose keys
// and values the kernels read as zeros.
inline
#if defined(__CUDACC__)
__host__ __device__
#endif
int64_t KvBlockOf(const FlashParams& p, int64_t b, int64_t j, int64_t* row) {
  if (p.block_table == nullptr) {
    *row = j;
    return b;
  }
  *row = j % p.page_size;
  const int64_t page = p.block_table[b * p.max_pages + j / p.page_size];
  return page >= 0 && page < p.num_pages ? page : -1;
}

// The twelve strides of q, k, v and o (batch, row, head of each), which the
// support checks (plan.h, sm90/tensor_map.h) test alike.
inline std::array<int64_t, 12> QkvoStrides(const FlashParams& p) {
  return {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
          p.k_batch_stride, p.k_row_stride, p.k_head_stride,
          p.v_batch_stride, p.v_row_stride, p.v_head_stride,
          p.o_batch_stride, p.o_row_stride, p.o_head_stride};
}

// True when every pointer is 16-byte aligned (the kernels move 16-byte
// chunks: cp.async, vector loads and stores, TMA bases).
inline bool Aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  }
  return true;
}

// Fills the dense [B, T, H, D] strides of every tensor from the sizes.
inline void SetDenseStrides(FlashParams& p) {
  const int64_t d = p.head_dim;
  p.q_head_stride = d;
  p.q_row_stride = p.num_heads_q * d;
  p.q_batch_stride = p.seqlen_q * p.q_row_stride;
  p.o_head_stride = p.q_head_stride;
  p.o_row_stride = p.q_row_stride;
  p.o_batch_stride = p.q_batch_stride;
  p.k_head_stride = d;
  p.k_row_stride = p.num_heads_kv * d;
  p.k_batch_stride = p.seqlen_k * p.k_row_stride;
  p.v_head_stride = p.k_head_stride;
  p.v_row_stride = p.k_row_stride;
  p.v_batch_stride = p.k_batch_stride;
}

}  // namespace jax_flash2
