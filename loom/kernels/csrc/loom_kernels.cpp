// loom's CPU kernels (AVX-512 + VNNI): quantized GEMM over GGUF-derived codes, RoPE with
// KV-cache store, and decode attention over the paged cache. Compiled at install time with
// -march=native; loom falls back to plain torch ops where this cannot be built.
//
// Quantized GEMM, y[M, N] = x[M, K] @ W[N, K]^T
//   W: per output row n and 32-wide group g, unsigned codes q (4 or 8 bits) with an affine
//      map w = a[n,g] * q + b[n,g]. Exact for Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 blocks.
//   x: each row, after an optional fused pre-op (RMSNorm, SwiGLU, GeGLU), is quantized per
//      32-group to int8: x ~ d[m,g] * xq, with the exact float group sum s[m,g] kept.
//   y[m,n] = sum_g a[n,g] * d[m,g] * <q[n,g,:], xq[m,g,:]> + b[n,g] * s[m,g]
//   The integer dot products use VPDPBUSD (u8 x s8 -> s32): one instruction covers 16 output
//   rows x 4 inputs. Every row of x is computed the same way whatever M is, so results do
//   not depend on batch composition.
//
// Packed layout: one stream of blocks, each 16 output rows x one 32-wide group:
//   [codes][a: 16 scales][b: 16 offsets], blocks ordered [N/16][G]   (N padded to a multiple of 16)
//   8-bit codes: [8 chunks][16 rows][4 bytes]       chunk c holds k = 4c .. 4c+3          (512 B)
//   4-bit codes: [4 chunks][16 rows][4 bytes]       byte j: low nibble k = 8c+j, high k = 8c+4+j  (256 B)
//   a, b: float16 where that is exact (every type with fp16 block scales), else float32

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int ROWS = 16;
constexpr int MT_MAX = 8;  // activation rows per register tile

enum PreOp : int64_t { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2, PRE_GEGLU = 3 };

// ---- vector math --------------------------------------------------------------------------

// exp(x) for 16 floats: 2^(x log2 e) split into 2^n * 2^f, 2^f by a degree-6 polynomial (rel. err ~2e-7).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 silu512(__m512 g) {
  __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// gelu with the tanh approximation: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi)(g + 0.044715 g^3)
inline __m512 gelu_tanh512(__m512 g) {
  __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// out[r] = sum of v[r]'s 16 lanes, for 16 vectors at once: four rounds of pairwise lane shuffles
// (45 instructions instead of 16 horizontal sums).
inline __m512 reduce16(const __m512* v) {
  const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i hi2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i lo1 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i hi1 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * k], lo8, v[2 * k + 1]),
                         _mm512_permutex2var_ps(v[2 * k], hi8, v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * k], lo4, a[2 * k + 1]),
                         _mm512_permutex2var_ps(a[2 * k], hi4, a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * k], lo2, b[2 * k + 1]),
                         _mm512_permutex2var_ps(b[2 * k], hi2, b[2 * k + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(c[0], lo1, c[1]), _mm512_permutex2var_ps(c[0], hi1, c[1]));
}

// ---- activation pre-op + quantization -----------------------------------------------------

