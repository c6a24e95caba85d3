// FlashAttention-2 forward for sm80+ (mma.sync m16n8k16, fp32 accumulators).
//
// One thread block computes O for kBlockM (packed) query rows of one head and
// batch entry; grid (m_blocks * splits, B, H / pack) with m-blocks fastest, so
// the blocks that read the same K/V run together and share it through L2.
//
// Per key block n (kBlockN keys), walking from the last visible block down so
// that the diagonal and ragged blocks, the only ones needing the per-element
// mask, come first:
//   S = Q K_n^T                               (ldmatrix + mma, fp32)
//   m' = max(m, rowmax(S));  P = exp2(S * scale_log2 - m' * scale_log2)
//   l = l * exp2((m - m') * scale_log2) + rowsum(P);  O = O * (same) + P V_n
// and at the end O / l and LSE = m * scale + log(l). O stays unnormalised in
// registers until then. Warps split the query rows (no cross-warp reduction).
//
// Pipelining (FwdArgs::kv_stages, chosen by the host):
//  1 stage (prefill): Q, K and V have one shared-memory tile each. The copy of
//    V_n is in flight while S = Q K_n^T runs, and the copy of K_{n-1} while
//    softmax and P V_n run (FlashAttention-2's schedule): every copy overlaps
//    a compute phase at the smallest footprint (two blocks per SM on A100).
//  2 stages (split-KV / packed decode): K_{n-1} and V_{n-1} stream into the
//    second stage during all of block n's math. There the grid is small, the
//    math per key block short (few real rows) and load latency the bound.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../dropout_bits.cuh"
#include "../../flash_mask.h"
#include "../../online_softmax.h"
#include "../smem_optin.h"
#include "fwd_launch.h"
#include "kernel_traits.h"
#include "primitives.cuh"

