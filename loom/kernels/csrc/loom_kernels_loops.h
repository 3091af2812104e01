// The loops of loom's CPU kernels, written once over a vector-traits struct V (see
// loom_kernels_simd.h): activation pre-op + int8 quantization, the quantized GEMM's register
// tiles, and decode attention over the paged KV cache. V also brings the variant's integer
// dot products (`V::dots`), the only part written per instruction set.
//
// Quantized GEMM, y[M, N] = x[M, K] @ W[N, K]^T
//   W: per output row n and 32-wide group g, unsigned codes q (4 or 8 bits) with an affine
//      map w = a[n,g] * q + b[n,g]. Exact for Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 blocks.
//   x: each row, after an optional fused pre-op (RMSNorm, SwiGLU, GeGLU), is quantized per
//      32-group to int8: x ~ d[m,g] * xq, and s[m,g] = d[m,g] * sum(xq), the group sum of the
//      quantized values: y is then the exact product of the dequantized W and x, whose rounding
//      errors cancel around the weights' zero (an exact float sum would leave them weighted
//      by the unsigned codes, 8 or 128 times a centred weight).
//   y[m,n] = sum_g a[n,g] * d[m,g] * <q[n,g,:], xq[m,g,:]> + b[n,g] * s[m,g]
//   The integer dot products are exact in both variants, and every row of x is computed the
//   same way whatever M is, so results do not depend on batch composition.
//
// Packed layout: one stream of blocks, each 16 output rows x one 32-wide group:
//   [codes][a: 16 scales][b: 16 offsets], blocks ordered [N/16][G]   (N padded to a multiple of 16)
//   8-bit codes: [8 chunks][16 rows][4 bytes]       chunk c holds k = 4c .. 4c+3          (512 B)
//   4-bit codes: [4 chunks][16 rows][4 bytes]       byte j: low nibble k = 8c+j, high k = 8c+4+j  (256 B)
//   a, b: float16 where that is exact (every type with fp16 block scales), else float32
// A block is ROWS / V::W parts of W rows; a 64-byte chunk is one 512-bit vector or two 256-bit halves.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "loom_kernels_simd.h"

namespace loom {

enum PreOp : int64_t { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2, PRE_GEGLU = 3 };

// ---- activation pre-op + quantization -----------------------------------------------------

template <class V>
inline float sum_squares(const float* x, int64_t K) {
  typename V::F acc = V::zero();
  for (int64_t k = 0; k < K; k += V::W) {
    const typename V::F v = V::load(x + k);
    acc = V::fma(v, v, acc);
  }
  return V::hsum(acc);
}

// v[0] + ... + v[N - 1] as a balanced tree
template <class V, int N>
inline typename V::F tree_sum(const typename V::F* v) {
  if constexpr (N == 1) return v[0];
  else return V::add(tree_sum<V, N / 2>(v), tree_sum<V, N / 2>(v + N / 2));
}

// One row: src (K floats, or 2K for the gated pre-ops) -> xq[K] int8, d[G], s[G] (and the
// integer code sums xs[G] where V::kCodeSums).
template <class V>
void quantize_row(const float* src, int64_t K, int64_t pre, const float* norm_w, float eps,
                  float* tmp, int8_t* xq, float* d, float* s, int32_t* xs) {
  using F = typename V::F;
  constexpr int NG = GROUP / V::W;
  const float* x = src;
  if (pre == PRE_RMSNORM) {
    const F rv = V::set1(1.0f / std::sqrt(sum_squares<V>(src, K) / (float)K + eps));
    for (int64_t k = 0; k < K; k += V::W) V::store(tmp + k, V::mul(V::mul(V::load(src + k), rv), V::load(norm_w + k)));
    x = tmp;
  } else if (pre == PRE_SWIGLU || pre == PRE_GEGLU) {
    for (int64_t k = 0; k < K; k += V::W) {
      const F g = V::load(src + k), u = V::load(src + K + k);
      V::store(tmp + k, V::mul(pre == PRE_SWIGLU ? silu<V>(g) : gelu_tanh<V>(g), u));
    }
    x = tmp;
  }
  for (int64_t g = 0; g < K / GROUP; ++g) {
    F v[NG], scaled[NG], amax = V::zero();
    for (int j = 0; j < NG; ++j) {
      v[j] = V::load(x + g * GROUP + V::W * j);
      amax = V::max(amax, V::abs(v[j]));
    }
    const float dg = V::hmax(amax) / 127.0f;
    const F inv = V::set1(dg > 0.0f ? 1.0f / dg : 0.0f);
    for (int j = 0; j < NG; ++j) scaled[j] = V::mul(v[j], inv);
    const int32_t code_sum = V::store_s8(xq + g * GROUP, scaled);
    if constexpr (V::kCodeSums) xs[g] = code_sum;
    d[g] = dg;
    s[g] = dg * (float)code_sum;   // the sum of what was quantized
  }
}

struct QuantActs {
  std::vector<int8_t> xq;
  std::vector<float> d, s;
  std::vector<int32_t> xs;   // sum of each group's int8 codes, where the variant needs it
};

template <class V>
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t pre, const float* norm_w,
                   float eps, QuantActs& qa) {
  const int64_t G = K / GROUP;
  qa.xq.resize(M * K);
  qa.d.resize(M * G);
  qa.s.resize(M * G);
  qa.xs.resize(V::kCodeSums ? M * G : 0);
  at::parallel_for(0, M, M < 16 ? M : 4, [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> tmp;
    tmp.resize(K);
    for (int64_t m = m0; m < m1; ++m)
      quantize_row<V>(x + m * ldx, K, pre, norm_w, eps, tmp.data(), qa.xq.data() + m * K, qa.d.data() + m * G,
                      qa.s.data() + m * G, V::kCodeSums ? qa.xs.data() + m * G : nullptr);
  });
}

