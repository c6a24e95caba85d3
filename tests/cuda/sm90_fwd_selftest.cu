// Standalone check of the Hopper forward (RunForwardSm90) against a float64
// CPU oracle, with the tolerance set by a plain same-dtype attention's error
// (the oracle and criterion of fwd_selftest.cu, copied here so that file
// stays untouched), then timings beside the sm80 RunForward. Every case runs
// each selected consumer schedule (Sm90Schedule: serial, overlap, pingpong)
// on the same inputs: if only overlap/pingpong fail, the bug is in their
// pipelining; if serial fails too, in what they share (TMA, descriptors,
// fragments, masking).
//
//   sm90_fwd_selftest               all cases + timings
//   sm90_fwd_selftest --small       small cases only, no timings (memcheck)
//   sm90_fwd_selftest --tiny        a few small cases (racecheck)
//   sm90_fwd_selftest --probe       exits 0 at once: checks that a carried binary loads
//   sm90_fwd_selftest --filter STR  only the cases (checked and timed) whose name
//                                   contains STR
//   sm90_fwd_selftest --package     each case under its tile's package schedule only
//                                   (the only one the package builds)
//   sm90_fwd_selftest --no-time     skip timings
//   sm90_fwd_selftest --time-only   timings only
//   sm90_fwd_selftest --no-sm80     time the sm90 kernels only (A/B runs)
//   sm90_fwd_selftest --schedules serial,overlap,pingpong
//                                   the sm90 schedules to check and time (default all)
//   sm90_fwd_selftest --tile N      run tile N (SelftestTile, sm90_fwd_variants.cuh:
//                                   the package's table, then rejected variants) where
//                                   its head dim is the case's bucket (else the
//                                   package's tile)
//   sm90_fwd_selftest --persistent 0|1
//                                   force the one-tile or the persistent grid
//   sm90_fwd_selftest --stream-k 0|1
//                                   the persistent grid's last rounds in whole tiles
//                                   or stream-K pieces (default: the package's rule)
//   sm90_fwd_selftest --grid        time the benchmark grid's shapes instead (B T = 16k,
//                                   H D = 2048), sm90 only; --filter picks among them
//
// Outputs are poisoned with NaN before each run, so an element the kernel
// fails to write shows up as a NaN. Each launch is watched (SyncWithWatchdog,
// selftest_util.h): a hung kernel (an mbarrier wait that never completes, the
// likeliest first-run failure of a TMA/mbarrier pipeline) is reported as HANG
// with the case name and the process exits, instead of stalling the device
// call. A failing case prints its worst elements (b, t, h, d, got, want) so a
// layout or descriptor error shows its pattern (which rows/columns are off).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/flash_cuda.h"
#include "src/cuda/sm90/fwd_sm90.h"
#include "src/flash_mask.h"
#include "src/flash_params.h"
#include "tests/cuda/selftest_util.h"
#include "tests/cuda/sm90_fwd_variants.cuh"
#include "tests/cuda/sm90_segments_test.h"

using namespace jax_flash2;
using namespace jax_flash2::selftest;


