// Standalone check of the CUDA forward (RunForward) against a float64 CPU
// oracle, with the tolerance set by a plain same-dtype attention's error.
//
//   fwd_selftest            all cases + timings
//   fwd_selftest --small    small cases only, no timings (for compute-sanitizer memcheck)
//   fwd_selftest --tiny     a few small cases (for compute-sanitizer racecheck)
//   fwd_selftest --decode-time [substring]   the decode timings alone (those named so)
//   fwd_selftest --probe    exits 0 at once: checks that a carried binary loads
// JAX_FLASH2_MAX_SMEM_PER_BLOCK=101376 runs any of these with the plan of a
// 99 KB GPU (cc 8.6 / 8.9; src/test_switches.h).
//
// Outputs and scratch are poisoned with NaN before each run, so an element the
// kernels fail to write shows up as a NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "src/cuda/flash_cuda.h"
#include "src/flash_mask.h"
#include "src/flash_params.h"
#include "tests/cuda/selftest_util.h"

using namespace jax_flash2;
using namespace jax_flash2::selftest;


namespace {


struct Case {
  std::string name;
  DType dtype;
  int64_t B, T, S, H, K, D;
  int64_t wl, wr;       // window; causal = (-1, 0)
  bool bhtd = false;    // [B, H, T, D] layout through strides
  float softcap = 0.f;  // score options (MakeHostVariants)
  bool alibi = false;
  int segments = 0;     // 0 none, 1 packed runs, 2 random (some queries see no key)
  float dropout = 0.f;  // dropout rate (MakeHostDropout)
};


struct Tensors {
  std::vector<float> q, k, v;  // values exactly representable in the dtype
};


// Returns true on PASS.
bool RunCase(const Case& c, const cuda::DeviceInfo& dev, uint64_t seed) {
  const FlashParams p0 = CaseParams(c);
  // The support check sees what the call will carry: dropout's seeds pointer
  // is set below, after the host mask is made, so stand in for it here.
  FlashParams checked = p0;
  static const uint32_t kSeedsStandIn[2] = {0, 0};
  if (c.dropout > 0.f) checked.dropout_seeds = kSeedsStandIn;
  const std::string why = ForwardUnsupported(checked, dev);
  if (!why.empty()) {  // every case is served, 99 KB devices included
    std::printf("FAIL %-34s unsupported: %s\n", c.name.c_str(), why.c_str());
    return false;
  }
  const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.S * c.K * c.D;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk);
  std::vector<float> fq(nq), fk(nk), fv(nk);
  // Fill by storage index: every element is written regardless of layout.
  for (int64_t i = 0; i < nq; ++i) { hq[i] = ToBits(c.dtype, normal(rng)); fq[i] = FromBits(c.dtype, hq[i]); }
  for (int64_t i = 0; i < nk; ++i) { hk[i] = ToBits(c.dtype, normal(rng)); fk[i] = FromBits(c.dtype, hk[i]); }
  for (int64_t i = 0; i < nk; ++i) { hv[i] = ToBits(c.dtype, normal(rng)); fv[i] = FromBits(c.dtype, hv[i]); }
  HostVariants var;
  MakeHostVariants(p0, c.softcap, c.alibi, c.segments, rng, &var);
  MakeHostDropout(p0, c.dropout, rng, &var);

