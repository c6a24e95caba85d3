// What the forward dispatch (forward.cu) hands to the per-bucket kernel
// instantiations (fwd_hdim*.cu). Plain C++ so both sides see one definition.
#pragma once

#include <cuda_runtime.h>

#include "../../flash_params.h"
#include "../../plan.h"  // kMaxSplits
#include "../launch.h"

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
  // sm90+, decode kernel: it and its combine are launched as programmatic
  // dependents of the grid before them (griddepcontrol), so each is scheduled
  // while its predecessor still runs, hiding the launch, and waits for it
  // in-kernel before touching memory.
  bool programmatic_launch = false;
  // The decode kernel's K/V are larger than half the L2: loaded evict-first
  // (they cannot stay for a next call, and would push out code and partials).
  bool kv_read_once = false;
  // Split-KV partials (num_splits > 1 only), each split normalised on its own:
  float* o_partial = nullptr;    // [splits, B, H, T, head_dim] fp32
  float* lse_partial = nullptr;  // [splits, B, H, T] fp32, -inf for an empty split
};

// Launches kernel(args) on `stream`; with args.programmatic_launch as a
// programmatic dependent of the grid before it (the kernel must then wait
// for it, WaitForPrimaryGrid, before touching memory).
template <typename Kernel>
cudaError_t LaunchWithFwdArgs(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes,
                              cudaStream_t stream, const FwdArgs& args) {
  return LaunchKernel(kernel, grid, block, smem_bytes, stream, args.programmatic_launch, args);
}

// One head-dim bucket's forward kernel; defined in fwd_kernel.cuh, instantiated
// per bucket in fwd_hdim*.cu.
template <typename Elem, int kHeadDim>
cudaError_t LaunchFwdKernel(const FwdArgs& args, cudaStream_t stream);

// The decode kernel of a head-dim bucket (64, 128 or 256) with m_tiles m16
// tiles of rows per block (DecodeMTiles) for calls whose packed rows T *
// group_size are at most DecodeMaxRows, with the bucket's small-smem tile
// where small_smem (kDecodeTileSmallSmem); decode_kernel.cu.
template <typename Elem>
cudaError_t LaunchDecodeKernel(const FwdArgs& args, int bucket, int m_tiles, bool small_smem,
                               cudaStream_t stream);

// The same for a quantized KV cache (args.p.kv_quant: int8 or float8_e4m3fn
// k and v with args.p.kv_scales), dequantized in the kernel, for bfloat16 or
// float16 q; decode_kernel.cu.
cudaError_t LaunchQuantizedDecodeKernel(const FwdArgs& args, int bucket, int m_tiles,
                                        bool small_smem, cudaStream_t stream);

// Merges the split partials into O (Elem) and LSE; fwd_combine.cu.
template <typename Elem>
cudaError_t LaunchFwdCombine(const FwdArgs& args, cudaStream_t stream);

// The sm80 forward of args.p's dtype: the decode kernel (m_tiles m16 tiles
// of rows; its small-smem tile where decode_small_smem) or the prefill kernel
// of a head-dim bucket, then the combine when args.num_splits > 1;
// fwd_launch.cu.
cudaError_t LaunchSm80Forward(const FwdArgs& args, bool decode, bool decode_small_smem, int bucket,
                              int m_tiles, cudaStream_t stream);

}  // namespace jax_flash2::cuda
