// The Python-facing functions of loom's kernels, shared by both variants: argument checks,
// dispatch over bit widths, scale and cache dtypes and head sizes, and the module table.
// A variant's source includes it after defining `loom::Isa`, its vector traits plus integer
// dot products (loom_kernels_simd.h, loom_kernels_loops.h).
#pragma once

#include "loom_kernels_loops.h"
#include "loom_kernels_sample.h"

namespace loom {

inline void check_f32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              name, " must be a float32 [rows, cols] tensor with contiguous rows");
}

// f(std::integral_constant<int, ZL>{}) for a matrix's zero point ZL (0: the affine layout)
template <int BITS, class F>
void with_zero(int64_t zero, F f) {
  if constexpr (BITS == 5) {   // five-bit codes are Q5_0's: zero point 16 (check_bits_zero)
    return f(std::integral_constant<int, 16>{});
  } else if constexpr (BITS == 4) {
    if (zero == 8) return f(std::integral_constant<int, 8>{});
  } else {
    if (zero == 16) return f(std::integral_constant<int, 16>{});
    if (zero == 128) return f(std::integral_constant<int, 128>{});
  }
  f(std::integral_constant<int, 0>{});
}

inline void check_bits_zero(int64_t bits, int64_t zero) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  TORCH_CHECK(bits == 5 ? zero == 16 : zero == 0 || (bits == 4 ? zero == 8 : zero == 16 || zero == 128),
              "zero must be 0 or 8 for 4-bit codes, 16 for 5-bit ones, 0, 16 or 128 for 8-bit ones");
}

// f(std::integral_constant<int, BITS>{}, S{}, std::integral_constant<int, ZL>{}) for a packed
// matrix's code width, scale type (at::Half where scales16, else float) and zero point
template <class F>
void with_layout(int64_t bits, bool scales16, int64_t zero, F f) {
  const auto with_scales = [&](auto b) {
    const auto go = [&](auto s) { with_zero<decltype(b)::value>(zero, [&](auto zl) { f(b, s, zl); }); };
    if (scales16) go(at::Half{});
    else go(float{});
  };
  if (bits == 4) with_scales(std::integral_constant<int, 4>{});
  else if (bits == 5) with_scales(std::integral_constant<int, 5>{});
  else with_scales(std::integral_constant<int, 8>{});
}

// y = pre(x) @ W^T (+ y if accumulate). x: [M, K] (or [M, 2K] for the gated pre-ops).
// w: the packed blocks (uint8); scales16: whether a and b are float16; zero: Z > 0 where every
// group's offset is b = -Z a (Q4_0: 8, Q5_0: 16, Q8_0: 128; the blocks then hold no b), else 0.
// The variant takes the integer zero-point path where it pays (Isa::zero_path: the AVX2 variant
// keeps full 8-bit codes on the affine one); either way a variant computes a row the same way at
// every M.

