// loom's CPU kernels, AVX2 + FMA + F16C variant: the functions of loom_kernels.cpp (AVX-512 +
// VNNI) with the same signatures, semantics and packed weight layout, written for 256-bit
// vectors; loom builds this file on CPUs without AVX-512 VNNI. Read it side by side with
// loom_kernels.cpp: the algorithms and function names are the same, only the vector width differs.
//
// Quantized GEMM, y[M, N] = x[M, K] @ W[N, K]^T
//   W: per output row n and 32-wide group g, unsigned codes q (4 or 8 bits) with an affine
//      map w = a[n,g] * q + b[n,g]. Exact for Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 blocks.
//   x: each row, after an optional fused pre-op (RMSNorm, SwiGLU, GeGLU), is quantized per
//      32-group to int8: x ~ d[m,g] * xq, with the exact float group sum s[m,g] kept.
//   y[m,n] = sum_g a[n,g] * d[m,g] * <q[n,g,:], xq[m,g,:]> + b[n,g] * s[m,g]
//   The integer dot products use VPMADDUBSW (u8 x s8 -> s16 pair sums) then VPMADDWD (s16 ->
//   s32). VPMADDUBSW saturates, so it only ever sees 4-bit values: 4-bit codes directly, 8-bit
//   codes as q = 16 hi + lo, two nibble dot products combined in int32. With nibbles the int16
//   sums over a whole group stay below 8 * 2 * 15 * 127 = 30480, so every dot product is exact.
//   Every row of x is computed the same way whatever M is, so results do not depend on batch
//   composition.
//
// Packed layout: one stream of blocks, each 16 output rows x one 32-wide group:
//   [codes][a: 16 scales][b: 16 offsets], blocks ordered [N/16][G]   (N padded to a multiple of 16)
//   8-bit codes: [8 chunks][16 rows][4 bytes]       chunk c holds k = 4c .. 4c+3          (512 B)
//   4-bit codes: [4 chunks][16 rows][4 bytes]       byte j: low nibble k = 8c+j, high k = 8c+4+j  (256 B)
//   a, b: float16 where that is exact (every type with fp16 block scales), else float32
// A 64-byte chunk is two 256-bit halves: rows 0-7, then rows 8-15.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int ROWS = 16;
constexpr int HALF = 8;    // output rows per 256-bit half of a chunk
constexpr int MT_MAX = 4;  // activation rows per register tile

enum PreOp : int64_t { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2, PRE_GEGLU = 3 };

// ---- vector math --------------------------------------------------------------------------

// v * 2^n for integral n in [-126, 128], as two exact power-of-two steps built in the exponent bits
inline __m256 scale2n(__m256 v, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(v, p1), p2);
}

// exp(x) for 8 floats: 2^(x log2 e) split into 2^n * 2^f, 2^f by a degree-6 polynomial (rel. err ~2e-7).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n);  // in [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return scale2n(p, n);
}

inline __m256 silu256(__m256 g) {
  __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// gelu with the tanh approximation: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi)(g + 0.044715 g^3)
inline __m256 gelu_tanh256(__m256 g) {
  __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// out[r] = sum of v[r]'s 8 lanes, for 8 vectors at once: two rounds of pairwise horizontal adds,
// then the two 128-bit lanes added (9 instructions instead of 8 horizontal sums).
inline __m256 reduce8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// integer lanes [0, n) all ones, the others zero (a mask for maskload / maskstore)
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(n, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// the first min(n, 8) floats at p; masked (slow on some CPUs) only for a partial vector
inline __m256 load_n(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
}
inline void store_n(float* p, __m256 v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes_below(n), v);
}

// integer lanes with lo <= x < hi
inline __m256i in_range(__m256i x, __m256i lo, __m256i hi) {
  return _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, x), _mm256_cmpgt_epi32(hi, x));
}

// ---- activation pre-op + quantization -----------------------------------------------------

