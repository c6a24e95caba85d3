// Helpers shared by the standalone CUDA self-tests (not part of the package).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "src/flash_dropout.h"
#include "src/flash_mask.h"
#include "src/flash_params.h"

// A self-test stops at the first failed CUDA call: its output is the report.
#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__,   \
                  __LINE__, #x);                                                        \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace jax_flash2::selftest {

// Waits for the default stream's work, polling, so that a hung kernel (an
// mbarrier wait that never completes) is reported as HANG instead of
// blocking forever; the process then exits, since the context cannot recover.
inline cudaError_t SyncWithWatchdog(const std::string& what, double hang_seconds = 20.0) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t err = cudaStreamQuery(0);
    if (err != cudaErrorNotReady) return err;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s > hang_seconds) {
      std::printf("HANG %s: kernel still running after %.0f s (mbarrier wait never completed?)\n",
                  what.c_str(), s);
      std::fflush(stdout);
      std::_Exit(2);  // don't run destructors on a dead context
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Milliseconds of `reps` calls run(r), r = 0..reps-1, sorted ascending (the
// median is [reps / 2]), after three warm-up calls run(0..2); each timed call
// is bracketed by events on the default stream and waited for with the
// watchdog. run returns a cudaError_t.
template <class Run>
std::vector<float> TimeRuns(const std::string& what, int reps, Run run) {
  for (int i = 0; i < 3; ++i) CHECK_CUDA(run(i));
  CHECK_CUDA(SyncWithWatchdog(what + " (warm-up)"));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(run(r));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(SyncWithWatchdog(what));
    CHECK_CUDA(cudaEventElapsedTime(&ms[r], e0, e1));
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms;
}

// The same with `batch` calls back to back between each pair of events
// (milliseconds per call): the GPU never waits for the host to launch, so a
// call of a few microseconds is not timed with its launch latency.
template <class Run>
std::vector<float> TimeRunsBatched(const std::string& what, int reps, int batch, Run run) {
  int r = 0;
  const std::vector<float> ms = TimeRuns(what, reps, [&](int) {
    cudaError_t err = cudaSuccess;
    for (int i = 0; i < batch && err == cudaSuccess; ++i) err = run(r++);
    return err;
  });
  std::vector<float> per_call(ms.size());
  for (size_t i = 0; i < ms.size(); ++i) per_call[i] = ms[i] / batch;
  return per_call;
}

// Fills n 16-bit elements (bf16 or fp16 bits) with hashed pseudo-random
// values in [-amplitude, amplitude).
static __global__ void FillRandom(uint16_t* x, int64_t n, uint32_t seed, bool bf16,
                                  float amplitude) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float u = ((h & 0xFFFFFF) / float(1 << 24) * 2.f - 1.f) * amplitude;
    if (bf16) {
      __nv_bfloat16 v = __float2bfloat16_rn(u);
      x[i] = *reinterpret_cast<uint16_t*>(&v);
    } else {
      __half v = __float2half_rn(u);
      x[i] = *reinterpret_cast<uint16_t*>(&v);
    }
  }
}

// Backward timings: the LSE of a row that sees `visible` keys of scores ~ 0
// is log(visible), so that P has realistic magnitudes (~1 / visible); dLSE
// small and nonzero.
static __global__ void FillLse(float* lse, float* d_lse, int64_t rows, int64_t T, int64_t S,
                               bool causal) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i % T;
    const int64_t causal_visible = t + 1 + S - T;
    const int64_t visible = causal && causal_visible < S ? causal_visible : S;
    lse[i] = logf(static_cast<float>(visible > 0 ? visible : 1));
    d_lse[i] = 1e-3f * static_cast<float>((i * 37) % 17 - 8);
  }
}

