// Vector traits for loom's kernels: one struct per instruction set with the same static
// members, so each loop in loom_kernels_loops.h is written once over `V` (as ggml's SIMD
// mappings do). A variant's source picks its struct at compile time and adds the one thing
// that is not a renaming: the integer dot products of the quantized GEMM (`dots`).
//
//   W              float lanes per vector (16 or 8)
//   MT_MAX, PV_ACC register tile sizes for 32 or 16 vector registers
//   F, I, Mask     float vector, integer vector, lane mask
//   load / store   16 or 8 floats from/to float32 or float16 storage
//   stream         a store past the caches (non-temporal; p aligned to the vector's size)
//   load_n/store_n the first n lanes only (n < W only at the end of a row)
//   reduce(v)      out[r] = sum of v[r]'s lanes, for W vectors at once
//   in_ranges      lanes l + j inside [a0, a1) or [b0, b1)
//   store_s8       GROUP scaled floats -> int8 (round to nearest even, saturate); returns
//                  the sum of the int8 codes (the GEMM's offset term uses it)
//   i8x16_to_f     16 int8 lanes of an SSE register -> 16 / W float vectors (quantized KV rows)
//   load_u8        W uint8 -> W floats (the output layer's codes, recomputed exactly)
//   gt_bits        bit l set where lane l of a > lane l of b
//   nlt_bits       bit l set where lane l of a is not below b's (a >= b, or either is NaN)
//   ge, select     lanes where a >= b (false for NaN); a where the mask is set, else b
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace loom {

#define LOOM_INLINE inline __attribute__((always_inline))   // inner loops: inlined whatever the heuristics say

constexpr int GROUP = 32;   // inputs per quantization group
constexpr int ROWS = 16;    // output rows per packed block

// The members whose intrinsics differ only in their prefix (_mm512 or _mm256), and the
// partial loads and stores over each struct's masked ones (load_part, store_part).
#define LOOM_FLOAT_OPS(P)                                                                            \
  static F zero() { return P##_setzero_ps(); }                                                       \
  static F set1(float x) { return P##_set1_ps(x); }                                                  \
  static F load(const float* p) { return P##_loadu_ps(p); }                                          \
  static void store(float* p, F v) { P##_storeu_ps(p, v); }                                          \
  static void stream(float* p, F v) { P##_stream_ps(p, v); }                                         \
  static F load_n(const float* p, int64_t n) { return n >= W ? load(p) : load_part(p, n); }          \
  static void store_n(float* p, F v, int64_t n) {                                                    \
    if (n >= W) store(p, v);                                                                         \
    else store_part(p, v, n);                                                                        \
  }                                                                                                  \
  static F add(F a, F b) { return P##_add_ps(a, b); }                                                \
  static F sub(F a, F b) { return P##_sub_ps(a, b); }                                                \
  static F mul(F a, F b) { return P##_mul_ps(a, b); }                                                \
  static F div(F a, F b) { return P##_div_ps(a, b); }                                                \
  static F fma(F a, F b, F c) { return P##_fmadd_ps(a, b, c); } /* a * b + c */                     \
  static F max(F a, F b) { return P##_max_ps(a, b); }                                                \
  static F min(F a, F b) { return P##_min_ps(a, b); }                                                \
  static F abs(F v) { return P##_andnot_ps(P##_set1_ps(-0.0f), v); }                                \
  static F cvt(I v) { return P##_cvtepi32_ps(v); }

#if defined(__AVX512F__)
struct Vec512 {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;
  static constexpr int MT_MAX = 8;                  // activation rows per GEMM register tile
  static constexpr int PV_ACC = 16;                 // accumulators of a value tile (attention's PV)
  static constexpr bool kAmx = false;              // AMX tiles (an Isa that has them says so)
  static constexpr bool tiles_on = false;
  static constexpr int AMX_ROWS = 16;
  static bool amx_rows(int64_t, int) { return false; }   // whether a GEMM of M rows runs AMX tiles: never here
  static void tiles_begin(int64_t) {}
  static void tiles_end() {}

  LOOM_FLOAT_OPS(_mm512)
  static F load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store(at::Half* p, F v) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Mask first(int64_t n) { return n >= W ? (Mask)0xFFFF : (Mask)((1u << n) - 1); }
  static F load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_part(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2n(F v, F n) { return _mm512_scalef_ps(v, n); }   // v * 2^n, n integral
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }

  // four rounds of pairwise lane sums (lanes j and j + 8, then j + 4, j + 2, j + 1 of each
  // vector), then one permute into vector order: 31 shuffles and 15 additions instead of 16
  // horizontal sums. The first two rounds move whole 128-bit blocks (VSHUFF32X4) and the last two
  // shuffle within them (VSHUFPS): 14.7 ns a tree on Zen 4, against 17-29 ns with two-source lane
  // permutes (VPERMT2PS) adding the same pairs in the same tree, so the same bits.
  static F reduce(const F* v) {
    F a[8], b[4], c[2];
    for (int k = 0; k < 8; ++k)   // a[k]: lanes 0-7 from v[2k] (j + (j + 8)), 8-15 from v[2k + 1]
      a[k] = add(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; ++k)   // b[k]: 4 lanes from each of v[4k .. 4k + 3]
      b[k] = add(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                 _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; ++k)   // c[k]: 2 lanes a vector, within each 128-bit block
      c[k] = add(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const F d = add(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),   // lane 4 (r % 4) + r / 4: v[r]'s sum
                    _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
  }

  static Mask in_ranges(int64_t l, int a0, int a1, int b0, int b1) {
    const I x = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                 _mm512_set1_epi32((int)l));
    return (_mm512_cmpge_epi32_mask(x, _mm512_set1_epi32(a0)) & _mm512_cmplt_epi32_mask(x, _mm512_set1_epi32(a1))) |
           (_mm512_cmpge_epi32_mask(x, _mm512_set1_epi32(b0)) & _mm512_cmplt_epi32_mask(x, _mm512_set1_epi32(b1)));
  }
  static F max_where(Mask m, F acc, F v) { return _mm512_mask_max_ps(acc, m, acc, v); }
  static F keep(Mask m, F v) { return _mm512_maskz_mov_ps(m, v); }   // v where m, else 0
  static void i8x16_to_f(__m128i x, F* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)); }
  static F load_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
  static uint32_t gt_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static uint32_t nlt_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
  static Mask ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static F select(Mask m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }

  static I set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
  static I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
#if defined(__AVX512VNNI__)
  static I dpbusd(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }   // acc + <u8, s8> per 4 bytes
#endif

  static int32_t store_s8(int8_t* dst, const F* v) {
    const __m512i q0 = _mm512_cvtps_epi32(v[0]), q1 = _mm512_cvtps_epi32(v[1]);
    _mm_storeu_si128((__m128i*)dst, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(dst + 16), _mm512_cvtsepi32_epi8(q1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));   // |q| <= 127: no saturation to account for
  }
};
#endif

struct Vec256 {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  using Mask = __m256;   // all-ones lanes
  static constexpr int MT_MAX = 4;
  static constexpr int PV_ACC = 8;
  static constexpr bool kAmx = false;              // AMX tiles (an Isa that has them says so)
  static constexpr bool tiles_on = false;
  static constexpr int AMX_ROWS = 16;
  static bool amx_rows(int64_t, int) { return false; }   // whether a GEMM of M rows runs AMX tiles: never here
  static void tiles_begin(int64_t) {}
  static void tiles_end() {}

  LOOM_FLOAT_OPS(_mm256)
  static F load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static void store(at::Half* p, F v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static I first(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(n, W)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // masked loads and stores are slow on some CPUs: only for a partial vector
  static F load_part(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_part(float* p, F v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }
  static F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // two exact power-of-two steps built in the exponent bits (n in [-126, 128])
  static F scale2n(F v, F n) {
    const I ni = _mm256_cvtps_epi32(n);
    const I n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const I bias = _mm256_set1_epi32(127);
    const F p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const F p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return mul(mul(v, p1), p2);
  }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }

  // two rounds of pairwise horizontal adds, then the two 128-bit lanes added (9 instructions)
  static F reduce(const F* v) {
    const F a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const F a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const F b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return add(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }

  static Mask in_ranges(int64_t l, int a0, int a1, int b0, int b1) {
    const I x = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)l));
    auto in = [&](int lo, int hi) {   // lo <= x < hi
      return _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), x), _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), x));
    };
    return _mm256_castsi256_ps(_mm256_or_si256(in(a0, a1), in(b0, b1)));
  }
  static F max_where(Mask m, F acc, F v) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, v), m); }
  static F keep(Mask m, F v) { return _mm256_and_ps(m, v); }
  static void i8x16_to_f(__m128i x, F* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
  }
  static F load_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
  static uint32_t gt_bits(F a, F b) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static uint32_t nlt_bits(F a, F b) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NLT_UQ)); }
  static Mask ge(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static F select(Mask m, F a, F b) { return _mm256_blendv_ps(b, a, m); }

  // 32 int8 codes in order (the per-lane packing undone); returns their sum
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
  static I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
#if defined(__AVXVNNI__)
  static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }   // acc + <u8, s8> per 4 bytes
#endif

  static int32_t store_s8(int8_t* dst, const F* v) {
    const I b = _mm256_packs_epi16(_mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1])),
                                   _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3])));
    const I q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)dst, q);
    const I s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  }
};