// 32 int32 (four vectors) -> 32 int8 with signed saturation, in order
inline __m256i pack_s8(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the per-lane packing
}

// One row: src (K floats, or 2K for the gated pre-ops) -> xq[K] int8, d[G], s[G].
void quantize_row(const float* src, int64_t K, int64_t pre, const float* norm_w, float eps,
                  float* tmp, int8_t* xq, float* d, float* s) {
  const float* x = src;
  if (pre == PRE_RMSNORM) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 v = _mm256_loadu_ps(src + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float r = 1.0f / std::sqrt(hsum(acc) / (float)K + eps);
    __m256 rv = _mm256_set1_ps(r);
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(tmp + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + k), rv), _mm256_loadu_ps(norm_w + k)));
    x = tmp;
  } else if (pre == PRE_SWIGLU || pre == PRE_GEGLU) {
    for (int64_t k = 0; k < K; k += 8) {
      __m256 g = _mm256_loadu_ps(src + k), u = _mm256_loadu_ps(src + K + k);
      __m256 act = pre == PRE_SWIGLU ? silu256(g) : gelu_tanh256(g);
      _mm256_storeu_ps(tmp + k, _mm256_mul_ps(act, u));
    }
    x = tmp;
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / GROUP; ++g) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + g * GROUP + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    float dg = hmax(amax) / 127.0f;
    __m256 inv = _mm256_set1_ps(dg > 0.0f ? 1.0f / dg : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // round to nearest even
    _mm256_storeu_si256((__m256i*)(xq + g * GROUP), pack_s8(q[0], q[1], q[2], q[3]));
    d[g] = dg;
    s[g] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  }
}

struct QuantActs {
  std::vector<int8_t> xq;
  std::vector<float> d, s;
};

void quantize_acts(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t pre, const float* norm_w,
                   float eps, QuantActs& qa) {
  const int64_t G = K / GROUP;
  qa.xq.resize(M * K);
  qa.d.resize(M * G);
  qa.s.resize(M * G);
  at::parallel_for(0, M, M < 16 ? M : 4, [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> tmp;
    tmp.resize(K);
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * ldx, K, pre, norm_w, eps, tmp.data(), qa.xq.data() + m * K,
                   qa.d.data() + m * G, qa.s.data() + m * G);
  });
}

// ---- GEMM micro-kernel: 16 output rows (two halves of 8) x MT activation rows, all groups ---

// 8 values as float32, from float32 or float16 storage (scales, the KV cache)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <int BITS, typename S>
constexpr int64_t block_bytes() { return (BITS == 4 ? 256 : 512) + 2 * ROWS * sizeof(S); }

// The 8 nibble vectors of one half (rows 8h .. 8h+7) of a block; code[j] pairs with input
// dword j (k = 4j .. 4j+3). 4-bit codes: both nibbles of the 4 chunks. 8-bit codes: one
// nibble (HIGH or not) of the 8 chunks.
template <int BITS, bool HIGH>
inline void nibbles(const uint8_t* wp, int h, __m256i* code) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (BITS == 4) {
    for (int c = 0; c < 4; ++c) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(wp + c * 64 + h * 32));
      code[2 * c] = _mm256_and_si256(v, low);
      code[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  } else {
    for (int c = 0; c < 8; ++c) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(wp + c * 64 + h * 32));
      code[c] = _mm256_and_si256(HIGH ? _mm256_srli_epi16(v, 4) : v, low);
    }
  }
}

// Per row of the half: <code, x> over the group as int32 pair sums times `weight` (1, or 16 for
// high nibbles). The int16 partial sums stay below 30480: no saturation.
inline __m256i nibble_dot(const __m256i* code, const int32_t* xp, __m256i weight) {
  __m256i s0 = _mm256_maddubs_epi16(code[0], _mm256_set1_epi32(xp[0]));
  __m256i s1 = _mm256_maddubs_epi16(code[1], _mm256_set1_epi32(xp[1]));
  for (int c = 2; c < 8; c += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(code[c], _mm256_set1_epi32(xp[c])));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(code[c + 1], _mm256_set1_epi32(xp[c + 1])));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), weight);
}