// Device buffers for timing the backward of p (sizes, strides and window set;
// bf16): random q, k, v, o, dO in [-2, 2), the dq, dk, dv outputs, and the LSE
// and dLSE of FillLse; sets p's pointers. cudaFree each returned pointer.
inline std::vector<void*> AllocBackwardTimingBuffers(FlashParams* p) {
  const int64_t nq = p->batch * p->seqlen_q * p->num_heads_q * p->head_dim;
  const int64_t nk = p->batch * p->seqlen_k * p->num_heads_kv * p->head_dim;
  const int64_t rows = p->batch * p->num_heads_q * p->seqlen_q;
  const int64_t sizes[] = {nq, nk, nk, nq, nq, nq, nk, nk};  // q k v o dO dq dk dv
  std::vector<void*> bufs;
  for (int i = 0; i < 8; ++i) {
    void* ptr;
    CHECK_CUDA(cudaMalloc(&ptr, sizes[i] * 2));
    FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(ptr), sizes[i], 1234u + i, true, 2.f);
    CHECK_CUDA(cudaGetLastError());
    bufs.push_back(ptr);
  }
  float *lse, *d_lse;
  CHECK_CUDA(cudaMalloc(&lse, rows * 4));
  CHECK_CUDA(cudaMalloc(&d_lse, rows * 4));
  const bool causal = p->window_left < 0 && p->window_right == 0;
  FillLse<<<1024, 256>>>(lse, d_lse, rows, p->seqlen_q, p->seqlen_k, causal);
  CHECK_CUDA(cudaGetLastError());
  p->q = bufs[0];
  p->k = bufs[1];
  p->v = bufs[2];
  p->o = bufs[3];
  p->d_o = bufs[4];
  p->dq = bufs[5];
  p->dk = bufs[6];
  p->dv = bufs[7];
  p->lse = lse;
  p->d_lse = d_lse;
  bufs.push_back(lse);
  bufs.push_back(d_lse);
  return bufs;
}

// Values rounded to / stored as the 16-bit dtype under test.
inline float RoundTo(DType dt, float x) {
  if (dt == DType::kFloat16) return __half2float(__float2half_rn(x));
  return __bfloat162float(__float2bfloat16_rn(x));
}

inline uint16_t ToBits(DType dt, float x) {
  uint16_t bits;
  if (dt == DType::kFloat16) {
    __half h = __float2half_rn(x);
    std::memcpy(&bits, &h, 2);
  } else {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}

inline float FromBits(DType dt, uint16_t bits) {
  if (dt == DType::kFloat16) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &bits, 2);
  return __bfloat162float(h);
}

// f(i) for i in [0, n) on every hardware thread (the float64 references).
template <typename F>
void ParallelFor(int64_t n, F f) {
  const int workers = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (int64_t i = next++; i < n; i = next++) f(i);
    });
  }
  for (auto& t : pool) t.join();
}

// The params of a self-test case (any struct with dtype, B, T, S, H, K, D,
// wl, wr and bhtd): sizes, dense [B, T, H, D] strides or, with bhtd,
// [B, H, T, D] ones; scale 1/sqrt(D); window (wl, wr).
template <class Case>
FlashParams CaseParams(const Case& c) {
  FlashParams p;
  p.dtype = c.dtype;
  p.batch = c.B;
  p.seqlen_q = c.T;
  p.seqlen_k = c.S;
  p.num_heads_q = c.H;
  p.num_heads_kv = c.K;
  p.head_dim = c.D;
  p.group_size = c.H / c.K;
  SetDenseStrides(p);
  if (c.bhtd) {
    p.q_row_stride = c.D;
    p.q_head_stride = c.T * c.D;
    p.q_batch_stride = c.H * c.T * c.D;
    p.o_row_stride = p.q_row_stride;
    p.o_head_stride = p.q_head_stride;
    p.o_batch_stride = p.q_batch_stride;
    p.k_row_stride = c.D;
    p.k_head_stride = c.S * c.D;
    p.k_batch_stride = c.K * c.S * c.D;
    p.v_row_stride = p.k_row_stride;
    p.v_head_stride = p.k_head_stride;
    p.v_batch_stride = p.k_batch_stride;
  }
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.window_left = c.wl;
  p.window_right = c.wr;
  return p;
}

// Element offset of (b, t, h, d) under batch, row and head strides.
inline int64_t Off(int64_t bs, int64_t rs, int64_t hs, int64_t b, int64_t t, int64_t h, int64_t d) {
  return b * bs + t * rs + h * hs + d;
}


// The score options on the host: softcap, ALiBi slopes [B, H] and segment ids
// [B, T], [B, S] (empty when off). The kernels get device copies through p.
struct HostVariants {
  float softcap = 0.f;
  std::vector<float> alibi;
  std::vector<int32_t> q_ids, kv_ids;
  // Dropout: the rate (0 = off) and [B, H, 2] seeds; the mask is
  // flash_dropout.h's DropoutMask, evaluated on the host (DropoutFactor).
  float dropout_rate = 0.f;
  std::vector<uint32_t> dropout_seeds;
};

