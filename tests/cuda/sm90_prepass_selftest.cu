// The segment-id pre-pass (src/cuda/sm90/segments.cuh) against a CPU
// model of its summaries: for every case, every summary the Hopper kernels
// read (spans, padded ids, key runs, tiles, the zeroed tile counter) must
// match byte for byte. The kernels' self-tests check the summaries' effect
// end to end. Then the pre-pass is timed on rows of 16k tokens and on long
// rows of many documents (varlen's one row).
//   nvcc -std=c++17 -O3 -I. -gencode=arch=compute_90a,code=sm_90a \
//     tests/cuda/sm90_prepass_selftest.cu -o build/sm90_prepass_selftest
//   build/sm90_prepass_selftest [--no-time]
#include <cstring>
#include <string>
#include <vector>

#include "src/cuda/sm90/segments.cuh"
#include "tests/cuda/selftest_util.h"
#include "tests/cuda/sm90_segments_test.h"

namespace jax_flash2::selftest {
namespace {

using cuda::sm90::SegmentBlocks;
using cuda::sm90::SegmentScratch;

struct PrepassCase {
  std::string name;
  SegKind seg;
  int docs;
  int64_t batch, seqlen_q, seqlen_k;
  int q_chunk, kv_chunk, q_tile_chunks, kv_tile_chunks;
};

struct Prepared {
  std::vector<int32_t> q_ids, kv_ids;  // host copies
  FlashParams p;
  int32_t* ids = nullptr;  // device: q ids then kv ids
  SegmentScratch lay;
};

Prepared Prepare(const PrepassCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Prepared r;
  std::vector<int32_t>& q_ids = r.q_ids;
  std::vector<int32_t>& kv_ids = r.kv_ids;
  MakeSegmentIds(c.seg, c.docs, c.batch, c.seqlen_q, c.seqlen_k, rng, &q_ids, &kv_ids);
  CHECK_CUDA(cudaMalloc(&r.ids, (q_ids.size() + kv_ids.size()) * sizeof(int32_t)));
  CHECK_CUDA(cudaMemcpy(r.ids, q_ids.data(), q_ids.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(r.ids + q_ids.size(), kv_ids.data(), kv_ids.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice));
  r.p.batch = c.batch;
  r.p.seqlen_q = c.seqlen_q;
  r.p.seqlen_k = c.seqlen_k;
  r.p.q_segment_ids = r.ids;
  r.p.kv_segment_ids = r.ids + q_ids.size();
  r.lay = cuda::sm90::SegmentScratchLayout(r.p, c.q_chunk, c.kv_chunk, c.q_tile_chunks,
                                           c.kv_tile_chunks);
  return r;
}

cudaError_t Run(const PrepassCase& c, const Prepared& r, void* scratch) {
  SegmentBlocks s;
  return cuda::sm90::RunSegmentPrepass(r.p, c.q_chunk, c.kv_chunk, c.q_tile_chunks,
                                       c.kv_tile_chunks, scratch, 132, &s, 0);
}

// The CPU model of the summaries (segments.cuh's top comment), one row.
struct Model {
  std::vector<int32_t> q_pad, kv_pad;
  std::vector<int32_t> q_span, kv_span;  // int4 each
  std::vector<int32_t> q_keys;           // int2 each
  std::vector<int32_t> q_tiles;          // int4 each
  std::vector<int32_t> kv_tiles;         // int2 each
};

void MinMax(const std::vector<int32_t>& pad, int64_t len, int chunk, std::vector<int64_t>* lo,
            std::vector<int64_t>* hi) {
  const int64_t n = static_cast<int64_t>(pad.size()) / chunk;
  lo->assign(n, INT32_MAX);
  hi->assign(n, INT32_MIN);
  for (int64_t x = 0; x < len; ++x) {
    (*lo)[x / chunk] = std::min<int64_t>((*lo)[x / chunk], pad[x]);
    (*hi)[x / chunk] = std::max<int64_t>((*hi)[x / chunk], pad[x]);
  }
}

// Positions of id x in chunk c of the padded ids: first, last, count.
void FindRun(const std::vector<int32_t>& pad, int chunk, int64_t c, int64_t x, int* first,
             int* last, int* count) {
  *first = INT32_MAX;
  *last = -1;
  *count = 0;
  for (int i = 0; i < chunk; ++i) {
    if (pad[c * chunk + i] == x) {
      *first = std::min(*first, i);
      *last = i;
      ++*count;
    }
  }
}

void ModelRow(const PrepassCase& c, const int32_t* q, const int32_t* kv, Model* m) {
  const int64_t nq = (c.seqlen_q + c.q_chunk - 1) / c.q_chunk;
  const int64_t nk = (c.seqlen_k + c.kv_chunk - 1) / c.kv_chunk;
  m->q_pad.assign(nq * c.q_chunk, INT32_MIN);
  m->kv_pad.assign(nk * c.kv_chunk, INT32_MIN);
  std::copy(q, q + c.seqlen_q, m->q_pad.begin());
  std::copy(kv, kv + c.seqlen_k, m->kv_pad.begin());
  std::vector<int64_t> qlo, qhi, klo, khi;
  MinMax(m->q_pad, c.seqlen_q, c.q_chunk, &qlo, &qhi);
  MinMax(m->kv_pad, c.seqlen_k, c.kv_chunk, &klo, &khi);
  auto span = [](int64_t lo, int64_t hi, const std::vector<int64_t>& olo,
                 const std::vector<int64_t>& ohi, int* first, int* last, int32_t* out) {
    *first = INT32_MAX;
    *last = -1;
    int ff = INT32_MAX, fl = -1, fc = 0;
    for (int j = 0; j < static_cast<int>(olo.size()); ++j) {
      if (olo[j] <= hi && lo <= ohi[j]) {
        *first = std::min(*first, j);
        *last = j;
      }
      if (lo == hi && olo[j] == ohi[j] && olo[j] == lo) {
        ff = std::min(ff, j);
        fl = j;
        ++fc;
      }
    }
    out[0] = out[1] = out[2] = out[3] = 0;
    if (*first <= *last) {
      out[0] = *first;
      out[1] = *last + 1;
      if (fc > 0 && fc == fl - ff + 1) {
        out[2] = ff;
        out[3] = fl + 1;
      }
    }
  };
  m->q_span.assign(4 * nq, 0);
  m->kv_span.assign(4 * nk, 0);
  m->q_keys.assign(2 * nq, -1);
  for (int64_t i = 0; i < nq; ++i) {
    int first, last;
    span(qlo[i], qhi[i], klo, khi, &first, &last, &m->q_span[4 * i]);
    if (qlo[i] != qhi[i] || first > last) continue;
    const int64_t x = qlo[i];
    bool interior = true;
    for (int j = first + 1; j < last; ++j) interior = interior && klo[j] == x && khi[j] == x;
    if (!interior) continue;
    const int n = c.kv_chunk;
    int af, al, ac, zf, zl, zc;
    FindRun(m->kv_pad, n, first, x, &af, &al, &ac);
    if (ac == 0 || ac != al - af + 1) continue;
    if (first == last) {
      m->q_keys[2 * i] = first * n + af;
      m->q_keys[2 * i + 1] = first * n + al + 1;
      continue;
    }
    FindRun(m->kv_pad, n, last, x, &zf, &zl, &zc);
    if (al != n - 1 || zf != 0 || zc != zl + 1) continue;
    m->q_keys[2 * i] = first * n + af;
    m->q_keys[2 * i + 1] = last * n + zl + 1;
  }
  for (int64_t i = 0; i < nk; ++i) {
    int first, last;
    span(klo[i], khi[i], qlo, qhi, &first, &last, &m->kv_span[4 * i]);
  }
  auto tile_union = [](const std::vector<int32_t>& spans, int64_t c0, int64_t c1, int* a,
                       int* z) {
    *a = INT32_MAX;
    *z = INT32_MIN;
    for (int64_t k = c0; k < c1; ++k) {
      if (spans[4 * k] < spans[4 * k + 1]) {
        *a = std::min(*a, spans[4 * k]);
        *z = std::max(*z, spans[4 * k + 1]);
      }
    }
  };
  const int64_t tq = (nq + c.q_tile_chunks - 1) / c.q_tile_chunks;
  const int64_t tk = (nk + c.kv_tile_chunks - 1) / c.kv_tile_chunks;
  m->q_tiles.assign(4 * tq, 0);
  m->kv_tiles.assign(2 * tk, 0);
  for (int64_t t = 0; t < tq; ++t) {
    const int64_t c0 = t * c.q_tile_chunks, c1 = std::min(nq, c0 + c.q_tile_chunks);
    int a, z;
    tile_union(m->q_span, c0, c1, &a, &z);
    int32_t r0 = m->q_keys[2 * c0], r1 = m->q_keys[2 * c0 + 1];
    for (int64_t k = c0 + 1; k < c1; ++k) {
      if (m->q_keys[2 * k] != r0 || m->q_keys[2 * k + 1] != r1) r0 = r1 = -1;
    }
    const int32_t v[4] = {a < z ? a : 0, a < z ? z : 0, a < z ? r0 : -1, a < z ? r1 : -1};
    std::copy(v, v + 4, &m->q_tiles[4 * t]);
  }
  for (int64_t t = 0; t < tk; ++t) {
    const int64_t c0 = t * c.kv_tile_chunks, c1 = std::min(nk, c0 + c.kv_tile_chunks);
    int a, z;
    tile_union(m->kv_span, c0, c1, &a, &z);
    m->kv_tiles[2 * t] = a < z ? a : 0;
    m->kv_tiles[2 * t + 1] = a < z ? z : 0;
  }
}

bool Compare(const PrepassCase& c, uint64_t seed) {
  const Prepared r = Prepare(c, seed);
  char* scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&scratch, r.lay.bytes));
  CHECK_CUDA(cudaMemset(scratch, 0x5a, r.lay.bytes));
  CHECK_CUDA(Run(c, r, scratch));
  CHECK_CUDA(SyncWithWatchdog(c.name));
  std::vector<char> host(r.lay.bytes);
  CHECK_CUDA(cudaMemcpy(host.data(), scratch, r.lay.bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(scratch));
  CHECK_CUDA(cudaFree(r.ids));
  int32_t counter;
  std::memcpy(&counter, host.data() + r.lay.tile_counter, sizeof(counter));
  if (counter != 0) {
    std::printf("FAIL %s: the tile counter is %d\n", c.name.c_str(), counter);
    return false;
  }
  // Row b's part of a summary: got (the scratch at offset, row b) against want.
  auto check = [&](const char* what, size_t offset, int64_t b, const std::vector<int32_t>& want) {
    const char* got = host.data() + offset + b * want.size() * sizeof(int32_t);
    for (size_t i = 0; i < want.size(); ++i) {
      int32_t g;
      std::memcpy(&g, got + i * sizeof(int32_t), sizeof(g));
      if (g != want[i]) {
        std::printf("FAIL %s: row %lld %s[%zu] is %d, want %d\n", c.name.c_str(), (long long)b,
                    what, i, g, want[i]);
        return false;
      }
    }
    return true;
  };
  Model m;
  // Every row when there are few, else a spread of them.
  const int64_t step = std::max<int64_t>(1, c.batch / 97);
  for (int64_t b = 0; b < c.batch; b += step) {
    ModelRow(c, r.q_ids.data() + b * c.seqlen_q, r.kv_ids.data() + b * c.seqlen_k, &m);
    if (!check("q_span", r.lay.q_span, b, m.q_span) ||
        !check("kv_span", r.lay.kv_span, b, m.kv_span) ||
        !check("q_ids", r.lay.q_ids, b, m.q_pad) || !check("kv_ids", r.lay.kv_ids, b, m.kv_pad) ||
        !check("q_keys", r.lay.q_keys, b, m.q_keys) ||
        !check("q_tiles", r.lay.q_tiles, b, m.q_tiles) ||
        !check("kv_tiles", r.lay.kv_tiles, b, m.kv_tiles)) {
      return false;
    }
  }
  std::printf("PASS %s\n", c.name.c_str());
  return true;
}

// Holds the stream for `cycles` SM clocks, so that the launches queued
// behind it are timed on the GPU alone, not at the host's launch rate.
__global__ void Spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

void Time(const PrepassCase& c) {
  const Prepared r = Prepare(c, 7);
  char* scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&scratch, r.lay.bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  constexpr int kRuns = 100;
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    Spin<<<1, 1>>>(20000000);  // ~10 ms of clocks: longer than enqueuing the runs
    CHECK_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < kRuns; ++i) CHECK_CUDA(Run(c, r, scratch));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(SyncWithWatchdog(c.name));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  std::printf("TIME %s: %.2f us per pre-pass (best of 5 x %d back to back)\n",
              c.name.c_str(), 1e3f * best / kRuns, kRuns);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  CHECK_CUDA(cudaFree(scratch));
  CHECK_CUDA(cudaFree(r.ids));
}

}  // namespace
}  // namespace jax_flash2::selftest

