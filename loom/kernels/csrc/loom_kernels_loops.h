// The loops of loom's CPU kernels, written once over a vector-traits struct V (see
// loom_kernels_simd.h): activation pre-op + int8 quantization, the quantized GEMM's register
// tiles, and decode attention over the paged KV cache. V also brings the variant's integer
// dot products (`V::dots`), the only part written per instruction set.
//
// Quantized GEMM, y[M, N] = x[M, K] @ W[N, K]^T
//   W: per output row n and 32-wide group g, unsigned codes q (4, 5 or 8 bits) with an affine
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
//   A matrix with an integer zero point ZL (b = -ZL a in every group: Q4_0, Q5_0, Q8_0) leaves b
//   out, [codes][a], and the loops take b = -ZL a (exact: ZL is a power of two). Its weights
//   then stream 5-10% fewer bytes, which a memory-bound GEMM (one activation row, or Gemma 3's
//   output matrix at a few rows) gains whole.
//   8-bit codes: [8 chunks][16 rows][4 bytes]       chunk c holds k = 4c .. 4c+3          (512 B)
//   4-bit codes: [4 chunks][16 rows][4 bytes]       byte j: low nibble k = 8c+j, high k = 8c+4+j  (256 B)
//   5-bit codes (Q5_0's, zero point 16): their low four bits as the 4-bit codes, then
//                [16 rows][4 bytes]                  byte j, bit c: the fifth bit of k = 4c+j   (320 B)
//   a, b: float16 where that is exact (every type with fp16 block scales), else float32
// A block is ROWS / V::W parts of W rows; a 64-byte chunk is one 512-bit vector or two 256-bit halves.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "loom_kernels_kv.h"
#include "loom_kernels_simd.h"

namespace loom {

// f(begin, end) over [0, n) in chunks of at most `chunk` indices. Thread t owns the range a
// static split would give it, [t n / T, (t + 1) n / T), and takes its chunks in order; a thread
// done with its own range then takes the chunks still left in the others (an atomic counter a
// range). On a machine shared with other processes (the server's front end, its clients), a
// thread that loses its core for a few milliseconds then holds up only the chunk it has, where a
// static split waits the whole time at the region's end; without such a delay, every thread
// streams its own range, prefetches included. Which thread runs a chunk changes no arithmetic.
template <class Fn>
void parallel_chunks(int64_t n, int64_t chunk, const Fn& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t T = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  if (T <= 1 || at::in_parallel_region()) return f(0, n);
  struct alignas(64) Range { std::atomic<int64_t> next; int64_t end; };
  thread_local std::unique_ptr<Range[]> mine;   // the calling thread's, kept across calls
  thread_local int64_t have = 0;
  if (have < T) mine.reset(new Range[have = T]);
  Range* ranges = mine.get();   // (a lambda would see each worker's own thread_local)
  for (int64_t t = 0; t < T; ++t) {
    ranges[t].next.store(t * n / T, std::memory_order_relaxed);
    ranges[t].end = (t + 1) * n / T;
  }
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < T; ++k) {
        Range& r = ranges[(t + k) % T];
        for (int64_t i; (i = r.next.fetch_add(chunk, std::memory_order_relaxed)) < r.end;)
          f(i, std::min(r.end, i + chunk));
      }
  });
}

// a chunk size for n indices: about 8 chunks a thread, but at least `least` indices (a chunk's
// work well above the cost of taking it) and at most `most`; never fewer chunks than threads
inline int64_t chunk_of(int64_t n, int64_t least, int64_t most) {
  const int64_t T = std::max(1, at::get_num_threads());
  return std::max<int64_t>(1, std::min({std::max(n / (8 * T), least), most, (n + T - 1) / T}));
}

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

// One row: src (K floats, or 2K for the gated pre-ops) -> per 32-group g: int8 codes at
// xq + g * step * GROUP, d[g * step], s[g * step] and the integer code sum times -zero at
// xs[g * step] (the panel layout of QuantActs: step = its rows per panel).
template <class V>
void quantize_row(const float* src, int64_t K, int64_t pre, const float* norm_w, float eps,
                  float* tmp, int8_t* xq, float* d, float* s, int32_t* xs, int64_t step, int zero) {
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
    const int32_t code_sum = V::store_s8(xq + g * step * GROUP, scaled);
    xs[g * step] = zero ? -zero * code_sum : code_sum;
    d[g * step] = dg;
    s[g * step] = dg * (float)code_sum;   // the sum of what was quantized
  }
}

// The quantized activations in panels of P rows (a GEMM tile's rows: V::MT_MAX, or M where M is
// smaller, or an AMX tile's V::AMX_ROWS, whose register tiles then take half a panel each),
// group-major within a panel: row m = p P + r, group
// g is at [p][g][r] (codes: 32 bytes there). A tile then walks one pointer per operand, its rows
// at fixed offsets, instead of MT row pointers (which spilled from the general registers at MT = 8).
struct QuantActs {
  int64_t P = 1;
  std::vector<int8_t> xq;    // [panels][G][P][32]
  std::vector<float> d, s;   // [panels][G][P]
  // [panels][G][P] sum of each group's int8 codes (AVX2's 8-bit dots); for a GEMM with zero point
  // Z, -Z times it: where each dot product starts, read from memory
  std::vector<int32_t> xs;
  std::vector<int16_t> xw;   // xq widened to int16, where the GEMM's dot products take them (V::wide_codes)
};

// wide: also the codes as int16 in qa.xw (the same layout), for dot products that take them;
// zero: the GEMM's zero point Z (QuantActs::xs); panel: the panels' height where the GEMM's AMX
// tiles take a panel's rows at once (0: a register tile's, V::MT_MAX or M)
template <class V>
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t pre, const float* norm_w,
                   float eps, QuantActs& qa, bool wide = false, int zero = 0, int64_t panel = 0) {
  const int64_t P = qa.P = panel > 0 ? panel : std::clamp<int64_t>(M, 1, V::MT_MAX);
  const int64_t G = K / GROUP, rows = (M + P - 1) / P * P;
  qa.xq.resize(rows * K);
  qa.d.resize(rows * G);
  qa.s.resize(rows * G);
  qa.xs.resize(rows * G);
  if (wide) qa.xw.resize(rows * K);
  at::parallel_for(0, M, M < 16 ? M : 4, [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> tmp;
    tmp.resize(K);
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t at = m / P * P * G + m % P;   // [panel][0][row]
      quantize_row<V>(x + m * ldx, K, pre, norm_w, eps, tmp.data(), qa.xq.data() + at * GROUP, qa.d.data() + at,
                      qa.s.data() + at, qa.xs.data() + at, P, zero);
      if (wide)
        for (int64_t g = 0; g < G; ++g) {
          const int8_t* src = qa.xq.data() + (at + g * P) * GROUP;
          std::copy(src, src + GROUP, qa.xw.data() + (at + g * P) * GROUP);
        }
    }
  });
}

// ---- GEMM: register tiles of W output rows x MT activation rows, all groups ----------------

// Weight blocks prefetched ahead of the one a tile reads. Into L2: 4 blocks ahead into L1 (T0)
// left Gemma 3's 262k-row output matrix waiting on memory; 64 ahead into L2 gave its decode step
// 1.2x at 8 rows and 1.05-1.08x at 32 (benchmarks/step_ab.py; 16 and 32 gained less, 128 no more).
constexpr int64_t GEMM_PF_BLOCKS = 64;
// Where a call has at most GEMM_NTA_ROWS rows and reads each weight block once, the weights are
// prefetched non-temporally, GEMM_NTA_BLOCKS ahead: a decode step of a few streams reads every
// layer's weights from memory, and through L2 and L3 they evicted what the step reuses (the
// kernels' code, the KV cache, the interpreter's working set). One-stream steps ran 1.05-1.15x
// (SmolLM2) and 1.12-1.25x (Gemma 3) as fast, 4 streams 1.00x and 1.02-1.07x (benchmarks/step_ab.py,
// Zen 4). 8 ahead gained less, 32 nothing for Gemma 3; at 8 rows, where Gemma 3's output matrix is
// no longer waiting on memory, streamed blocks ran 0.91-0.93x, so more rows keep them in L2.
// AMD's cores only (cpu_streams_nta): on an Intel Xeon (Sapphire Rapids class, AVX-512 and
// AMX) the same prefetches made Gemma 3's one-stream decode step 2.9x as slow (24 ms against
// 8.2; its output matrix alone 15.8 ms against 3.9, benchmarks/gemm_rate.py).
constexpr int64_t GEMM_NTA_BLOCKS = 16, GEMM_NTA_ROWS = 4;

// whether V's AMX tiles may run here (V::kAmx: built with them)
template <class V>
bool amx_allowed() {
  if constexpr (V::kAmx) return V::amx_allowed();
  else return false;
}

// whether the CPU has AVX-512 (whatever this build's instructions)
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// whether non-temporal prefetches stream weights at memory speed here (GEMM_NTA_ROWS): AMD's
inline bool cpu_streams_nta() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// bytes of one block's codes: 16 rows x 32 codes of 4 bits, of 5 (the 4-bit layout of their low
// bits, then a 64-byte plane of their fifth bits), or of 8
constexpr int64_t code_bytes_of(int64_t bits) { return bits == 4 ? 256 : bits == 5 ? 320 : 512; }