// One row: src (K floats, or 2K for the gated pre-ops) -> xq[K] int8, d[G], s[G].
void quantize_row(const float* src, int64_t K, int64_t pre, const float* norm_w, float eps,
                  float* tmp, int8_t* xq, float* d, float* s) {
  const float* x = src;
  if (pre == PRE_RMSNORM) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 v = _mm512_loadu_ps(src + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float r = 1.0f / std::sqrt(hsum(acc) / (float)K + eps);
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t k = 0; k < K; k += 16)
      _mm512_storeu_ps(tmp + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(src + k), rv), _mm512_loadu_ps(norm_w + k)));
    x = tmp;
  } else if (pre == PRE_SWIGLU || pre == PRE_GEGLU) {
    for (int64_t k = 0; k < K; k += 16) {
      __m512 g = _mm512_loadu_ps(src + k), u = _mm512_loadu_ps(src + K + k);
      __m512 act = pre == PRE_SWIGLU ? silu512(g) : gelu_tanh512(g);
      _mm512_storeu_ps(tmp + k, _mm512_mul_ps(act, u));
    }
    x = tmp;
  }
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / GROUP; ++g) {
    __m512 v0 = _mm512_loadu_ps(x + g * GROUP), v1 = _mm512_loadu_ps(x + g * GROUP + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    float dg = amax / 127.0f;
    __m512 inv = _mm512_set1_ps(dg > 0.0f ? 1.0f / dg : 0.0f);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128((__m128i*)(xq + g * GROUP), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(xq + g * GROUP + 16), _mm512_cvtsepi32_epi8(q1));
    d[g] = dg;
    s[g] = hsum(_mm512_add_ps(v0, v1));
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

// ---- GEMM micro-kernel: 16 output rows x MT activation rows, all groups -------------------

// 16 values as float32, from float32 or float16 storage (scales, the KV cache)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <int BITS, typename S>
constexpr int64_t block_bytes() { return (BITS == 4 ? 256 : 512) + 2 * ROWS * sizeof(S); }

template <int BITS, int MT, typename S>
inline void tile(const uint8_t* w, int64_t G, const QuantActs& qa,
                 int64_t K, int64_t m0, float* y, int64_t ldy, int64_t n0, int64_t N, bool accumulate) {
  constexpr int64_t CODE_BYTES = BITS == 4 ? 256 : 512, BLOCK = block_bytes<BITS, S>();
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * BLOCK;
    for (int64_t off = 0; off < BLOCK; off += 64) _mm_prefetch((const char*)(wp + 4 * BLOCK + off), _MM_HINT_T0);
    __m512i code[8];
    if constexpr (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_loadu_si512(wp + c * 64);
        code[2 * c] = _mm512_and_si512(v, low);
        code[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int c = 0; c < 8; ++c) code[c] = _mm512_loadu_si512(wp + c * 64);
    }
    const S* sc = (const S*)(wp + CODE_BYTES);
    const __m512 av = load16(sc), bv = load16(sc + ROWS);
    for (int i = 0; i < MT; ++i) {
      const int64_t m = m0 + i;
      const int32_t* xp = (const int32_t*)(qa.xq.data() + m * K + g * GROUP);
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), code[0], _mm512_set1_epi32(xp[0]));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), code[1], _mm512_set1_epi32(xp[1]));
      s0 = _mm512_dpbusd_epi32(s0, code[2], _mm512_set1_epi32(xp[2]));
      s1 = _mm512_dpbusd_epi32(s1, code[3], _mm512_set1_epi32(xp[3]));
      s0 = _mm512_dpbusd_epi32(s0, code[4], _mm512_set1_epi32(xp[4]));
      s1 = _mm512_dpbusd_epi32(s1, code[5], _mm512_set1_epi32(xp[5]));
      s0 = _mm512_dpbusd_epi32(s0, code[6], _mm512_set1_epi32(xp[6]));
      s1 = _mm512_dpbusd_epi32(s1, code[7], _mm512_set1_epi32(xp[7]));
      __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      const int64_t gi = m * G + g;
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(av, _mm512_set1_ps(qa.d[gi])), acc[i]);
      acc[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(qa.s[gi]), acc[i]);
    }
  }
  const __mmask16 mask = N - n0 >= ROWS ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
  for (int i = 0; i < MT; ++i) {
    float* yp = y + (m0 + i) * ldy + n0;
    __m512 r = acc[i];
    if (accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, yp));
    _mm512_mask_storeu_ps(yp, mask, r);
  }
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
          LOOM_TILE(1) LOOM_TILE(2) LOOM_TILE(3) LOOM_TILE(4) LOOM_TILE(5) LOOM_TILE(6) LOOM_TILE(7) LOOM_TILE(8)
#undef LOOM_TILE
        }
      }
    }
  });
}

}  // namespace