namespace jax_flash2::cuda {
namespace fwd {

// ldmatrix from a raw shared address: the kernel keeps one base address per
// operand and adds compile-time offsets, which become immediates of the
// instruction instead of one live register per (tile, k-step) address.
__device__ __forceinline__ void LdMatrixX4At(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void LdMatrixX4TransAt(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Thread -> chunk map of the tile copies: kThreadsPerRow lanes share a row
// (so a warp reads whole 16-byte-chunk runs of a row), each taking every
// kThreadsPerRow-th chunk; the block covers kRowsPerIter rows per step.
template <class Tr>
struct CopyMap {
  static constexpr int Gcd(int a, int b) { return b == 0 ? a : Gcd(b, a % b); }
  static constexpr int kThreadsPerRow = Gcd(Tr::kChunksPerRow, Tr::kThreads);
  static constexpr int kChunksPerThread = Tr::kChunksPerRow / kThreadsPerRow;
  static constexpr int kRowsPerIter = Tr::kThreads / kThreadsPerRow;
};

// cp.async of kRows rows of one K or V head into smem, starting at key row0.
// Rows >= num_rows and columns >= head_dim are zero-filled (zero K rows are
// masked anyway; zero V columns add nothing). The source pointer advances by
// one step per row group rather than being recomputed from the row index, so
// no per-row offsets stay live across the main loop. kL2Policy: loaded under
// l2_policy (L2Policy).
template <class Tr, int kRows, bool kL2Policy = false, typename Elem>
__device__ __forceinline__ void LoadKvTile(Elem* smem, const Elem* head_base, int64_t row_stride,
                                           int row0, int num_rows, int head_dim, int tid,
                                           uint64_t l2_policy = 0) {
  using Map = CopyMap<Tr>;
  static_assert(kRows % Map::kRowsPerIter == 0);
  const int tr = tid / Map::kThreadsPerRow;
  const int tc = (tid % Map::kThreadsPerRow) * 8;
  const Elem* src = head_base + (row0 + tr) * row_stride + tc;
  const int64_t step = Map::kRowsPerIter * row_stride;
  Elem* dst = smem + tr * Tr::kSmemStride + tc;
#pragma unroll
  for (int i = 0; i < kRows / Map::kRowsPerIter; ++i) {
    const bool row_ok = row0 + tr + i * Map::kRowsPerIter < num_rows;
#pragma unroll
    for (int j = 0; j < Map::kChunksPerThread; ++j) {
      const int c = j * Map::kThreadsPerRow * 8;
      const bool valid = row_ok && tc + c < head_dim;
      Elem* to = dst + i * Map::kRowsPerIter * Tr::kSmemStride + c;
      const Elem* from = valid ? src + c : head_base;
      if constexpr (kL2Policy) {
        CpAsync16(to, from, valid, l2_policy);
      } else {
        CpAsync16(to, from, valid);
      }
    }
    src += step;
  }
}

// cp.async of the block's Q rows. Packed row r is query r / pack of head
// z * pack + r % pack; rows past num_rows are zero-filled.
template <class Tr, typename Elem>
__device__ __forceinline__ void LoadQTile(Elem* smem, const FlashParams& p, int b, int z, int pack,
                                          int row_begin, int num_rows, int tid) {
  constexpr int kChunks = Tr::kBlockM * Tr::kChunksPerRow;
  const Elem* q = static_cast<const Elem*>(p.q);
#pragma unroll
  for (int i = 0; i < (kChunks + Tr::kThreads - 1) / Tr::kThreads; ++i) {
    const int idx = tid + i * Tr::kThreads;
    if (kChunks % Tr::kThreads != 0 && idx >= kChunks) break;
    const int r = idx / Tr::kChunksPerRow;
    const int c = (idx % Tr::kChunksPerRow) * 8;
    const int row = row_begin + r;
    const bool valid = row < num_rows && c < p.head_dim;
    const Elem* src = q;
    if (valid) {
      const int t = row / pack;
      const int head = z * pack + row % pack;
      src = q + b * p.q_batch_stride + t * p.q_row_stride + head * p.q_head_stride + c;
    }
    CpAsync16(smem + r * Tr::kSmemStride + c, src, valid);
  }
}

// This lane's ldmatrix address in a tile whose rows are kStride elements apart
// (the prefill kernel's padded rows, conflict-free for ldmatrix): 16-row group
// i, 16-column step j. ComputeS and AccumulatePV take the tiles' layouts as
// such address maps (the decode kernel's K/V tiles are swizzled instead).
template <int kStride>
struct PaddedTileAt {
  uint32_t base;  // this lane's address at (0, 0)
  __device__ __forceinline__ uint32_t operator()(int i, int j) const {
    return base + (i * 16 * kStride + j * 16) * 2;
  }
};

template <class Tr>
__device__ __forceinline__ void ZeroScores(float (&s)[Tr::kMTiles][Tr::kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;
    }
  }
}

// S = Q K^T for the first kLive m16 tiles of the warp (the rest stay 0);
// q_at(m16 tile, k16 step), k_at(16-key pair, k16 step).
template <class Tr, typename Elem, int kLive, class QAt, class KAt>
__device__ __forceinline__ void ComputeS(float (&s)[Tr::kMTiles][Tr::kNTiles][4], QAt q_at,
                                         KAt k_at, int head_dim) {
  ZeroScores<Tr>(s);
#pragma unroll
  for (int ks = 0; ks < Tr::kHeadDim / 16; ++ks) {
    if (ks * 16 >= head_dim) break;  // zero padding columns contribute nothing
    uint32_t a[kLive][4];
#pragma unroll
    for (int mt = 0; mt < kLive; ++mt) LdMatrixX4At(a[mt], q_at(mt, ks));
#pragma unroll
    for (int np = 0; np < Tr::kNTiles / 2; ++np) {
      uint32_t kf[4];
      LdMatrixX4At(kf, k_at(np, ks));
      const uint32_t b0[2] = {kf[0], kf[1]};
      const uint32_t b1[2] = {kf[2], kf[3]};
#pragma unroll
      for (int mt = 0; mt < kLive; ++mt) {
        Mma16816<Elem>(s[mt][2 * np], a[mt], b0);
        Mma16816<Elem>(s[mt][2 * np + 1], a[mt], b1);
      }
    }
  }
}

// The A fragments of P's 16-key step kk for the first kLive m16 tiles: the C
// fragments of two adjacent n8 tiles of P are the A fragment of one k16 step
// (primitives.cuh), rounded to Elem as in FA2.
template <class Tr, typename Elem, int kLive>
__device__ __forceinline__ void PFragments(const float (&s)[Tr::kMTiles][Tr::kNTiles][4], int kk,
                                           uint32_t (&a)[kLive][4]) {
#pragma unroll
  for (int mt = 0; mt < kLive; ++mt) {
    a[mt][0] = PackFloat2<Elem>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
    a[mt][1] = PackFloat2<Elem>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
    a[mt][2] = PackFloat2<Elem>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
    a[mt][3] = PackFloat2<Elem>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
  }
}

// O += P V for the first kLive m16 tiles; v_at(16-key step, 16-column pair).
template <class Tr, typename Elem, int kLive, class VAt>
__device__ __forceinline__ void AccumulatePV(const float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                             float (&o)[Tr::kMTiles][Tr::kDTiles][4], VAt v_at,
                                             int head_dim) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    uint32_t a[kLive][4];
    PFragments<Tr, Elem, kLive>(s, kk, a);
#pragma unroll
    for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
      if (dp * 16 >= head_dim) break;  // padding columns of O are never written
      uint32_t vf[4];
      LdMatrixX4TransAt(vf, v_at(kk, dp));
      const uint32_t b0[2] = {vf[0], vf[1]};
      const uint32_t b1[2] = {vf[2], vf[3]};
#pragma unroll
      for (int mt = 0; mt < kLive; ++mt) {
        Mma16816<Elem>(o[mt][2 * dp], a[mt], b0);
        Mma16816<Elem>(o[mt][2 * dp + 1], a[mt], b1);
      }
    }
  }
}

