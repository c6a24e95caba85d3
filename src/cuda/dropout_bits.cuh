// Dropout's keep bits in the mma.sync and wgmma accumulator layouts (the sm80
// and Hopper kernels): flash_dropout.h's mask bit for bit, each Philox call
// made once per warp, the bits carried in registers.
//
// Both layouts give a thread rows g and g + 8 (g = lane / 4) of a 16-row slab
// and, per n8 tile, columns 2 t4 and 2 t4 + 1 (t4 = lane % 4); accumulator
// element i of a slab is n8 tile i / 4, row half (i / 2) % 2, column i % 2.
// A Philox call covers 16 keys of one query, and its word w holds keys 2w,
// 2w + 1, 2w + 8, 2w + 9 of them.
// - Forward (rows = queries, columns = keys): lane t4 needs word t4 of the
//   calls of its two rows. The four lanes of a quad each make one of four
//   calls (two rows, two key groups). Either each compares its words and
//   packs the bits of two such rounds in one register, a 4 x 4 matrix
//   (maker, receiver) of 2 x 4 bits that two butterfly stages (a shuffle
//   and three ALU instructions each) transpose (FwdKeepPack,
//   FwdKeepTranspose: the D 64 forward), or a 4 x 4 transpose of the words
//   comes first and each lane compares the words it receives
//   (FwdKeepBitsByWords: the 128-row tiles).
// - Backward (rows = keys, columns = queries): a slab's 16 keys are one
//   group, so each query column is one call, shared by the eight lanes of
//   equal t4 (lane g needs the bytes of keys g and g + 8). Each of the eight
//   makes one of eight calls and packs its 16 keep bits; an 8 x 8 transpose
//   of 2-bit entries (three shuffles for two such batches) hands every lane
//   its bits.
//
// With JF2_DROPOUT_BITS_HOST_LANES defined, a host build gets the layout
// functions (not the mask load or the packed-pair max) with the shuffle
// supplied by the includer, which runs the lanes of a warp as threads
// (tests/cuda/dropout_bits_host_test.cc): the layouts are checked bit for bit
// on any machine.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

#include <cstdint>
#include <type_traits>

#include "../flash_dropout.h"

#if defined(__CUDACC__)
#define JF2_LANES_FN __device__ __forceinline__
#elif defined(JF2_DROPOUT_BITS_HOST_LANES)
#define JF2_LANES_FN inline
#endif

namespace jax_flash2::cuda {

#if defined(__CUDACC__) || defined(JF2_DROPOUT_BITS_HOST_LANES)

#if !defined(__CUDACC__)
// The includer's lane exchange: v of lane ^ lane_mask.
uint32_t HostShflXor(uint32_t v, int lane_mask);
#endif

JF2_LANES_FN uint32_t ShflXor(uint32_t v, int lane_mask) {
#if defined(__CUDACC__)
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#else
  return HostShflXor(v, lane_mask);
#endif
}

// x rotated left by n % 32 bits (SHF.L.W).
JF2_LANES_FN uint32_t RotateLeft(uint32_t x, int n) {
#if defined(__CUDACC__)
  return __funnelshift_l(x, x, n);
#else
  n &= 31;
  return n == 0 ? x : (x << n) | (x >> (32 - n));
#endif
}

// prmt.b32 with selector sel: result byte i is byte sel_i % 8 of {b, a}
// (a the low four), replaced by its sign bit in all 8 bits when sel_i >= 8.
JF2_LANES_FN uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDACC__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nib = (sel >> (4 * i)) & 0xF;
    uint32_t byte = (bytes >> (8 * (nib & 7))) & 0xFF;
    if (nib & 8) byte = (byte & 0x80) ? 0xFF : 0;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// lop3.b32 with lookup table kLut: result bit i is bit (a_i b_i c_i) (a
// the high index bit) of kLut.
template <uint32_t kLut>
JF2_LANES_FN uint32_t Lop3(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDACC__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return d;
#else
  uint32_t d = 0;
  for (int i = 0; i < 32; ++i) {
    const uint32_t index = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1);
    d |= ((kLut >> index) & 1u) << i;
  }
  return d;
#endif
}