// bytes of one packed block: the codes, 16 scales a and, without a zero point, 16 offsets b
constexpr int64_t packed_block_bytes(int64_t bits, int64_t scale_bytes, int64_t zero) {
  return code_bytes_of(bits) + (zero > 0 ? 1 : 2) * ROWS * scale_bytes;
}

template <int BITS, typename S, int ZL>
constexpr int64_t block_bytes() { return packed_block_bytes(BITS, sizeof(S), ZL); }

// One group's block of 4- or 5-bit codes rewritten in the 8-bit layout (bytes (c, row, j) =
// code(4c + j)), scales copied: the same codes and scales, so the same products.
template <int BITS, typename S, int ZL>
LOOM_INLINE void widen_block(const uint8_t* src, uint8_t* dst) {
  static_assert(BITS == 4 || BITS == 5, "nibbles, with or without a plane of fifth bits");
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256i plane = _mm256_setzero_si256();
    if constexpr (BITS == 5) plane = _mm256_loadu_si256((const __m256i*)(src + 256 + 32 * half));
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(src + c * 64 + 32 * half));
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (BITS == 5) {
        lo = _mm256_or_si256(lo, fifth_bit(plane, 2 * c));
        hi = _mm256_or_si256(hi, fifth_bit(plane, 2 * c + 1));
      }
      _mm256_storeu_si256((__m256i*)(dst + 2 * c * 64 + 32 * half), lo);
      _mm256_storeu_si256((__m256i*)(dst + (2 * c + 1) * 64 + 32 * half), hi);
    }
  }
  std::memcpy(dst + code_bytes_of(8), src + code_bytes_of(BITS), block_bytes<BITS, S, ZL>() - code_bytes_of(BITS));
}

template <class V, int BITS, int MT, typename S, int Z, int ZL>
LOOM_INLINE void group_scale(const uint8_t* wp, int h, const typename V::I* dot, const float* d, const float* s,
                             typename V::F* acc);

// acc[i] += rows h W .. (h + 1) W - 1 of one group's block wp times activation row i (its int8
// codes at xq + 8 i, int16 ones at xw + 32 i).
// Z > 0: every group's offset is b = -Z a (Q4_0, Q5_0, Q8_0: an integer zero point), so the
// offset term is integer, a d <q - Z, xq> = a d (<q, xq> - Z sum(xq)), and one FMA per row and
// group is left on the multiply pipes instead of two (and the two large terms' cancellation is exact).
// ZL: the layout's zero point (blocks without b); Z is ZL, or 0 for the affine arithmetic on such
// a matrix (the AVX2 variant's full 8-bit codes, Q8_0), which then takes b = -ZL a.
template <class V, int BITS, int MT, typename S, int Z, int ZL>
LOOM_INLINE void group_part(const uint8_t* wp, int h, const int32_t* xq, const int16_t* xw, const int32_t* xs,
                            const float* d, const float* s, typename V::F* acc) {
  static_assert(Z == 0 || Z == ZL, "the integer path needs the layout's zero point");
  typename V::I dot[MT];
  V::template dots<BITS, MT, Z>(wp, h, xq, xw, xs, dot);
  group_scale<V, BITS, MT, S, Z, ZL>(wp, h, dot, d, s, acc);
}

// acc[i] += the group's integer dot products dot[i] scaled: a d dot (+ b s without Z)
template <class V, int BITS, int MT, typename S, int Z, int ZL>
LOOM_INLINE void group_scale(const uint8_t* wp, int h, const typename V::I* dot, const float* d, const float* s,
                             typename V::F* acc) {
  constexpr int64_t CODE_BYTES = code_bytes_of(BITS);
  const S* sc = (const S*)(wp + CODE_BYTES);
  const typename V::F av = V::load(sc + h * V::W);
  const typename V::F bv = Z > 0    ? V::zero()
                           : ZL > 0 ? V::mul(av, V::set1(-(float)ZL))
                                    : V::load(sc + ROWS + h * V::W);
  for (int i = 0; i < MT; ++i) {
    acc[i] = V::fma(V::cvt(dot[i]), V::mul(av, V::set1(d[i])), acc[i]);
    if constexpr (Z == 0) acc[i] = V::fma(bv, V::set1(s[i]), acc[i]);   // the offset term b s
  }
}

// Where a tile's weights come from: memory, read once by the call (every part of a block at a
// time, the blocks streaming past L2 and L3: GEMM_NTA_BLOCKS); memory, read again by the call's
// other rows (a part at a time, the column waiting in L2 for the next part: GEMM_PF_BLOCKS); or
// a buffer already in cache (gemm_widened's), which nothing needs to fetch ahead.
enum class Fetch { once, again, cached };

// acc[p][i] = part H + p (rows (H + p) W .. of a block column) times activation row m0 + i, over
// all G groups, for the NP parts from H, the weights fetched as `fetch` says.
template <class V, int BITS, int MT, typename S, int Z, int ZL, int H, int NP>
LOOM_INLINE void tile_part(const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, Fetch fetch,
                           typename V::F (*acc)[MT]) {
  constexpr int64_t BLOCK = block_bytes<BITS, S, ZL>();
  const int64_t P = qa.P;
  for (int p = 0; p < NP; ++p)
    for (int i = 0; i < MT; ++i) acc[p][i] = V::zero();
  // rows m0 .. m0 + MT of their panel (MT <= P, m0 % P + MT <= P): group g's rows at [g][m0 % P + i]
  const int64_t at = m0 / P * P * G + m0 % P;
  const int32_t* xq = (const int32_t*)(qa.xq.data() + at * GROUP);
  const int16_t* xw = V::template wide_codes<BITS, MT, Z>() ? qa.xw.data() + at * GROUP : nullptr;
  const int32_t* xs = qa.xs.data() + at;
  const float *d = qa.d.data() + at, *s = qa.s.data() + at;
  if constexpr (MT > V::MT_MAX) {   // AMX (V::tiles_on): a panel's rows, four groups' dot products at a time, each scaled as below
    static_assert(V::kAmx && BITS == 8 && MT == V::AMX_ROWS && NP == 1, "a tile of more rows than registers runs on AMX");
    alignas(64) int32_t out[V::AMX_GROUPS][MT][16];
    for (int64_t g = 0; g < G; g += V::AMX_GROUPS) {
      const int n = (int)std::min<int64_t>(V::AMX_GROUPS, G - g);
      const uint8_t* wp = w + g * BLOCK;
      if (fetch == Fetch::again)
        for (int64_t off = 0; off < n * BLOCK; off += 64) _mm_prefetch((const char*)(wp + GEMM_PF_BLOCKS * BLOCK + off), _MM_HINT_T2);
      V::amx_dots(n, wp, BLOCK, (const int8_t*)xq, P * GROUP, out);
      for (int j = 0; j < n; ++j, xq += P * GROUP / 4, xs += P, d += P, s += P) {
        typename V::I dot[MT];
        for (int i = 0; i < MT; ++i) dot[i] = V::template amx_row<Z>(out[j][i], xs[i]);
        group_scale<V, BITS, MT, S, Z, ZL>(wp + j * BLOCK, H, dot, d, s, acc[0]);
      }
    }
  } else {
    for (int64_t g = 0; g < G; ++g, xq += P * GROUP / 4, xw += xw ? P * GROUP : 0, xs += P, d += P, s += P) {
      const uint8_t* wp = w + g * BLOCK;
      if constexpr (H == 0) {   // the weights stream from memory (GEMM_PF_BLOCKS, GEMM_NTA_BLOCKS)
        if (fetch == Fetch::once)
          for (int64_t off = 0; off < BLOCK; off += 64) _mm_prefetch((const char*)(wp + GEMM_NTA_BLOCKS * BLOCK + off), _MM_HINT_NTA);
        else if (fetch == Fetch::again)
          for (int64_t off = 0; off < BLOCK; off += 64) _mm_prefetch((const char*)(wp + GEMM_PF_BLOCKS * BLOCK + off), _MM_HINT_T2);
      }
      for (int p = 0; p < NP; ++p) group_part<V, BITS, MT, S, Z, ZL>(wp, H + p, xq, xw, xs, d, s, acc[p]);
    }
  }
}

// What a tile does with each output vector besides storing it: nothing, or (the output layer's
// TopTrack below) look at the values while they are still in registers. kStream: the outputs are
// stored past the caches (see TopTrack); stores(): whether they are stored at all; done() ends a
// chunk of the GEMM.
struct NoEpi {
  static constexpr bool kStream = false;
  static constexpr bool stores() { return true; }
  template <class F>
  LOOM_INLINE void operator()(int64_t, int64_t, F, int64_t) const {}
  void done() const {}
};