// Sets to -inf the scores of keys outside [key_lo, key_hi) of their row:
// this lane's rows mt * 16 + g (+8) and keys key0 + nt * 8 + 2 * t4 (+1).
template <class Tr>
__device__ __forceinline__ void MaskScores(float (&s)[Tr::kMTiles][Tr::kNTiles][4], int key0,
                                           const int (&key_lo)[Tr::kMTiles][2],
                                           const int (&key_hi)[Tr::kMTiles][2], int t4) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key0 + nt * 8 + 2 * t4 + (i & 1);
        if (key < key_lo[mt][i / 2] || key >= key_hi[mt][i / 2]) s[mt][nt][i] = -INFINITY;
      }
    }
  }
}

// One key block of the online softmax, in place: the running max, sum and O
// are rescaled to the new row max and S becomes the unnormalised P. row_sum
// holds this lane's columns only (quad-reduced by the caller at the end).
// kWarpSkipsUnitRescale: the whole warp calls it, and skips O's rescale when
// every factor is exactly 1 (no row's max moved: most of a long row's blocks;
// the decode kernel's D 128 chunk spent 64 of its ~630 instructions on it).
template <class Tr, bool kWarpSkipsUnitRescale = false>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                              float (&o)[Tr::kMTiles][Tr::kDTiles][4],
                                              float (&row_max)[Tr::kMTiles][2],
                                              float (&row_sum)[Tr::kMTiles][2], float scale_log2) {
  float corrections[Tr::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[mt][h];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
      }
      mx = QuadMax(mx);
      const float max_scaled = ExpOffset(mx, scale_log2);
      const float correction = RescaleFactor(row_max[mt][h], mx, scale_log2, FastExp2);
      row_max[mt][h] = mx;
      row_sum[mt][h] *= correction;
      corrections[mt][h] = correction;
      if constexpr (!kWarpSkipsUnitRescale) {
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
          o[mt][dt][2 * h] *= correction;
          o[mt][dt][2 * h + 1] *= correction;
        }
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = FastExp2(fmaf(s[mt][nt][2 * h + e], scale_log2, -max_scaled));
          s[mt][nt][2 * h + e] = pv;
          row_sum[mt][h] += pv;
        }
      }
    }
  }
  if constexpr (kWarpSkipsUnitRescale) {
    bool unit = true;
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      unit = unit && corrections[mt][0] == 1.f && corrections[mt][1] == 1.f;
    }
    if (!__all_sync(0xffffffffu, unit)) {  // NaN != 1: a NaN factor is applied
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][dt][e] *= corrections[mt][e / 2];
        }
      }
    }
  }
}

