// FlashParams from FFI buffers and attributes: the one place where shapes are
// checked on the C++ side, used by the CPU and CUDA handlers alike. Python
// checks the same things at trace time with friendlier messages; these checks
// guard against a custom call built by hand.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "flash_dropout.h"
#include "flash_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash2 {

namespace ffi = xla::ffi;

inline std::string ShapeString(const ffi::AnyBuffer& buffer) {
  std::string s = "[";
  const auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline ffi::Error ToDType(ffi::DataType type, DType* dtype) {
  switch (type) {
    case ffi::DataType::F32: *dtype = DType::kFloat32; return ffi::Error::Success();
    case ffi::DataType::F16: *dtype = DType::kFloat16; return ffi::Error::Success();
    case ffi::DataType::BF16: *dtype = DType::kBFloat16; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jax_flash2: q, k, v must be float32, float16 or bfloat16");
  }
}

// Sizes, strides, dtype, scale and window from q [B, T, H, D], k, v [B, S, K, D].
// With page_size > 0, k and v are a page pool [num_pages, page_size, K, D]
// (any number of pages), and S comes from the block table (SetKvCacheInputs).
inline ffi::Error ParamsFromInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                   const ffi::AnyBuffer& v, float softmax_scale,
                                   int64_t window_left, int64_t window_right, float softcap,
                                   FlashParams* p, int64_t page_size = 0) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("jax_flash2: q, k, v must be rank 4 [B, T, H, D]; got q " +
                                       ShapeString(q) + ", k " + ShapeString(k) + ", v " +
                                       ShapeString(v));
  }
  const bool shapes_ok = (page_size > 0 || kd[0] == qd[0]) && vd[0] == kd[0] && kd[1] == vd[1] &&
                         kd[2] == vd[2] &&
                         kd[3] == qd[3] && vd[3] == qd[3] && kd[2] > 0 && qd[2] % kd[2] == 0;
  if (!shapes_ok) {
    return ffi::Error::InvalidArgument("jax_flash2: incompatible shapes q " + ShapeString(q) +
                                       ", k " + ShapeString(k) + ", v " + ShapeString(v));
  }
  // k and v may be a quantized KV cache (int8 or float8_e4m3fn, with scales:
  // SetKvCacheInputs checks the rest); else q, k, v share one dtype.
  const ffi::DataType kv_type = k.element_type();
  const bool quantized = kv_type == ffi::DataType::S8 || kv_type == ffi::DataType::F8E4M3FN;
  if ((!quantized && q.element_type() != kv_type) || v.element_type() != kv_type) {
    return ffi::Error::InvalidArgument("jax_flash2: q, k, v must share one dtype");
  }
  p->kv_quant = !quantized                      ? KvQuant::kNone
                : kv_type == ffi::DataType::S8 ? KvQuant::kInt8
                                               : KvQuant::kFloat8E4M3;
  if (ffi::Error err = ToDType(q.element_type(), &p->dtype); err.failure()) return err;
  if (qd[3] % 8 != 0 || qd[3] > 256 || qd[3] <= 0) {
    return ffi::Error::InvalidArgument("jax_flash2: head_dim must be a multiple of 8 in [8, 256]; "
                                       "got " + std::to_string(qd[3]));
  }
  if (!(softmax_scale > 0.0f) || !std::isfinite(softmax_scale)) {
    return ffi::Error::InvalidArgument("jax_flash2: softmax_scale must be finite and positive");
  }
  p->batch = qd[0];
  p->seqlen_q = qd[1];
  p->num_heads_q = qd[2];
  p->head_dim = qd[3];
  p->seqlen_k = kd[1];
  p->num_heads_kv = kd[2];
  p->group_size = p->num_heads_q / p->num_heads_kv;
  p->softmax_scale = softmax_scale;
  p->softmax_scale_log2 = softmax_scale * 1.4426950408889634f;
  if (window_left < -1 || window_right < -1) {
    return ffi::Error::InvalidArgument("jax_flash2: window bounds must be >= -1");
  }
  if (!(softcap >= 0.0f) || !std::isfinite(softcap)) {
    return ffi::Error::InvalidArgument("jax_flash2: softcap must be finite and >= 0");
  }
  p->window_left = window_left;
  p->window_right = window_right;
  p->softcap = softcap;
  SetDenseStrides(*p);
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  return ffi::Error::Success();
}