// qgemm's checks and GEMM, with the tiles' epilogues from epis() (see gemm); epilogues that store
// nothing (stores() false: no `out`, no accumulate) get no output: an [M, 0] tensor is returned
template <class Epis>
torch::Tensor run_qgemm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t bits, bool scales16,
                        int64_t pre, c10::optional<torch::Tensor> norm_w, double eps, c10::optional<torch::Tensor> out,
                        bool accumulate, int64_t zero, const Epis& epis) {
  check_f32_rows(x, "x");
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of 32");
  TORCH_CHECK(x.size(1) == ((pre == PRE_SWIGLU || pre == PRE_GEGLU) ? 2 * K : K), "x has the wrong width");
  check_bits_zero(bits, zero);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8, "packed weights must be contiguous uint8");
  const int64_t M = x.size(0);
  const bool store = epis().stores();
  TORCH_CHECK(store || (!out.has_value() && !accumulate), "a GEMM that stores nothing takes no out");
  torch::Tensor y = out.has_value() ? *out : torch::empty({M, store ? N : 0}, x.options());
  if (store) {
    check_f32_rows(y, "out");
    TORCH_CHECK(y.size(0) == M && y.size(1) == N, "out has the wrong shape");
  }
  if (M == 0) return y;
  const float* nw = nullptr;
  if (pre == PRE_RMSNORM) {
    TORCH_CHECK(norm_w.has_value() && norm_w->numel() == K && norm_w->is_contiguous(), "norm weight [K] needed");
    nw = norm_w->data_ptr<float>();
  }
  const int64_t blocks = (N + ROWS - 1) / ROWS * (K / GROUP);
  TORCH_CHECK(w.numel() == blocks * packed_block_bytes(bits, scales16 ? 2 : 4, zero),
              "packed weights do not match N, K, bits, zero");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = store ? y.data_ptr<float>() : nullptr;
  const int64_t ldy = store ? y.stride(0) : 0;
  thread_local QuantActs qa;  // reused across calls: no allocation on the hot path
  with_layout(bits, scales16, zero, [&](auto b, auto s, auto zl) {
    constexpr int BITS = decltype(b)::value, ZL = decltype(zl)::value, Z = Isa::template zero_path<BITS, ZL>() ? ZL : 0;
    // wide: the tiles' dot products take the codes widened to int16 as well
    const bool wide = M > 1 && Isa::template wide_codes<BITS, Isa::MT_MAX, Z>();
    const int64_t panel = Isa::amx_rows(M, BITS) ? Isa::AMX_ROWS : 0;   // AMX tiles take a panel's rows at once
    quantize_acts<Isa>(x.data_ptr<float>(), M, K, x.stride(0), pre, nw, (float)eps, qa, wide, Z, panel);
    gemm<Isa, BITS, decltype(s), Z, ZL>(wp, N, K, M, qa, yp, ldy, accumulate, epis);
  });
  return y;
}

torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t bits, bool scales16, int64_t pre, c10::optional<torch::Tensor> norm_w, double eps,
                    c10::optional<torch::Tensor> out, bool accumulate, int64_t zero) {
  return run_qgemm(x, w, N, K, bits, scales16, pre, norm_w, eps, out, accumulate, zero, NoEpis{});
}

// One head x [D] in place: RMSNorm by nw (none if null), then RoPE rotating x[i] with x[i + D/2]
// by the position's cos c and sin s [D]. Vector loops, a scalar tail where D/2 is not a multiple
// of the vector width; the norm's sum of squares is the lane-wise tree of sum_squares.
template <class V>
inline void norm_rope_head(float* x, const float* nw, float eps, const float* c, const float* s, int64_t D) {
  using F = typename V::F;
  const int64_t half = D / 2, vec = half / V::W * V::W;
  if (nw) {
    const float r = 1.0f / std::sqrt(sum_squares<V>(x, D) / (float)D + eps);
    const F rv = V::set1(r);
    for (int64_t i = 0; i < D; i += V::W) V::store(x + i, V::mul(V::mul(V::load(x + i), rv), V::load(nw + i)));
  }
  for (int64_t i = 0; i < vec; i += V::W) {
    const F x1 = V::load(x + i), x2 = V::load(x + i + half);
    V::store(x + i, V::sub(V::mul(x1, V::load(c + i)), V::mul(x2, V::load(s + i))));
    V::store(x + i + half, V::fma(x1, V::load(s + i + half), V::mul(x2, V::load(c + i + half))));
  }
  for (int64_t i = vec; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

// In place on qkv [T, (H + 2 Hkv) * D]: optional per-head RMSNorm of q and k heads, rotate-half
// RoPE of q and k at `positions` (tables [P, D]); then k and v are stored at the cache slots in
// the cache's format (kv_format: float32 or float16 caches as their dtype, or quantized rows,
// loom_kernels_kv.h).
void rope_store(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t H, int64_t Hkv,
                c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                int64_t kv_format) {
  check_f32_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv has the wrong width");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous and of one dtype");
  TORCH_CHECK(D % 16 == 0 && D <= 1024, "head_dim must be a multiple of 16, at most 1024");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float *ct = cos.data_ptr<float>(), *st = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  uint8_t *kc = (uint8_t*)k_cache.data_ptr(), *vc = (uint8_t*)v_cache.data_ptr();
  float* base = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  with_kv_format(k_cache, kv_format, [&](auto c) {
    using C = decltype(c);
    TORCH_CHECK(C::fits(D) && kv_head_dim<C>(k_cache) == D && k_cache.sizes() == v_cache.sizes(),
                "caches must be [slots, Hkv, D] or [blocks, Hkv, block_size, D] in their format");
    const CacheLayout lay = cache_layout(k_cache, Hkv, C::row_bytes(D));
    at::parallel_for(0, T, T < 8 ? T : 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* row = base + t * ld;
        const float* c = ct + pos[t] * D;
        const float* s = st + pos[t] * D;
        for (int64_t h = 0; h < H + Hkv; ++h) norm_rope_head<Isa>(row + h * D, h < H ? qn : kn, (float)eps, c, s, D);
        for (int64_t h = 0; h < Hkv; ++h) {
          kv_store_row<Isa, C>(kc + lay.offset(sl[t], h), row + (H + h) * D, D);
          kv_store_row<Isa, C>(vc + lay.offset(sl[t], h), row + (H + Hkv + h) * D, D);
        }
      }
    });
  });
}

