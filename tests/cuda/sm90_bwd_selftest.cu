// Standalone check of the Hopper backward (RunBackwardSm90, between the
// preprocess and convert kernels of bwd_kernel.cuh, as RunBackward runs it)
// against a float64 CPU oracle, then timings beside the sm80 RunBackward.
//
// Per case: random q, k, v, dO (and dLSE where asked) in the dtype; O and LSE
// from a float64 CPU forward (O rounded to the dtype, LSE to fp32, as the
// forward hands them over); dq, dk, dv poisoned with NaN and the scratch with
// 0xff; then the float64 backward of the same inputs. Tolerance as in
// bwd_selftest.cu: the oracle also runs the "same-dtype naive" backward (P, dS
// and the outputs rounded to the dtype, sums in float64), and a case passes
// when, for each of dq, dk, dv, no NaN/Inf is left and
//   ||out - ref|| / ||ref|| <= 3 * (||naive - ref|| / ||ref||) + 1e-4.
// A failing case prints each output's worst element (b, row, head, d, got,
// want), so a layout or descriptor error shows which rows/columns are off.
// Each launch is watched (SyncWithWatchdog, selftest_util.h): a hung kernel
// is reported as HANG and the process exits.
//
//   sm90_bwd_selftest               all cases + timings
//   sm90_bwd_selftest --tiny        the small cases (for the sanitizers)
//   sm90_bwd_selftest --probe       exits 0 at once: checks that a carried binary loads
//   sm90_bwd_selftest --filter STR  only the cases (checked and timed) whose name contains STR
//   sm90_bwd_selftest --no-time     skip timings
//   sm90_bwd_selftest --time-only   timings only
//   sm90_bwd_selftest --no-sm80     time the sm90 kernels only (A/B runs)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/flash_cuda.h"
#include "src/cuda/sm80/bwd_kernel.cuh"
#include "src/cuda/sm80/bwd_traits.h"
#include "src/cuda/sm90/bwd_sm90.h"
#include "src/flash_mask.h"
#include "src/flash_params.h"
#include "tests/cuda/selftest_util.h"
#include "tests/cuda/sm90_segments_test.h"

using namespace jax_flash2;
using namespace jax_flash2::selftest;
using jax_flash2::cuda::BwdScratchPtrs;
using jax_flash2::cuda::DeviceInfo;

namespace {

struct Case {
  std::string name;
  DType dtype;
  int64_t B, T, S, H, K, D;
  int64_t wl, wr;     // window; causal = (-1, 0)
  bool dlse = false;  // nonzero dLSE
  bool bhtd = false;  // [B, H, T, D] layout through strides
  // > 0: the backward is told the GPU has this many SMs, so a persistent
  // grid (unmasked, D = 64: BwdSm90Tile) has that many CTAs, each walking
  // several tiles, and an unmasked call whose tiles do not fill whole rounds
  // of them runs stream-K pieces (at either head dim).
  int sm_count = 0;
  SegKind seg = SegKind::kNone;  // segment ids (sm90_segments_test.h)
  int docs = 0;
  // Score options: softcap (0 = off), ALiBi slopes in [0.01, 0.3] (random
  // per case), and a softmax scale other than 1/sqrt(D) (0 = that one), so
  // that the cap bends the scores.
  float softcap = 0.f;
  bool alibi = false;
  float scale = 0.f;
  float dropout = 0.f;  // dropout rate (0 = off; MakeHostDropout)
  // The deterministic backward (p.deterministic; Det below): checked against
  // the oracle, then run twice more and compared bit for bit.
  bool det = false;
};

// c as a deterministic case, named "det ...".
Case Det(Case c) {
  c.det = true;
  c.name = "det " + c.name;
  return c;
}




// The scratch of the sm90 path (the linked RunBackward is the sm80 one): one
// dQ slice, the stream-K slots unless whole_tiles, and the deterministic
// backward's dQ counters.
cuda::BwdScratchLayout Sm90Layout(const FlashParams& p, const DeviceInfo& dev, bool whole_tiles) {
  return cuda::MakeBwdScratchLayout(
      p.batch, p.seqlen_q, p.num_heads_q, p.head_dim, 1,
      whole_tiles ? 0 : cuda::Sm90BackwardStreamKSlots(p, dev),
      cuda::sm90::BwdSm90SlotFloats(p.head_dim), cuda::Sm90BackwardDqTurns(p));
}

// What RunBackward does on the sm90 path: preprocess, RunBackwardSm90, convert.
template <typename Elem>
cudaError_t RunSm90Typed(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                         bool whole_tiles) {
  const cuda::BwdScratchLayout layout = Sm90Layout(p, dev, whole_tiles);
  const BwdScratchPtrs s = cuda::BwdScratchPointers(scratch, layout, p.deterministic);
  cudaError_t err = cudaMemsetAsync(s.dq_acc, 0, layout.zeroed_bytes, 0);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.batch * p.num_heads_q * s.t_pad;
  if (rows > 0) {
    cuda::BwdPreprocessKernel<Elem><<<cuda::BwdPreprocessBlocks<Elem>(p, s, dev.sm_count), 256>>>(p, s);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if ((err = cuda::RunBackwardSm90(p, s, dev, 0)) != cudaSuccess) return err;
  const int64_t chunks = p.batch * p.seqlen_q * p.num_heads_q * (p.head_dim / 8);
  if (chunks > 0) {
    const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, dev.sm_count * 16);
    cuda::BwdConvertKernel<Elem><<<static_cast<unsigned>(blocks), 256>>>(p, s);
    err = cudaGetLastError();
  }
  return err;
}

cudaError_t RunSm90(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                    bool whole_tiles = false) {
  if (p.dtype == DType::kFloat16) return RunSm90Typed<__half>(p, scratch, dev, whole_tiles);
  return RunSm90Typed<__nv_bfloat16>(p, scratch, dev, whole_tiles);
}

// Bytes of scratch for both paths on dev (the sm80 path's deterministic dQ
// slices included).
size_t ScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  FlashParams det = p;
  det.deterministic = true;
  return std::max({cuda::BackwardScratchBytes(p, dev), cuda::BackwardScratchBytes(det, dev),
                   Sm90Layout(p, dev, false).total_bytes, Sm90Layout(det, dev, false).total_bytes});
}

struct ErrStats {
  double rel = 0, naive_rel = 0;
  bool finite = true;
  size_t worst = 0;
  double worst_err = -1;
};

// out: device result bits; ref: float64 oracle; naive: same-dtype naive.
ErrStats Compare(DType dt, const std::vector<uint16_t>& out, const std::vector<double>& ref,
                 const std::vector<double>& naive) {
  double num = 0, den = 0, nnum = 0;
  ErrStats e;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = FromBits(dt, out[i]);
    if (!std::isfinite(o)) e.finite = false;
    const double err = std::isfinite(o) ? std::fabs(o - ref[i]) : INFINITY;
    if (err > e.worst_err) {
      e.worst_err = err;
      e.worst = i;
    }
    num += (o - ref[i]) * (o - ref[i]);
    const double n = RoundTo(dt, static_cast<float>(naive[i]));
    nnum += (n - ref[i]) * (n - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) den = 1;  // all-zero reference: absolute error
  e.rel = std::sqrt(num / den);
  e.naive_rel = std::sqrt(nnum / den);
  return e;
}

bool Ok(const ErrStats& e) { return e.finite && e.rel <= 3 * e.naive_rel + 1e-4; }