// The forward's score transform in the kernel's units: S holds unscaled Q K^T
// and the softmax multiplies by scale * log2(e), so a transformed natural-unit
// score x is stored back as x / scale:
//   x = scale * S;  x = softcap * tanh(x / softcap)  (softcap > 0)
//   x -= slope[b, head] * |t + S - T - key|           (ALiBi, after the cap)
//   S = x / scale, or -inf where q_segment_ids[t] != kv_segment_ids[key].
// Only the element (row, key) pairs of this lane: rows row0 + mt * 16 + g (+8)
// (packed: query row / pack of head z * pack + row % pack), keys key0 + nt * 8
// + 2 * t4 (+1). Rows past T (never written) and keys past S (hidden by the
// window mask) read the ids of the last query / key.
template <class Tr>
__device__ __forceinline__ void ApplyScoreVariants(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                                   const FlashParams& p, int b, int z, int pack,
                                                   int row0, int key0, int g, int t4) {
  // The plain path has no register to spare (d128: 255): see Opaque.
  b = Opaque(b);
  z = Opaque(z);
  row0 = Opaque(row0);
  key0 = Opaque(key0);
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const int seqlen_k = static_cast<int>(p.seqlen_k);
  // Query of each of the lane's rows.
  int t[Tr::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) t[mt][h] = min((row0 + mt * 16 + g + 8 * h) / pack, seqlen_q - 1);
  }
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int head = z * pack + (row0 + mt * 16 + g + 8 * h) % pack;
        const float slope =
            p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.num_heads_q + head] : 0.f;
        const int diag = t[mt][h] + seqlen_k - seqlen_q;  // |t + S - T - key| = |diag - key|
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = key0 + nt * 8 + 2 * t4 + e;
            float x = s[mt][nt][2 * h + e] * p.softmax_scale;
            if (p.softcap > 0.f) x = p.softcap * FastTanh(__fdividef(x, p.softcap));
            x -= slope * static_cast<float>(abs(diag - key));
            s[mt][nt][2 * h + e] = __fdividef(x, p.softmax_scale);
          }
        }
      }
    }
  }
  if (p.q_segment_ids != nullptr) {
    // Column by column: one key id live at a time.
    const int32_t* kv_ids = p.kv_segment_ids + static_cast<int64_t>(b) * seqlen_k;
    const int32_t* q_ids = p.q_segment_ids + static_cast<int64_t>(b) * seqlen_q;
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int32_t kv_id = kv_ids[min(key0 + nt * 8 + 2 * t4 + e, seqlen_k - 1)];
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (q_ids[t[mt][h]] != kv_id) s[mt][nt][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  }
}

// Word offset in shared memory of a lane's first keep word: the padding of Q
// row warp_row0 + lane / 4, its word lane % 4 (word k lies 8 k rows below).
// A warp's kMTiles * 2 words per lane fill exactly the padding of its 16
// kMTiles rows, and the 8 rows x 4 words of one access hit 32 distinct banks
// (a row is kHeadDim / 2 + 4 words: 4 or 20 more than a multiple of 32).
template <class Tr>
__device__ __forceinline__ int KeepWordsOfLane(int warp_row0, int lane) {
  static_assert(kSmemPad * 2 == 4 * 4, "four keep words per row's padding");
  return (warp_row0 + lane / 4) * (Tr::kSmemStride / 2) + Tr::kHeadDim / 2 + lane % 4;
}

