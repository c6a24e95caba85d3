// Appends new keys and values to a KV cache in place: the CUDA route of
// jax_flash2/kvcache.py's _append, bit for bit the same as its XLA route
// (_append_xla) in one launch where XLA runs several small dependent kernels.
//
// Token t of sequence b goes to position pos = cache_seqlens[b] + t of its
// sequence: row pos of a contiguous cache [B, S_max, K, D], or slot
// pos % page_size of page block_table[b, pos / page_size] of a paged one
// [num_pages, page_size, K, D]. A position outside [0, capacity) or a page id
// outside the pool drops the token (never wrapped, never clamped), so that
// untrusted lengths and tables never write out of bounds. An int8 /
// float8_e4m3fn cache stores round / saturate(float32(x) / scale) as
// kvcache.quantize() does, with the division XLA emits on the GPU.
//
// Each thread takes one 8-element chunk of one (b, t, kh) row and writes it
// to both caches: the destination is computed once for k and v.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../ffi_params.h"
#include "ffi_cuda.h"
#include "flash_cuda.h"  // GetCurrentDeviceInfo
#include "launch.h"
#include "sm80/primitives.cuh"  // ToFloat, AllowDependentLaunch, WaitForPrimaryGrid

namespace jax_flash2::cuda {
namespace {

constexpr int kChunk = 8;  // elements per thread step: 16 bytes of a 16-bit row
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this

// Where the call reads and writes; every buffer dense row-major.
struct KvAppendParams {
  const void* k;  // [B, T, K, D]
  const void* v;
  void* k_cache;  // [B, S_max, K, D], or [num_pages, page_size, K, D]
  void* v_cache;
  const int32_t* cache_seqlens;  // [B]
  const int32_t* block_table;    // [B, max_pages]; null for a contiguous cache
  const float* k_scale;          // [K] or [num_pages, K]; null unless quantized
  const float* v_scale;
  int64_t batch, seqlen_new, num_kv_heads, head_dim;
  int64_t capacity;   // positions per sequence: S_max, or max_pages * page_size
  int64_t page_size;  // 0: contiguous
  int64_t num_pages, max_pages;
  bool k_scale_per_page, v_scale_per_page;  // [num_pages, K] rather than [K]
  bool vectorized;  // D % kChunk == 0 and every buffer 16-byte aligned: whole-chunk copies
};

// x / y as XLA computes a float32 division on the GPU: its NVPTX backend
// runs with -nvptx-prec-divf32=1, so fdiv becomes div.full.f32 (within 2 ulp),
// not the correctly rounded div.rn.f32 of CUDA's x / y. The same instruction
// keeps the quantized values equal to the XLA route's, bit for bit.
__device__ __forceinline__ float DivideAsXla(float x, float y) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(y));
  return q;
}

// One cache element from one new element: the same bits for a cache of k's
// dtype; else float32(x) / scale quantized as kvcache.quantize() does.
template <typename Src, typename Cache>
__device__ __forceinline__ Cache Encode(Src x, float scale) {
  if constexpr (std::is_same_v<Src, Cache>) {
    return x;
  } else {
    const float y = DivideAsXla(ToFloat(x), scale);
    if constexpr (std::is_same_v<Cache, int8_t>) {
      const float r = rintf(y);  // half to even, as jnp.round
      // XLA converts a NaN float to the integer 0; fminf / fmaxf would turn it into a bound.
      if (isnan(r)) return 0;
      return static_cast<int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
    } else {
      // The clamp to +-448 is quantize()'s, written with comparisons (false
      // for NaN) so that NaN passes through. The conversion stores any NaN
      // as 0x7F, as XLA does: its NaN-propagating clamp yields a positive one.
      const float c = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
      __nv_fp8_e4m3 out;
      out.__x = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3);  // round to nearest even
      return out;
    }
  }
}

// Copies a chunk between global memory and a local array in the widest
// words its size allows (16 bytes, or 8 for a chunk of 1-byte elements).
template <typename T>
__device__ __forceinline__ void CopyChunk(T* dst, const T* src) {
  constexpr int kBytes = sizeof(T) * kChunk;
  static_assert(kBytes % 8 == 0, "a chunk is whole 8-byte words");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(src)[i];
    }
  }
}

// The cache slot (row of the cache seen as [slots, K, D]) of token t of
// sequence b and the page that holds it, or -1 when the token is dropped.
// pos is computed in int64, where cache_seqlens[b] + t cannot overflow (XLA's
// int32 sum wraps to a negative position instead: dropped all the same).
__device__ __forceinline__ int64_t CacheSlot(const KvAppendParams& p, int64_t b, int64_t t,
                                             int64_t* page) {
  const int64_t pos = static_cast<int64_t>(p.cache_seqlens[b]) + t;
  if (pos < 0 || pos >= p.capacity) return -1;
  if (p.page_size == 0) {
    *page = 0;
    return b * p.capacity + pos;
  }
  // pos < max_pages * page_size, so the table index is in its row.
  const int64_t id = p.block_table[b * p.max_pages + pos / p.page_size];
  if (id < 0 || id >= p.num_pages) return -1;
  *page = id;
  return id * p.page_size + pos % p.page_size;
}

