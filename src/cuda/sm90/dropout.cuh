// Dropout in the Hopper kernels: the keep mask Z of flash_dropout.h (the same
// Philox words as the CPU, sm80 and reference backends, bit for bit) over the
// wgmma accumulator layout, every Philox call made once per warp.
//
// A thread of an m64nN accumulator holds rows 16 warp + g and + 8 and, per n8
// tile j, the column pair 8 j + 2 t4, + 1 (element i: j = i / 4, row half
// (i / 2) % 2, column i % 2). One Philox call gives four adjacent keys of one
// row, so lanes t4 and t4 ^ 1 of a row need the same call. In the forward
// (rows = queries, columns = keys) the pair splits the work by row: lane
// t4 & 1 = 0 computes row g, lane 1 row g + 8, and they swap their words with
// one shuffle per eight calls. In the backward (rows = keys, columns =
// queries) the four keys of a call lie in the four lanes of equal t4 and g /
// 4: each of the four computes one of four calls (two n8 tiles, two columns)
// and a 4 x 4 bit transpose over them (two shuffle stages) hands every lane
// its bits. The bits end in a few 32-bit words held from the Philox calls to
// the softmax; nothing goes through shared memory.
#pragma once

#include <cstdint>

#include "../../flash_dropout.h"

namespace jax_flash2::cuda::sm90 {

#if defined(__CUDACC__)

// Words of keep bits for kAcc accumulator elements: element i at bit i % 32
// of word i / 32 (forward); the backward's order is its own (below).
template <int kAcc>
constexpr int KeepWords() {
  return (kAcc + 31) / 32;
}

// The mask of (b, h): its seed pair, read through the read-only path.
__device__ __forceinline__ DropoutMask LoadDropoutMask(const FlashParams& p, int bh) {
  const uint2 seed = __ldg(reinterpret_cast<const uint2*>(p.dropout_seeds) + bh);
  return DropoutMask{seed.x, seed.y, p.dropout_threshold};
}

// Forward: the keep bits of this thread's elements of an m64 x kAcc*2 S tile
// whose row g is query `row` (so row + 8 is the other) and whose first key is
// key0 (a multiple of 8). Lane t4 & 1 = odd computes the calls of row row +
// 8 odd, groups 2 j + t4 / 2 of the block's keys: its nibble j (bit k = key
// 8 j + 4 (t4 / 2) + k) goes to bits 4 (j % 8) of word j / 8. The pair then
// swaps words; this lane's columns are bits 2 odd, 2 odd + 1 of each nibble.
template <int kAcc>
__device__ __forceinline__ void FwdKeepBits(uint32_t (&keep)[KeepWords<kAcc>()],
                                            const DropoutMask& mask, int row, int key0,
                                            int t4) {
  constexpr int kTiles = kAcc / 4;  // n8 tiles
  const int odd = t4 & 1;
  const int64_t query = row + 8 * odd;
  const int64_t key4 = key0 / 4 + (t4 >> 1);
#pragma unroll
  for (int w = 0; w < KeepWords<kAcc>(); ++w) {
    uint32_t mine = 0;
#pragma unroll 4
    for (int jj = 0; jj < 8 && 8 * w + jj < kTiles; ++jj) {
      mine |= mask.Keep4(query, key4 + 2 * (8 * w + jj)) << (4 * jj);
    }
    const uint32_t theirs = __shfl_xor_sync(0xffffffffu, mine, 1);
    const uint32_t row0 = (odd ? theirs : mine) >> (2 * odd);
    const uint32_t row1 = (odd ? mine : theirs) >> (2 * odd);
    // Element 4 j + 2 h + e at bit 4 (j % 8) + 2 h + e.
    keep[w] = (row0 & 0x33333333u) | ((row1 & 0x33333333u) << 2);
  }
}

// Z o P over a forward fragment (P >= 0 already summed into l undropped).
template <int kAcc>
__device__ __forceinline__ void ApplyFwdKeepBits(float (&s)[kAcc],
                                                 const uint32_t (&keep)[KeepWords<kAcc>()]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    if (!((keep[i / 32] >> (i % 32)) & 1u)) s[i] = 0.f;
  }
}

// Backward: the keep bits of this thread's elements of an m64 (keys) x
// kAcc*2 (queries) S^T tile whose row g is key `key` and whose first query
// is m_begin. x = g % 4: for each pair of n8 tiles jp and row half rh, lane x
// computes the call of query m_begin + 8 (2 jp + x / 2) + 2 t4 + x % 2 and
// keys 4 (key / 4) + 8 rh + 0..3, its nibble at slot q = rh * kTiles / 2 +
// jp. A 4 x 4 transpose of those nibbles over the lanes x = 0..3 (lane ^ 8,
// then lane ^ 4) leaves in this lane's nibble q the bit of its own key for
// the four calls: element (j, rh, e) at bit 4 q + 2 (j % 2) + e
// (BwdKeepBit). kUnroll: how many Philox calls the compiler may interleave.
template <int kAcc, int kUnroll>
__device__ __forceinline__ void BwdKeepBits(uint32_t (&keep)[KeepWords<kAcc>()],
                                            const DropoutMask& mask, int key, int m_begin,
                                            int g, int t4) {
  constexpr int kTiles = kAcc / 4;  // n8 tiles over queries
  static_assert(kTiles % 2 == 0 && kTiles * 4 == 32 * KeepWords<kAcc>(),
                "whole words of nibbles");
  const int x = g % 4;
  const int64_t query0 = m_begin + 8 * (x / 2) + 2 * t4 + x % 2;
  const int64_t key4 = key / 4;  // the call's first key: key - x
#pragma unroll
  for (int w = 0; w < KeepWords<kAcc>(); ++w) {
    uint32_t word = 0;
#pragma unroll kUnroll
    for (int qq = 0; qq < 8; ++qq) {
      const int q = 8 * w + qq;
      const int rh = q / (kTiles / 2), jp = q % (kTiles / 2);
      word |= mask.Keep4(query0 + 16 * jp, key4 + 2 * rh) << (4 * qq);
    }
    // [[A, B], [C, D]] -> [[A, C], [B, D]] over lane bit x / 2 and nibble
    // bits 2, 3; then the 2 x 2 blocks over lane bit x % 2 and nibble bit 1.
    uint32_t other = __shfl_xor_sync(0xffffffffu, word, 8);
    word = (x & 2) ? (word & 0xCCCCCCCCu) | ((other & 0xCCCCCCCCu) >> 2)
                   : (word & 0x33333333u) | ((other & 0x33333333u) << 2);
    other = __shfl_xor_sync(0xffffffffu, word, 4);
    word = (x & 1) ? (word & 0xAAAAAAAAu) | ((other & 0xAAAAAAAAu) >> 1)
                   : (word & 0x55555555u) | ((other & 0x55555555u) << 1);
    keep[w] = word;
  }
}

// The bit of backward element i (n8 tile j = i / 4, row half rh = (i / 2) %
// 2, column e = i % 2) in BwdKeepBits' words: nibble q = rh * kTiles / 2 + j
// / 2, bit 2 (j % 2) + e.
template <int kAcc>
__device__ __forceinline__ bool BwdKeepBit(const uint32_t (&keep)[KeepWords<kAcc>()], int i) {
  constexpr int kTiles = kAcc / 4;
  const int j = i / 4, rh = (i / 2) % 2, e = i % 2;
  const int bit = 4 * (rh * (kTiles / 2) + j / 2) + 2 * (j % 2) + e;
  return (keep[bit / 32] >> (bit % 32)) & 1u;
}

#endif  // __CUDACC__

}  // namespace jax_flash2::cuda::sm90
