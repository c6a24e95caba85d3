// Mask predicates and block ranges, shared by the CPU and CUDA kernels.
//
// All of them follow FlashParams' window convention: query i sees key j iff
// i + offset - window_left <= j <= i + offset + window_right, offset = S - T,
// with -1 meaning unbounded on that side.
#pragma once

#include <cstdint>

#include "flash_params.h"

#if defined(__CUDACC__)
#define JF2_HD __host__ __device__ __forceinline__
#else
#define JF2_HD inline
#endif

namespace jax_flash2 {

struct WindowMask {
  int64_t offset;  // S - T: aligns the diagonal bottom-right
  int64_t left;    // -1 = unbounded
  int64_t right;   // -1 = unbounded
  int64_t seqlen_k;

  JF2_HD bool Allowed(int64_t i, int64_t j) const {
    if (j < 0 || j >= seqlen_k) return false;
    if (left >= 0 && j < i + offset - left) return false;
    if (right >= 0 && j > i + offset + right) return false;
    return true;
  }

  // Keys [*begin, *end) that any query in [m_begin, m_end) may see. Empty when
  // *end <= *begin (every key masked: such rows output 0 and LSE -inf).
  JF2_HD void KeyRange(int64_t m_begin, int64_t m_end, int64_t* begin, int64_t* end) const {
    int64_t b = 0, e = seqlen_k;
    if (left >= 0) {
      const int64_t lo = m_begin + offset - left;
      b = lo > 0 ? lo : 0;
    }
    if (right >= 0) {
      const int64_t hi = m_end - 1 + offset + right + 1;
      e = hi < seqlen_k ? hi : seqlen_k;
    }
    *begin = b;
    *end = e;
  }

  // Queries [*begin, *end) (of seqlen_q) that may see any key in [n_begin, n_end).
  JF2_HD void QueryRange(int64_t n_begin, int64_t n_end, int64_t seqlen_q, int64_t* begin,
                         int64_t* end) const {
    int64_t b = 0, e = seqlen_q;
    if (right >= 0) {
      const int64_t lo = n_begin - offset - right;
      b = lo > 0 ? lo : 0;
    }
    if (left >= 0) {
      const int64_t hi = n_end - 1 - offset + left + 1;
      e = hi < seqlen_q ? hi : seqlen_q;
    }
    *begin = b;
    *end = e;
  }

  // True when every (i, j) of the block is allowed, so the kernel can skip the
  // per-element predicate (only diagonal and ragged-tail blocks need it).
  JF2_HD bool BlockFullyVisible(int64_t m_begin, int64_t m_end, int64_t n_begin,
                                int64_t n_end) const {
    if (n_end > seqlen_k) return false;
    if (right >= 0 && n_end - 1 > m_begin + offset + right) return false;
    if (left >= 0 && n_begin < m_end - 1 + offset - left) return false;
    return true;
  }
};

JF2_HD WindowMask MakeWindowMask(const FlashParams& p) {
  return WindowMask{p.seqlen_k - p.seqlen_q, p.window_left, p.window_right, p.seqlen_k};
}

// Sequence b's mask: with per-sequence key counts (KV cache) the diagonal
// aligns to that sequence's own last key and keys past its end are masked.
JF2_HD WindowMask MakeWindowMask(const FlashParams& p, int64_t b) {
  const int64_t n = KvLength(p, b);
  return WindowMask{n - p.seqlen_q, p.window_left, p.window_right, n};
}

// Whether p has a window (causal included): some query sees fewer keys than
// all of them.
JF2_HD bool HasWindow(const FlashParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

// ALiBi distance |i + S - T - j|: the bias is -slope times this.
JF2_HD float AlibiDistance(int64_t i, int64_t j, int64_t offset) {
  const int64_t d = i + offset - j;
  return static_cast<float>(d < 0 ? -d : d);
}

// Packed sequences: query i sees key j only if their segment ids are equal.
// ids == nullptr means no segments (every pair allowed).
struct SegmentMask {
  const int32_t* q_ids;   // this batch entry's [T], or null
  const int32_t* kv_ids;  // this batch entry's [S], or null

  JF2_HD bool Active() const { return q_ids != nullptr; }
  JF2_HD bool Allowed(int64_t i, int64_t j) const { return q_ids[i] == kv_ids[j]; }

  // [*lo, *hi] of ids[begin, end) (end > begin).
  JF2_HD static void IdRange(const int32_t* ids, int64_t begin, int64_t end, int32_t* lo,
                             int32_t* hi) {
    int32_t a = ids[begin], b = ids[begin];
    for (int64_t x = begin + 1; x < end; ++x) {
      a = ids[x] < a ? ids[x] : a;
      b = ids[x] > b ? ids[x] : b;
    }
    *lo = a;
    *hi = b;
  }

  // False only when no (query, key) pair of the block can have equal ids: the
  // block is skipped. Disjoint id ranges are a sufficient test, exact for
  // packed (sorted) ids; otherwise the per-element mask does the rest.
  JF2_HD bool BlockMayMatch(int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) const {
    if (!Active()) return true;
    int32_t q_lo, q_hi, k_lo, k_hi;
    IdRange(q_ids, m_begin, m_end, &q_lo, &q_hi);
    IdRange(kv_ids, n_begin, n_end, &k_lo, &k_hi);
    return q_lo <= k_hi && k_lo <= q_hi;
  }
};

// True when the scores need more than the window mask: softcap, ALiBi or
// segment ids. The CUDA kernels test it per tile from the kernel parameters,
// so that the plain path keeps no extra register live.
JF2_HD bool HasScoreVariants(const FlashParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr || p.q_segment_ids != nullptr;
}

// The segment mask of batch entry b (inactive when p has no segment ids).
JF2_HD SegmentMask MakeSegmentMask(const FlashParams& p, int64_t b) {
  if (p.q_segment_ids == nullptr) return SegmentMask{nullptr, nullptr};
  return SegmentMask{p.q_segment_ids + b * p.seqlen_q, p.kv_segment_ids + b * p.seqlen_k};
}

}  // namespace jax_flash2
