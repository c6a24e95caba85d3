// Which kernel, tile, grid and split-KV a call gets: a pure function of the
// call (FlashParams: shapes, strides, options) and of the device (DeviceInfo).
// The CUDA launch code (cuda/forward.cu, cuda/backward.cu) runs what these
// functions return, and the CPU extension exposes the same functions as
// jax_flash2.plan (unit-tested on CPU), so the two cannot disagree.
//
// Plain C++ (no CUDA headers); the sm80 tile tables it reads are CUDA-free.
// The Hopper kernels' own tile and schedule tables (cuda/sm90/fwd_sm90.h,
// bwd_sm90.h) need CUDA headers: for those calls the plan names the kernel,
// its head-dim bucket and the options it serves (sm90_options.h), not the tile.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/sm80/bwd_traits.h"
#include "cuda/sm80/kernel_traits.h"
#include "cuda/sm90/head_dim.h"
#include "flash_mask.h"
#include "flash_params.h"
#include "heuristics.h"
#include "sm90_options.h"
#include "test_switches.h"

namespace jax_flash2 {

// What the plan needs to know of a GPU (cuda/device_info.cu fills it).
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  size_t max_smem_per_block_optin = 0;  // bytes a block may use after opting in
  size_t l2_bytes = 0;
};

// Shared memory per block that the Hopper kernels' tiles are built for.
inline constexpr size_t kSm90SmemBytes = 227 * 1024;

// Most key-range splits of a forward call (the combine kernel's LSE slots).
inline constexpr int kMaxSplits = 128;
// Keys per split of a KV-cache decode call (MakeDecodePlan).
inline constexpr int64_t kKvCacheSplitKeys = 2048;
inline constexpr int64_t kKvCacheBlocksPerSm = 4;

// The split heuristic assumes this many resident sm80 forward blocks per SM
// (the d128 kernel's register use allows two), as FlashAttention-2 does.
inline constexpr int kFwdBlocksPerSm = 2;

// What the build and the test switches allow, besides the device.
struct PlanOptions {
  bool have_sm90 = false;      // the build has the Hopper kernels (sm_90a)
  bool decode_kernel = true;   // JAX_FLASH2_DECODE_KERNEL
  bool sm90_backward = true;   // JAX_FLASH2_SM90_BACKWARD
  int64_t kv_split_keys = 0;   // JAX_FLASH2_KV_SPLIT_KEYS; 0: MakeDecodePlan's rule
};

inline PlanOptions PlanOptionsFrom(bool have_sm90, const TestSwitches& switches) {
  return {have_sm90, switches.decode_kernel, switches.sm90_backward, switches.kv_split_keys};
}

enum class FwdKernel : int { kUnsupported = 0, kSm80Prefill, kSm80Decode, kSm90 };
enum class BwdKernel : int { kUnsupported = 0, kSm80, kSm90 };

inline const char* KernelName(FwdKernel k) {
  switch (k) {
    case FwdKernel::kSm80Prefill: return "sm80-prefill";
    case FwdKernel::kSm80Decode: return "sm80-decode";
    case FwdKernel::kSm90: return "sm90";
    default: return "unsupported";
  }
}

inline const char* KernelName(BwdKernel k) {
  switch (k) {
    case BwdKernel::kSm80: return "sm80";
    case BwdKernel::kSm90: return "sm90";
    default: return "unsupported";
  }
}

struct FwdPlan {
  FwdKernel kernel = FwdKernel::kUnsupported;
  // Unsupported: why. Otherwise why a faster kernel does not serve the call
  // (the Hopper one, or the decode kernel for decode shapes); empty when the
  // call runs the first choice.
  std::string reason;
  int bucket = 0;                     // the kernel's compile-time head dim
  cuda::FwdTileSizes tile{};          // sm80 prefill kernel
  cuda::DecodeTileSizes decode_tile{};  // sm80 decode kernel
  bool decode_small_smem = false;       // decode_tile is kDecodeTileSmallSmem
  int pack = 1;  // query heads packed into the rows of a block (GQA decode)
  int num_m_blocks = 0;
  int num_splits = 1;
  int n_blocks_per_split = 0;  // key blocks (decode kernel: warp key chunks)
  int kv_stages = 1;
  int m_tiles = 1;     // decode kernel: m16 tiles of rows per block
  int smem_bytes = 0;  // sm80 kernels' dynamic shared memory per block
  int64_t grid[3] = {0, 0, 0};  // sm80 kernels' grid (x, y, z)
};

