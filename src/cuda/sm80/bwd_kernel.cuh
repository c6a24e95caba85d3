// FlashAttention-2 backward kernels (sm80+, mma.sync), in three launches:
//
//   1. BwdPreprocessKernel: Dvec_i = rowsum(dO_i * O_i) - dLSE_i and
//      lse2_i = LSE_i * log2(e) (+inf where LSE = -inf), per query row.
//   2. BwdMainKernel: one CTA per (key block, batch, K/V head). K_j, V_j stay in
//      shared memory, dK_j, dV_j in fp32 registers; the CTA loops over the
//      group's query heads and over the query blocks that can see key block j:
//        S   = Q K^T                  (computed transposed: S^T = K Q^T)
//        P   = exp2(S * scale*log2(e) - lse2)
//        dV += P^T dO
//        dP  = dO V^T                 (dP^T = V dO^T)
//        dS  = P o (dP - Dvec)        (o: elementwise)
//        dK += dS^T Q                 (times scale in the epilogue)
//        dQ += dS K                   (fp32 atomics into dq_acc; times scale in 3.)
//   3. BwdConvertKernel: dq = dq_acc * scale in the input dtype.
//
// Deterministic backward (p.deterministic): the atomics' order across key
// blocks is what varies run to run. There the grid has only `splits` CTAs per
// (b, kv head) (BwdDqSplits); CTA i walks key blocks i, i + splits, ... in
// order and adds into its own dQ slice, so every element of a slice is summed
// in one fixed order, and the convert kernel adds the slices in index order.
// Cost: splits * B * T * H * D * 4 bytes of scratch (capped at 1 GiB), a grid
// of about one CTA per multiprocessor (less tolerance of causal load
// imbalance), and the convert kernel reading `splits` slices.
//
// GQA/MQA: dK and dV of a K/V head are sums over its group of query heads. The
// CTA loops over the group itself, so the sum is formed in registers and no
// [B, S, H, D] dK/dV (nor a reduction launch) is needed; the price is that a
// CTA's work grows with group_size, which is fine because the grid is already
// (S / block_n) x B x K CTAs.
//
// Why S^T instead of S: with the key rows as the mma's M dimension each warp
// owns 16 keys for all key-side products, so P^T and dS^T come out of the S^T
// and dP^T accumulators in exactly the A-operand layout of dV += P^T dO and
// dK += dS^T Q. They still go through shared memory, because with warps_d > 1
// a warp needs the other warps' query columns, and dQ = dS K needs all keys.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "../dropout_bits.cuh"
#include "../../flash_mask.h"
#include "../../flash_params.h"
#include "../flash_cuda.h"
#include "../smem_optin.h"
#include "bwd_traits.h"
#include "primitives.cuh"