namespace {



struct Case {
  std::string name;
  DType dtype;
  int64_t B, T, S, H, K, D;
  int64_t wl, wr;     // window; causal = (-1, 0)
  bool bhtd = false;  // [B, H, T, D] layout through strides
  SegKind seg = SegKind::kNone;  // segment ids (sm90_segments_test.h)
  int docs = 0;
  // Score options: softcap (0 = off), ALiBi slopes in [0.01, 0.3] (random
  // per case), and a softmax scale other than 1/sqrt(D) (0 = that one), so
  // that the cap bends the scores.
  float softcap = 0.f;
  bool alibi = false;
  float scale = 0.f;
  float dropout = 0.f;  // dropout rate (0 = off; MakeHostDropout)
};

// p with c's score options: var gets the host copies (slopes and dropout
// seeds from rng), and *slopes one device buffer holding the seeds [B, H, 2]
// and then the slopes (null without either; the caller frees).
template <class Rng>
FlashParams OptionParams(const Case& c, Rng& rng, HostVariants* var, float** slopes) {
  FlashParams p = CaseParams(c);
  if (c.scale > 0.f) {
    p.softmax_scale = c.scale;
    p.softmax_scale_log2 = c.scale * 1.4426950408889634f;
  }
  MakeHostVariants(p, c.softcap, c.alibi, 0, rng, var);
  MakeHostDropout(p, c.dropout, rng, var);
  p.softcap = c.softcap;
  *slopes = nullptr;
  const size_t seed_words = var->dropout_seeds.size();
  if (c.alibi || seed_words > 0) {
    CHECK_CUDA(cudaMalloc(slopes, (seed_words + var->alibi.size()) * sizeof(float)));
  }
  if (seed_words > 0) {
    CHECK_CUDA(cudaMemcpy(*slopes, var->dropout_seeds.data(), seed_words * 4,
                          cudaMemcpyHostToDevice));
    SetDropout(*var, *slopes, &p);
  }
  if (c.alibi) {
    CHECK_CUDA(cudaMemcpy(*slopes + seed_words, var->alibi.data(),
                          var->alibi.size() * sizeof(float), cudaMemcpyHostToDevice));
    p.alibi_slopes = *slopes + seed_words;
  }
  return p;
}



struct Worst {
  double err = -1;
  int64_t b = 0, t = 0, h = 0, d = 0;
  float got = 0;
  double want = 0;
};

using cuda::sm90::Sm90Schedule;

const char* ScheduleName(Sm90Schedule s) {
  switch (s) {
    case Sm90Schedule::kSerial: return "serial";
    case Sm90Schedule::kOverlap: return "overlap";
    case Sm90Schedule::kPingpong: return "pingpong";
  }
  return "?";
}

// The schedules to check (--schedules); all three by default.
// --tile, --persistent, --stream-k: applied to every sm90 run.
int g_tile = -1;
cuda::sm90::FwdSm90Choice g_choice;

// g_tile for this head dim: a forced tile only where it fits (-1: the package's).
int TileFor(int64_t head_dim) {
  if (g_tile < 0 || g_tile >= kNumSelftestTiles ||
      SelftestTile(g_tile).head_dim != cuda::sm90::Sm90HeadDimBucket(head_dim)) {
    return -1;
  }
  return g_tile;
}

std::vector<Sm90Schedule> g_schedules = {Sm90Schedule::kSerial, Sm90Schedule::kOverlap,
                                         Sm90Schedule::kPingpong};

// --package: each case under the schedule the package builds its tile with
// (the only one the package builds).
bool g_package_schedule = false;

std::vector<Sm90Schedule> SchedulesFor(const FlashParams& p) {
  if (!g_package_schedule) return g_schedules;
  const int tile = cuda::sm90::FwdSm90PackageTileIndex(p);
  if (tile < 0) return g_schedules;
  return {SelftestTile(tile).schedule};
}

// Runs every schedule on one set of inputs, checks each against the float64
// oracle; one PASS/FAIL line per schedule. Returns the number of failures.
int RunCase(const Case& c, const cuda::DeviceInfo& dev, uint64_t seed) {
  HostVariants var;
  float* d_slopes;
  std::mt19937_64 option_rng(seed ^ 0xa11b1);
  FlashParams p0 = OptionParams(c, option_rng, &var, &d_slopes);
  std::mt19937_64 rng(seed);
  // Segment ids: host copies for the oracle, device copies for the kernel.
  void* d_ids = nullptr;
  if (c.seg != SegKind::kNone) {
    MakeSegmentIds(c.seg, c.docs, c.B, c.T, c.S, rng, &var.q_ids, &var.kv_ids);
    d_ids = UploadSegmentIds(var.q_ids, var.kv_ids, &p0);
  }
  if (!cuda::Sm90ForwardSupports(p0)) {
    std::printf("FAIL %-44s Sm90ForwardSupports is false\n", c.name.c_str());
    if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));
    return 1;
  }
  const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.S * c.K * c.D;
  const int64_t nlse = c.B * c.H * c.T;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk);
  std::vector<float> fq(nq), fk(nk), fv(nk);
  for (int64_t i = 0; i < nq; ++i) { hq[i] = ToBits(c.dtype, normal(rng)); fq[i] = FromBits(c.dtype, hq[i]); }
  for (int64_t i = 0; i < nk; ++i) { hk[i] = ToBits(c.dtype, normal(rng)); fk[i] = FromBits(c.dtype, hk[i]); }
  for (int64_t i = 0; i < nk; ++i) { hv[i] = ToBits(c.dtype, normal(rng)); fv[i] = FromBits(c.dtype, hv[i]); }

  void *dq, *dk, *dv, *d_o, *scratch = nullptr;
  float* dlse;
  const size_t scratch_bytes = VariantScratchBytes(p0, dev, TileFor(c.D), g_choice);
  if (scratch_bytes) {
    CHECK_CUDA(cudaMalloc(&scratch, scratch_bytes));
    // Poison: the kernel zeroes the flags it needs (a stale flag would hang
    // or merge garbage).
    CHECK_CUDA(cudaMemset(scratch, 0x7F, scratch_bytes));
  }
  CHECK_CUDA(cudaMalloc(&dq, nq * 2));
  CHECK_CUDA(cudaMalloc(&dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&dv, nk * 2));
  CHECK_CUDA(cudaMalloc(&d_o, nq * 2));
  CHECK_CUDA(cudaMalloc(&dlse, nlse * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  FlashParams p = p0;
  p.q = dq;
  p.k = dk;
  p.v = dv;
  p.o = d_o;
  p.lse = dlse;

  const std::vector<Sm90Schedule> schedules = SchedulesFor(p0);
  const int kNumSchedules = static_cast<int>(schedules.size());
  std::vector<std::vector<uint16_t>> ho(kNumSchedules);
  std::vector<std::vector<float>> hlse(kNumSchedules);
  std::vector<bool> launched(kNumSchedules, false);
  for (int si = 0; si < kNumSchedules; ++si) {
    const std::string what = c.name + " [" + ScheduleName(schedules[si]) + "]";
    // Poison: 0xFFFF is NaN in fp16 and bf16, 0xFFFFFFFF in fp32.
    CHECK_CUDA(cudaMemset(d_o, 0xFF, nq * 2));
    CHECK_CUDA(cudaMemset(dlse, 0xFF, nlse * sizeof(float)));
    CHECK_CUDA(cudaDeviceSynchronize());
    cudaError_t err =
        RunForwardSm90Variant(p, scratch, dev, 0, schedules[si], TileFor(c.D), g_choice);
    if (err == cudaSuccess) err = SyncWithWatchdog(what);
    if (err != cudaSuccess) {
      std::printf("FAIL %-44s RunForwardSm90: %s\n", what.c_str(), cudaGetErrorString(err));
      if (err != cudaErrorInvalidValue && err != cudaErrorNotSupported) {
        std::printf("(sticky device error: stopping)\n");
        std::fflush(stdout);
        std::_Exit(1);
      }
      continue;
    }
    launched[si] = true;
    ho[si].resize(nq);
    hlse[si].resize(nlse);
    CHECK_CUDA(cudaMemcpy(ho[si].data(), d_o, nq * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hlse[si].data(), dlse, nlse * sizeof(float), cudaMemcpyDeviceToHost));
  }
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(d_o));
  CHECK_CUDA(cudaFree(dlse));
  if (scratch) CHECK_CUDA(cudaFree(scratch));
  if (d_ids) CHECK_CUDA(cudaFree(d_ids));
  if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));

  // Oracle (float64) and naive same-dtype attention (S and P rounded to the
  // dtype, fp32 accumulation, as a framework's plain attention computes it).
  std::vector<double> ref_o(c.B * c.H * c.T * c.D), ref_lse(nlse);  // [B, H, T, (D)]
  std::vector<double> err_naive(c.B * c.H, 0.0);
  ParallelFor(c.B * c.H, [&](int64_t bh) {
    const int64_t b = bh / c.H, h = bh % c.H;
    ReferenceRowScratch row;
    for (int64_t t = 0; t < c.T; ++t) {
      const double row_lse = ReferenceRow(p, c.dtype, fq.data(), fk.data(), fv.data(), b, t, h, row,
                                          var);
      const std::vector<double>& o = row.o;
      const std::vector<float>& of = row.of;
      ref_lse[bh * c.T + t] = row_lse;
      for (int64_t d = 0; d < c.D; ++d) {
        ref_o[(bh * c.T + t) * c.D + d] = o[d];
        err_naive[bh] = std::max(err_naive[bh], std::abs(RoundTo(c.dtype, of[d]) - o[d]));
      }
    }
  });
  const double en = *std::max_element(err_naive.begin(), err_naive.end());
  // FlashAttention's criterion: no worse than twice the plain same-dtype
  // attention's max error (plus a hair for cases where that error is ~0).
  const double tol = 2 * en + 1e-5;

  int failures = 0;
  for (int si = 0; si < kNumSchedules; ++si) {
    if (!launched[si]) {
      ++failures;
      continue;
    }
    double ek = 0, el = 0;
    int64_t nbad = 0, first_bad = -1;  // first NaN/-inf mismatch, as a [B, H, T, D+1] index
    Worst worst;
    for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
      const int64_t b = bh / c.H, h = bh % c.H;
      for (int64_t t = 0; t < c.T; ++t) {
        const int64_t ob = Off(p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, t, h, 0);
        for (int64_t d = 0; d < c.D; ++d) {
          const float got = FromBits(c.dtype, ho[si][ob + d]);
          const double want = ref_o[(bh * c.T + t) * c.D + d];
          if (std::isnan(got)) {
            if (nbad++ == 0) first_bad = (bh * c.T + t) * (c.D + 1) + d;
            continue;
          }
          const double e = std::abs(got - want);
          if (e > worst.err) worst = Worst{e, b, t, h, d, got, want};
          ek = std::max(ek, e);
        }
        const float lse_got = hlse[si][(b * c.H + h) * c.T + t];
        const double lse_ref = ref_lse[bh * c.T + t];
        bool lse_bad = false;
        if (std::isnan(lse_got)) {
          lse_bad = true;
        } else if (lse_ref == -INFINITY || lse_got == -INFINITY) {
          lse_bad = lse_ref != lse_got;
        } else {
          el = std::max(el, std::abs(lse_got - lse_ref) / std::max(1.0, std::abs(lse_ref)));
        }
        if (lse_bad && nbad++ == 0) first_bad = (bh * c.T + t) * (c.D + 1) + c.D;
      }
    }
    const bool ok = nbad == 0 && ek <= tol && el <= 1e-4;
    const std::string what = c.name + " [" + ScheduleName(schedules[si]) + "]";
    std::printf("%s %-54s O err %.3e (naive %.3e)  LSE rel err %.2e  nan/-inf mismatches %lld\n",
                ok ? "PASS" : "FAIL", what.c_str(), ek, en, el, static_cast<long long>(nbad));
    if (!ok) {
      // Where it goes wrong, so a layout or descriptor error shows its
      // pattern: the worst element, the first NaN or -inf mismatch (d = D
      // means the LSE), and how many rows / columns exceed the tolerance.
      std::printf("     worst: b %lld t %lld h %lld d %lld  got %.6f want %.6f\n",
                  static_cast<long long>(worst.b), static_cast<long long>(worst.t),
                  static_cast<long long>(worst.h), static_cast<long long>(worst.d), worst.got,
                  worst.want);
      if (first_bad >= 0) {
        const int64_t d = first_bad % (c.D + 1), bht = first_bad / (c.D + 1);
        std::printf("     first nan/-inf mismatch: b %lld h %lld t %lld d %lld\n",
                    static_cast<long long>(bht / c.T / c.H),
                    static_cast<long long>(bht / c.T % c.H), static_cast<long long>(bht % c.T),
                    static_cast<long long>(d));
      }
      std::vector<int64_t> bad_cols(c.D, 0), bad_rows_mod64(64, 0);
      for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
        const int64_t b = bh / c.H, h = bh % c.H;
        for (int64_t t = 0; t < c.T; ++t) {
          const int64_t ob = Off(p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, t, h, 0);
          for (int64_t d = 0; d < c.D; ++d) {
            const float got = FromBits(c.dtype, ho[si][ob + d]);
            if (!(std::abs(got - ref_o[(bh * c.T + t) * c.D + d]) <= tol)) {
              ++bad_cols[d];
              ++bad_rows_mod64[t % 64];
            }
          }
        }
      }
      std::printf("     bad elements by column d:");
      for (int64_t d = 0; d < c.D; ++d) std::printf(" %lld", static_cast<long long>(bad_cols[d]));
      std::printf("\n     bad elements by row t %% 64:");
      for (int r = 0; r < 64; ++r) std::printf(" %lld", static_cast<long long>(bad_rows_mod64[r]));
      std::printf("\n");
    }
    failures += !ok;
  }
  return failures;
}