// y[m0 .. m0 + MT, n0 + (H + p) W ..) (+)= acc[p] for the NP parts from H, those within N;
// epi(row, first column, stored vector, its valid lanes)
template <class V, int MT, int H, int NP, class Epi>
LOOM_INLINE void store_parts(typename V::F (*acc)[MT], int64_t m0, float* y, int64_t ldy, int64_t n0, int64_t N,
                             bool accumulate, Epi& epi) {
  for (int p = 0; p < NP; ++p) {
    const int64_t n = N - n0 - (H + p) * V::W;
    if (n <= 0) return;
    for (int i = 0; i < MT; ++i) {
      typename V::F out = acc[p][i];
      if (epi.stores()) {   // else y is null: nothing is read or written there
        float* yp = y + (m0 + i) * ldy + n0 + (H + p) * V::W;
        if (accumulate) out = V::add(out, V::load_n(yp, n));
        if (Epi::kStream && n >= V::W && (uintptr_t)yp % sizeof(out) == 0)
          V::stream(yp, out);
        else
          V::store_n(yp, out, n);
      }
      epi(m0 + i, n0 + (H + p) * V::W, out, std::min<int64_t>(n, V::W));
    }
  }
}

// y[m0 .. m0 + MT, n0 .. n0 + 16) (+)= one block column, part H and the parts after it (all at
// once where the call reads each block once); fewer than 16 rows only at the end of N
template <class V, int BITS, int MT, typename S, int Z, int ZL, int H = 0, class Epi>
inline void tile(const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, float* y, int64_t ldy,
                 int64_t n0, int64_t N, bool accumulate, Fetch fetch, Epi& epi) {
  constexpr int PARTS = ROWS / V::W;
  if (N - n0 - H * V::W <= 0) return;
  if constexpr (H == 0 && PARTS > 1) {
    if (fetch == Fetch::once) {
      typename V::F acc[PARTS][MT];
      tile_part<V, BITS, MT, S, Z, ZL, 0, PARTS>(w, G, qa, K, m0, fetch, acc);
      return store_parts<V, MT, 0, PARTS>(acc, m0, y, ldy, n0, N, accumulate, epi);
    }
  }
  typename V::F acc[1][MT];
  tile_part<V, BITS, MT, S, Z, ZL, H, 1>(w, G, qa, K, m0, fetch, acc);
  store_parts<V, MT, H, 1>(acc, m0, y, ldy, n0, N, accumulate, epi);
  if constexpr (H + 1 < PARTS)
    tile<V, BITS, MT, S, Z, ZL, H + 1>(w, G, qa, K, m0, y, ldy, n0, N, accumulate,
                                       fetch == Fetch::cached ? fetch : Fetch::again, epi);
}

// the tile for mt = 1 .. MT activation rows
template <class V, int BITS, typename S, int Z, int ZL, int MT = V::MT_MAX, class Epi>
inline void tile_rows(int64_t mt, const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K, int64_t m0, float* y,
                      int64_t ldy, int64_t n0, int64_t N, bool accumulate, Fetch fetch, Epi& epi) {
  if constexpr (MT > 1)
    if (mt < MT) return tile_rows<V, BITS, S, Z, ZL, MT - 1>(mt, w, G, qa, K, m0, y, ldy, n0, N, accumulate, fetch, epi);
  tile<V, BITS, MT, S, Z, ZL>(w, G, qa, K, m0, y, ldy, n0, N, accumulate, fetch, epi);
}

// the tiles of rows m0 .. m1 over one block column: AMX tiles of a panel's V::AMX_ROWS rows
// where the call runs them (V::tiles_on), register tiles of up to V::MT_MAX rows for the rest
template <class V, int BITS, typename S, int Z, int ZL, class Epi>
LOOM_INLINE void column_rows(int64_t m0, int64_t m1, const uint8_t* w, int64_t G, const QuantActs& qa, int64_t K,
                             float* y, int64_t ldy, int64_t n0, int64_t N, bool accumulate, Fetch fetch, Epi& epi) {
  if constexpr (V::kAmx && BITS == 8)
    if (V::tiles_on)
      for (; m0 + V::AMX_ROWS <= m1; m0 += V::AMX_ROWS)
        tile<V, BITS, V::AMX_ROWS, S, Z, ZL>(w, G, qa, K, m0, y, ldy, n0, N, accumulate, fetch, epi);
  for (; m0 < m1; m0 += V::MT_MAX)
    tile_rows<V, BITS, S, Z, ZL>(std::min<int64_t>(V::MT_MAX, m1 - m0), w, G, qa, K, m0, y, ldy, n0, N, accumulate, fetch, epi);
}

// Cache blocking. The tiles of one block column read its weights G times per MT rows and the
// int8 codes of every activation row once, so either can be the operand that stays in cache.
// Weights: a run of NC block columns (~GEMM_L2_WEIGHTS bytes) stays in L2; activations: MC rows
// (~GEMM_L1_ACTS bytes of codes, whole panels: MT_MAX or AMX_ROWS rows) stay in L1 while that run passes over
// them. Without the M blocking, 32 rows of a 576-wide layer (18 KB of codes) plus the block
// column left L1 and the 8-bit output matrix ran at a third of the 4-bit layers' rate.
// Only the order of the tiles changes: each output is the same tile's same sum over groups.
constexpr int64_t GEMM_L1_ACTS = 16 * 1024, GEMM_L2_WEIGHTS = 256 * 1024;

template <class V, int BITS, typename S, int Z, int ZL, class Epis>
void gemm_widened(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
                  bool accumulate, const Epis& epis);

// block columns a GEMM chunk takes at least: ~1M multiply-adds (a few microseconds)
inline int64_t least_columns(int64_t K, int64_t M) {
  return (((int64_t)1 << 20) + ROWS * K * M - 1) / (ROWS * K * M);
}

// From this many rows on, 5-bit codes are widened to bytes a column at a time (gemm_widened);
// fewer read them directly, their fifth bits taken apart in every tile. Gemma 3's gate/up matrix
// (Zen 2, two threads, against the byte layout's time): directly 1.47-1.55x at one row, 1.37x at
// two, 0.91-1.03x at three, 0.83-0.88x at four (widened, 157-163 us there against 134-136 us
// directly), widened 0.93-0.96x at 5-32 rows.
constexpr int64_t GEMM_WIDEN5_ROWS = 5;

// epis(): the epilogue of a chunk of block columns (one per chunk: it may hold the thread's state)
template <class V, int BITS, typename S, int Z, int ZL, class Epis>
void gemm(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
          bool accumulate, const Epis& epis) {
  if constexpr (BITS == 5)
    if (M >= GEMM_WIDEN5_ROWS) return gemm_widened<V, 5, S, Z, ZL>(w, N, K, M, qa, y, ldy, accumulate, epis);
  if constexpr (BITS == 4 && V::kAmx)   // AMX takes bytes: the nibbles widened as the five bits are
    if (V::amx_rows(M, 4)) return gemm_widened<V, 4, S, Z, ZL>(w, N, K, M, qa, y, ldy, accumulate, epis);
  const int64_t G = K / GROUP, NB = (N + ROWS - 1) / ROWS, column = G * block_bytes<BITS, S, ZL>();
  const int64_t code_bytes = V::template wide_codes<BITS, V::MT_MAX, Z>() ? 2 : 1;   // int16 codes: half the rows
  const int64_t PM = std::max<int64_t>(V::MT_MAX, qa.P);   // rows a panel: an AMX tile's, where the call runs them
  const int64_t MC = std::max<int64_t>(PM, GEMM_L1_ACTS / (K * code_bytes) / PM * PM);
  const int64_t NC = std::max<int64_t>(1, GEMM_L2_WEIGHTS / column);
  // a few rows whose tiles read each weight block once: past the caches. The AVX2 variant's tiles
  // then take both halves of a block at a time (tile); on an AVX2-only Zen 2 decode steps ran
  // 1.14-1.23x as fast at one row, 1.10-1.39x at 2-4 (benchmarks/step_ab.py), where streaming 6
  // and 8 rows gained nothing (0.97-1.04x). On a CPU with AVX-512, where the AVX2 variant runs
  // only when forced, its blocks stay in L2: on a Zen 4, streamed, 2 and 4 rows lost 0.85-0.93x.
  const Fetch fetch = M <= GEMM_NTA_ROWS && cpu_streams_nta() && (ROWS == V::W || !cpu_has_avx512()) ? Fetch::once
                                                                                                     : Fetch::again;
  parallel_chunks(NB, chunk_of(NB, least_columns(K, M), NC), [&](int64_t nb0, int64_t nb1) {
    auto epi = epis();
    if constexpr (BITS == 8) V::tiles_begin(M);   // only 8-bit tiles run on AMX (others: gemm_widened)
    for (int64_t nc0 = nb0; nc0 < nb1; nc0 += NC) {
      const int64_t nc1 = std::min(nc0 + NC, nb1);
      for (int64_t mc0 = 0; mc0 < M; mc0 += MC) {
        const int64_t mc1 = std::min(mc0 + MC, M);
        for (int64_t nb = nc0; nb < nc1; ++nb)
          column_rows<V, BITS, S, Z, ZL>(mc0, mc1, w + nb * column, G, qa, K, y, ldy, nb * ROWS, N, accumulate, fetch, epi);
      }
    }
    V::tiles_end();
    epi.done();
  });
}