// Encodes one chunk of a row of k or v (src) into the cache (dst); count
// elements (kChunk on the vectorized path, fewer at the end of a row whose
// D is not a multiple of kChunk).
template <typename Src, typename Cache>
__device__ __forceinline__ void AppendChunk(const Src* src, Cache* dst, float scale, int count,
                                            bool vectorized) {
  alignas(16) Src in[kChunk];
  alignas(16) Cache out[kChunk];
  if (vectorized) {
    CopyChunk(in, src);
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) in[j] = j < count ? src[j] : Src{};
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) out[j] = Encode<Src, Cache>(in[j], scale);
  if (vectorized) {
    CopyChunk(dst, out);
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < count) dst[j] = out[j];
    }
  }
}

template <typename Src, typename Cache>
__global__ void __launch_bounds__(kThreads) KvAppendKernel(const KvAppendParams p) {
  // Launched early (LaunchKvAppend), the grid waits for the one before it
  // before it reads anything, and lets the attention after it (the decode
  // kernel, which waits for this grid in turn) be scheduled at once.
  AllowDependentLaunch();
  WaitForPrimaryGrid();
  constexpr bool kQuantized = !std::is_same_v<Src, Cache>;
  const int64_t chunks_per_row = (p.head_dim + kChunk - 1) / kChunk;
  const int64_t items = p.batch * p.seqlen_new * p.num_kv_heads * chunks_per_row;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t chunk = item % chunks_per_row;
    const int64_t row = item / chunks_per_row;  // (b, t, kh) of k and v
    const int64_t kh = row % p.num_kv_heads;
    const int64_t t = (row / p.num_kv_heads) % p.seqlen_new;
    const int64_t b = row / (p.num_kv_heads * p.seqlen_new);
    int64_t page;
    const int64_t slot = CacheSlot(p, b, t, &page);
    if (slot < 0) continue;
    float k_scale = 1.0f, v_scale = 1.0f;
    if constexpr (kQuantized) {
      k_scale = p.k_scale[(p.k_scale_per_page ? page * p.num_kv_heads : 0) + kh];
      v_scale = p.v_scale[(p.v_scale_per_page ? page * p.num_kv_heads : 0) + kh];
    }
    const int64_t first = chunk * kChunk;
    const int count = static_cast<int>(std::min<int64_t>(kChunk, p.head_dim - first));
    const int64_t src = row * p.head_dim + first;
    const int64_t dst = (slot * p.num_kv_heads + kh) * p.head_dim + first;
    AppendChunk(static_cast<const Src*>(p.k) + src, static_cast<Cache*>(p.k_cache) + dst, k_scale,
                count, p.vectorized);
    AppendChunk(static_cast<const Src*>(p.v) + src, static_cast<Cache*>(p.v_cache) + dst, v_scale,
                count, p.vectorized);
  }
}

// On cc 9.0 a programmatic dependent launch, as the decode kernel after it:
// both launches then sit under the previous grid's tail instead of in line.
template <typename Src, typename Cache>
cudaError_t LaunchKvAppend(const KvAppendParams& p, cudaStream_t stream) {
  const int64_t chunks_per_row = (p.head_dim + kChunk - 1) / kChunk;
  const int64_t items = p.batch * p.seqlen_new * p.num_kv_heads * chunks_per_row;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks);
  DeviceInfo dev;
  if (cudaError_t err = GetCurrentDeviceInfo(&dev); err != cudaSuccess) return err;
  return LaunchKernel(KvAppendKernel<Src, Cache>, dim3(static_cast<unsigned>(blocks)),
                      dim3(kThreads), 0, stream, LaunchesDecodeEarly(dev), p);
}

// The kernel for a (k dtype, cache dtype) pair: a cache of k's dtype, or an
// int8 / float8_e4m3fn one.
template <typename Src>
cudaError_t DispatchCache(const KvAppendParams& p, ffi::DataType cache_type, cudaStream_t stream) {
  switch (cache_type) {
    case ffi::DataType::S8: return LaunchKvAppend<Src, int8_t>(p, stream);
    case ffi::DataType::F8E4M3FN: return LaunchKvAppend<Src, __nv_fp8_e4m3>(p, stream);
    default: return LaunchKvAppend<Src, Src>(p, stream);
  }
}

