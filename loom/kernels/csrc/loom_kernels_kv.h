// The KV cache's row formats. A row is one (slot, kv head): D values of a key or a value.
//
//   float32 / float16   D values as they are
//   int8   [D int8 codes][float16 d]                           x = d * q,  q in [-127, 127]   D + 2 bytes
//   int4   [D/2 bytes of nibbles][D/32 float16 d]              x = d * (c - 8) per 32-group   D/2 + D/16 bytes
//          group g: byte 16g + j holds element 32g + j (low nibble) and 32g + 16 + j (high)
//
// The quantized formats hold the row after an orthonormal Hadamard rotation (blocks of the
// largest power of two dividing D, scaled by 1/sqrt(n)): it spreads an outlier channel over the
// whole block, so one scale fits every element. H is its own inverse, so attention reads rotated
// keys and values directly: <q, k> = <Hq, Hk> (the query is rotated once), and
// sum p v = H sum p (Hv) (the output is rotated back once).
//
// Each format: row_bytes(D); load<V>(row, D, dst) -> D floats (the attention loops read 16 keys
// at a time through it, never a dequantized copy of the context); store(row, src, D) from
// floats (scalar: once per new token, the same arithmetic as loom/model/kv_dtypes); kInPlace
// and Elem: whether the loops may also read a row in place, as D Elem values through V::load.
#pragma once

#include "loom_kernels_simd.h"

namespace loom {

enum KvFormat : int64_t { KV_FLOAT = 0, KV_INT8 = 1, KV_INT4 = 2 };

// in place: x = H x over blocks of n = the largest power of two dividing D
inline void hadamard(float* x, int64_t D) {
  const int64_t n = D & -D;
  const float s = 1.0f / std::sqrt((float)n);
  for (int64_t b = 0; b < D; b += n) {
    float* y = x + b;
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float u = y[j], v = y[j + h];
          y[j] = u + v;
          y[j + h] = u - v;
        }
    for (int64_t j = 0; j < n; ++j) y[j] *= s;
  }
}

template <typename T>
struct KvPlain {
  static constexpr bool kRotated = false, kInPlace = true;
  using Elem = T;
  static bool fits(int64_t D) { return D % 16 == 0; }
  static int64_t row_bytes(int64_t D) { return D * (int64_t)sizeof(T); }
  template <class V>
  LOOM_INLINE static void load(const uint8_t* src, int64_t D, float* dst) {
    for (int64_t j = 0; j < D; j += V::W) V::store(dst + j, V::load((const T*)src + j));
  }
  template <class V>
  static void store(uint8_t* dst, const float* src, int64_t D) {
    for (int64_t j = 0; j < D; j += V::W) V::store((T*)dst + j, V::load(src + j));
  }
};

struct KvInt8 {
  static constexpr bool kRotated = true, kInPlace = false;
  using Elem = float;
  static bool fits(int64_t D) { return D % 16 == 0; }
  static int64_t row_bytes(int64_t D) { return D + 2; }
  template <class V>
  LOOM_INLINE static void load(const uint8_t* src, int64_t D, float* dst) {
    const typename V::F d = V::set1((float)*(const at::Half*)(src + D));
    typename V::F f[16 / V::W];
    for (int64_t j = 0; j < D; j += 16) {
      V::i8x16_to_f(_mm_loadu_si128((const __m128i*)(src + j)), f);
      for (int k = 0; k < 16 / V::W; ++k) V::store(dst + j + k * V::W, V::mul(f[k], d));
    }
  }
  template <class V>
  static void store(uint8_t* dst, const float* src, int64_t D) {
    float amax = 0.0f;
    for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(src[j]));
    const at::Half d = amax / 127.0f;
    const float df = d, inv = df != 0.0f ? 1.0f / df : 0.0f;
    for (int64_t j = 0; j < D; ++j)
      dst[j] = (uint8_t)(int8_t)std::min(127.0f, std::max(-127.0f, std::nearbyint(src[j] * inv)));
    *(at::Half*)(dst + D) = d;
  }
};

