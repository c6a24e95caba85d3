// The head dims the Hopper kernels are built for, and the one a call runs at
// (fwd_sm90.h and bwd_sm90.h look their tiles up by it).
#pragma once

#include <cstdint>

namespace jax_flash2::cuda::sm90 {

// A call of head dim D runs the kernel of the next bucket. Its tensor maps
// keep D as their first extent, so the 64-column boxes past D are zero-filled
// on load (still counting their full bytes on the mbarrier) and dropped on
// store: the extra columns cost their share of the products, no copies in
// HBM. 0: no bucket (D > 256).
inline constexpr int64_t kSm90HeadDimBuckets[] = {64, 128, 256};
constexpr int64_t Sm90HeadDimBucket(int64_t head_dim) {
  for (int64_t bucket : kSm90HeadDimBuckets) {
    if (head_dim > 0 && head_dim <= bucket) return bucket;
  }
  return 0;
}

}  // namespace jax_flash2::cuda::sm90