namespace jax_flash2::cuda {

// Everything the main kernel needs besides FlashParams: the scratch parts.
struct BwdScratchPtrs {
  float* lse2;
  float* dvec;
  float* dq_acc;
  int64_t t_pad;
  int dq_splits;             // dQ slices (BwdDqSplits); 1 unless deterministic
  int64_t dq_slice_stride;   // elements between slices (B * T * H * D); 0 unless deterministic
  // The Hopper backward's stream-K pieces (BwdScratchLayout): sk_slots slots,
  // flags zeroed; none (0) keeps its grid to whole tiles.
  int* sk_flags = nullptr;
  float* sk_partial = nullptr;
  int64_t sk_slots = 0;
  // The Hopper deterministic backward's dQ writer counters (zeroed), or none.
  int* dq_turns = nullptr;
};

// The parts of one call's scratch laid out by MakeBwdScratchLayout.
inline BwdScratchPtrs BwdScratchPointers(void* scratch, const BwdScratchLayout& layout,
                                         bool deterministic) {
  char* base = static_cast<char*>(scratch);
  return {reinterpret_cast<float*>(base + layout.lse2_offset),
          reinterpret_cast<float*>(base + layout.dvec_offset),
          reinterpret_cast<float*>(base + layout.dq_acc_offset),
          layout.t_pad,
          layout.dq_splits,
          deterministic ? static_cast<int64_t>(layout.dq_split_elems) : 0,
          reinterpret_cast<int*>(base + layout.sk_flags_offset),
          reinterpret_cast<float*>(base + layout.sk_partial_offset),
          layout.sk_slots,
          layout.sk_partial_offset > layout.dq_turns_offset
              ? reinterpret_cast<int*>(base + layout.dq_turns_offset)
              : nullptr};
}

// a.lo * b.lo + a.hi * b.hi in fp32, a and b each two packed Elems.
template <typename Elem>
__device__ __forceinline__ float Dot2(uint32_t a, uint32_t b) {
  const Elem* ae = reinterpret_cast<const Elem*>(&a);
  const Elem* be = reinterpret_cast<const Elem*>(&b);
  return ToFloat(ae[0]) * ToFloat(be[0]) + ToFloat(ae[1]) * ToFloat(be[1]);
}

// ---------------------------------------------------------------------------
// 1. Preprocess, per (b, h, t) row, t < T_pad: a row's D / 8 16-byte pieces
// of O and dO go to a group of lanes (the power of two that covers them, at
// most 32), so a warp takes 32 / group rows at a time, and the warps stride
// over the rows. One warp per row left three quarters of the lanes idle at
// D 64 and launched a block per 8 rows: 107 us for 262k rows (67 MB of O and
// dO; H100, ncu) against 34 us in this form.
__host__ __device__ inline int BwdPreprocessGroup(int64_t head_dim) {
  int group = 1;
  while (group < 32 && group * 8 < head_dim) group *= 2;
  return group;
}

template <typename Elem>
__global__ void __launch_bounds__(256) BwdPreprocessKernel(const FlashParams p, BwdScratchPtrs s) {
  const int group = BwdPreprocessGroup(p.head_dim);
  const int lane = threadIdx.x % 32;
  const int piece = lane % group;
  const int64_t rows = p.batch * p.num_heads_q * s.t_pad;
  const int64_t rows_per_warp = 32 / group;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  for (int64_t row0 = warp * rows_per_warp; row0 < rows; row0 += warps * rows_per_warp) {
    const int64_t row = row0 + lane / group;
    const int64_t t = row % s.t_pad;
    const int64_t bh = row / s.t_pad;
    // Padding rows (t >= T) keep acc = 0: P = exp2(s - inf) = 0 and dS = 0
    // there whatever Q and dO hold.
    const bool real = row < rows && t < p.seqlen_q;
    float acc = 0.f;
    if (real) {
      const int64_t b = bh / p.num_heads_q, h = bh % p.num_heads_q;
      const int64_t q_off = b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
      const Elem* o = static_cast<const Elem*>(p.o) + q_off;
      const Elem* d_o = static_cast<const Elem*>(p.d_o) + q_off;
      for (int64_t c = piece * 8; c < p.head_dim; c += group * 8) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
        acc += Dot2<Elem>(ov.x, dv.x) + Dot2<Elem>(ov.y, dv.y) + Dot2<Elem>(ov.z, dv.z) +
               Dot2<Elem>(ov.w, dv.w);
      }
    }
    for (int off = group / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (piece != 0 || row >= rows) continue;
    if (!real) {
      s.lse2[row] = INFINITY;
      s.dvec[row] = 0.f;
      continue;
    }
    const int64_t lse_idx = bh * p.seqlen_q + t;
    const float d_lse = p.d_lse != nullptr ? p.d_lse[lse_idx] : 0.f;
    const float lse = p.lse[lse_idx];
    s.dvec[row] = acc - d_lse;
    // A row that sees no key has LSE = -inf; +inf here makes its P exactly 0
    // (exp2(s - inf)) instead of exp2(s + inf) = inf and then NaN.
    s.lse2[row] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
  }
}

// Its grid: enough 256-thread blocks for every row, at most as many as the
// SMs hold at once (its warps stride over the rows; a block beyond them
// would start only when one ends, and take as long again).
template <typename Elem>
unsigned BwdPreprocessBlocks(const FlashParams& p, const BwdScratchPtrs& s, int sm_count) {
  static const int per_sm = [] {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, BwdPreprocessKernel<Elem>, 256, 0);
    return n > 0 ? n : 1;
  }();
  const int64_t rows = p.batch * p.num_heads_q * s.t_pad;
  const int64_t rows_per_block = 8 * (32 / BwdPreprocessGroup(p.head_dim));
  const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 132) * per_sm;
  return static_cast<unsigned>(std::min((rows + rows_per_block - 1) / rows_per_block, cap));
}