// Random seeds for dropout at `rate` (none when rate == 0), the rate rounded
// to 256ths as jax_flash2 applies it.
template <class Rng>
void MakeHostDropout(const FlashParams& p, float rate, Rng& rng, HostVariants* var) {
  var->dropout_rate =
      rate == 0.f ? 0.f : std::min(std::max(std::nearbyint(rate * 256.f), 1.f), 255.f) / 256.f;
  var->dropout_seeds.clear();
  if (rate == 0.f) return;
  std::uniform_int_distribution<uint32_t> word;
  for (int64_t i = 0; i < 2 * p.batch * p.num_heads_q; ++i) var->dropout_seeds.push_back(word(rng));
}

// p's dropout fields for var, with `seeds` the device copy of var.dropout_seeds
// (as ffi_params.h fills them).
inline void SetDropout(const HostVariants& var, const void* seeds, FlashParams* p) {
  p->dropout_seeds = static_cast<const uint32_t*>(seeds);
  p->dropout_rate = var.dropout_rate;
  p->dropout_threshold = DropoutThreshold(var.dropout_rate);
  p->dropout_scale = 1.0f / (1.0f - var.dropout_rate);
}

// Z / (1 - rate) at (b, h, t, j): 0 where dropout drops the score, the
// kernels' float32 1 / (1 - rate) where it keeps it, 1 without dropout.
inline double DropoutFactor(const FlashParams& p, const HostVariants& var, int64_t b, int64_t h,
                            int64_t t, int64_t j) {
  if (var.dropout_seeds.empty()) return 1.0;
  const uint32_t* seed = &var.dropout_seeds[2 * (b * p.num_heads_q + h)];
  const DropoutMask mask{seed[0], seed[1], DropoutThreshold(var.dropout_rate)};
  const bool keep = (mask.Keep16(t, j / 16) >> (j % 16)) & 1u;
  return keep ? static_cast<double>(1.0f / (1.0f - var.dropout_rate)) : 0.0;
}

// Score of query t and key j of (b, h) from the scaled dot product
// x = scale * q.k, in double: x = softcap * tanh(x / softcap), then
// x -= slope * |t + S - T - j|; -inf where the window or the segments hide
// the pair. *dcap (if given) gets d score / dx = 1 - tanh^2 (1 without cap).
inline double VariantScore(const FlashParams& p, const HostVariants& var, int64_t b, int64_t t,
                           int64_t h, int64_t j, double x, double* dcap = nullptr) {
  if (dcap) *dcap = 1.0;
  if (!MakeWindowMask(p).Allowed(t, j)) return -INFINITY;
  if (!var.q_ids.empty() &&
      var.q_ids[b * p.seqlen_q + t] != var.kv_ids[b * p.seqlen_k + j]) {
    return -INFINITY;
  }
  if (var.softcap > 0.f) {
    const double th = std::tanh(x / var.softcap);
    x = var.softcap * th;
    if (dcap) *dcap = 1.0 - th * th;
  }
  if (!var.alibi.empty()) {
    x -= var.alibi[b * p.num_heads_q + h] * std::abs(double(t + p.seqlen_k - p.seqlen_q - j));
  }
  return x;
}