// The ALiBi slopes [B, H] float32, segment ids [B, T], [B, S] int32 and
// dropout seeds [B, H, 2] uint32 are always operands; the attributes say
// whether the call uses them, and only then do their pointers go into p (the
// kernels test for null). One the call does not read may also be a
// zero-size placeholder (the lowering passes those, so that XLA launches
// nothing to fill it).
inline ffi::Error SetOptionalInputs(const ffi::AnyBuffer& alibi_slopes,
                                    const ffi::AnyBuffer& q_segment_ids,
                                    const ffi::AnyBuffer& kv_segment_ids,
                                    const ffi::AnyBuffer& dropout_seeds, bool has_alibi,
                                    bool has_segment_ids, float dropout_rate, FlashParams* p) {
  const auto placeholder = [](const ffi::AnyBuffer& input, bool used) {
    return !used && input.element_count() == 0;
  };
  const auto sd = alibi_slopes.dimensions();
  if (!placeholder(alibi_slopes, has_alibi) &&
      (alibi_slopes.element_type() != ffi::DataType::F32 || sd.size() != 2 ||
       sd[0] != p->batch || sd[1] != p->num_heads_q)) {
    return ffi::Error::InvalidArgument("jax_flash2: alibi_slopes must be float32 [B, H] = [" +
                                       std::to_string(p->batch) + ", " +
                                       std::to_string(p->num_heads_q) + "]; got " +
                                       ShapeString(alibi_slopes));
  }
  for (const auto& [ids, length, name] :
       {std::tuple{&q_segment_ids, p->seqlen_q, "q_segment_ids [B, T]"},
        std::tuple{&kv_segment_ids, p->seqlen_k, "kv_segment_ids [B, S]"}}) {
    const auto d = ids->dimensions();
    if (!placeholder(*ids, has_segment_ids) &&
        (ids->element_type() != ffi::DataType::S32 || d.size() != 2 || d[0] != p->batch ||
         d[1] != length)) {
      return ffi::Error::InvalidArgument(std::string("jax_flash2: ") + name +
                                         " must be int32 of batch " + std::to_string(p->batch) +
                                         " and length " + std::to_string(length) + "; got " +
                                         ShapeString(*ids));
    }
  }
  const auto dd = dropout_seeds.dimensions();
  if (!placeholder(dropout_seeds, dropout_rate > 0.0f) &&
      (dropout_seeds.element_type() != ffi::DataType::U32 || dd.size() != 3 ||
       dd[0] != p->batch || dd[1] != p->num_heads_q || dd[2] != 2)) {
    return ffi::Error::InvalidArgument("jax_flash2: dropout_seeds must be uint32 [B, H, 2] = [" +
                                       std::to_string(p->batch) + ", " +
                                       std::to_string(p->num_heads_q) + ", 2]; got " +
                                       ShapeString(dropout_seeds));
  }
  // Written so that NaN fails too.
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) {
    return ffi::Error::InvalidArgument("jax_flash2: dropout_rate must be in [0, 1); got " +
                                       std::to_string(dropout_rate));
  }
  // One byte of Philox output decides a key (flash_dropout.h): the Python
  // layer rounds the rate to 256ths, so any other value is a caller's error.
  const float in_256ths = dropout_rate * 256.0f;
  if (dropout_rate > 0.0f && (in_256ths != static_cast<float>(static_cast<int>(in_256ths)) ||
                              in_256ths < 1.0f || in_256ths > 255.0f)) {
    return ffi::Error::InvalidArgument(
        "jax_flash2: dropout_rate must be a multiple of 1/256 in [1/256, 255/256]; got " +
        std::to_string(dropout_rate));
  }
  p->dropout_rate = dropout_rate;
  p->dropout_seeds =
      dropout_rate > 0.0f ? static_cast<const uint32_t*>(dropout_seeds.untyped_data()) : nullptr;
  p->dropout_threshold = DropoutThreshold(dropout_rate);
  p->dropout_scale = 1.0f / (1.0f - dropout_rate);
  p->alibi_slopes = has_alibi ? static_cast<const float*>(alibi_slopes.untyped_data()) : nullptr;
  p->q_segment_ids =
      has_segment_ids ? static_cast<const int32_t*>(q_segment_ids.untyped_data()) : nullptr;
  p->kv_segment_ids =
      has_segment_ids ? static_cast<const int32_t*>(kv_segment_ids.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// The KV-cache operands (jax_flash2.kvcache): kv_seqlens [B] int32, the valid
// keys of each sequence (the window aligns to them), and with page_size > 0
// the block table [B, P] int32 of page ids; k, v are then a page pool whose
// "batch" stride is the page stride, and S = P * page_size. Lengths and page
// ids are checked in Python when concrete; the kernels clamp lengths to
// [0, S] and never follow a page id outside [0, num_pages) (its keys and
// values read as zeros), so a traced bad value cannot make them read out of
// bounds.
inline ffi::Error SetKvCacheInputs(const ffi::AnyBuffer& kv_seqlens,
                                   const ffi::AnyBuffer& block_table,
                                   const ffi::AnyBuffer& kv_scales, bool has_kv_seqlens,
                                   int64_t page_size, int64_t num_pages, FlashParams* p) {
  if (page_size < 0 || (page_size > 0 && !has_kv_seqlens)) {
    return ffi::Error::InvalidArgument("jax_flash2: page_size must be >= 0, and > 0 only with "
                                       "kv_seqlens; got " + std::to_string(page_size));
  }
  const auto ld = kv_seqlens.dimensions();
  if (has_kv_seqlens && (kv_seqlens.element_type() != ffi::DataType::S32 || ld.size() != 1 ||
                         ld[0] != p->batch)) {
    return ffi::Error::InvalidArgument("jax_flash2: kv_seqlens must be int32 [B] = [" +
                                       std::to_string(p->batch) + "]; got " +
                                       ShapeString(kv_seqlens));
  }
  const auto td = block_table.dimensions();
  if (page_size > 0) {
    if (block_table.element_type() != ffi::DataType::S32 || td.size() != 2 ||
        td[0] != p->batch || td[1] < 1 || p->seqlen_k != page_size) {
      return ffi::Error::InvalidArgument(
          "jax_flash2: a paged cache needs k, v [num_pages, page_size, K, D] and an int32 "
          "block_table [B, P]; got k pages of " + std::to_string(p->seqlen_k) +
          " keys, page_size " + std::to_string(page_size) + ", block_table " +
          ShapeString(block_table));
    }
    p->block_table = static_cast<const int32_t*>(block_table.untyped_data());
    p->max_pages = td[1];
    p->num_pages = num_pages;
    p->page_size = page_size;
    p->seqlen_k = td[1] * page_size;
  }
  p->kv_seqlens = has_kv_seqlens ? static_cast<const int32_t*>(kv_seqlens.untyped_data()) : nullptr;
  // A quantized cache: kv_scales float32 [B, 2, 1 or max_pages, K].
  if (p->kv_quant != KvQuant::kNone) {
    const auto sd = kv_scales.dimensions();
    const bool ok = has_kv_seqlens && kv_scales.element_type() == ffi::DataType::F32 &&
                    sd.size() == 4 && sd[0] == p->batch && sd[1] == 2 &&
                    (sd[2] == 1 || (page_size > 0 && sd[2] == p->max_pages)) &&
                    sd[3] == p->num_heads_kv;
    if (!ok) {
      return ffi::Error::InvalidArgument(
          "jax_flash2: an int8 / float8_e4m3fn k, v is a KV cache (kv_seqlens) with kv_scales "
          "float32 [B, 2, 1 or max_pages, K]; got kv_scales " + ShapeString(kv_scales));
    }
    p->kv_scales = static_cast<const float*>(kv_scales.untyped_data());
    p->kv_scale_pages = sd[2];
  }
  return ffi::Error::Success();
}

// Output and backward-input shapes must match what ParamsFromInputs derived.
inline ffi::Error CheckSameShape(const ffi::AnyBuffer& actual, const ffi::AnyBuffer& expected,
                                 const char* name) {
  const auto a = actual.dimensions();
  const auto e = expected.dimensions();
  bool same = a.size() == e.size() && actual.element_type() == expected.element_type();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == e[i];
  if (!same) {
    return ffi::Error::InvalidArgument(std::string("jax_flash2: ") + name + " has shape " +
                                       ShapeString(actual) + ", expected " +
                                       ShapeString(expected) + " of the same dtype");
  }
  return ffi::Error::Success();
}

// lse-like buffers are float32 [B, H, T].
inline ffi::Error CheckLseShape(const ffi::AnyBuffer& lse, const FlashParams& p, const char* name) {
  const auto d = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || d.size() != 3 || d[0] != p.batch ||
      d[1] != p.num_heads_q || d[2] != p.seqlen_q) {
    return ffi::Error::InvalidArgument(std::string("jax_flash2: ") + name +
                                       " must be float32 [B, H, T]; got " + ShapeString(lse));
  }
  return ffi::Error::Success();
}