struct KvInt4 {
  static constexpr bool kRotated = true, kInPlace = false;
  using Elem = float;
  static bool fits(int64_t D) { return D % 32 == 0; }
  static int64_t row_bytes(int64_t D) { return D / 2 + D / 16; }
  template <class V>
  LOOM_INLINE static void load(const uint8_t* src, int64_t D, float* dst) {
    const __m128i m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const at::Half* sc = (const at::Half*)(src + D / 2);
    typename V::F f[16 / V::W];
    for (int64_t g = 0; g < D / 32; ++g) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(src + 16 * g));
      const typename V::F d = V::set1((float)sc[g]);
      V::i8x16_to_f(_mm_sub_epi8(_mm_and_si128(b, m4), eight), f);
      for (int k = 0; k < 16 / V::W; ++k) V::store(dst + 32 * g + k * V::W, V::mul(f[k], d));
      V::i8x16_to_f(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m4), eight), f);
      for (int k = 0; k < 16 / V::W; ++k) V::store(dst + 32 * g + 16 + k * V::W, V::mul(f[k], d));
    }
  }
  // per 32-group: d = (the element of largest magnitude) / -8, codes round(x / d) in [-8, 7]
  template <class V>
  static void store(uint8_t* dst, const float* src, int64_t D) {
    at::Half* sc = (at::Half*)(dst + D / 2);
    for (int64_t g = 0; g < D / 32; ++g) {
      const float* x = src + 32 * g;
      float mx = 0.0f;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(x[j]) > std::fabs(mx)) mx = x[j];
      const at::Half d = mx / -8.0f;
      const float df = d, inv = df != 0.0f ? 1.0f / df : 0.0f;
      auto code = [&](int j) { return (int)std::min(7.0f, std::max(-8.0f, std::nearbyint(x[j] * inv))) + 8; };
      for (int j = 0; j < 16; ++j) dst[16 * g + j] = (uint8_t)(code(j) | (code(16 + j) << 4));
      sc[g] = d;
    }
  }
};

// store one row of D floats in format C (a quantized format rotates a copy first)
template <class V, class C>
inline void kv_store_row(uint8_t* dst, const float* src, int64_t D) {
  if constexpr (C::kRotated) {
    float tmp[1024];
    std::copy(src, src + D, tmp);
    hadamard(tmp, D);
    C::template store<V>(dst, tmp, D);
  } else {
    C::template store<V>(dst, src, D);
  }
}

// calls f(C{}) with the format of a cache: its dtype, or the quantized format asked for
template <class F>
inline void with_kv_format(const torch::Tensor& cache, int64_t format, F&& f) {
  if (format == KV_INT8) {
    TORCH_CHECK(cache.scalar_type() == torch::kUInt8, "an int8 KV cache is uint8 rows");
    f(KvInt8{});
  } else if (format == KV_INT4) {
    TORCH_CHECK(cache.scalar_type() == torch::kUInt8, "an int4 KV cache is uint8 rows");
    f(KvInt4{});
  } else {
    TORCH_CHECK(format == KV_FLOAT, "kv_format must be 0 (float), 1 (int8) or 2 (int4)");
    if (cache.scalar_type() == torch::kHalf) f(KvPlain<at::Half>{});
    else {
      TORCH_CHECK(cache.scalar_type() == torch::kFloat32, "caches must be float32, float16 or quantized uint8 rows");
      f(KvPlain<float>{});
    }
  }
}

// Where a cache's rows lie. A paged cache is [blocks, Hkv, bs, row]: the bs rows of one kv head
// in one block are contiguous (2 KB of SmolLM2's float16 keys in a 16-slot block), so attention
// reads each (sequence, kv head) as runs the hardware prefetchers follow, not rows a slot's
// other heads apart (1 KB apart at 8 kv heads of 128 floats). A cache [slots, Hkv, row] is the
// same with bs = 1. Slot s is row s % bs of block s / bs.
struct CacheLayout {
  int64_t Hkv, rb, bs, shift;   // rb: bytes a row; shift: log2(bs) where bs is a power of two, else -1
  LOOM_INLINE int64_t offset(int64_t slot, int64_t kh) const {
    const int64_t b = shift >= 0 ? slot >> shift : slot / bs, o = shift >= 0 ? slot & (bs - 1) : slot % bs;
    return ((b * Hkv + kh) * bs + o) * rb;
  }
};

// the layout of a contiguous cache [slots, Hkv, row] or [blocks, Hkv, bs, row] of rb-byte rows
inline CacheLayout cache_layout(const torch::Tensor& cache, int64_t Hkv, int64_t rb) {
  TORCH_CHECK(cache.is_contiguous() && (cache.dim() == 3 || cache.dim() == 4) && cache.size(1) == Hkv,
              "caches must be contiguous [slots, Hkv, row] or [blocks, Hkv, block_size, row]");
  const int64_t bs = cache.dim() == 4 ? cache.size(2) : 1;
  TORCH_CHECK(bs >= 1, "a cache's block size must be at least 1");
  int64_t shift = -1;
  if ((bs & (bs - 1)) == 0)
    for (shift = 0; (int64_t{1} << shift) < bs; ++shift) {}
  return CacheLayout{Hkv, rb, bs, shift};
}

// head size D of a cache [..., last] in format C (last: D values, or a quantized row's bytes)
template <class C>
inline int64_t kv_head_dim(const torch::Tensor& cache) {
  const int64_t last = cache.size(cache.dim() - 1);
  if constexpr (!C::kRotated) return last;
  for (int64_t D = 16; D <= 1024; D += 16)
    if (C::fits(D) && C::row_bytes(D) == last) return D;
  TORCH_CHECK(false, "cache rows of ", last, " bytes match no head size of this format");
  return 0;
}

}  // namespace loom
