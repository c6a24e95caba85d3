// The CUDA forward's entry points: what the kernels support, the launch plan
// (GQA packing, split-KV, decode or prefill kernel), and the choice between the
// Hopper (sm90/) and the sm80 (sm80/) kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include "../flash_mask.h"
#include "../heuristics.h"
#include "../test_switches.h"
#include "flash_cuda.h"
#include "sm80/fwd_launch.h"
#include "sm80/kernel_traits.h"
#if JF2_HAVE_SM90
#include "sm90/fwd_sm90.h"
#endif

namespace jax_flash2::cuda {
namespace {

// The split heuristic assumes this many resident forward blocks per SM (the
// d128 kernel's register use allows two), as FlashAttention-2 does.
constexpr int kBlocksPerSm = 2;

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

// The decode kernel serves decode shapes without score variants or dropout,
// on GPUs with its shared memory (135-140 KB at d128: not sm86/sm89's 99 KB).
bool UseDecodeKernel(const FlashParams& p, const DeviceInfo& dev) {
  if (!IsDecodeShape(p) || HasScoreVariants(p) || p.dropout_seeds != nullptr) return false;
  const DecodeTileSizes tile = DecodeTileFor(p.head_dim);
  const int smem = DecodeSmemBytes(tile, DecodeMTiles(tile, p.seqlen_q * p.group_size));
  return static_cast<size_t>(smem) <= dev.max_smem_per_block_optin && GetTestSwitches().decode_kernel;
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

}  // namespace

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
  args.programmatic_launch = plan.decode && dev.cc_major >= 9 && GetTestSwitches().decode_pdl;
  const double kv_bytes = 2.0 * p.batch * p.seqlen_k * p.num_heads_kv * p.head_dim * 2;
  args.kv_read_once = plan.decode && kv_bytes > 0.5 * static_cast<double>(dev.l2_bytes);
  if (plan.num_splits > 1) {
    if (scratch == nullptr) return cudaErrorInvalidValue;
    args.lse_partial = static_cast<float*>(scratch);
    args.o_partial = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                              PartialLseBytes(p, plan));
  }
  return LaunchSm80Forward(args, plan.decode, plan.bucket, plan.m_tiles, stream);
}

}  // namespace jax_flash2::cuda