// KeepBytes (flash_dropout.h) with its top-bit decision as one LOP3: a >= t
// per byte is the majority of a.7, a.lo >= t.lo and not t.7 (table 0xD4
// over word, low_ge, threshold4; written as C, ptxas splits it into three).
// Taken where it measured faster: the D 64 forward's pack (B4 T 4k, H100:
// 1.01 -> 0.98 ms) and the backward; the 128-row forward tiles keep the C
// form (with the LOP3 there: 1.31 -> 1.36 ms at D 128).
JF2_LANES_FN uint32_t KeepBytesMajority(uint32_t word, uint32_t threshold4) {
  constexpr uint32_t kHigh = 0x80808080u;
  const uint32_t low_ge = (word | kHigh) - (threshold4 & ~kHigh);
  return Lop3<0xD4>(word, low_ge, threshold4) & kHigh;
}

// Words of keep bits for kAcc accumulator elements.
template <int kAcc>
constexpr int KeepWords() {
  return (kAcc + 31) / 32;
}

// One stage of a bit transpose across lane pairs (lane, lane ^ lane_mask)
// whose `kept` masks are complements: each lane keeps its bits under `kept`
// and gives the others away rotated by `rot` onto the places of `kept`,
// which are the ones its partner fills (the receiver only merges).
JF2_LANES_FN uint32_t ButterflyStage(uint32_t x, uint32_t kept, int rot, int lane_mask) {
  return (x & kept) | ShflXor(RotateLeft(x, rot) & kept, lane_mask);
}

// Word w (a runtime 0..3) of a call, by selects (an indexed register array
// would go to local memory).
JF2_LANES_FN uint32_t SelectWord(const Philox4& r, int w) {
  return (w & 2) ? ((w & 1) ? r.x[3] : r.x[2]) : ((w & 1) ? r.x[1] : r.x[0]);
}

// Forward: the keep bits of this thread's elements of a 16-row slab x kAcc*2
// keys of S whose row g is query `row` and whose first key is key0 (a
// multiple of 16). Group c (keys key0 + 16 c ..) and row half rh of key
// byte b (KeepBytes' bit 8 b + 7) land at bit 8 b + 7 - (2 (c % 4) + rh) of
// word c / 4 (FwdKeepPairMask).
// Lane s of the quad makes, per pair of groups, the call of row half s % 2
// and group 2 (c / 2) + s / 2, whose word w lane w needs; that bit's slot,
// 2 (c % 4) + rh = 4 ((c / 2) % 2) + s, depends only on the maker, so each
// lane packs word w at slot 4 ((c / 2) % 2) + w (FwdKeepPack) and a
// transpose of the 4 x 4 slot matrix (maker, word) puts every bit in place
// (FwdKeepTranspose). Two calls, so that a kernel can run the transpose's
// shuffles where its warps wait anyway (under a wgmma) rather than on the
// way to issuing one. (With an odd number of groups the last pair's second
// call covers keys past the block: unread slots.)
template <int kAcc>
JF2_LANES_FN void FwdKeepPack(uint32_t (&keep)[KeepWords<kAcc>()], const DropoutMask& mask,
                              int64_t row, int64_t key0, int t4) {
  constexpr int kCalls = (kAcc / 8 + 1) / 2;  // per lane: one per pair of groups
  static_assert(kAcc % 8 == 0, "whole groups of 16 keys");
  const uint32_t threshold4 = mask.Threshold4();
  const int64_t call_row = row + 8 * (t4 & 1);
  const int64_t call_group0 = key0 / 16 + (t4 >> 1);
#pragma unroll
  for (int wd = 0; wd < KeepWords<kAcc>(); ++wd) {
    uint32_t x = 0;
#pragma unroll
    for (int h = 0; h < 2 && 2 * wd + h < kCalls; ++h) {
      const Philox4 r = mask.Words(call_row, call_group0 + 2 * (2 * wd + h));
#pragma unroll
      for (int w = 0; w < 4; ++w) x |= KeepBytesMajority(r.x[w], threshold4) >> (4 * h + w);
    }
    keep[wd] = x;
  }
}

// Butterfly stage k keeps the slots whose bit k equals the lane's, and sends
// the others, rotated by 2^k slots onto the kept ones' places, to lane ^ 2^k,
// which takes them into the places it sent from.
template <int kAcc>
JF2_LANES_FN void FwdKeepTranspose(uint32_t (&keep)[KeepWords<kAcc>()], int t4) {
  // Slot k sits at bits 7 - k of each byte: even slots 0xAA.., slots with
  // k % 4 < 2 0xCC..; a rotation left by one bit moves a slot down by one.
  const uint32_t kept1 = 0xAAAAAAAAu >> (t4 & 1), kept2 = 0xCCCCCCCCu >> (t4 & 2);
  const int rot1 = 1 - 2 * (t4 & 1), rot2 = 2 - 2 * (t4 & 2);
#pragma unroll
  for (int wd = 0; wd < KeepWords<kAcc>(); ++wd) {
    keep[wd] = ButterflyStage(ButterflyStage(keep[wd], kept1, rot1, 1), kept2, rot2, 2);
  }
}