// Times the sm80 forward and each sm90 schedule on the same inputs (median
// of `reps`, L2 cold only in the sense that the working set exceeds it) and
// prints one line per implementation as soon as it is measured, so a hang in
// a later schedule still leaves the earlier numbers in the log.
bool g_time_sm80 = true;  // --no-sm80 clears it

void TimeCase(const Case& c, const cuda::DeviceInfo& dev, int reps, bool with_sm80 = true) {
  HostVariants var;
  float* d_slopes;
  std::mt19937_64 option_rng(7);
  FlashParams p = OptionParams(c, option_rng, &var, &d_slopes);
  void* d_ids = nullptr;
  if (c.seg != SegKind::kNone) {
    std::mt19937_64 id_rng(11);
    MakeSegmentIds(c.seg, c.docs, c.B, c.T, c.S, id_rng, &var.q_ids, &var.kv_ids);
    d_ids = UploadSegmentIds(var.q_ids, var.kv_ids, &p);
  }
  if (!cuda::Sm90ForwardSupports(p)) {  // a build without the options (a baseline's)
    std::printf("SKIP %s: Sm90ForwardSupports is false\n", c.name.c_str());
    if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));
    if (d_ids) CHECK_CUDA(cudaFree(d_ids));
    return;
  }
  const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.S * c.K * c.D;
  void *q, *k, *v, *o, *scratch = nullptr;
  float* lse;
  CHECK_CUDA(cudaMalloc(&q, nq * 2));
  CHECK_CUDA(cudaMalloc(&k, nk * 2));
  CHECK_CUDA(cudaMalloc(&v, nk * 2));
  CHECK_CUDA(cudaMalloc(&o, nq * 2));
  CHECK_CUDA(cudaMalloc(&lse, c.B * c.H * c.T * 4));
  const bool bf16 = c.dtype == DType::kBFloat16;
  FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(q), nq, 1, bf16, 1.f);
  FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(k), nk, 2, bf16, 1.f);
  FillRandom<<<1024, 256>>>(static_cast<uint16_t*>(v), nk, 3, bf16, 1.f);
  CHECK_CUDA(cudaGetLastError());
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
  const size_t scratch_bytes = std::max(cuda::ForwardScratchBytes(p, dev),
                                        VariantScratchBytes(p, dev, TileFor(c.D), g_choice));
  if (scratch_bytes) CHECK_CUDA(cudaMalloc(&scratch, scratch_bytes));
  double flops = 4.0 * c.B * c.T * c.S * c.H * c.D;
  if (c.wr == 0) flops /= 2;
  if (c.seg != SegKind::kNone) {  // the documents' visible pairs only
    flops = 4.0 * VisiblePairs(var.q_ids, c.B, c.T, c.wr == 0) * c.H * c.D;
  }
  auto time = [&](const char* impl, auto run) {
    const std::vector<float> ms = TimeRuns(c.name + " [" + impl + "]", reps, run);
    const double med = ms[reps / 2];
    std::printf("TIME %-36s %-13s %8.3f ms  %6.1f TFLOP/s\n", c.name.c_str(), impl, med,
                flops / med / 1e9);
    std::fflush(stdout);
  };
  if (with_sm80 && g_time_sm80) {
    time("sm80", [&](int) { return cuda::RunForward(p, scratch, dev, 0); });
  }
  for (Sm90Schedule sch : SchedulesFor(p)) {
    const std::string impl = std::string("sm90 ") + ScheduleName(sch);
    time(impl.c_str(), [&](int) {
      return RunForwardSm90Variant(p, scratch, dev, 0, sch, TileFor(c.D), g_choice);
    });
  }
  for (void* ptr : {q, k, v, o, static_cast<void*>(lse)}) CHECK_CUDA(cudaFree(ptr));
  if (scratch) CHECK_CUDA(cudaFree(scratch));
  if (d_slopes) CHECK_CUDA(cudaFree(d_slopes));
  if (d_ids) CHECK_CUDA(cudaFree(d_ids));
}