// 5-bit codes: plane byte (row, j) holds in bit c the fifth bit of code(4c + j), the code that
// pairs with input dword c. fifth_bit(plane, c): that bit moved to bit 4 of each byte, to be
// OR-ed onto the low four bits (16-bit lane shifts move no bit across a byte before the mask).
LOOM_INLINE __m256i fifth_bit(__m256i plane, int c) {
  const __m256i v = c <= 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - c)) : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(c - 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}
#if defined(__AVX512BW__)
LOOM_INLINE __m512i fifth_bit(__m512i plane, int c) {
  const __m512i v = c <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - c)) : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(c - 4));
  return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
}
#endif

// ---- vector math over any V -----------------------------------------------------------------

// The VNNI dot products of one 32-group for MT activation rows, given its 8 code vectors (code[c]
// pairs with input dword c): dot[i] = sum_c VPDPBUSD(code[c], row i's dword c), started at xs[i]
// (the zero point's term) where Z is set. One chain per row from 4 rows (the rows' chains hide
// each other's latency), two per row below that, added at the end. V needs dpbusd (AVX-512 VNNI,
// or AVX-VNNI on 256 bits).
template <class V, int MT, int Z>
LOOM_INLINE void vnni_rows(const typename V::I* code, const int32_t* xp, const int32_t* xs, typename V::I* dot) {
  using I = typename V::I;
  for (int i = 0; i < MT; ++i) {
    const I init = V::set1_i32(Z ? xs[i] : 0);   // -Z sum(xq)
    if constexpr (MT >= 4) {
      I s = init;
      for (int c = 0; c < 8; ++c) s = V::dpbusd(s, code[c], V::set1_i32(xp[8 * i + c]));
      dot[i] = s;
    } else {
      I s0 = V::dpbusd(init, code[0], V::set1_i32(xp[8 * i]));
      I s1 = V::dpbusd(V::set1_i32(0), code[1], V::set1_i32(xp[8 * i + 1]));
      for (int c = 2; c < 8; c += 2) {
        s0 = V::dpbusd(s0, code[c], V::set1_i32(xp[8 * i + c]));
        s1 = V::dpbusd(s1, code[c + 1], V::set1_i32(xp[8 * i + c + 1]));
      }
      dot[i] = V::add_i32(s0, s1);
    }
  }
}

