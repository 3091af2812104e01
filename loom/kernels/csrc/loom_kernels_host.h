// Host-side functions shared by both kernel variants (loom_kernels.cpp, loom_kernels_avx2.cpp):
// argument checks and dispatch of qgemm, and rope_store. Each variant includes it once it has
// defined GROUP, ROWS, the pre-op codes, QuantActs, quantize_acts, gemm, block_bytes and
// store_row (the one vector-width-specific helper used here).
#pragma once

inline void check_f32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              name, " must be a float32 [rows, cols] tensor with contiguous rows");
}

// y = pre(x) @ W^T (+ y if accumulate). x: [M, K] (or [M, 2K] for the gated pre-ops).
// w: the packed blocks (uint8); scales16: whether a and b are float16.
torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t bits, bool scales16, int64_t pre, c10::optional<torch::Tensor> norm_w, double eps,
                    c10::optional<torch::Tensor> out, bool accumulate) {
  check_f32_rows(x, "x");
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of 32");
  TORCH_CHECK(x.size(1) == ((pre == PRE_SWIGLU || pre == PRE_GEGLU) ? 2 * K : K), "x has the wrong width");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8, "packed weights must be contiguous uint8");
  const int64_t M = x.size(0);
  torch::Tensor y = out.has_value() ? *out : torch::empty({M, N}, x.options());
  check_f32_rows(y, "out");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, "out has the wrong shape");
  if (M == 0) return y;
  const float* nw = nullptr;
  if (pre == PRE_RMSNORM) {
    TORCH_CHECK(norm_w.has_value() && norm_w->numel() == K && norm_w->is_contiguous(), "norm weight [K] needed");
    nw = norm_w->data_ptr<float>();
  }
  thread_local QuantActs qa;  // reused across calls: no allocation on the hot path
  quantize_acts(x.data_ptr<float>(), M, K, x.stride(0), pre, nw, (float)eps, qa);
  const int64_t blocks = (N + ROWS - 1) / ROWS * (K / GROUP);
  const int64_t bb = scales16 ? (bits == 4 ? block_bytes<4, at::Half>() : block_bytes<8, at::Half>())
                              : (bits == 4 ? block_bytes<4, float>() : block_bytes<8, float>());
  TORCH_CHECK(w.numel() == blocks * bb, "packed weights do not match N, K, bits");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  if (scales16) {
    if (bits == 4) gemm<4, at::Half>(wp, N, K, M, qa, yp, ldy, accumulate);
    else gemm<8, at::Half>(wp, N, K, M, qa, yp, ldy, accumulate);
  } else {
    if (bits == 4) gemm<4, float>(wp, N, K, M, qa, yp, ldy, accumulate);
    else gemm<8, float>(wp, N, K, M, qa, yp, ldy, accumulate);
  }
  return y;
}

// In place on qkv [T, (H + 2 Hkv) * D]: optional per-head RMSNorm of q and k heads, rotate-half
// RoPE of q and k at `positions` (tables [P, D]); then k and v are stored at the cache slots
// (float32 or float16 caches).
void rope_store(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t H, int64_t Hkv,
                c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps) {
  check_f32_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), D = cos.size(1), half = D / 2;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv has the wrong width");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kHalf),
              "caches must be contiguous float32 or float16");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  const bool half_cache = k_cache.scalar_type() == torch::kHalf;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float *ct = cos.data_ptr<float>(), *st = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  void *kc = k_cache.data_ptr(), *vc = v_cache.data_ptr();
  float* base = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  at::parallel_for(0, T, T < 8 ? T : 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = base + t * ld;
      const float* c = ct + pos[t] * D;
      const float* s = st + pos[t] * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        float* x = row + h * D;
        const float* nw = h < H ? qn : kn;
        if (nw) {
          float ss = 0.0f;
          for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
          float r = 1.0f / std::sqrt(ss / (float)D + (float)eps);
          for (int64_t i = 0; i < D; ++i) x[i] = x[i] * r * nw[i];
        }
        for (int64_t i = 0; i < half; ++i) {
          float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
      const int64_t at = sl[t] * Hkv * D;
      if (half_cache) {
        store_row((at::Half*)kc + at, row + H * D, Hkv * D);
        store_row((at::Half*)vc + at, row + (H + Hkv) * D, Hkv * D);
      } else {
        store_row((float*)kc + at, row + H * D, Hkv * D);
        store_row((float*)vc + at, row + (H + Hkv) * D, Hkv * D);
      }
    }
  });
}