// y[0:n] (+)= the 16 values lo | hi; n < 16 only in the last block of a matrix whose N is not a multiple of 16
inline void store_rows(float* yp, __m256 lo, __m256 hi, int64_t n, bool accumulate) {
  if (n >= ROWS) {
    if (accumulate) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(yp));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(yp + HALF));
    }
    _mm256_storeu_ps(yp, lo);
    _mm256_storeu_ps(yp + HALF, hi);
    return;
  }
  float v[ROWS];
  _mm256_storeu_ps(v, lo);
  _mm256_storeu_ps(v + HALF, hi);
  for (int64_t j = 0; j < n; ++j) yp[j] = accumulate ? yp[j] + v[j] : v[j];
}

// acc[i] = rows 8h .. 8h+7 of a block column times activation row m0 + i, over all G groups.
// One pass per half: 8 code vectors and MT accumulators fit the 16 registers.
template <int BITS, int MT, typename S>
inline void half_tile(const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, int h, __m256* acc) {
  constexpr int64_t CODE_BYTES = BITS == 4 ? 256 : 512, BLOCK = block_bytes<BITS, S>();
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * BLOCK;
    if (h == 0)
      for (int64_t off = 0; off < BLOCK; off += 64) _mm_prefetch((const char*)(wp + 4 * BLOCK + off), _MM_HINT_T0);
    auto xp = [&](int i) { return (const int32_t*)(qa.xq.data() + (m0 + i) * K + g * GROUP); };
    __m256i code[8], dot[MT];
    nibbles<BITS, false>(wp, h, code);
    for (int i = 0; i < MT; ++i) dot[i] = nibble_dot(code, xp(i), one);
    if constexpr (BITS == 8) {  // q = 16 hi + lo
      nibbles<BITS, true>(wp, h, code);
      for (int i = 0; i < MT; ++i) dot[i] = _mm256_add_epi32(dot[i], nibble_dot(code, xp(i), sixteen));
    }
    const S* sc = (const S*)(wp + CODE_BYTES);
    const __m256 av = load8(sc + h * HALF), bv = load8(sc + ROWS + h * HALF);
    for (int i = 0; i < MT; ++i) {
      const int64_t gi = (m0 + i) * G + g;
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(av, _mm256_set1_ps(qa.d[gi])), acc[i]);
      acc[i] = _mm256_fmadd_ps(bv, _mm256_set1_ps(qa.s[gi]), acc[i]);
    }
  }
}

template <int BITS, int MT, typename S>
inline void tile(const uint8_t* w, int64_t G, const QuantActs& qa,
                 int64_t K, int64_t m0, float* y, int64_t ldy, int64_t n0, int64_t N, bool accumulate) {
  __m256 lo[MT], hi[MT];
  half_tile<BITS, MT, S>(w, G, qa, K, m0, 0, lo);
  half_tile<BITS, MT, S>(w, G, qa, K, m0, 1, hi);
  for (int i = 0; i < MT; ++i) store_rows(y + (m0 + i) * ldy + n0, lo[i], hi[i], N - n0, accumulate);
}

template <int BITS, typename S>
void gemm(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
          bool accumulate) {
  const int64_t G = K / GROUP, NB = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* wb = w + nb * G * block_bytes<BITS, S>();
      for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
        switch (std::min<int64_t>(MT_MAX, M - m0)) {
#define LOOM_TILE(mt) case mt: tile<BITS, mt, S>(wb, G, qa, K, m0, y, ldy, nb * ROWS, N, accumulate); break;
          LOOM_TILE(1) LOOM_TILE(2) LOOM_TILE(3) LOOM_TILE(4)
#undef LOOM_TILE
        }
      }
    }
  });
}

}  // namespace