// Dropout, P <- Z o P with Z the keep mask of flash_dropout.h at the absolute
// (query, key) of each element, in two steps:
//   DropoutKeepBits before S = Q K^T, while S holds no registers, into the
//     16-byte padding of the Q tile's rows (each lane its own words, so no
//     barrier; the copies never write the padding);
//   ApplyDropoutBits after the row sums, which stay those of the undropped
//     softmax (as the LSE does); 1 / (1 - rate) is applied with 1 / l in the
//     epilogue.
// Why the detour: the d128 tile sits at 255 registers with S and O live, and
// the Philox calls beside S, or even four words of bits carried in registers
// from before S to after it, made ptxas spill 144-700 bytes (dropout as a
// runtime branch of one kernel); this way the dropout kernel alone spills 44
// bytes at d128 on sm_80.
// Rows and keys as in ApplyScoreVariants (packed row r: query r / pack of head
// z * pack + r % pack). A lane's keys 2 t4, 2 t4 + 1 of n8 tiles 2 c and
// 2 c + 1 are word t4 of the Philox call of group c (key0 is a multiple of
// 16): each lane makes the calls of its rows and keeps its word. The rows of
// a quad may differ in head (packed GQA rows), so the Hopper kernels' quad
// transpose does not apply. Word (mt, h) of the lane, at keep[(mt * 2 + h) *
// Tr::kKeepWordStride], holds tile nt's two keys at bits 2 nt and 2 nt + 1;
// `keep` is the lane's first word (KeepWordsOfLane).
template <class Tr>
__device__ __forceinline__ void DropoutKeepBits(uint32_t* keep, const FlashParams& p, int b,
                                                int z, int pack, int row0, int key0, int g,
                                                int t4) {
  static_assert(Tr::kNTiles % 2 == 0 && Tr::kNTiles * 2 <= 32);
#pragma unroll 1
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll 1
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + 8 * h;
      const DropoutMask mask = MakeDropoutMask(p, b, z * pack + row % pack);
      const uint32_t threshold4 = mask.Threshold4();
      const int query = row / pack;  // rows past T are never written
      uint32_t own = 0;
#pragma unroll 1
      for (int c = 0; c < Tr::kNTiles / 2; ++c) {
        // Bytes 0..3: tile 2 c columns 0, 1, tile 2 c + 1 columns 0, 1.
        const uint32_t kept =
            KeepBytes(SelectWord(mask.Words(query, key0 / 16 + c), t4), threshold4);
        own |= (((kept >> 7) & 1u) | ((kept >> 14) & 2u) | ((kept >> 21) & 4u) |
                ((kept >> 28) & 8u))
               << (4 * c);
      }
      keep[(mt * 2 + h) * Tr::kKeepWordStride] = own;
    }
  }
}

template <class Tr>
__device__ __forceinline__ void ApplyDropoutBits(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                                 const uint32_t* keep) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t bits = keep[(mt * 2 + h) * Tr::kKeepWordStride];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!((bits >> (2 * nt + e)) & 1u)) s[mt][nt][2 * h + e] = 0.f;
        }
      }
    }
  }
}