#define JF2_RETURN_IF_ERROR(expr)          \
  if (ffi::Error err = (expr); err.failure()) { \
    return err;                              \
  }

// The attributes every call carries (see the handler bindings).
struct CallAttrs {
  float softmax_scale;
  int64_t window_left;
  int64_t window_right;
  float softcap;
  bool has_alibi;
  bool has_segment_ids;
  float dropout_rate;  // 0: off
  bool has_kv_seqlens = false;  // KV cache: per-sequence key counts
  int64_t page_size = 0;        // > 0: paged KV cache
};

// The optional per-call arrays; their shapes are checked even when unused.
struct OptionalInputs {
  ffi::AnyBuffer alibi_slopes;    // [B, H] float32
  ffi::AnyBuffer q_segment_ids;   // [B, T] int32
  ffi::AnyBuffer kv_segment_ids;  // [B, S] int32
  ffi::AnyBuffer dropout_seeds;   // [B, H, 2] uint32
  ffi::AnyBuffer kv_seqlens;      // [B] int32
  ffi::AnyBuffer block_table;     // [B, P] int32
  ffi::AnyBuffer kv_scales;       // [B, 2, 1 or P, K] float32
};

// FlashParams of a forward call: inputs q, k, v (+ optional), outputs out, lse.
inline ffi::Error ForwardParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, const OptionalInputs& optional,
                                const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                const CallAttrs& attrs, FlashParams* p) {
  JF2_RETURN_IF_ERROR(ParamsFromInputs(q, k, v, attrs.softmax_scale, attrs.window_left,
                                       attrs.window_right, attrs.softcap, p, attrs.page_size));
  JF2_RETURN_IF_ERROR(SetKvCacheInputs(optional.kv_seqlens, optional.block_table,
                                       optional.kv_scales, attrs.has_kv_seqlens, attrs.page_size,
                                       k.dimensions()[0], p));
  JF2_RETURN_IF_ERROR(SetOptionalInputs(optional.alibi_slopes, optional.q_segment_ids,
                                        optional.kv_segment_ids, optional.dropout_seeds,
                                        attrs.has_alibi, attrs.has_segment_ids,
                                        attrs.dropout_rate, p));
  JF2_RETURN_IF_ERROR(CheckSameShape(out, q, "out"));
  JF2_RETURN_IF_ERROR(CheckLseShape(lse, *p, "lse"));
  p->o = out.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  return ffi::Error::Success();
}