// Attention of query rows over the paged cache (see loom_kernels_loops.h). q [R, >= H*D]
// float32 rows; slots [R, Lmax] int64; ctx [R]; groups [NG + 1] row starts and shared [NG],
// or both empty: every row its own group sharing its whole context. Caches in kv_format (as in
// rope_store). first [R] (optional): each row's first visible key, 0 <= first < ctx, in place of
// ctx - window (a sliding window by position over a key list with evicted entries).
torch::Tensor attn_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                          torch::Tensor ctx, int64_t H, int64_t Hkv, double scale, int64_t window,
                          c10::optional<torch::Tensor> groups, c10::optional<torch::Tensor> shared,
                          int64_t kv_format, c10::optional<torch::Tensor> first) {
  check_f32_rows(q, "q");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "the K and V caches must be of one shape and dtype");
  const int64_t R = q.size(0);
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.size(0) == R && slots.stride(1) == 1,
              "slots must be an int64 [rows, L] tensor");
  torch::Tensor cl_t = ctx.contiguous();
  TORCH_CHECK(cl_t.scalar_type() == torch::kInt64 && cl_t.numel() == R, "ctx must hold one int64 per row");
  torch::Tensor fk_t;
  if (first.has_value()) {
    fk_t = first->contiguous();
    TORCH_CHECK(fk_t.scalar_type() == torch::kInt64 && fk_t.numel() == R, "first must hold one int64 per row");
    const int64_t *fk = fk_t.data_ptr<int64_t>(), *cl = cl_t.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(0 <= fk[r] && fk[r] < cl[r], "first[", r, "] = ", fk[r], " is outside the row's keys 0 .. ", cl[r] - 1);
  }
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
  torch::Tensor out;
  with_kv_format(k_cache, kv_format, [&](auto c) {
    using C = decltype(c);
    const int64_t D = kv_head_dim<C>(k_cache);
    TORCH_CHECK(q.size(1) >= H * D && C::fits(D) && D <= 1024 && H % Hkv == 0,
                "q must hold H * D values per row, D a multiple of 16");
    const CacheLayout lay = cache_layout(k_cache, Hkv, C::row_bytes(D));
    out = torch::empty({R, H * D}, q.options());
    if (R == 0) return;
    auto run = [&](auto nv) {
      const PagedAttn<C> a{q.data_ptr<float>(), q.stride(0), (const uint8_t*)k_cache.data_ptr(),
                           (const uint8_t*)v_cache.data_ptr(), lay, slots.data_ptr<int64_t>(),
                           slots.stride(0), cl_t.data_ptr<int64_t>(), gs_t.data_ptr<int64_t>(),
                           sh_t.data_ptr<int64_t>(), NG, H, Hkv, D, (float)scale, window,
                           first.has_value() ? fk_t.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
                           nullptr, 0, 0, 0};
      attn_impl<Isa, decltype(nv)::value>(a);
    };
    switch (D) {   // register-resident fast paths for the common head sizes, a generic loop otherwise
      case 64: run(std::integral_constant<int, 64 / Isa::W>{}); break;
      case 128: run(std::integral_constant<int, 128 / Isa::W>{}); break;
      case 256: run(std::integral_constant<int, 256 / Isa::W>{}); break;
      default: run(std::integral_constant<int, 0>{}); break;
    }
  });
  return out;
}