struct BwdPlan {
  BwdKernel kernel = BwdKernel::kUnsupported;
  std::string reason;  // as FwdPlan::reason
  int bucket = 0;
  cuda::BwdTileRow row = cuda::BwdTileRow::kDefault;  // sm80 main kernel
  cuda::BwdTileSizes tile{};
  int smem_bytes = 0;
  int dq_splits = 1;  // deterministic backward: dQ slices
  int64_t grid[3] = {0, 0, 0};  // sm80 main kernel's grid (x, y, z)
};

namespace plan_detail {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::string CcString(const DeviceInfo& dev) {
  return std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor);
}

// Checks both directions share: dtype, compute capability, head dim, heads,
// 16-byte rows (cp.async and vector loads move 16-byte chunks).
inline std::string CommonUnsupported(const FlashParams& p, const DeviceInfo& dev) {
  if (p.dtype == DType::kFloat32) {
    return "float32 is not supported by the CUDA kernels; use bfloat16/float16";
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return "unknown dtype for the CUDA kernels; use bfloat16/float16";
  }
  if (dev.cc_major < 8) {
    return "compute capability " + CcString(dev) +
           " is not supported by the CUDA kernels (need 8.0+)";
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
  for (int64_t s : QkvoStrides(p)) {
    if (s % 8 != 0) {
      return "the CUDA kernels need every stride to be a multiple of 8 elements; got " +
             std::to_string(s);
    }
  }
  return "";
}

// The layout the Hopper kernels' tensor maps can encode (strides below 2^39
// elements, 16-byte aligned bases) and their 32-bit row indices; what
// Sm90CommonSupports checks beside the options.
inline bool Sm90LayoutServes(const FlashParams& p, bool backward) {
  for (int64_t s : QkvoStrides(p)) {
    if (s < 0 || s >= (int64_t{1} << 39)) return false;
  }
  if (!Aligned16({p.q, p.k, p.v, p.o})) return false;
  if (backward && !Aligned16({p.d_o, p.dq, p.dk, p.dv})) return false;
  return p.seqlen_q < (int64_t{1} << 31) - 256 && p.seqlen_k < (int64_t{1} << 31) - 256;
}

// Empty when the build, the device and p's options let a Hopper kernel serve
// the call, else why not.
inline std::string Sm90Unserved(const FlashParams& p, const DeviceInfo& dev,
                                const PlanOptions& opts, bool backward) {
  const char* direction = backward ? "the Hopper backward" : "the Hopper forward";
  if (dev.cc_major != 9) return "compute capability " + CcString(dev) + ": the Hopper kernels need 9.0";
  if (!opts.have_sm90) return "this build has no Hopper (sm_90a) kernels";
  if (backward && !opts.sm90_backward) return "JAX_FLASH2_SM90_BACKWARD=0";
  if (dev.max_smem_per_block_optin < kSm90SmemBytes) {
    return std::to_string(dev.max_smem_per_block_optin) +
           " bytes of shared memory per block: the Hopper kernels need " +
           std::to_string(kSm90SmemBytes);
  }
  if (const char* option = Sm90UnservedOption(p)) {
    return std::string(option) + ": " + direction + " does not serve it";
  }
  if (const char* option = backward ? Sm90BackwardUnservedOption(p) : nullptr) {
    return std::string(option) + ": " + direction + " does not serve it";
  }
  if (cuda::sm90::Sm90HeadDimBucket(p.head_dim) == 0) {
    return "head_dim D=" + std::to_string(p.head_dim) + ": no Hopper tile";
  }
  if (!Sm90LayoutServes(p, backward)) {
    return "a stride or base address the Hopper tensor maps cannot encode";
  }
  return "";
}

// Decode-shaped: few packed rows per K/V head (DecodeMaxRows).
inline bool IsDecodeShape(const FlashParams& p) {
  return p.seqlen_q * p.group_size <= cuda::DecodeMaxRows(cuda::DecodeTileFor(p.head_dim));
}

inline int DecodeSmem(const FlashParams& p, const cuda::DecodeTileSizes& tile) {
  return cuda::DecodeSmemBytes(tile, cuda::DecodeMTiles(tile, p.seqlen_q * p.group_size));
}

// The decode tile for p on dev: the bucket's row, else its small-smem one
// where that fits and holds p's rows (small_smem says which); {0, ...} when
// neither does. A KV-cache call tries the small-smem tile first: its 70 KB
// blocks sit three to an SM, so one block's start and merge overlap the
// others' streaming, which the many short splits of mixed lengths need (H200,
// T1 H32 K8 D128, lengths uniform in 1k-32k: B64 paged 57% -> 87% of the copy
// rate, B16 contiguous 51% -> 67%).
inline cuda::DecodeTileSizes ChooseDecodeTile(const FlashParams& p, const DeviceInfo& dev,
                                              bool* small_smem) {
  const int bucket = cuda::DecodeTileFor(p.head_dim).head_dim;
  const bool kv_cache = p.kv_seqlens != nullptr;
  for (bool small : {kv_cache, !kv_cache}) {
    const cuda::DecodeTileSizes t = cuda::DecodeTileOfRow(bucket, small);
    if (t.head_dim != 0 && p.seqlen_q * p.group_size <= cuda::DecodeMaxRows(t) &&
        static_cast<size_t>(DecodeSmem(p, t)) <= dev.max_smem_per_block_optin) {
      *small_smem = small;
      return t;
    }
  }
  return cuda::DecodeTileSizes{0, 0, 0, 0};
}

// Empty when the decode kernel serves a decode-shaped call, else why not.
inline std::string DecodeUnserved(const FlashParams& p, const DeviceInfo& dev,
                                  const PlanOptions& opts) {
  const char* option = p.softcap > 0.f                ? "softcap"
                       : p.alibi_slopes != nullptr   ? "alibi_slopes"
                       : p.q_segment_ids != nullptr  ? "segment_ids"
                       : p.dropout_seeds != nullptr  ? "dropout"
                                                     : nullptr;
  if (option != nullptr) return std::string(option) + ": the decode kernel does not serve it";
  bool small_smem = false;
  if (ChooseDecodeTile(p, dev, &small_smem).head_dim == 0) {
    const cuda::DecodeTileSizes tile = cuda::DecodeTileFor(p.head_dim);
    return "the decode kernel needs " + std::to_string(DecodeSmem(p, tile)) +
           " bytes of shared memory per block at D=" + std::to_string(tile.head_dim) +
           "; this GPU allows " + std::to_string(dev.max_smem_per_block_optin);
  }
  if (!opts.decode_kernel) return "JAX_FLASH2_DECODE_KERNEL=0";
  return "";
}

// The decode kernel's grid (splits, B, K) with `tile`: its blocks stream
// disjoint keys (memory bound), so the wave should fill the GPU closely (95%,
// not the prefill's 85%).
inline FwdPlan MakeDecodePlan(const FlashParams& p, const DeviceInfo& dev,
                              const PlanOptions& opts, const cuda::DecodeTileSizes& tile,
                              bool small_smem) {
  FwdPlan plan;
  plan.kernel = FwdKernel::kSm80Decode;
  plan.decode_tile = tile;
  plan.decode_small_smem = small_smem;
  plan.bucket = tile.head_dim;
  plan.pack = static_cast<int>(p.group_size);
  plan.num_m_blocks = 1;
  plan.m_tiles = cuda::DecodeMTiles(tile, p.seqlen_q * p.group_size);
  const int64_t chunks = CeilDiv(p.seqlen_k, tile.warp_keys);
  const int64_t block_steps = CeilDiv(chunks, cuda::kDecodeWarps);  // chunk rounds of the warps
  int splits = ChooseNumSplits(p.batch * p.num_heads_kv, block_steps,
                               dev.sm_count * tile.blocks_per_sm, kMaxSplits, 0.95);
  if (p.kv_seqlens != nullptr) {
    // A KV cache's lengths are known only on the device, and a split count
    // chosen for S_max left the SMs of short sequences idle while a long
    // one's few blocks streamed it (H200, B16 at 1k-32k: 33% of the copy
    // rate; one 32k among 1k: 6%). Splits of at most kKvCacheSplitKeys keys
    // spread each sequence over the GPU, and small batches get at least
    // kKvCacheBlocksPerSm blocks per SM over S_max (B1, 15.8k of 32k keys:
    // 16 splits 76 us, 32 splits 47 us); splits past a sequence's end exit
    // at once. JAX_FLASH2_KV_SPLIT_KEYS sets the split size alone.
    const int64_t heads = p.batch * p.num_heads_kv;
    const int64_t want =
        opts.kv_split_keys > 0
            ? CeilDiv(p.seqlen_k, opts.kv_split_keys)
            : std::max(CeilDiv(p.seqlen_k, kKvCacheSplitKeys),
                       CeilDiv(int64_t{dev.sm_count} * kKvCacheBlocksPerSm, heads));
    splits = static_cast<int>(std::max<int64_t>(splits, std::min<int64_t>(want, kMaxSplits)));
  }
  if (splits > 1) {
    plan.n_blocks_per_split = static_cast<int>(CeilDiv(block_steps, splits) * cuda::kDecodeWarps);
    plan.num_splits = static_cast<int>(CeilDiv(chunks, plan.n_blocks_per_split));
  }
  plan.kv_stages = tile.stages;
  plan.smem_bytes = cuda::DecodeSmemBytes(tile, plan.m_tiles);
  plan.grid[0] = plan.num_splits;
  plan.grid[1] = p.batch;
  plan.grid[2] = p.num_heads_kv;
  return plan;
}

// The prefill kernel's grid (m-blocks x splits, B, H / pack).
inline FwdPlan MakePrefillPlan(const FlashParams& p, const DeviceInfo& dev) {
  FwdPlan plan;
  plan.kernel = FwdKernel::kSm80Prefill;
  plan.tile = cuda::FwdTileFor(p.head_dim);
  plan.bucket = plan.tile.head_dim;
  // Pack a GQA group into the M dimension when the queries alone would leave
  // most of a block empty (decode): each K/V head is then streamed once for
  // its whole group instead of once per query head.
  if (p.group_size > 1 && p.seqlen_q < plan.tile.block_m) plan.pack = static_cast<int>(p.group_size);
  plan.num_m_blocks = static_cast<int>(CeilDiv(p.seqlen_q * plan.pack, plan.tile.block_m));
  const int64_t num_n_blocks = CeilDiv(p.seqlen_k, plan.tile.block_n);
  const int64_t blocks = p.batch * (p.num_heads_q / plan.pack) * plan.num_m_blocks;
  const int splits =
      ChooseNumSplits(blocks, num_n_blocks, dev.sm_count * kFwdBlocksPerSm, kMaxSplits);
  if (splits > 1) {
    // Even shares of whole key blocks; recount so that no split is empty by
    // construction (a split can still be empty under a mask).
    plan.n_blocks_per_split = static_cast<int>(CeilDiv(num_n_blocks, splits));
    plan.num_splits = static_cast<int>(CeilDiv(num_n_blocks, plan.n_blocks_per_split));
  }
  // Small (split or packed) grids are bound by copy latency, not by the tensor
  // cores: give them a second K/V stage when it fits.
  if ((plan.num_splits > 1 || plan.pack > 1) &&
      static_cast<size_t>(cuda::FwdSmemBytes(plan.tile, 2)) <= dev.max_smem_per_block_optin) {
    plan.kv_stages = 2;
  }
  plan.smem_bytes = cuda::FwdSmemBytes(plan.tile, plan.kv_stages);
  plan.grid[0] = int64_t{plan.num_m_blocks} * plan.num_splits;
  plan.grid[1] = p.batch;
  plan.grid[2] = p.num_heads_q / plan.pack;
  return plan;
}

// Empty when the Hopper forward serves p (with the prefill plan the sm80
// kernels would run), else why not: split-KV and GQA-packed grids stay on the
// sm80 kernels, which implement them.
inline std::string Sm90ForwardUnserved(const FlashParams& p, const DeviceInfo& dev,
                                       const PlanOptions& opts, const FwdPlan& prefill) {
  std::string why = Sm90Unserved(p, dev, opts, false);
  if (!why.empty()) return why;
  if (prefill.num_splits > 1) {
    return "split-KV (" + std::to_string(prefill.num_splits) +
           " splits for a small grid): the Hopper forward does not split keys";
  }
  if (prefill.pack > 1) return "GQA-packed rows: the Hopper forward does not pack heads";
  return "";
}

// Empty when the decode kernel serves a KV-cache call (per-sequence lengths,
// maybe a block table), else why not. Only the decode kernel reads those
// operands, on every GPU: the prefill and Hopper kernels never see them.
inline std::string KvCacheUnserved(const FlashParams& p, const DeviceInfo& dev) {
  const int64_t rows = p.seqlen_q * p.group_size;
  const int64_t max_rows = cuda::DecodeMaxRows(cuda::DecodeTileFor(p.head_dim));
  if (rows > max_rows) {
    return "KV cache: T * H / K = " + std::to_string(rows) +
           " packed rows exceed the decode kernel's " + std::to_string(max_rows) + " at D=" +
           std::to_string(p.head_dim) + " (the one CUDA kernel that reads per-sequence lengths "
           "and block tables); split the T new queries into chunks of at most " +
           std::to_string(max_rows / p.group_size > 0 ? max_rows / p.group_size : 1);
  }
  if (p.softcap > 0.f || p.alibi_slopes != nullptr || p.q_segment_ids != nullptr ||
      p.dropout_seeds != nullptr) {
    return std::string("KV cache: ") +
           (p.softcap > 0.f ? "softcap" : p.alibi_slopes ? "alibi_slopes" : "segment ids/dropout") +
           " is not served by the decode kernel (the one CUDA kernel that reads per-sequence "
           "lengths and block tables)";
  }
  bool small_smem = false;
  if (ChooseDecodeTile(p, dev, &small_smem).head_dim == 0) {
    return "KV cache: the decode kernel's tile does not fit this GPU's shared memory (" +
           std::to_string(dev.max_smem_per_block_optin) + " bytes) at D=" +
           std::to_string(p.head_dim);
  }
  if (p.kv_quant != KvQuant::kNone) {
    if (!GetTestSwitches().decode_quant) {
      return "KV cache: int8 / float8_e4m3fn caches are dequantized by XLA for the CUDA kernels "
             "(JAX_FLASH2_DECODE_QUANT=0)";
    }
    if (p.head_dim % 16 != 0) {
      return "KV cache: an int8 / float8_e4m3fn cache needs head_dim D % 16 == 0 in the decode "
             "kernel (its 16-byte copies); got D=" + std::to_string(p.head_dim);
    }
  }
  return "";
}

}  // namespace plan_detail

