// CPU FlashAttention-2 kernels: the GPU algorithm on float32 tiles.
//
// Compiled once per instruction set with JF2_CPU_ISA naming the namespace
// (avx512, avx2, baseline) and the matching -m flags; GCC vector extensions
// give register-blocked micro-kernels without intrinsics, so one source serves
// every ISA. Forward: Q rows outer, K/V blocks inner, online softmax with O
// unscaled until the end, LSE only. Backward: K/V blocks outer, P recomputed
// from the LSE.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../flash_dropout.h"
#include "../flash_mask.h"
#include "../online_softmax.h"
#include "convert.h"
#include "cpu_kernels.h"

#ifndef JF2_CPU_ISA
#error "JF2_CPU_ISA must name the instruction-set namespace"
#endif
#define JF2_STRINGIFY_IMPL(x) #x
#define JF2_STRINGIFY(x) JF2_STRINGIFY_IMPL(x)

namespace jax_flash2::cpu::JF2_CPU_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVecsPerChunk = 4;  // 4 rows x 4 zmm = 16 of 32 registers
#elif defined(__AVX2__)
constexpr int kLanes = 8;
constexpr int kVecsPerChunk = 2;  // 4 rows x 2 ymm = 8 of 16 registers
#else
constexpr int kLanes = 4;
constexpr int kVecsPerChunk = 2;
#endif
constexpr int kRows = 4;  // rows of C per micro-kernel
constexpr int64_t kChunk = kLanes * kVecsPerChunk;
static_assert(kDimPad % kLanes == 0, "padded dims must hold whole vectors");

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline float Exp2Scalar(float x) { return std::exp2(x); }

// max(a, b) that returns NaN when either is NaN. std::max(-inf, NaN) is -inf,
// which would make a row whose scores are NaN look like a row that sees no key
// (out 0, LSE -inf): the NaN must reach out and LSE instead.
inline float MaxOrNaN(float a, float b) { return (b > a || b != b) ? b : a; }

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec Splat(float x) { return Vec{} + x; }

// 2^x for x <= 0 (up to rounding), relative error ~2e-7; exactly 0 below 2^-126
// so that masked (-inf) scores give P = 0 without a separate pass.
inline Vec Exp2(Vec x) {
  const Vec lo = Splat(-126.0f);
  Vec xc = x < lo ? lo : x;
  xc = xc > Splat(126.0f) ? Splat(126.0f) : xc;
  // Round to nearest by the 1.5 * 2^23 trick: vectorizes on every ISA.
  const Vec magic = Splat(12582912.0f);
  const Vec r = (xc + magic) - magic;
  const Vec f = xc - r;  // in [-0.5, 0.5]
  Vec p = Splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  IVec bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += __builtin_convertvector(r, IVec) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return x < lo ? Splat(0.0f) : p;
}