// Structured output: logits [R, V] float32 rows, in place, -inf where bit v % 32 of word v / 32
// of the row's bitmask [R, >= V / 32] int32 is clear (xgrammar's token bitmask). A word of
// zeros (most of them where a grammar admits few tokens) is 32 vector-stored -infs, a word of
// ones is skipped: the same result as xgrammar's element-by-element kernel, without its 1.5 M
// branches per step for 32 rows of a 49k vocabulary. Returns, per row, whether it admits at
// least one token (the caller ends a request whose grammar admits none); a Python list, not a
// tensor: a step with one constrained row should not pay for a tensor's allocation.
std::vector<bool> apply_bitmask(torch::Tensor logits, torch::Tensor mask) {
  check_f32_rows(logits, "logits");
  TORCH_CHECK(mask.scalar_type() == torch::kInt32 && mask.dim() == 2 && mask.stride(1) == 1 &&
              mask.size(0) == logits.size(0) && mask.size(1) * 32 >= logits.size(1),
              "mask must be an int32 [rows, >= V / 32] tensor");
  const int64_t R = logits.size(0), V = logits.size(1), ldl = logits.stride(0), ldm = mask.stride(0);
  std::vector<uint8_t> admits(R, 0);   // bytes: rows are written from several threads
  float* lp = logits.data_ptr<float>();
  const int32_t* mp = mask.data_ptr<int32_t>();
  uint8_t* ap = admits.data();
  const auto neg = Isa::set1(-INFINITY);
  at::parallel_for(0, R, R < 8 ? R : 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = lp + r * ldl;
      const int32_t* words = mp + r * ldm;
      uint32_t seen = 0;
      for (int64_t w = 0; w * 32 < V; ++w) {
        const int64_t v0 = w * 32, n = std::min<int64_t>(32, V - v0);
        const uint32_t bits = (uint32_t)words[w];
        seen |= n == 32 ? bits : bits & ((1u << n) - 1);
        if (bits == 0xFFFFFFFFu) continue;
        if (bits == 0 && n == 32) {
          for (int64_t j = 0; j < 32; j += Isa::W) Isa::store(row + v0 + j, neg);
          continue;
        }
        for (int64_t j = 0; j < n; ++j)
          if (!((bits >> j) & 1u)) row[v0 + j] = -INFINITY;
      }
      ap[r] = seen != 0;
    }
  });
  return std::vector<bool>(admits.begin(), admits.end());
}

// the optional argmax [R] int64 output of the refinements, checked; null if not given
inline int64_t* argmax_rows_out(const c10::optional<torch::Tensor>& argmax, int64_t R) {
  if (!argmax.has_value()) return nullptr;
  TORCH_CHECK(argmax->scalar_type() == torch::kInt64 && argmax->dim() == 1 && argmax->size(0) == R &&
              argmax->is_contiguous(), "argmax must be a contiguous int64 [R] tensor");
  return argmax->data_ptr<int64_t>();
}

// am[r] = refine(r, cand, xs) for every row r < R (am may be null), rows in chunks over the
// threads, each with its own candidate and group-sum buffers
template <class Refine>
void refine_each_row(int64_t R, int64_t* am, const Refine& refine) {
  parallel_chunks(R, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<Scored> cand;
    thread_local std::vector<float> xs;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t best = refine(r, cand, xs);
      if (am) am[r] = best;
    }
  });
}