// The one support check of a forward call: empty when the CUDA kernels serve
// p on dev, else the reason (returned to the caller as InvalidArgument).
inline std::string ForwardUnsupported(const FlashParams& p, const DeviceInfo& dev) {
  std::string why = plan_detail::CommonUnsupported(p, dev);
  if (!why.empty()) return why;
  if (p.batch > 65535 || p.num_heads_q > 65535 || p.seqlen_q >= (int64_t{1} << 31) / 128 ||
      p.seqlen_k >= (int64_t{1} << 31) - 256) {
    return "shape too large for the CUDA kernels' grid: B=" + std::to_string(p.batch) +
           " (max 65535), H=" + std::to_string(p.num_heads_q) + " (max 65535), T=" +
           std::to_string(p.seqlen_q) + ", S=" + std::to_string(p.seqlen_k);
  }
  if (p.kv_seqlens != nullptr) return plan_detail::KvCacheUnserved(p, dev);
  if (p.kv_quant != KvQuant::kNone) return "an int8 / float8_e4m3fn k, v must be a KV cache";
  const int smem = cuda::FwdSmemBytes(cuda::FwdTileFor(p.head_dim), 1);
  if (static_cast<size_t>(smem) > dev.max_smem_per_block_optin) {
    return "head_dim D=" + std::to_string(p.head_dim) + " needs " + std::to_string(smem) +
           " bytes of shared memory per block in the forward; this GPU allows " +
           std::to_string(dev.max_smem_per_block_optin);
  }
  return "";
}

