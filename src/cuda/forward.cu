// Host side of the CUDA forward: what the kernels support, the
// launch plan (GQA packing, split-KV), the one runtime -> template dispatch,
// and the split-KV combine kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "../flash_mask.h"
#include "../heuristics.h"
#include "decode_trace.cuh"
#include "flash_cuda.h"
#include "fwd_launch.h"
#include "kernel_traits.h"
#include "primitives.cuh"
#if JF2_HAVE_SM90
#include "sm90/fwd_sm90.h"
#endif

namespace jax_flash2::cuda {
JF2_TRACE_RING(g_combine_ring, ReadCombineTrace, ResetCombineTrace)
namespace {

constexpr int kMaxSplits = 128;
// The split heuristic assumes this many resident forward blocks per SM (the
// d128 kernel's register use allows two), as FlashAttention-2 does.
constexpr int kBlocksPerSm = 2;
constexpr int kCombineWarps = 4;

struct FwdPlan {
  bool decode = false;  // the decode kernel (decode_kernel.cu); else the prefill one
  int bucket = 0;       // the kernel's compile-time head dim
  FwdTileSizes tile{};  // the prefill kernel's tile (unused by the decode kernel)
  int pack = 1;
  int num_m_blocks = 0;
  int num_splits = 1;
  int n_blocks_per_split = 0;
  int kv_stages = 1;
  int m_tiles = 1;  // the decode kernel: m16 tiles of rows per block
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Decode-shaped: few packed rows per K/V head (DecodeMaxRows).
bool IsDecodeShape(const FlashParams& p) {
  return p.seqlen_q * p.group_size <= DecodeMaxRows(DecodeTileFor(p.head_dim));
}

// JAX_FLASH2_DECODE_KERNEL=0 sends decode shapes to the prefill kernel (read
// once per process): for side-by-side timings and as a way out.
bool DecodeKernelEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_FLASH2_DECODE_KERNEL");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// JAX_FLASH2_DECODE_PDL=0 launches the decode kernel and its combine as plain
// stream-ordered grids (read once per process; for comparisons).
bool DecodePdlEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_FLASH2_DECODE_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// The decode kernel serves decode shapes without score variants or dropout,
// on GPUs with its shared memory (135-140 KB at d128: not sm86/sm89's 99 KB).
bool UseDecodeKernel(const FlashParams& p, const DeviceInfo& dev) {
  if (!IsDecodeShape(p) || HasScoreVariants(p) || p.dropout_seeds != nullptr) return false;
  const DecodeTileSizes tile = DecodeTileFor(p.head_dim);
  const int smem = DecodeSmemBytes(tile, DecodeMTiles(tile, p.seqlen_q * p.group_size));
  return static_cast<size_t>(smem) <= dev.max_smem_per_block_optin && DecodeKernelEnabled();
}

// Splits of the decode kernel: its blocks stream disjoint keys (memory bound),
// so the wave should fill the GPU closely (95%, not the prefill's 85%).
FwdPlan MakeDecodePlan(const FlashParams& p, const DeviceInfo& dev) {
  FwdPlan plan;
  plan.decode = true;
  const DecodeTileSizes tile = DecodeTileFor(p.head_dim);
  plan.bucket = tile.head_dim;
  plan.pack = static_cast<int>(p.group_size);
  plan.num_m_blocks = 1;
  plan.m_tiles = DecodeMTiles(tile, p.seqlen_q * p.group_size);
  const int64_t chunks = CeilDiv(p.seqlen_k, tile.warp_keys);
  const int64_t block_steps = CeilDiv(chunks, kDecodeWarps);  // chunk rounds of the warps
  const int splits = ChooseNumSplits(p.batch * p.num_heads_kv, block_steps,
                                     dev.sm_count * tile.blocks_per_sm, kMaxSplits, 0.95);
  if (splits > 1) {
    plan.n_blocks_per_split = static_cast<int>(CeilDiv(block_steps, splits) * kDecodeWarps);
    plan.num_splits = static_cast<int>(CeilDiv(chunks, plan.n_blocks_per_split));
  }
  return plan;
}

FwdPlan MakePrefillPlan(const FlashParams& p, const DeviceInfo& dev) {
  FwdPlan plan;
  plan.tile = FwdTileFor(p.head_dim);
  plan.bucket = plan.tile.head_dim;
  // Pack a GQA group into the M dimension when the queries alone would leave
  // most of a block empty (decode): each K/V head is then streamed once for
  // its whole group instead of once per query head.
  if (p.group_size > 1 && p.seqlen_q < plan.tile.block_m) plan.pack = static_cast<int>(p.group_size);
  plan.num_m_blocks = static_cast<int>(CeilDiv(p.seqlen_q * plan.pack, plan.tile.block_m));
  const int64_t num_n_blocks = CeilDiv(p.seqlen_k, plan.tile.block_n);
  const int64_t blocks = p.batch * (p.num_heads_q / plan.pack) * plan.num_m_blocks;
  const int splits =
      ChooseNumSplits(blocks, num_n_blocks, dev.sm_count * kBlocksPerSm, kMaxSplits);
  if (splits > 1) {
    // Even shares of whole key blocks; recount so that no split is empty by
    // construction (a split can still be empty under a mask).
    plan.n_blocks_per_split = static_cast<int>(CeilDiv(num_n_blocks, splits));
    plan.num_splits = static_cast<int>(CeilDiv(num_n_blocks, plan.n_blocks_per_split));
  }
  // Small (split or packed) grids are bound by copy latency, not by the tensor
  // cores: give them a second K/V stage when it fits.
  if ((plan.num_splits > 1 || plan.pack > 1) &&
      static_cast<size_t>(FwdSmemBytes(plan.tile, 2, p.dropout_seeds != nullptr)) <=
          dev.max_smem_per_block_optin) {
    plan.kv_stages = 2;
  }
  return plan;
}

// Everything that decides the grid and the scratch size, so that
// ForwardScratchBytes and RunForward cannot disagree.
FwdPlan MakeFwdPlan(const FlashParams& p, const DeviceInfo& dev) {
  return UseDecodeKernel(p, dev) ? MakeDecodePlan(p, dev) : MakePrefillPlan(p, dev);
}

// Scratch: partial LSEs first (padded to 256 bytes), then partial O.
size_t PartialLseBytes(const FlashParams& p, const FwdPlan& plan) {
  const size_t n = static_cast<size_t>(plan.num_splits) * p.batch * p.num_heads_q * p.seqlen_q;
  return (n * sizeof(float) + 255) / 256 * 256;
}

size_t ScratchBytes(const FlashParams& p, const FwdPlan& plan) {
  if (plan.num_splits <= 1) return 0;
  const size_t n = static_cast<size_t>(plan.num_splits) * p.batch * p.num_heads_q * p.seqlen_q;
  return PartialLseBytes(p, plan) + n * p.head_dim * sizeof(float);
}

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
  JF2_TRACE_BEGIN(g_combine_ring);
  JF2_STAMP(kStart);
  WaitForPrimaryGrid();  // the partials are the main kernel's (programmatic_launch)
  JF2_STAMP(kWaited);
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
  // Empty splits carry -inf and weigh 0. When every split is empty the max
  // itself is -inf and must not be subtracted (-inf - -inf = NaN): the row
  // then gets O = 0 and LSE = -inf, like an unsplit row that sees no key.
  const bool empty = mx == -INFINITY;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kLseSlots; ++i) sum += empty ? 0.f : expf(lse_i[i] - mx);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float lse = empty ? -INFINITY : mx + logf(sum);
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
#pragma unroll
    for (int j = 0; j < kColSlots; ++j) add(w, j, prefetched[k][j]);
  }
#pragma unroll 8
  for (int s = warp + kCombineWarps * kPrefetch; s < num_splits; s += kCombineWarps) {
    const float w = weights[s];
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
  JF2_STAMP(kEnd);
}

template <typename Elem>
cudaError_t LaunchBucket(const FwdArgs& args, int bucket, cudaStream_t stream) {
  switch (bucket) {
    case 32: return LaunchFwdKernel<Elem, 32>(args, stream);
    case 64: return LaunchFwdKernel<Elem, 64>(args, stream);
    case 96: return LaunchFwdKernel<Elem, 96>(args, stream);
    case 128: return LaunchFwdKernel<Elem, 128>(args, stream);
    case 192: return LaunchFwdKernel<Elem, 192>(args, stream);
    case 256: return LaunchFwdKernel<Elem, 256>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Elem>
cudaError_t LaunchForward(const FwdArgs& args, const FwdPlan& plan, cudaStream_t stream) {
  const cudaError_t err = plan.decode
                              ? LaunchDecodeKernel<Elem>(args, plan.bucket, plan.m_tiles, stream)
                              : LaunchBucket<Elem>(args, plan.bucket, stream);
  if (err != cudaSuccess || args.num_splits <= 1) return err;
  return LaunchFwdCombine<Elem>(args, stream);
}

}  // namespace

template <typename Elem>
cudaError_t LaunchFwdCombine(const FwdArgs& args, cudaStream_t stream) {
  const int64_t rows = args.p.batch * args.p.num_heads_q * args.p.seqlen_q;
  return LaunchWithFwdArgs(FwdCombineKernel<Elem>, dim3(static_cast<unsigned>(rows)),
                           dim3(kCombineWarps * 32), 0, stream, args);
}

std::string Unsupported(const FlashParams& p, const DeviceInfo& dev) {
  if (p.dtype == DType::kFloat32) {
    return "float32 is not supported by the CUDA kernels; use bfloat16/float16";
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return "unknown dtype for the CUDA kernels; use bfloat16/float16";
  }
  if (dev.cc_major < 8) {
    return "compute capability " + std::to_string(dev.cc_major) + "." +
           std::to_string(dev.cc_minor) + " is not supported by the CUDA kernels (need 8.0+)";
  }
  if (p.head_dim <= 0 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return "head_dim D=" + std::to_string(p.head_dim) +
           " is not supported by the CUDA kernels: it must be a multiple of 8 in [8, 256]";
  }
  if (p.num_heads_kv <= 0 || p.num_heads_q % p.num_heads_kv != 0 ||
      p.group_size != p.num_heads_q / p.num_heads_kv) {
    return "num_heads_q H=" + std::to_string(p.num_heads_q) +
           " must be a multiple of num_heads_kv K=" + std::to_string(p.num_heads_kv) +
           " with group_size = H / K";
  }
  // cp.async moves 16-byte chunks: every row must start 16-byte aligned.
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0) {
      return "the CUDA kernels need every stride to be a multiple of 8 elements; got " +
             std::to_string(s);
    }
  }
  if (p.batch > 65535 || p.num_heads_q > 65535 || p.seqlen_q >= (int64_t{1} << 31) / 128 ||
      p.seqlen_k >= (int64_t{1} << 31) - 256) {
    return "shape too large for the CUDA kernels' grid: B=" + std::to_string(p.batch) +
           " (max 65535), H=" + std::to_string(p.num_heads_q) + " (max 65535), T=" +
           std::to_string(p.seqlen_q) + ", S=" + std::to_string(p.seqlen_k);
  }
  const int smem = FwdSmemBytes(FwdTileFor(p.head_dim), 1, p.dropout_seeds != nullptr);
  if (static_cast<size_t>(smem) > dev.max_smem_per_block_optin) {
    return "head_dim D=" + std::to_string(p.head_dim) + " needs " + std::to_string(smem) +
           " bytes of shared memory per block; this GPU allows " +
           std::to_string(dev.max_smem_per_block_optin);
  }
  return "";
}