template <typename C>
void store_row(C* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
}

#include "loom_kernels_host.h"   // check_f32_rows, qgemm, rope_store

// Attention over the paged cache, one query token per row. Row r has the key slots
// slots[r, :ctx[r]] (its context in position order); with window W it sees only the last W.
// Rows come in groups (a sequence's new tokens): the rows of group g agree on their first
// shared[g] slots, whose keys and values are converted to float once per (group, kv head)
// and used by every query head of every row in the group; each row's keys past the shared
// part (its own draft or chunk tokens, a few) are handled one by one.
//
//   scores   p[i, :] for query i = (row, head): shared keys [lo, P) then the row's tail keys
//   softmax  over the row's visible keys (window), zero elsewhere
//   output   sum over keys of p * v, the shared part 16 keys at a time from a float buffer

constexpr int KB = 16;  // shared keys converted to float at a time
constexpr int PV_NJ = 4, PV_QT = 2;  // value tile: PV_QT queries x PV_NJ vectors of columns

template <typename C>
inline void to_float(const C* src, float* dst, int64_t D) {
  for (int64_t j = 0; j < D; j += 8) _mm256_storeu_ps(dst + j, load8(src + j));
}

// 8 scores <q, k_r> for the keys in buf (rows of D floats); NV = D / 8 when fixed, else 0
template <int NV, bool FULL>
inline __m256 qk8(const float* qh, const float* buf, int64_t Drt, int64_t mm) {
  const int64_t D = NV > 0 ? 8 * NV : Drt, nv = D / 8;
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nv; ++j) {
    const __m256 qj = _mm256_loadu_ps(qh + 8 * j);
    for (int r = 0; r < 8; ++r)
      if (FULL || r < mm) acc[r] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(buf + r * D + 8 * j), acc[r]);
  }
  return reduce8(acc);
}

// out[t][8 j0 .. 8 (j0 + NJ)) += sum_r w[t][r] * buf[r][same columns] for QT queries (weights
// p + t * stride), mm value rows of D floats
template <int NJ, int QT>
inline void pv_tile(float* const* out, const float* p, int64_t stride, const float* buf, int64_t D, int64_t j0,
                    int64_t mm) {
  __m256 acc[QT][NJ];
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) acc[t][j] = _mm256_loadu_ps(out[t] + 8 * (j0 + j));
  for (int64_t r = 0; r < mm; ++r) {
    const float* vr = buf + r * D + 8 * j0;
    for (int t = 0; t < QT; ++t) {
      const __m256 w = _mm256_set1_ps(p[t * stride + r]);
      for (int j = 0; j < NJ; ++j) acc[t][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * j), acc[t][j]);
    }
  }
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(out[t] + 8 * (j0 + j), acc[t][j]);
}

// whether any of the queries i0 .. i0 + n - 1 (G per row, row contexts cl) has keys at or past t
inline bool any_reaches(const int64_t* cl, int64_t G, int64_t i0, int64_t n, int64_t t) {
  for (int64_t i = i0; i < i0 + n; ++i)
    if (cl[i / G] > t) return true;
  return false;
}

