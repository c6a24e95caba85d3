// The causal / window mask on a P^T accumulator tile in the Hopper backward
// kernels (bwd_sm90_kernel.cuh, bwd_sm90_dsplit_kernel.cuh).
#pragma once

namespace jax_flash2::cuda::sm90 {

// Zeroes the masked elements of a 64-key x (kAcc / 4 * 8)-query P^T
// accumulator (element i: key row 16 warp + g + 8 ((i / 2) % 2), query
// m_begin + 8 (i / 4) + 2 t4 + i % 2), given the queries [q_lo[rh],
// q_hi[rh]) that see this thread's key row rh, as 32-bit ints computed once
// per tile (64-bit WindowMask tests in every iteration cost the D = 64
// consumers spills). For blocks not fully visible only: one branch per
// block, none per element (a per-element mask call made ptxas wrap every
// exponential in its own branch).
template <int kAcc>
__device__ __forceinline__ void ZeroMaskedScores(float (&p)[kAcc], int m_begin, int t4,
                                                 const int (&q_lo)[2], const int (&q_hi)[2]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int query = m_begin + 8 * (i / 4) + 2 * t4 + (i & 1);
    const int rh = (i / 2) % 2;
    if (query < q_lo[rh] || query >= q_hi[rh]) p[i] = 0.f;
  }
}

}  // namespace jax_flash2::cuda::sm90
