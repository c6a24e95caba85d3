// The Hopper forward's variants for its self-test: every consumer schedule and
// both grid forms of the package's tiles, plus tiles the package does not
// build (rejected variants kept for comparison), through the package's own
// host side (PrepareForwardSm90). Included by sm90_fwd_selftest.cu only.
// The kernels are instantiated in the self-test's own object: an A/B build
// of a kernel change compiles the self-test from the changed sources too
// (linked beside an unchanged self-test object, a changed
// fwd_sm90_launch.o is not what its timings run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "src/cuda/sm90/fwd_sm90.h"
#include "src/cuda/sm90/fwd_sm90_kernel.cuh"

namespace jax_flash2::selftest {

using cuda::sm90::FwdSm90Choice;
using cuda::sm90::FwdSm90Launch;
using cuda::sm90::FwdSm90Tile;
using cuda::sm90::Sm90Schedule;

// D 256 with 64-key blocks (fewer registers, more blocks).
struct D256Keys64Tile {
  static constexpr FwdSm90Tile kTile{
      256, 128, 64, 2, false, false, 0, cuda::sm90::kAnyKeys, Sm90Schedule::kPingpong, 0, 0};
};

// --tile N: rows 0 .. kFwdSm90NumTiles - 1 are the package's table, then the one above.
inline constexpr int kNumSelftestTiles = cuda::sm90::kFwdSm90NumTiles + 1;

inline FwdSm90Tile SelftestTile(int index) {
  if (index < cuda::sm90::kFwdSm90NumTiles) return cuda::sm90::kFwdSm90TileTable[index];
  return D256Keys64Tile::kTile;
}

template <typename Elem, class TileRow, Sm90Schedule kSchedule>
cudaError_t LaunchVariantGrid(const FwdSm90Launch& launch, cudaStream_t stream) {
  if (launch.grid_blocks == launch.args.num_tiles) {
    return cuda::sm90::LaunchFwdSm90<Elem, TileRow, kSchedule, false>(launch, stream);
  }
  return cuda::sm90::LaunchFwdSm90<Elem, TileRow, kSchedule, true>(launch, stream);
}

template <typename Elem, class TileRow>
cudaError_t LaunchVariant(const FwdSm90Launch& launch, Sm90Schedule schedule,
                          cudaStream_t stream) {
  switch (schedule) {
    case Sm90Schedule::kSerial:
      return LaunchVariantGrid<Elem, TileRow, Sm90Schedule::kSerial>(launch, stream);
    case Sm90Schedule::kOverlap:
      return LaunchVariantGrid<Elem, TileRow, Sm90Schedule::kOverlap>(launch, stream);
    case Sm90Schedule::kPingpong:
      return LaunchVariantGrid<Elem, TileRow, Sm90Schedule::kPingpong>(launch, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename Elem>
cudaError_t LaunchVariantTile(const FwdSm90Launch& launch, int tile, Sm90Schedule schedule,
                              cudaStream_t stream) {
  using cuda::sm90::FwdSm90TableTile;
  switch (tile) {
    case 0: return LaunchVariant<Elem, FwdSm90TableTile<0>>(launch, schedule, stream);
    case 1: return LaunchVariant<Elem, FwdSm90TableTile<1>>(launch, schedule, stream);
    case 2: return LaunchVariant<Elem, FwdSm90TableTile<2>>(launch, schedule, stream);
    case 3: return LaunchVariant<Elem, FwdSm90TableTile<3>>(launch, schedule, stream);
    case 4: return LaunchVariant<Elem, FwdSm90TableTile<4>>(launch, schedule, stream);
    case 5: return LaunchVariant<Elem, FwdSm90TableTile<5>>(launch, schedule, stream);
    case 6: return LaunchVariant<Elem, D256Keys64Tile>(launch, schedule, stream);
    default: return cudaErrorInvalidValue;
  }
}
static_assert(kNumSelftestTiles == 7, "LaunchVariantTile dispatches every tile");

// tile < 0: the package's row for p.
inline size_t VariantScratchBytes(const FlashParams& p, const cuda::DeviceInfo& dev, int tile,
                                  FwdSm90Choice choice) {
  if (tile < 0) tile = cuda::sm90::FwdSm90PackageTileIndex(p);
  if (tile < 0) return 0;
  return cuda::sm90::Sm90ForwardScratchBytesFor(p, dev, SelftestTile(tile), choice);
}

inline cudaError_t RunForwardSm90Variant(const FlashParams& p, void* scratch,
                                         const cuda::DeviceInfo& dev, cudaStream_t stream,
                                         Sm90Schedule schedule, int tile,
                                         FwdSm90Choice choice) {
  if (tile < 0) tile = cuda::sm90::FwdSm90PackageTileIndex(p);
  if (tile < 0 || tile >= kNumSelftestTiles) return cudaErrorInvalidValue;
  FwdSm90Launch launch;
  const cudaError_t err = cuda::sm90::PrepareForwardSm90(p, scratch, dev, stream,
                                                         SelftestTile(tile), choice, &launch);
  if (err != cudaSuccess || launch.grid_blocks == 0) return err;
  switch (p.dtype) {
    case DType::kFloat16: return LaunchVariantTile<__half>(launch, tile, schedule, stream);
    case DType::kBFloat16:
      return LaunchVariantTile<__nv_bfloat16>(launch, tile, schedule, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash2::selftest