// FlashParams of a backward call: the forward's inputs and results, the output
// cotangents d_out and d_lse, and the gradients dq, dk, dv to write.
inline ffi::Error BackwardParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                                 const ffi::AnyBuffer& lse, const ffi::AnyBuffer& d_out,
                                 const ffi::AnyBuffer& d_lse, const OptionalInputs& optional,
                                 const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                                 const ffi::AnyBuffer& dv, const CallAttrs& attrs, FlashParams* p) {
  if (attrs.has_kv_seqlens || attrs.page_size > 0) {
    return ffi::Error::InvalidArgument("jax_flash2: the KV-cache call is forward only");
  }
  JF2_RETURN_IF_ERROR(ForwardParams(q, k, v, optional, out, lse, attrs, p));
  JF2_RETURN_IF_ERROR(CheckSameShape(d_out, q, "d_out"));
  JF2_RETURN_IF_ERROR(CheckLseShape(d_lse, *p, "d_lse"));
  JF2_RETURN_IF_ERROR(CheckSameShape(dq, q, "dq"));
  JF2_RETURN_IF_ERROR(CheckSameShape(dk, k, "dk"));
  JF2_RETURN_IF_ERROR(CheckSameShape(dv, v, "dv"));
  p->d_o = d_out.untyped_data();
  p->d_lse = static_cast<const float*>(d_lse.untyped_data());
  p->dq = dq.untyped_data();
  p->dk = dk.untyped_data();
  p->dv = dv.untyped_data();
  return ffi::Error::Success();
}