template <typename C>
void store_row(C* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
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

template <typename C>
inline void to_float(const C* src, float* dst, int64_t D) {
  for (int64_t j = 0; j < D; j += 16) _mm512_storeu_ps(dst + j, load16(src + j));
}

// 16 scores <q, k_r> for the keys in buf (rows of D floats); NV = D / 16 when fixed, else 0
template <int NV, bool FULL>
inline __m512 qk16(const float* qh, const float* buf, int64_t Drt, int64_t mm) {
  const int64_t D = NV > 0 ? 16 * NV : Drt, nv = D / 16;
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nv; ++j) {
    const __m512 qj = _mm512_loadu_ps(qh + 16 * j);
    for (int r = 0; r < 16; ++r)
      if (FULL || r < mm) acc[r] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(buf + r * D + 16 * j), acc[r]);
  }
  return reduce16(acc);
}

// out[t] += sum_r w[t][r] * buf[r] for QT queries (weights p + t * stride), mm value rows
template <int NV, int QT>
inline void pv_tile(float* const* out, const float* p, int64_t stride, const float* buf, int64_t mm) {
  __m512 acc[QT][NV];
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NV; ++j) acc[t][j] = _mm512_loadu_ps(out[t] + 16 * j);
  for (int64_t r = 0; r < mm; ++r) {
    const float* vr = buf + r * NV * 16;
    for (int t = 0; t < QT; ++t) {
      const __m512 w = _mm512_set1_ps(p[t * stride + r]);
      for (int j = 0; j < NV; ++j) acc[t][j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * j), acc[t][j]);
    }
  }
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out[t] + 16 * j, acc[t][j]);
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
  const int64_t G = H / Hkv, D = NV > 0 ? 16 * NV : Drt;
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
    buf.resize(16 * D);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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
      lo -= lo % 16;   // key t always sits in lane t % 16 of the sums below, whatever the grouping
      const int64_t Ls = P - lo, stride = Ls + maxtail;
      p.resize(m * stride);
      float* pd = p.data();
      const int64_t* shared_slots = sl + r0 * lds + lo;
      const __m512 sv = _mm512_set1_ps(scale);
      // scores over the shared keys, 16 at a time (a row's keys past its own context are skipped)
      for (int64_t l0 = 0; l0 < Ls; l0 += 16) {
        const int64_t mm = std::min<int64_t>(16, Ls - l0);
        for (int64_t r = 0; r < mm; ++r) to_float(kc + (shared_slots[l0 + r] * Hkv + kh) * D, buf.data() + r * D, D);
        const __mmask16 mk = (__mmask16)((1u << mm) - 1);
        for (int64_t i = 0; i < m; ++i) {
          if (cl[r0 + i / G] <= lo + l0) continue;
          const __m512 sc = mm == 16 ? qk16<NV, true>(qps[i], buf.data(), D, 16) : qk16<NV, false>(qps[i], buf.data(), D, mm);
          _mm512_mask_storeu_ps(pd + i * stride + l0, mk, _mm512_mul_ps(sc, sv));
        }
      }
      // each row's own keys past the shared part, 16 at a time through the same dot product, so a
      // key's score has the same bits whether it is shared or a row's own
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = r0 + r, L = cl[row];
        for (int64_t t0 = std::max<int64_t>(P, first[r]); t0 < L; t0 += 16) {
          const int64_t mm = std::min<int64_t>(16, L - t0);
          for (int64_t j = 0; j < mm; ++j) to_float(kc + (sl[row * lds + t0 + j] * Hkv + kh) * D, buf.data() + j * D, D);
          const __mmask16 mk = (__mmask16)((1u << mm) - 1);
          for (int64_t g = 0; g < G; ++g) {
            const __m512 sc = mm == 16 ? qk16<NV, true>(qps[r * G + g], buf.data(), D, 16)
                                       : qk16<NV, false>(qps[r * G + g], buf.data(), D, mm);
            _mm512_mask_storeu_ps(pd + (r * G + g) * stride + Ls + t0 - P, mk, _mm512_mul_ps(sc, sv));
          }
        }
      }
      // softmax over each query's visible keys
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = i / G, row = r0 + r, L = cl[row];
        float* pi = pd + i * stride;
        // visible: [a0, a1) of the shared part, [b0, b1) of the tail
        const __m512i a0 = _mm512_set1_epi32((int)(std::min(first[r], P) - lo));
        const __m512i a1 = _mm512_set1_epi32((int)(std::min(L, P) - lo));
        const __m512i b0 = _mm512_set1_epi32((int)(Ls + std::max<int64_t>(0, first[r] - P)));
        const __m512i b1 = _mm512_set1_epi32((int)(Ls + L - P));
        auto visible = [&](int64_t l) -> __mmask16 {
          const __m512i x = _mm512_add_epi32(iota, _mm512_set1_epi32((int)l));
          const __mmask16 n = (__mmask16)((1u << std::min<int64_t>(16, stride - l)) - 1);
          return n & ((_mm512_cmpge_epi32_mask(x, a0) & _mm512_cmplt_epi32_mask(x, a1)) |
                      (_mm512_cmpge_epi32_mask(x, b0) & _mm512_cmplt_epi32_mask(x, b1)));
        };
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int64_t l = 0; l < stride; l += 16) mxv = _mm512_mask_max_ps(mxv, visible(l), mxv, _mm512_loadu_ps(pi + l));
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t l = 0; l < stride; l += 16) {   // exp over the visible keys, 0 elsewhere
          const __mmask16 all = (__mmask16)((1u << std::min<int64_t>(16, stride - l)) - 1), mk = visible(l);
          const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, pi + l), mv)));
          _mm512_mask_storeu_ps(pi + l, all, e);
          sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / hsum(sum));
        for (int64_t l = 0; l < stride; l += 16) {
          const __mmask16 mk = (__mmask16)((1u << std::min<int64_t>(16, stride - l)) - 1);
          _mm512_mask_storeu_ps(pi + l, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, pi + l), inv));
        }
        std::fill(ops[i], ops[i] + D, 0.0f);
      }
      // values of the shared keys, 16 at a time, into every query's output
      for (int64_t l0 = 0; l0 < Ls; l0 += 16) {
        const int64_t mm = std::min<int64_t>(16, Ls - l0);
        for (int64_t r = 0; r < mm; ++r) to_float(vc + (shared_slots[l0 + r] * Hkv + kh) * D, buf.data() + r * D, D);
        if constexpr (NV > 0) {
          constexpr int QT = NV >= 16 ? 1 : 16 / NV;   // queries per register tile
          int64_t i0 = 0;
          for (; i0 + QT <= m; i0 += QT)
            if (any_reaches(cl + r0, G, i0, QT, lo + l0))   // all-zero weights would add nothing
              pv_tile<NV, QT>(ops.data() + i0, pd + i0 * stride + l0, stride, buf.data(), mm);
          for (; i0 < m; ++i0)
            if (cl[r0 + i0 / G] > lo + l0) pv_tile<NV, 1>(ops.data() + i0, pd + i0 * stride + l0, stride, buf.data(), mm);
        } else {
          for (int64_t i = 0; i < m; ++i) {
            if (cl[r0 + i / G] <= lo + l0) continue;
            float* oh = ops[i];
            for (int64_t r = 0; r < mm; ++r) {
              const __m512 w = _mm512_set1_ps(pd[i * stride + l0 + r]);
              for (int64_t j = 0; j < D; j += 16)
                _mm512_storeu_ps(oh + j, _mm512_fmadd_ps(w, _mm512_loadu_ps(buf.data() + r * D + j), _mm512_loadu_ps(oh + j)));
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
          const __m512 w = _mm512_set1_ps(pi[Ls + t - P]);
          for (int64_t j = 0; j < D; j += 16)
            _mm512_storeu_ps(oh + j, _mm512_fmadd_ps(w, load16(vp + j), _mm512_loadu_ps(oh + j)));
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
  switch (D) {  // register-resident fast paths for the common head sizes, a generic loop otherwise
    case 64: run(std::integral_constant<int, 4>{}); break;
    case 128: run(std::integral_constant<int, 8>{}); break;
    case 256: run(std::integral_constant<int, 16>{}); break;
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
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        __m512 v = _mm512_loadu_ps(yr + k);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      __m512 r = _mm512_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)K + (float)eps));
      for (int64_t k = 0; k < K; k += 16)
        _mm512_storeu_ps(hr + k, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(yr + k), r),
                                                 _mm512_loadu_ps(wb + k), _mm512_loadu_ps(hr + k)));
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