// ---- GEMM: register tiles of W output rows x MT activation rows, all groups ----------------

template <int BITS, typename S>
constexpr int64_t block_bytes() { return (BITS == 4 ? 256 : 512) + 2 * ROWS * sizeof(S); }

// acc[i] = rows h W .. (h + 1) W - 1 of a block column times activation row m0 + i, over all G groups
template <class V, int BITS, int MT, typename S>
LOOM_INLINE void tile_part(const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, int h,
                      typename V::F* acc) {
  constexpr int64_t CODE_BYTES = BITS == 4 ? 256 : 512, BLOCK = block_bytes<BITS, S>();
  for (int i = 0; i < MT; ++i) acc[i] = V::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * BLOCK;
    if (h == 0)
      for (int64_t off = 0; off < BLOCK; off += 64) _mm_prefetch((const char*)(wp + 4 * BLOCK + off), _MM_HINT_T0);
    const int32_t* xp[MT];
    int32_t xs[MT];
    for (int i = 0; i < MT; ++i) {
      xp[i] = (const int32_t*)(qa.xq.data() + (m0 + i) * K + g * GROUP);
      xs[i] = V::kCodeSums && BITS == 8 ? qa.xs[(m0 + i) * G + g] : 0;   // read by 8-bit dots only
    }
    typename V::I dot[MT];
    V::template dots<BITS, MT>(wp, h, xp, xs, dot);
    const S* sc = (const S*)(wp + CODE_BYTES);
    const typename V::F av = V::load(sc + h * V::W), bv = V::load(sc + ROWS + h * V::W);
    for (int i = 0; i < MT; ++i) {
      const int64_t gi = (m0 + i) * G + g;
      acc[i] = V::fma(V::cvt(dot[i]), V::mul(av, V::set1(qa.d[gi])), acc[i]);
      acc[i] = V::fma(bv, V::set1(qa.s[gi]), acc[i]);
    }
  }
}

// y[m0 .. m0 + MT, n0 .. n0 + 16) (+)= one block column, part H and the parts after it; fewer
// than 16 rows only at the end of N
template <class V, int BITS, int MT, typename S, int H = 0>
inline void tile(const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, float* y, int64_t ldy,
                 int64_t n0, int64_t N, bool accumulate) {
  const int64_t n = N - n0 - H * V::W;
  if (n <= 0) return;
  typename V::F acc[MT];
  tile_part<V, BITS, MT, S>(w, G, qa, K, m0, H, acc);
  for (int i = 0; i < MT; ++i) {
    float* yp = y + (m0 + i) * ldy + n0 + H * V::W;
    V::store_n(yp, accumulate ? V::add(acc[i], V::load_n(yp, n)) : acc[i], n);
  }
  if constexpr (H + 1 < ROWS / V::W) tile<V, BITS, MT, S, H + 1>(w, G, qa, K, m0, y, ldy, n0, N, accumulate);
}