// kDropout (p.dropout_seeds != nullptr) is the one score option made a
// template argument: as a runtime branch, even with the mask bits in shared
// memory, it cost the plain d128 kernel 28-124 bytes of spills (the kernel
// sits at 255 registers, and any branch between the softmax and P V splits
// the block whose overlap keeps it there).
template <typename Elem, int kHeadDim, bool kDropout>
__global__ void __launch_bounds__(FwdTraits<kHeadDim>::kThreads, 1)
    FwdKernel(const __grid_constant__ FwdArgs args) {
  using Tr = FwdTraits<kHeadDim>;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kMT = Tr::kMTiles;
  constexpr int kNT = Tr::kNTiles;
  constexpr int kDT = Tr::kDTiles;
  constexpr int kStride = Tr::kSmemStride;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Q, then per stage K and V (one stage: Q K V; two: Q K0 V0 K1 V1).
  Elem* s_q = reinterpret_cast<Elem*>(smem_raw);
  Elem* s_k = s_q + kBlockM * kStride;
  Elem* s_v = s_k + kBlockN * kStride;

  const FlashParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;   // C-layout row within an m16 tile (and g + 8)
  const int t4 = lane % 4;  // C-layout column pair
  const int m_block = blockIdx.x % args.num_m_blocks;
  const int split = blockIdx.x / args.num_m_blocks;
  const int b = blockIdx.y;
  const int z = blockIdx.z;
  const int pack = args.pack;
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const int seqlen_k = static_cast<int>(p.seqlen_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const int num_rows = seqlen_q * pack;
  const int row_begin = m_block * kBlockM;
  const int row_end = min(row_begin + kBlockM, num_rows);
  const int kv_head = z * pack / static_cast<int>(p.group_size);  // GQA by index, no copies

  // Key blocks [n_first, n_end) that any query of this block may see, within
  // this block's split.
  const WindowMask mask = MakeWindowMask(p);
  const int t_begin = row_begin / pack;
  const int t_end = (row_end - 1) / pack + 1;
  int64_t key_begin, key_end;
  mask.KeyRange(t_begin, t_end, &key_begin, &key_end);
  // BlockFullyVisible(t_begin, t_end, n0, n1) in two 32-bit registers: it is
  // exactly [n0, n1) inside the keys every row sees, from the last row's
  // first key (the window's left edge grows with t) to the first row's end
  // (right edge and S).
  int64_t lo, hi;
  mask.KeyRange(t_end - 1, t_end, &lo, &hi);
  const int full_begin = static_cast<int>(lo);
  mask.KeyRange(t_begin, t_begin + 1, &lo, &hi);
  const int full_end = static_cast<int>(hi);
  if (p.q_segment_ids != nullptr && key_begin < key_end) {
    // Packed sequences: only the keys from the first to the last one whose id
    // lies within this block's query ids.
    NarrowToSegments(p.q_segment_ids + b * p.seqlen_q, t_begin, t_end,
                     p.kv_segment_ids + b * p.seqlen_k, &key_begin, &key_end);
  }
  int n_first = static_cast<int>(key_begin / kBlockN);
  int n_end = key_end > key_begin ? static_cast<int>((key_end + kBlockN - 1) / kBlockN) : n_first;
  if (args.num_splits > 1) {
    n_first = max(n_first, split * args.n_blocks_per_split);
    n_end = min(n_end, (split + 1) * args.n_blocks_per_split);
  }

  const Elem* k_head =
      static_cast<const Elem*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
  const Elem* v_head =
      static_cast<const Elem*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;

  // Warp w owns block rows [w * 16 * kMT, (w + 1) * 16 * kMT). Warps whose
  // rows are all past the last query (short decode blocks) only help copy.
  const int warp_row0 = warp * 16 * kMT;
  const bool warp_active = row_begin + warp_row0 < row_end;
  const float scale_log2 = p.softmax_scale_log2;

  // Per-lane ldmatrix row addresses (bytes); the tile and k-step offsets added
  // below are compile-time constants.
  // Q (A operand, x4): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), rows first.
  const uint32_t q_addr = SmemAddress(s_q) +
      ((warp_row0 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8) * 2;
  // K (B operand of Q K^T, x4): two n8 tiles x (k 0-7 | 8-15), k first.
  const uint32_t k_addr =
      SmemAddress(s_k) + (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8) * 2;
  // V (B operand of P V, x4 transposed): (keys 0-7 | 8-15) x two d8 tiles.
  const uint32_t v_addr =
      SmemAddress(s_v) + ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8) * 2;

  float o[kMT][kDT][4];
  float row_max[kMT][2];
  float row_sum[kMT][2];  // this lane's columns only; quad-reduced at the end
  int key_lo[kMT][2];     // keys [key_lo, key_hi) visible to each row the lane holds
  int key_hi[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][dt][i] = 0.f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = -INFINITY;
      row_sum[mt][h] = 0.f;
      // Allowed(t, j) is exactly j in KeyRange(t, t + 1); 32-bit bounds keep
      // the per-element mask cheap.
      const int t = (row_begin + warp_row0 + mt * 16 + g + 8 * h) / pack;
      mask.KeyRange(t, t + 1, &lo, &hi);
      key_lo[mt][h] = static_cast<int>(lo);
      key_hi[mt][h] = static_cast<int>(hi);
    }
  }

  // Decode blocks hold only group_size * T real rows: when this warp's last
  // m16 tile has none, the two-stage (decode) loop runs the mma over the first
  // tile alone. The count is a compile-time argument (kLive) so that the
  // one-stage prefill loop, which always runs full tiles, carries neither a
  // per-tile predicate nor a second code path.
  const bool all_live = row_begin + warp_row0 + (kMT - 1) * 16 < row_end;

  // This lane's dropout keep words (DropoutKeepBits), in the padding of its
  // warp's Q rows; recomputed at each use so that no register holds the address.
  auto dropout_keep = [&]() {
    return reinterpret_cast<uint32_t*>(smem_raw) + Opaque(KeepWordsOfLane<Tr>(warp_row0, lane));
  };

  // Mask, online softmax (S becomes P in place), O += P V_n.
  auto softmax_pv = [&](float (&s)[kMT][kNT][4], int key0, uint32_t v_tile, bool all) {
    if (HasScoreVariants(p)) {  // runtime options, off the plain path
      ApplyScoreVariants<Tr>(s, p, b, z, pack, row_begin + warp_row0, key0, g, t4);
    }
    // Per-element mask only where some (query, key) pair of the block is
    // hidden: the diagonal band, window edges and the ragged last key block.
    if (key0 < full_begin || key0 + kBlockN > full_end) {  // !BlockFullyVisible
      MaskScores<Tr>(s, key0, key_lo, key_hi, t4);
    }
    OnlineSoftmax<Tr>(s, o, row_max, row_sum, scale_log2);

    if constexpr (kDropout) ApplyDropoutBits<Tr>(s, dropout_keep());

    if (kMT == 1 || all) {
      AccumulatePV<Tr, Elem, kMT>(s, o, PaddedTileAt<kStride>{v_tile}, head_dim);
    } else {
      AccumulatePV<Tr, Elem, 1>(s, o, PaddedTileAt<kStride>{v_tile}, head_dim);
    }
  };

  // S = Q K_n^T (unscaled; the scale is folded into exp2 below), and the
  // dropout keep bits of the block's keys key0 + [0, kBlockN) first.
  auto compute_s = [&](float (&s)[kMT][kNT][4], int key0, uint32_t k_tile, bool all) {
    if constexpr (kDropout) {
      DropoutKeepBits<Tr>(dropout_keep(), p, Opaque(b), Opaque(z), pack,
                          Opaque(row_begin + warp_row0), Opaque(key0), g, t4);
    }
    if (kMT == 1 || all) {
      ComputeS<Tr, Elem, kMT>(s, PaddedTileAt<kStride>{q_addr}, PaddedTileAt<kStride>{k_tile},
                              head_dim);
    } else {
      ComputeS<Tr, Elem, 1>(s, PaddedTileAt<kStride>{q_addr}, PaddedTileAt<kStride>{k_tile},
                            head_dim);
    }
  };

  auto load_k = [&](Elem* dst, int n_block) {
    LoadKvTile<Tr, kBlockN>(dst, k_head, p.k_row_stride, n_block * kBlockN, seqlen_k, head_dim,
                            tid);
  };
  auto load_v = [&](Elem* dst, int n_block) {
    LoadKvTile<Tr, kBlockN>(dst, v_head, p.v_row_stride, n_block * kBlockN, seqlen_k, head_dim,
                            tid);
  };
  const uint32_t k_addr0 = k_addr;
  const uint32_t v_addr0 = v_addr;

  if (n_first < n_end) {
    LoadQTile<Tr>(s_q, p, b, z, pack, row_begin, num_rows, tid);
    load_k(s_k, n_end - 1);
    if (args.kv_stages == 2) load_v(s_v, n_end - 1);
    CpAsyncCommit();
  }

  if (args.kv_stages == 1) {
    // One tile each of K and V: V_n lands while S = Q K_n^T runs, K_{n-1}
    // while softmax and P V_n run.
    for (int n_block = n_end - 1; n_block >= n_first; --n_block) {
      CpAsyncWait<0>();
      __syncthreads();  // K_n (and Q) visible to all warps; every warp is done with V_{n+1}
      load_v(s_v, n_block);
      CpAsyncCommit();
      float s[kMT][kNT][4];
      if (warp_active) compute_s(s, n_block * kBlockN, k_addr0, true);
      CpAsyncWait<0>();
      __syncthreads();  // V_n visible; every warp is done reading K_n
      if (n_block > n_first) load_k(s_k, n_block - 1);
      CpAsyncCommit();
      if (warp_active) softmax_pv(s, n_block * kBlockN, v_addr0, true);
    }
  } else {
    // Two K/V stages: K_{n-1} and V_{n-1} stream into the other stage during
    // all of block n's math, so twice the bytes are in flight. Used where
    // latency, not the tensor cores, bounds the time (split-KV and packed
    // decode grids); prefill keeps the smaller one-stage footprint.
    constexpr int kStageElems = 2 * kBlockN * kStride;  // K then V of one stage
    int stage = 0;
    for (int n_block = n_end - 1; n_block >= n_first; --n_block, stage ^= 1) {
      if (n_block > n_first) {
        // The other stage was last read in the previous iteration, which
        // ended with a barrier.
        load_k(s_k + (stage ^ 1) * kStageElems, n_block - 1);
        load_v(s_v + (stage ^ 1) * kStageElems, n_block - 1);
      }
      CpAsyncCommit();
      CpAsyncWait<1>();  // all but the group just issued: stage `stage` has landed
      __syncthreads();
      if (warp_active) {
        float s[kMT][kNT][4];
        const uint32_t offset = stage * kStageElems * 2;
        compute_s(s, n_block * kBlockN, k_addr0 + offset, all_live);
        softmax_pv(s, n_block * kBlockN, v_addr0 + offset, all_live);
      }
      __syncthreads();  // every warp is done with this stage before it is refilled
    }
  }

  // Epilogue: O / l and LSE, or this split's normalised partials.
  const bool write_partial = args.num_splits > 1;
  const int64_t num_heads = p.num_heads_q;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = QuadSum(row_sum[mt][h]);
      const int row = row_begin + warp_row0 + mt * 16 + g + 8 * h;
      if (row >= row_end) continue;
      const int t = row / pack;
      const int head = z * pack + row % pack;
      // Dropout's 1 / (1 - rate) goes into the normalizer; the LSE is of the
      // undropped softmax.
      const float inv_l = RowNormalizer(l, kDropout ? p.dropout_scale : 1.f, IeeeDivide{});
      const float lse = RowLse(row_max[mt][h] * p.softmax_scale, l, IeeeLog{});
      const int64_t lse_index = (b * num_heads + head) * seqlen_q + t;
      if (!write_partial) {
        Elem* o_row = static_cast<Elem*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
                      head * p.o_head_stride;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const int d = dt * 8 + 2 * t4;
          if (d < head_dim) {
            *reinterpret_cast<uint32_t*>(o_row + d) =
                PackFloat2<Elem>(o[mt][dt][2 * h] * inv_l, o[mt][dt][2 * h + 1] * inv_l);
          }
        }
        if (t4 == 0) p.lse[lse_index] = lse;
      } else {
        const int64_t part = split * p.batch * num_heads * seqlen_q + lse_index;
        float* o_row = args.o_partial + part * head_dim;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const int d = dt * 8 + 2 * t4;
          if (d < head_dim) {
            *reinterpret_cast<float2*>(o_row + d) =
                make_float2(o[mt][dt][2 * h] * inv_l, o[mt][dt][2 * h + 1] * inv_l);
          }
        }
        if (t4 == 0) args.lse_partial[part] = lse;
      }
    }
  }
}

}  // namespace fwd