// In: w = the words of the call this lane made (call t4 of its quad). Out:
// w[x] = word t4 of call t4 ^ x.
JF2_LANES_FN void QuadTranspose(uint32_t (&w)[4], int t4) {
  const bool odd = t4 & 1, high = t4 & 2;
  uint32_t a[2][2];  // after lane ^ 1: a[j][s] = word 2 j + odd of call t4 ^ s
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    a[j][0] = odd ? w[2 * j + 1] : w[2 * j];
    a[j][1] = ShflXor(odd ? w[2 * j] : w[2 * j + 1], 1);
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {  // after lane ^ 2: word t4 of calls t4 ^ s, t4 ^ 2 ^ s
    w[s] = high ? a[1][s] : a[0][s];
    w[2 + s] = ShflXor(high ? a[0][s] : a[1][s], 2);
  }
}

// FwdKeepPack and FwdKeepTranspose's result the other way: the four lanes'
// words transposed first (QuadTranspose), then compared. The kernels with
// 128-row tiles take this one (FwdSm90Kernel's keep_bits says why).
template <int kAcc>
JF2_LANES_FN void FwdKeepBitsByWords(uint32_t (&keep)[KeepWords<kAcc>()],
                                     const DropoutMask& mask, int64_t row, int64_t key0, int t4) {
  constexpr int kGroups = kAcc / 8;
  static_assert(kAcc % 8 == 0, "whole groups of 16 keys");
  const uint32_t threshold4 = mask.Threshold4();
  const int64_t group0 = key0 / 16;
#pragma unroll
  for (int w = 0; w < KeepWords<kAcc>(); ++w) keep[w] = 0;
  // Groups in pairs: lane t4 makes the call of row half t4 & 1, group
  // 2 cc + t4 / 2; word c / 4 = cc / 2, slot 2 (c % 4) + rh = 4 (cc % 2) + call.
#pragma unroll
  for (int cc = 0; cc < kGroups / 2; ++cc) {
    const Philox4 r = mask.Words(row + 8 * (t4 & 1), group0 + 2 * cc + (t4 >> 1));
    uint32_t v[4] = {r.x[0], r.x[1], r.x[2], r.x[3]};
    QuadTranspose(v, t4);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      keep[cc / 2] |= KeepBytes(v[x], threshold4) >> (4 * (cc % 2) + (t4 ^ x));
    }
  }
  if constexpr (kGroups % 2 == 1) {  // the last group alone: lanes t4 and t4 ^ 2 make one call
    constexpr int c = kGroups - 1;
    const int rh = t4 & 1;
    const Philox4 r = mask.Words(row + 8 * rh, group0 + c);
    const uint32_t theirs = ShflXor(SelectWord(r, t4 ^ 1), 1);
    keep[c / 4] |= KeepBytes(SelectWord(r, t4), threshold4) >> (2 * (c % 4) + rh);
    keep[c / 4] |= KeepBytes(theirs, threshold4) >> (2 * (c % 4) + (rh ^ 1));
  }
}

// The keep mask of forward elements i, i + 1 (i even: two adjacent keys, one
// packed pair of P's A fragment), from the forward's keep words: 0xFFFF over the
// half of each kept key. The pair's bits sit at bit 7 - slot of bytes b and
// b + 1 of word c / 4 (slot 2 (c % 4) + rh); a shift brings them to bit 7,
// where prmt's sign-replicating selectors (nibbles 8 + byte) spread each
// over its half. Two instructions per pair, with the AND, where a bit test
// and a select per fp32 element cost four.
template <int kAcc>
JF2_LANES_FN uint32_t FwdKeepPairMask(const uint32_t (&keep)[KeepWords<kAcc>()], int i) {
  const int c = i / 8, b = 2 * ((i / 4) % 2), rh = (i / 2) % 2;
  const uint32_t at_bit7 = keep[c / 4] << (2 * (c % 4) + rh);
  return Prmt(at_bit7, 0, b == 0 ? 0x9988u : 0xBBAAu);
}