// ---------------------------------------------------------------------------
// 3. Convert: dq = (sum of the dq_acc slices, in order) * scale, 8 elements
// (16 bytes of dq) per thread.
template <typename Elem>
__global__ void __launch_bounds__(256) BwdConvertKernel(const FlashParams p, BwdScratchPtrs s) {
  const int64_t chunks_per_row = p.head_dim / 8;
  const int64_t chunks = p.batch * p.seqlen_q * p.num_heads_q * chunks_per_row;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / chunks_per_row;  // ((b * T) + t) * H + h
    const int64_t d = (c % chunks_per_row) * 8;
    const int64_t h = row % p.num_heads_q;
    const int64_t t = (row / p.num_heads_q) % p.seqlen_q;
    const int64_t b = row / (p.num_heads_q * p.seqlen_q);
    const float4* src = reinterpret_cast<const float4*>(s.dq_acc + row * p.head_dim + d);
    float4 lo = src[0], hi = src[1];
    for (int i = 1; i < s.dq_splits; ++i) {
      const float4* part = src + i * s.dq_slice_stride / 4;
      const float4 a = part[0], b4 = part[1];
      lo = make_float4(lo.x + a.x, lo.y + a.y, lo.z + a.z, lo.w + a.w);
      hi = make_float4(hi.x + b4.x, hi.y + b4.y, hi.z + b4.z, hi.w + b4.w);
    }
    const float sc = p.softmax_scale;
    uint4 out;
    out.x = PackFloat2<Elem>(lo.x * sc, lo.y * sc);
    out.y = PackFloat2<Elem>(lo.z * sc, lo.w * sc);
    out.z = PackFloat2<Elem>(hi.x * sc, hi.y * sc);
    out.w = PackFloat2<Elem>(hi.z * sc, hi.w * sc);
    Elem* dq = static_cast<Elem*>(p.dq) + b * p.q_batch_stride + t * p.q_row_stride +
               h * p.q_head_stride + d;
    *reinterpret_cast<uint4*>(dq) = out;
  }
}

// ---------------------------------------------------------------------------
// 2. Main kernel.

// kRows x head_dim tile (row stride `stride` elements in global memory) into a
// [kRows][Tr::kStride] shared tile; rows >= valid_rows and columns >=
// head_dim are zero-filled (never read). `base` is a mapped address used as
// the dummy source of zero-filled chunks.
template <typename Tr, int kRows, typename Elem>
__device__ __forceinline__ void LoadTileAsync(Elem* smem, const Elem* gmem, const Elem* base,
                                              int64_t stride, int64_t valid_rows,
                                              int64_t head_dim) {
  constexpr int kChunks = kRows * Tr::kChunksPerRow;
  for (int c = threadIdx.x; c < kChunks; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow;
    const int col = (c % Tr::kChunksPerRow) * 8;
    const bool valid = r < valid_rows && col < head_dim;
    CpAsync16(smem + r * Tr::kStride + col, valid ? gmem + r * stride + col : base, valid);
  }
}

