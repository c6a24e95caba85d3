// The rotated deterministic dQ order of the Hopper backward (bwd_sm90.h says
// when it runs): the walk of a tile and the turns it takes, for the kernel
// and for the host test (tests/cuda/dq_order_host_test.cc).
//
// N key blocks of one (batch, K/V head) each visit the same I >= N query
// iterations. Key block n's step `it` visits iteration (it + n) mod I, so in
// step the tiles are on N different iterations. Iteration w takes the key
// blocks in the order their walks reach it: n = min(w, N - 1) first (at its
// earliest step), then the lower ones down to 0, then N - 1 down to w + 1.
// A key block's turn at w is its place in that order; at each step it waits
// only for key blocks at earlier steps of their walks.
#pragma once

#if defined(__CUDACC__)
#define JF2_DQ_ORDER_HD __host__ __device__ __forceinline__
#else
#define JF2_DQ_ORDER_HD inline
#endif

namespace jax_flash2::cuda::sm90 {

// The iteration key block n visits at step `it` (it, n < num_iters).
JF2_DQ_ORDER_HD constexpr int RotatedDqVisit(int it, int n, int num_iters) {
  const int v = it + n;
  return v >= num_iters ? v - num_iters : v;
}

// Key block n's turn at iteration w (n < num_n_blocks <= the iterations).
JF2_DQ_ORDER_HD constexpr int RotatedDqTurn(int n, int w, int num_n_blocks) {
  const int first = w < num_n_blocks - 1 ? w : num_n_blocks - 1;
  return first - n + (w < n ? num_n_blocks : 0);
}

static_assert(RotatedDqTurn(2, 3, 3) == 0 && RotatedDqTurn(0, 3, 3) == 2 &&
              RotatedDqTurn(0, 0, 3) == 0 && RotatedDqTurn(2, 0, 3) == 1 &&
              RotatedDqTurn(1, 0, 3) == 2 && RotatedDqVisit(3, 2, 4) == 1);

}  // namespace jax_flash2::cuda::sm90