// The custom calls' operand lists, shared by the CPU and CUDA handlers so the
// two platforms cannot drift apart: each handler binds its context, then
// ForwardOperands or BackwardOperands, its own results (the CUDA workspace),
// ScoreAttrs, and its own attributes, in its handler's parameter order.
template <class Binding>
auto ForwardOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q: [B, T, H, D]
      .template Arg<ffi::AnyBuffer>()            // k: [B, S, K, D]
      .template Arg<ffi::AnyBuffer>()            // v: [B, S, K, D]
      .template Arg<ffi::AnyBuffer>()  // alibi_slopes: [B, H] float32, read if has_alibi
      .template Arg<ffi::AnyBuffer>()  // q_segment_ids: [B, T] int32, read if has_segment_ids
      .template Arg<ffi::AnyBuffer>()  // kv_segment_ids: [B, S] int32, read if has_segment_ids
      .template Arg<ffi::AnyBuffer>()  // dropout_seeds: [B, H, 2] uint32, read if dropout_rate > 0
      .template Arg<ffi::AnyBuffer>()  // kv_seqlens: [B] int32, read if has_kv_seqlens
      .template Arg<ffi::AnyBuffer>()  // block_table: [B, P] int32, read if page_size > 0
      .template Arg<ffi::AnyBuffer>()  // kv_scales: [B, 2, 1|P, K] float32, read if k is int8/fp8
      .template Ret<ffi::AnyBuffer>()  // out: [B, T, H, D]
      .template Ret<ffi::AnyBuffer>();  // lse: [B, H, T] float32
}

template <class Binding>
auto BackwardOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q: [B, T, H, D]
      .template Arg<ffi::AnyBuffer>()            // k: [B, S, K, D]
      .template Arg<ffi::AnyBuffer>()            // v: [B, S, K, D]
      .template Arg<ffi::AnyBuffer>()  // out: [B, T, H, D], the forward's output
      .template Arg<ffi::AnyBuffer>()  // lse: [B, H, T] float32, the forward's LSE
      .template Arg<ffi::AnyBuffer>()  // d_out: [B, T, H, D]
      .template Arg<ffi::AnyBuffer>()  // d_lse: [B, H, T] float32
      .template Arg<ffi::AnyBuffer>()  // alibi_slopes: [B, H] float32, read if has_alibi
      .template Arg<ffi::AnyBuffer>()  // q_segment_ids: [B, T] int32, read if has_segment_ids
      .template Arg<ffi::AnyBuffer>()  // kv_segment_ids: [B, S] int32, read if has_segment_ids
      .template Arg<ffi::AnyBuffer>()  // dropout_seeds: [B, H, 2] uint32, the forward's
      .template Arg<ffi::AnyBuffer>()  // kv_seqlens: unused (the KV-cache call is forward only)
      .template Arg<ffi::AnyBuffer>()  // block_table: unused
      .template Arg<ffi::AnyBuffer>()  // kv_scales: unused
      .template Ret<ffi::AnyBuffer>()  // dq: [B, T, H, D]
      .template Ret<ffi::AnyBuffer>()  // dk: [B, S, K, D], summed over each head group
      .template Ret<ffi::AnyBuffer>();  // dv: [B, S, K, D], summed over each head group
}

template <class Binding>
auto ScoreAttrs(Binding binding) {
  return std::move(binding).template Attr<float>("softmax_scale")
      .template Attr<int64_t>("window_left")    // -1: unbounded
      .template Attr<int64_t>("window_right")   // -1: unbounded; 0: causal
      .template Attr<float>("softcap")          // 0: off
      .template Attr<bool>("has_alibi")         // false: alibi_slopes is ignored
      .template Attr<bool>("has_segment_ids")   // false: the segment ids are ignored
      .template Attr<float>("dropout_rate")     // in [0, 1); 0: off, the seeds are ignored
      .template Attr<bool>("has_kv_seqlens")    // false: kv_seqlens is ignored (all S keys valid)
      .template Attr<int64_t>("page_size");     // 0: k, v dense; > 0: paged via block_table
}

}  // namespace jax_flash2