// The forward's plan: the decode kernel for decode shapes it serves, else the
// Hopper kernel where it serves the call, else the sm80 prefill kernel.
inline FwdPlan MakeForwardPlan(const FlashParams& p, const DeviceInfo& dev,
                               const PlanOptions& opts) {
  FwdPlan plan;
  if (std::string why = ForwardUnsupported(p, dev); !why.empty()) {
    plan.reason = why;
    return plan;
  }
  if (p.kv_seqlens != nullptr) {  // served by the decode kernel only (KvCacheUnserved)
    bool small_smem = false;
    const cuda::DecodeTileSizes tile = plan_detail::ChooseDecodeTile(p, dev, &small_smem);
    plan = plan_detail::MakeDecodePlan(p, dev, opts, tile, small_smem);
    plan.reason = "KV cache: the decode kernel is the one that reads per-sequence lengths and "
                  "block tables";
    return plan;
  }
  std::string not_decode;
  const bool decode_shape = plan_detail::IsDecodeShape(p);
  if (decode_shape) {
    not_decode = plan_detail::DecodeUnserved(p, dev, opts);
    if (not_decode.empty()) {
      bool small_smem = false;
      const cuda::DecodeTileSizes tile = plan_detail::ChooseDecodeTile(p, dev, &small_smem);
      return plan_detail::MakeDecodePlan(p, dev, opts, tile, small_smem);
    }
  }
  plan = plan_detail::MakePrefillPlan(p, dev);
  const std::string not_sm90 = plan_detail::Sm90ForwardUnserved(p, dev, opts, plan);
  if (not_sm90.empty()) {
    FwdPlan sm90;
    sm90.kernel = FwdKernel::kSm90;
    sm90.bucket = static_cast<int>(cuda::sm90::Sm90HeadDimBucket(p.head_dim));
    sm90.reason = decode_shape ? not_decode : "";
    return sm90;
  }
  plan.reason = decode_shape ? not_decode + "; " + not_sm90 : not_sm90;
  return plan;
}

