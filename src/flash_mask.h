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

}  // namespace jax_flash2