// 5-bit codes at GEMM_WIDEN5_ROWS rows or more: each block column is widened to the 8-bit
// layout (widen_block) into a buffer that stays in L1, and the 8-bit tiles of every row run over
// it, where each tile would otherwise take the fifth bits apart again. Same tiles, same sums: the
// results are those of the 5-bit tiles (a row's outputs do not depend on M). A column at a time
// beat runs of columns kept in L2 with the rows in panels (gemm's blocking) at every M, 512 too:
// Gemma 3's gate/up matrix at 8 / 32 / 512 rows 0.93 / 0.96 / 0.99x the byte layout's time
// against 0.87 / 0.93 / 0.96x (Zen 2, two threads). 4-bit codes take the same way where AMX runs
// a call's tiles (V::AMX_ROWS4 rows or more): AMX multiplies bytes.
template <class V, int BITS, typename S, int Z, int ZL, class Epis>
void gemm_widened(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
                  bool accumulate, const Epis& epis) {
  constexpr int64_t BN = block_bytes<BITS, S, ZL>(), B8 = block_bytes<8, S, ZL>();
  const int64_t G = K / GROUP, NB = (N + ROWS - 1) / ROWS;
  parallel_chunks(NB, chunk_of(NB, least_columns(K, M), std::max<int64_t>(1, GEMM_L2_WEIGHTS / (G * BN))), [&](int64_t nb0, int64_t nb1) {
    thread_local std::vector<uint8_t> column;
    if ((int64_t)column.size() < G * B8) column.resize(G * B8);
    auto epi = epis();
    V::tiles_begin(M);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* src = w + nb * G * BN;
      for (int64_t g = 0; g < G; ++g, src += BN) {
        for (int64_t off = 0; off < BN; off += 64) _mm_prefetch((const char*)(src + GEMM_PF_BLOCKS * BN + off), _MM_HINT_T2);
        widen_block<BITS, S, ZL>(src, column.data() + g * B8);
      }
      column_rows<V, 8, S, Z, ZL>(0, M, column.data(), G, qa, K, y, ldy, nb * ROWS, N, accumulate, Fetch::cached, epi);
    }
    V::tiles_end();
    epi.done();
  });
}

struct NoEpis {   // the plain GEMM's epilogues (one type: every plain caller shares one instantiation)
  NoEpi operator()() const { return {}; }
};

template <class V, int BITS, typename S, int Z, int ZL>
void gemm(const uint8_t* w, int64_t N, int64_t K, int64_t M, const QuantActs& qa, float* y, int64_t ldy,
          bool accumulate) {
  gemm<V, BITS, S, Z, ZL>(w, N, K, M, qa, y, ldy, accumulate, NoEpis{});
}

template <class V, typename C>
void store_row(C* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += V::W) V::store(dst + i, V::load(src + i));
}

// ---- the output layer's top logits in float32 ----------------------------------------------
// The GEMM rounds each activation row to int8 per 32-group; on the output layer that rounding
// moves every logit by a little, and the tokens near the top carry the probability. So after
// the GEMM, the logits within `margin` of a row's maximum (at most `cap` of them, the largest)
// are computed again from the same codes against the float32 activations: the exact product of
// the stored weights, as the float32 mode computes it (up to summation order).

// <row n of the packed matrix, x> in float32; xs[g] = sum of x over group g
template <class V, int BITS, typename S, int ZL>
float exact_row_dot(const uint8_t* w, int64_t G, int64_t n, const float* x, const float* xs) {
  constexpr int64_t CODE_BYTES = code_bytes_of(BITS), BLOCK = block_bytes<BITS, S, ZL>();
  const uint8_t* col = w + (n / ROWS) * G * BLOCK;
  const int64_t ri = n % ROWS;
  alignas(64) uint8_t q[GROUP];
  typename V::F acc = V::zero();
  float offset = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = col + g * BLOCK;
    if constexpr (BITS == 4 || BITS == 5) {   // byte (c, row, j): code(8c + j) | code(8c + 4 + j) << 4
      for (int c = 0; c < 4; ++c) {
        uint32_t u;
        std::memcpy(&u, wp + c * 64 + ri * 4, 4);
        const uint32_t lo = u & 0x0F0F0F0Fu, hi = (u >> 4) & 0x0F0F0F0Fu;
        std::memcpy(q + 8 * c, &lo, 4);
        std::memcpy(q + 8 * c + 4, &hi, 4);
      }
      if constexpr (BITS == 5)   // plane byte (row, j), bit c: the fifth bit of code(4c + j)
        for (int j = 0; j < 4; ++j) {
          const uint8_t h = wp[256 + ri * 4 + j];
          for (int c = 0; c < 8; ++c) q[4 * c + j] |= (uint8_t)(((h >> c) & 1) << 4);
        }
    } else {                     // bytes (c, row, j) = code(4c + j)
      for (int c = 0; c < 8; ++c) std::memcpy(q + 4 * c, wp + c * 64 + ri * 4, 4);
    }
    typename V::F dot = V::zero();
    for (int j = 0; j < GROUP; j += V::W) dot = V::fma(V::load_u8(q + j), V::load(x + g * GROUP + j), dot);
    const S* sc = (const S*)(wp + CODE_BYTES);
    acc = V::fma(dot, V::set1((float)sc[ri]), acc);   // a * <q, x>
    offset += (ZL > 0 ? (float)sc[ri] * -(float)ZL : (float)sc[ROWS + ri]) * xs[g];   // b * sum(x)
  }
  return V::hsum(acc) + offset;
}

using Scored = std::pair<float, int32_t>;   // (value, index)

// a before b: the larger value; of equal values, the lower index
inline bool larger(const Scored& a, const Scored& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); }

// cand = the `cap` largest entries of row[0, N) above `thr` (fewer if fewer are), unordered.
// When more than 4 cap have gathered, the cap largest so far are kept and the threshold rises to
// the smallest of them, so a flat row costs about one vector compare per element. Returns the
// final threshold: every entry left out is at most it.
template <class V>
float largest_above(const float* row, int64_t N, float thr, int64_t cap, std::vector<Scored>& cand) {
  cand.clear();
  if (cap <= 0) return INFINITY;
  typename V::F tv = V::set1(thr);
  const auto keep_largest = [&]() {
    std::nth_element(cand.begin(), cand.begin() + (cap - 1), cand.end(), larger);
    cand.resize(cap);
    thr = std::max(thr, cand[cap - 1].first);
    tv = V::set1(thr);
  };
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) {
    for (uint32_t bits = V::gt_bits(V::load(row + v), tv); bits; bits &= bits - 1) {
      const int64_t t = v + __builtin_ctz(bits);
      cand.emplace_back(row[t], (int32_t)t);
    }
    if ((int64_t)cand.size() > 4 * cap) keep_largest();
  }
  for (; v < N; ++v)
    if (row[v] > thr) cand.emplace_back(row[v], (int32_t)v);
  if ((int64_t)cand.size() > cap) keep_largest();
  return thr;
}

// the row's candidates: its logits within `margin` of its maximum, the `cap` largest, in index
// order; *bound: every other logit is at most it. False if the row has no finite maximum.
template <class V>
bool refine_candidates(const float* row, int64_t N, float margin, int64_t cap, std::vector<Scored>& cand,
                       float* bound) {
  typename V::F m = V::set1(-INFINITY);
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) m = V::max(m, V::load(row + v));
  float mx = V::hmax(m);
  for (int64_t t = v; t < N; ++t) mx = std::max(mx, row[t]);
  if (!std::isfinite(mx)) return false;
  *bound = largest_above<V>(row, N, mx - margin, cap, cand);
  std::sort(cand.begin(), cand.end(), [](const Scored& a, const Scored& b) { return a.second < b.second; });
  return true;   // in index order: rows near each other in memory come together
}

// the candidates' logits (in index order) computed again from the packed codes, in place (row
// null: a GEMM that kept no logits, only the argmax is wanted); returns the best where it is
// above bound (every other logit is at most bound), else -1
template <class V, int BITS, typename S, int ZL>
int64_t refine_listed(float* row, const float* x, int64_t K, const uint8_t* w, const std::vector<Scored>& cand,
                      std::vector<float>& xs, float bound) {
  const int64_t G = K / GROUP;
  xs.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    typename V::F s = V::zero();
    for (int j = 0; j < GROUP; j += V::W) s = V::add(s, V::load(x + g * GROUP + j));
    xs[g] = V::hsum(s);
  }
  int64_t best = -1;
  float top = 0.0f;
  for (const Scored& c : cand) {   // in index order: the first of equal values stays
    const float v = exact_row_dot<V, BITS, S, ZL>(w, G, c.second, x, xs.data());
    if (row) row[c.second] = v;
    if (best < 0 || v > top) best = c.second, top = v;
  }
  return best >= 0 && top > bound ? best : -1;
}

// one row of logits [N], in place, from the packed matrix w. Returns the row's argmax after the
// refinement (of equal values the lower index, as torch's argmax) where the refinement decides
// it, that is where its best value is above every logit it left alone; else -1.
template <class V, int BITS, typename S, int ZL>
int64_t refine_row(float* row, int64_t N, const float* x, int64_t K, const uint8_t* w, float margin, int64_t cap,
                   std::vector<Scored>& cand, std::vector<float>& xs) {
  float bound;
  if (!refine_candidates<V>(row, N, margin, cap, cand, &bound)) return -1;
  return refine_listed<V, BITS, S, ZL>(row, x, K, w, cand, xs, bound);
}