// Workspace of the sm80 split-KV partials: LSEs first (padded to 256 bytes),
// then O, both fp32.
inline size_t SplitPartialLseBytes(const FlashParams& p, const FwdPlan& plan) {
  const size_t n = static_cast<size_t>(plan.num_splits) * p.batch * p.num_heads_q * p.seqlen_q;
  return (n * sizeof(float) + 255) / 256 * 256;
}

inline size_t SplitScratchBytes(const FlashParams& p, const FwdPlan& plan) {
  if (plan.num_splits <= 1 || plan.kernel == FwdKernel::kSm90) return 0;
  const size_t n = static_cast<size_t>(plan.num_splits) * p.batch * p.num_heads_q * p.seqlen_q;
  return SplitPartialLseBytes(p, plan) + n * p.head_dim * sizeof(float);
}

// The sm80 backward's main-kernel tile of p.head_dim's bucket on a device with
// max_smem bytes per block: the large-smem row where the bucket has one and it
// fits (sm90), else the default row (sm80's 163 KB), else the small-smem row
// (cc 8.6 / 8.9: 99 KB). tile.head_dim == 0 when none fits.
struct Sm80BwdTile {
  cuda::BwdTileRow row = cuda::BwdTileRow::kDefault;
  cuda::BwdTileSizes tile{};
};

