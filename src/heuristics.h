// Host-side launch heuristics: plain C++, no CUDA, so the CPU module can expose
// them to Python unit tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace jax_flash2 {

// Number of key-range splits for the forward pass (flash-decoding).
//
// batch_heads_mblocks: thread blocks of the unsplit grid (B * heads * m-blocks).
// num_n_blocks: key blocks of one query block. block_slots: blocks the GPU runs
// at once (the caller passes SMs x expected residency). max_splits: hard cap.
//
// A grid that already fills ~80% of the slots is not split: splitting would
// only add the combine pass. Otherwise, for every split count s, the last wave
// is (blocks * s / slots) / ceil(...) full; we take the smallest s within
// min_efficiency (85%) of the best such efficiency, since each split adds
// partial O traffic and a share of the combine. The memory-bound decode kernel
// asks for 95%: there an idle SM is lost bandwidth, and a split's partials are
// small beside the keys it streams. Counts that leave ceil(n_blocks / s) unchanged from
// s - 1 give the same per-block work with more blocks, so they are skipped.
inline int ChooseNumSplits(int64_t batch_heads_mblocks, int64_t num_n_blocks, int block_slots,
                           int max_splits, double min_efficiency = 0.85) {
  if (batch_heads_mblocks <= 0 || num_n_blocks <= 1 || block_slots <= 0 || max_splits <= 1) {
    return 1;
  }
  if (batch_heads_mblocks * 5 >= int64_t{block_slots} * 4) return 1;
  const int64_t cap = std::min<int64_t>({int64_t{max_splits}, int64_t{block_slots}, num_n_blocks});
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto eligible = [&](int64_t s) {
    return s == 1 || ceil_div(num_n_blocks, s) != ceil_div(num_n_blocks, s - 1);
  };
  auto efficiency = [&](int64_t s) {
    const double waves = static_cast<double>(batch_heads_mblocks * s) / block_slots;
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= cap; ++s) {
    if (eligible(s)) best = std::max(best, efficiency(s));
  }
  for (int64_t s = 1; s <= cap; ++s) {
    if (eligible(s) && efficiency(s) >= min_efficiency * best) return static_cast<int>(s);
  }
  return 1;
}

}  // namespace jax_flash2
