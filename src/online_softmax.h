// The online-softmax arithmetic every forward shares: the sm80 prefill and
// decode kernels, the split-KV combine, the Hopper kernel and its stream-K
// merge, and the CPU kernels. A row's state is (m, l, O): m the running max
// of its raw scores, l = sum exp(scale (s - m)), O unnormalised; exp2 with
// the scale folded in (scale = softmax_scale * log2(e)). Plain C++ with CUDA
// qualifiers, so the guards are written once.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define JF2_SOFTMAX_HD __host__ __device__ __forceinline__
#define JF2_SOFTMAX_MEMBER __host__ __device__ __forceinline__
#else
// Internal linkage: the CPU kernels compile this once per instruction set.
#define JF2_SOFTMAX_HD static inline
#define JF2_SOFTMAX_MEMBER
#endif

namespace jax_flash2 {

// What exp2 subtracts for a row whose max is m: m * scale, or 0 while the row
// has seen only masked keys (m = -inf), so exp2(-inf - 0) = 0 instead of
// exp2(-inf + inf) = NaN. The old max is -inf exactly when O and l are still
// 0, so rescaling them by exp2(-inf) = 0 is harmless. A NaN max passes.
JF2_SOFTMAX_HD float ExpOffset(float m, float scale) {
  return m == -INFINITY ? 0.f : m * scale;
}

// The rescale of one online-softmax step: the row's max goes from m_old to
// m_new >= m_old (NaN aside); its old l and O are multiplied by the returned
// factor, exp2(scale m_old - ExpOffset(m_new)), 0 on the row's first visible
// block. `exp2` is the caller's (MUFU ex2 on the GPU, std::exp2 on the CPU).
template <typename Exp2>
JF2_SOFTMAX_HD float RescaleFactor(float m_old, float m_new, float scale, Exp2 exp2) {
  return exp2(m_old * scale - ExpOffset(m_new, scale));
}

// Two partial states of one row (from two warps, two splits, or two CTAs of
// a stream-K tile) merged: the max, and the weights of each side's l and O.
// Both weights are 0 when neither side saw a key.
struct MergeWeights {
  float m;
  float own;
  float other;
};

template <typename Exp2>
JF2_SOFTMAX_HD MergeWeights MergeTwoStates(float m_own, float m_other, float scale, Exp2 exp2) {
  const float m = fmaxf(m_own, m_other);
  const float offset = ExpOffset(m, scale);
  return {m, exp2(m_own * scale - offset), exp2(m_other * scale - offset)};
}

// The end of a row: O is multiplied by numerator / l, the LSE is m (natural
// units) + log(l). l == 0 exactly when the row saw no key (its max key
// contributes exp2(0) = 1 otherwise): that row gets O = 0 and LSE -inf, not
// 0 / 0. A NaN score makes l NaN (fmaxf skips NaN in the max, exp2 does not),
// and the != test lets it through to O and the LSE (l > 0 would turn it into
// a row that saw no key). `divide` and `log` are the caller's (IEEE, or the
// MUFU forms where l >= 1); they run only for l != 0.
template <typename Divide>
JF2_SOFTMAX_HD float RowNormalizer(float l, float numerator, Divide divide) {
  return l != 0.f ? divide(numerator, l) : 0.f;
}

template <typename Log>
JF2_SOFTMAX_HD float RowLse(float m_natural, float l, Log log) {
  return l != 0.f ? m_natural + log(l) : -INFINITY;
}

// Both ends of a row behind one test of l, for a caller that needs both at
// once: with RowNormalizer and RowLse apart, the compiler keeps two branches.
struct RowEnd {
  float normalizer;
  float lse;
};

template <typename Divide, typename Log>
JF2_SOFTMAX_HD RowEnd RowEndOf(float l, float numerator, float m_natural, Divide divide, Log log) {
  if (l != 0.f) return {divide(numerator, l), m_natural + log(l)};
  return {0.f, -INFINITY};
}

struct IeeeDivide {
  JF2_SOFTMAX_MEMBER float operator()(float a, float b) const { return a / b; }
};

struct IeeeLog {
  JF2_SOFTMAX_MEMBER float operator()(float x) const { return logf(x); }
};

#if defined(__CUDACC__)
// The MUFU forms, for the GPU kernels' l >= 1.
struct FastDivide {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fdividef(a, b); }
};

struct FastLog {
  __device__ __forceinline__ float operator()(float x) const { return __logf(x); }
};
#endif

}  // namespace jax_flash2
