// Self-test of the CUDA backward (RunBackward) against a float64 CPU oracle.
//
// For each case: random q, k, v, dO (and dLSE where asked) in the input dtype;
// O and LSE from a float64 CPU forward (so the test does not depend on the
// forward kernel), O rounded to the dtype and LSE to fp32 as the real forward
// would hand them over; dq, dk, dv poisoned with NaN, scratch with 0xff; then
// RunBackward against a float64 backward of the same inputs.
//
// Tolerance: the kernel's error comes from rounding P and dS to the dtype
// before their products and the outputs to the dtype at the end (accumulation
// is fp32). The oracle also runs that "same-dtype naive" backward (P, dS and
// the outputs rounded, sums in float64); a case passes when
//   ||out - ref|| / ||ref|| <= 3 * (||naive - ref|| / ||ref||) + 1e-4
// for each of dq, dk, dv, and no NaN/Inf is left. The factor 3 leaves room for
// fp32 accumulation order and ex2.approx; 1e-4 for outputs that round almost
// exactly. Typical naive errors: ~2e-3 (bf16), ~3e-4 (fp16).
//
// Usage: bwd_selftest          all cases, then times D = 128
//        bwd_selftest small    three tiny cases (for the sanitizers)
//        bwd_selftest time     times D = 32, 64, 128, 256 only
//        bwd_selftest --probe  exits 0 at once: checks that a carried binary loads
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/flash_cuda.h"
#include "src/flash_mask.h"
#include "src/flash_params.h"
#include "tests/cuda/selftest_util.h"

// This test reports a CUDA error as a failed case rather than exiting.
#undef CHECK_CUDA

using jax_flash2::DType;
using jax_flash2::selftest::FromBits;
using jax_flash2::selftest::HostVariants;
using jax_flash2::selftest::ToBits;
using jax_flash2::selftest::VariantScore;
using jax_flash2::FlashParams;
using jax_flash2::cuda::DeviceInfo;

#define CHECK_CUDA(expr)                                                                 \
  do {                                                                                   \
    cudaError_t err_ = (expr);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__, \
                  __LINE__, #expr);                                                      \
      return false;                                                                      \
    }                                                                                    \
  } while (0)

