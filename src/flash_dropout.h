// Attention dropout: the keep mask as a pure function of a per-(batch, head)
// seed and the absolute position (i, j), shared by the CPU and CUDA kernels.
// Nothing is stored: the backward regenerates the forward's mask bit for bit.
// jax_flash2/reference.py mirrors this function in plain JAX (uint32 ops), so
// the reference backend drops exactly the same scores.
//
//   keep(b, h, i, j) = Philox4x32-10(key = seed[b, h], counter = (j / 4, i, 0, 0))[j % 4]
//                      >= threshold
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11) is the counter-based generator cuRAND and FlashAttention use; one call
// gives 4 words, so 4 adjacent keys of a row share it. threshold =
// floor(rate * 2^32) with rate as float32, so P(keep) = 1 - rate up to 2^-32.
#pragma once

#include <cstdint>

#include "flash_params.h"

#if defined(__CUDACC__)
#define JF2_DROPOUT_HD __host__ __device__ __forceinline__
#else
#define JF2_DROPOUT_HD inline
#endif

namespace jax_flash2 {

struct Philox4 {
  uint32_t x[4];
};

// The 64-bit product a * b as its high and low 32-bit words.
struct MulHiLo32 {
  JF2_DROPOUT_HD void operator()(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) const {
    const uint64_t product = static_cast<uint64_t>(a) * b;
    *hi = static_cast<uint32_t>(product >> 32);
    *lo = static_cast<uint32_t>(product);
  }
};

// The 10 rounds of Philox4x32 on counter c with key (k0, k1), in place. Word is
// uint32_t, or a vector of them (the CPU kernels run one lane per counter with
// GCC vector types and their own mul_hi_lo); the key is shared by all lanes.
template <typename Word, typename MulHiLo>
JF2_DROPOUT_HD void PhiloxRounds(Word* c, uint32_t k0, uint32_t k1, MulHiLo mul_hi_lo) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    Word hi0, lo0, hi1, lo1;
    mul_hi_lo(c[0], kMul0, &hi0, &lo0);
    mul_hi_lo(c[2], kMul1, &hi1, &lo1);
    const Word c1 = c[1], c3 = c[3];
    c[0] = hi1 ^ c1 ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c3 ^ k1;
    c[3] = lo0;
    k0 += kWeyl0;  // the key schedule: a Weyl sequence per word
    k1 += kWeyl1;
  }
}

// The four 32-bit words of Philox4x32-10 for counter (c0, c1, c2, c3), key (k0, k1).
JF2_DROPOUT_HD Philox4 Philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
  Philox4 r{{c0, c1, c2, c3}};
  PhiloxRounds(r.x, k0, k1, MulHiLo32{});
  return r;
}

// floor(rate * 2^32) for rate in [0, 1) (a float32 times 2^32 is exact in double).
inline uint32_t DropoutThreshold(float rate) {
  return static_cast<uint32_t>(static_cast<double>(rate) * 4294967296.0);
}

// The mask of one (batch, head): which scores survive dropout.
struct DropoutMask {
  uint32_t seed_lo;
  uint32_t seed_hi;
  uint32_t threshold;

  // Keep bits of keys 4 * j4 .. 4 * j4 + 3 of query row i, in bits 0..3.
  JF2_DROPOUT_HD unsigned Keep4(int64_t i, int64_t j4) const {
    const Philox4 r = Philox4x32(static_cast<uint32_t>(j4), static_cast<uint32_t>(i), 0u, 0u,
                                 seed_lo, seed_hi);
    return (r.x[0] >= threshold ? 1u : 0u) | (r.x[1] >= threshold ? 2u : 0u) |
           (r.x[2] >= threshold ? 4u : 0u) | (r.x[3] >= threshold ? 8u : 0u);
  }
};

// The mask of (b, h); only meaningful when p.dropout_seeds is set.
JF2_DROPOUT_HD DropoutMask MakeDropoutMask(const FlashParams& p, int64_t b, int64_t h) {
  const uint32_t* seed = p.dropout_seeds + 2 * (b * p.num_heads_q + h);
  return DropoutMask{seed[0], seed[1], p.dropout_threshold};
}

}  // namespace jax_flash2
