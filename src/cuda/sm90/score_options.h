// Softcap and ALiBi in the Hopper kernels: the score units they compute in
// (host and device) and the per-fragment transforms (device, sm90 only).
//
// The kernels keep a score u per (query, key) and take exp2(u * log2 - m),
// so that the softmax scale folds into the exponent:
//   plain:    u = S = Q K^T (unscaled)            natural logit = scale * u
//   softcap:  u = tanh(S * scale / cap)            natural logit = cap * u
// With softcap the scaled score is capped first (cap * tanh(scale S / cap)),
// and the cap, not the scale, becomes the folded factor: one multiply and one
// tanh per score, no division back into the kernel's units. ALiBi subtracts
// slope * |i + S - T - j| in natural units after the cap (as FlashAttention-2
// and the sm80 kernels order it), i.e. slope / natural per unit of u. The
// backward gets dS through the cap as dS_u * (1 - th^2) (th = tanh(S scale / cap),
// before ALiBi), and the scale in its
// epilogues as without softcap (d logit / dS = scale * (1 - tanh^2)).
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../../flash_params.h"
#include "../../test_switches.h"

namespace jax_flash2::cuda::sm90 {

struct Sm90ScoreUnits {
  float natural = 1.f;  // natural-log units per unit of u (LSE = m * natural + log l)
  float log2 = 1.f;     // natural * log2(e): the exp2 factor
  float tanh_in = 0.f;  // scale / cap: tanh's argument per unit of S; 0 without softcap
  float inv_natural = 1.f;  // 1 / natural (ALiBi's slope per unit of u)
  // The forward's softmax max m (units of u) when it can be a constant,
  // -inf when the kernel tracks the running max (see MakeSm90ScoreUnits).
  float fixed_max = -INFINITY;
};

// Softcap alone bounds every score, |u| <= 1, so the forward can take
// exp2((u - m) log2) against a constant m instead of the running max: no max
// reduction before the exponentials, no rescale of O. m = min(1, 125 / log2 -
// 1) keeps a visible key's term in [2^-125, 2^32] (a normal float, so l > 0
// for every row that sees a key; O at most 2^32 times the plain path's
// bound), which holds up to log2 = 78.5 (caps up to about 54). Larger caps
// and ALiBi (unbounded below) keep the running max, and so does fp16: P goes
// to the PV product as the input type, and fp16's range (2^-24 .. 65504)
// would flush a row whose largest term is far below 1 (logits well under
// the cap) and overflow above; bf16 has float's exponent range.
inline constexpr float kFixedMaxLog2Limit = 78.5f;

inline Sm90ScoreUnits MakeSm90ScoreUnits(const FlashParams& p) {
  Sm90ScoreUnits u;
  if (p.softcap > 0.f) {
    u.natural = p.softcap;
    u.log2 = p.softcap * 1.4426950408889634f;
    u.tanh_in = p.softmax_scale / p.softcap;
  } else {
    u.natural = p.softmax_scale;
    u.log2 = p.softmax_scale_log2;
  }
  u.inv_natural = 1.f / u.natural;
  if (p.softcap > 0.f && p.alibi_slopes == nullptr && p.dtype == DType::kBFloat16 &&
      u.log2 <= kFixedMaxLog2Limit && GetTestSwitches().softcap_fixed_max) {
    u.fixed_max = std::min(1.f, 125.f / u.log2 - 1.f);
  }
  return u;
}

// Whether a call transforms its scores or drops them (../dropout_bits.cuh): the
// kernels with kScoreOptions, inside which each option is a runtime branch.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool HasSm90ScoreOptions(const FlashParams& p) {
  return p.softcap > 0.f || p.alibi_slopes != nullptr || p.dropout_seeds != nullptr;
}

#if defined(__CUDACC__)

// tanh by MUFU.TANH: one special-function op per score, where the sm80
// kernels' exp-and-reciprocal form costs two more; the special-function unit
// already carries one exp2 per score and would bound the softcap path. Its
// relative error (2^-11) is a quarter of bf16's rounding of the logit and
// fp16's own.
__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// u = tanh(S * tanh_in) over an accumulator fragment.
template <int kAcc>
__device__ __forceinline__ void SoftcapScores(float (&s)[kAcc], float tanh_in) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s[i] = TanhApprox(s[i] * tanh_in);
}

// u -= slope_u * |dist| over a wgmma accumulator fragment: element i is in
// accumulator row (i / 2) % 2 (this thread's rows r and r + 8) and column
// 8 (i / 4) + 2 t4 + i % 2; its ALiBi distance is |base[row] + kColumnSign *
// (8 (i / 4) + i % 2)|, with the thread's t4 and the tile's origin in base
// (the forward's rows are queries and columns keys: sign -1; the backward's
// transposed tiles the other way round: +1). The column offsets are
// compile-time constants, so a score costs two instructions (an FADD, an
// FFMA with |x|).
template <int kAcc, int kColumnSign>
__device__ __forceinline__ void AlibiScores(float (&s)[kAcc], float slope_u,
                                            const float (&base)[2]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const float column = static_cast<float>(8 * (i / 4) + (i & 1));
    s[i] -= slope_u * fabsf(base[(i / 2) % 2] + kColumnSign * column);
  }
}

// ALiBi over a forward fragment (AlibiScores' layout, kColumnSign -1) whose
// distances base[0] + 8 row - column all have one sign (the block lies on
// one side of the diagonal). |distance| is then linear, and slope_u *
// |distance| splits into a term of row and column that is a compile-time
// constant per element, added here by one FFMA a score (column_slope =
// slope_u * sign), and -slope_u * sign * base[0], the same for both rows,
// which the caller adds to its row maxima instead (a row's softmax is
// invariant to a shift; base[0] holds the thread's key offset, so the
// maxima go back to the row's frame before the quad reduces them).
template <int kAcc>
__device__ __forceinline__ void AlibiColumnScores(float (&s)[kAcc], float column_slope) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const float column = static_cast<float>(8 * (i / 4) + (i & 1) - 8 * ((i / 2) % 2));
    s[i] = fmaf(column_slope, column, s[i]);
  }
}

// slope[b, h] per unit of u (0 without ALiBi). The index goes through an
// opaque move in the callers, so the load stays inside their option branch.
__device__ __forceinline__ float AlibiSlopeUnits(const FlashParams& p,
                                                 const Sm90ScoreUnits& units, int bh) {
  return p.alibi_slopes != nullptr ? __ldg(p.alibi_slopes + bh) * units.inv_natural : 0.f;
}

// f(std::bool_constant<a>): one copy of a per-score loop for each case, so
// an option a call lacks issues nothing. Under plain runtime tests inside
// the loop ptxas predicated each score's tanh and ALiBi term instead of
// branching: the D 64 backward with ALiBi alone issued twice the plain
// kernel's MUFU and FMA-pipe instructions (ncu).
template <typename F>
__device__ __forceinline__ void WithOptionFlag(bool a, F&& f) {
  if (a) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// f(std::bool_constant<a>, std::bool_constant<b>): WithOptionFlag for two.
template <typename F>
__device__ __forceinline__ void WithOptionFlags(bool a, bool b, F&& f) {
  if (a) {
    if (b) {
      f(std::true_type{}, std::true_type{});
    } else {
      f(std::true_type{}, std::false_type{});
    }
  } else if (b) {
    f(std::false_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

#endif  // __CUDACC__

}  // namespace jax_flash2::cuda::sm90