namespace {

#if JF2_HAVE_SM90
// The Hopper kernel serves cc 9.0 calls it supports that the sm80 prefill
// plan would run as one plain grid; split-KV and GQA-packed prefill and the
// decode kernel's calls stay on the sm80 kernels, which implement them.
bool UseSm90Forward(const FlashParams& p, const DeviceInfo& dev, const FwdPlan& plan) {
  return dev.cc_major == 9 && !plan.decode && plan.num_splits == 1 && plan.pack == 1 &&
         Sm90ForwardSupports(p);
}
#endif

}  // namespace

size_t ForwardScratchBytes(const FlashParams& p, const DeviceInfo& dev) {
  if (!Unsupported(p, dev).empty() || p.batch * p.seqlen_q * p.num_heads_q == 0) return 0;
  const FwdPlan prefill = MakePrefillPlan(p, dev);
  size_t bytes = ScratchBytes(p, prefill);
#if JF2_HAVE_SM90
  if (UseSm90Forward(p, dev, prefill)) bytes = std::max(bytes, Sm90ForwardScratchBytes(p, dev));
#endif
  // The lowering sizes the workspace without the score options, which decide
  // between the decode and prefill kernels: enough for either.
  return IsDecodeShape(p) ? std::max(bytes, ScratchBytes(p, MakeDecodePlan(p, dev))) : bytes;
}

