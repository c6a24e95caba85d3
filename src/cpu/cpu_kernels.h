// Per-ISA entry points of the CPU FlashAttention-2 kernels. cpu_kernels.cc is
// compiled once per instruction set (AVX-512, AVX2, baseline), each into its own
// namespace; flash_cpu.cc picks one at run time.
#pragma once

#include <cstdint>

#include "../flash_params.h"

namespace jax_flash2::cpu {

// Query rows per forward task and key rows per backward step.
inline constexpr int64_t kBlockM = 64;
inline constexpr int64_t kBlockN = 64;
// Head dims are zero-padded to a multiple of this in the float32 tiles.
inline constexpr int64_t kDimPad = 16;

inline int64_t PaddedHeadDim(int64_t head_dim) { return (head_dim + kDimPad - 1) / kDimPad * kDimPad; }

// Floats of per-worker scratch one task needs (tiles of Q, K, V, O, dO, dK,
// dV, dQ, S, dP, the softcap derivative and row statistics), forward and
// backward alike.
inline int64_t WorkspaceFloats(int64_t head_dim) {
  const int64_t dp = PaddedHeadDim(head_dim);
  return 10 * kBlockM * dp + 3 * kBlockM * kBlockN + 4 * kBlockM + dp;
}

struct KernelTable {
  // O and LSE for query rows [m_block * kBlockM, +kBlockM) of (batch b, head h).
  void (*forward_block)(const FlashParams& p, float* workspace, int64_t b, int64_t h,
                        int64_t m_block);
  // dK, dV for key blocks [n_block_begin, n_block_end) of (b, kv_head), summed over
  // the head group; adds this range's share of dQ (unscaled) into dq_accum
  // (float32, [B, T, H, D]). dvec = rowsum(dO * O) - dLSE, [B, H, T].
  void (*backward_blocks)(const FlashParams& p, float* workspace, const float* dvec,
                          float* dq_accum, int64_t b, int64_t kv_head, int64_t n_block_begin,
                          int64_t n_block_end);
  const char* isa;
};

namespace avx512 {
extern const KernelTable kTable;
}
namespace avx2 {
extern const KernelTable kTable;
}
namespace baseline {
extern const KernelTable kTable;
}

}  // namespace jax_flash2::cpu