// Backward: the keep bits of this thread's elements of a 16-row slab (keys)
// x kAcc*2 (queries) S^T tile whose row g is key `key` and whose first query
// is m_begin. Query column u = 2 j + e (n8 tile j, column e) of the lane's
// t4 is call u, made by lane g = u % 8 of batch u / 8. A call's 16 bits are
// packed at bit 8 (2 kh + d % 2) + d / 2 (+ 4 for the second batch of a
// word) for the lane d that needs key d + 8 kh; three butterfly stages over
// g's bits (lane ^ 4, ^ 8, ^ 16) then turn the destination d into the
// source lane (BwdKept).
template <int kAcc>
JF2_LANES_FN void BwdKeepBits(uint32_t (&keep)[KeepWords<kAcc>()], const DropoutMask& mask,
                              int64_t key, int64_t m_begin, int g, int t4) {
  constexpr int kCalls = kAcc / 2;  // 2 per n8 tile
  constexpr int kBatches = (kCalls + 7) / 8;
  static_assert(kAcc % 4 == 0 && (kBatches + 1) / 2 == KeepWords<kAcc>(), "two batches a word");
  const uint32_t threshold4 = mask.Threshold4();
  const int64_t group = (key - g) / 16;
#pragma unroll
  for (int wd = 0; wd < KeepWords<kAcc>(); ++wd) {
    uint32_t x = 0;
#pragma unroll
    for (int bb = 0; bb < 2 && 2 * wd + bb < kBatches; ++bb) {
      const int u = 8 * (2 * wd + bb) + g;  // past kCalls: a call whose bits go unused
      const Philox4 r = mask.Words(m_begin + 8 * (u / 2) + 2 * t4 + u % 2, group);
#pragma unroll
      for (int w = 0; w < 4; ++w) x |= KeepBytesMajority(r.x[w], threshold4) >> (7 - w - 4 * bb);
    }
    // Stage for g's bit k: the destination bit sits at position bit 3, 0, 1
    // (mask of the set positions, shift); the lane keeps the half it is the
    // destination of and takes its partner's half for it.
    constexpr uint32_t kMask[3] = {0xFF00FF00u, 0xAAAAAAAAu, 0xCCCCCCCCu};
    constexpr int kShift[3] = {8, 1, 2};
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const uint32_t bit = (g >> k) & 1;
      x = ButterflyStage(x, kMask[k] ^ (bit - 1), bit ? kShift[k] : -kShift[k], 4 << k);
    }
    keep[wd] = x;
  }
}

// Whether backward element i survives, from BwdKeepBits' words.
template <int kAcc>
JF2_LANES_FN bool BwdKept(const uint32_t (&keep)[KeepWords<kAcc>()], int i) {
  const int j = i / 4, rh = (i / 2) % 2, e = i % 2;
  const int u = 2 * j + e, batch = u / 8, src = u % 8;
  const int bit = 8 * (2 * rh + (src & 1)) + 2 * ((src >> 2) & 1) + ((src >> 1) & 1) +
                  4 * (batch % 2);
  return (keep[batch / 2] >> bit) & 1u;
}

#endif  // __CUDACC__ || JF2_DROPOUT_BITS_HOST_LANES

#if defined(__CUDACC__)

// The mask of (b, h): its seed pair, read through the read-only path.
__device__ __forceinline__ DropoutMask LoadDropoutMask(const FlashParams& p, int bh) {
  const uint2 seed = __ldg(reinterpret_cast<const uint2*>(p.dropout_seeds) + bh);
  return DropoutMask{seed.x, seed.y, p.dropout_threshold};
}

// max(x, 0) in each half of a packed pair of Elem, NaN kept: the backward's
// sign-marked P^T (dropped elements negative) to Z o P^T in one instruction
// per pair, where a compare and a select per fp32 element cost four.
template <typename Elem>
__device__ __forceinline__ uint32_t ZeroNegativeHalves(uint32_t x) {
  uint32_t y;
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm("max.NaN.bf16x2 %0, %1, %2;\n" : "=r"(y) : "r"(x), "r"(0u));
  } else {
    asm("max.NaN.f16x2 %0, %1, %2;\n" : "=r"(y) : "r"(x), "r"(0u));
  }
  return y;
}

#endif  // __CUDACC__

}  // namespace jax_flash2::cuda