// the tile for mt = 1 .. MT activation rows
template <class V, int BITS, typename S, int MT = V::MT_MAX>
inline void tile_rows(int64_t mt, const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, float* y,
                      int64_t ldy, int64_t n0, int64_t N, bool accumulate) {
  if constexpr (MT > 1)
    if (mt < MT) return tile_rows<V, BITS, S, MT - 1>(mt, w, G, qa, K, m0, y, ldy, n0, N, accumulate);
  tile<V, BITS, MT, S>(w, G, qa, K, m0, y, ldy, n0, N, accumulate);
}

// Cache blocking. The tiles of one block column read its weights G times per MT rows and the
// int8 codes of every activation row once, so either can be the operand that stays in cache.
// Weights: a run of NC block columns (~GEMM_L2_WEIGHTS bytes) stays in L2; activations: MC rows
// (~GEMM_L1_ACTS bytes of codes, a multiple of MT_MAX) stay in L1 while that run passes over
// them. Without the M blocking, 32 rows of a 576-wide layer (18 KB of codes) plus the block
// column left L1 and the 8-bit output matrix ran at a third of the 4-bit layers' rate.
// Only the order of the tiles changes: each output is the same tile's same sum over groups.
constexpr int64_t GEMM_L1_ACTS = 16 * 1024, GEMM_L2_WEIGHTS = 256 * 1024;

template <class V, int BITS, typename S>
void gemm(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
          bool accumulate) {
  const int64_t G = K / GROUP, NB = (N + ROWS - 1) / ROWS, column = G * block_bytes<BITS, S>();
  const int64_t MC = std::max<int64_t>(V::MT_MAX, GEMM_L1_ACTS / K / V::MT_MAX * V::MT_MAX);
  const int64_t NC = std::max<int64_t>(1, GEMM_L2_WEIGHTS / column);
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nc0 = nb0; nc0 < nb1; nc0 += NC) {
      const int64_t nc1 = std::min(nc0 + NC, nb1);
      for (int64_t mc0 = 0; mc0 < M; mc0 += MC) {
        const int64_t mc1 = std::min(mc0 + MC, M);
        for (int64_t nb = nc0; nb < nc1; ++nb)
          for (int64_t m0 = mc0; m0 < mc1; m0 += V::MT_MAX)
            tile_rows<V, BITS, S>(std::min<int64_t>(V::MT_MAX, mc1 - m0), w + nb * column, G, qa, K, m0, y, ldy,
                                  nb * ROWS, N, accumulate);
      }
    }
  });
}

template <class V, typename C>
void store_row(C* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += V::W) V::store(dst + i, V::load(src + i));
}

// ---- attention over the paged cache --------------------------------------------------------
// One query token per row. Row r has the key slots slots[r, :ctx[r]] (its context in position
// order); with window W it sees only the last W. Rows come in groups (a sequence's new tokens):
// the rows of group g agree on their first shared[g] slots, whose keys and values are
// converted to float once per (group, kv head) and used by every query head of every row in
// the group; each row's keys past the shared part (its own draft or chunk tokens, a few) are
// handled one by one. Per (group, kv head), in steps:
//
//   QK       p[i, :] for query i = (row, head): shared keys [lo, P) then the row's tail keys
//   softmax  over the row's visible keys (window), zero elsewhere
//   PV       sum over keys of p * v, the shared part KB keys at a time from a float buffer

constexpr int KB = 16;  // shared keys converted to float at a time

template <typename C>
struct PagedAttn {   // attn_decode's arguments (see there) as raw pointers
  const float* q;
  int64_t ldq;
  const C *kc, *vc;
  const int64_t* slots;
  int64_t lds;
  const int64_t *ctx, *group_start, *shared;
  int64_t NG, H, Hkv, D;
  float scale;
  int64_t window;
  float* out;
};

struct AttnItem {   // one (row group, kv head) and the buffers of its steps
  int64_t r0, nr, m, kh, P, lo, Ls, stride;   // rows, queries, shared length, first shared key, scores per query
  const int64_t* shared_slots;
  std::vector<int64_t> first;        // per row: its first visible key
  std::vector<const float*> q;       // per query i = (row, head)
  std::vector<float*> out;
  std::vector<float> mem;            // holds, from 64-byte boundaries (whole cache lines per vector):
  float* kv;                         //   KB keys or values as float rows of D
  float* scores;                     //   [m, stride]
};

