// Python module _cpu_ext: the CPU FFI handlers as capsules for
// jax.ffi.register_ffi_target, the CUDA kernels' plan (src/plan.h, for
// jax_flash2.plan and its unit tests, with no GPU), plus the host heuristics
// and the scalar dropout mask (the CUDA kernels' path; the CPU kernels
// vectorize it) for unit tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "../flash_dropout.h"
#include "../heuristics.h"
#include "../plan.h"
#include "ffi_cpu.h"
#include "flash_cpu.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// The plan of a call described by its shapes and options (dense [B, T, H, D]
// layout, 16-byte aligned buffers) on a described GPU, as a dict.
nb::dict Plan(bool backward, int dtype, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
              int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t window_left,
              int64_t window_right, float softcap, bool has_alibi, bool has_segment_ids,
              float dropout_rate, bool deterministic, int cc_major, int cc_minor, int sm_count,
              int64_t max_smem_per_block, bool have_sm90, bool has_kv_seqlens,
              int64_t page_size, int kv_quant) {
  using namespace jax_flash2;
  // Stands in for every buffer: the plan reads only whether an option's
  // operand is there and whether addresses are 16-byte aligned.
  alignas(16) static unsigned char buffer[16];
  FlashParams p;
  p.dtype = static_cast<DType>(dtype);
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.num_heads_q = heads_q;
  p.num_heads_kv = heads_kv;
  p.group_size = heads_kv > 0 ? heads_q / heads_kv : 0;
  p.head_dim = head_dim;
  SetDenseStrides(p);
  p.q = p.k = p.v = p.d_o = buffer;
  p.o = p.dq = p.dk = p.dv = buffer;
  p.lse = reinterpret_cast<float*>(buffer);
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  if (has_alibi) p.alibi_slopes = reinterpret_cast<const float*>(buffer);
  if (has_segment_ids) {
    p.q_segment_ids = p.kv_segment_ids = reinterpret_cast<const int32_t*>(buffer);
  }
  if (dropout_rate > 0.f) {
    p.dropout_seeds = reinterpret_cast<const uint32_t*>(buffer);
    p.dropout_rate = dropout_rate;
  }
  p.deterministic = deterministic;
  if (has_kv_seqlens) p.kv_seqlens = reinterpret_cast<const int32_t*>(buffer);
  p.kv_quant = static_cast<KvQuant>(kv_quant);
  if (p.kv_quant != KvQuant::kNone) p.kv_scales = reinterpret_cast<const float*>(buffer);
  if (page_size > 0) {  // seqlen_k is the block table's max_pages * page_size
    p.block_table = reinterpret_cast<const int32_t*>(buffer);
    p.page_size = page_size;
    p.max_pages = (seqlen_k + page_size - 1) / page_size;
    p.num_pages = p.max_pages;
  }
  DeviceInfo dev;
  dev.sm_count = sm_count;
  dev.cc_major = cc_major;
  dev.cc_minor = cc_minor;
  // As on a GPU (cuda/device_info.cu), the test switch caps the shared memory.
  const TestSwitches& switches = GetTestSwitches();
  if (switches.max_smem_per_block > 0 && switches.max_smem_per_block < max_smem_per_block) {
    max_smem_per_block = switches.max_smem_per_block;
  }
  dev.max_smem_per_block_optin = static_cast<size_t>(max_smem_per_block);
  const PlanOptions opts = PlanOptionsFrom(have_sm90, switches);
  nb::dict d;
  nb::dict tile;
  auto grid = [](const int64_t (&g)[3]) { return nb::make_tuple(g[0], g[1], g[2]); };
  if (backward) {
    const BwdPlan plan = MakeBackwardPlan(p, dev, opts);
    d["kernel"] = KernelName(plan.kernel);
    d["reason"] = nb::str(plan.reason.c_str());
    d["bucket"] = plan.bucket;
    tile["block_m"] = plan.tile.block_m;
    tile["block_n"] = 16 * plan.tile.warps_n;
    tile["warps_n"] = plan.tile.warps_n;
    tile["warps_d"] = plan.tile.warps_d;
    tile["do_stages"] = plan.tile.do_stages;
    tile["row"] = plan.row == cuda::BwdTileRow::kLargeSmem   ? "large_smem"
                  : plan.row == cuda::BwdTileRow::kSmallSmem ? "small_smem"
                                                             : "default";
    d["grid"] = grid(plan.grid);
    d["splits"] = plan.dq_splits;
    d["smem_bytes"] = plan.smem_bytes;
  } else {
    const FwdPlan plan = MakeForwardPlan(p, dev, opts);
    d["kernel"] = KernelName(plan.kernel);
    d["reason"] = nb::str(plan.reason.c_str());
    d["bucket"] = plan.bucket;
    if (plan.kernel == FwdKernel::kSm80Decode) {
      tile["warp_keys"] = plan.decode_tile.warp_keys;
      tile["row"] = plan.decode_small_smem ? "small_smem" : "default";
      tile["warps"] = cuda::kDecodeWarps;
      tile["rows"] = 16 * plan.m_tiles;
    } else {
      tile["block_m"] = plan.tile.block_m;
      tile["block_n"] = plan.tile.block_n;
      tile["warps"] = plan.tile.warps;
    }
    tile["pack"] = plan.pack;
    tile["kv_stages"] = plan.kv_stages;
    d["grid"] = grid(plan.grid);
    d["splits"] = plan.num_splits;
    d["smem_bytes"] = plan.smem_bytes;
  }
  d["tile"] = tile;
  return d;
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["jax_flash2_attention_fwd"] = Capsule(jax_flash2::cpu::JaxFlash2CpuForward);
    targets["jax_flash2_attention_bwd"] = Capsule(jax_flash2::cpu::JaxFlash2CpuBackward);
    return targets;
  });
  m.def("isa", [] { return jax_flash2::cpu::SelectedIsa(); },
        "Instruction set the CPU kernels were selected for on this machine.");
  m.def("plan", &Plan, nb::arg("backward"), nb::arg("dtype"), nb::arg("batch"),
        nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("heads_q"), nb::arg("heads_kv"),
        nb::arg("head_dim"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("has_alibi"), nb::arg("has_segment_ids"), nb::arg("dropout_rate"),
        nb::arg("deterministic"), nb::arg("cc_major"), nb::arg("cc_minor"), nb::arg("sm_count"),
        nb::arg("max_smem_per_block"), nb::arg("have_sm90"),
        nb::arg("has_kv_seqlens") = false, nb::arg("page_size") = 0, nb::arg("kv_quant") = 0,
        "The CUDA kernels' plan of a call (src/plan.h), for jax_flash2.plan.");
  m.def("choose_num_splits", &jax_flash2::ChooseNumSplits, nb::arg("batch_heads_mblocks"),
        nb::arg("num_n_blocks"), nb::arg("block_slots"), nb::arg("max_splits"),
        nb::arg("min_efficiency") = 0.85,
        "The CUDA forward's split-KV count (src/heuristics.h), for unit tests.");
  m.def("philox4x32",
        [](uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
          const jax_flash2::Philox4 r = jax_flash2::Philox4x32(c0, c1, c2, c3, k0, k1);
          return std::tuple(r.x[0], r.x[1], r.x[2], r.x[3]);
        },
        "Philox4x32-10 of src/flash_dropout.h, for unit tests.");
  m.def("dropout_keep16",
        [](uint32_t seed_lo, uint32_t seed_hi, float rate, int64_t i, int64_t j16) {
          const jax_flash2::DropoutMask mask{seed_lo, seed_hi, jax_flash2::DropoutThreshold(rate)};
          return mask.Keep16(i, j16);
        },
        "Keep bits of keys 16 j16 .. 16 j16 + 15 of query row i (src/flash_dropout.h), for unit "
        "tests.");
  m.def("dropout_keep_bytes", &jax_flash2::KeepBytes, nb::arg("word"), nb::arg("threshold4"),
        "flash_dropout.h's bytewise word >= threshold4 (bit 8 b + 7), for unit tests.");
}