// exp(x): 2^(x log2 e) split into 2^n * 2^f, 2^f by a degree-6 polynomial (rel. err ~2e-7).
template <class V>
inline typename V::F vexp(typename V::F x) {
  x = V::max(V::min(x, V::set1(88.3762626647949f)), V::set1(-87.3365447504f));
  const typename V::F t = V::mul(x, V::set1(1.44269504088896341f)), n = V::round(t);
  const typename V::F f = V::sub(t, n);  // in [-0.5, 0.5]
  typename V::F p = V::set1(1.535336188319500e-4f);
  p = V::fma(p, f, V::set1(1.339887440266574e-3f));
  p = V::fma(p, f, V::set1(9.618437357674640e-3f));
  p = V::fma(p, f, V::set1(5.550332471162809e-2f));
  p = V::fma(p, f, V::set1(2.402264791363012e-1f));
  p = V::fma(p, f, V::set1(6.931472028550421e-1f));
  p = V::fma(p, f, V::set1(1.0f));
  return V::scale2n(p, n);
}

template <class V>
inline typename V::F silu(typename V::F g) {
  return V::div(g, V::add(V::set1(1.0f), vexp<V>(V::sub(V::zero(), g))));
}

// gelu with the tanh approximation: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi)(g + 0.044715 g^3)
template <class V>
inline typename V::F gelu_tanh(typename V::F g) {
  const typename V::F g3 = V::mul(V::mul(g, g), g);
  const typename V::F u = V::mul(V::set1(0.7978845608028654f), V::fma(V::set1(0.044715f), g3, g));
  return V::div(g, V::add(V::set1(1.0f), vexp<V>(V::mul(V::set1(-2.0f), u))));
}

}  // namespace loom