// Runs one case; one PASS/FAIL line. Returns 1 when it fails, else 0.
int RunCase(const Case& c, const DeviceInfo& dev, uint64_t seed) {
  FlashParams p = CaseParams(c);
  p.deterministic = c.det;
  if (c.scale > 0.f) {
    p.softmax_scale = c.scale;
    p.softmax_scale_log2 = c.scale * 1.4426950408889634f;
  }
  HostVariants var;
  {
    std::mt19937_64 option_rng(seed ^ 0xa11b1);
    MakeHostVariants(p, c.softcap, c.alibi, 0, option_rng, &var);
    MakeHostDropout(p, c.dropout, option_rng, &var);
  }
  p.softcap = c.softcap;
  const DType dt = c.dtype;
  const int64_t B = c.B, T = c.T, S = c.S, H = c.H, K = c.K, D = c.D, G = H / K;
  const WindowMask mask = MakeWindowMask(p);
  const double scale = p.softmax_scale;
  const int64_t nq = B * T * H * D, nk = B * S * K * D, nl = B * H * T;
  auto qi = [&](int64_t b, int64_t t, int64_t h) {
    return Off(p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, t, h, 0);
  };
  auto ki = [&](int64_t b, int64_t s, int64_t kh) {
    return Off(p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, s, kh, 0);
  };
  auto li = [&](int64_t b, int64_t h, int64_t t) { return (b * H + h) * T + t; };

  std::mt19937_64 rng(seed);
  std::vector<int32_t> q_ids, kv_ids;
  if (c.seg != SegKind::kNone) MakeSegmentIds(c.seg, c.docs, B, T, S, rng, &q_ids, &kv_ids);
  // The window and, with segment ids, equal ids.
  auto allowed = [&](int64_t b, int64_t t, int64_t s) {
    return mask.Allowed(t, s) && (q_ids.empty() || q_ids[b * T + t] == kv_ids[b * S + s]);
  };
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](int64_t n, std::vector<uint16_t>& bits, std::vector<double>& val) {
    bits.resize(n);
    val.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      bits[i] = ToBits(dt, normal(rng));
      val[i] = FromBits(dt, bits[i]);
    }
  };
  std::vector<uint16_t> hq, hk, hv, hdo;
  std::vector<double> q, k, v, d_o;
  random(nq, hq, q);
  random(nk, hk, k);
  random(nk, hv, v);
  random(nq, hdo, d_o);
  std::vector<float> d_lse(nl, 0.f);
  if (c.dlse) {
    for (float& x : d_lse) x = normal(rng);
  }

  // float64 forward: O (rounded to the dtype), LSE (fp32; -inf for a row that
  // sees no key, as the forward emits).
  std::vector<uint16_t> ho(nq);
  std::vector<double> o(nq);
  std::vector<float> lse(nl);
  ParallelFor(B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H, kh = h / G;
    std::vector<double> sc(S), acc(D);
    for (int64_t t = 0; t < T; ++t) {
      double m = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        sc[s] = -INFINITY;
        if (!allowed(b, t, s)) continue;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += q[qi(b, t, h) + d] * k[ki(b, s, kh) + d];
        sc[s] = VariantScore(p, var, b, t, h, s, dot * scale);
        m = std::max(m, sc[s]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double l = 0;
      if (m != -INFINITY) {
        for (int64_t s = 0; s < S; ++s) {
          if (sc[s] == -INFINITY) continue;
          const double w = std::exp(sc[s] - m);
          l += w;  // undropped: the LSE is of the undropped softmax
          // O = (Z o P / (1 - rate)) V (z = 1 without dropout).
          const double wz = w * DropoutFactor(p, var, b, h, t, s);
          for (int64_t d = 0; d < D; ++d) acc[d] += wz * v[ki(b, s, kh) + d];
        }
      }
      lse[li(b, h, t)] = m == -INFINITY ? -INFINITY : static_cast<float>(m + std::log(l));
      for (int64_t d = 0; d < D; ++d) {
        ho[qi(b, t, h) + d] = ToBits(dt, static_cast<float>(l > 0 ? acc[d] / l : 0.0));
        o[qi(b, t, h) + d] = FromBits(dt, ho[qi(b, t, h) + d]);
      }
    }
  });

  // float64 backward and the same-dtype naive one; one (b, K/V head) per task
  // (its dk, dv rows and its group's dq rows are disjoint from the others').
  std::vector<double> dq(nq, 0), dk(nk, 0), dv(nk, 0), dqn(nq, 0), dkn(nk, 0), dvn(nk, 0);
  ParallelFor(B * K, [&](int64_t bk) {
    const int64_t b = bk / K, kh = bk % K;
    std::vector<double> pr(S), ds(S), z(S);
    for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const double L = lse[li(b, h, t)];
        if (L == -INFINITY) continue;  // no key visible: P = 0, all gradients 0
        const double* qr = &q[qi(b, t, h)];
        const double* dor = &d_o[qi(b, t, h)];
        double Di = -d_lse[li(b, h, t)];
        for (int64_t d = 0; d < D; ++d) Di += dor[d] * o[qi(b, t, h) + d];
        for (int64_t s = 0; s < S; ++s) {
          pr[s] = ds[s] = 0;
          if (!allowed(b, t, s)) continue;
          double dot = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += qr[d] * k[ki(b, s, kh) + d];
            dp += dor[d] * v[ki(b, s, kh) + d];
          }
          double dcap;  // d score / d (scale q.k): the cap's 1 - tanh^2
          pr[s] = std::exp(VariantScore(p, var, b, t, h, s, dot * scale, &dcap) - L);
          // Dropout: dS = P o (Z o dP / (1 - rate) - D), dV = (Z o P / (1 - rate))^T dO.
          z[s] = DropoutFactor(p, var, b, h, t, s);
          ds[s] = pr[s] * (z[s] * dp - Di) * dcap;
        }
        for (int64_t s = 0; s < S; ++s) {
          if (pr[s] == 0 && ds[s] == 0) continue;
          const double pn = RoundTo(dt, static_cast<float>(pr[s]));
          const double dsn = RoundTo(dt, static_cast<float>(ds[s]));
          const double* kr = &k[ki(b, s, kh)];
          for (int64_t d = 0; d < D; ++d) {
            dq[qi(b, t, h) + d] += scale * ds[s] * kr[d];
            dqn[qi(b, t, h) + d] += scale * dsn * kr[d];
            dk[ki(b, s, kh) + d] += scale * ds[s] * qr[d];
            dkn[ki(b, s, kh) + d] += scale * dsn * qr[d];
            dv[ki(b, s, kh) + d] += z[s] * pr[s] * dor[d];
            dvn[ki(b, s, kh) + d] += z[s] * pn * dor[d];
          }
        }
      }
    }
  });

  void* d_ids = nullptr;
  if (!q_ids.empty()) d_ids = UploadSegmentIds(q_ids, kv_ids, &p);
  // One buffer: the dropout seeds [B, H, 2], then the ALiBi slopes.
  float* d_slopes = nullptr;
  const size_t seed_words = var.dropout_seeds.size();
  if (c.alibi || seed_words > 0) {
    CHECK_CUDA(cudaMalloc(&d_slopes, (seed_words + var.alibi.size()) * sizeof(float)));
  }
  if (seed_words > 0) {
    CHECK_CUDA(cudaMemcpy(d_slopes, var.dropout_seeds.data(), seed_words * 4,
                          cudaMemcpyHostToDevice));
    SetDropout(var, d_slopes, &p);
  }
  if (c.alibi) {
    CHECK_CUDA(cudaMemcpy(d_slopes + seed_words, var.alibi.data(),
                          var.alibi.size() * sizeof(float), cudaMemcpyHostToDevice));
    p.alibi_slopes = d_slopes + seed_words;
  }
  if (!cuda::Sm90BackwardSupports(p)) {
    std::printf("FAIL %-57s Sm90BackwardSupports is false\n", c.name.c_str());
    if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));
    return 1;
  }
  void *d_q, *d_k, *d_v, *d_out, *d_dout, *d_dq, *d_dk, *d_dv, *d_scratch;
  float *d_lse_buf, *d_dlse_buf;
  CHECK_CUDA(cudaMalloc(&d_q, nq * 2));
  CHECK_CUDA(cudaMalloc(&d_k, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_v, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_out, nq * 2));
  CHECK_CUDA(cudaMalloc(&d_dout, nq * 2));
  CHECK_CUDA(cudaMalloc(&d_dq, nq * 2));
  CHECK_CUDA(cudaMalloc(&d_dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_dv, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_lse_buf, nl * 4));
  CHECK_CUDA(cudaMalloc(&d_dlse_buf, nl * 4));
  CHECK_CUDA(cudaMemcpy(d_q, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_v, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_out, ho.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_dout, hdo.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_lse_buf, lse.data(), nl * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_dlse_buf, d_lse.data(), nl * 4, cudaMemcpyHostToDevice));
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
  DeviceInfo run_dev = dev;
  if (c.sm_count > 0) run_dev.sm_count = c.sm_count;
  const size_t scratch_bytes = ScratchBytes(p, run_dev);
  CHECK_CUDA(cudaMalloc(&d_scratch, scratch_bytes));
  auto free_all = [&] {
    for (void* ptr : {d_q, d_k, d_v, d_out, d_dout, d_dq, d_dk, d_dv, d_scratch,
                      static_cast<void*>(d_lse_buf), static_cast<void*>(d_dlse_buf), d_ids}) {
      if (ptr) CHECK_CUDA(cudaFree(ptr));
    }
    if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));
  };
  // Poison: 0xffff is NaN in fp16 and bf16; 0xffffffff is NaN in fp32.
  CHECK_CUDA(cudaMemset(d_dq, 0xff, nq * 2));
  CHECK_CUDA(cudaMemset(d_dk, 0xff, nk * 2));
  CHECK_CUDA(cudaMemset(d_dv, 0xff, nk * 2));
  CHECK_CUDA(cudaMemset(d_scratch, 0xff, scratch_bytes));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaError_t err = RunSm90(p, d_scratch, run_dev);
  if (err == cudaSuccess) err = SyncWithWatchdog(c.name);
  if (err != cudaSuccess) {
    std::printf("FAIL %-57s %s\n", c.name.c_str(), cudaGetErrorString(err));
    if (err != cudaErrorInvalidValue && err != cudaErrorNotSupported) {
      std::printf("(sticky device error: stopping)\n");
      std::fflush(stdout);
      std::_Exit(1);
    }
    free_all();
    return 1;
  }
  std::vector<uint16_t> out_dq(nq), out_dk(nk), out_dv(nk);
  CHECK_CUDA(cudaMemcpy(out_dq.data(), d_dq, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out_dk.data(), d_dk, nk * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out_dv.data(), d_dv, nk * 2, cudaMemcpyDeviceToHost));

  // Deterministic: two more runs (outputs and scratch poisoned again) must
  // give the same bits. For scale, three runs without the fixed order: how
  // many of the last two differ from the first (they may agree by chance).
  std::string bits;
  bool same_bits = true;
  if (c.det) {
    struct Grads {
      std::vector<uint16_t> dq, dk, dv;
      bool operator!=(const Grads& o) const { return dq != o.dq || dk != o.dk || dv != o.dv; }
    };
    const auto run_again = [&](const FlashParams& run_p) {
      Grads g{std::vector<uint16_t>(nq), std::vector<uint16_t>(nk), std::vector<uint16_t>(nk)};
      CHECK_CUDA(cudaMemset(d_dq, 0xff, nq * 2));
      CHECK_CUDA(cudaMemset(d_dk, 0xff, nk * 2));
      CHECK_CUDA(cudaMemset(d_dv, 0xff, nk * 2));
      CHECK_CUDA(cudaMemset(d_scratch, 0xff, scratch_bytes));
      cudaError_t run_err = RunSm90(run_p, d_scratch, run_dev);
      if (run_err == cudaSuccess) run_err = SyncWithWatchdog(c.name);
      if (run_err != cudaSuccess) {
        std::printf("FAIL %-57s rerun: %s\n", c.name.c_str(), cudaGetErrorString(run_err));
        std::fflush(stdout);
        std::_Exit(1);
      }
      CHECK_CUDA(cudaMemcpy(g.dq.data(), d_dq, nq * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(g.dk.data(), d_dk, nk * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(g.dv.data(), d_dv, nk * 2, cudaMemcpyDeviceToHost));
      return g;
    };
    const Grads first{out_dq, out_dk, out_dv};
    for (int r = 0; r < 2; ++r) same_bits = !(run_again(p) != first) && same_bits;
    FlashParams plain = p;
    plain.deterministic = false;
    const Grads plain_first = run_again(plain);
    int plain_differ = 0;
    for (int r = 0; r < 2; ++r) plain_differ += run_again(plain) != plain_first ? 1 : 0;
    bits = same_bits ? "  bits: same in 3 runs" : "  bits: DIFFER in 3 runs";
    bits += " (plain: " + std::to_string(plain_differ) + " of 2 differ)";
  }

  const ErrStats eq = Compare(dt, out_dq, dq, dqn), ek = Compare(dt, out_dk, dk, dkn),
                 ev = Compare(dt, out_dv, dv, dvn);
  const bool pass = Ok(eq) && Ok(ek) && Ok(ev) && same_bits;
  std::printf(
      "%s %-57s dq %.2e (naive %.2e)%s  dk %.2e (naive %.2e)%s  dv %.2e (naive %.2e)%s%s\n",
      pass ? "PASS" : "FAIL", c.name.c_str(), eq.rel, eq.naive_rel, eq.finite ? "" : " NaN",
      ek.rel, ek.naive_rel, ek.finite ? "" : " NaN", ev.rel, ev.naive_rel,
      ev.finite ? "" : " NaN", bits.c_str());
  if (!pass) {
    // Worst element of each output, decoded by its strides (q's for dq, k's
    // for dk and dv): (b, row, head, d).
    auto show = [&](const char* name, const ErrStats& e, const std::vector<uint16_t>& out,
                    const std::vector<double>& ref, int64_t bs, int64_t rs, int64_t hs) {
      const int64_t i = static_cast<int64_t>(e.worst);
      std::printf("     %s worst at b=%lld row=%lld head=%lld d=%lld: got %.5g want %.5g\n",
                  name, (long long)(i / bs), (long long)((i % bs) / rs),
                  (long long)((i % rs) / hs), (long long)(i % hs), FromBits(dt, out[i]),
                  ref[i]);
    };
    if (c.bhtd) {
      // Row and head strides are swapped; decode b, head, row, d instead.
      std::printf("     (bhtd layout: 'row' and 'head' below are head and row)\n");
      show("dq", eq, out_dq, dq, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
      show("dk", ek, out_dk, dk, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
      show("dv", ev, out_dv, dv, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
    } else {
      show("dq", eq, out_dq, dq, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
      show("dk", ek, out_dk, dk, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
      show("dv", ev, out_dv, dv, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
    }
  }
  std::fflush(stdout);
  free_all();
  return pass ? 0 : 1;
}

// The whole backward (preprocess, main, convert) by both paths, bf16;
// TFLOP/s = 2.5 * 4 B T S H D / t (5 products of 2 B T S H D flops each),
// halved when causal.
bool g_time_sm80 = true;  // --no-sm80 clears it

void TimeCase(const Case& c, const DeviceInfo& dev) {
  FlashParams p = CaseParams(c);
  std::vector<void*> bufs = AllocBackwardTimingBuffers(&p);
  p.softcap = c.softcap;
  if (c.alibi) {
    const std::vector<float> slopes(c.B * c.H, 0.05f);
    float* d_slopes;
    CHECK_CUDA(cudaMalloc(&d_slopes, slopes.size() * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(d_slopes, slopes.data(), slopes.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
    p.alibi_slopes = d_slopes;
    bufs.push_back(d_slopes);
  }
  if (c.dropout > 0.f) {
    HostVariants var;
    std::mt19937_64 rng(7);
    MakeHostDropout(p, c.dropout, rng, &var);
    void* d_seeds;
    CHECK_CUDA(cudaMalloc(&d_seeds, var.dropout_seeds.size() * 4));
    CHECK_CUDA(cudaMemcpy(d_seeds, var.dropout_seeds.data(), var.dropout_seeds.size() * 4,
                          cudaMemcpyHostToDevice));
    SetDropout(var, d_seeds, &p);
    bufs.push_back(d_seeds);
  }
  std::vector<int32_t> q_ids, kv_ids;
  if (c.seg != SegKind::kNone) {
    std::mt19937_64 id_rng(11);
    MakeSegmentIds(c.seg, c.docs, c.B, c.T, c.S, id_rng, &q_ids, &kv_ids);
    bufs.push_back(UploadSegmentIds(q_ids, kv_ids, &p));
  }
  if (!cuda::Sm90BackwardSupports(p)) {  // a build without the options (a baseline's)
    std::printf("SKIP %s: Sm90BackwardSupports is false\n", c.name.c_str());
    for (void* ptr : bufs) CHECK_CUDA(cudaFree(ptr));
    return;
  }
  void* scratch;
  CHECK_CUDA(cudaMalloc(&scratch, ScratchBytes(p, dev)));
  double flops = 2.5 * 4.0 * c.B * c.T * c.S * c.H * c.D;
  if (c.wr == 0) flops /= 2;
  if (c.seg != SegKind::kNone) {  // the documents' visible pairs only
    flops = 2.5 * 4.0 * VisiblePairs(q_ids, c.B, c.T, c.wr == 0) * c.H * c.D;
  }
  auto time = [&](const char* impl, auto run) {
    const std::vector<float> ms = TimeRuns(c.name + " [" + impl + "]", 15, run);
    const double med = ms[ms.size() / 2];
    std::printf("TIME %-32s %-11s %8.3f ms  %6.1f TFLOP/s\n", c.name.c_str(), impl, med,
                flops / med / 1e9);
    std::fflush(stdout);
  };
  if (c.det) {
    // The deterministic backward beside the plain one (both sm90).
    FlashParams det = p;
    det.deterministic = true;
    time("sm90", [&](int) { return RunSm90(p, scratch, dev); });
    time("sm90 det", [&](int) { return RunSm90(det, scratch, dev); });
    for (void* ptr : bufs) CHECK_CUDA(cudaFree(ptr));
    CHECK_CUDA(cudaFree(scratch));
    return;
  }
  if (g_time_sm80) time("sm80", [&](int) { return cuda::RunBackward(p, scratch, dev, 0); });
  time("sm90", [&](int) { return RunSm90(p, scratch, dev); });
  if (cuda::Sm90BackwardStreamKSlots(p, dev) > 0 && p.q_segment_ids == nullptr) {
    // The same grid without the stream-K tail (whole tiles only; with
    // segment ids the slots hold the pre-pass's summaries instead).
    time("sm90 whole", [&](int) { return RunSm90(p, scratch, dev, true); });
  }
  if (c.wl < 0 && c.wr < 0 && cuda::sm90::BwdSm90TileFor(c.D).persistent) {
    // The same kernel with one CTA per tile (the grid of masked calls).
    DeviceInfo tile_dev = dev;
    tile_dev.sm_count = 1 << 24;
    time("sm90 1/tile", [&](int) { return RunSm90(p, scratch, tile_dev); });
  }
  for (void* ptr : bufs) CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaFree(scratch));
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode, filter;
  bool no_time = false, time_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--filter" && i + 1 < argc) {
      filter = argv[++i];
    } else if (a == "--no-time") {
      no_time = true;
    } else if (a == "--time-only") {
      time_only = true;
    } else if (a == "--no-sm80") {
      g_time_sm80 = false;
    } else {
      mode = a;
    }
  }
  if (mode == "--probe") return 0;
  const bool tiny = mode == "--tiny";
  DeviceInfo dev;
  CHECK_CUDA(cuda::GetCurrentDeviceInfo(&dev));
  std::printf("device sm_%d%d, %d SMs, %zu B smem opt-in\n", dev.cc_major, dev.cc_minor,
              dev.sm_count, dev.max_smem_per_block_optin);
  if (dev.cc_major != 9) {
    std::printf("FAIL: needs a cc 9.0 device\n");
    return 1;
  }
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cases;
  if (tiny) {
    cases = {
        {"tiny bf16 d128 T70 S130 causal", bf, 1, 70, 130, 1, 1, 128, -1, 0},
        {"tiny fp16 d64 T33 S47 causal gqa2 dlse", fp, 1, 33, 47, 4, 2, 64, -1, 0, true},
        {"tiny bf16 d128 T200 S100 causal (empty rows)", bf, 1, 200, 100, 2, 2, 128, -1, 0},
        {"tiny bf16 d64 T130 S200 window(64,16) bhtd", bf, 1, 130, 200, 2, 2, 64, 64, 16, false,
         true},
        {"tiny bf16 d64 T70 S300 full gqa2 (2 CTAs)", bf, 1, 70, 300, 2, 1, 64, -1, -1, false,
         false, 2},
        {"tiny fp16 d64 T33 S200 B2 full dlse (1 CTA)", fp, 2, 33, 200, 1, 1, 64, -1, -1, true,
         false, 1},
        // Stream-K at D = 128: 3 tiles on "2 SMs", each CTA a tile and a half.
        {"tiny fp16 d128 T100 S300 full gqa2 (stream-K, 2 SMs)", fp, 1, 100, 300, 2, 1, 128, -1,
         -1, false, false, 2},
        // Head dims below a tile's (its maps zero-fill the columns past D).
        {"tiny bf16 d96 T70 S200 causal gqa2 bhtd", bf, 1, 70, 200, 2, 1, 96, -1, 0, false, true},
        {"tiny fp16 d40 T100 S300 full dlse (stream-K, 2 SMs)", fp, 1, 100, 300, 2, 2, 40, -1, -1,
         true, false, 2},
        // The D-split kernel (D = 256 and its bucket).
        {"tiny bf16 d256 T70 S130 causal gqa2", bf, 1, 70, 130, 2, 1, 256, -1, 0},
        {"tiny fp16 d200 T150 S100 full dlse bhtd", fp, 1, 150, 100, 1, 1, 200, -1, -1, true, true},
        {"tiny seg 7 docs bf16 d64 T300 causal", bf, 1, 300, 300, 2, 2, 64, -1, 0, false, false,
         0, SegKind::kPacked, 7},
        {"tiny seg random fp16 d128 T200 S130 gqa2 dlse", fp, 1, 200, 130, 2, 1, 128, -1, -1,
         true, false, 0, SegKind::kRandom, 0},
        {"tiny seg short docs bf16 d256 T150 causal", bf, 1, 150, 150, 2, 2, 256, -1, 0, false,
         false, 0, SegKind::kShort, 0},
        {"opt tiny bf16 d64 T70 S300 causal gqa2 softcap10+alibi s1", bf, 1, 70, 300, 2, 1, 64, -1, 0, false, false, 0, SegKind::kNone, 0, 10.f, true, 1.f},
        {"opt tiny fp16 d128 T100 S300 full softcap20 dlse (stream-K, 2 SMs) s1", fp, 1, 100, 300, 2, 1, 128, -1, -1, true, false, 2, SegKind::kNone, 0, 20.f, false, 1.f},
        {"opt tiny bf16 d256 T70 S130 causal gqa2 softcap30+alibi s1", bf, 1, 70, 130, 2, 1, 256, -1, 0, false, false, 0, SegKind::kNone, 0, 30.f, true, 1.f},
        {"opt tiny bf16 d128 T200 S100 causal alibi (empty rows)", bf, 1, 200, 100, 2, 2, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, true},
        {"drop tiny bf16 d64 T70 S300 causal gqa2 drop0.2", bf, 1, 70, 300, 2, 1, 64, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.2f},
        {"drop tiny fp16 d128 T100 S300 full dlse drop0.1 (stream-K, 2 SMs)", fp, 1, 100, 300, 2, 1, 128, -1, -1, true, false, 2, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop tiny bf16 d128 T200 S100 causal softcap10+alibi drop0.3 (empty rows) s1", bf, 1, 200, 100, 2, 2, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 10.f, true, 1.f, 0.3f},
        {"drop tiny seg 7 docs bf16 d64 T300 causal drop0.1", bf, 1, 300, 300, 2, 2, 64, -1, 0, false, false, 0, SegKind::kPacked, 7, 0.f, false, 0.f, 0.1f},
        // The deterministic backward: its counters and waits, each kernel.
        Det({"tiny bf16 d128 T200 S600 causal gqa2", bf, 1, 200, 600, 2, 1, 128, -1, 0}),
        Det({"tiny fp16 d64 T100 S700 full dlse (2 CTAs)", fp, 1, 100, 700, 2, 2, 64, -1, -1, true,
             false, 2}),
        Det({"tiny bf16 d64 T150 S500 window(100,-1)", bf, 1, 150, 500, 2, 2, 64, 100, -1}),
        Det({"tiny bf16 d64 T300 S300 full gqa2 (rotated)", bf, 1, 300, 300, 2, 1, 64, -1, -1}),
        Det({"tiny fp16 d128 T200 S250 B2 full dlse (4 SMs, rotated)", fp, 2, 200, 250, 2, 2, 128,
             -1, -1, true, false, 4}),
        Det({"tiny fp16 d256 T130 S300 window(100,20) gqa2", fp, 1, 130, 300, 2, 1, 256, 100,
             20}),
    };
  } else if (!time_only) {
    cases = {
        // Smoke: whole blocks, no mask.
        {"bf16 d128 T128 S128 full", bf, 1, 128, 128, 1, 1, 128, -1, -1},
        {"bf16 d64 T128 S128 full", bf, 1, 128, 128, 1, 1, 64, -1, -1},
        {"fp16 d128 T64 S256 full", fp, 1, 64, 256, 2, 2, 128, -1, -1},
        // Odd lengths, T != S, causal.
        {"bf16 d128 T257 S300 causal", bf, 1, 257, 300, 2, 2, 128, -1, 0},
        {"fp16 d64 T257 S300 full", fp, 1, 257, 300, 2, 2, 64, -1, -1},
        {"fp16 d128 T64 S64 causal dlse", fp, 1, 64, 64, 2, 2, 128, -1, 0, true},
        {"bf16 d64 T1 S1 full", bf, 1, 1, 1, 1, 1, 64, -1, -1},
        // GQA 4:1, MQA.
        {"bf16 d64 T1000 S1000 causal gqa4 dlse", bf, 1, 1000, 1000, 8, 2, 64, -1, 0, true},
        {"fp16 d128 T1000 S257 full gqa4 dlse", fp, 1, 1000, 257, 8, 2, 128, -1, -1, true},
        {"bf16 d128 T17 S1000 full mqa", bf, 1, 17, 1000, 4, 1, 128, -1, -1},
        // Empty rows (T > S causal), short S.
        {"bf16 d128 T300 S100 causal (empty rows)", bf, 2, 300, 100, 2, 2, 128, -1, 0},
        {"fp16 d64 T257 S100 causal (empty rows)", fp, 1, 257, 100, 2, 1, 64, -1, 0},
        {"bf16 d64 T1000 S17 causal", bf, 1, 1000, 17, 2, 2, 64, -1, 0},
        // Windows.
        {"bf16 d128 T1000 S1000 window(128,32)", bf, 1, 1000, 1000, 2, 2, 128, 128, 32},
        {"fp16 d64 T300 S1000 window(64,0)", fp, 1, 300, 1000, 2, 2, 64, 64, 0},
        {"fp16 d128 T1000 S1000 window(-1,100) gqa2", fp, 1, 1000, 1000, 4, 2, 128, -1, 100},
        // B * H large; [B, H, T, D] strides.
        {"bf16 d128 T512 S512 B2 H16 causal", bf, 2, 512, 512, 16, 16, 128, -1, 0},
        {"fp16 d64 T384 S384 B3 H12 gqa3 full", fp, 3, 384, 384, 12, 4, 64, -1, -1},
        {"fp16 d128 T257 S257 causal gqa2 bhtd", fp, 1, 257, 257, 4, 2, 128, -1, 0, false, true},
        {"bf16 d64 T300 S500 full bhtd dlse", bf, 2, 300, 500, 2, 2, 64, -1, -1, true, true},
        // Persistent grids of a few CTAs (several tiles each; unmasked D = 64).
        {"bf16 d64 T300 S700 B2 H4 gqa2 full (3 CTAs)", bf, 2, 300, 700, 4, 2, 64, -1, -1, false,
         false, 3},
        {"fp16 d64 T257 S1000 B2 H6 gqa3 full dlse bhtd (5 CTAs)", fp, 2, 257, 1000, 6, 2, 64, -1,
         -1, true, true, 5},
        {"bf16 d64 T1 S300 full mqa (2 CTAs)", bf, 1, 1, 300, 4, 1, 64, -1, -1, false, false, 2},
        {"fp16 d64 T100 S129 B3 H2 full (1 CTA)", fp, 3, 100, 129, 2, 2, 64, -1, -1, false, false,
         1},
        // Stream-K tails (unmasked, tiles not a multiple of the "SMs"): the
        // 5-CTA and 2-CTA D = 64 cases above run them too.
        {"bf16 d128 T300 S1000 B2 H4 gqa2 full (stream-K, 3 SMs)", bf, 2, 300, 1000, 4, 2, 128,
         -1, -1, false, false, 3},
        {"fp16 d128 T257 S700 H3 mqa dlse bhtd (stream-K, 4 SMs)", fp, 1, 257, 700, 3, 1, 128, -1,
         -1, true, true, 4},
        {"bf16 d64 T200 S1000 B3 H2 full (stream-K, 7 SMs)", bf, 3, 200, 1000, 2, 2, 64, -1, -1,
         false, false, 7},
        // Head dims run by the next tile's kernel (D 64 or 128), the maps
        // zero-filling the columns past D: every path above once more.
        {"bf16 d96 T257 S300 causal gqa2", bf, 1, 257, 300, 4, 2, 96, -1, 0},
        {"fp16 d120 T1000 S257 full gqa4 dlse bhtd", fp, 1, 1000, 257, 8, 2, 120, -1, -1, true,
         true},
        {"bf16 d72 T300 S1000 B2 H4 gqa2 full (stream-K, 3 SMs)", bf, 2, 300, 1000, 4, 2, 72, -1,
         -1, false, false, 3},
        {"fp16 d40 T257 S1000 B2 H6 gqa3 full dlse (5 CTAs)", fp, 2, 257, 1000, 6, 2, 40, -1, -1,
         true, false, 5},
        {"bf16 d8 T300 S500 window(64,0) mqa", bf, 1, 300, 500, 4, 1, 8, 64, 0},
        {"fp16 d56 T1000 S1000 causal bhtd", fp, 1, 1000, 1000, 2, 2, 56, -1, 0, false, true},
        // The D-split kernel (D = 256; D 136-248 by its tile, the maps
        // zero-filling the columns past D).
        {"bf16 d256 T64 S64 full", bf, 1, 64, 64, 1, 1, 256, -1, -1},
        {"fp16 d256 T257 S300 causal", fp, 1, 257, 300, 2, 2, 256, -1, 0},
        {"bf16 d256 T1000 S257 full gqa4 dlse", bf, 1, 1000, 257, 8, 2, 256, -1, -1, true},
        {"fp16 d256 T17 S1000 full mqa", fp, 1, 17, 1000, 4, 1, 256, -1, -1},
        {"bf16 d256 T300 S100 B2 causal (empty rows)", bf, 2, 300, 100, 2, 2, 256, -1, 0},
        {"fp16 d256 T1000 S1000 window(128,32) bhtd", fp, 1, 1000, 1000, 2, 2, 256, 128, 32, false,
         true},
        {"bf16 d256 T1 S1 full", bf, 1, 1, 1, 1, 1, 256, -1, -1},
        {"bf16 d256 T512 S512 B2 H8 causal gqa2 dlse", bf, 2, 512, 512, 8, 4, 256, -1, 0, true},
        {"fp16 d200 T257 S700 causal gqa2 bhtd", fp, 1, 257, 700, 4, 2, 200, -1, 0, false, true},
        {"bf16 d136 T300 S257 full dlse", bf, 1, 300, 257, 2, 2, 136, -1, -1, true},
        // Segment ids (packed rows): 1, 2, 7 and 64 documents, empty ones,
        // documents shorter than a block, padding, unsorted ids, T != S
        // (some documents without keys or without queries), GQA, windows,
        // every tile.
        {"seg 1 doc bf16 d128 T1000 causal", bf, 1, 1000, 1000, 2, 2, 128, -1, 0, false, false,
         0, SegKind::kPacked, 1},
        {"seg 2 docs fp16 d64 T1000 B2 causal dlse", fp, 2, 1000, 1000, 2, 2, 64, -1, 0, true,
         false, 0, SegKind::kPacked, 2},
        {"seg 7 docs bf16 d128 T2000 causal gqa4", bf, 1, 2000, 2000, 8, 2, 128, -1, 0, false,
         false, 0, SegKind::kPacked, 7},
        {"seg 64 docs bf16 d64 T4096 causal", bf, 1, 4096, 4096, 2, 2, 64, -1, 0, false, false,
         0, SegKind::kPacked, 64},
        {"seg 64 docs fp16 d128 T4096 full", fp, 1, 4096, 4096, 2, 2, 128, -1, -1, false, false,
         0, SegKind::kPacked, 64},
        {"seg 7 docs bf16 d256 T1000 causal gqa2", bf, 1, 1000, 1000, 2, 1, 256, -1, 0, false,
         false, 0, SegKind::kPacked, 7},
        {"seg short docs bf16 d64 T777 causal", bf, 1, 777, 777, 2, 2, 64, -1, 0, false, false,
         0, SegKind::kShort, 0},
        {"seg short docs fp16 d128 T500 full bhtd", fp, 1, 500, 500, 2, 2, 128, -1, -1, false,
         true, 0, SegKind::kShort, 0},
        {"seg padded 5 docs bf16 d128 T1500 B2 causal", bf, 2, 1500, 1500, 2, 2, 128, -1, 0,
         false, false, 0, SegKind::kPadded, 5},
        {"seg random ids bf16 d64 T300 full dlse", bf, 1, 300, 300, 2, 2, 64, -1, -1, true, false,
         0, SegKind::kRandom, 0},
        {"seg cross 7 docs bf16 d128 T700 S1500 gqa2", bf, 1, 700, 1500, 4, 2, 128, -1, -1,
         false, false, 0, SegKind::kPacked, 7},
        {"seg cross missing docs fp16 d64 T900 S400 B2 gqa2", fp, 2, 900, 400, 4, 2, 64, -1, -1,
         false, false, 0, SegKind::kMissing, 6},
        {"seg 7 docs bf16 d128 T2000 window(200,0)", bf, 1, 2000, 2000, 2, 2, 128, 200, 0, false,
         false, 0, SegKind::kPacked, 7},
        {"seg 7 docs fp16 d200 T700 window(64,16) bhtd", fp, 1, 700, 700, 2, 2, 200, 64, 16,
         false, true, 0, SegKind::kPacked, 7},
        // Score options (--filter opt): softcap, ALiBi and both, with causal,
        // windows, GQA, dLSE, both kernels and every head dim bucket, the
        // persistent grid, stream-K, bhtd strides, odd lengths. Scale 1 (or
        // 0.5) in the softcap cases: scores of a few tens, so the cap bends
        // them.
        {"opt bf16 d128 T257 S300 causal softcap30 s1", bf, 1, 257, 300, 2, 2, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 30.f, false, 1.f},
        {"opt fp16 d64 T257 S300 full softcap5", fp, 1, 257, 300, 2, 2, 64, -1, -1, false, false, 0, SegKind::kNone, 0, 5.f},
        {"opt bf16 d64 T1000 S1000 causal gqa4 dlse alibi", bf, 1, 1000, 1000, 8, 2, 64, -1, 0, true, false, 0, SegKind::kNone, 0, 0.f, true},
        {"opt fp16 d128 T1000 S257 full gqa4 dlse alibi", fp, 1, 1000, 257, 8, 2, 128, -1, -1, true, false, 0, SegKind::kNone, 0, 0.f, true},
        {"opt bf16 d128 T1000 S1000 window(128,32) softcap20+alibi s1", bf, 1, 1000, 1000, 2, 2, 128, 128, 32, false, false, 0, SegKind::kNone, 0, 20.f, true, 1.f},
        {"opt fp16 d64 T300 S1000 window(64,0) softcap50+alibi s1", fp, 1, 300, 1000, 2, 2, 64, 64, 0, false, false, 0, SegKind::kNone, 0, 50.f, true, 1.f},
        {"opt bf16 d64 T300 S700 B2 H4 gqa2 full softcap30 (3 CTAs) s1", bf, 2, 300, 700, 4, 2, 64, -1, -1, false, false, 3, SegKind::kNone, 0, 30.f, false, 1.f},
        {"opt bf16 d128 T300 S1000 B2 H4 gqa2 alibi (stream-K, 3 SMs)", bf, 2, 300, 1000, 4, 2, 128, -1, -1, false, false, 3, SegKind::kNone, 0, 0.f, true},
        {"opt fp16 d128 T257 S257 causal gqa2 bhtd softcap15+alibi s0.5", fp, 1, 257, 257, 4, 2, 128, -1, 0, false, true, 0, SegKind::kNone, 0, 15.f, true, 0.5f},
        {"opt bf16 d96 T257 S300 causal gqa2 softcap30 s1", bf, 1, 257, 300, 4, 2, 96, -1, 0, false, false, 0, SegKind::kNone, 0, 30.f, false, 1.f},
        {"opt bf16 d256 T1000 S257 full gqa4 dlse softcap30+alibi s0.5", bf, 1, 1000, 257, 8, 2, 256, -1, -1, true, false, 0, SegKind::kNone, 0, 30.f, true, 0.5f},
        {"opt fp16 d256 T257 S300 causal softcap10 s1", fp, 1, 257, 300, 2, 2, 256, -1, 0, false, false, 0, SegKind::kNone, 0, 10.f, false, 1.f},
        {"opt bf16 d200 T300 S100 B2 causal alibi (empty rows)", bf, 2, 300, 100, 2, 2, 200, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, true},
        {"opt fp16 d256 T1000 S1000 window(128,32) bhtd softcap50+alibi s1", fp, 1, 1000, 1000, 2, 2, 256, 128, 32, false, true, 0, SegKind::kNone, 0, 50.f, true, 1.f},
        {"opt bf16 d64 T1000 S17 causal alibi", bf, 1, 1000, 17, 2, 2, 64, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, true},
        // Dropout (--filter drop; the oracle applies flash_dropout.h's mask
        // on the host): both tiles, causal, windows, GQA, dLSE, the
        // persistent grid, stream-K, segment ids, softcap and ALiBi, bhtd.
        {"drop bf16 d128 T257 S300 causal drop0.1", bf, 1, 257, 300, 2, 2, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop fp16 d64 T257 S300 full drop0.2", fp, 1, 257, 300, 2, 2, 64, -1, -1, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.2f},
        {"drop bf16 d64 T1000 S1000 causal gqa4 dlse drop0.3", bf, 1, 1000, 1000, 8, 2, 64, -1, 0, true, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.3f},
        {"drop fp16 d128 T1000 S257 full gqa4 dlse drop0.1", fp, 1, 1000, 257, 8, 2, 128, -1, -1, true, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop bf16 d128 T1000 S1000 window(128,32) drop0.5", bf, 1, 1000, 1000, 2, 2, 128, 128, 32, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.5f},
        {"drop bf16 d64 T300 S700 B2 H4 gqa2 full drop0.1 (3 CTAs)", bf, 2, 300, 700, 4, 2, 64, -1, -1, false, false, 3, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop bf16 d128 T300 S1000 B2 H4 gqa2 drop0.1 (stream-K, 3 SMs)", bf, 2, 300, 1000, 4, 2, 128, -1, -1, false, false, 3, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop fp16 d128 T257 S257 causal gqa2 bhtd softcap15+alibi drop0.2 s0.5", fp, 1, 257, 257, 4, 2, 128, -1, 0, false, true, 0, SegKind::kNone, 0, 15.f, true, 0.5f, 0.2f},
        {"drop bf16 d64 T300 S1000 window(64,0) softcap50+alibi drop0.1 s1", bf, 1, 300, 1000, 2, 2, 64, 64, 0, false, false, 0, SegKind::kNone, 0, 50.f, true, 1.f, 0.1f},
        {"drop bf16 d96 T257 S300 causal gqa2 drop0.1", bf, 1, 257, 300, 4, 2, 96, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop seg 7 docs bf16 d128 T2000 causal gqa4 drop0.1", bf, 1, 2000, 2000, 8, 2, 128, -1, 0, false, false, 0, SegKind::kPacked, 7, 0.f, false, 0.f, 0.1f},
        {"drop seg random ids bf16 d64 T300 full dlse drop0.2", bf, 1, 300, 300, 2, 2, 64, -1, -1, true, false, 0, SegKind::kRandom, 0, 0.f, false, 0.f, 0.2f},
        {"drop bf16 d64 T1000 S17 causal drop0.1", bf, 1, 1000, 17, 2, 2, 64, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        // The deterministic backward (--filter det): many key blocks per
        // query block, causal and not, GQA, windows whose left edge makes a
        // query block's first key block a later one (and leaves leading key
        // blocks without queries), empty rows, the persistent grid of a few
        // CTAs (which wait on each other's earlier tiles), a grid that would
        // take stream-K, segment ids, the score options, both kernels.
        Det({"bf16 d128 T1000 S2000 causal gqa2", bf, 1, 1000, 2000, 4, 2, 128, -1, 0}),
        Det({"fp16 d128 T1000 S1500 B2 H4 full gqa2 dlse", fp, 2, 1000, 1500, 4, 2, 128, -1, -1,
             true}),
        Det({"bf16 d64 T1000 S1000 causal", bf, 1, 1000, 1000, 2, 2, 64, -1, 0}),
        Det({"fp16 d64 T777 S1500 B2 H4 full gqa4 (5 CTAs)", fp, 2, 777, 1500, 4, 1, 64, -1, -1,
             false, false, 5}),
        Det({"bf16 d64 T300 S2000 full bhtd (1 CTA)", bf, 1, 300, 2000, 2, 2, 64, -1, -1, false,
             true, 1}),
        Det({"bf16 d128 T300 S1000 B2 H4 gqa2 full (no stream-K, 3 SMs)", bf, 2, 300, 1000, 4, 2,
             128, -1, -1, false, false, 3}),
        Det({"fp16 d128 T1000 S1000 window(300,50) gqa2", fp, 1, 1000, 1000, 4, 2, 128, 300, 50}),
        Det({"bf16 d64 T300 S1000 window(64,0)", bf, 1, 300, 1000, 2, 2, 64, 64, 0}),
        Det({"fp16 d64 T300 S1000 window(200,-1) dlse", fp, 1, 300, 1000, 2, 2, 64, 200, -1,
             true}),
        Det({"bf16 d128 T300 S100 B2 causal (empty rows)", bf, 2, 300, 100, 2, 2, 128, -1, 0}),
        Det({"bf16 d96 T257 S1000 full mqa", bf, 1, 257, 1000, 4, 1, 96, -1, -1}),
        // The rotated order (unmasked; whole groups of key blocks per round):
        // two rounds of two groups, a grid of 16 on 17 SMs, three groups per
        // round with a partial last round, and an SM count that falls back
        // to the descending order (20 % 8 > 20 / 8).
        Det({"fp16 d64 T1000 S1000 B2 H4 full gqa2 (16 SMs, rotated)", fp, 2, 1000, 1000, 4, 2,
             64, -1, -1, false, false, 16}),
        Det({"bf16 d128 T700 S1000 full mqa dlse (17 SMs, rotated)", bf, 1, 700, 1000, 4, 1, 128,
             -1, -1, true, false, 17}),
        Det({"bf16 d128 T1000 S1000 B2 H4 full gqa2 (24 SMs, rotated)", bf, 2, 1000, 1000, 4, 2,
             128, -1, -1, false, false, 24}),
        Det({"fp16 d64 T1000 S1000 B2 H2 full (20 SMs)", fp, 2, 1000, 1000, 2, 2, 64, -1, -1,
             false, false, 20}),
        Det({"bf16 d256 T700 S1000 causal gqa2", bf, 1, 700, 1000, 4, 2, 256, -1, 0}),
        Det({"fp16 d256 T500 S700 window(128,32) bhtd", fp, 1, 500, 700, 2, 2, 256, 128, 32, false,
             true}),
        Det({"seg 7 docs bf16 d128 T2000 causal gqa4", bf, 1, 2000, 2000, 8, 2, 128, -1, 0, false,
             false, 0, SegKind::kPacked, 7}),
        Det({"seg random ids fp16 d64 T300 S700 full", fp, 1, 300, 700, 2, 2, 64, -1, -1, false,
             false, 0, SegKind::kRandom, 0}),
        Det({"seg 7 docs bf16 d256 T1000 causal", bf, 1, 1000, 1000, 2, 2, 256, -1, 0, false, false,
             0, SegKind::kPacked, 7}),
        Det({"opt bf16 d128 T1000 S1000 causal gqa2 softcap30+alibi s1", bf, 1, 1000, 1000, 4, 2,
             128, -1, 0, false, false, 0, SegKind::kNone, 0, 30.f, true, 1.f}),
        Det({"opt fp16 d64 T500 S1500 full softcap20 s1 (3 CTAs)", fp, 1, 500, 1500, 2, 2, 64, -1,
             -1, false, false, 3, SegKind::kNone, 0, 20.f, false, 1.f}),
    };
  }
  int failed = 0, run = 0;
  uint64_t seed = 0x5eed;
  for (const Case& c : cases) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    failed += RunCase(c, dev, seed++);
    ++run;
  }
  if (run > 0) {
    std::printf("%s: %d failure(s) of %d cases\n",
                failed ? "FAILED" : "ALL PASSED", failed, run);
  }
  if (!tiny && !no_time) {
    std::printf("timings (median of 15; whole backward incl. preprocess and convert):\n");
    const std::vector<Case> timed = {
        {"B8 T=S=2048 H16 D128", bf, 8, 2048, 2048, 16, 16, 128, -1, -1},
        {"B8 T=S=2048 H16 D128 causal", bf, 8, 2048, 2048, 16, 16, 128, -1, 0},
        {"B8 T=S=2048 H32 D64", bf, 8, 2048, 2048, 32, 32, 64, -1, -1},
        {"B8 T=S=2048 H32 D64 causal", bf, 8, 2048, 2048, 32, 32, 64, -1, 0},
        {"B4 T=S=4096 H16 D128", bf, 4, 4096, 4096, 16, 16, 128, -1, -1},
        {"B4 T=S=4096 H16 D128 causal", bf, 4, 4096, 4096, 16, 16, 128, -1, 0},
        {"B4 T=S=4096 H32 D64", bf, 4, 4096, 4096, 32, 32, 64, -1, -1},
        {"B4 T=S=4096 H32 D64 causal", bf, 4, 4096, 4096, 32, 32, 64, -1, 0},
        {"B1 T=S=16384 H16 D128", bf, 1, 16384, 16384, 16, 16, 128, -1, -1},
        {"B1 T=S=16384 H16 D128 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0},
        {"B4 T=S=4096 H16 D96", bf, 4, 4096, 4096, 16, 16, 96, -1, -1},
        {"B4 T=S=4096 H8 D256", bf, 4, 4096, 4096, 8, 8, 256, -1, -1},
        {"B4 T=S=4096 H8 D256 causal", bf, 4, 4096, 4096, 8, 8, 256, -1, 0},
        {"B1 T=S=16384 H8 D256", bf, 1, 16384, 16384, 8, 8, 256, -1, -1},
        {"B16 T=S=1024 H8 D256 causal", bf, 16, 1024, 1024, 8, 8, 256, -1, 0},
        // The score options beside their plain rows above.
        {"B4 T=S=4096 H16 D128 softcap50", bf, 4, 4096, 4096, 16, 16, 128, -1, -1, false, false, 0, SegKind::kNone, 0, 50.f},
        {"B4 T=S=4096 H16 D128 causal alibi", bf, 4, 4096, 4096, 16, 16, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, true},
        {"B4 T=S=4096 H32 D64 softcap50+alibi", bf, 4, 4096, 4096, 32, 32, 64, -1, -1, false, false, 0, SegKind::kNone, 0, 50.f, true},
        {"B4 T=S=4096 H8 D256 causal softcap50", bf, 4, 4096, 4096, 8, 8, 256, -1, 0, false, false, 0, SegKind::kNone, 0, 50.f},
        // Dropout beside its plain rows (--filter T8k).
        {"B2 T=S=8192 H16 D128 causal T8k", bf, 2, 8192, 8192, 16, 16, 128, -1, 0},
        {"B2 T=S=8192 H16 D128 causal T8k drop0.1", bf, 2, 8192, 8192, 16, 16, 128, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"B2 T=S=8192 H16 D64 causal T8k", bf, 2, 8192, 8192, 16, 16, 64, -1, 0},
        {"B2 T=S=8192 H16 D64 causal T8k drop0.1", bf, 2, 8192, 8192, 16, 16, 64, -1, 0, false, false, 0, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        // Packed documents (one row of 16k) beside the same documents as a
        // batch (--filter packed; the pre-pass included).
        {"packed 64x256 H16 D128 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0, false, false, 0, SegKind::kEqual, 64},
        {"packed 64x256 H16 D128 causal batch", bf, 64, 256, 256, 16, 16, 128, -1, 0},
        {"packed 64x256 H16 D64 causal", bf, 1, 16384, 16384, 16, 16, 64, -1, 0, false, false, 0, SegKind::kEqual, 64},
        {"packed 64x256 H16 D64 causal batch", bf, 64, 256, 256, 16, 16, 64, -1, 0},
        {"packed 8x2048 H16 D128 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0, false, false, 0, SegKind::kEqual, 8},
        {"packed 8x2048 H16 D128 causal batch", bf, 8, 2048, 2048, 16, 16, 128, -1, 0},
        // The deterministic backward beside the plain one.
        Det({"B2 T=S=8192 H16 D128 causal", bf, 2, 8192, 8192, 16, 16, 128, -1, 0}),
        Det({"B2 T=S=8192 H16 D128", bf, 2, 8192, 8192, 16, 16, 128, -1, -1}),
        Det({"B2 T=S=8192 H32 D64 causal", bf, 2, 8192, 8192, 32, 32, 64, -1, 0}),
        Det({"B2 T=S=8192 H32 D64", bf, 2, 8192, 8192, 32, 32, 64, -1, -1}),
        Det({"B2 T=S=4096 H16 D64", bf, 2, 4096, 4096, 16, 16, 64, -1, -1}),
        Det({"B2 T=S=4096 H16 D128", bf, 2, 4096, 4096, 16, 16, 128, -1, -1}),
        Det({"B4 T=S=4096 H16 D128 causal gqa4", bf, 4, 4096, 4096, 16, 4, 128, -1, 0}),
        Det({"B1 T=S=16384 H16 D128", bf, 1, 16384, 16384, 16, 16, 128, -1, -1}),
        Det({"B1 T=S=16384 H16 D64 causal", bf, 1, 16384, 16384, 16, 16, 64, -1, 0}),
        Det({"B4 T=S=4096 H8 D256 causal", bf, 4, 4096, 4096, 8, 8, 256, -1, 0}),
    };
    for (const Case& c : timed) {
      if (filter.empty() || c.name.find(filter) != std::string::npos) TimeCase(c, dev);
    }
  }
  return failed ? 1 : 0;
}