std::string Name(const char* fmt, long long a, long long b, long long c, const char* d) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), fmt, a, b, c, d);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode, filter;
  bool no_time = false, time_only = false, grid = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--filter" && i + 1 < argc) {
      filter = argv[++i];
    } else if (a == "--schedules" && i + 1 < argc) {
      const std::string list = std::string(",") + argv[++i] + ",";
      g_schedules.clear();
      for (Sm90Schedule sch :
           {Sm90Schedule::kSerial, Sm90Schedule::kOverlap, Sm90Schedule::kPingpong}) {
        if (list.find(std::string(",") + ScheduleName(sch) + ",") != std::string::npos) {
          g_schedules.push_back(sch);
        }
      }
      if (g_schedules.empty()) {
        std::printf("--schedules: expected a comma-separated subset of serial,overlap,pingpong\n");
        return 2;
      }
    } else if (a == "--tile" && i + 1 < argc) {
      g_tile = std::atoi(argv[++i]);
    } else if (a == "--persistent" && i + 1 < argc) {
      g_choice.persistent = std::atoi(argv[++i]);
    } else if (a == "--stream-k" && i + 1 < argc) {
      g_choice.stream_k = std::atoi(argv[++i]);
    } else if (a == "--grid") {
      grid = true;
      time_only = true;
    } else if (a == "--package") {
      g_package_schedule = true;
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
  const bool small = tiny || mode == "--small";
  cuda::DeviceInfo dev;
  CHECK_CUDA(cuda::GetCurrentDeviceInfo(&dev));
  std::printf("device %d: %d SMs, cc %d.%d, smem opt-in %zu\n", dev.device, dev.sm_count,
              dev.cc_major, dev.cc_minor, dev.max_smem_per_block_optin);
  if (dev.cc_major != 9) {
    std::printf("FAILED: the sm90 forward needs a cc 9.x device\n");
    return 1;
  }

  int failures = 0;
  {  // What the sm90 path declines (host only): the dispatcher falls back then.
    Case c{"", DType::kFloat32, 1, 1, 1, 1, 1, 64, -1, -1};
    const bool f32 = !cuda::Sm90ForwardSupports(CaseParams(c));
    c.dtype = DType::kBFloat16;
    c.D = 264;
    const bool d264 = !cuda::Sm90ForwardSupports(CaseParams(c));
    c.D = 128;
    FlashParams p = CaseParams(c);
    p.softcap = 30.f;
    p.alibi_slopes = reinterpret_cast<const float*>(&p);  // host-only check: any non-null
    p.dropout_seeds = reinterpret_cast<const uint32_t*>(&p);
    const bool options = cuda::Sm90ForwardSupports(p);
    p.softcap = 0.f;
    p.alibi_slopes = nullptr;
    p.dropout_seeds = nullptr;
    const int32_t ids = 0;
    p.q_segment_ids = &ids;  // ids come in pairs: one alone is declined
    const bool segments = !cuda::Sm90ForwardSupports(p);
    p.q_segment_ids = nullptr;
    bool accepted = true;
    for (int64_t d : {8, 40, 96, 128, 200, 256}) {
      p.head_dim = d;
      accepted = accepted && cuda::Sm90ForwardSupports(p);
    }
    const bool ok = f32 && d264 && options && segments && accepted;
    std::printf("%s supports: float32, D=264, unpaired segment ids declined; softcap + ALiBi + "
                "dropout, bf16 D=8..256 accepted\n",
                ok ? "PASS" : "FAIL");
    failures += !ok;
  }

  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cases;
  // Smoke test first: one full tile, no mask. If this hangs or fails, the
  // pipeline itself is broken (barriers, descriptors), not the masking.
  cases.push_back({"smoke T128 S128 D128 bf16", bf, 1, 128, 128, 1, 1, 128, -1, -1});
  cases.push_back({"smoke T128 S128 D64 bf16", bf, 1, 128, 128, 1, 1, 64, -1, -1});
  // The matrix: D x dtype x (T, S) x {full, causal}.
  const int64_t ts[][2] = {{1, 1},     {17, 17},  {128, 128}, {1000, 1000},
                           {17, 1000}, {1000, 17}, {128, 4096}, {1, 4096}};
  for (int64_t d : {64, 128, 256}) {
    for (DType dt : {bf, fp}) {
      for (const auto& x : ts) {
        for (bool causal : {false, true}) {
          const std::string name =
              Name("T%lld S%lld D%lld %s", x[0], x[1], d, dt == bf ? "bf16" : "fp16") +
              (causal ? " causal" : "");
          cases.push_back({name, dt, 1, x[0], x[1], 2, 2, d, -1, causal ? 0 : -1});
        }
      }
    }
  }
  const std::vector<Case> special = {
      {"T1000 S1000 D128 causal GQA4 bf16 B2", bf, 2, 1000, 1000, 8, 2, 128, -1, 0},
      {"T17 S4096 D64 GQA4 fp16", fp, 1, 17, 4096, 8, 2, 64, -1, -1},
      {"T1000 S1000 D128 window(64,16) bf16", bf, 1, 1000, 1000, 2, 2, 128, 64, 16},
      {"T4096 S4096 D64 window(100,0) bf16", bf, 1, 4096, 4096, 1, 1, 64, 100, 0},
      {"T300 S1000 D64 window(0,0) fp16 (diag only)", fp, 1, 300, 1000, 2, 2, 64, 0, 0},
      {"T1000 S1000 D128 causal bf16 bhtd", bf, 1, 1000, 1000, 2, 2, 128, -1, 0, true},
      {"T257 S300 D64 fp16 bhtd GQA4 B3", fp, 3, 257, 300, 4, 1, 64, -1, -1, true},
      {"T4096 S4096 D128 causal bf16", bf, 1, 4096, 4096, 2, 2, 128, -1, 0},
      {"T4096 S128 D128 causal fp16 (empty rows)", fp, 1, 4096, 128, 2, 2, 128, -1, 0},
      {"T1000 S4096 D64 fp16 B2", fp, 2, 1000, 4096, 2, 2, 64, -1, -1},
      // Around the tile sizes: 192-row blocks (D 64), 176-key blocks (D 128).
      {"T385 S353 D64 causal bf16 B2", bf, 2, 385, 353, 3, 3, 64, -1, 0},
      {"T191 S529 D128 fp16 B2", fp, 2, 191, 529, 3, 3, 128, -1, -1},
      {"T700 S177 D128 bf16", bf, 1, 700, 177, 2, 1, 128, -1, -1},
      // Masked above 8192 keys: D 128's row for them (one tile per block).
      {"T300 S9000 D128 causal bf16", bf, 1, 300, 9000, 2, 2, 128, -1, 0},
      {"T300 S9000 D128 window(700,0) fp16", fp, 1, 300, 9000, 2, 2, 128, 700, 0},
      // More tiles than SMs without a mask: the persistent grid, each block
      // walking several tiles (Q and the K/V ring reused across them).
      {"T600 S400 D64 GQA4 bf16 B4 H16 (persistent)", bf, 4, 600, 400, 16, 4, 64, -1, -1},
      {"T300 S333 D128 fp16 B3 H24 bhtd (persistent)", fp, 3, 300, 333, 24, 24, 128, -1, -1, true},
      // Whole-tile rounds, then stream-K pieces (640 tiles on 132 SMs: 3
      // rounds, then 244 tiles' key blocks shared out, 8 per tile).
      {"T1000 S1000 D128 bf16 B2 H40 (persistent, stream-K)", bf, 2, 1000, 1000, 40, 40, 128, -1, -1},
      {"T2000 S700 D64 GQA2 fp16 B1 H40 (persistent, stream-K)", fp, 1, 2000, 700, 40, 20, 64, -1, -1},
      // D 256 (128 x 80 tiles) around its key blocks, and head dims run by
      // the next bucket's tile (columns past D zero-filled by the maps).
      {"T1000 S1000 D256 causal GQA4 bf16 B2", bf, 2, 1000, 1000, 8, 2, 256, -1, 0},
      {"T161 S4097 D256 window(300,20) fp16 bhtd", fp, 1, 161, 4097, 2, 2, 256, 300, 20, true},
      {"T4096 S4096 D256 causal bf16", bf, 1, 4096, 4096, 2, 1, 256, -1, 0},
      {"T333 S81 D256 fp16 B3", fp, 3, 333, 81, 2, 2, 256, -1, -1},
      {"T300 S9000 D200 GQA2 bf16", bf, 1, 300, 9000, 4, 2, 200, -1, -1},
      {"T777 S555 D136 causal fp16 bhtd", fp, 1, 777, 555, 3, 3, 136, -1, 0},
      {"T1000 S5000 D96 bf16 B2 (176-key tile)", bf, 2, 1000, 5000, 2, 2, 96, -1, -1},
      {"T1000 S1000 D72 causal GQA2 fp16", fp, 1, 1000, 1000, 4, 2, 72, -1, 0},
      {"T1000 S1000 D120 bf16 B2 H40 (persistent, stream-K)", bf, 2, 1000, 1000, 40, 40, 120, -1,
       -1},
      {"T385 S353 D40 causal bf16 B2", bf, 2, 385, 353, 3, 3, 40, -1, 0},
      {"T600 S400 D8 GQA4 fp16 B4 H16 (persistent)", fp, 4, 600, 400, 16, 4, 8, -1, -1},
  };
  cases.insert(cases.end(), special.begin(), special.end());
  // Segment ids (packed rows): 1, 2, 7 and 64 documents, empty ones,
  // documents shorter than a block, padding, unsorted ids, T != S (cross
  // attention between packed rows, some documents without keys), GQA,
  // windows, every head-dim tile, both dtypes.
  using SK = SegKind;
  const std::vector<Case> segmented = {
      {"seg 1 doc T1000 D128 causal bf16", bf, 1, 1000, 1000, 2, 2, 128, -1, 0, false, SK::kPacked, 1},
      {"seg 2 docs T1000 D64 causal fp16 B2", fp, 2, 1000, 1000, 2, 2, 64, -1, 0, false, SK::kPacked, 2},
      {"seg 7 docs T2000 D128 causal GQA4 bf16", bf, 1, 2000, 2000, 8, 2, 128, -1, 0, false, SK::kPacked, 7},
      {"seg 64 docs T4096 D64 causal bf16", bf, 1, 4096, 4096, 4, 4, 64, -1, 0, false, SK::kPacked, 64},
      {"seg 64 docs T4096 D128 bf16", bf, 1, 4096, 4096, 2, 2, 128, -1, -1, false, SK::kPacked, 64},
      {"seg 7 docs T2000 D64 bf16", bf, 1, 2000, 2000, 2, 2, 64, -1, -1, false, SK::kPacked, 7},
      {"seg 64 docs T4096 D64 GQA2 fp16", fp, 1, 4096, 4096, 4, 2, 64, -1, -1, false, SK::kPacked, 64},
      {"seg 7 docs T1000 D256 causal fp16", fp, 1, 1000, 1000, 2, 1, 256, -1, 0, false, SK::kPacked, 7},
      {"seg short docs T777 D64 causal bf16", bf, 1, 777, 777, 2, 2, 64, -1, 0, false, SK::kShort, 0},
      {"seg short docs T500 D128 fp16 bhtd", fp, 1, 500, 500, 2, 2, 128, -1, -1, true, SK::kShort, 0},
      {"seg padded 5 docs T1500 D128 causal bf16 B2", bf, 2, 1500, 1500, 2, 2, 128, -1, 0, false, SK::kPadded, 5},
      {"seg random ids T300 D64 bf16", bf, 1, 300, 300, 2, 2, 64, -1, -1, false, SK::kRandom, 0},
      {"seg random ids T300 S500 D128 causal fp16", fp, 1, 300, 500, 2, 2, 128, -1, 0, false, SK::kRandom, 0},
      {"seg cross 7 docs T700 S1500 D128 bf16", bf, 1, 700, 1500, 4, 2, 128, -1, -1, false, SK::kPacked, 7},
      {"seg cross missing docs T900 S400 D64 GQA2 fp16", fp, 2, 900, 400, 4, 2, 64, -1, -1, false, SK::kMissing, 6},
      {"seg 7 docs T2000 D128 window(200,0) bf16", bf, 1, 2000, 2000, 2, 2, 128, 200, 0, false, SK::kPacked, 7},
      {"seg 7 docs T1000 D64 window(64,16) fp16", fp, 1, 1000, 1000, 2, 2, 64, 64, 16, false, SK::kPacked, 7},
      {"seg 7 docs T600 D96 causal H16 bf16 B3 (persistent)", bf, 3, 600, 600, 16, 16, 96, -1, 0, false, SK::kPacked, 7},
      {"seg 64 docs T9000 D128 causal bf16", bf, 1, 9000, 9000, 2, 2, 128, -1, 0, false, SK::kPacked, 64},
      // One-document tiles start their key blocks at the document: the
      // options that read key positions (ALiBi, dropout's words).
      {"seg 7 docs T2000 D128 causal drop0.1 softcap+alibi bf16", bf, 1, 2000, 2000, 2, 2, 128, -1, 0, false, SK::kPacked, 7, 30.f, true, 0.f, 0.1f},
      {"seg 64 docs T4096 D64 drop0.2 alibi fp16 B2", fp, 2, 4096, 4096, 2, 1, 64, -1, -1, false, SK::kPacked, 64, 0.f, true, 0.f, 0.2f},
      {"seg padded 5 docs T1500 D256 causal drop0.1 bf16", bf, 1, 1500, 1500, 2, 2, 256, -1, 0, false, SK::kPadded, 5, 0.f, false, 0.f, 0.1f},
  };
  cases.insert(cases.end(), segmented.begin(), segmented.end());
  // Score options (--filter opt): softcap, ALiBi and both, with causal,
  // windows, GQA, every tile (D 64, 128 at 128 and 176 keys, 256 and the
  // masked 128-key row above 8192 keys), the persistent grid, stream-K,
  // bhtd strides, T != S both ways, odd lengths. Scale 1 in the softcap
  // cases: scores of a few tens, so the cap bends them.
  const std::vector<Case> options = {
      {"opt softcap30 T1000 S1000 D128 causal bf16 s1", bf, 1, 1000, 1000, 2, 2, 128, -1, 0, false, SegKind::kNone, 0, 30.f, false, 1.f},
      {"opt softcap5 T17 S1000 D64 fp16", fp, 1, 17, 1000, 2, 2, 64, -1, -1, false, SegKind::kNone, 0, 5.f},
      {"opt alibi T1000 S1000 D64 causal GQA4 bf16 B2", bf, 2, 1000, 1000, 8, 2, 64, -1, 0, false, SegKind::kNone, 0, 0.f, true},
      {"opt alibi T300 S9000 D128 window(700,0) fp16", fp, 1, 300, 9000, 2, 2, 128, 700, 0, false, SegKind::kNone, 0, 0.f, true},
      {"opt softcap20+alibi T1000 S5000 D96 bf16 B2 s0.5", bf, 2, 1000, 5000, 2, 2, 96, -1, -1, false, SegKind::kNone, 0, 20.f, true, 0.5f},
      {"opt softcap50+alibi T385 S353 D64 causal bf16 B2 s1", bf, 2, 385, 353, 3, 3, 64, -1, 0, false, SegKind::kNone, 0, 50.f, true, 1.f},
      {"opt softcap10 T1000 S1000 D256 causal GQA4 bf16 B2 s0.5", bf, 2, 1000, 1000, 8, 2, 256, -1, 0, false, SegKind::kNone, 0, 10.f, false, 0.5f},
      {"opt alibi T161 S4097 D256 window(300,20) fp16 bhtd", fp, 1, 161, 4097, 2, 2, 256, 300, 20, true, SegKind::kNone, 0, 0.f, true},
      {"opt softcap30+alibi T1000 S1000 D128 bf16 B2 H40 (stream-K) s1", bf, 2, 1000, 1000, 40, 40, 128, -1, -1, false, SegKind::kNone, 0, 30.f, true, 1.f},
      {"opt alibi T600 S400 D64 GQA4 bf16 B4 H16 (persistent)", bf, 4, 600, 400, 16, 4, 64, -1, -1, false, SegKind::kNone, 0, 0.f, true},
      {"opt softcap30 T4096 S4096 D128 causal bf16 s1", bf, 1, 4096, 4096, 2, 2, 128, -1, 0, false, SegKind::kNone, 0, 30.f, false, 1.f},
      {"opt alibi T1000 S17 D128 bf16 (T > S)", bf, 1, 1000, 17, 2, 2, 128, -1, -1, false, SegKind::kNone, 0, 0.f, true},
      {"opt softcap15+alibi T300 S9000 D128 causal fp16 s0.5", fp, 1, 300, 9000, 2, 1, 128, -1, 0, false, SegKind::kNone, 0, 15.f, true, 0.5f},
      {"opt softcap50+alibi T777 S555 D200 causal fp16 bhtd", fp, 1, 777, 555, 3, 3, 200, -1, 0, true, SegKind::kNone, 0, 50.f, true},
  };
  cases.insert(cases.end(), options.begin(), options.end());
  // Dropout (--filter drop; the oracle applies flash_dropout.h's mask on the
  // host): every tile (D 64, 128 at 128 and 176 keys, the masked 128-key row
  // above 8192 keys, 256), causal, windows, GQA, the persistent grid,
  // stream-K, segment ids, with softcap and ALiBi, bhtd, T != S both ways.
  const std::vector<Case> dropped = {
      {"drop0.1 T1000 S1000 D128 causal bf16", bf, 1, 1000, 1000, 2, 2, 128, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
      {"drop0.2 T17 S1000 D64 fp16", fp, 1, 17, 1000, 2, 2, 64, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.2f},
      {"drop0.3 T1000 S1000 D64 causal GQA4 bf16 B2", bf, 2, 1000, 1000, 8, 2, 64, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.3f},
      {"drop0.1 T1000 S5000 D128 bf16 (176 keys)", bf, 1, 1000, 5000, 2, 2, 128, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
      {"drop0.5 T300 S9000 D128 window(700,0) fp16", fp, 1, 300, 9000, 2, 2, 128, 700, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.5f},
      {"drop0.1 T1000 S1000 D128 bf16 B2 H40 (stream-K)", bf, 2, 1000, 1000, 40, 40, 128, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
      {"drop0.2 T600 S400 D64 GQA4 bf16 B4 H16 (persistent)", bf, 4, 600, 400, 16, 4, 64, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.2f},
      {"drop0.1 T1000 S1000 D256 causal GQA4 bf16 B2", bf, 2, 1000, 1000, 8, 2, 256, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
      {"drop0.3 T161 S4097 D256 window(300,20) fp16 bhtd", fp, 1, 161, 4097, 2, 2, 256, 300, 20, true, SegKind::kNone, 0, 0.f, false, 0.f, 0.3f},
      {"drop0.1 softcap20+alibi T1000 S1000 D96 bf16 B2 s0.5", bf, 2, 1000, 1000, 2, 2, 96, -1, -1, false, SegKind::kNone, 0, 20.f, true, 0.5f, 0.1f},
      {"drop0.2 softcap50+alibi T777 S555 D200 causal fp16 bhtd", fp, 1, 777, 555, 3, 3, 200, -1, 0, true, SegKind::kNone, 0, 50.f, true, 0.f, 0.2f},
      {"drop0.1 seg 7 docs T2000 D128 causal bf16", bf, 1, 2000, 2000, 2, 2, 128, -1, 0, false, SegKind::kPacked, 7, 0.f, false, 0.f, 0.1f},
      {"drop0.1 seg random T700 S500 D64 fp16", fp, 1, 700, 500, 2, 1, 64, -1, -1, false, SegKind::kRandom, 0, 0.f, false, 0.f, 0.1f},
      {"drop0.1 T1000 S17 D128 bf16 (T > S)", bf, 1, 1000, 17, 2, 2, 128, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
  };
  cases.insert(cases.end(), dropped.begin(), dropped.end());
  if (tiny) {
    cases = {
        {"tiny T128 S128 D128 bf16", bf, 1, 128, 128, 1, 1, 128, -1, -1},
        {"tiny T17 S300 D64 causal fp16", fp, 1, 17, 300, 2, 2, 64, -1, 0},
        {"tiny T200 S100 D128 causal GQA2 bf16 (empty rows)", bf, 1, 200, 100, 2, 1, 128, -1, 0},
        {"tiny T130 S500 D64 window(64,16) bf16 bhtd", bf, 1, 130, 500, 2, 2, 64, 64, 16, true},
        {"tiny T130 S200 D64 H140 bf16 B2 (persistent)", bf, 2, 130, 200, 140, 140, 64, -1, -1},
        {"tiny T150 S170 D256 causal GQA2 fp16", fp, 1, 150, 170, 2, 1, 256, -1, 0},
        {"tiny T100 S300 D200 bf16 bhtd", bf, 1, 100, 300, 2, 2, 200, -1, -1, true},
        {"tiny T130 S200 D96 H140 fp16 (persistent)", fp, 1, 130, 200, 140, 140, 96, -1, -1},
        {"tiny seg 7 docs T300 D64 causal bf16", bf, 1, 300, 300, 2, 2, 64, -1, 0, false,
         SegKind::kPacked, 7},
        {"tiny seg 5 docs T400 D64 fp16", fp, 1, 400, 400, 2, 2, 64, -1, -1, false,
         SegKind::kPacked, 5},
        {"tiny seg random T200 S130 D128 fp16", fp, 1, 200, 130, 2, 1, 128, -1, -1, false,
         SegKind::kRandom, 0},
        {"tiny seg short docs T150 D256 causal bf16", bf, 1, 150, 150, 2, 2, 256, -1, 0, false,
         SegKind::kShort, 0},
        {"opt tiny softcap10+alibi T130 S200 D64 causal GQA2 bf16 s1", bf, 1, 130, 200, 2, 1, 64, -1, 0, false, SegKind::kNone, 0, 10.f, true, 1.f},
        {"opt tiny softcap30 T150 S170 D256 fp16 s1", fp, 1, 150, 170, 2, 2, 256, -1, -1, false, SegKind::kNone, 0, 30.f, false, 1.f},
        {"opt tiny alibi T200 S100 D128 causal bf16 (empty rows)", bf, 1, 200, 100, 2, 2, 128, -1, 0, false, SegKind::kNone, 0, 0.f, true},
        {"opt tiny softcap20+alibi T130 S200 D128 H140 bf16 (persistent)", bf, 1, 130, 200, 140, 140, 128, -1, -1, false, SegKind::kNone, 0, 20.f, true},
        {"drop tiny T130 S200 D64 causal GQA2 bf16", bf, 1, 130, 200, 2, 1, 64, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.2f},
        {"drop tiny T150 S170 D256 fp16", fp, 1, 150, 170, 2, 2, 256, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.3f},
        {"drop tiny softcap10 T200 S100 D128 causal bf16 (empty rows)", bf, 1, 200, 100, 2, 2, 128, -1, 0, false, SegKind::kNone, 0, 10.f, false, 1.f, 0.1f},
        {"drop tiny T130 S200 D128 H140 bf16 (persistent)", bf, 1, 130, 200, 140, 140, 128, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"drop tiny seg 7 docs T300 D64 causal bf16", bf, 1, 300, 300, 2, 2, 64, -1, 0, false, SegKind::kPacked, 7, 0.f, false, 0.f, 0.1f},
    };
  } else if (small) {
    std::vector<Case> keep;
    for (const Case& c : cases) {
      if (c.B * c.H * c.T * c.S <= int64_t{2} * 1000 * 1000) keep.push_back(c);
    }
    cases = keep;
  }
  uint64_t seed = 1234;
  int ran = 0;
  for (const Case& c : cases) {
    ++seed;
    if (time_only) break;
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    std::fflush(stdout);
    failures += RunCase(c, dev, seed);
    ++ran;
  }
  std::printf("%d case(s) run\n", ran);

  if (!small && !no_time) {
    const std::vector<Case> timed = {
        {"B4 T=S=4096 H16 D128 bf16", bf, 4, 4096, 4096, 16, 16, 128, -1, -1},
        {"B4 T=S=4096 H16 D128 bf16 causal", bf, 4, 4096, 4096, 16, 16, 128, -1, 0},
        {"B1 T=S=16384 H16 D128 bf16", bf, 1, 16384, 16384, 16, 16, 128, -1, -1},
        {"B1 T=S=16384 H16 D128 bf16 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0},
        {"B4 T=S=4096 H16 D64 bf16", bf, 4, 4096, 4096, 16, 16, 64, -1, -1},
        {"B1 T=S=16384 H32 D64 bf16 causal", bf, 1, 16384, 16384, 32, 32, 64, -1, 0},
        // Short sequences of the benchmark grid (B T = 16k, H D = 2048).
        {"B32 T=S=512 H32 D64 bf16", bf, 32, 512, 512, 32, 32, 64, -1, -1},
        {"B8 T=S=2048 H32 D64 bf16", bf, 8, 2048, 2048, 32, 32, 64, -1, -1},
        {"B32 T=S=512 H16 D128 bf16", bf, 32, 512, 512, 16, 16, 128, -1, -1},
        {"B8 T=S=2048 H16 D128 bf16", bf, 8, 2048, 2048, 16, 16, 128, -1, -1},
        // Sequences shorter than a D 64 tile's 192 rows (--filter short).
        {"short B128 T=S=128 H12 D64 bf16", bf, 128, 128, 128, 12, 12, 64, -1, -1},
        {"short B64 T=S=197 H12 D64 bf16", bf, 64, 197, 197, 12, 12, 64, -1, -1},
        {"short B64 T=S=256 H16 D64 bf16", bf, 64, 256, 256, 16, 16, 64, -1, -1},
        {"short B64 T=S=256 H16 D64 bf16 causal", bf, 64, 256, 256, 16, 16, 64, -1, 0},
        {"short B32 T=S=384 H16 D64 bf16 causal", bf, 32, 384, 384, 16, 16, 64, -1, 0},
        {"short B32 T=S=512 H32 D64 bf16 causal", bf, 32, 512, 512, 32, 32, 64, -1, 0},
        {"short B32 T=S=512 H32 D64 bf16 unmasked", bf, 32, 512, 512, 32, 32, 64, -1, -1},
        {"short B64 T=S=256 H16 D64 bf16 causal softcap50", bf, 64, 256, 256, 16, 16, 64, -1, 0, false, SegKind::kNone, 0, 50.f},
        {"short B64 T=S=256 H16 D64 bf16 causal dropout0.1", bf, 64, 256, 256, 16, 16, 64, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"B2 T=S=8192 H8 D256 bf16", bf, 2, 8192, 8192, 8, 8, 256, -1, -1},
        {"B2 T=S=8192 H8 D256 bf16 causal", bf, 2, 8192, 8192, 8, 8, 256, -1, 0},
        {"B8 T=S=2048 H8 D256 bf16", bf, 8, 2048, 2048, 8, 8, 256, -1, -1},
        {"B4 T=S=4096 H16 D96 bf16", bf, 4, 4096, 4096, 16, 16, 96, -1, -1},
        // The score options beside their plain rows above.
        {"B4 T=S=4096 H16 D128 bf16 softcap50", bf, 4, 4096, 4096, 16, 16, 128, -1, -1, false, SegKind::kNone, 0, 50.f},
        {"B4 T=S=4096 H16 D128 bf16 causal alibi", bf, 4, 4096, 4096, 16, 16, 128, -1, 0, false, SegKind::kNone, 0, 0.f, true},
        {"B4 T=S=4096 H16 D64 bf16 softcap50", bf, 4, 4096, 4096, 16, 16, 64, -1, -1, false, SegKind::kNone, 0, 50.f},
        {"B4 T=S=4096 H16 D64 bf16 softcap50+alibi", bf, 4, 4096, 4096, 16, 16, 64, -1, -1, false, SegKind::kNone, 0, 50.f, true},
        {"B4 T=S=4096 H16 D64 bf16 alibi", bf, 4, 4096, 4096, 16, 16, 64, -1, -1, false, SegKind::kNone, 0, 0.f, true},
        {"B2 T=S=8192 H16 D64 bf16 causal alibi", bf, 2, 8192, 8192, 16, 16, 64, -1, 0, false, SegKind::kNone, 0, 0.f, true},
        {"B4 T=S=4096 H16 D64 bf16 dropout0.1", bf, 4, 4096, 4096, 16, 16, 64, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"B4 T=S=4096 H16 D128 bf16 dropout0.1", bf, 4, 4096, 4096, 16, 16, 128, -1, -1, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        // Dropout beside its plain rows (--filter T8k).
        {"B2 T=S=8192 H16 D128 bf16 causal T8k", bf, 2, 8192, 8192, 16, 16, 128, -1, 0},
        {"B2 T=S=8192 H16 D128 bf16 causal T8k dropout0.1", bf, 2, 8192, 8192, 16, 16, 128, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        {"B2 T=S=8192 H16 D64 bf16 causal T8k", bf, 2, 8192, 8192, 16, 16, 64, -1, 0},
        {"B2 T=S=8192 H16 D64 bf16 causal T8k dropout0.1", bf, 2, 8192, 8192, 16, 16, 64, -1, 0, false, SegKind::kNone, 0, 0.f, false, 0.f, 0.1f},
        // Packed documents (one row of 16k) beside the same documents as a
        // batch (--filter packed; the pre-pass included).
        {"packed 64x256 H16 D128 bf16 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0, false, SegKind::kEqual, 64},
        {"packed 64x256 H16 D128 bf16 causal batch", bf, 64, 256, 256, 16, 16, 128, -1, 0},
        {"packed 64x256 H16 D64 bf16 causal", bf, 1, 16384, 16384, 16, 16, 64, -1, 0, false, SegKind::kEqual, 64},
        {"packed 64x256 H16 D64 bf16 causal batch", bf, 64, 256, 256, 16, 16, 64, -1, 0},
        {"packed 8x2048 H16 D128 bf16 causal", bf, 1, 16384, 16384, 16, 16, 128, -1, 0, false, SegKind::kEqual, 8},
        {"packed 8x2048 H16 D128 bf16 causal batch", bf, 8, 2048, 2048, 16, 16, 128, -1, 0},
        {"packed 8x2048 H16 D64 bf16 causal", bf, 1, 16384, 16384, 16, 16, 64, -1, 0, false, SegKind::kEqual, 8},
        {"packed 8x2048 H16 D64 bf16 causal batch", bf, 8, 2048, 2048, 16, 16, 64, -1, 0},
        // Rows of documents of random lengths (uniform cuts; some empty).
        {"packed random 12 docs B4 T16k H16 D128 bf16 causal", bf, 4, 16384, 16384, 16, 16, 128, -1, 0, false, SegKind::kPacked, 12},
        {"packed random 12 docs B4 T16k H16 D64 bf16 causal", bf, 4, 16384, 16384, 16, 16, 64, -1, 0, false, SegKind::kPacked, 12},
    };
    if (grid) {
      for (int64_t d : {64, 128, 256}) {
        for (bool causal : {false, true}) {
          for (int64_t t = 512; t <= 16384; t *= 2) {
            const std::string name = "grid D" + std::to_string(d) + " T" + std::to_string(t) +
                                     (causal ? " causal" : "");
            if (!filter.empty() && name.find(filter) == std::string::npos) continue;
            const Case c{name,
                         bf, 16384 / t, t, t, 2048 / d, 2048 / d, d, -1, causal ? 0 : -1};
            TimeCase(c, dev, 20, /*with_sm80=*/false);
          }
        }
      }
    } else {
      for (const Case& c : timed) {
        if (filter.empty() || c.name.find(filter) != std::string::npos) TimeCase(c, dev, 20);
      }
    }
  }
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "ALL PASSED", failures);
  return failures ? 1 : 0;
}
