// Attention dropout: the keep mask as a pure function of a per-(batch, head)
// seed and the absolute position (i, j), shared by the CPU and CUDA kernels.
// Nothing is stored: the backward regenerates the forward's mask bit for bit.
// jax_flash2/_scores.py mirrors this function in plain JAX (uint32 ops), so
// the reference backend drops exactly the same scores.
//
//   keep(b, h, i, j) = byte (j % 16) of Philox4x32-10(key = seed[b, h],
//                                                  counter = (j / 16, i, 0, 0))
//                      >= threshold
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11) is the counter-based generator cuRAND and FlashAttention use. One call
// gives 16 bytes, one per key of 16 adjacent keys of a row: at one byte per
// key the generator costs a quarter of what a 32-bit word per key does, which
// is what lets dropout keep up with the Hopper kernels' matrix products.
// Word w of a call holds keys 2w, 2w + 1, 2w + 8, 2w + 9 of its group in bytes
// 0..3 (KeyByte): the keys one lane holds in the mma / wgmma accumulator
// layout. threshold = the rate in 256ths (jax_flash2 rounds the rate to a
// multiple of 1/256 in [1/256, 255/256]), so P(keep) = 1 - rate exactly.
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

// The byte of key offset k (0..15) of a call: word KeyWord(k), byte
// KeyByte(k) of that word.
JF2_DROPOUT_HD int KeyWord(int k) { return (k % 8) / 2; }
JF2_DROPOUT_HD int KeyByte(int k) { return k % 2 + 2 * (k / 8); }

// The threshold of a rate that is a multiple of 1/256 (exact in float32).
inline uint32_t DropoutThreshold(float rate) {
  return static_cast<uint32_t>(static_cast<double>(rate) * 256.0 + 0.5);
}

// Bit 8 b + 7 of the result is byte b of `word` >= that byte of `threshold4`
// (the threshold in all four bytes); the other bits are 0. Per byte, with
// a, t the bytes and lo their low 7 bits: (a | 0x80) - t.lo never borrows
// across bytes, and its bit 7 is a.lo >= t.lo; a >= t is then decided by the
// top bits, a.7 > t.7, or equal and a.lo >= t.lo.
JF2_DROPOUT_HD uint32_t KeepBytes(uint32_t word, uint32_t threshold4) {
  constexpr uint32_t kHigh = 0x80808080u;
  const uint32_t low_ge = (word | kHigh) - (threshold4 & ~kHigh);
  return ((word & ~threshold4) | (~(word ^ threshold4) & low_ge)) & kHigh;
}

// The mask of one (batch, head): which scores survive dropout.
struct DropoutMask {
  uint32_t seed_lo;
  uint32_t seed_hi;
  uint32_t threshold;  // in 256ths, 1..255

  JF2_DROPOUT_HD uint32_t Threshold4() const { return threshold * 0x01010101u; }

  // The Philox words of keys 16 j16 .. 16 j16 + 15 of query row i.
  JF2_DROPOUT_HD Philox4 Words(int64_t i, int64_t j16) const {
    return Philox4x32(static_cast<uint32_t>(j16), static_cast<uint32_t>(i), 0u, 0u, seed_lo,
                      seed_hi);
  }

  // Keep bits of keys 16 j16 .. 16 j16 + 15 of query row i: bit k for key 16 j16 + k.
  JF2_DROPOUT_HD unsigned Keep16(int64_t i, int64_t j16) const {
    const Philox4 r = Words(i, j16);
    unsigned bits = 0;
    for (int k = 0; k < 16; ++k) {
      bits |= ((KeepBytes(r.x[KeyWord(k)], Threshold4()) >> (8 * KeyByte(k) + 7)) & 1u) << k;
    }
    return bits;
  }
};

// The mask of (b, h); only meaningful when p.dropout_seeds is set.
JF2_DROPOUT_HD DropoutMask MakeDropoutMask(const FlashParams& p, int64_t b, int64_t h) {
  const uint32_t* seed = p.dropout_seeds + 2 * (b * p.num_heads_q + h);
  return DropoutMask{seed[0], seed[1], p.dropout_threshold};
}

}  // namespace jax_flash2