// The same refinement with the candidates gathered by the output layer's GEMM itself (qgemm_top):
// refine_candidates' two passes over a row (its maximum, then the entries within the margin)
// read 2 x 1 MB of each of Gemma 3's rows back from memory, ~1.2 ms of a 32-row step. Instead
// each GEMM tile hands every vector of logits it stores to TopTrack while it is in registers, one
// compare against the row's threshold in the thread's TopRow. A thread keeps the entries at or
// above that threshold, which only rises: the row's maximum so far (in the thread) minus the
// margin, and once more than 4 cap have gathered, the smallest of its cap largest, the ones it
// keeps. Every entry the full scan chooses (the cap largest, value then lower index first, of
// those above the maximum minus the margin) is kept by the thread that computed it: an entry a
// thread leaves out or drops has cap larger ones in the same thread. So the union over threads,
// cut as largest_above cuts a row, is the same set, refined by the same dots: the same bits as
// refine_row. A row with a NaN takes refine_row itself (NaN decides the maximum by position there).
struct alignas(64) TopRow {   // one row's candidates in one thread, a line of its own (read every tile)
  float mx, thr, cut;  // largest value seen, the threshold, the highest cut a prune set
  bool nan;
  std::vector<Scored> cand;
  void reset() {
    mx = thr = cut = -INFINITY;
    nan = false;
    cand.clear();
  }
};

//
// The logits are stored past the caches: a 32-row step of Gemma 3 writes 33.5 MB of them, more
// than L3, and an ordinary store first reads each line in. Its output layer took 17.8 instead of
// 18.3 ms (best of 25; medians 20.2 and 22.8), 6.2 instead of 6.4 at 8 rows, with a sampler's
// pass over the rows afterwards no slower at 1, 8 or 32 rows (Zen 4, 2 threads).
//
// AVX-512 only (kTopInTiles): the AVX2 variant's 8-bit tiles use all 16 of its registers, and
// with the compare in them (or the epilogue's state passed through the tile functions at all,
// which GCC then inlined differently) its output matrix ran 1.5x slower from 4 rows on; there
// qgemm_top is the GEMM and refine_row, as before.
template <class V>
constexpr bool kTopInTiles = sizeof(typename V::F) == 64;

template <class V>
struct TopTrack {   // the GEMM epilogue of one chunk: rows[m] is this thread's TopRow of row m
  static constexpr bool kStream = true;   // whole cache lines: 16 floats
  TopRow* rows;
  float margin;
  int64_t cap;
  bool store = true;   // false: the logits are not kept (a greedy step wants only the argmax)

  bool stores() const { return store; }

  LOOM_INLINE void operator()(int64_t m, int64_t n0, typename V::F v, int64_t n) const {
    uint32_t bits = V::nlt_bits(v, V::set1(rows[m].thr));   // v >= thr, or NaN
    if (n < V::W) bits &= (1u << n) - 1;
    if (bits) take(rows[m], n0, v, bits);
  }

  void done() const { _mm_sfence(); }   // the chunk's streamed stores, before the GEMM returns

  __attribute__((noinline)) void take(TopRow& r, int64_t n0, typename V::F v, uint32_t bits) const {
    alignas(64) float vals[V::W];
    V::store(vals, v);
    for (; bits; bits &= bits - 1) {
      const int l = __builtin_ctz(bits);
      if (std::isnan(vals[l])) {
        r.nan = true;
        continue;
      }
      r.cand.emplace_back(vals[l], (int32_t)(n0 + l));
      r.mx = std::max(r.mx, vals[l]);
    }
    r.thr = std::max(r.thr, r.mx - margin);
    if ((int64_t)r.cand.size() > 4 * cap) {
      std::nth_element(r.cand.begin(), r.cand.begin() + (cap - 1), r.cand.end(), larger);
      r.cand.resize(cap);
      r.cut = std::max(r.cut, r.cand[cap - 1].first);
      r.thr = std::max(r.thr, r.cut);
    }
  }
};

// refine_row for row r of a GEMM whose T threads tracked it (rows[t * M + r]): the candidates
// merged, the same set refined. The argmax is returned where the best refined value is above
// every entry left alone, as refine_row's; the bound here can be higher than refine_row's only
// where a thread pruned entries within the margin of the maximum and exactly cap of them remain
// (a prune's cut then bounds what it left out), and the caller then scans the row itself. row
// null (the GEMM kept no logits): a row with a NaN, which refine_row would scan, gets -1 too.
template <class V, int BITS, typename S, int ZL>
int64_t refine_tracked(float* row, int64_t N, const float* x, int64_t K, const uint8_t* w, float margin,
                       int64_t cap, const TopRow* rows, int64_t T, int64_t M, int64_t r, std::vector<Scored>& cand,
                       std::vector<float>& xs) {
  float mx = -INFINITY, cut = -INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    const TopRow& tr = rows[t * M + r];
    if (tr.nan) return row ? refine_row<V, BITS, S, ZL>(row, N, x, K, w, margin, cap, cand, xs) : -1;
    mx = std::max(mx, tr.mx);
    cut = std::max(cut, tr.cut);
  }
  if (!std::isfinite(mx)) return -1;
  const float thr = mx - margin;
  cand.clear();
  for (int64_t t = 0; t < T; ++t)
    for (const Scored& c : rows[t * M + r].cand)
      if (c.first > thr) cand.push_back(c);
  float bound = std::max(thr, cut);   // every entry not in cand is at most it
  if ((int64_t)cand.size() > cap) {
    std::nth_element(cand.begin(), cand.begin() + (cap - 1), cand.end(), larger);
    cand.resize(cap);
    bound = std::max(bound, cand[cap - 1].first);
  }
  std::sort(cand.begin(), cand.end(), [](const Scored& a, const Scored& b) { return a.second < b.second; });
  return refine_listed<V, BITS, S, ZL>(row, x, K, w, cand, xs, bound);
}

// out[0, k) = the indices of row's k largest entries, largest first (ties: the lower index);
// entries that are NaN or -inf come last, in index order, when fewer than k others exist
template <class V>
void topk_row(const float* row, int64_t N, int64_t k, int64_t* out, std::vector<Scored>& cand) {
  largest_above<V>(row, N, -INFINITY, k, cand);
  std::sort(cand.begin(), cand.end(), larger);
  int64_t n = 0;
  for (const Scored& c : cand) out[n++] = c.second;
  for (int64_t t = 0; n < k && t < N; ++t)
    if (!(row[t] > -INFINITY)) out[n++] = t;
}

// ---- attention over the paged cache --------------------------------------------------------
// One query token per row. Row r has the key slots slots[r, :ctx[r]] (its context in position
// order); with window W it sees only the last W, or, where per-row first keys are given (a
// sliding-window layer over a list with evicted entries, whose last W entries span more than W
// positions), the keys first[r] .. ctx[r] - 1. Rows come in groups (a sequence's new tokens):
// the rows of group g agree on their first shared[g] slots, whose keys and values are
// converted to float once per (group, kv head, part) and used by every query head of every
// row in the group; each row's keys past the shared part (its own draft nodes) are handled
// per row. Cache rows are read through their format C (loom_kernels_kv.h), KB at a time; a plain
// format's value rows in place (float16 converted in the register tile that uses them).
//
// Split across keys (flash-decoding): a row's keys are cut at fixed positions into parts of
// SPLIT keys, [0, SPLIT), [SPLIT, 2 SPLIT), ...; a work item is one (group, part, kv head), so
// one long sequence spreads over every thread. Per item, in steps:
//
//   QK       s[i, t] for query i = (row, head) and the part's keys t (shared, then the row's own)
//   softmax  e = exp(s - m) over the row's visible keys in the part, m their max, l = sum e
//   PV       o = sum over the part's keys of e * v, in key order
//
// then per query the parts are combined in order: out = sum_p w_p o_p / sum_p w_p l_p with
// w_p = exp(m_p - max m). Every sum runs in an order fixed by key position (key t in lane t % 16
// of the softmax sums, parts at fixed positions combined in order), never by the thread count
// or the batch, so a row's result has the same bits however it is batched.

constexpr int KB = 16;           // shared keys converted to float at a time
constexpr int64_t SPLIT = 256;   // keys per part (a multiple of KB)
constexpr int64_t PART_O = 16;   // a partial result: m, l, then o from this offset (whole lines)

template <class C>
struct PagedAttn {   // attn_decode's arguments (see there) as raw pointers
  const float* q;
  int64_t ldq;
  const uint8_t *kc, *vc;        // row (slot, kv head) at lay.offset(slot, kh) (loom_kernels_kv.h)
  CacheLayout lay;
  const int64_t* slots;
  int64_t lds;
  const int64_t *ctx, *group_start, *shared;
  int64_t NG, H, Hkv, D;
  float scale;
  int64_t window;
  const int64_t* first_key;      // per row: its first visible key, or null (the window decides)
  float* out;
  float* part;                   // partial results [rows from part_row0][H][NP][PS] (PS = PART_O + D)
  int64_t NP, PS, part_row0;
  float* partial(int64_t row, int64_t h, int64_t p) const { return part + (((row - part_row0) * H + h) * NP + p) * PS; }
  const uint8_t* row(const uint8_t* cache, int64_t slot, int64_t kh) const { return cache + lay.offset(slot, kh); }
  int64_t first(int64_t row) const {
    if (first_key) return first_key[row];
    return window > 0 ? std::max<int64_t>(0, ctx[row] - window) : 0;
  }
};