// The output layer's top logits again in float32 (refine_row, loom_kernels_loops.h): logits
// [R, N] in place, x [R, K] the activations the GEMM was given, w the same packed matrix.
// argmax: optional [R] int64, set to each row's argmax after the refinement where the refinement
// decides it (its best value above every logit it left alone), else -1 (the caller scans the row).
void refine_logits(torch::Tensor logits, torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t bits,
                   bool scales16, int64_t zero, double margin, int64_t cap, c10::optional<torch::Tensor> argmax) {
  check_f32_rows(logits, "logits");
  check_f32_rows(x, "x");
  TORCH_CHECK(K % GROUP == 0 && x.size(1) == K && logits.size(1) == N && x.size(0) == logits.size(0),
              "logits must be [R, N] and x [R, K]");
  TORCH_CHECK(cap >= 0 && margin >= 0, "margin and cap must be >= 0");
  check_bits_zero(bits, zero);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8 &&
                  w.numel() == (N + ROWS - 1) / ROWS * (K / GROUP) * packed_block_bytes(bits, scales16 ? 2 : 4, zero),
              "packed weights do not match N, K, bits, zero");
  const int64_t R = logits.size(0), ldl = logits.stride(0), ldx = x.stride(0);
  int64_t* am = argmax_rows_out(argmax, R);
  float* lp = logits.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float mg = (float)margin;
  with_layout(bits, scales16, zero, [&](auto b, auto s, auto zl) {
    refine_each_row(R, am, [&](int64_t r, std::vector<Scored>& cand, std::vector<float>& xs) {
      return refine_row<Isa, decltype(b)::value, decltype(s), decltype(zl)::value>(lp + r * ldl, N, xp + r * ldx, K,
                                                                                     wp, mg, cap, cand, xs);
    });
  });
}

// The output layer: qgemm (no pre-op) and refine_logits in one call. Where kTopInTiles (AVX-512),
// the refinement's candidates are gathered by the GEMM's tiles (TopTrack, refine_tracked in
// loom_kernels_loops.h) instead of two passes over every row afterwards, and the logits are
// stored past the caches: the same logits as the two calls; the argmax where given is the
// refined row's (see refine_tracked for where it leaves a row to the caller).
// logits false (a greedy step that reads nothing but the argmax; argmax required): where
// kTopInTiles the logits are not stored at all and an [M, 0] tensor is returned, the argmax the
// same as with them, and -1 also for a row with a NaN logit (the caller computes such a row's
// logits); elsewhere the call is as with logits true.
torch::Tensor qgemm_top(torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t bits, bool scales16,
                        int64_t zero, double margin, int64_t cap, c10::optional<torch::Tensor> out,
                        c10::optional<torch::Tensor> argmax, bool logits) {
  TORCH_CHECK(cap >= 1 && margin >= 0, "margin must be >= 0 and cap >= 1");
  TORCH_CHECK(logits || argmax.has_value(), "qgemm_top without logits needs the argmax tensor");
  if constexpr (!kTopInTiles<Isa>) {
    torch::Tensor y = qgemm(x, w, N, K, bits, scales16, PRE_NONE, c10::nullopt, 0.0, out, false, zero);
    refine_logits(y, x, w, N, K, bits, scales16, zero, margin, cap, argmax);
    return y;
  }
  const int64_t M = x.size(0), T = std::max(1, at::get_num_threads());
  int64_t* am = argmax_rows_out(argmax, M);
  thread_local std::vector<TopRow> rows;   // [T][M], kept across calls with their candidates' capacity
  if ((int64_t)rows.size() < T * M) rows.resize(T * M);
  for (int64_t i = 0; i < T * M; ++i) rows[i].reset();
  TopRow* rp = rows.data();
  const float mg = (float)margin;
  // without logits the GEMM allocates no output (its tiles store nothing)
  torch::Tensor y = run_qgemm(x, w, N, K, bits, scales16, PRE_NONE, c10::nullopt, 0.0, out, false, zero,
                              [&] { return TopTrack<Isa>{rp + at::get_thread_num() * M, mg, cap, logits}; });
  float* lp = logits ? y.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldl = y.stride(0), ldx = x.stride(0);
  with_layout(bits, scales16, zero, [&](auto b, auto s, auto zl) {
    refine_each_row(M, am, [&](int64_t r, std::vector<Scored>& cand, std::vector<float>& xs) {
      return refine_tracked<Isa, decltype(b)::value, decltype(s), decltype(zl)::value>(
          lp ? lp + r * ldl : nullptr, N, xp + r * ldx, K, wp, mg, cap, rp, T, M, r, cand, xs);
    });
  });
  return y;
}