inline Sm80BwdTile ChooseSm80BwdTile(int64_t head_dim, size_t max_smem) {
  const int bucket = cuda::BwdTileFor(head_dim).head_dim;
  for (cuda::BwdTileRow row : {cuda::BwdTileRow::kLargeSmem, cuda::BwdTileRow::kDefault,
                               cuda::BwdTileRow::kSmallSmem}) {
    const cuda::BwdTileSizes t = cuda::BwdTileOfRow(bucket, row);
    if (t.head_dim != 0 && static_cast<size_t>(cuda::BwdSmemBytes(t)) <= max_smem) {
      return {row, t};
    }
  }
  return {};
}

// The one support check of a backward call (as ForwardUnsupported).
inline std::string BackwardUnsupported(const FlashParams& p, const DeviceInfo& dev) {
  std::string why = plan_detail::CommonUnsupported(p, dev);
  if (!why.empty()) return why;
  if (!Aligned16({p.q, p.k, p.v, p.o, p.d_o, p.dq, p.dk, p.dv})) {
    return "the CUDA backward needs 16-byte aligned q, k, v, out, d_out, dq, dk, dv";
  }
  if (p.batch > 65535 || p.num_heads_kv > 65535) {
    return "shape too large for the CUDA backward's grid: B=" + std::to_string(p.batch) +
           " (max 65535), K=" + std::to_string(p.num_heads_kv) + " (max 65535)";
  }
  if (ChooseSm80BwdTile(p.head_dim, dev.max_smem_per_block_optin).tile.head_dim == 0) {
    const int bucket = cuda::BwdTileFor(p.head_dim).head_dim;
    cuda::BwdTileSizes smallest = cuda::BwdTileOfRow(bucket, cuda::BwdTileRow::kSmallSmem);
    if (smallest.head_dim == 0) smallest = cuda::BwdTileFor(p.head_dim);
    return "head_dim D=" + std::to_string(p.head_dim) + " needs " +
           std::to_string(cuda::BwdSmemBytes(smallest)) +
           " bytes of shared memory per block in the backward; this GPU allows " +
           std::to_string(dev.max_smem_per_block_optin);
  }
  return "";
}