template <typename C, int NV>
void attn_impl(const float* qb, int64_t ldq, const C* kc, const C* vc, const int64_t* sl, int64_t lds,
               const int64_t* cl, const int64_t* gs, const int64_t* sh, int64_t NG, int64_t H, int64_t Hkv,
               int64_t Drt, float scale, int64_t window, float* ob) {
  const int64_t G = H / Hkv, D = NV > 0 ? 8 * NV : Drt;
  int64_t work_total = 0;
  for (int64_t g = 0; g < NG; ++g) {
    const int64_t L = sh[g] + 1;
    work_total += (gs[g + 1] - gs[g]) * G * D * (window > 0 ? std::min(L, window) : L);
  }
  const int64_t per_item = std::max<int64_t>(1, work_total / std::max<int64_t>(1, NG * Hkv));
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / per_item);  // small batches stay on one thread
  at::parallel_for(0, NG * Hkv, grain, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> p, buf;
    thread_local std::vector<int64_t> first;
    thread_local std::vector<const float*> qps;
    thread_local std::vector<float*> ops;
    buf.resize(KB * D);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t grp = work / Hkv, kh = work % Hkv, r0 = gs[grp], nr = gs[grp + 1] - r0, m = nr * G;
      const int64_t P = sh[grp];
      first.resize(nr);
      qps.resize(m);
      ops.resize(m);
      int64_t lo = P, maxtail = 0;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t L = cl[r0 + r];
        first[r] = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        lo = std::min(lo, first[r]);
        maxtail = std::max(maxtail, L - P);
        for (int64_t g = 0; g < G; ++g) {
          qps[r * G + g] = qb + (r0 + r) * ldq + (kh * G + g) * D;
          ops[r * G + g] = ob + (r0 + r) * H * D + (kh * G + g) * D;
        }
      }
      lo -= lo % KB;   // key t always sits in lane t % 8 of the sums below, whatever the grouping
      const int64_t Ls = P - lo, stride = Ls + maxtail;
      p.resize(m * stride);
      float* pd = p.data();
      const int64_t* shared_slots = sl + r0 * lds + lo;
      const __m256 sv = _mm256_set1_ps(scale);
      // scores over KB keys in buf (mm of them) for query qh, into dst
      auto score_tile = [&](const float* qh, int64_t mm, float* dst) {
        for (int64_t h = 0; h < mm; h += 8) {
          const float* kb = buf.data() + h * D;
          const __m256 sc = mm - h >= 8 ? qk8<NV, true>(qh, kb, D, 8) : qk8<NV, false>(qh, kb, D, mm - h);
          store_n(dst + h, _mm256_mul_ps(sc, sv), mm - h);
        }
      };
      // scores over the shared keys, KB at a time, 8 per vector (a row's keys past its own context are skipped)
      for (int64_t l0 = 0; l0 < Ls; l0 += KB) {
        const int64_t mm = std::min<int64_t>(KB, Ls - l0);
        for (int64_t r = 0; r < mm; ++r) to_float(kc + (shared_slots[l0 + r] * Hkv + kh) * D, buf.data() + r * D, D);
        for (int64_t i = 0; i < m; ++i)
          if (cl[r0 + i / G] > lo + l0) score_tile(qps[i], mm, pd + i * stride + l0);
      }
      // each row's own keys past the shared part, KB at a time through the same dot product, so a
      // key's score has the same bits whether it is shared or a row's own
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = r0 + r, L = cl[row];
        for (int64_t t0 = std::max<int64_t>(P, first[r]); t0 < L; t0 += KB) {
          const int64_t mm = std::min<int64_t>(KB, L - t0);
          for (int64_t j = 0; j < mm; ++j) to_float(kc + (sl[row * lds + t0 + j] * Hkv + kh) * D, buf.data() + j * D, D);
          for (int64_t g = 0; g < G; ++g) score_tile(qps[r * G + g], mm, pd + (r * G + g) * stride + Ls + t0 - P);
        }
      }
      // softmax over each query's visible keys
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = i / G, L = cl[r0 + r];
        float* pi = pd + i * stride;
        // visible: [a0, a1) of the shared part, [b0, b1) of the tail (both end by stride)
        const __m256i a0 = _mm256_set1_epi32((int)(std::min(first[r], P) - lo));
        const __m256i a1 = _mm256_set1_epi32((int)(std::min(L, P) - lo));
        const __m256i b0 = _mm256_set1_epi32((int)(Ls + std::max<int64_t>(0, first[r] - P)));
        const __m256i b1 = _mm256_set1_epi32((int)(Ls + L - P));
        auto visible = [&](int64_t l) -> __m256i {
          const __m256i x = _mm256_add_epi32(iota, _mm256_set1_epi32((int)l));
          return _mm256_or_si256(in_range(x, a0, a1), in_range(x, b0, b1));
        };
        __m256 mxv = _mm256_set1_ps(-INFINITY);
        for (int64_t l = 0; l < stride; l += 8) {
          const __m256 v = load_n(pi + l, stride - l);
          mxv = _mm256_blendv_ps(mxv, _mm256_max_ps(mxv, v), _mm256_castsi256_ps(visible(l)));
        }
        const __m256 mv = _mm256_set1_ps(hmax(mxv));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t l = 0; l < stride; l += 8) {   // exp over the visible keys, 0 elsewhere
          const __m256 x = _mm256_sub_ps(load_n(pi + l, stride - l), mv);
          const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(visible(l)), exp256(x));
          store_n(pi + l, e, stride - l);
          sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
        for (int64_t l = 0; l < stride; l += 8)
          store_n(pi + l, _mm256_mul_ps(load_n(pi + l, stride - l), inv), stride - l);
        std::fill(ops[i], ops[i] + D, 0.0f);
      }
      // values of the shared keys, KB at a time, into every query's output
      for (int64_t l0 = 0; l0 < Ls; l0 += KB) {
        const int64_t mm = std::min<int64_t>(KB, Ls - l0);
        for (int64_t r = 0; r < mm; ++r) to_float(vc + (shared_slots[l0 + r] * Hkv + kh) * D, buf.data() + r * D, D);
        if constexpr (NV > 0) {
          static_assert(NV % PV_NJ == 0, "fixed head sizes are whole value tiles");
          int64_t i0 = 0;
          for (; i0 + PV_QT <= m; i0 += PV_QT)
            if (any_reaches(cl + r0, G, i0, PV_QT, lo + l0))   // all-zero weights would add nothing
              for (int64_t j0 = 0; j0 < NV; j0 += PV_NJ)
                pv_tile<PV_NJ, PV_QT>(ops.data() + i0, pd + i0 * stride + l0, stride, buf.data(), D, j0, mm);
          for (; i0 < m; ++i0)
            if (cl[r0 + i0 / G] > lo + l0)
              for (int64_t j0 = 0; j0 < NV; j0 += PV_NJ)
                pv_tile<PV_NJ, 1>(ops.data() + i0, pd + i0 * stride + l0, stride, buf.data(), D, j0, mm);
        } else {
          for (int64_t i = 0; i < m; ++i) {
            if (cl[r0 + i / G] <= lo + l0) continue;
            float* oh = ops[i];
            for (int64_t r = 0; r < mm; ++r) {
              const __m256 w = _mm256_set1_ps(pd[i * stride + l0 + r]);
              for (int64_t j = 0; j < D; j += 8)
                _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(w, _mm256_loadu_ps(buf.data() + r * D + j), _mm256_loadu_ps(oh + j)));
            }
          }
        }
      }
      // values of each row's own keys
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = i / G, row = r0 + r, L = cl[row];
        float* oh = ops[i];
        const float* pi = pd + i * stride;
        for (int64_t t = std::max<int64_t>(P, first[r]); t < L; ++t) {
          const C* vp = vc + (sl[row * lds + t] * Hkv + kh) * D;
          const __m256 w = _mm256_set1_ps(pi[Ls + t - P]);
          for (int64_t j = 0; j < D; j += 8)
            _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(w, load8(vp + j), _mm256_loadu_ps(oh + j)));
        }
      }
    }
  });
}

