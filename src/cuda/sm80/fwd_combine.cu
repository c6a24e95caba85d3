// The split-KV combine kernel: merges the normalised partials of the splits
// of a forward call (prefill or decode kernel) into O and LSE.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../online_softmax.h"
#include "fwd_launch.h"
#include "primitives.cuh"

namespace jax_flash2::cuda {
namespace {

constexpr int kCombineWarps = 4;

// One block per (b, h, t) row: LSE = log sum_i exp(LSE_i), O = sum_i
// exp(LSE_i - LSE) O_i, over the splits i. Its time is a chain of memory
// round trips (split decode calls have few rows), so it issues its loads
// together: each warp the partial rows of its first kPrefetch splits (w,
// w + 4, ...) and every lane its splits' LSEs, then sums the rows once the
// weights are known; the warps' sums meet in shared memory. (One warp per
// row, walking the splits in batches of 8, took 9 us at B1 S32k under ncu,
// against 23 us for the decode kernel itself.)
template <typename Elem>
__global__ void __launch_bounds__(kCombineWarps * 32)
    FwdCombineKernel(const __grid_constant__ FwdArgs args) {
  constexpr int kLseSlots = kMaxSplits / 32;  // splits lane, lane + 32, ... of each lane
  constexpr int kColSlots = 256 / 128;        // columns lane * 4 + 128 j, head_dim <= 256
  constexpr int kPrefetch = 8;                // per warp: 32 splits load in one round trip
  __shared__ float weights[kMaxSplits];
  __shared__ float4 warp_sums[kCombineWarps - 1][kColSlots][32];
  // A next decode call may be scheduled now; it waits for this grid.
  AllowDependentLaunch();
  WaitForPrimaryGrid();  // the partials are the main kernel's (programmatic_launch)
  const FlashParams& p = args.p;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.num_heads_q * p.seqlen_q;  // [B, H, T], LSE order
  const int64_t row = blockIdx.x;
  const int num_splits = args.num_splits;
  const float* lse_part = args.lse_partial + row;

  // Warp w sums splits w, w + 4, ...; head_dim is a multiple of 8, so a
  // lane's 4 columns never straddle its end.
  const int64_t head_dim = p.head_dim;
  const float* o_part = args.o_partial + row * head_dim;
  const int64_t split_stride = rows * head_dim;
  float4 prefetched[kPrefetch][kColSlots];
#pragma unroll
  for (int k = 0; k < kPrefetch; ++k) {
    const int s = warp + kCombineWarps * k;
#pragma unroll
    for (int j = 0; j < kColSlots; ++j) {
      const int d = lane * 4 + 128 * j;
      prefetched[k][j] = s < num_splits && d < head_dim
                             ? *reinterpret_cast<const float4*>(o_part + s * split_stride + d)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  // Every warp reduces the LSEs itself (no barrier before the weights).
  float lse_i[kLseSlots];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kLseSlots; ++i) {
    const int s = lane + 32 * i;
    lse_i[i] = s < num_splits ? lse_part[s * rows] : -INFINITY;
    mx = fmaxf(mx, lse_i[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  // Empty splits carry -inf and weigh 0; when every split is empty the sum
  // is 0 and the row gets O = 0 and LSE = -inf, like an unsplit row that sees
  // no key. A split whose scores held a NaN has a NaN LSE (fmaxf skips it,
  // expf does not): the sum, the LSE and O come out NaN.
  const float base = ExpOffset(mx, 1.f);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kLseSlots; ++i) sum += expf(lse_i[i] - base);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const bool empty = sum == 0.f;
  const float lse = RowLse(base, sum, IeeeLog{});
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < kLseSlots; ++i) {
      const int s = lane + 32 * i;
      if (s < num_splits) weights[s] = empty ? 0.f : expf(lse_i[i] - lse);
    }
  }
  __syncthreads();

  float4 acc[kColSlots];
#pragma unroll
  for (int j = 0; j < kColSlots; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float w, int j, float4 v) {
    acc[j].x += w * v.x;
    acc[j].y += w * v.y;
    acc[j].z += w * v.z;
    acc[j].w += w * v.w;
  };
#pragma unroll
  for (int k = 0; k < kPrefetch; ++k) {
    const int s = warp + kCombineWarps * k;
    const float w = s < num_splits ? weights[s] : 0.f;
    if (w == 0.f) continue;  // an empty split may not have written its O
#pragma unroll
    for (int j = 0; j < kColSlots; ++j) add(w, j, prefetched[k][j]);
  }
#pragma unroll 8
  for (int s = warp + kCombineWarps * kPrefetch; s < num_splits; s += kCombineWarps) {
    const float w = weights[s];
    if (w == 0.f) continue;
#pragma unroll
    for (int j = 0; j < kColSlots; ++j) {
      const int d = lane * 4 + 128 * j;
      if (d < head_dim) add(w, j, *reinterpret_cast<const float4*>(o_part + s * split_stride + d));
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int j = 0; j < kColSlots; ++j) warp_sums[warp - 1][j][lane] = acc[j];
  }
  __syncthreads();
  if (warp != 0) return;
  const int64_t t = row % p.seqlen_q;
  const int64_t bh = row / p.seqlen_q;
  const int64_t head = bh % p.num_heads_q;
  const int64_t b = bh / p.num_heads_q;
  Elem* o_row = static_cast<Elem*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
                head * p.o_head_stride;
#pragma unroll
  for (int j = 0; j < kColSlots; ++j) {
    const int d = lane * 4 + 128 * j;
    if (d >= head_dim) continue;
    float4 total = acc[j];
#pragma unroll
    for (int w = 0; w < kCombineWarps - 1; ++w) {
      const float4 x = warp_sums[w][j][lane];
      total = make_float4(total.x + x.x, total.y + x.y, total.z + x.z, total.w + x.w);
    }
    *reinterpret_cast<uint2*>(o_row + d) =
        make_uint2(PackFloat2<Elem>(total.x, total.y), PackFloat2<Elem>(total.z, total.w));
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace

template <typename Elem>
cudaError_t LaunchFwdCombine(const FwdArgs& args, cudaStream_t stream) {
  const int64_t rows = args.p.batch * args.p.num_heads_q * args.p.seqlen_q;
  return LaunchWithFwdArgs(FwdCombineKernel<Elem>, dim3(static_cast<unsigned>(rows)),
                           dim3(kCombineWarps * 32), 0, stream, args);
}


template cudaError_t LaunchFwdCombine<__half>(const FwdArgs&, cudaStream_t);
template cudaError_t LaunchFwdCombine<__nv_bfloat16>(const FwdArgs&, cudaStream_t);

}  // namespace jax_flash2::cuda
