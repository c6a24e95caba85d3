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
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, int64_t window_left,
                       int64_t window_right, float softcap, bool has_alibi, bool has_segment_ids,
                       float dropout_rate) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(ForwardParams(
      q, k, v, {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds}, *out, *lse,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate}, &p));
  SharedLoopRunner runner = MakeRunner(pool);
  ForwardCpu(p, runner);
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer d_out,
                        ffi::AnyBuffer d_lse, ffi::AnyBuffer alibi_slopes,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer dropout_seeds, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, int64_t window_left,
                        int64_t window_right, float softcap, bool has_alibi,
                        bool has_segment_ids, float dropout_rate) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(BackwardParams(
      q, k, v, out, lse, d_out, d_lse,
      {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds}, *dq, *dk, *dv,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate},
      &p));
  SharedLoopRunner runner = MakeRunner(pool);
  BackwardCpu(p, runner);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlash2CpuForward, ForwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::AnyBuffer>()  // q: [B, T, H, D]
        .Arg<ffi::AnyBuffer>()  // k: [B, S, K, D]
        .Arg<ffi::AnyBuffer>()  // v: [B, S, K, D]
        .Arg<ffi::AnyBuffer>()  // alibi_slopes: [B, H] float32, read if has_alibi
        .Arg<ffi::AnyBuffer>()  // q_segment_ids: [B, T] int32, read if has_segment_ids
        .Arg<ffi::AnyBuffer>()  // kv_segment_ids: [B, S] int32, read if has_segment_ids
        .Arg<ffi::AnyBuffer>()  // dropout_seeds: [B, H, 2] uint32, read if dropout_rate > 0
        .Ret<ffi::AnyBuffer>()  // out: [B, T, H, D]
        .Ret<ffi::AnyBuffer>()  // lse: [B, H, T] float32
        .Attr<float>("softmax_scale")
        .Attr<int64_t>("window_left")    // -1: unbounded
        .Attr<int64_t>("window_right")  // -1: unbounded; 0: causal
        .Attr<float>("softcap")         // 0: off
        .Attr<bool>("has_alibi")        // false: alibi_slopes is ignored
        .Attr<bool>("has_segment_ids")  // false: the segment ids are ignored
        .Attr<float>("dropout_rate"));  // in [0, 1); 0: off, the seeds are ignored

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlash2CpuBackward, BackwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::AnyBuffer>()  // q: [B, T, H, D]
        .Arg<ffi::AnyBuffer>()  // k: [B, S, K, D]
        .Arg<ffi::AnyBuffer>()  // v: [B, S, K, D]
        .Arg<ffi::AnyBuffer>()  // out: [B, T, H, D], the forward's output
        .Arg<ffi::AnyBuffer>()  // lse: [B, H, T] float32, the forward's LSE
        .Arg<ffi::AnyBuffer>()  // d_out: [B, T, H, D]
        .Arg<ffi::AnyBuffer>()  // d_lse: [B, H, T] float32
        .Arg<ffi::AnyBuffer>()  // alibi_slopes: [B, H] float32, read if has_alibi
        .Arg<ffi::AnyBuffer>()  // q_segment_ids: [B, T] int32, read if has_segment_ids
        .Arg<ffi::AnyBuffer>()  // kv_segment_ids: [B, S] int32, read if has_segment_ids
        .Arg<ffi::AnyBuffer>()  // dropout_seeds: [B, H, 2] uint32, the forward's
        .Ret<ffi::AnyBuffer>()  // dq: [B, T, H, D]
        .Ret<ffi::AnyBuffer>()  // dk: [B, S, K, D], summed over each head group
        .Ret<ffi::AnyBuffer>()  // dv: [B, S, K, D], summed over each head group
        .Attr<float>("softmax_scale")
        .Attr<int64_t>("window_left")
        .Attr<int64_t>("window_right")
        .Attr<float>("softcap")
        .Attr<bool>("has_alibi")
        .Attr<bool>("has_segment_ids")
        .Attr<float>("dropout_rate"));

}  // namespace jax_flash2::cpu
