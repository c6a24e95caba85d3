// Hopper (sm_90a) forward: host interface, tile table and the kernel's
// argument block. Built as its own library for sm_90a only (CMakeLists.txt);
// RunForward (fwd_launch.cu) calls it on cc 9.0 devices when
// Sm90ForwardSupports(p) holds and the call needs neither split-KV nor GQA
// packing, and runs the sm80 kernels otherwise.
#pragma once

#include <cuda.h>  // CUtensorMap (type only)
#include <cuda_runtime.h>

#include "../../flash_params.h"
#include "../flash_cuda.h"

namespace jax_flash2::cuda {

// True when the Hopper forward can serve p: bf16/fp16, D in {64, 128}, no
// softcap, ALiBi or segment ids, every stride a multiple of 8 elements and
// every pointer 16-byte aligned (TMA), sizes within the grid and tensor-map
// limits. Split-KV and GQA packing for decode are not implemented here: such
// calls still run (one block per 128 query rows), but the dispatcher sends
// them to the decode kernel or the sm80 split-KV path, which serve them better.
bool Sm90ForwardSupports(const FlashParams& p);

// Runs the forward on the current device (must be cc 9.0). Returns
// cudaErrorInvalidValue when !Sm90ForwardSupports(p), and the driver's error
// (as cudaErrorInvalidValue) when a tensor map cannot be encoded.
cudaError_t RunForwardSm90(const FlashParams& p, const DeviceInfo& dev, cudaStream_t stream);

namespace sm90 {
// Consumer schedules (a kernel template argument; see fwd_sm90_kernel.cuh).
// All three passed the self-test on the H200; the package builds and runs
// kOverlap only (the others exist with JF2_SM90_ALL_SCHEDULES, which the
// self-test sets, for timing and for localising a failure).
//   kSerial:   S -> softmax -> PV per key block. The simplest.
//   kOverlap:  S_{n-1} = Q K_{n-1}^T and O += P_n V_n issued back to back; the
//              softmax of block n-1 runs while the PV product executes
//              (FlashAttention-3's intra-warpgroup overlap). Fastest at most
//              shapes measured (619 vs 596 serial and 613 pingpong TFLOP/s at
//              B4 T=S=4096 H16 D128).
//   kPingpong: kOverlap, plus the two consumer warpgroups take turns issuing
//              their wgmmas (named barriers), so one's softmax runs while the
//              other's products occupy the tensor cores (+3% at D64 causal
//              T=16k, -1 to -3% elsewhere).
enum class Sm90Schedule : int { kSerial = 0, kOverlap = 1, kPingpong = 2 };

// RunForwardSm90 with an explicit consumer schedule (for the self-test).
cudaError_t RunForwardSm90Schedule(const FlashParams& p, const DeviceInfo& dev,
                                   cudaStream_t stream, Sm90Schedule schedule);
}  // namespace sm90

namespace sm90 {

// One row per head dim. kBlockM = 128 query rows = two consumer warpgroups of
// 64 rows; kBlockN keys per pipeline stage. Shared memory: Q (block_m x D)
// plus `stages` x (K + V) (block_n x D each), 2-byte elements:
//   D = 64:  16 KB + 3 x 32 KB = 112 KB
//   D = 128: 32 KB + 2 x 64 KB = 160 KB   (a third stage would need 224 KB,
//            right at the 227 KB opt-in limit; FA3 also uses 2 at d128)
// Registers per consumer thread: S (block_n / 2 fp32) + O (D / 2 fp32) + P
// (block_n / 4 b32) = 64 + 64 + 32 at D = 128.
struct FwdSm90Tile {
  int head_dim;
  int block_m;
  int block_n;
  int stages;
};

inline constexpr FwdSm90Tile kFwdSm90TileTable[] = {
    {64, 128, 128, 3},
    {128, 128, 128, 2},
};

constexpr FwdSm90Tile FwdSm90TileFor(int64_t head_dim) {
  for (const FwdSm90Tile& t : kFwdSm90TileTable) {
    if (head_dim == t.head_dim) return t;
  }
  return FwdSm90Tile{0, 0, 0, 0};
}

// Warp roles: warpgroup 0 produces (one thread issues every TMA copy),
// warpgroups 1 and 2 consume (wgmma + softmax), 64 query rows each.
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kFwdSm90Threads = 128 * (1 + kConsumerWarpgroups);
// setmaxnreg budget: 128 x 40 + 256 x 232 = 64512 <= 65536 registers.
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;

// Bytes of dynamic shared memory: the tiles, the mbarriers, and 1 KB of
// slack to align the tiles to the 1024-byte swizzle atom.
constexpr int FwdSm90SmemBytes(const FwdSm90Tile& t) {
  const int tiles = (t.block_m + 2 * t.stages * t.block_n) * t.head_dim * 2;
  const int barriers = (2 + 4 * t.stages) * 8;  // q full/empty; k/v full and empty per stage
  return tiles + barriers + 1024;
}

// The kernel's by-value argument block (__grid_constant__), so the tensor maps
// sit in parameter space where the TMA unit may read them. Each map is 4-D
// over (D, rows, heads, B) or (D, heads, rows, B), whichever keeps strides
// increasing (the tensor-map encoding expects that); `*_heads_inner` says
// which, and only swaps the two middle coordinates (the box is 1 along the
// head dim, so the shared-memory image is the same either way).
struct FwdSm90Args {
  CUtensorMap tma_q;
  CUtensorMap tma_k;
  CUtensorMap tma_v;
  FlashParams p;
  int num_m_blocks = 0;
  int num_tiles = 0;  // num_m_blocks * H * B; the grid has one block per tile, or fewer
  bool q_heads_inner = true;
  bool k_heads_inner = true;
  bool v_heads_inner = true;
};

}  // namespace sm90
}  // namespace jax_flash2::cuda