int main(int argc, char** argv) {
  using namespace jax_flash2::selftest;
  bool time = true;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-time") time = false;
  }
  // Chunk shapes of the kernels: forward {64, block_n} with block_m / 64
  // query chunks per tile, backward {block_m, 64} with block_n / 64 key
  // chunks per tile.
  const std::vector<PrepassCase> cases = {
      {"64 docs T16384 fwd D128", SegKind::kPacked, 64, 1, 16384, 16384, 64, 128, 2, 1},
      {"8 docs T16384 fwd D128 176-key", SegKind::kPacked, 8, 1, 16384, 16384, 64, 176, 2, 1},
      {"64 docs T16384 fwd D64", SegKind::kPacked, 64, 1, 16384, 16384, 64, 128, 3, 1},
      {"64 docs T16384 bwd D64", SegKind::kPacked, 64, 1, 16384, 16384, 128, 64, 1, 2},
      {"8 docs T16384 bwd D128", SegKind::kPacked, 8, 1, 16384, 16384, 64, 64, 1, 2},
      {"5 docs T1000 S777 B3 fwd D256", SegKind::kPacked, 5, 3, 1000, 777, 64, 80, 2, 1},
      {"padded T1000 S1000 B2 fwd", SegKind::kPadded, 6, 2, 1000, 1000, 64, 128, 2, 1},
      {"padded T17 S3001 B2 bwd", SegKind::kPadded, 3, 2, 17, 3001, 128, 64, 1, 2},
      {"short docs T4099 B2 fwd D64", SegKind::kShort, 0, 2, 4099, 4099, 64, 128, 3, 1},
      {"short docs T2000 S333 bwd", SegKind::kShort, 0, 1, 2000, 333, 64, 64, 1, 2},
      {"unsorted T999 S1501 fwd", SegKind::kRandom, 0, 2, 999, 1501, 64, 176, 2, 1},
      {"unsorted T999 S1501 bwd", SegKind::kRandom, 0, 2, 999, 1501, 128, 64, 1, 2},
      {"missing kv docs T3000 fwd", SegKind::kMissing, 9, 1, 3000, 3000, 64, 128, 2, 1},
      {"70000 rows T37 S21 fwd", SegKind::kPacked, 3, 70000, 37, 21, 64, 128, 2, 1},
      {"2 docs T200000 S150000 bwd", SegKind::kPacked, 2, 1, 200000, 150000, 64, 64, 1, 2},
      // Many groups of chunks (the group search above 1024 chunks): unsorted
      // ids meet every group, short sorted documents a few.
      {"unsorted T5000 S9001 fwd", SegKind::kRandom, 0, 1, 5000, 9001, 64, 176, 2, 1},
      {"unsorted T9001 S5000 B2 bwd", SegKind::kRandom, 0, 2, 9001, 5000, 128, 64, 1, 2},
      {"short docs T70001 bwd", SegKind::kShort, 0, 1, 70001, 70001, 64, 64, 1, 2},
      {"unsorted T70001 S66000 fwd", SegKind::kRandom, 0, 1, 70001, 66000, 64, 128, 2, 1},
  };
  // varlen's one row of many sequences: checked, then timed beside the rows of 16k.
  const std::vector<PrepassCase> long_rows = {
      {"1000 docs T300000 fwd D64", SegKind::kPacked, 1000, 1, 300000, 300000, 64, 128, 3, 1},
      {"4096 docs T1048576 fwd D128", SegKind::kPacked, 4096, 1, 1 << 20, 1 << 20, 64, 128, 2,
       1},
      {"4096 docs T1048576 bwd D128", SegKind::kPacked, 4096, 1, 1 << 20, 1 << 20, 64, 64, 1,
       2},
  };
  int failures = 0;
  uint64_t seed = 1;
  for (const PrepassCase& c : cases) failures += Compare(c, seed++) ? 0 : 1;
  for (const PrepassCase& c : long_rows) failures += Compare(c, seed++) ? 0 : 1;
  std::printf("%s: %d failure(s) of %zu cases\n", failures ? "FAILED" : "ALL PASSED", failures,
              cases.size() + long_rows.size());
  if (time) {
    for (int i = 0; i < 5; ++i) Time(cases[i]);
    for (const PrepassCase& c : long_rows) Time(c);
  }
  return failures ? 1 : 0;
}