// Fills var for a case: softcap as given; alibi slopes in [0.01, 0.3] when
// `alibi`; segments 0 none, 1 packed (sorted runs of 3 ids, the same cuts for
// q and k/v when T == S), 2 random (q ids in [0, 4), k/v ids in [0, 3): queries
// with id 3 see no key).
template <class Rng>
void MakeHostVariants(const FlashParams& p, float softcap, bool alibi, int segments, Rng& rng,
                      HostVariants* var) {
  var->softcap = softcap;
  var->alibi.clear();
  var->q_ids.clear();
  var->kv_ids.clear();
  std::uniform_real_distribution<float> slope(0.01f, 0.3f);
  if (alibi) {
    for (int64_t i = 0; i < p.batch * p.num_heads_q; ++i) var->alibi.push_back(slope(rng));
  }
  auto packed = [&](int64_t length, std::vector<int32_t>& ids) {
    std::uniform_int_distribution<int64_t> cut(1, std::max<int64_t>(1, length - 1));
    for (int64_t b = 0; b < p.batch; ++b) {
      int64_t c0 = cut(rng), c1 = cut(rng);
      if (c0 > c1) std::swap(c0, c1);
      for (int64_t i = 0; i < length; ++i) ids.push_back(i < c0 ? 0 : i < c1 ? 1 : 2);
    }
  };
  if (segments == 1) {
    packed(p.seqlen_q, var->q_ids);
    if (p.seqlen_q == p.seqlen_k) {
      var->kv_ids = var->q_ids;
    } else {
      packed(p.seqlen_k, var->kv_ids);
    }
  } else if (segments == 2) {
    std::uniform_int_distribution<int32_t> q_id(0, 3), kv_id(0, 2);
    for (int64_t i = 0; i < p.batch * p.seqlen_q; ++i) var->q_ids.push_back(q_id(rng));
    for (int64_t i = 0; i < p.batch * p.seqlen_k; ++i) var->kv_ids.push_back(kv_id(rng));
  }
}

// Query row (b, t, h) of attention under p, twice: in float64 (the oracle, into
// row.o, returning the LSE; -inf when no key is visible) and as a plain
// same-dtype attention computes it (S and P rounded to the dtype, fp32 sums,
// into row.of). q, k, v are the inputs as floats, laid out by p's strides.
// With dropout (var), O = (Z o P / (1 - rate)) V and the LSE is undropped.
struct ReferenceRowScratch {
  std::vector<double> s, o;
  std::vector<float> sf, of;
};

inline double ReferenceRow(const FlashParams& p, DType dtype, const float* fq, const float* fk,
                           const float* fv, int64_t b, int64_t t, int64_t h,
                           ReferenceRowScratch& row, const HostVariants& var = HostVariants()) {
  const WindowMask mask = MakeWindowMask(p);
  const double scale = p.softmax_scale;
  const int64_t kh = h / p.group_size;
  row.s.resize(p.seqlen_k);
  row.sf.resize(p.seqlen_k);
  row.o.resize(p.head_dim);
  row.of.resize(p.head_dim);
  std::vector<double>& s = row.s;
  std::vector<double>& o = row.o;
  std::vector<float>& sf = row.sf;
  std::vector<float>& of = row.of;
  const float* qr = &fq[Off(p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, t, h, 0)];
  double mx = -INFINITY;
  float mxf = -INFINITY;
  for (int64_t j = 0; j < p.seqlen_k; ++j) {
    if (!mask.Allowed(t, j)) { s[j] = -INFINITY; sf[j] = -INFINITY; continue; }
    const float* kr = &fk[Off(p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, j, kh, 0)];
    double acc = 0;
    float accf = 0;
    for (int64_t d = 0; d < p.head_dim; ++d) { acc += double(qr[d]) * kr[d]; accf += qr[d] * kr[d]; }
    s[j] = VariantScore(p, var, b, t, h, j, acc * scale);
    sf[j] = RoundTo(dtype, static_cast<float>(
                               VariantScore(p, var, b, t, h, j, accf * p.softmax_scale)));
    mx = std::max(mx, s[j]);
    mxf = std::max(mxf, sf[j]);
  }
  double l = 0;
  float lf = 0;
  std::fill(o.begin(), o.end(), 0.0);
  std::fill(of.begin(), of.end(), 0.f);
  if (mx != -INFINITY) {
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
      if (s[j] == -INFINITY) continue;
      s[j] = std::exp(s[j] - mx);
      l += s[j];
      sf[j] = std::exp(sf[j] - mxf);
      lf += sf[j];
    }
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
      if (sf[j] == -INFINITY) continue;
      const float* vr = &fv[Off(p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, j, kh, 0)];
      const double z = DropoutFactor(p, var, b, h, t, j);
      const double w = s[j] / l * z;
      const float wf = RoundTo(dtype, sf[j] / lf) * static_cast<float>(z);
      for (int64_t d = 0; d < p.head_dim; ++d) { o[d] += w * vr[d]; of[d] += wf * vr[d]; }
    }
  }
  return mx == -INFINITY ? -INFINITY : mx + std::log(l);
}

}  // namespace jax_flash2::selftest