cudaError_t RunKvAppend(const KvAppendParams& p, ffi::DataType src_type, ffi::DataType cache_type,
                        cudaStream_t stream) {
  switch (src_type) {
    case ffi::DataType::F16: return DispatchCache<__half>(p, cache_type, stream);
    case ffi::DataType::BF16: return DispatchCache<__nv_bfloat16>(p, cache_type, stream);
    default: return DispatchCache<float>(p, cache_type, stream);
  }
}

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_flash2 kv_append: " + message);
}

bool SameShape(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  return da.size() == db.size() && std::equal(da.begin(), da.end(), db.begin());
}

// Checks a quantized cache's scale (float32 [K], or [num_pages, K] for a
// paged cache) and says whether it is per page.
ffi::Error CheckScale(const char* name, const ffi::AnyBuffer& scale, int64_t num_kv_heads,
                      int64_t num_pages, bool paged, bool* per_page) {
  const auto d = scale.dimensions();
  const bool per_head = d.size() == 1 && d[0] == num_kv_heads;
  *per_page = paged && d.size() == 2 && d[0] == num_pages && d[1] == num_kv_heads;
  if (scale.element_type() != ffi::DataType::F32 || !(per_head || *per_page)) {
    return Invalid(std::string(name) + " must be float32 [K] = [" + std::to_string(num_kv_heads) +
                   "]" + (paged ? " or [num_pages, K]" : "") + "; got " + ShapeString(scale));
  }
  return ffi::Error::Success();
}

// KvAppendParams from the buffers, with every shape and dtype checked (the
// Python side checks them at trace time; these guard a hand-built call).
ffi::Error KvAppendParamsFrom(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache,
                              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& cache_seqlens,
                              const ffi::AnyBuffer& block_table, const ffi::AnyBuffer& k_scale,
                              const ffi::AnyBuffer& v_scale, ffi::AnyBuffer& k_cache_out,
                              ffi::AnyBuffer& v_cache_out, int64_t page_size, KvAppendParams* p) {
  const auto kd = k.dimensions();
  const auto cd = k_cache.dimensions();
  if (kd.size() != 4 || !SameShape(k, v) || cd.size() != 4 || !SameShape(k_cache, v_cache) ||
      cd[2] != kd[2] || cd[3] != kd[3]) {
    return Invalid("k, v must be [B, T, K, D] and the caches [B or num_pages, S_max or "
                   "page_size, K, D]; got k " + ShapeString(k) + ", v " + ShapeString(v) +
                   ", k_cache " + ShapeString(k_cache) + ", v_cache " + ShapeString(v_cache));
  }
  const ffi::DataType src_type = k.element_type();
  const ffi::DataType cache_type = k_cache.element_type();
  const bool quantized = cache_type == ffi::DataType::S8 || cache_type == ffi::DataType::F8E4M3FN;
  if ((src_type != ffi::DataType::F16 && src_type != ffi::DataType::BF16 &&
       src_type != ffi::DataType::F32) ||
      v.element_type() != src_type || v_cache.element_type() != cache_type ||
      (!quantized && cache_type != src_type)) {
    return Invalid("k, v must be float16, bfloat16 or float32, and the caches of that dtype or "
                   "int8 / float8_e4m3fn");
  }
  if (!SameShape(k_cache_out, k_cache) || !SameShape(v_cache_out, v_cache) ||
      k_cache_out.element_type() != cache_type || v_cache_out.element_type() != cache_type) {
    return Invalid("the results must have the caches' shape and dtype; got " +
                   ShapeString(k_cache_out) + " and " + ShapeString(v_cache_out));
  }
  p->batch = kd[0];
  p->seqlen_new = kd[1];
  p->num_kv_heads = kd[2];
  p->head_dim = kd[3];
  const auto sd = cache_seqlens.dimensions();
  if (cache_seqlens.element_type() != ffi::DataType::S32 || sd.size() != 1 || sd[0] != p->batch) {
    return Invalid("cache_seqlens must be int32 [B] = [" + std::to_string(p->batch) + "]; got " +
                   ShapeString(cache_seqlens));
  }

  p->page_size = page_size;
  p->block_table = nullptr;
  if (page_size < 0) return Invalid("page_size must be >= 0; got " + std::to_string(page_size));
  if (page_size == 0) {
    if (cd[0] != p->batch || block_table.element_count() != 0) {
      return Invalid("a contiguous cache (page_size 0) must be [B, S_max, K, D] with B = " +
                     std::to_string(p->batch) + " and no block table; got k_cache " +
                     ShapeString(k_cache) + ", block_table " + ShapeString(block_table));
    }
    p->num_pages = 0;
    p->max_pages = 0;
    p->capacity = cd[1];
  } else {
    const auto td = block_table.dimensions();
    if (cd[1] != page_size || block_table.element_type() != ffi::DataType::S32 || td.size() != 2 ||
        td[0] != p->batch || td[1] < 1) {
      return Invalid("a paged cache must be [num_pages, page_size = " + std::to_string(page_size) +
                     ", K, D] with an int32 block table [B, max_pages >= 1]; got k_cache " +
                     ShapeString(k_cache) + ", block_table " + ShapeString(block_table));
    }
    p->num_pages = cd[0];
    p->max_pages = td[1];
    p->capacity = td[1] * page_size;
    p->block_table = static_cast<const int32_t*>(block_table.untyped_data());
  }

  p->k_scale = p->v_scale = nullptr;
  p->k_scale_per_page = p->v_scale_per_page = false;
  if (quantized) {
    JF2_RETURN_IF_ERROR(CheckScale("k_scale", k_scale, p->num_kv_heads, p->num_pages,
                                   page_size > 0, &p->k_scale_per_page));
    JF2_RETURN_IF_ERROR(CheckScale("v_scale", v_scale, p->num_kv_heads, p->num_pages,
                                   page_size > 0, &p->v_scale_per_page));
    p->k_scale = static_cast<const float*>(k_scale.untyped_data());
    p->v_scale = static_cast<const float*>(v_scale.untyped_data());
  } else if (k_scale.element_count() != 0 || v_scale.element_count() != 0) {
    return Invalid("k_scale, v_scale are for int8 / float8_e4m3fn caches; got " +
                   ShapeString(k_scale) + " and " + ShapeString(v_scale));
  }

  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->k_cache = k_cache_out.untyped_data();
  p->v_cache = v_cache_out.untyped_data();
  p->cache_seqlens = static_cast<const int32_t*>(cache_seqlens.untyped_data());
  // A chunk starts at a multiple of kChunk elements of a buffer: aligned for
  // its word copies when every buffer starts on 16 bytes.
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  p->vectorized = p->head_dim % kChunk == 0 && aligned(p->k) && aligned(p->v) &&
                  aligned(p->k_cache) && aligned(p->v_cache);
  return ffi::Error::Success();
}