template <typename C>
void plan_item(const PagedAttn<C>& a, int64_t work, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, grp = work / a.Hkv;
  it.kh = work % a.Hkv;
  it.r0 = a.group_start[grp];
  it.nr = a.group_start[grp + 1] - it.r0;
  it.m = it.nr * G;
  it.P = a.shared[grp];
  it.first.resize(it.nr);
  it.q.resize(it.m);
  it.out.resize(it.m);
  int64_t lo = it.P, maxtail = 0;
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t L = a.ctx[it.r0 + r];
    it.first[r] = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    lo = std::min(lo, it.first[r]);
    maxtail = std::max(maxtail, L - it.P);
    for (int64_t g = 0; g < G; ++g) {
      it.q[r * G + g] = a.q + (it.r0 + r) * a.ldq + (it.kh * G + g) * a.D;
      it.out[r * G + g] = a.out + (it.r0 + r) * a.H * a.D + (it.kh * G + g) * a.D;
    }
  }
  it.lo = lo - lo % KB;   // key t always sits in lane t % W of the softmax sums, whatever the grouping
  it.Ls = it.P - it.lo;
  it.stride = it.Ls + maxtail;
  it.shared_slots = a.slots + it.r0 * a.lds + it.lo;
  it.mem.resize(KB * a.D + it.m * it.stride + 48);
  it.kv = (float*)(((uintptr_t)it.mem.data() + 63) & ~(uintptr_t)63);
  it.scores = it.kv + KB * a.D + 16;   // one line apart: its stores do not 4K-alias the kv rows' loads
}

// the head size: a compile-time constant for the fixed sizes (NV = D / W vectors), else a.D
template <class V, int NV, typename C>
inline int64_t head_dim(const PagedAttn<C>& a) {
  if constexpr (NV > 0) return V::W * NV;
  else return a.D;
}

// keys or values of the shared slots [l0, l0 + mm) of kv head kh, as float rows of D
template <class V, int NV, typename C>
inline void shared_to_float(const PagedAttn<C>& a, const AttnItem& it, const C* cache, int64_t l0, int64_t mm,
                            float* buf) {
  const int64_t D = head_dim<V, NV>(a);
  for (int64_t r = 0; r < mm; ++r) {
    const C* src = cache + (it.shared_slots[l0 + r] * a.Hkv + it.kh) * D;
    for (int64_t j = 0; j < D; j += V::W) V::store(buf + r * D + j, V::load(src + j));
  }
}

// W scores <q, k_r> for the keys in buf (rows of D floats); NV = D / W when fixed, else 0
template <class V, int NV, bool FULL>
LOOM_INLINE typename V::F qk(const float* qh, const float* buf, int64_t Drt, int64_t mm) {
  const int64_t D = NV > 0 ? V::W * NV : Drt, nv = D / V::W;
  typename V::F acc[V::W];
  for (int r = 0; r < V::W; ++r) acc[r] = V::zero();
  for (int64_t j = 0; j < nv; ++j) {
    const typename V::F qj = V::load(qh + V::W * j);
    for (int r = 0; r < V::W; ++r)
      if (FULL || r < mm) acc[r] = V::fma(qj, V::load(buf + r * D + V::W * j), acc[r]);
  }
  return V::reduce(acc);
}

// QK, shared part: scores of every query over the shared keys, KB at a time, W per vector
template <class V, int NV, typename C>
void shared_scores(const PagedAttn<C>& a, AttnItem& it) {
  const typename V::F sv = V::set1(a.scale);
  const int64_t D = head_dim<V, NV>(a);
  float* buf = it.kv;
  for (int64_t l0 = 0; l0 < it.Ls; l0 += KB) {
    const int64_t mm = std::min<int64_t>(KB, it.Ls - l0);
    shared_to_float<V, NV>(a, it, a.kc, l0, mm, buf);
    for (int64_t i = 0; i < it.m; ++i) {
      if (a.ctx[it.r0 + i / (a.H / a.Hkv)] <= it.lo + l0) continue;   // keys past its row's context
      for (int64_t h = 0; h < mm; h += V::W) {
        const float* kb = buf + h * D;
        const typename V::F sc = mm - h >= V::W ? qk<V, NV, true>(it.q[i], kb, D, V::W)
                                                : qk<V, NV, false>(it.q[i], kb, D, mm - h);
        V::store_n(it.scores + i * it.stride + l0 + h, V::mul(sc, sv), mm - h);
      }
    }
  }
}