// The backward's plan: the Hopper main kernel where it serves the call, else
// the sm80 one with the tile of ChooseSm80BwdTile. (Both share the preprocess
// and convert kernels and the workspace layout, cuda/sm80/bwd_traits.h.)
inline BwdPlan MakeBackwardPlan(const FlashParams& p, const DeviceInfo& dev,
                                const PlanOptions& opts) {
  BwdPlan plan;
  if (std::string why = BackwardUnsupported(p, dev); !why.empty()) {
    plan.reason = why;
    return plan;
  }
  const std::string not_sm90 = plan_detail::Sm90Unserved(p, dev, opts, true);
  if (not_sm90.empty()) {
    // Deterministic calls too: one dQ accumulator, summed in a fixed order
    // (cuda/sm90/bwd_sm90.h, Sm90BackwardDqTurns).
    plan.kernel = BwdKernel::kSm90;
    plan.bucket = static_cast<int>(cuda::sm90::Sm90HeadDimBucket(p.head_dim));
    return plan;
  }
  // The dQ slices are counted with the default row's block_n on every device
  // so that the workspace the lowering sizes (for any GPU of a compute
  // capability) is never short; a smaller block_n only has more key blocks.
  plan.dq_splits = cuda::BwdDqSplits(p.deterministic, p.batch, p.seqlen_q, p.seqlen_k,
                                     p.num_heads_q, p.num_heads_kv, p.head_dim, dev.sm_count);
  plan.kernel = BwdKernel::kSm80;
  plan.reason = not_sm90;
  const Sm80BwdTile choice = ChooseSm80BwdTile(p.head_dim, dev.max_smem_per_block_optin);
  plan.row = choice.row;
  plan.tile = choice.tile;
  plan.bucket = choice.tile.head_dim;
  plan.smem_bytes = cuda::BwdSmemBytes(choice.tile);
  const int64_t block_n = 16 * choice.tile.warps_n;
  const int64_t n_blocks = plan_detail::CeilDiv(p.seqlen_k, block_n);
  plan.grid[0] = p.deterministic ? std::min<int64_t>(plan.dq_splits, n_blocks) : n_blocks;
  plan.grid[1] = p.batch;
  plan.grid[2] = p.num_heads_kv;
  return plan;
}

}  // namespace jax_flash2