// C[kRows x kVecs*kLanes] += A[kRows x depth] * B[depth x kVecs*kLanes], with A
// addressed by strides (a_row, a_k) so that transposed operands need no copy.
template <int kVecs>
inline void MicroKernel(float* c, int64_t ldc, const float* a, int64_t a_row, int64_t a_k,
                        const float* b, int64_t ldb, int64_t depth) {
  Vec acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = Load(c + r * ldc + v * kLanes);
  for (int64_t k = 0; k < depth; ++k) {
    Vec bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = Load(b + k * ldb + v * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Vec ar = Splat(a[r * a_row + k * a_k]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ar * bv[v];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
}

// C[m x n] += A[m x depth] B[depth x n]; m a multiple of kRows, n of kLanes.
void Gemm(float* c, int64_t ldc, const float* a, int64_t a_row, int64_t a_k, const float* b,
          int64_t ldb, int64_t m, int64_t n, int64_t depth) {
  for (int64_t i = 0; i < m; i += kRows) {
    float* c_rows = c + i * ldc;
    const float* a_rows = a + i * a_row;
    int64_t j = 0;
    for (; j + kChunk <= n; j += kChunk) {
      MicroKernel<kVecsPerChunk>(c_rows + j, ldc, a_rows, a_row, a_k, b + j, ldb, depth);
    }
    for (; j < n; j += kLanes) MicroKernel<1>(c_rows + j, ldc, a_rows, a_row, a_k, b + j, ldb, depth);
  }
}

inline int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Philox bytes of keys n0 .. n0 + kBlockN - 1 of query row i (words[j]: key
// n0 + j's byte; kept iff >= the threshold), flash_dropout.h's mask with the
// block's kBlockN / 16 calls in the lanes of one vector. n0 is a multiple of
// kBlockN, so of 16: the tile covers whole calls. The callers then select
// without branches.
constexpr int kCallsPerBlock = kBlockN / 16;
static_assert(kBlockN % 16 == 0, "whole Philox calls per block");
typedef uint32_t CallVec __attribute__((vector_size(kCallsPerBlock * sizeof(uint32_t))));
typedef uint64_t CallVec64 __attribute__((vector_size(kCallsPerBlock * sizeof(uint64_t))));
struct MulHiLoCalls {
  void operator()(CallVec a, uint32_t b, CallVec* hi, CallVec* lo) const {
    const CallVec64 product = __builtin_convertvector(a, CallVec64) * static_cast<uint64_t>(b);
    *hi = __builtin_convertvector(product >> 32, CallVec);
    *lo = __builtin_convertvector(product, CallVec);
  }
};
void DropoutWords(const DropoutMask& dropout, int64_t i, int64_t n0, uint32_t* words) {
  CallVec c[4];
  for (int l = 0; l < kCallsPerBlock; ++l) c[0][l] = static_cast<uint32_t>((n0 >> 4) + l);
  c[1] = CallVec{} + static_cast<uint32_t>(i);
  c[2] = CallVec{};
  c[3] = CallVec{};
  PhiloxRounds(c, dropout.seed_lo, dropout.seed_hi, MulHiLoCalls{});
  for (int l = 0; l < kCallsPerBlock; ++l)
    for (int k = 0; k < 16; ++k)
      words[16 * l + k] = (c[KeyWord(k)][l] >> (8 * KeyByte(k))) & 0xFFu;
}

// S <- softcap * tanh(S / softcap) * out_scale for the first `rows` rows of a
// [kBlockM, kBlockN] tile (S already times the softmax scale); the derivative
// 1 - tanh^2 goes to `slope` when the backward needs it.
void ApplySoftcap(float* s, int64_t rows, float softcap, float out_scale, float* slope) {
  const float inv = 1.0f / softcap;
  for (int64_t i = 0; i < rows * kBlockN; ++i) {
    const float t = std::tanh(s[i] * inv);
    s[i] = softcap * t * out_scale;
    if (slope != nullptr) slope[i] = 1.0f - t * t;
  }
}

// rows x D elements of a [.., rows, .., D] tensor into a zero-padded
// [kBlockM x dp] float tile, times `scale`.
void LoadTile(const void* base, DType dtype, int64_t offset, int64_t row_stride, int64_t rows,
              int64_t d, int64_t dp, float scale, float* tile) {
  std::fill(tile, tile + kBlockM * dp, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = tile + r * dp;
    LoadRow(base, dtype, offset + r * row_stride, d, row);
    if (scale != 1.0f)
      for (int64_t c = 0; c < d; ++c) row[c] *= scale;
  }
}

// The same rows transposed into [dp x kBlockN] (columns = rows of the tensor).
void LoadTileTransposed(const void* base, DType dtype, int64_t offset, int64_t row_stride,
                        int64_t rows, int64_t d, int64_t dp, float* row_buffer, float* tile) {
  std::fill(tile, tile + dp * kBlockN, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    LoadRow(base, dtype, offset + r * row_stride, d, row_buffer);
    for (int64_t c = 0; c < d; ++c) tile[c * kBlockN + r] = row_buffer[c];
  }
}

// Keys [n0, n0 + keys) of (b, kv_head) of a KV cache as K^T [dp x kBlockN]
// and V [kBlockN x dp] tiles, row by row (through the block table when the
// cache is paged; a page id outside the pool reads as zero rows), a
// quantized cache dequantized with its scales.
void LoadKvCacheTiles(const FlashParams& p, int64_t b, int64_t kv_head, int64_t n0,
                      int64_t keys, int64_t d, int64_t dp, float* row_buffer, float* kt,
                      float* v) {
  std::fill(kt, kt + dp * kBlockN, 0.0f);
  std::fill(v, v + kBlockN * dp, 0.0f);
  for (int64_t r = 0; r < keys; ++r) {
    int64_t row;
    const int64_t page = KvBlockOf(p, b, n0 + r, &row);
    if (page < 0) continue;
    LoadKvRow(p.k, p.dtype, p.kv_quant,
              page * p.k_batch_stride + row * p.k_row_stride + kv_head * p.k_head_stride, d,
              KvScale(p, b, 0, n0 + r, kv_head), row_buffer);
    for (int64_t c = 0; c < d; ++c) kt[c * kBlockN + r] = row_buffer[c];
    LoadKvRow(p.v, p.dtype, p.kv_quant,
              page * p.v_batch_stride + row * p.v_row_stride + kv_head * p.v_head_stride, d,
              KvScale(p, b, 1, n0 + r, kv_head), v + r * dp);
  }
}

void ForwardBlock(const FlashParams& p, float* ws, int64_t b, int64_t h, int64_t m_block) {
  const int64_t d = p.head_dim;
  const int64_t dp = PaddedHeadDim(d);
  const int64_t m0 = m_block * kBlockM;
  const int64_t rows = std::min(kBlockM, p.seqlen_q - m0);
  const int64_t m_rows = RoundUp(rows, kRows);
  const int64_t kv_head = h / p.group_size;
  // Per sequence: a KV cache's lengths move the diagonal and the end of the keys.
  const WindowMask mask = MakeWindowMask(p, b);
  const SegmentMask segments = MakeSegmentMask(p, b);
  // ALiBi slope in log2 units, the units S is kept in here (0 when off).
  const bool has_alibi = p.alibi_slopes != nullptr;
  const float alibi_log2 = has_alibi ? p.alibi_slopes[b * p.num_heads_q + h] * kLog2e : 0.0f;
  // Dropout zeroes entries of P after the row sum (the LSE is of the undropped
  // softmax); the 1 / (1 - rate) goes into the final division.
  const bool has_dropout = p.dropout_seeds != nullptr;
  const DropoutMask dropout = has_dropout ? MakeDropoutMask(p, b, h) : DropoutMask{};

  float* q = ws;                   // [kBlockM, dp], pre-scaled by scale * log2(e)
  float* o = q + kBlockM * dp;     // [kBlockM, dp], unscaled until the end
  float* kt = o + kBlockM * dp;    // [dp, kBlockN]
  float* v = kt + dp * kBlockN;    // [kBlockN, dp]
  float* s = v + kBlockN * dp;     // [kBlockM, kBlockN]: S, then P
  float* row_max = s + kBlockM * kBlockN;  // running max of S (log2 units)
  float* row_sum = row_max + kBlockM;      // running sum of P
  float* row_buffer = row_sum + kBlockM;   // [dp]

  // With softcap, S is capped in natural units, then moved to log2 units.
  const bool capped = p.softcap > 0.0f;
  const int64_t q_offset = b * p.q_batch_stride + m0 * p.q_row_stride + h * p.q_head_stride;
  LoadTile(p.q, p.dtype, q_offset, p.q_row_stride, rows, d, dp,
           capped ? p.softmax_scale : p.softmax_scale_log2, q);
  std::fill(o, o + kBlockM * dp, 0.0f);
  std::fill(row_max, row_max + kBlockM, kNegInf);
  std::fill(row_sum, row_sum + kBlockM, 0.0f);

  int64_t n_begin, n_end;
  mask.KeyRange(m0, m0 + rows, &n_begin, &n_end);
  for (int64_t n0 = n_begin / kBlockN * kBlockN; n0 < n_end; n0 += kBlockN) {
    // Keys past the sequence's end (mask.seqlen_k) are never read.
    const int64_t keys = std::min(kBlockN, mask.seqlen_k - n0);
    // No query of this block shares a segment with a key of it: P = 0, skip.
    if (!segments.BlockMayMatch(m0, m0 + rows, n0, n0 + keys)) continue;
    if (p.block_table != nullptr || p.kv_quant != KvQuant::kNone) {
      LoadKvCacheTiles(p, b, kv_head, n0, keys, d, dp, row_buffer, kt, v);
    } else {
      const int64_t k_offset =
          b * p.k_batch_stride + n0 * p.k_row_stride + kv_head * p.k_head_stride;
      const int64_t v_offset =
          b * p.v_batch_stride + n0 * p.v_row_stride + kv_head * p.v_head_stride;
      LoadTileTransposed(p.k, p.dtype, k_offset, p.k_row_stride, keys, d, dp, row_buffer, kt);
      LoadTile(p.v, p.dtype, v_offset, p.v_row_stride, keys, d, dp, 1.0f, v);
    }

    // S = (Q * scale * log2 e) K^T
    std::fill(s, s + kBlockM * kBlockN, 0.0f);
    Gemm(s, kBlockN, q, dp, 1, kt, kBlockN, m_rows, kBlockN, dp);
    if (capped) ApplySoftcap(s, rows, p.softcap, kLog2e, nullptr);
    // S -= slope * |i + S - T - j| (log2 units), after the cap as in FlashAttention-2.
    if (has_alibi) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < kBlockN; ++j)
          s[r * kBlockN + j] -= alibi_log2 * AlibiDistance(m0 + r, n0 + j, mask.offset);
    }
    if (segments.Active() || !mask.BlockFullyVisible(m0, m0 + rows, n0, n0 + kBlockN)) {
      // mask.Allowed first: it rejects the keys past S before the ids are read.
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < kBlockN; ++j)
          if (!mask.Allowed(m0 + r, n0 + j) ||
              (segments.Active() && !segments.Allowed(m0 + r, n0 + j)))
            s[r * kBlockN + j] = kNegInf;
    }

    // Online softmax: rescale the running O and sum by 2^(m_old - m_new).
    for (int64_t r = 0; r < rows; ++r) {
      float* s_row = s + r * kBlockN;
      float block_max = kNegInf;
      for (int64_t j = 0; j < kBlockN; ++j) block_max = MaxOrNaN(block_max, s_row[j]);
      const float new_max = MaxOrNaN(row_max[r], block_max);
      if (new_max == kNegInf) {  // nothing visible yet: P = 0, avoid -inf - -inf
        std::fill(s_row, s_row + kBlockN, 0.0f);
        continue;
      }
      if (new_max != new_max) {
        // A NaN score: the row's O, sum and max become NaN (and stay NaN) so
        // that out and LSE are NaN. Not through Exp2, whose range reduction
        // converts NaN to an integer.
        std::fill(s_row, s_row + kBlockN, kNaN);
        row_sum[r] = kNaN;
        row_max[r] = kNaN;
        continue;
      }
      // Scores are pre-scaled into log2 units here: scale 1.
      const float alpha = RescaleFactor(row_max[r], new_max, 1.0f, Exp2Scalar);
      Vec sum = Splat(0.0f);
      for (int64_t j = 0; j < kBlockN; j += kLanes) {
        const Vec pv = Exp2(Load(s_row + j) - new_max);
        Store(s_row + j, pv);
        sum += pv;
      }
      float block_sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) block_sum += sum[l];
      row_sum[r] = row_sum[r] * alpha + block_sum;
      row_max[r] = new_max;
      if (alpha != 1.0f) {
        float* o_row = o + r * dp;
        for (int64_t c = 0; c < dp; ++c) o_row[c] *= alpha;
      }
      if (has_dropout) {  // P <- Z o P
        uint32_t words[kBlockN];
        DropoutWords(dropout, m0 + r, n0, words);
        for (int64_t j = 0; j < kBlockN; ++j)
          s_row[j] = words[j] >= dropout.threshold ? s_row[j] : 0.0f;
      }
    }
    // O += (Z o P) V, Z the keep mask (all ones without dropout)
    Gemm(o, dp, s, kBlockN, 1, v, dp, m_rows, dp, keys);
  }

  // O *= 1 / (l (1 - rate)) once; LSE = m ln 2 + ln l. A row that saw no key
  // keeps O = 0, LSE = -inf; a row with a NaN score has l = NaN: out, LSE NaN.
  const int64_t o_offset = b * p.o_batch_stride + m0 * p.o_row_stride + h * p.o_head_stride;
  float* lse = p.lse + (b * p.num_heads_q + h) * p.seqlen_q + m0;
  for (int64_t r = 0; r < rows; ++r) {
    float* o_row = o + r * dp;
    const float l = row_sum[r];
    const float inv = RowNormalizer(l, p.dropout_scale, IeeeDivide{});
    for (int64_t c = 0; c < d; ++c) o_row[c] *= inv;
    lse[r] = RowLse(row_max[r] * kLn2, l, IeeeLog{});
    StoreRow(o_row, d, p.o, p.dtype, o_offset + r * p.o_row_stride);
  }
}