// QK, tail: each row's own keys past the shared part, KB at a time through the same dot product
// as the shared keys, so a key's score has the same bits whether it is shared or a row's own
template <class V, int NV, typename C>
void tail_scores(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, D = head_dim<V, NV>(a);
  const typename V::F sv = V::set1(a.scale);
  float* buf = it.kv;
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r, L = a.ctx[row];
    for (int64_t t0 = std::max<int64_t>(it.P, it.first[r]); t0 < L; t0 += KB) {
      const int64_t mm = std::min<int64_t>(KB, L - t0);
      for (int64_t j = 0; j < mm; ++j) {
        const C* src = a.kc + (a.slots[row * a.lds + t0 + j] * a.Hkv + it.kh) * D;
        for (int64_t c = 0; c < D; c += V::W) V::store(buf + j * D + c, V::load(src + c));
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        for (int64_t h = 0; h < mm; h += V::W) {
          const float* kb = buf + h * D;
          const typename V::F sc = mm - h >= V::W ? qk<V, NV, true>(it.q[i], kb, D, V::W)
                                                  : qk<V, NV, false>(it.q[i], kb, D, mm - h);
          V::store_n(it.scores + i * it.stride + it.Ls + t0 - it.P + h, V::mul(sc, sv), mm - h);
        }
      }
    }
  }
}

// softmax of one score row p[0, n) over the lanes in [a0, a1) or [b0, b1); zero elsewhere
template <class V>
void softmax_row(float* p, int64_t n, int a0, int a1, int b0, int b1) {
  using F = typename V::F;
  F mxv = V::set1(-INFINITY);
  for (int64_t l = 0; l < n; l += V::W)
    mxv = V::max_where(V::in_ranges(l, a0, a1, b0, b1), mxv, V::load_n(p + l, n - l));
  const F mv = V::set1(V::hmax(mxv));
  F sum = V::zero();
  for (int64_t l = 0; l < n; l += V::W) {
    const F e = V::keep(V::in_ranges(l, a0, a1, b0, b1), vexp<V>(V::sub(V::load_n(p + l, n - l), mv)));
    V::store_n(p + l, e, n - l);
    sum = V::add(sum, e);
  }
  const F inv = V::set1(1.0f / V::hsum(sum));
  for (int64_t l = 0; l < n; l += V::W) V::store_n(p + l, V::mul(V::load_n(p + l, n - l), inv), n - l);
}

// softmax of query i: visible are [a0, a1) of the shared part and [b0, b1) of the tail
template <class V, typename C>
void query_softmax(const PagedAttn<C>& a, AttnItem& it, int64_t i) {
  const int64_t r = i / (a.H / a.Hkv), L = a.ctx[it.r0 + r], f = it.first[r];
  softmax_row<V>(it.scores + i * it.stride, it.stride, (int)(std::min(f, it.P) - it.lo),
                 (int)(std::min(L, it.P) - it.lo),
                 (int)(it.Ls + std::max<int64_t>(0, f - it.P)), (int)(it.Ls + L - it.P));
}

// out[t][W j0 .. W (j0 + NJ)) += sum_r w[t][r] * buf[r][same columns] for QT queries (weights
// p + t * stride), mm value rows of D floats
template <class V, int NJ, int QT>
LOOM_INLINE void pv_tile(float* const* out, const float* p, int64_t stride, const float* buf, int64_t D, int64_t j0,
                    int64_t mm) {
  typename V::F acc[QT][NJ];
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) acc[t][j] = V::load(out[t] + V::W * (j0 + j));
  for (int64_t r = 0; r < mm; ++r) {
    const float* vr = buf + r * D + V::W * j0;
    for (int t = 0; t < QT; ++t) {
      const typename V::F w = V::set1(p[t * stride + r]);
      for (int j = 0; j < NJ; ++j) acc[t][j] = V::fma(w, V::load(vr + V::W * j), acc[t][j]);
    }
  }
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) V::store(out[t] + V::W * (j0 + j), acc[t][j]);
}

// whether any of the queries i0 .. i0 + n - 1 has keys at or past key t
template <typename C>
inline bool reaches(const PagedAttn<C>& a, const AttnItem& it, int64_t i0, int64_t n, int64_t t) {
  const int64_t G = a.H / a.Hkv;
  for (int64_t i = i0; i < i0 + n; ++i)
    if (a.ctx[it.r0 + i / G] > t) return true;
  return false;
}

