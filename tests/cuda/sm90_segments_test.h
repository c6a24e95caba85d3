// Segment-id layouts for the Hopper self-tests (sm90_fwd_selftest.cu,
// sm90_bwd_selftest.cu): packed documents as data loaders make them, and the
// awkward cases the kernels' block summaries must survive.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "src/flash_params.h"
#include "tests/cuda/selftest_util.h"  // CHECK_CUDA

namespace jax_flash2::selftest {

enum class SegKind : int {
  kNone = 0,
  kPacked,   // `docs` sorted runs of random lengths (some may be empty)
  kPadded,   // kPacked, then a tail of padding id 0 (docs are 1..docs)
  kShort,    // documents of 1..40 tokens (shorter than any block)
  kRandom,   // unsorted: q ids in [0, 4), kv ids in [0, 3) (id 3 sees no key)
  kMissing,  // kPacked, but the kv side holds only the even documents
  kEqual,    // `docs` runs of equal length (the benchmarks' packed rows; timings)
};

// Cuts of `length` into `docs` runs of random lengths (sorted cut points, so
// equal neighbours make empty documents): ids[i] = first_id + run index.
template <class Rng>
void PackedRuns(int64_t length, int docs, int first_id, Rng& rng, int32_t* ids) {
  std::uniform_int_distribution<int64_t> cut(0, length);
  std::vector<int64_t> cuts(std::max(docs - 1, 0));
  for (int64_t& c : cuts) c = cut(rng);
  if (docs > 2) cuts[0] = cuts[1];  // at least one empty document
  std::sort(cuts.begin(), cuts.end());
  int run = 0;
  for (int64_t i = 0; i < length; ++i) {
    while (run < static_cast<int>(cuts.size()) && i >= cuts[run]) ++run;
    ids[i] = first_id + run;
  }
}

// q_ids [B, T], kv_ids [B, S] for a case. T == S shares the ids (self
// attention over packed rows); T != S draws each side's cuts on its own
// (cross attention between packed rows: document d of q sees document d of
// kv).
template <class Rng>
void MakeSegmentIds(SegKind kind, int docs, int64_t B, int64_t T, int64_t S, Rng& rng,
                    std::vector<int32_t>* q_ids, std::vector<int32_t>* kv_ids) {
  q_ids->assign(B * T, 0);
  kv_ids->assign(B * S, 0);
  for (int64_t b = 0; b < B; ++b) {
    int32_t* q = q_ids->data() + b * T;
    int32_t* kv = kv_ids->data() + b * S;
    switch (kind) {
      case SegKind::kNone: break;
      case SegKind::kPacked:
      case SegKind::kMissing:
        PackedRuns(T, docs, 0, rng, q);
        if (T == S) {
          std::copy(q, q + T, kv);
        } else {
          PackedRuns(S, docs, 0, rng, kv);
        }
        if (kind == SegKind::kMissing) {
          for (int64_t j = 0; j < S; ++j) kv[j] = kv[j] / 2 * 2;  // odd docs: no keys
        }
        break;
      case SegKind::kPadded: {
        // Documents 1..docs over the first 80-95%, then padding (id 0).
        std::uniform_int_distribution<int> pct(80, 95);
        const int64_t tq = T * pct(rng) / 100, ts = T == S ? tq : S * pct(rng) / 100;
        PackedRuns(tq, docs, 1, rng, q);
        if (T == S) {
          std::copy(q, q + tq, kv);
        } else {
          PackedRuns(ts, docs, 1, rng, kv);
        }
        break;
      }
      case SegKind::kShort: {
        std::uniform_int_distribution<int64_t> len(1, 40);
        auto fill = [&](int32_t* ids, int64_t n) {
          int32_t id = 0;
          for (int64_t i = 0; i < n;) {
            for (int64_t e = std::min(n, i + len(rng)); i < e; ++i) ids[i] = id;
            ++id;
          }
        };
        fill(q, T);
        if (T == S) {
          std::copy(q, q + T, kv);
        } else {
          fill(kv, S);
        }
        break;
      }
      case SegKind::kEqual:
        for (int64_t i = 0; i < T; ++i) q[i] = static_cast<int32_t>(i * docs / T);
        for (int64_t j = 0; j < S; ++j) kv[j] = static_cast<int32_t>(j * docs / S);
        break;
      case SegKind::kRandom: {
        std::uniform_int_distribution<int32_t> q_id(0, 3), kv_id(0, 2);
        for (int64_t i = 0; i < T; ++i) q[i] = q_id(rng);
        for (int64_t j = 0; j < S; ++j) kv[j] = kv_id(rng);
        break;
      }
    }
  }
}

// Device copies of q_ids [B, T] and kv_ids [B, S] in one buffer (returned;
// the caller frees it), set as p's segment ids.
inline void* UploadSegmentIds(const std::vector<int32_t>& q_ids,
                              const std::vector<int32_t>& kv_ids, FlashParams* p) {
  void* d_ids;
  CHECK_CUDA(cudaMalloc(&d_ids, (q_ids.size() + kv_ids.size()) * 4 + 16));
  CHECK_CUDA(cudaMemcpy(d_ids, q_ids.data(), q_ids.size() * 4, cudaMemcpyHostToDevice));
  int32_t* kv = static_cast<int32_t*>(d_ids) + q_ids.size();
  CHECK_CUDA(cudaMemcpy(kv, kv_ids.data(), kv_ids.size() * 4, cudaMemcpyHostToDevice));
  p->q_segment_ids = static_cast<const int32_t*>(d_ids);
  p->kv_segment_ids = kv;
  return d_ids;
}

// The (query, key) pairs a call computes when q and kv share sorted runs
// (T == S): per run of length L, L^2, or L (L + 1) / 2 under a causal mask,
// summed over the batch (the useful work of a packed row, for TFLOP/s).
inline double VisiblePairs(const std::vector<int32_t>& ids, int64_t B, int64_t T, bool causal) {
  double pairs = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = ids.data() + b * T;
    for (int64_t i = 0; i < T;) {
      int64_t j = i;
      while (j < T && row[j] == row[i]) ++j;
      const double len = static_cast<double>(j - i);
      pairs += causal ? len * (len + 1) / 2 : len * len;
      i = j;
    }
  }
  return pairs;
}

}  // namespace jax_flash2::selftest