void BackwardBlocks(const FlashParams& p, float* ws, const float* dvec, float* dq_accum, int64_t b,
                    int64_t kv_head, int64_t n_block_begin, int64_t n_block_end) {
  const int64_t d = p.head_dim;
  const int64_t dp = PaddedHeadDim(d);
  const WindowMask mask = MakeWindowMask(p);
  const SegmentMask segments = MakeSegmentMask(p, b);
  const bool capped = p.softcap > 0.0f;
  // P = exp2(S' * multiplier - LSE * log2 e), S' the (capped) scaled scores.
  const float exp_multiplier = capped ? kLog2e : p.softmax_scale_log2;
  const bool has_alibi = p.alibi_slopes != nullptr;
  const bool has_dropout = p.dropout_seeds != nullptr;

  float* kmat = ws;                  // [kBlockN, dp]
  float* kt = kmat + kBlockN * dp;   // [dp, kBlockN]
  float* vt = kt + dp * kBlockN;     // [dp, kBlockN]
  float* dk = vt + dp * kBlockN;     // [kBlockN, dp]
  float* dv = dk + kBlockN * dp;     // [kBlockN, dp]
  float* q = dv + kBlockN * dp;      // [kBlockM, dp]
  float* d_o = q + kBlockM * dp;     // [kBlockM, dp]
  float* dq = d_o + kBlockM * dp;    // [kBlockM, dp]
  float* pm = dq + kBlockM * dp;     // [kBlockM, kBlockN]: P
  float* ds = pm + kBlockM * kBlockN;  // [kBlockM, kBlockN]: dP, then dS
  float* slope = ds + kBlockM * kBlockN;   // d softcap(S) / dS, when capped
  float* lse2 = slope + kBlockM * kBlockN;  // LSE in log2 units
  float* row_d = lse2 + kBlockM;
  float* row_buffer = row_d + kBlockM;

  for (int64_t nb = n_block_begin; nb < n_block_end; ++nb) {
    const int64_t n0 = nb * kBlockN;
    const int64_t keys = std::min(kBlockN, p.seqlen_k - n0);
    const int64_t k_offset = b * p.k_batch_stride + n0 * p.k_row_stride + kv_head * p.k_head_stride;
    const int64_t v_offset = b * p.v_batch_stride + n0 * p.v_row_stride + kv_head * p.v_head_stride;
    LoadTile(p.k, p.dtype, k_offset, p.k_row_stride, keys, d, dp, 1.0f, kmat);
    for (int64_t j = 0; j < kBlockN; ++j)
      for (int64_t c = 0; c < dp; ++c) kt[c * kBlockN + j] = kmat[j * dp + c];
    LoadTileTransposed(p.v, p.dtype, v_offset, p.v_row_stride, keys, d, dp, row_buffer, vt);
    std::fill(dk, dk + kBlockN * dp, 0.0f);
    std::fill(dv, dv + kBlockN * dp, 0.0f);

    int64_t q_begin, q_end;
    mask.QueryRange(n0, n0 + keys, p.seqlen_q, &q_begin, &q_end);
    for (int64_t h = kv_head * p.group_size; h < (kv_head + 1) * p.group_size; ++h) {
      // ALiBi slope in the units of S' before the multiplier: the bias is
      // slope * distance in natural units, and S' * multiplier is in log2 units.
      const float alibi_pre =
          has_alibi ? p.alibi_slopes[b * p.num_heads_q + h] * kLog2e / exp_multiplier : 0.0f;
      const DropoutMask dropout = has_dropout ? MakeDropoutMask(p, b, h) : DropoutMask{};
      for (int64_t m0 = q_begin / kBlockM * kBlockM; m0 < q_end; m0 += kBlockM) {
        const int64_t rows = std::min(kBlockM, p.seqlen_q - m0);
        // No shared segment between these queries and keys: P = 0, nothing to add.
        if (!segments.BlockMayMatch(m0, m0 + rows, n0, n0 + keys)) continue;
        const int64_t m_rows = RoundUp(rows, kRows);
        const int64_t q_offset = b * p.q_batch_stride + m0 * p.q_row_stride + h * p.q_head_stride;
        const int64_t o_offset = b * p.o_batch_stride + m0 * p.o_row_stride + h * p.o_head_stride;
        LoadTile(p.q, p.dtype, q_offset, p.q_row_stride, rows, d, dp, 1.0f, q);
        LoadTile(p.d_o, p.dtype, o_offset, p.o_row_stride, rows, d, dp, 1.0f, d_o);
        const int64_t stat_offset = (b * p.num_heads_q + h) * p.seqlen_q + m0;
        for (int64_t r = 0; r < rows; ++r) {
          lse2[r] = p.lse[stat_offset + r] * kLog2e;
          row_d[r] = dvec[stat_offset + r];
        }

        // P = exp2(S * scale * log2 e - LSE * log2 e), 0 where masked.
        std::fill(pm, pm + kBlockM * kBlockN, 0.0f);
        Gemm(pm, kBlockN, q, dp, 1, kt, kBlockN, m_rows, kBlockN, dp);
        if (capped) {
          for (int64_t i = 0; i < rows * kBlockN; ++i) pm[i] *= p.softmax_scale;
          ApplySoftcap(pm, rows, p.softcap, 1.0f, slope);
        }
        const bool fully_visible =
            !segments.Active() && mask.BlockFullyVisible(m0, m0 + rows, n0, n0 + kBlockN);
        for (int64_t r = 0; r < kBlockM; ++r) {
          float* p_row = pm + r * kBlockN;
          // A row that saw no key has LSE = -inf and P = 0 (not exp(+inf)).
          if (r >= rows || lse2[r] == kNegInf) {
            std::fill(p_row, p_row + kBlockN, 0.0f);
            continue;
          }
          if (has_alibi) {  // the forward's bias, after the cap
            for (int64_t j = 0; j < kBlockN; ++j)
              p_row[j] -= alibi_pre * AlibiDistance(m0 + r, n0 + j, mask.offset);
          }
          if (!fully_visible) {
            // mask.Allowed first: it rejects the keys past S before the ids are read.
            for (int64_t j = 0; j < kBlockN; ++j)
              if (!mask.Allowed(m0 + r, n0 + j) ||
                  (segments.Active() && !segments.Allowed(m0 + r, n0 + j)))
                p_row[j] = kNegInf;
          }
          if (lse2[r] != lse2[r]) {
            // The forward saw a NaN score in this row: P is NaN where visible
            // (0 where masked, as in the reference), so dQ, dK, dV carry it.
            for (int64_t j = 0; j < kBlockN; ++j) p_row[j] = p_row[j] == kNegInf ? 0.0f : kNaN;
            continue;
          }
          for (int64_t j = 0; j < kBlockN; j += kLanes)
            Store(p_row + j, Exp2(Load(p_row + j) * exp_multiplier - lse2[r]));
        }

        // dP' = dO V^T, the cotangent of the dropped, rescaled P' = Z o P / (1 - rate).
        std::fill(ds, ds + kBlockM * kBlockN, 0.0f);
        Gemm(ds, kBlockN, d_o, dp, 1, vt, kBlockN, m_rows, kBlockN, dp);
        for (int64_t r = 0; r < rows; ++r) {
          float* ds_row = ds + r * kBlockN;
          float* p_row = pm + r * kBlockN;
          if (has_dropout) {
            // dS = P (Z o dP' / (1 - rate) - D); P becomes Z o P for dV, whose
            // 1 / (1 - rate) is applied once at the end.
            uint32_t words[kBlockN];
            DropoutWords(dropout, m0 + r, n0, words);
            for (int64_t j = 0; j < kBlockN; ++j) {
              const bool kept = words[j] >= dropout.threshold;
              ds_row[j] = p_row[j] * ((kept ? ds_row[j] * p.dropout_scale : 0.0f) - row_d[r]);
              p_row[j] = kept ? p_row[j] : 0.0f;
            }
          } else {
            // dS = P (dP - D)
            for (int64_t j = 0; j < kBlockN; ++j) ds_row[j] = p_row[j] * (ds_row[j] - row_d[r]);
          }
          if (capped) {  // chain rule through the cap
            const float* slope_row = slope + r * kBlockN;
            for (int64_t j = 0; j < kBlockN; ++j) ds_row[j] *= slope_row[j];
          }
        }
        for (int64_t r = rows; r < kBlockM; ++r) std::fill(ds + r * kBlockN, ds + (r + 1) * kBlockN, 0.0f);
        // dV += (Z o P)^T dO
        Gemm(dv, dp, pm, 1, kBlockN, d_o, dp, kBlockN, dp, rows);
        // dK += dS^T Q (scaled once at the end)
        Gemm(dk, dp, ds, 1, kBlockN, q, dp, kBlockN, dp, rows);
        // dQ += dS K, added into the float32 accumulator of this chunk.
        std::fill(dq, dq + kBlockM * dp, 0.0f);
        Gemm(dq, dp, ds, kBlockN, 1, kmat, dp, m_rows, dp, keys);
        for (int64_t r = 0; r < rows; ++r) {
          float* acc = dq_accum + ((b * p.seqlen_q + m0 + r) * p.num_heads_q + h) * d;
          const float* dq_row = dq + r * dp;
          for (int64_t c = 0; c < d; ++c) acc[c] += dq_row[c];
        }
      }
    }

    for (int64_t j = 0; j < keys; ++j) {
      float* dk_row = dk + j * dp;
      for (int64_t c = 0; c < d; ++c) dk_row[c] *= p.softmax_scale;
      StoreRow(dk_row, d, p.dk, p.dtype, k_offset + j * p.k_row_stride);
      float* dv_row = dv + j * dp;
      if (has_dropout)
        for (int64_t c = 0; c < d; ++c) dv_row[c] *= p.dropout_scale;
      StoreRow(dv_row, d, p.dv, p.dtype, v_offset + j * p.v_row_stride);
    }
  }
}

}  // namespace

const KernelTable kTable = {&ForwardBlock, &BackwardBlocks, JF2_STRINGIFY(JF2_CPU_ISA)};

}  // namespace jax_flash2::cpu::JF2_CPU_ISA