// PV, shared part: the shared keys' values, KB at a time, into every query's output; fixed
// head sizes in register tiles of QT queries x NJ vectors (V::PV_ACC accumulators)
template <class V, int NV, typename C>
void shared_values(const PagedAttn<C>& a, AttnItem& it) {
  float* buf = it.kv;
  const int64_t D = head_dim<V, NV>(a), stride = it.stride;
  for (int64_t l0 = 0; l0 < it.Ls; l0 += KB) {
    const int64_t mm = std::min<int64_t>(KB, it.Ls - l0);
    shared_to_float<V, NV>(a, it, a.vc, l0, mm, buf);
    const float* p0 = it.scores + l0;
    if constexpr (NV > 0) {
      constexpr int NJ = std::min(NV, V::PV_NJ), QT = V::PV_ACC / NJ;
      static_assert(NV % NJ == 0, "fixed head sizes are whole value tiles");
      int64_t i0 = 0;
      for (; i0 + QT <= it.m; i0 += QT)
        if (reaches(a, it, i0, QT, it.lo + l0))   // all-zero weights would add nothing
          for (int64_t j0 = 0; j0 < NV; j0 += NJ)
            pv_tile<V, NJ, QT>(it.out.data() + i0, p0 + i0 * stride, stride, buf, D, j0, mm);
      for (; i0 < it.m; ++i0)
        if (reaches(a, it, i0, 1, it.lo + l0))
          for (int64_t j0 = 0; j0 < NV; j0 += NJ)
            pv_tile<V, NJ, 1>(it.out.data() + i0, p0 + i0 * stride, stride, buf, D, j0, mm);
    } else {
      for (int64_t i = 0; i < it.m; ++i) {
        if (!reaches(a, it, i, 1, it.lo + l0)) continue;
        float* oh = it.out[i];
        for (int64_t r = 0; r < mm; ++r) {
          const typename V::F w = V::set1(p0[i * stride + r]);
          for (int64_t j = 0; j < D; j += V::W) V::store(oh + j, V::fma(w, V::load(buf + r * D + j), V::load(oh + j)));
        }
      }
    }
  }
}

// PV, tail: the values of each row's own keys
template <class V, int NV, typename C>
void tail_values(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, D = head_dim<V, NV>(a);
  for (int64_t i = 0; i < it.m; ++i) {
    const int64_t r = i / G, row = it.r0 + r, L = a.ctx[row];
    float* oh = it.out[i];
    const float* pi = it.scores + i * it.stride;
    for (int64_t t = std::max<int64_t>(it.P, it.first[r]); t < L; ++t) {
      const C* vp = a.vc + (a.slots[row * a.lds + t] * a.Hkv + it.kh) * D;
      const typename V::F w = V::set1(pi[it.Ls + t - it.P]);
      for (int64_t j = 0; j < D; j += V::W) V::store(oh + j, V::fma(w, V::load(vp + j), V::load(oh + j)));
    }
  }
}

template <class V, int NV, typename C>
void attn_impl(const PagedAttn<C>& a) {
  const int64_t G = a.H / a.Hkv;
  int64_t work_total = 0;
  for (int64_t g = 0; g < a.NG; ++g) {
    const int64_t L = a.shared[g] + 1;
    work_total += (a.group_start[g + 1] - a.group_start[g]) * G * a.D * (a.window > 0 ? std::min(L, a.window) : L);
  }
  const int64_t per_item = std::max<int64_t>(1, work_total / std::max<int64_t>(1, a.NG * a.Hkv));
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / per_item);  // small batches stay on one thread
  at::parallel_for(0, a.NG * a.Hkv, grain, [&](int64_t w0, int64_t w1) {
    thread_local AttnItem it;
    for (int64_t work = w0; work < w1; ++work) {
      plan_item(a, work, it);
      shared_scores<V, NV>(a, it);
      tail_scores<V, NV>(a, it);
      for (int64_t i = 0; i < it.m; ++i) {
        query_softmax<V>(a, it, i);
        std::fill(it.out[i], it.out[i] + head_dim<V, NV>(a), 0.0f);
      }
      shared_values<V, NV>(a, it);
      tail_values<V, NV>(a, it);
    }
  });
}

// h += rmsnorm(y) * w, row by row
template <class V>
void add_rmsnorm_rows(float* hb, int64_t ldh, const float* yb, int64_t ldy, const float* wb, int64_t M, int64_t K,
                      float eps) {
  at::parallel_for(0, M, M < 16 ? M : 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* yr = yb + m * ldy;
      float* hr = hb + m * ldh;
      const typename V::F r = V::set1(1.0f / std::sqrt(sum_squares<V>(yr, K) / (float)K + eps));
      for (int64_t k = 0; k < K; k += V::W)
        V::store(hr + k, V::fma(V::mul(V::load(yr + k), r), V::load(wb + k), V::load(hr + k)));
    }
  });
}

}  // namespace loom