  void *dq, *dk, *dv, *d_o, *dscratch = nullptr;
  float* dlse;
  CHECK_CUDA(cudaMalloc(&dq, nq * 2));
  CHECK_CUDA(cudaMalloc(&dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&dv, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_o, nq * 2));
  CHECK_CUDA(cudaMalloc(&dlse, c.B * c.H * c.T * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  // Poison: 0xFFFF is NaN in fp16 and bf16, 0xFFFFFFFF in fp32.
  CHECK_CUDA(cudaMemset(d_o, 0xFF, nq * 2));
  CHECK_CUDA(cudaMemset(dlse, 0xFF, c.B * c.H * c.T * sizeof(float)));

  FlashParams p = p0;
  p.softcap = var.softcap;
  std::vector<void*> option_bufs;
  auto upload = [&](const auto& host) {
    void* ptr = nullptr;
    const size_t bytes = host.size() * sizeof(host[0]);
    CHECK_CUDA(cudaMalloc(&ptr, bytes));
    CHECK_CUDA(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice));
    option_bufs.push_back(ptr);
    return ptr;
  };
  if (!var.alibi.empty()) p.alibi_slopes = static_cast<const float*>(upload(var.alibi));
  if (!var.q_ids.empty()) {
    p.q_segment_ids = static_cast<const int32_t*>(upload(var.q_ids));
    p.kv_segment_ids = static_cast<const int32_t*>(upload(var.kv_ids));
  }
  if (!var.dropout_seeds.empty()) SetDropout(var, upload(var.dropout_seeds), &p);
  p.q = dq;
  p.k = dk;
  p.v = dv;
  p.o = d_o;
  p.lse = dlse;
  const size_t scratch_bytes = cuda::ForwardScratchBytes(p, dev);
  if (scratch_bytes > 0) {
    CHECK_CUDA(cudaMalloc(&dscratch, scratch_bytes));
    CHECK_CUDA(cudaMemset(dscratch, 0xFF, scratch_bytes));
  }
  cudaError_t err = cuda::RunForward(p, dscratch, dev, 0);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("FAIL %-34s RunForward: %s\n", c.name.c_str(), cudaGetErrorString(err));
    return false;
  }
  std::vector<uint16_t> ho(nq);
  std::vector<float> hlse(c.B * c.H * c.T);
  CHECK_CUDA(cudaMemcpy(ho.data(), d_o, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hlse.data(), dlse, hlse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(d_o));
  CHECK_CUDA(cudaFree(dlse));
  if (dscratch) CHECK_CUDA(cudaFree(dscratch));
  for (void* ptr : option_bufs) CHECK_CUDA(cudaFree(ptr));

  // Oracle (float64) and naive same-dtype attention (S and P rounded to the
  // dtype, fp32 accumulation, as a framework's plain attention computes it).
  std::vector<double> err_kernel(c.B * c.H, 0.0), err_naive(c.B * c.H, 0.0),
      err_lse(c.B * c.H, 0.0);
  std::vector<int64_t> bad(c.B * c.H, 0);
  ParallelFor(c.B * c.H, [&](int64_t bh) {
    const int64_t b = bh / c.H, h = bh % c.H;
    ReferenceRowScratch row;
    for (int64_t t = 0; t < c.T; ++t) {
      const double row_lse = ReferenceRow(p, c.dtype, fq.data(), fk.data(), fv.data(), b, t, h, row, var);
      const std::vector<double>& o = row.o;
      const std::vector<float>& of = row.of;
      const double lse_ref = row_lse;
      const int64_t ob = Off(p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, t, h, 0);
      for (int64_t d = 0; d < c.D; ++d) {
        const float got = FromBits(c.dtype, ho[ob + d]);
        if (std::isnan(got)) { ++bad[bh]; continue; }
        err_kernel[bh] = std::max(err_kernel[bh], std::abs(got - o[d]));
        err_naive[bh] = std::max(err_naive[bh], std::abs(RoundTo(c.dtype, of[d]) - o[d]));
      }
      const float lse_got = hlse[(b * c.H + h) * c.T + t];
      if (std::isnan(lse_got)) {
        ++bad[bh];
      } else if (lse_ref == -INFINITY || lse_got == -INFINITY) {
        if (lse_ref != lse_got) ++bad[bh];
      } else {
        err_lse[bh] = std::max(err_lse[bh], std::abs(lse_got - lse_ref) / std::max(1.0, std::abs(lse_ref)));
      }
    }
  });
  const double ek = *std::max_element(err_kernel.begin(), err_kernel.end());
  const double en = *std::max_element(err_naive.begin(), err_naive.end());
  const double el = *std::max_element(err_lse.begin(), err_lse.end());
  int64_t nbad = 0;
  for (int64_t x : bad) nbad += x;
  // FlashAttention's criterion: no worse than twice the plain same-dtype
  // attention's max error (plus a hair for cases where that error is ~0).
  const bool ok = nbad == 0 && ek <= 2 * en + 1e-5 && el <= 1e-4;
  std::printf("%s %-34s O err %.3e (naive %.3e)  LSE rel err %.2e  nan/-inf mismatches %lld  scratch %zu B\n",
              ok ? "PASS" : "FAIL", c.name.c_str(), ek, en, el, static_cast<long long>(nbad),
              scratch_bytes);
  return ok;
}

// Median milliseconds of one RunForward over `reps` runs (each the mean of
// `batch` back-to-back calls), rotating among `sets` input copies so that L2
// does not hold the inputs between runs.
double TimeForward(const Case& c, const cuda::DeviceInfo& dev, int sets, int reps, int* splits_out,
                   int batch = 1) {
  const FlashParams p0 = CaseParams(c);
  const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.S * c.K * c.D;
  std::vector<FlashParams> ps(sets, p0);
  std::vector<void*> bufs;
  size_t scratch_bytes = 0;
  void* scratch = nullptr;
  for (int i = 0; i < sets; ++i) {
    void *q, *k, *v, *o;
    float* lse;
    CHECK_CUDA(cudaMalloc(&q, nq * 2));
    CHECK_CUDA(cudaMalloc(&k, nk * 2));
    CHECK_CUDA(cudaMalloc(&v, nk * 2));
    CHECK_CUDA(cudaMalloc(&o, nq * 2));
    CHECK_CUDA(cudaMalloc(&lse, c.B * c.H * c.T * 4));
    FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(q), nq, 1 + 3 * i,
                               c.dtype == DType::kBFloat16, 1.f);
    FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(k), nk, 2 + 3 * i,
                               c.dtype == DType::kBFloat16, 1.f);
    FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(v), nk, 3 + 3 * i,
                               c.dtype == DType::kBFloat16, 1.f);
    CHECK_CUDA(cudaGetLastError());
    ps[i].q = q; ps[i].k = k; ps[i].v = v; ps[i].o = o; ps[i].lse = lse;
    bufs.insert(bufs.end(), {q, k, v, o, lse});
  }
  scratch_bytes = cuda::ForwardScratchBytes(ps[0], dev);
  if (scratch_bytes) CHECK_CUDA(cudaMalloc(&scratch, scratch_bytes));
  *splits_out = scratch_bytes > 0;
  const std::vector<float> ms = TimeRunsBatched(
      c.name, reps, batch, [&](int r) { return cuda::RunForward(ps[r % sets], scratch, dev, 0); });
  for (void* b : bufs) CHECK_CUDA(cudaFree(b));
  if (scratch) CHECK_CUDA(cudaFree(scratch));
  return ms[reps / 2];
}


}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--probe") return 0;
  const bool tiny = mode == "--tiny";
  const bool decode_time = mode == "--decode-time";  // the decode timings alone
  const bool small = tiny || mode == "--small";
  cuda::DeviceInfo dev;
  CHECK_CUDA(cuda::GetCurrentDeviceInfo(&dev));
  std::printf("device %d: %d SMs, cc %d.%d, smem opt-in %zu\n", dev.device, dev.sm_count,
              dev.cc_major, dev.cc_minor, dev.max_smem_per_block_optin);

  int failures = 0;
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  // The decode table of benchmarks/gpu_bench.py; JAX_FLASH2_DECODE_KERNEL=0
  // times the prefill kernel's split-KV path instead.
  const std::vector<Case> decode = {
      {"decode B1 T1 S4k H32 K4 D128 bf16", bf, 1, 1, 4096, 32, 4, 128, -1, -1},
      {"decode B1 T1 S32k H32 K4 D128 bf16", bf, 1, 1, 32768, 32, 4, 128, -1, -1},
      {"decode B1 T1 S128k H32 K4 D128 bf16", bf, 1, 1, 131072, 32, 4, 128, -1, -1},
      {"decode B8 T1 S4k H32 K4 D128 bf16", bf, 8, 1, 4096, 32, 4, 128, -1, -1},
      {"decode B8 T1 S32k H32 K4 D128 bf16", bf, 8, 1, 32768, 32, 4, 128, -1, -1},
      {"decode B8 T1 S128k H32 K4 D128 bf16", bf, 8, 1, 131072, 32, 4, 128, -1, -1},
      {"decode B1 T2 S32k H32 K4 D128 causal bf16", bf, 1, 2, 32768, 32, 4, 128, -1, 0},
      {"decode B1 T4 S32k H32 K4 D128 bf16", bf, 1, 4, 32768, 32, 4, 128, -1, -1},
      {"decode B8 T4 S32k H32 K4 D128 bf16", bf, 8, 4, 32768, 32, 4, 128, -1, -1},
      {"decode B1 T8 S32k H32 K4 D128 bf16 (prefill)", bf, 1, 8, 32768, 32, 4, 128, -1, -1},
      {"decode B8 T8 S32k H32 K4 D128 bf16 (prefill)", bf, 8, 8, 32768, 32, 4, 128, -1, -1},
      {"decode B1 T16 S32k H32 K4 D128 bf16 (prefill)", bf, 1, 16, 32768, 32, 4, 128, -1, -1},
      {"decode B8 T16 S32k H32 K4 D128 bf16 (prefill)", bf, 8, 16, 32768, 32, 4, 128, -1, -1},
  };
  const std::string decode_filter = decode_time && argc > 2 ? argv[2] : "";
  auto time_decode = [&] {
    for (const Case& c : decode) {
      if (c.name.find(decode_filter) == std::string::npos) continue;
      int split;
      const double bytes = 2.0 * c.B * c.S * c.K * c.D * 2;
      // Enough copies that the rotation spans 4x the H200's 60 MB L2.
      const int sets = std::max(4, static_cast<int>(240e6 / bytes) + 1);
      const double ms = TimeForward(c, dev, sets, 30, &split, 20);
      std::printf("TIME %-44s %8.4f ms  %6.0f GB/s of K+V  (split-KV %s)\n", c.name.c_str(), ms,
                  bytes / ms / 1e6, split ? "on" : "off");
    }
  };
  if (decode_time) {
    time_decode();
    return 0;
  }
  {  // Unsupported messages (host only).
    Case c{"", DType::kFloat32, 1, 1, 1, 1, 1, 64, -1, -1};
    const bool f32 = !ForwardUnsupported(CaseParams(c), dev).empty();
    c.dtype = DType::kBFloat16;
    c.D = 264;
    const bool d264 = !ForwardUnsupported(CaseParams(c), dev).empty();
    c.D = 12;
    const bool d12 = !ForwardUnsupported(CaseParams(c), dev).empty();
    const bool ok = f32 && d264 && d12;
    std::printf("%s unsupported: float32, D=264, D=12 rejected\n", ok ? "PASS" : "FAIL");
    failures += !ok;
  }

  std::vector<Case> cases = {
      {"T1 S1 D64 bf16", bf, 1, 1, 1, 2, 2, 64, -1, -1},
      {"T17 S257 D32 causal fp16", fp, 2, 17, 257, 4, 4, 32, -1, 0},
      {"T257 S17 D128 causal bf16 (empty rows)", bf, 1, 257, 17, 2, 2, 128, -1, 0},
      {"T17 S17 D8 fp16", fp, 1, 17, 17, 2, 1, 8, -1, -1},
      {"T257 S257 D64 causal bf16 bhtd", bf, 2, 257, 257, 4, 2, 64, -1, 0, true},
      {"T100 S300 D40 window(64,16) bf16", bf, 1, 100, 300, 4, 4, 40, 64, 16},
      {"T257 S257 D192 causal MQA bf16", bf, 1, 257, 257, 4, 1, 192, -1, 0},
      {"T17 S1000 D256 fp16", fp, 1, 17, 1000, 2, 2, 256, -1, -1},
      {"T1 S2000 D128 MHA decode bf16", bf, 2, 1, 2000, 4, 4, 128, -1, -1},
      {"T5 S3000 D64 causal GQA8 fp16", fp, 1, 5, 3000, 16, 2, 64, -1, 0},
      // The decode kernel (T * group <= DecodeMaxRows rows, no score
      // options): causal over the last chunk and a ragged tail, window, T > S
      // (rows that see no key), every bucket with padded head dims, [B, H, T,
      // D] strides; two m16 tiles per block (17-32 rows).
      {"decode T2 S3001 GQA8 D128 causal fp16", fp, 2, 2, 3001, 16, 2, 128, -1, 0},
      {"decode T3 S777 GQA4 D64 win(100,0) bf16", bf, 1, 3, 777, 8, 2, 64, 100, 0},
      {"decode T1 S5000 GQA4 D256 bf16", bf, 1, 1, 5000, 4, 1, 256, -1, -1},
      {"decode T1 S1000 GQA2 D40 fp16", fp, 3, 1, 1000, 6, 3, 40, -1, -1},
      {"decode T16 S333 MHA D96 causal bf16", bf, 1, 16, 333, 4, 4, 96, -1, 0},
      {"decode T5 S3 D32 causal (empty rows) fp16", fp, 2, 5, 3, 2, 2, 32, -1, 0},
      {"decode T2 S1500 GQA4 D200 bhtd bf16", bf, 2, 2, 1500, 8, 2, 200, -1, -1, true},
      {"decode T3 S2001 GQA8 D128 causal bf16 (24 rows)", bf, 2, 3, 2001, 16, 2, 128, -1, 0},
      {"decode T4 S3000 GQA8 D64 causal fp16 (32 rows)", fp, 1, 4, 3000, 16, 2, 64, -1, 0},
      {"decode T4 S1200 GQA8 D96 win(300,0) bf16", bf, 2, 4, 1200, 8, 1, 96, 300, 0},
      {"T5 S700 GQA4 D256 causal bf16 (20 rows: prefill)", bf, 1, 5, 700, 8, 2, 256, -1, 0},
      {"decode T32 S4000 MHA D128 causal fp16 bhtd", fp, 1, 32, 4000, 2, 2, 128, -1, 0, true},
      {"decode T4 S5 GQA8 D32 causal (empty rows) bf16", bf, 2, 4, 5, 8, 1, 32, -1, 0},
  };
  // Score options: softcap, ALiBi, segment ids (packed, and random ids that
  // leave queries with no key: O = 0, LSE = -inf), alone and with causal,
  // window, GQA, odd lengths, and the split-KV / packed-decode path.
  const std::vector<Case> options = {
      {"T77 S77 D64 softcap5 bf16", bf, 2, 77, 77, 4, 4, 64, -1, -1, false, 5.f},
      {"T130 S97 D128 causal alibi GQA2 fp16", fp, 2, 130, 97, 4, 2, 128, -1, 0, false, 0.f, true},
      {"T200 S200 D32 causal packed-seg bf16", bf, 2, 200, 200, 2, 1, 32, -1, 0, false, 0.f, false,
       1},
      {"T140 S200 D64 random-seg (empty rows) fp16", fp, 1, 140, 200, 4, 4, 64, -1, -1, false, 0.f,
       false, 2},
      {"T257 S257 D128 win(80,0) all options GQA2 bf16", bf, 2, 257, 257, 4, 2, 128, 80, 0, false,
       5.f, true, 1},
      {"T200 S260 D40 softcap3 alibi seg bf16", bf, 1, 200, 260, 2, 1, 40, -1, -1, false, 3.f, true,
       1},
      {"decode T1 S3000 GQA8 D128 alibi seg bf16", bf, 1, 1, 3000, 16, 2, 128, -1, -1, false, 0.f,
       true, 2},
      {"decode T5 S2000 GQA4 D64 causal softcap fp16", fp, 2, 5, 2000, 8, 2, 64, -1, 0, false, 4.f,
       true, 1},
  };
  cases.insert(cases.end(), options.begin(), options.end());
  // Dropout (the oracle applies flash_dropout.h's mask on the host): alone,
  // causal with GQA and odd lengths, with the other options, and through the
  // split-KV and packed-GQA decode paths (absolute rows / heads recovered).
  const std::vector<Case> dropout = {
      {"T77 S77 D64 dropout0.2 bf16", bf, 2, 77, 77, 4, 4, 64, -1, -1, false, 0.f, false, 0, 0.2f},
      {"T257 S257 D128 causal GQA2 dropout0.3 fp16", fp, 1, 257, 257, 4, 2, 128, -1, 0, false, 0.f,
       false, 0, 0.3f},
      {"T130 S97 D32 causal softcap alibi seg dropout bf16", bf, 2, 130, 97, 2, 1, 32, -1, 0, false,
       4.f, true, 1, 0.1f},
      {"T100 S300 D40 win(64,16) dropout0.5 bf16", bf, 1, 100, 300, 4, 4, 40, 64, 16, false, 0.f,
       false, 0, 0.5f},
      {"T17 S1000 D256 dropout0.2 fp16", fp, 1, 17, 1000, 2, 2, 256, -1, -1, false, 0.f, false, 0,
       0.2f},
      {"decode T5 S2000 GQA4 D64 causal dropout fp16", fp, 2, 5, 2000, 8, 2, 64, -1, 0, false, 0.f,
       false, 0, 0.25f},
      {"decode T1 S3000 GQA8 D128 dropout bf16", bf, 1, 1, 3000, 16, 2, 128, -1, -1, false, 0.f,
       false, 0, 0.1f},
  };
  cases.insert(cases.end(), dropout.begin(), dropout.end());
  if (tiny) {  // one of each path: causal + empty rows, window, packed GQA split, options
    cases = {cases[1], cases[2], cases[5], cases[9], cases[10], cases[15], cases[17],
             options[3], options[6], dropout[1], dropout[4], dropout[5]};
  }
  if (!small) {
    std::vector<Case> big = {
        {"T1000 S1000 D96 MQA fp16", fp, 1, 1000, 1000, 8, 1, 96, -1, -1},
        {"T1000 S257 D80 causal GQA8 bf16", bf, 1, 1000, 257, 16, 2, 80, -1, 0},
        {"T257 S1000 D128 causal fp16", fp, 2, 257, 1000, 4, 4, 128, -1, 0},
        {"T1000 S1000 D256 causal bf16", bf, 1, 1000, 1000, 2, 1, 256, -1, 0},
        {"T1000 S1000 D200 bf16", bf, 1, 1000, 1000, 2, 2, 200, -1, -1},
        {"T1000 S1000 D32 causal fp16", fp, 1, 1000, 1000, 4, 4, 32, -1, 0},
        {"T1000 S17 D192 fp16", fp, 1, 1000, 17, 2, 2, 192, -1, -1},
        // Grids that fill the GPU: no split, one-stage pipeline over many key blocks.
        {"T2048 S2048 D128 causal GQA4 bf16 B2", bf, 2, 2048, 2048, 8, 2, 128, -1, 0},
        {"T1500 S2100 D64 fp16 B2 H12", fp, 2, 1500, 2100, 12, 12, 64, -1, -1},
        {"T1024 S1500 D256 causal fp16 B2 H8", fp, 2, 1024, 1500, 8, 8, 256, -1, 0},
        {"decode T1 S32768 H32 K4 D128 bf16", bf, 1, 1, 32768, 32, 4, 128, -1, 0},
        {"decode T16 S8000 H32 K4 D128 causal fp16", fp, 2, 16, 8000, 32, 4, 128, -1, 0},
        {"decode T4 S20000 H32 K4 D128 bf16", bf, 3, 4, 20000, 32, 4, 128, -1, -1},
        {"decode T3 S4096 win(100,0) K8 D64 bf16", bf, 1, 3, 4096, 8, 1, 64, 100, 0},
        {"decode B8 T1 S32768 H32 K4 D128 bf16", bf, 8, 1, 32768, 32, 4, 128, -1, -1},
        {"decode B3 T2 S100001 H8 K1 D64 causal fp16", fp, 3, 2, 100001, 8, 1, 64, -1, 0},
        {"T1000 S1000 D256 causal softcap alibi bf16", bf, 1, 1000, 1000, 2, 2, 256, -1, 0, false,
         10.f, true},
    };
    cases.insert(cases.end(), big.begin(), big.end());
  }
  uint64_t seed = 1234;
  for (const Case& c : cases) failures += !RunCase(c, dev, seed++);

  if (!small) {
    const std::vector<Case> prefill = {
        {"B4 T=S=4096 H16 D128 bf16", bf, 4, 4096, 4096, 16, 16, 128, -1, -1},
        {"B4 T=S=4096 H16 D128 bf16 causal", bf, 4, 4096, 4096, 16, 16, 128, -1, 0},
        {"B4 T=S=4096 H16 D64 bf16", bf, 4, 4096, 4096, 16, 16, 64, -1, -1},
        {"B2 T=S=4096 H16 D256 bf16", bf, 2, 4096, 4096, 16, 16, 256, -1, -1},
        {"B4 T=S=4096 H16 D128 bf16 (again)", bf, 4, 4096, 4096, 16, 16, 128, -1, -1},
    };
    for (const Case& c : prefill) {
      int split;
      const double ms = TimeForward(c, dev, 1, 20, &split);
      double flops = 4.0 * c.B * c.T * c.S * c.H * c.D;
      if (c.wr == 0) flops /= 2;
      std::printf("TIME %-36s %8.3f ms  %6.1f TFLOP/s\n", c.name.c_str(), ms, flops / ms / 1e9);
    }
    time_decode();
  }
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "ALL PASSED", failures);
  return failures ? 1 : 0;
}