namespace {

// x rounded to dt (selftest_util.h's conversions).
double Round(double x, DType dt) { return FromBits(dt, ToBits(dt, static_cast<float>(x))); }

struct Case {
  std::string name;
  DType dtype;
  int64_t B, T, S, H, K, D;
  int64_t window_left, window_right;  // (-1, -1) full, (-1, 0) causal
  bool dlse;                          // nonzero dLSE
  float softcap = 0.f;                // score options (MakeHostVariants)
  bool alibi = false;
  int segments = 0;                   // 0 none, 1 packed runs, 2 random (empty rows)
  bool deterministic = false;         // also: a second run gives the same bits
  float dropout = 0.f;                // dropout rate (MakeHostDropout)
};

struct Tensor {  // host copy: dtype bits and the exact double values of them
  std::vector<uint16_t> bits;
  std::vector<double> val;
};

Tensor RandomTensor(size_t n, DType dt, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  Tensor t;
  t.bits.resize(n);
  t.val.resize(n);
  for (size_t i = 0; i < n; ++i) {
    t.bits[i] = ToBits(dt, static_cast<float>(dist(rng)));
    t.val[i] = FromBits(dt, t.bits[i]);
  }
  return t;
}

struct ErrStats {
  double rel = 0, naive_rel = 0;
  bool finite = true;
};

ErrStats Compare(const std::vector<uint16_t>& out, const std::vector<double>& ref,
                 const std::vector<double>& naive, DType dt) {
  double num = 0, den = 0, nnum = 0;
  ErrStats e;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = FromBits(dt, out[i]);
    if (!std::isfinite(o)) e.finite = false;
    num += (o - ref[i]) * (o - ref[i]);
    const double n = Round(naive[i], dt);
    nnum += (n - ref[i]) * (n - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) den = 1;  // all-zero reference: absolute error
  e.rel = std::sqrt(num / den);
  e.naive_rel = std::sqrt(nnum / den);
  return e;
}

struct DevVariant {
  DeviceInfo dev;
  const char* label;
};

// Runs case c once per device variant (the same inputs and oracle); counts
// failures in *failed.
bool RunCase(const Case& c, const std::vector<DevVariant>& variants, int* failed) {
  const DType dt = c.dtype;
  const int64_t B = c.B, T = c.T, S = c.S, H = c.H, K = c.K, D = c.D, G = H / K;
  FlashParams p;
  p.dtype = dt;
  p.batch = B;
  p.seqlen_q = T;
  p.seqlen_k = S;
  p.num_heads_q = H;
  p.num_heads_kv = K;
  p.head_dim = D;
  p.group_size = G;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  jax_flash2::SetDenseStrides(p);
  p.softcap = c.softcap;
  p.deterministic = c.deterministic;
  const double scale = p.softmax_scale;

  std::mt19937_64 rng(0x5eed + T * 131 + S * 7 + D + H * 1000003 + static_cast<int>(dt));
  HostVariants var;
  jax_flash2::selftest::MakeHostVariants(p, c.softcap, c.alibi, c.segments, rng, &var);
  jax_flash2::selftest::MakeHostDropout(p, c.dropout, rng, &var);
  const size_t nq = B * T * H * D, nk = B * S * K * D, nl = B * H * T;
  Tensor q = RandomTensor(nq, dt, rng), k = RandomTensor(nk, dt, rng),
         v = RandomTensor(nk, dt, rng), d_o = RandomTensor(nq, dt, rng);
  std::vector<float> d_lse(nl, 0.f);
  if (c.dlse) {
    std::normal_distribution<float> dist(0.f, 1.f);
    for (float& x : d_lse) x = dist(rng);
  }
  auto qi = [&](int64_t b, int64_t t, int64_t h) { return ((b * T + t) * H + h) * D; };
  auto ki = [&](int64_t b, int64_t s, int64_t kh) { return ((b * S + s) * K + kh) * D; };
  auto li = [&](int64_t b, int64_t h, int64_t t) { return (b * H + h) * T + t; };

  // float64 forward: O (rounded to dtype), LSE (fp32).
  Tensor o;
  o.bits.resize(nq);
  o.val.resize(nq);
  std::vector<float> lse(nl);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> sc(S), acc(D);
      const int64_t kh = h / G;
      for (int64_t t = 0; t < T; ++t) {
        double m = -INFINITY;
        for (int64_t s = 0; s < S; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q.val[qi(b, t, h) + d] * k.val[ki(b, s, kh) + d];
          sc[s] = VariantScore(p, var, b, t, h, s, dot * scale);
          m = std::max(m, sc[s]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double l = 0;
        if (m != -INFINITY) {
          for (int64_t s = 0; s < S; ++s) {
            if (sc[s] == -INFINITY) continue;
            const double w = std::exp(sc[s] - m);
            l += w;  // the LSE is of the undropped softmax; O of Z o P / (1 - rate)
            const double wz = w * jax_flash2::selftest::DropoutFactor(p, var, b, h, t, s);
            for (int64_t d = 0; d < D; ++d) acc[d] += wz * v.val[ki(b, s, kh) + d];
          }
        }
        // A row that sees no key: O = 0, LSE = -inf (what the forward emits).
        lse[li(b, h, t)] = m == -INFINITY ? -INFINITY : static_cast<float>(m + std::log(l));
        for (int64_t d = 0; d < D; ++d) {
          const double x = l > 0 ? acc[d] / l : 0.0;
          o.bits[qi(b, t, h) + d] = ToBits(dt, static_cast<float>(x));
          o.val[qi(b, t, h) + d] = FromBits(dt, o.bits[qi(b, t, h) + d]);
        }
      }
    }
  }

  // float64 backward of the same inputs, plus the same-dtype naive one.
  std::vector<double> dq(nq, 0), dk(nk, 0), dv(nk, 0), dqn(nq, 0), dkn(nk, 0), dvn(nk, 0);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t kh = 0; kh < K; ++kh) {
      std::vector<double> pr(S), ds(S), z(S);
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          const double L = lse[li(b, h, t)];
          if (L == -INFINITY) continue;  // no key visible: P = 0, all gradients 0
          const double* qr = &q.val[qi(b, t, h)];
          const double* dor = &d_o.val[qi(b, t, h)];
          double Di = -d_lse[li(b, h, t)];
          for (int64_t d = 0; d < D; ++d) Di += dor[d] * o.val[qi(b, t, h) + d];
          for (int64_t s = 0; s < S; ++s) {
            double dot = 0, dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              dot += qr[d] * k.val[ki(b, s, kh) + d];
              dp += dor[d] * v.val[ki(b, s, kh) + d];
            }
            double dcap;
            const double score = VariantScore(p, var, b, t, h, s, dot * scale, &dcap);
            pr[s] = score == -INFINITY ? 0.0 : std::exp(score - L);
            // Dropout: dS = P o (Z o dP / (1 - rate) - D), dV = (Z o P / (1 - rate))^T dO.
            z[s] = jax_flash2::selftest::DropoutFactor(p, var, b, h, t, s);
            ds[s] = pr[s] * (dp * z[s] - Di) * dcap;  // through the cap: d score / d(scale q.k)
          }
          for (int64_t s = 0; s < S; ++s) {
            if (pr[s] == 0 && ds[s] == 0) continue;
            const double pn = Round(pr[s], dt), dsn = Round(ds[s], dt);
            const double* kr = &k.val[ki(b, s, kh)];
            for (int64_t d = 0; d < D; ++d) {
              dq[qi(b, t, h) + d] += scale * ds[s] * kr[d];
              dqn[qi(b, t, h) + d] += scale * dsn * kr[d];
              dk[ki(b, s, kh) + d] += scale * ds[s] * qr[d];
              dkn[ki(b, s, kh) + d] += scale * dsn * qr[d];
              dv[ki(b, s, kh) + d] += pr[s] * z[s] * dor[d];
              dvn[ki(b, s, kh) + d] += pn * z[s] * dor[d];
            }
          }
        }
      }
    }
  }

  // Device run, once per variant.
  for (const DevVariant& dv_variant : variants) {
    const DeviceInfo& dev = dv_variant.dev;
    // The plan's support check (src/plan.h): every variant serves every case.
    if (const std::string why = jax_flash2::BackwardUnsupported(p, dev); !why.empty()) {
      ++*failed;
      std::printf("FAIL %-40s%s refused: %s\n", c.name.c_str(), dv_variant.label, why.c_str());
      continue;
    }
    const size_t eb = 2;
    void *d_q, *d_k, *d_v, *d_out, *d_dout, *d_dq, *d_dk, *d_dv, *d_scratch = nullptr;
    float *d_lse_buf, *d_dlse_buf;
    CHECK_CUDA(cudaMalloc(&d_q, nq * eb));
    CHECK_CUDA(cudaMalloc(&d_k, nk * eb));
    CHECK_CUDA(cudaMalloc(&d_v, nk * eb));
    CHECK_CUDA(cudaMalloc(&d_out, nq * eb));
    CHECK_CUDA(cudaMalloc(&d_dout, nq * eb));
    CHECK_CUDA(cudaMalloc(&d_dq, nq * eb));
    CHECK_CUDA(cudaMalloc(&d_dk, nk * eb));
    CHECK_CUDA(cudaMalloc(&d_dv, nk * eb));
    CHECK_CUDA(cudaMalloc(&d_lse_buf, nl * 4));
    CHECK_CUDA(cudaMalloc(&d_dlse_buf, nl * 4));
    CHECK_CUDA(cudaMemcpy(d_q, q.bits.data(), nq * eb, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_k, k.bits.data(), nk * eb, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_v, v.bits.data(), nk * eb, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_out, o.bits.data(), nq * eb, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_dout, d_o.bits.data(), nq * eb, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_lse_buf, lse.data(), nl * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_dlse_buf, d_lse.data(), nl * 4, cudaMemcpyHostToDevice));
    // Poison: 0xffff is NaN in fp16 and bf16; 0xffffffff is NaN in fp32.
    CHECK_CUDA(cudaMemset(d_dq, 0xff, nq * eb));
    CHECK_CUDA(cudaMemset(d_dk, 0xff, nk * eb));
    CHECK_CUDA(cudaMemset(d_dv, 0xff, nk * eb));
    p.q = d_q;
    p.k = d_k;
    p.v = d_v;
    p.o = d_out;
    p.lse = d_lse_buf;
    p.d_o = d_dout;
    p.d_lse = d_dlse_buf;
    p.dq = d_dq;
    p.dk = d_dk;
    p.dv = d_dv;
    void *d_alibi = nullptr, *d_q_ids = nullptr, *d_kv_ids = nullptr, *d_seeds = nullptr;
    if (!var.dropout_seeds.empty()) {
      const size_t bytes = var.dropout_seeds.size() * 4;
      CHECK_CUDA(cudaMalloc(&d_seeds, bytes));
      CHECK_CUDA(cudaMemcpy(d_seeds, var.dropout_seeds.data(), bytes, cudaMemcpyHostToDevice));
      jax_flash2::selftest::SetDropout(var, d_seeds, &p);
    }
    if (!var.alibi.empty()) {
      CHECK_CUDA(cudaMalloc(&d_alibi, var.alibi.size() * 4));
      CHECK_CUDA(cudaMemcpy(d_alibi, var.alibi.data(), var.alibi.size() * 4,
                            cudaMemcpyHostToDevice));
      p.alibi_slopes = static_cast<const float*>(d_alibi);
    }
    if (!var.q_ids.empty()) {
      CHECK_CUDA(cudaMalloc(&d_q_ids, var.q_ids.size() * 4));
      CHECK_CUDA(cudaMalloc(&d_kv_ids, var.kv_ids.size() * 4));
      CHECK_CUDA(cudaMemcpy(d_q_ids, var.q_ids.data(), var.q_ids.size() * 4,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_kv_ids, var.kv_ids.data(), var.kv_ids.size() * 4,
                            cudaMemcpyHostToDevice));
      p.q_segment_ids = static_cast<const int32_t*>(d_q_ids);
      p.kv_segment_ids = static_cast<const int32_t*>(d_kv_ids);
    }
    const size_t scratch_bytes = jax_flash2::cuda::BackwardScratchBytes(p, dev);
    CHECK_CUDA(cudaMalloc(&d_scratch, scratch_bytes));
    // Deterministic cases run twice, from freshly poisoned outputs and scratch.
    std::vector<uint16_t> out_dq(nq), out_dk(nk), out_dv(nk);
    bool identical = true;
    for (int run = 0; run < (c.deterministic ? 2 : 1); ++run) {
      CHECK_CUDA(cudaMemset(d_dq, 0xff, nq * eb));
      CHECK_CUDA(cudaMemset(d_dk, 0xff, nk * eb));
      CHECK_CUDA(cudaMemset(d_dv, 0xff, nk * eb));
      CHECK_CUDA(cudaMemset(d_scratch, 0xff, scratch_bytes));
      CHECK_CUDA(jax_flash2::cuda::RunBackward(p, d_scratch, dev, nullptr));
      CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<uint16_t> run_dq(nq), run_dk(nk), run_dv(nk);
      CHECK_CUDA(cudaMemcpy(run_dq.data(), d_dq, nq * eb, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(run_dk.data(), d_dk, nk * eb, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(run_dv.data(), d_dv, nk * eb, cudaMemcpyDeviceToHost));
      if (run > 0) {
        identical = identical && run_dq == out_dq && run_dk == out_dk && run_dv == out_dv;
      }
      out_dq.swap(run_dq);
      out_dk.swap(run_dk);
      out_dv.swap(run_dv);
    }
    for (void* ptr : {d_q, d_k, d_v, d_out, d_dout, d_dq, d_dk, d_dv, d_scratch,
                      static_cast<void*>(d_lse_buf), static_cast<void*>(d_dlse_buf), d_alibi,
                      d_q_ids, d_kv_ids, d_seeds}) {
      if (ptr != nullptr) CHECK_CUDA(cudaFree(ptr));
    }
    p.alibi_slopes = nullptr;
    p.q_segment_ids = p.kv_segment_ids = nullptr;
    p.dropout_seeds = nullptr;

    const ErrStats eq = Compare(out_dq, dq, dqn, dt), ek = Compare(out_dk, dk, dkn, dt),
                   ev = Compare(out_dv, dv, dvn, dt);
    auto ok = [](const ErrStats& e) { return e.finite && e.rel <= 3 * e.naive_rel + 1e-4; };
    const bool pass = ok(eq) && ok(ek) && ok(ev) && identical;
    *failed += pass ? 0 : 1;
    std::printf(
        "%s %-40s%s dq %.2e (naive %.2e)%s  dk %.2e (naive %.2e)%s  dv %.2e (naive %.2e)%s%s\n",
        pass ? "PASS" : "FAIL", c.name.c_str(), dv_variant.label, eq.rel, eq.naive_rel,
        eq.finite ? "" : " NaN",
        ek.rel, ek.naive_rel, ek.finite ? "" : " NaN", ev.rel, ev.naive_rel,
        ev.finite ? "" : " NaN",
        c.deterministic ? (identical ? "  2 runs bit-identical" : "  2 runs DIFFER") : "");
  }
  return true;
}

// B = 4, T = S = 4096, H * D = 2048 (H = 16 at D = 128), bf16.
bool TimeBackward(const DeviceInfo& dev, int64_t D, bool causal) {
  const int64_t B = 4, T = 4096, S = 4096, H = 2048 / D;
  FlashParams p;
  p.dtype = DType::kBFloat16;
  p.batch = B;
  p.seqlen_q = T;
  p.seqlen_k = S;
  p.num_heads_q = H;
  p.num_heads_kv = H;
  p.head_dim = D;
  p.group_size = 1;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  jax_flash2::SetDenseStrides(p);
  const std::vector<void*> bufs = jax_flash2::selftest::AllocBackwardTimingBuffers(&p);
  void* scratch;
  CHECK_CUDA(cudaMalloc(&scratch, jax_flash2::cuda::BackwardScratchBytes(p, dev)));
  const std::vector<float> ms = jax_flash2::selftest::TimeRuns("bwd timing", 15, [&](int) {
    return jax_flash2::cuda::RunBackward(p, scratch, dev, nullptr);
  });
  const double med = ms[ms.size() / 2];
  double flops = 2.5 * 4.0 * B * T * S * H * D;
  if (causal) flops /= 2;
  std::printf("TIME bf16 B=%lld T=S=%lld H=%lld D=%lld %-9s median %.3f ms (min %.3f, max %.3f) "
              "%.1f TFLOP/s\n",
              (long long)B, (long long)T, (long long)H, (long long)D,
              causal ? "causal" : "noncausal", med, ms.front(), ms.back(),
              flops / (med * 1e-3) / 1e12);
  for (void* ptr : bufs) CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaFree(scratch));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--probe") return 0;
  const bool small = mode == "small";
  DeviceInfo dev;
  if (jax_flash2::cuda::GetCurrentDeviceInfo(&dev) != cudaSuccess) return 2;
  std::printf("device sm_%d%d, %d SMs, %zu B smem opt-in\n", dev.cc_major, dev.cc_minor,
              dev.sm_count, dev.max_smem_per_block_optin);
  const DType bf = DType::kBFloat16, hf = DType::kFloat16;
  std::vector<Case> cases;
  if (mode == "time") {
    for (int64_t d : {32, 64, 128, 256}) {
      if (!TimeBackward(dev, d, false) || !TimeBackward(dev, d, true)) return 1;
    }
    return 0;
  }
  if (small) {
    cases = {
        {"bf16 d64 T33 S47 causal gqa2", bf, 1, 33, 47, 4, 2, 64, -1, 0, true},
        {"fp16 d256 T17 S70 full mqa", hf, 1, 17, 70, 2, 1, 256, -1, -1, false},
        {"bf16 d128 T70 S130 causal", bf, 1, 70, 130, 1, 1, 128, -1, 0, false},
        {"bf16 d64 T70 S150 softcap alibi rand-seg", bf, 1, 70, 150, 2, 1, 64, -1, -1, true, 4.f,
         true, 2},
        {"fp16 d32 T40 S300 determ gqa2", hf, 2, 40, 300, 4, 2, 32, -1, 0, false, 0.f, false, 0,
         true},
        {"bf16 d64 T45 S70 causal gqa2 dropout0.3", bf, 1, 45, 70, 4, 2, 64, -1, 0, true, 0.f,
         false, 0, false, 0.3f},
    };
  } else {
    cases = {
        {"bf16 d8 T1 S1 full", bf, 1, 1, 1, 1, 1, 8, -1, -1, false},
        {"bf16 d32 T17 S17 causal", bf, 2, 17, 17, 2, 2, 32, -1, 0, false},
        {"fp16 d32 T17 S257 full", hf, 1, 17, 257, 2, 2, 32, -1, -1, false},
        {"fp16 d32 T257 S17 causal (empty rows)", hf, 1, 257, 17, 2, 2, 32, -1, 0, false},
        {"bf16 d40 T17 S17 causal dlse", bf, 1, 17, 17, 2, 2, 40, -1, 0, true},
        {"bf16 d64 T257 S257 full", bf, 2, 257, 257, 2, 2, 64, -1, -1, false},
        {"fp16 d64 T257 S257 causal gqa4", hf, 1, 257, 257, 8, 2, 64, -1, 0, false},
        {"bf16 d64 T257 S257 window(64,16)", bf, 1, 257, 257, 2, 2, 64, 64, 16, false},
        {"fp16 d80 T1000 S257 full gqa4 dlse", hf, 1, 1000, 257, 4, 1, 80, -1, -1, true},
        {"bf16 d128 T1000 S1000 causal mqa", bf, 1, 1000, 1000, 4, 1, 128, -1, 0, false},
        {"bf16 d128 T1 S1000 full gqa4", bf, 1, 1, 1000, 8, 2, 128, -1, -1, false},
        {"fp16 d128 T257 S17 full", hf, 2, 257, 17, 2, 2, 128, -1, -1, false},
        {"fp16 d256 T257 S1000 causal gqa4", hf, 1, 257, 1000, 4, 1, 256, -1, 0, false},
        {"bf16 d256 T1000 S17 full", bf, 1, 1000, 17, 2, 2, 256, -1, -1, false},
        {"bf16 d200 T257 S257 causal mqa", bf, 1, 257, 257, 2, 1, 200, -1, 0, false},
        // Score options, alone and with causal / window / GQA; random segment
        // ids leave queries with no key (their gradients are 0).
        {"bf16 d64 T150 S170 softcap5", bf, 1, 150, 170, 2, 2, 64, -1, -1, false, 5.f},
        {"fp16 d128 T130 S97 causal alibi gqa2 dlse", hf, 2, 130, 97, 4, 2, 128, -1, 0, true, 0.f,
         true},
        {"bf16 d32 T200 S200 causal packed-seg mqa", bf, 2, 200, 200, 2, 1, 32, -1, 0, false, 0.f,
         false, 1},
        {"fp16 d64 T140 S200 rand-seg (empty rows)", hf, 1, 140, 200, 4, 4, 64, -1, -1, true, 0.f,
         false, 2},
        {"bf16 d128 T257 S257 win(80,0) all gqa2", bf, 2, 257, 257, 4, 2, 128, 80, 0, true, 5.f,
         true, 1},
        {"bf16 d256 T200 S260 softcap3 alibi seg", bf, 1, 200, 260, 2, 1, 256, -1, -1, false, 3.f,
         true, 1},
        {"bf16 d40 T97 S97 win(30,-1) softcap2", bf, 2, 97, 97, 4, 2, 40, 30, -1, true, 2.f},
        // Deterministic: several key blocks per CTA into one dQ slice (B * K
        // CTAs per split, splits ~ SMs / (B * K)), twice, bit-identical.
        {"bf16 d64 T700 S700 causal determ", bf, 4, 700, 700, 16, 16, 64, -1, 0, true, 0.f, false,
         0, true},
        {"fp16 d128 T300 S1500 determ gqa2 seg", hf, 2, 300, 1500, 8, 4, 128, -1, -1, false, 0.f,
         false, 1, true},
        // Dropout (the oracle applies flash_dropout.h's mask on the host):
        // alone, causal GQA with odd lengths and dLSE, with the other options,
        // a decode shape (T = 5, GQA4), and the deterministic path.
        {"bf16 d64 T77 S77 dropout0.2", bf, 2, 77, 77, 4, 4, 64, -1, -1, false, 0.f, false, 0,
         false, 0.2f},
        {"fp16 d128 T257 S130 causal gqa2 dlse dropout0.3", hf, 1, 257, 130, 4, 2, 128, -1, 0, true,
         0.f, false, 0, false, 0.3f},
        {"bf16 d32 T130 S97 causal softcap alibi seg dropout", bf, 2, 130, 97, 2, 1, 32, -1, 0,
         false, 4.f, true, 1, false, 0.1f},
        {"fp16 d256 T100 S300 win(64,16) dropout0.5", hf, 1, 100, 300, 2, 2, 256, 64, 16, false, 0.f,
         false, 0, false, 0.5f},
        {"fp16 d64 T5 S2000 causal gqa4 decode dropout", hf, 2, 5, 2000, 8, 2, 64, -1, 0, true, 0.f,
         false, 0, false, 0.25f},
        {"bf16 d128 T700 S700 causal determ dropout0.1", bf, 2, 700, 700, 8, 8, 128, -1, 0, true,
         0.f, false, 0, true, 0.1f},
    };
  }
  // Every case runs with the device as it is and, where that device has more,
  // with the shared memory of an A100 (163 KB opt-in), which selects the
  // default tile rows instead of the large-smem ones, and with that of cc 8.6
  // / 8.9 GPUs (99 KB), which selects the small-smem rows. No variant may
  // refuse a case. The kernels are the same sm_80 code there.
  DeviceInfo dev80 = dev, dev86 = dev;
  dev80.max_smem_per_block_optin = std::min<size_t>(dev.max_smem_per_block_optin, 166912);
  dev86.max_smem_per_block_optin = std::min<size_t>(dev.max_smem_per_block_optin, 101376);
  std::vector<DevVariant> variants = {{dev, ""}};
  if (dev80.max_smem_per_block_optin < dev.max_smem_per_block_optin) {
    variants.push_back({dev80, " [sm80 tiles]"});
  }
  if (dev86.max_smem_per_block_optin < dev.max_smem_per_block_optin) {
    variants.push_back({dev86, " [99 KB tiles]"});
  }
  int failed = 0;
  for (const Case& c : cases) {
    if (!RunCase(c, variants, &failed)) {
      std::printf("FAIL %s (CUDA error)\n", c.name.c_str());
      return 1;
    }
  }
  if (!small) {
    for (const DevVariant& var : variants) {
      std::printf("timing%s:\n", var.label);
      if (!TimeBackward(var.dev, 128, false) || !TimeBackward(var.dev, 128, true)) return 1;
    }
  }
  std::printf("%s: %d of %zu runs failed\n", failed ? "FAILED" : "ALL PASSED", failed,
              cases.size() * variants.size());
  return failed ? 1 : 0;
}