// Key block n_block of (b, kv head) = (blockIdx.y, blockIdx.z); dQ into dq_acc.
// kDropout == (p.dropout_seeds != nullptr), a template argument as in the
// forward: in the runtime score-variants branch it raised the spills of the
// d128 large-smem tile on sm_90a from 12 to 84 bytes of stores.
template <typename Elem, typename Tr, bool kDropout>
__device__ __forceinline__ void BwdMainBody(const FlashParams& p, const BwdScratchPtrs& s,
                                            int64_t n_block, float* dq_acc) {
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  constexpr int kStride = Tr::kStride, kPStride = Tr::kPStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Elem* s_k = reinterpret_cast<Elem*>(smem_raw);  // [kN][kStride]
  Elem* s_v = s_k + kN * kStride;                 // [kN][kStride]
  Elem* s_q = s_v + kN * kStride;                 // [2][kM][kStride]
  Elem* s_do = s_q + 2 * kM * kStride;            // [kDoStages][kM][kStride]
  Elem* s_pt = s_do + Tr::kDoStages * kM * kStride;  // [kN][kPStride]  P^T
  Elem* s_dst = s_pt + kN * kPStride;             // [kN][kPStride]  dS^T
  float* s_lse2 = reinterpret_cast<float*>(s_dst + kN * kPStride);  // [2][kM]
  float* s_dvec = s_lse2 + 2 * kM;                                  // [2][kM]

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, tq = lane % 4;  // mma fragment row / column-pair index
  const int wn = warp % Tr::kWarpsN, wd = warp / Tr::kWarpsN;
  const int64_t b = blockIdx.y, kvh = blockIdx.z;
  const int64_t seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, head_dim = p.head_dim;
  const WindowMask mask = MakeWindowMask(p);

  const int64_t n_begin = n_block * kN;
  const int64_t n_end = min(n_begin + kN, seqlen_k);
  int64_t q_begin, q_end;
  mask.QueryRange(n_begin, n_end, seqlen_q, &q_begin, &q_end);
  if (p.q_segment_ids != nullptr && q_begin < q_end) {
    // Packed sequences: only the queries from the first to the last one whose
    // id lies within this block's key ids.
    NarrowToSegments(p.kv_segment_ids + b * seqlen_k, static_cast<int>(n_begin),
                     static_cast<int>(n_end), p.q_segment_ids + b * seqlen_q, &q_begin, &q_end);
  }
  const int64_t m_block_begin = q_begin / kM;
  const int64_t num_m_blocks = q_end > q_begin ? (q_end + kM - 1) / kM - m_block_begin : 0;
  const int64_t num_iters = num_m_blocks * p.group_size;

  const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
  const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
  LoadTileAsync<Tr, kN>(s_k, k_head + n_begin * p.k_row_stride, k_head, p.k_row_stride,
                        n_end - n_begin, head_dim);
  LoadTileAsync<Tr, kN>(s_v, v_head + n_begin * p.v_row_stride, v_head, p.v_row_stride,
                        n_end - n_begin, head_dim);

  // Iteration `it` covers query head kvh * group + it / num_m_blocks and query
  // block m_block_begin + it % num_m_blocks: Q, dO, lse2, Dvec into buffer it % 2
  // (with one dO buffer, dO by load_single_do once the previous block's dV is done).
  auto load_single_do = [&](int64_t it) {
    const int64_t h = kvh * p.group_size + it / num_m_blocks;
    const int64_t m_begin = (m_block_begin + it % num_m_blocks) * kM;
    const Elem* do_head =
        static_cast<const Elem*>(p.d_o) + b * p.o_batch_stride + h * p.o_head_stride;
    LoadTileAsync<Tr, kM>(s_do, do_head + m_begin * p.o_row_stride, do_head, p.o_row_stride,
                          seqlen_q - m_begin, head_dim);
  };
  auto load_q_do = [&](int64_t it) {
    const int buf = static_cast<int>(it % 2);
    const int64_t h = kvh * p.group_size + it / num_m_blocks;
    const int64_t m_begin = (m_block_begin + it % num_m_blocks) * kM;
    const Elem* q_head =
        static_cast<const Elem*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const Elem* do_head =
        static_cast<const Elem*>(p.d_o) + b * p.o_batch_stride + h * p.o_head_stride;
    LoadTileAsync<Tr, kM>(s_q + buf * kM * kStride, q_head + m_begin * p.q_row_stride, q_head,
                          p.q_row_stride, seqlen_q - m_begin, head_dim);
    if constexpr (Tr::kDoStages == 2) {
      LoadTileAsync<Tr, kM>(s_do + buf * kM * kStride, do_head + m_begin * p.o_row_stride,
                            do_head, p.o_row_stride, seqlen_q - m_begin, head_dim);
    }
    // lse2/dvec rows are padded to a multiple of kM, so these copies are whole.
    const int64_t row0 = (b * p.num_heads_q + h) * s.t_pad + m_begin;
    if (threadIdx.x < kM / 4) {
      CpAsync16(s_lse2 + buf * kM + threadIdx.x * 4, s.lse2 + row0 + threadIdx.x * 4, true);
    } else if (threadIdx.x < kM / 2) {
      const int c = threadIdx.x - kM / 4;
      CpAsync16(s_dvec + buf * kM + c * 4, s.dvec + row0 + c * 4, true);
    }
  };
  if (num_iters > 0) {
    load_q_do(0);
    if constexpr (Tr::kDoStages == 1) load_single_do(0);
  }
  CpAsyncCommit();

  // dK, dV of keys [16 wn, +16) x dims [wd * kDw, +kDw): C fragments.
  constexpr int kDTiles = Tr::kDw / 8;
  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;
  }

  for (int64_t it = 0; it < num_iters; ++it) {
    const int buf = static_cast<int>(it % 2);
    const int64_t h = kvh * p.group_size + it / num_m_blocks;
    const int64_t m_begin = (m_block_begin + it % num_m_blocks) * kM;
    const Elem* sq = s_q + buf * kM * kStride;
    const Elem* sdo = s_do + (Tr::kDoStages == 2 ? buf : 0) * kM * kStride;
    const float* slse2 = s_lse2 + buf * kM;
    const float* sdvec = s_dvec + buf * kM;

    // This tile has landed, and every warp is done with iteration it - 1 (so
    // its buffers, P^T and dS^T may be overwritten).
    CpAsyncWait<0>();
    __syncthreads();
    if (it + 1 < num_iters) load_q_do(it + 1);
    CpAsyncCommit();

    // Dropout's keep bits first, while S^T and dP^T hold no registers.
    // Keys n_begin + 16 wn + g (+ 8) x queries m_begin + m0 + 8 nt + 2 tq + e:
    // the accumulator layout dropout_bits.cuh's BwdKeepBits reads.
    constexpr int kKeepAcc = Tr::kMw / 2;
    uint32_t keep_bits[KeepWords<kKeepAcc>()] = {};
    if constexpr (kDropout) {
      BwdKeepBits<kKeepAcc>(keep_bits, MakeDropoutMask(p, b, h), n_begin + 16 * wn + g,
                            m_begin + wd * Tr::kMw, g, tq);
    }

    // S^T = K Q^T and dP^T = V dO^T for keys [16 wn, +16) x queries [m0, +kMw).
    constexpr int kSTiles = Tr::kMw / 8;
    const int m0 = wd * Tr::kMw;
    float acc_s[kSTiles][4], acc_dp[kSTiles][4];
#pragma unroll
    for (int i = 0; i < kSTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[i][e] = acc_dp[i][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a_k[4], a_v[4];
      const int a_off = (wn * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8;
      LdMatrixX4(a_k, s_k + a_off);
      LdMatrixX4(a_v, s_v + a_off);
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        // B operand (k = head dim, n = query) from row-major Q/dO: two n8 tiles.
        const int b_off =
            (m0 + nt * 8 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8;
        uint32_t b_q[4], b_do[4];
        LdMatrixX4(b_q, sq + b_off);
        LdMatrixX4(b_do, sdo + b_off);
        Mma16816<Elem>(acc_s[nt], a_k, {b_q[0], b_q[1]});
        Mma16816<Elem>(acc_s[nt + 1], a_k, {b_q[2], b_q[3]});
        Mma16816<Elem>(acc_dp[nt], a_v, {b_do[0], b_do[1]});
        Mma16816<Elem>(acc_dp[nt + 1], a_v, {b_do[2], b_do[3]});
      }
    }

    // P^T = exp2(S^T * scale_log2 - lse2), dS^T = P^T o (dP^T - Dvec), into smem.
    // The per-element mask only where the block is not fully visible (diagonal
    // and ragged tails); rows past T have lse2 = +inf, hence P = 0.
    if (!kDropout && !HasScoreVariants(p)) {
      const bool full = mask.BlockFullyVisible(m_begin, m_begin + kM, n_begin, n_begin + kN);
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wn * 16 + g + half * 8;  // key row in the block
          const int c = m0 + nt * 8 + 2 * tq;    // query column in the block
          float pv[2], ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = FastExp2(acc_s[nt][2 * half + e] * p.softmax_scale_log2 - slse2[c + e]);
            if (!full && !mask.Allowed(m_begin + c + e, n_begin + r)) x = 0.f;
            pv[e] = x;
            ds[e] = x * (acc_dp[nt][2 * half + e] - sdvec[c + e]);
          }
          *reinterpret_cast<uint32_t*>(s_pt + r * kPStride + c) = PackFloat2<Elem>(pv[0], pv[1]);
          *reinterpret_cast<uint32_t*>(s_dst + r * kPStride + c) = PackFloat2<Elem>(ds[0], ds[1]);
        }
      }
    } else {
      // softcap, ALiBi, segments, dropout: the forward's transform of the scores,
      //   x = scale * S;  x = softcap * tanh(x / softcap);  x -= slope * |q + S - T - key|
      //   P = exp2(x * log2(e) - lse2), 0 where the window or the segments hide the pair
      //   dS = P o (Z o dP / (1 - rate) - Dvec) o (1 - tanh^2)   (the cap's
      //        derivative; dK, dQ get the scale in their epilogues)
      //   P^T for dV += P^T dO is Z o P; dV's 1 / (1 - rate) is in the epilogue.
      // Z is the dropout keep mask (all ones without dropout), from BwdKeepBits.
      // Indices through Opaque: the plain path has no register to spare.
      const int64_t bb = Opaque(static_cast<int>(b));
      const int64_t nb = Opaque(static_cast<int>(n_begin));
      const int64_t mb = Opaque(static_cast<int>(m_begin));
      const float slope = p.alibi_slopes != nullptr
                              ? p.alibi_slopes[bb * p.num_heads_q + Opaque(static_cast<int>(h))]
                              : 0.f;
      const SegmentMask segments = MakeSegmentMask(p, bb);
      const float cap = p.softcap;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wn * 16 + g + half * 8;  // key row in the block
          const int c = m0 + nt * 8 + 2 * tq;    // query column in the block
          const int64_t key = nb + r;
          float pv[2], ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t query = mb + c + e;
            float x = acc_s[nt][2 * half + e] * p.softmax_scale;
            float slope_cap = 1.f;
            if (cap > 0.f) {
              const float th = FastTanh(__fdividef(x, cap));
              x = cap * th;
              slope_cap = 1.f - th * th;
            }
            x -= slope * AlibiDistance(query, key, mask.offset);
            float y = FastExp2(x * 1.4426950408889634f - slse2[c + e]);
            // mask.Allowed first: it rejects keys past S before their ids are
            // read; queries past T have lse2 = +inf (y = 0) and no id.
            if (!mask.Allowed(query, key) ||
                (segments.Active() &&
                 (query >= p.seqlen_q || !segments.Allowed(query, key)))) {
              y = 0.f;
            }
            float dp = acc_dp[nt][2 * half + e];
            bool kept = true;
            if constexpr (kDropout) {
              kept = BwdKept<kKeepAcc>(keep_bits, 4 * nt + 2 * half + e);
              dp = kept ? dp * p.dropout_scale : 0.f;
            }
            pv[e] = kept ? y : 0.f;
            ds[e] = y * (dp - sdvec[c + e]) * slope_cap;
          }
          *reinterpret_cast<uint32_t*>(s_pt + r * kPStride + c) = PackFloat2<Elem>(pv[0], pv[1]);
          *reinterpret_cast<uint32_t*>(s_dst + r * kPStride + c) = PackFloat2<Elem>(ds[0], ds[1]);
        }
      }
    }
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q for keys [16 wn, +16) x dims [d0, +kDw).
    const int d0 = wd * Tr::kDw;
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
      uint32_t a_p[4], a_ds[4];
      const int a_off = (wn * 16 + lane % 16) * kPStride + kk * 16 + (lane / 16) * 8;
      LdMatrixX4(a_p, s_pt + a_off);
      LdMatrixX4(a_ds, s_dst + a_off);
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {
        // B operand (k = query, n = dim) from row-major dO/Q: transposed load.
        const int b_off =
            (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + d0 + dt * 8 + (lane / 16) * 8;
        uint32_t b_do[4], b_q[4];
        LdMatrixX4Trans(b_do, sdo + b_off);
        LdMatrixX4Trans(b_q, sq + b_off);
        Mma16816<Elem>(acc_dv[dt], a_p, {b_do[0], b_do[1]});
        Mma16816<Elem>(acc_dv[dt + 1], a_p, {b_do[2], b_do[3]});
        Mma16816<Elem>(acc_dk[dt], a_ds, {b_q[0], b_q[1]});
        Mma16816<Elem>(acc_dk[dt + 1], a_ds, {b_q[2], b_q[3]});
      }
    }
    if constexpr (Tr::kDoStages == 1) {
      // Every warp is done with dO: the next block's lands under the dQ product.
      __syncthreads();
      if (it + 1 < num_iters) load_single_do(it + 1);
      CpAsyncCommit();
    }

    // dQ (unscaled) += dS K for queries [16 wq_m, +16) x dims [dq0, +kDqPassDw):
    // pass `pass` of the kDqPasses over the warp's kDqDw dims.
    auto dq_pass = [&](int pass) {
      constexpr int kQTiles = Tr::kDqPassDw / 8;
      const int wq_m = warp % Tr::kDqWarpsM, wq_d = warp / Tr::kDqWarpsM;
      const int dq0 = wq_d * Tr::kDqDw + pass * Tr::kDqPassDw;
      float acc_dq[kQTiles][4];
#pragma unroll
      for (int i = 0; i < kQTiles; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[i][e] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        // A operand (m = query, k = key) from dS^T stored [key][query]: transposed load.
        uint32_t a_ds[4];
        LdMatrixX4Trans(a_ds, s_dst + (kk * 16 + lane % 8 + (lane / 16) * 8) * kPStride +
                                  wq_m * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int dt = 0; dt < kQTiles; dt += 2) {
          uint32_t b_k[4];
          LdMatrixX4Trans(b_k, s_k + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dq0 +
                                   dt * 8 + (lane / 16) * 8);
          Mma16816<Elem>(acc_dq[dt], a_ds, {b_k[0], b_k[1]});
          Mma16816<Elem>(acc_dq[dt + 1], a_ds, {b_k[2], b_k[3]});
        }
      }
      // Accumulate into dq_acc [B, T, H, D]; each (row, column pair) once per CTA.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t t = m_begin + wq_m * 16 + g + half * 8;
        if (t >= seqlen_q) continue;
        float* dst = dq_acc + ((b * seqlen_q + t) * p.num_heads_q + h) * head_dim;
#pragma unroll
        for (int dt = 0; dt < kQTiles; ++dt) {
          const int d = dq0 + dt * 8 + 2 * tq;  // even, and head_dim % 8 == 0: d + 1 valid too
          if (d >= head_dim) continue;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(dst + d),
                    make_float2(acc_dq[dt][2 * half], acc_dq[dt][2 * half + 1]));
#else
          atomicAdd(dst + d, acc_dq[dt][2 * half]);
          atomicAdd(dst + d + 1, acc_dq[dt][2 * half + 1]);
#endif
        }
      }
    };
    if constexpr (Tr::kDqPasses == 1) {
      dq_pass(0);
    } else {
#pragma unroll
      for (int pass = 0; pass < Tr::kDqPasses; ++pass) dq_pass(pass);
    }
  }

  CpAsyncWait<0>();  // no copy may still target shared memory at exit (num_iters == 0)

  // Epilogue: dK = scale * acc_dk, dV = acc_dv, into [B, S, K, D] (dk, dv share
  // k's strides). Keys no query sees get zeros here (num_iters == 0).
  const int d0 = wd * Tr::kDw;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t n = n_begin + wn * 16 + g + half * 8;
    if (n >= seqlen_k) continue;
    const int64_t off = b * p.k_batch_stride + n * p.k_row_stride + kvh * p.k_head_stride;
    Elem* dk = static_cast<Elem*>(p.dk) + off;
    Elem* dv = static_cast<Elem*>(p.dv) + off;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int d = d0 + dt * 8 + 2 * tq;
      if (d >= head_dim) continue;
      *reinterpret_cast<uint32_t*>(dk + d) = PackFloat2<Elem>(
          acc_dk[dt][2 * half] * p.softmax_scale, acc_dk[dt][2 * half + 1] * p.softmax_scale);
      // dV = (Z o P)^T dO / (1 - rate) with dropout.
      const float dv_scale = kDropout ? p.dropout_scale : 1.f;
      *reinterpret_cast<uint32_t*>(dv + d) =
          PackFloat2<Elem>(acc_dv[dt][2 * half] * dv_scale, acc_dv[dt][2 * half + 1] * dv_scale);
    }
  }
}