struct AttnItem {   // one (row group, part, kv head) and the buffers of its steps
  int64_t r0, nr, m, kh, P, k1, lo, n;   // rows, queries, shared length, part end, first key, scores per query
  const int64_t* shared_slots;           // the group's slots from key lo
  std::vector<int64_t> first;            // per row: its first visible key
  std::vector<const float*> q;           // per query i = (row, head)
  std::vector<int64_t> ctx;              // per query: its row's context length
  std::vector<float*> ml;                // per query: its partial result of this part (m, l, o)
  std::vector<float*> out;               // per query: o
  std::vector<float> mem;                // holds, from 64-byte boundaries (whole cache lines per vector):
  float* kv;                             //   KB keys or values as float rows of D
  float* scores;                         //   [m, n]
  float* qrot;                           //   [m, D] rotated queries (rotated formats)
};

template <class C>
void plan_item(const PagedAttn<C>& a, int64_t grp, int64_t p, int64_t kh, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, D = a.D;
  it.kh = kh;
  it.r0 = a.group_start[grp];
  it.nr = a.group_start[grp + 1] - it.r0;
  it.m = it.nr * G;
  it.P = a.shared[grp];
  it.first.resize(it.nr);
  it.q.resize(it.m);
  it.ctx.resize(it.m);
  it.ml.resize(it.m);
  it.out.resize(it.m);
  const int64_t k0 = p * SPLIT;
  int64_t lo = INT64_MAX, maxL = 0;
  for (int64_t r = 0; r < it.nr; ++r) {
    it.first[r] = a.first(it.r0 + r);
    lo = std::min(lo, it.first[r]);
    maxL = std::max(maxL, a.ctx[it.r0 + r]);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g, h = kh * G + g;
      it.q[i] = a.q + (it.r0 + r) * a.ldq + h * D;
      it.ctx[i] = a.ctx[it.r0 + r];
      it.ml[i] = a.partial(it.r0 + r, h, p);
      it.out[i] = it.ml[i] + PART_O;
    }
  }
  it.lo = std::max(k0, lo - lo % KB);   // key t always sits in lane t % W of the softmax sums
  it.k1 = std::min(k0 + SPLIT, maxL);
  it.n = it.k1 - it.lo;
  it.shared_slots = a.slots + it.r0 * a.lds + it.lo;
  const size_t floats = KB * D + it.m * (it.n + D) + 64;
  if (it.mem.size() < floats) it.mem.resize(floats);   // grows only: no zeroing of a reused buffer per item
  it.kv = (float*)(((uintptr_t)it.mem.data() + 63) & ~(uintptr_t)63);
  it.scores = it.kv + KB * D + 16;   // one line apart: its stores do not 4K-alias the kv rows' loads
  it.qrot = it.scores + it.m * it.n;
  if constexpr (C::kRotated)
    for (int64_t i = 0; i < it.m; ++i) {
      std::copy(it.q[i], it.q[i] + D, it.qrot + i * D);
      hadamard(it.qrot + i * D, D);
      it.q[i] = it.qrot + i * D;
    }
}

// the head size: a compile-time constant for the fixed sizes (NV = D / W vectors), else a.D
template <class V, int NV, class C>
inline int64_t head_dim(const PagedAttn<C>& a) {
  if constexpr (NV > 0) return V::W * NV;
  else return a.D;
}

// whether any of the queries i0 .. i0 + n - 1 has keys at or past key t
inline bool reaches(const AttnItem& it, int64_t i0, int64_t n, int64_t t) {
  for (int64_t i = i0; i < i0 + n; ++i)
    if (it.ctx[i] > t) return true;
  return false;
}

// the rows of the mm keys (or values) at slots[0 .. mm) of kv head it.kh of a cache: a plain
// format's rows in place, a quantized format's converted into it.kv
template <class V, int NV, class C>
inline void cache_rows(const PagedAttn<C>& a, AttnItem& it, const uint8_t* cache, const int64_t* slots, int64_t mm,
                       const typename C::Elem** rows) {
  const int64_t D = head_dim<V, NV>(a);
  for (int64_t r = 0; r < mm; ++r) {
    const uint8_t* src = a.row(cache, slots[r], it.kh);
    if constexpr (C::kInPlace) {
      rows[r] = (const typename C::Elem*)src;
    } else {
      C::template load<V>(src, D, it.kv + r * D);
      rows[r] = it.kv + r * D;
    }
  }
}

constexpr int QK_QT = 4;   // queries per score tile

// Score tiles: QT queries (a decode row's query heads share its keys) x KT keys, one
// accumulator each, QT KT <= W: a key vector is loaded (and converted from float16) once for
// the QT queries, a query vector once for the KT keys. Each score is one FMA chain over the
// head's vectors in order, its lanes summed by V::reduce's fixed tree, then scaled: the same
// bits for every tile shape, so a key's score does not depend on which queries share its tile.
template <class V, int QT>
constexpr int qk_keys() {
  int kt = V::W;
  while (kt > 1 && QT * kt > V::W) kt /= 2;
  return kt;
}

// s[t * stride + r] = scale <q[t], rows[r]> for t < QT, r < kt (kt <= KT keys)
template <class V, int NV, int QT, int KT, bool FULL, typename T>
LOOM_INLINE void qk_tile(const float* const* q, const T* const* rows, int64_t Drt, int64_t kt, float* s,
                         int64_t stride, typename V::F sv) {
  const int64_t nv = (NV > 0 ? V::W * NV : Drt) / V::W;
  typename V::F acc[V::W];
  for (int i = 0; i < V::W; ++i) acc[i] = V::zero();
  for (int64_t j = 0; j < nv; ++j) {
    typename V::F qv[QT];
    for (int t = 0; t < QT; ++t) qv[t] = V::load(q[t] + V::W * j);
    for (int r = 0; r < KT; ++r) {
      if (!FULL && r >= kt) break;
      const typename V::F k = V::load(rows[r] + V::W * j);
      for (int t = 0; t < QT; ++t) acc[t * KT + r] = V::fma(qv[t], k, acc[t * KT + r]);
    }
  }
  if constexpr (QT == 1) {
    V::store_n(s, V::mul(V::reduce(acc), sv), FULL ? KT : kt);
    return;
  }
  alignas(64) float sum[V::W];
  V::store(sum, V::mul(V::reduce(acc), sv));
  for (int t = 0; t < QT; ++t)
    for (int r = 0; r < (FULL ? KT : kt); ++r) s[t * stride + r] = sum[t * KT + r];
}

// scores of QT queries for the mm keys at rows, from s (query t's at s + t * stride)
template <class V, int NV, int QT, typename T>
LOOM_INLINE void qk_block(const float* const* q, const T* const* rows, int64_t D, int64_t mm, float* s,
                          int64_t stride, typename V::F sv) {
  constexpr int KT = qk_keys<V, QT>();
  int64_t r0 = 0;
  for (; r0 + KT <= mm; r0 += KT) qk_tile<V, NV, QT, KT, true>(q, rows + r0, D, KT, s + r0, stride, sv);
  if (r0 < mm) qk_tile<V, NV, QT, KT, false>(q, rows + r0, D, mm - r0, s + r0, stride, sv);
}

// the blocks for n = 1 .. QK_QT queries
template <class V, int NV, typename T, int QT = QK_QT>
inline void qk_queries(int64_t n, const float* const* q, const T* const* rows, int64_t D, int64_t mm, float* s,
                       int64_t stride, typename V::F sv) {
  if constexpr (QT > 1)
    if (n < QT) return qk_queries<V, NV, T, QT - 1>(n, q, rows, D, mm, s, stride, sv);
  qk_block<V, NV, QT>(q, rows, D, mm, s, stride, sv);
}

// A decode batch's cache rows come from memory (32 rows of a few hundred keys are more than L3)
// in runs of a block's rows (CacheLayout) scattered over the cache, which the hardware
// prefetchers do not follow from one run to the next: the
// QK loop asks for the key rows PF_BYTES of rows ahead of the ones it converts (one block of
// SmolLM2's 128-byte rows, 4 keys of Gemma 3's 512-byte ones), and for the value rows of its
// block, which PV reads after the softmax. Into L2 (T2): T0 requests, which hold an L1 miss
// buffer each, stalled the loop at 5 GB/s of rows on Zen 4; T2 doubled the rate of SmolLM2's
// 32-row batch (benchmarks/attn_batch.py). Prefetches change no arithmetic.
constexpr int64_t PF_BYTES = 2048;