// indices [R, k] int64 of each row's k largest logits, largest first (ties: the lower index):
// torch.topk's indices, without its sort of every candidate
torch::Tensor topk_rows(torch::Tensor logits, int64_t k) {
  check_f32_rows(logits, "logits");
  const int64_t R = logits.size(0), N = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(k >= 0 && k <= N, "k must be in [0, ", N, "]");
  torch::Tensor out = torch::empty({R, k}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_chunks(R, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<Scored> cand;
    for (int64_t r = r0; r < r1; ++r) topk_row<Isa>(lp + r * ld, N, k, op + r * k, cand);
  });
  return out;
}

// The non-greedy rows of a step (loom_kernels_sample.h): logits [R, V] float32, modified in place;
// per row temperature (> 0), top_k (<= 0: off), top_p, min_p (float32) and a uniform u in
// [0, 1) (float64). draw: returns each row's token; else leaves each row its distribution
// (the filtered probabilities, summing to 1) and returns -1s.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u, bool draw) {
  check_f32_rows(logits, "logits");
  const int64_t R = logits.size(0), N = logits.size(1), ld = logits.stride(0);
  const auto column = [&](const torch::Tensor& t, torch::ScalarType type, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.dim() == 1 && t.size(0) == R && t.is_contiguous(), name,
                " must be a contiguous [rows] tensor of ", c10::toString(type));
  };
  column(temperature, torch::kFloat32, "temperature");
  column(top_k, torch::kInt64, "top_k");
  column(top_p, torch::kFloat32, "top_p");
  column(min_p, torch::kFloat32, "min_p");
  column(u, torch::kFloat64, "u");
  torch::Tensor out = torch::empty({R}, logits.options().dtype(torch::kInt64));
  float* lp = logits.data_ptr<float>();
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_chunks(R, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<Scored> cand;
    for (int64_t r = r0; r < r1; ++r)
      op[r] = sample_row<Isa>(lp + r * ld, N, tp[r], kp[r], pp[r], mp[r], up[r], draw, cand);
  });
  return out;
}

// The logprobs of rows of raw logits [R, V] without the [R, V] log-softmax: each row's
// log-sum-exp [R] (float32) and the ids [R, k] of its k largest logits, largest first (ties: the
// lower id); a logprob is then logit - lse. With targets [R] (int64 ids): each target's rank [R],
// 1 + the number of logits above its own (else an empty tensor).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> logprob_rows(torch::Tensor logits, int64_t k,
                                                                     c10::optional<torch::Tensor> targets) {
  check_f32_rows(logits, "logits");
  const int64_t R = logits.size(0), N = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(k >= 0 && k <= N, "k must be in [0, ", N, "]");
  const int64_t* tp = nullptr;
  if (targets.has_value()) {
    TORCH_CHECK(targets->scalar_type() == torch::kInt64 && targets->dim() == 1 && targets->size(0) == R &&
                targets->is_contiguous(), "targets must be a contiguous int64 [R] tensor");
    tp = targets->data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < N, "target ", tp[r], " is not a column");
  }
  torch::Tensor lse = torch::empty({R}, logits.options());
  torch::Tensor ids = torch::empty({R, k}, logits.options().dtype(torch::kInt64));
  torch::Tensor ranks = torch::empty({tp ? R : 0}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  float* sp = lse.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *rp = ranks.data_ptr<int64_t>();
  parallel_chunks(R, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<Scored> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = lp + r * ld;
      sp[r] = logsumexp_row<Isa>(row, N);
      topk_row<Isa>(row, N, k, ip + r * k, cand);
      if (tp) rp[r] = 1 + count_above<Isa>(row, N, row[tp[r]]);
    }
  });
  return {lse, ids, ranks};
}