// q [R, >= H*D] float32 rows; slots [R, Lmax] int64; ctx [R]; groups [NG + 1] row starts and
// shared [NG] (see above), or both empty: every row its own group sharing its whole context.
torch::Tensor attn_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                          torch::Tensor ctx, int64_t H, int64_t Hkv, double scale, int64_t window,
                          c10::optional<torch::Tensor> groups, c10::optional<torch::Tensor> shared) {
  check_f32_rows(q, "q");
  const int64_t R = q.size(0), D = k_cache.size(2);
  TORCH_CHECK(q.size(1) >= H * D && D % 16 == 0 && H % Hkv == 0, "q must hold H * D values per row, D a multiple of 16");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous and of one dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.size(0) == R && slots.stride(1) == 1,
              "slots must be an int64 [rows, L] tensor");
  torch::Tensor cl_t = ctx.contiguous();
  TORCH_CHECK(cl_t.scalar_type() == torch::kInt64 && cl_t.numel() == R, "ctx must hold one int64 per row");
  torch::Tensor gs_t, sh_t;
  if (groups.has_value() && shared.has_value()) {
    gs_t = groups->contiguous();
    sh_t = shared->contiguous();
  } else {
    gs_t = torch::arange(R + 1, torch::kInt64);
    sh_t = cl_t;
  }
  const int64_t NG = sh_t.numel();
  TORCH_CHECK(gs_t.numel() == NG + 1 && gs_t.scalar_type() == torch::kInt64 && sh_t.scalar_type() == torch::kInt64,
              "groups must hold NG + 1 row starts and shared NG lengths");
  torch::Tensor out = torch::empty({R, H * D}, q.options());
  if (R == 0) return out;
  const int64_t *sl = slots.data_ptr<int64_t>(), *cl = cl_t.data_ptr<int64_t>(), *gs = gs_t.data_ptr<int64_t>(),
                *sh = sh_t.data_ptr<int64_t>();
  const bool half = k_cache.scalar_type() == torch::kHalf;
  TORCH_CHECK(half || k_cache.scalar_type() == torch::kFloat32, "caches must be float32 or float16");
  auto run = [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    if (half)
      attn_impl<at::Half, NV>(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<at::Half>(),
                              v_cache.data_ptr<at::Half>(), sl, slots.stride(0), cl, gs, sh, NG, H, Hkv, D,
                              (float)scale, window, out.data_ptr<float>());
    else
      attn_impl<float, NV>(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                           sl, slots.stride(0), cl, gs, sh, NG, H, Hkv, D, (float)scale, window,
                           out.data_ptr<float>());
  };
  switch (D) {  // unrolled fast paths for the common head sizes, a generic loop otherwise
    case 64: run(std::integral_constant<int, 8>{}); break;
    case 128: run(std::integral_constant<int, 16>{}); break;
    case 256: run(std::integral_constant<int, 32>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
  return out;
}

void add_rmsnorm(torch::Tensor h, torch::Tensor y, torch::Tensor w, double eps) {
  check_f32_rows(h, "h");
  check_f32_rows(y, "y");
  const int64_t M = h.size(0), K = h.size(1);
  TORCH_CHECK(K % 16 == 0 && y.size(1) == K && w.numel() == K, "shapes differ");
  float *hb = h.data_ptr<float>();
  const float *yb = y.data_ptr<float>(), *wb = w.data_ptr<float>();
  at::parallel_for(0, M, M < 16 ? M : 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* yr = yb + m * y.stride(0);
      float* hr = hb + m * h.stride(0);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_loadu_ps(yr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)K + (float)eps));
      for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(hr + k, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(yr + k), r),
                                                 _mm256_loadu_ps(wb + k), _mm256_loadu_ps(hr + k)));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemm", &qgemm, "quantized GEMM with fused activation pre-op");
  m.def("rope_store", &rope_store, "per-head norm + RoPE of q/k in place, store k/v in the cache");
  m.def("attn_decode", &attn_decode, "attention of query rows over the paged KV cache", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("ctx"), py::arg("H"), py::arg("Hkv"),
        py::arg("scale"), py::arg("window"), py::arg("groups") = py::none(), py::arg("shared") = py::none());
  m.def("add_rmsnorm", &add_rmsnorm, "h += rmsnorm(y) * w");
}