// prefetch the rows at slots[0 .. n) of kv head kh of a cache
template <class C>
LOOM_INLINE void prefetch_rows(const PagedAttn<C>& a, const uint8_t* cache, const int64_t* slots, int64_t n,
                               int64_t kh) {
  for (int64_t r = 0; r < n; ++r) {   // every line the row touches (quantized rows are not aligned)
    const uintptr_t p = (uintptr_t)a.row(cache, slots[r], kh);
    for (uintptr_t line = p & ~(uintptr_t)63; line < p + a.lay.rb; line += 64) _mm_prefetch((const char*)line, _MM_HINT_T2);
  }
}

// W scores <q, k_r> for the keys in buf (rows of D floats); NV = D / W when fixed, else 0. The
// one-query case of qk_tile, kept apart: over a float buffer its fixed row stride compiles to
// immediate offsets, where qk_tile's row pointers measured ~10% slower on SmolLM2's batches.
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

// scores of query i for the mm keys in buf, stored at s
template <class V, int NV>
LOOM_INLINE void scores_of(const float* qh, const float* buf, int64_t D, int64_t mm, float* s, typename V::F sv) {
  for (int64_t h = 0; h < mm; h += V::W) {
    const float* kb = buf + h * D;
    const typename V::F sc = mm - h >= V::W ? qk<V, NV, true>(qh, kb, D, V::W) : qk<V, NV, false>(qh, kb, D, mm - h);
    V::store_n(s + h, V::mul(sc, sv), mm - h);
  }
}

// Score tiles pay where one tile of queries uses the keys (a decode row's heads) and a head is
// long: the keys are then read in place, never converted into a buffer. Gemma 3's 256-float
// heads: 1.05-1.15x on its decode batches (benchmarks/attn_batch.py). Elsewhere the keys are
// converted to float once and each query takes W keys at a time: SmolLM2's 64-float heads (4
// vectors on AVX-512, 8 on AVX2), where a tile's lane sums cost more than its FMAs save
// (0.94-0.97x on its AVX2 batches), and a prefill chunk's rows, which share every converted key
// (tiles over the float keys made Gemma 3's 512-token prefill attention 5-8% slower). Either way
// a score is the same FMA chain and lane sums, so the same bits.
constexpr int64_t QK_TILE_VECTORS = 16;

// scores of the queries i0 .. i0 + n - 1 for the mm keys at slots, query i0's from s, each
// next query's it.n further; query tiles for which skip(i, q) holds are left out
template <class V, int NV, class C, class Skip>
LOOM_INLINE void block_scores(const PagedAttn<C>& a, AttnItem& it, const int64_t* slots, int64_t mm, int64_t i0,
                              int64_t n, float* s, Skip skip) {
  const int64_t D = head_dim<V, NV>(a);
  const typename V::F sv = V::set1(a.scale);
  if (n <= QK_QT && D >= QK_TILE_VECTORS * V::W) {
    const typename C::Elem* rows[KB];
    cache_rows<V, NV>(a, it, a.kc, slots, mm, rows);
    if (!skip(i0, n)) qk_queries<V, NV>(n, it.q.data() + i0, rows, D, mm, s, it.n, sv);
    return;
  }
  for (int64_t r = 0; r < mm; ++r) C::template load<V>(a.row(a.kc, slots[r], it.kh), D, it.kv + r * D);
  for (int64_t i = i0; i < i0 + n; ++i)
    if (!skip(i, 1)) scores_of<V, NV>(it.q[i], it.kv, D, mm, s + (i - i0) * it.n, sv);
}

// QK, shared keys of the part: every query, KB keys at a time
template <class V, int NV, class C>
void shared_scores(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t Ls = std::min(it.k1, it.P) - it.lo;
  const int64_t dk = std::max<int64_t>(1, PF_BYTES / a.lay.rb);   // keys ahead
  prefetch_rows(a, a.kc, it.shared_slots, std::min(Ls, dk), it.kh);
  for (int64_t l0 = 0; l0 < Ls; l0 += KB) {
    const int64_t mm = std::min<int64_t>(KB, Ls - l0), ahead = l0 + dk;
    if (ahead < Ls) prefetch_rows(a, a.kc, it.shared_slots + ahead, std::min<int64_t>(KB, Ls - ahead), it.kh);
    prefetch_rows(a, a.vc, it.shared_slots + l0, mm, it.kh);
    // queries whose rows' contexts all end before these keys are skipped
    block_scores<V, NV>(a, it, it.shared_slots + l0, mm, 0, it.m, it.scores + l0,
                        [&](int64_t i, int64_t q) { return !reaches(it, i, q, it.lo + l0); });
  }
}

// QK, each row's own keys in the part (past the shared ones), KB at a time through the same dot
// product as the shared keys, so a key's score has the same bits whether it is shared or not
template <class V, int NV, class C>
void tail_scores(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t G = a.H / a.Hkv;
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r, L = std::min(a.ctx[row], it.k1);
    for (int64_t t0 = std::max({it.P, it.first[r], it.lo}); t0 < L; t0 += KB)
      block_scores<V, NV>(a, it, a.slots + row * a.lds + t0, std::min<int64_t>(KB, L - t0), r * G, G,
                          it.scores + r * G * it.n + t0 - it.lo, [](int64_t, int64_t) { return false; });
  }
}

// p[0, n) -> exp(p - m) over the lanes [a0, a1), zero elsewhere; ml = (m, sum); m = -inf and
// all zero when no lane is visible
template <class V>
void softmax_part(float* p, int64_t n, int a0, int a1, float* ml) {
  using F = typename V::F;
  if (a1 <= a0) {
    std::fill(p, p + n, 0.0f);
    ml[0] = -INFINITY;
    ml[1] = 0.0f;
    return;
  }
  F mxv = V::set1(-INFINITY);
  for (int64_t l = 0; l < n; l += V::W) mxv = V::max_where(V::in_ranges(l, a0, a1, 0, 0), mxv, V::load_n(p + l, n - l));
  const float m = V::hmax(mxv);
  const F mv = V::set1(m);
  F sum = V::zero();
  for (int64_t l = 0; l < n; l += V::W) {
    const F e = V::keep(V::in_ranges(l, a0, a1, 0, 0), vexp<V>(V::sub(V::load_n(p + l, n - l), mv)));
    V::store_n(p + l, e, n - l);
    sum = V::add(sum, e);
  }
  ml[0] = m;
  ml[1] = V::hsum(sum);
}

// out[t][W j0 .. W (j0 + NJ)) += sum_r w[t][r] * rows[r][same columns] for QT queries (weights
// p + t * stride), mm value rows (float32, or float16 read in place)
template <class V, int NJ, int QT, typename T>
LOOM_INLINE void pv_tile(float* const* out, const float* p, int64_t stride, const T* const* rows, int64_t j0,
                         int64_t mm) {
  typename V::F acc[QT][NJ];
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) acc[t][j] = V::load(out[t] + V::W * (j0 + j));
  for (int64_t r = 0; r < mm; ++r) {
    const T* vr = rows[r] + V::W * j0;
    typename V::F v[NJ];
    for (int j = 0; j < NJ; ++j) v[j] = V::load(vr + V::W * j);
    for (int t = 0; t < QT; ++t) {
      const typename V::F w = V::set1(p[t * stride + r]);
      for (int j = 0; j < NJ; ++j) acc[t][j] = V::fma(w, v[j], acc[t][j]);
    }
  }
  for (int t = 0; t < QT; ++t)
    for (int j = 0; j < NJ; ++j) V::store(out[t] + V::W * (j0 + j), acc[t][j]);
}

// Value tiles: up to PV_QT queries (a decode row's query heads: 3 for SmolLM2, 4 for Gemma 3)
// x NJ vectors of the row, at most V::PV_ACC accumulators, so each value vector is loaded (and
// converted from float16) once for all of them. Every output element is still one sequential
// FMA chain over the keys in key order: the tiling changes which loads are shared, not a sum.
constexpr int PV_QT = 4;

template <class V, int NV, int QT>
constexpr int pv_nj() {
  int nj = NV;
  while (nj > 1 && QT * nj > V::PV_ACC) nj /= 2;
  return nj;
}

// the tiles of QT queries (out, weights p) across the NV vectors of the rows
template <class V, int NV, int QT, typename T>
LOOM_INLINE void pv_tiles(float* const* out, const float* p, int64_t stride, const T* const* rows, int64_t mm) {
  constexpr int NJ = pv_nj<V, NV, QT>();
  static_assert(NV % NJ == 0, "fixed head sizes are whole value tiles");
  for (int64_t j0 = 0; j0 < NV; j0 += NJ) pv_tile<V, NJ, QT>(out, p, stride, rows, j0, mm);
}

// the tiles for q = 1 .. PV_QT queries
template <class V, int NV, typename T, int QT = PV_QT>
inline void pv_queries(int64_t q, float* const* out, const float* p, int64_t stride, const T* const* rows, int64_t mm) {
  if constexpr (QT > 1)
    if (q < QT) return pv_queries<V, NV, T, QT - 1>(q, out, p, stride, rows, mm);
  pv_tiles<V, NV, QT>(out, p, stride, rows, mm);
}