// The lowering aliases each result to its cache (input_output_aliases), so
// the slots the kernel does not write already hold the cache; a call built
// without the alias gets the cache copied first.
ffi::Error CopyUnlessAliased(const ffi::AnyBuffer& cache, ffi::AnyBuffer& out,
                             cudaStream_t stream) {
  if (cache.untyped_data() == out.untyped_data()) return ffi::Error::Success();
  if (cudaError_t err = cudaMemcpyAsync(out.untyped_data(), cache.untyped_data(),
                                        cache.size_bytes(), cudaMemcpyDeviceToDevice, stream);
      err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_flash2 kv_append: copying a cache: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error KvAppendImpl(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer cache_seqlens,
                        ffi::AnyBuffer block_table, ffi::AnyBuffer k_scale,
                        ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> k_cache_out,
                        ffi::Result<ffi::AnyBuffer> v_cache_out, int64_t page_size) {
  KvAppendParams p;
  JF2_RETURN_IF_ERROR(KvAppendParamsFrom(k_cache, v_cache, k, v, cache_seqlens, block_table,
                                         k_scale, v_scale, *k_cache_out, *v_cache_out, page_size,
                                         &p));
  JF2_RETURN_IF_ERROR(CopyUnlessAliased(k_cache, *k_cache_out, stream));
  JF2_RETURN_IF_ERROR(CopyUnlessAliased(v_cache, *v_cache_out, stream));
  if (cudaError_t err = RunKvAppend(p, k.element_type(), k_cache.element_type(), stream);
      err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_flash2 kv_append: kernel launch: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlash2CudaKvAppend, KvAppendImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // k_cache: [B, S_max, K, D], or [num_pages, page_size, K, D]
        .Arg<ffi::AnyBuffer>()  // v_cache: as k_cache
        .Arg<ffi::AnyBuffer>()  // k: [B, T, K, D] float16 / bfloat16 / float32
        .Arg<ffi::AnyBuffer>()  // v: as k
        .Arg<ffi::AnyBuffer>()  // cache_seqlens: int32 [B], any values (bad ones drop tokens)
        .Arg<ffi::AnyBuffer>()  // block_table: int32 [B, max_pages]; [0] when contiguous
        .Arg<ffi::AnyBuffer>()  // k_scale: float32 [K] or [num_pages, K]; [0] unless quantized
        .Arg<ffi::AnyBuffer>()  // v_scale: as k_scale
        .Ret<ffi::AnyBuffer>()  // k_cache updated, aliased to operand 0
        .Ret<ffi::AnyBuffer>()  // v_cache updated, aliased to operand 1
        .Attr<int64_t>("page_size"));  // 0: contiguous; > 0: paged via block_table

}  // namespace jax_flash2::cuda