namespace {

// Calls served by each forward kernel in this process, for tests and
// kernel_info: which path ran is otherwise invisible to the caller.
std::atomic<int64_t> forward_calls[3];  // sm80 prefill, sm90, decode

}  // namespace

ForwardCallCounts GetForwardCallCounts() {
  return {forward_calls[0].load(), forward_calls[1].load(), forward_calls[2].load()};
}

cudaError_t RunForward(const FlashParams& p, void* scratch, const DeviceInfo& dev,
                       cudaStream_t stream) {
  if (!Unsupported(p, dev).empty()) return cudaErrorInvalidValue;
  if (p.batch * p.seqlen_q * p.num_heads_q == 0) return cudaSuccess;  // nothing to write
  const FwdPlan plan = MakeFwdPlan(p, dev);
#if JF2_HAVE_SM90
  if (UseSm90Forward(p, dev, plan)) {
    ++forward_calls[1];
    return RunForwardSm90(p, scratch, dev, stream);
  }
#endif
  ++forward_calls[plan.decode ? 2 : 0];
  FwdArgs args;
  args.p = p;
  args.pack = plan.pack;
  args.num_m_blocks = plan.num_m_blocks;
  args.kv_stages = plan.kv_stages;
  args.num_splits = plan.num_splits;
  args.n_blocks_per_split = plan.n_blocks_per_split;
  args.programmatic_launch = plan.decode && dev.cc_major >= 9 && DecodePdlEnabled();
  const double kv_bytes = 2.0 * p.batch * p.seqlen_k * p.num_heads_kv * p.head_dim * 2;
  args.kv_read_once = plan.decode && kv_bytes > 0.5 * static_cast<double>(dev.l2_bytes);
  if (plan.num_splits > 1) {
    if (scratch == nullptr) return cudaErrorInvalidValue;
    args.lse_partial = static_cast<float*>(scratch);
    args.o_partial = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                              PartialLseBytes(p, plan));
  }
  switch (p.dtype) {
    case DType::kFloat16: return LaunchForward<__half>(args, plan, stream);
    case DType::kBFloat16: return LaunchForward<__nv_bfloat16>(args, plan, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::cuda
