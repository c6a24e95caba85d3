// What the forward dispatch (fwd_launch.cu) hands to the per-bucket kernel
// instantiations (fwd_hdim*.cu). Plain C++ so both sides see one definition.
#pragma once

#include <cuda_runtime.h>

#include "../flash_params.h"

namespace jax_flash2::cuda {

struct FwdArgs {
  FlashParams p;
  // Query heads packed into the M dimension: block row r is query t = r / pack
  // of head z * pack + r % pack (z = blockIdx.z). pack == group_size packs a GQA
  // group so its K/V head is streamed once for all of them (decode); pack == 1
  // is the plain layout (z is the query head).
  int pack = 1;
  int num_m_blocks = 0;  // over the packed rows T * pack
  int kv_stages = 1;     // K/V shared-memory stages: 1 (prefill) or 2 (decode)
  int num_splits = 1;
  int n_blocks_per_split = 0;  // key blocks (the decode kernel: warp key chunks)
  // Launch the combine as a programmatic dependent of the main kernel (sm90+,
  // decode kernel): it is scheduled while the main kernel runs, hiding its
  // launch, and waits for it in-kernel.
  bool early_combine = false;
  // Split-KV partials (num_splits > 1 only), each split normalised on its own:
  float* o_partial = nullptr;    // [splits, B, H, T, head_dim] fp32
  float* lse_partial = nullptr;  // [splits, B, H, T] fp32, -inf for an empty split
};

// One head-dim bucket's forward kernel; defined in fwd_kernel.cuh, instantiated
// per bucket in fwd_hdim*.cu.
template <typename Elem, int kHeadDim>
cudaError_t LaunchFwdKernel(const FwdArgs& args, cudaStream_t stream);

// The decode kernel of a head-dim bucket (64, 128 or 256) for calls whose
// packed rows T * group_size fit kDecodeRows; decode_kernel.cu.
template <typename Elem>
cudaError_t LaunchDecodeKernel(const FwdArgs& args, int bucket, cudaStream_t stream);

// Merges the split partials into O (Elem) and LSE; defined in fwd_launch.cu.
template <typename Elem>
cudaError_t LaunchFwdCombine(const FwdArgs& args, cudaStream_t stream);

}  // namespace jax_flash2::cuda
