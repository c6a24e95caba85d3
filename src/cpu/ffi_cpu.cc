// XLA FFI handlers for the CPU platform: typed implementations, then the
// bindings that read like their signatures.
#include "ffi_cpu.h"

#include "../ffi_params.h"
#include "flash_cpu.h"

namespace jax_flash2::cpu {
namespace {

// Tasks go to XLA's intra-op pool; the calling thread works as well.
SharedLoopRunner MakeRunner(ffi::ThreadPool& pool) {
  const int64_t threads = pool.num_threads();
  return SharedLoopRunner([&pool](std::function<void()> task) { pool.Schedule(std::move(task)); },
                          static_cast<int>(threads > 0 ? threads : 1));
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer dropout_seeds,
                       ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer block_table,
                       ffi::AnyBuffer kv_scales,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, int64_t window_left,
                       int64_t window_right, float softcap, bool has_alibi, bool has_segment_ids,
                       float dropout_rate, bool has_kv_seqlens, int64_t page_size) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(ForwardParams(
      q, k, v, {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, kv_seqlens,
                block_table, kv_scales}, *out, *lse,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate, has_kv_seqlens, page_size}, &p));
  SharedLoopRunner runner = MakeRunner(pool);
  ForwardCpu(p, runner);
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer d_out,
                        ffi::AnyBuffer d_lse, ffi::AnyBuffer alibi_slopes,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer kv_seqlens,
                        ffi::AnyBuffer block_table,
                        ffi::AnyBuffer kv_scales, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, int64_t window_left,
                        int64_t window_right, float softcap, bool has_alibi,
                        bool has_segment_ids, float dropout_rate, bool has_kv_seqlens,
                        int64_t page_size) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(BackwardParams(
      q, k, v, out, lse, d_out, d_lse,
      {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, kv_seqlens, block_table,
       kv_scales},
      *dq, *dk, *dv,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate, has_kv_seqlens, page_size},
      &p));
  SharedLoopRunner runner = MakeRunner(pool);
  BackwardCpu(p, runner);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlash2CpuForward, ForwardImpl,
                              ScoreAttrs(ForwardOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlash2CpuBackward, BackwardImpl,
                              ScoreAttrs(BackwardOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

}  // namespace jax_flash2::cpu