// One key block per CTA (grid.x = key blocks), or, deterministic, key blocks
// blockIdx.x, + gridDim.x, ... in order into dQ slice blockIdx.x.
template <typename Elem, typename Tr, bool kDropout>
__device__ __forceinline__ void BwdMainLoop(const FlashParams& p, const BwdScratchPtrs& s) {
  const int64_t num_n_blocks = (p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  float* dq_acc = s.dq_acc + blockIdx.x * s.dq_slice_stride;
  for (int64_t n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    if (n_block != blockIdx.x) __syncthreads();  // every warp is done with the last K, V, dS
    BwdMainBody<Elem, Tr, kDropout>(p, s, n_block, dq_acc);
  }
}

template <typename Elem, typename Tr, bool kDropout>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    BwdMainKernel(const FlashParams p, const BwdScratchPtrs s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // The large-smem tiles need more than the 163 KB that pre-sm90 parts offer,
  // so LaunchBwdMain never picks them there: compile no body for them.
  if constexpr (!Tr::kLargeSmem) BwdMainLoop<Elem, Tr, kDropout>(p, s);
#else
  BwdMainLoop<Elem, Tr, kDropout>(p, s);
#endif
}

template <typename Elem, typename Tr>
cudaError_t LaunchBwdMainTiles(const FlashParams& p, const BwdScratchPtrs& s,
                               cudaStream_t stream) {
  constexpr int kSmem = Tr::kSmemBytes;
  const bool dropout = p.dropout_seeds != nullptr;
  auto kernel = dropout ? BwdMainKernel<Elem, Tr, true> : BwdMainKernel<Elem, Tr, false>;
  if (kSmem > 48 * 1024) {
    static std::atomic<uint64_t> opted_in[2] = {0, 0};  // [dropout]
    const cudaError_t err = OptInSharedMemoryOnce(reinterpret_cast<const void*>(kernel),
                                                  opted_in[dropout], kSmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t num_n_blocks = (p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int64_t columns =
      p.deterministic ? std::min<int64_t>(s.dq_splits, num_n_blocks) : num_n_blocks;
  const dim3 grid(static_cast<unsigned>(columns), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.num_heads_kv));
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(p, s);
  return cudaGetLastError();
}

// LaunchBwdMainTiles with the tile of kRow; invalid where the bucket has no
// row in that table (nothing compiled for it).
template <typename Elem, int kHeadDim, BwdTileRow kRow>
cudaError_t LaunchBwdMainRow(const FlashParams& p, const BwdScratchPtrs& s, cudaStream_t stream) {
  if constexpr (BwdTileOfRow(kHeadDim, kRow).head_dim == kHeadDim) {
    return LaunchBwdMainTiles<Elem, BwdTraits<kHeadDim, kRow>>(p, s, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

// Launches BwdMainKernel for one (dtype, head-dim bucket) with the tile of
// `row` (the plan's choice for the device, plan.h ChooseSm80BwdTile); only the
// rows a bucket has are compiled. Instantiated in bwd_hdim*.cu so the buckets
// compile in parallel.
template <typename Elem, int kHeadDim>
cudaError_t LaunchBwdMain(const FlashParams& p, const BwdScratchPtrs& s, BwdTileRow row,
                          cudaStream_t stream) {
  switch (row) {
    case BwdTileRow::kDefault:
      return LaunchBwdMainRow<Elem, kHeadDim, BwdTileRow::kDefault>(p, s, stream);
    case BwdTileRow::kLargeSmem:
      return LaunchBwdMainRow<Elem, kHeadDim, BwdTileRow::kLargeSmem>(p, s, stream);
    case BwdTileRow::kSmallSmem:
      return LaunchBwdMainRow<Elem, kHeadDim, BwdTileRow::kSmallSmem>(p, s, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash2::cuda