namespace fwd {

template <typename Elem, int kHeadDim, bool kDropout>
cudaError_t LaunchFwdKernelFor(const FwdArgs& args, cudaStream_t stream) {
  using Tr = FwdTraits<kHeadDim>;
  const auto kernel = &FwdKernel<Elem, kHeadDim, kDropout>;
  const int smem_bytes = FwdSmemBytes(Tr::kTile, args.kv_stages);
  // Opt in once per device to the most dynamic shared memory any launch of
  // this kernel may ask for there (the two-stage size when the device has it;
  // the host only picks two stages then). Setting it per launch size instead
  // could lower it under a later, larger launch.
  static std::atomic<uint64_t> opted_in{0};
  const cudaError_t err = OptInSharedMemoryOnce(
      reinterpret_cast<const void*>(kernel), opted_in, [](int device, int* max_bytes) {
        int optin = 0;
        const cudaError_t e =
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        *max_bytes = FwdSmemBytes(Tr::kTile, 2);
        if (*max_bytes > optin) *max_bytes = FwdSmemBytes(Tr::kTile, 1);
        return e;
      });
  if (err != cudaSuccess) return err;
  const dim3 grid(args.num_m_blocks * args.num_splits, static_cast<unsigned>(args.p.batch),
                  static_cast<unsigned>(args.p.num_heads_q / args.pack));
  kernel<<<grid, Tr::kThreads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace fwd

template <typename Elem, int kHeadDim>
cudaError_t LaunchFwdKernel(const FwdArgs& args, cudaStream_t stream) {
  return args.p.dropout_seeds != nullptr
             ? fwd::LaunchFwdKernelFor<Elem, kHeadDim, true>(args, stream)
             : fwd::LaunchFwdKernelFor<Elem, kHeadDim, false>(args, stream);
}

}  // namespace jax_flash2::cuda