void add_rmsnorm(torch::Tensor h, torch::Tensor y, torch::Tensor w, double eps) {
  check_f32_rows(h, "h");
  check_f32_rows(y, "y");
  const int64_t M = h.size(0), K = h.size(1);
  TORCH_CHECK(K % 16 == 0 && y.size(1) == K && w.numel() == K, "shapes differ");
  add_rmsnorm_rows<Isa>(h.data_ptr<float>(), h.stride(0), y.data_ptr<float>(), y.stride(0), w.data_ptr<float>(), M, K,
                        (float)eps);
}

}  // namespace loom

#include "loom_kernels_stack.h"   // decode_layers: the kernels above, a whole stack per call

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemm", &loom::qgemm, "quantized GEMM with fused activation pre-op");
  m.def("amx_tiles", [] { return loom::Isa::kAmx && loom::amx_allowed<loom::Isa>(); },
        "whether GEMMs of 16 or more rows (32 over 4-bit codes) run their tiles on AMX here (built with it, granted by the kernel, LOOM_AMX not 0)");
  m.def("rope_store", &loom::rope_store, "per-head norm + RoPE of q/k in place, store k/v in the cache", py::arg("qkv"),
        py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("H"), py::arg("Hkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("kv_format") = 0);
  m.def("attn_decode", &loom::attn_decode, "attention of query rows over the paged KV cache", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("ctx"), py::arg("H"), py::arg("Hkv"),
        py::arg("scale"), py::arg("window"), py::arg("groups") = py::none(), py::arg("shared") = py::none(),
        py::arg("kv_format") = 0, py::arg("first") = py::none());
  m.def("refine_logits", &loom::refine_logits, "the top logits of each row again in float32, in place",
        py::arg("logits"), py::arg("x"), py::arg("w"), py::arg("N"), py::arg("K"), py::arg("bits"), py::arg("scales16"),
        py::arg("zero"), py::arg("margin"), py::arg("cap"), py::arg("argmax") = py::none());
  m.def("qgemm_top", &loom::qgemm_top, "the output layer: qgemm and refine_logits in one call, the candidates "
        "gathered by the GEMM", py::arg("x"), py::arg("w"), py::arg("N"), py::arg("K"), py::arg("bits"),
        py::arg("scales16"), py::arg("zero"), py::arg("margin"), py::arg("cap"), py::arg("out") = py::none(),
        py::arg("argmax") = py::none(), py::arg("logits") = true);
  m.def("topk_rows", &loom::topk_rows, "indices of each row's k largest logits, largest first");
  m.def("sample_rows", &loom::sample_rows, "temperature, top-k, top-p, min-p and one draw per row, in place",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::arg("draw"));
  m.def("logprob_rows", &loom::logprob_rows, "each row's log-sum-exp, the ids of its k largest logits and its "
        "target's rank", py::arg("logits"), py::arg("k"), py::arg("targets") = py::none());
  m.def("add_rmsnorm", &loom::add_rmsnorm, "h += rmsnorm(y) * w");
  m.def("decode_layers", &loom::decode_layers, "a decoder stack's layers over attention's kernel rows, in place",
        py::arg("h"), py::arg("weights"), py::arg("dims"), py::arg("norms"), py::arg("eps"), py::arg("down_pre"),
        py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("rope_of"), py::arg("windows"),
        py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"), py::arg("H"), py::arg("Hkv"),
        py::arg("kv_format"), py::arg("scale"), py::arg("slots"), py::arg("ctx"), py::arg("groups") = py::none(),
        py::arg("shared") = py::none(), py::arg("first") = py::none());
  m.def("apply_bitmask", &loom::apply_bitmask, "logits = -inf where a token bitmask's bit is clear, in place; "
        "returns which rows admit a token");
}