// PV of q queries from i0 over mm value rows, weights p (query i0's, then every stride): fixed
// head sizes in value tiles, other sizes one query and vector at a time
template <class V, int NV, typename T>
inline void pv_block(AttnItem& it, int64_t i0, int64_t q, const float* p, int64_t stride, const T* const* rows,
                     int64_t mm, int64_t D) {
  if constexpr (NV > 0) {
    pv_queries<V, NV>(q, it.out.data() + i0, p, stride, rows, mm);
  } else {
    for (int64_t t = 0; t < q; ++t) {
      float* oh = it.out[i0 + t];
      for (int64_t r = 0; r < mm; ++r) {
        const typename V::F w = V::set1(p[t * stride + r]);
        for (int64_t j = 0; j < D; j += V::W) V::store(oh + j, V::fma(w, V::load(rows[r] + j), V::load(oh + j)));
      }
    }
  }
}

// PV, shared keys of the part, KB at a time, into every query's o
template <class V, int NV, class C>
void shared_values(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t D = head_dim<V, NV>(a), stride = it.n, Ls = std::min(it.k1, it.P) - it.lo;
  const typename C::Elem* rows[KB];
  for (int64_t l0 = 0; l0 < Ls; l0 += KB) {
    const int64_t mm = std::min<int64_t>(KB, Ls - l0);
    cache_rows<V, NV>(a, it, a.vc, it.shared_slots + l0, mm, rows);
    for (int64_t i0 = 0; i0 < it.m; i0 += PV_QT) {
      const int64_t q = std::min<int64_t>(PV_QT, it.m - i0);
      if (reaches(it, i0, q, it.lo + l0))   // all-zero weights would add nothing
        pv_block<V, NV>(it, i0, q, it.scores + i0 * stride + l0, stride, rows, mm, D);
    }
  }
}

// PV, each row's own keys in the part, KB at a time, for the row's query heads
template <class V, int NV, class C>
void tail_values(const PagedAttn<C>& a, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, D = head_dim<V, NV>(a);
  const typename C::Elem* rows[KB];
  for (int64_t r = 0; r < it.nr; ++r) {
    const int64_t row = it.r0 + r, L = std::min(a.ctx[row], it.k1);
    for (int64_t t0 = std::max({it.P, it.first[r], it.lo}); t0 < L; t0 += KB) {
      const int64_t mm = std::min<int64_t>(KB, L - t0);
      cache_rows<V, NV>(a, it, a.vc, a.slots + row * a.lds + t0, mm, rows);
      for (int64_t g0 = 0; g0 < G; g0 += PV_QT) {
        const int64_t i0 = r * G + g0;
        pv_block<V, NV>(it, i0, std::min<int64_t>(PV_QT, G - g0), it.scores + i0 * it.n + t0 - it.lo, it.n, rows, mm, D);
      }
    }
  }
}

template <class V, int NV, class C>
void attn_item(const PagedAttn<C>& a, int64_t grp, int64_t p, int64_t kh, AttnItem& it) {
  const int64_t G = a.H / a.Hkv, D = head_dim<V, NV>(a);
  plan_item(a, grp, p, kh, it);
  shared_scores<V, NV>(a, it);
  tail_scores<V, NV>(a, it);
  for (int64_t i = 0; i < it.m; ++i) {
    const int64_t row = it.r0 + i / G;
    const int64_t a0 = std::max(a.first(row), it.lo) - it.lo, a1 = std::min(a.ctx[row], it.k1) - it.lo;
    softmax_part<V>(it.scores + i * it.n, it.n, (int)a0, (int)std::max(a0, a1), it.ml[i]);
    std::fill(it.out[i], it.out[i] + D, 0.0f);
  }
  shared_values<V, NV>(a, it);
  tail_values<V, NV>(a, it);
}

// out of query (row, head h): its parts combined in order, rotated back for rotated formats
template <class V, class C>
void combine_parts(const PagedAttn<C>& a, int64_t row, int64_t h, std::vector<float>& w) {
  const float* base = a.partial(row, h, 0);
  const int64_t p0 = a.first(row) / SPLIT, p1 = (a.ctx[row] + SPLIT - 1) / SPLIT;
  float M = -INFINITY, l = 0.0f;
  for (int64_t p = p0; p < p1; ++p) M = std::max(M, base[p * a.PS]);
  w.resize(p1 - p0);
  for (int64_t p = p0; p < p1; ++p) {
    w[p - p0] = std::exp(base[p * a.PS] - M);
    l += w[p - p0] * base[p * a.PS + 1];
  }
  const typename V::F inv = V::set1(1.0f / l);
  float* o = a.out + row * a.H * a.D + h * a.D;
  for (int64_t j = 0; j < a.D; j += V::W) {
    typename V::F acc = V::zero();
    for (int64_t p = p0; p < p1; ++p) acc = V::fma(V::set1(w[p - p0]), V::load(base + p * a.PS + PART_O + j), acc);
    V::store(o + j, V::mul(acc, inv));
  }
  if constexpr (C::kRotated) hadamard(o, a.D);
}

// Two schedules with the same arithmetic (so the same bits): few rows (decodes) spread every
// (group, part, kv head) over the threads, their partial results in one buffer, then combine;
// many rows (prefill chunks), whose partials for every part at once would be large, give each
// thread whole (group, kv head) items that run their parts in order and combine in place.
constexpr int64_t PARTIALS_MAX = 8 << 20;   // bytes of partial results for the first schedule

template <class V, int NV, class C>
void attn_impl(PagedAttn<C> a) {
  const int64_t G = a.H / a.Hkv;
  std::vector<std::pair<int64_t, int64_t>> parts;   // (group, part) of every item, times Hkv heads
  std::vector<int64_t> first_part(a.NG), end_part(a.NG);
  int64_t work_total = 0;
  a.NP = 1;
  for (int64_t g = 0; g < a.NG; ++g) {
    int64_t lo = INT64_MAX, maxL = 0;
    for (int64_t r = a.group_start[g]; r < a.group_start[g + 1]; ++r) {
      lo = std::min(lo, a.first(r));
      maxL = std::max(maxL, a.ctx[r]);
      work_total += a.H * a.D * (a.ctx[r] - a.first(r));   // every kv head's G queries
    }
    first_part[g] = lo / SPLIT;
    end_part[g] = (maxL + SPLIT - 1) / SPLIT;
    for (int64_t p = first_part[g]; p < end_part[g]; ++p) parts.emplace_back(g, p);
    a.NP = std::max(a.NP, end_part[g]);
  }
  const int64_t R = a.group_start[a.NG];
  a.PS = PART_O + a.D;
  a.part_row0 = 0;
  const int64_t items = (int64_t)parts.size() * a.Hkv;
  // Little work (a short context, one row) stays on one thread. Otherwise a chunk is at least
  // ~1<<17 of work, but a thread gets at least 4 chunks: with a few items of unequal size (a
  // context's last part holds a few keys), one whole-range chunk per thread had left one thread
  // all the full parts. SmolLM2, one row, two threads: 15-21 us at 257 keys and 27-38 at 513
  // before this split, 12 and 16 us with it (benchmarks/attn_chain.py).
  const int64_t per_item = std::max<int64_t>(1, work_total / std::max<int64_t>(1, items));
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t grain = work_total < (1 << 17)
                            ? std::max<int64_t>(1, items)
                            : std::max<int64_t>(1, std::min(items / (4 * threads), (1 << 17) / per_item));
  if (R * a.H * a.NP * a.PS * (int64_t)sizeof(float) <= PARTIALS_MAX) {
    thread_local std::vector<float> part_mem;   // reused across calls: no allocation on the hot path
    part_mem.resize(R * a.H * a.NP * a.PS + 16);
    a.part = (float*)(((uintptr_t)part_mem.data() + 63) & ~(uintptr_t)63);
    parallel_chunks(items, grain, [&](int64_t w0, int64_t w1) {
      thread_local AttnItem it;
      for (int64_t w = w0; w < w1; ++w) attn_item<V, NV>(a, parts[w / a.Hkv].first, parts[w / a.Hkv].second, w % a.Hkv, it);
    });
    at::parallel_for(0, R * a.H, std::max<int64_t>(1, (1 << 15) / (a.NP * a.D)), [&](int64_t q0, int64_t q1) {
      thread_local std::vector<float> w;
      for (int64_t q = q0; q < q1; ++q) combine_parts<V>(a, q / a.H, q % a.H, w);
    });
    return;
  }
  parallel_chunks(a.NG * a.Hkv, 1, [&](int64_t w0, int64_t w1) {
    thread_local AttnItem it;
    thread_local std::vector<float> mem, w;
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t g = work / a.Hkv, kh = work % a.Hkv, r0 = a.group_start[g], nr = a.group_start[g + 1] - r0;
      PagedAttn<C> b = a;   // partials of this group's rows only
      b.NP = end_part[g];
      mem.resize(nr * a.H * b.NP * a.PS + 16);
      b.part = (float*)(((uintptr_t)mem.data() + 63) & ~(uintptr_t)63);
      b.part_row0 = r0;
      for (int64_t p = first_part[g]; p < end_part[g]; ++p) attn_item<V, NV>(b, g, p, kh, it);
      for (int64_t r = r0; r < r0 + nr; ++r)
        for (int64_t h = kh * G; h < kh * G + G; ++h) combine_parts<V>(b, r, h, w);
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
