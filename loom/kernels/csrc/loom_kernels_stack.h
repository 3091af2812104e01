// A decoder stack's layers in one call (decode_layers): the fused forward of
// loom/model/arch/llama.py and gemma3.py for a batch whose every token is a row of attn_decode
// (decode steps, prefill chunks, draft chains, small trees: AttentionMetadata.kernel_rows
// without rest). The same kernel calls with the same arguments in the same order, made from
// here instead of from Python, so the interpreter, argument conversion and output allocation
// around each of a layer's 6-7 calls are paid once per step (~0.4 ms of a 6.5 ms SmolLM2 decode
// step on Zen 2).
// Included by loom_kernels_host.h after the functions it calls.
#pragma once

namespace loom {

// projection i of a stack: its packed matrix and dims[5 i ..] = (n, k, bits, scales16, zero)
struct StackLinear {
  const torch::Tensor& w;
  const int64_t* d;

  torch::Tensor operator()(const torch::Tensor& x, int64_t pre, const c10::optional<torch::Tensor>& norm, double eps,
                           const c10::optional<torch::Tensor>& out = c10::nullopt) const {
    return qgemm(x, w, d[0], d[1], d[2], d[3] != 0, pre, norm, eps, out, out.has_value(), d[4]);
  }
};

// The per-step arguments of every layer's attention (AttentionMetadata.kernel_rows).
struct StackAttn {
  const torch::Tensor &positions, &slot_mapping, &slots, &ctx;
  const c10::optional<torch::Tensor> &groups, &shared, &first;   // first: the windowed layers' first keys
  int64_t H, Hkv, kv_format;
  double scale;
};

// Layer l: h's attention half, returning the attention output rows [T, H * D]. q/k norms (Gemma 3)
// where given; the cos/sin table and window are the layer's.
inline torch::Tensor stack_attention(torch::Tensor& h, const StackLinear& qkv_proj, const torch::Tensor& attn_norm,
                                     double eps, const c10::optional<torch::Tensor>& q_norm,
                                     const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
                                     const torch::Tensor& sin, int64_t window, torch::Tensor& k_cache,
                                     torch::Tensor& v_cache, const StackAttn& a) {
  torch::Tensor qkv = qkv_proj(h, PRE_RMSNORM, attn_norm, eps);                      // [T, (H + 2 Hkv) * D]
  rope_store(qkv, a.positions, cos, sin, k_cache, v_cache, a.slot_mapping, a.H, a.Hkv, q_norm, k_norm,
             q_norm.has_value() ? eps : 0.0, a.kv_format);
  return attn_decode(qkv, k_cache, v_cache, a.slots, a.ctx, a.H, a.Hkv, a.scale, window, a.groups, a.shared,
                     a.kv_format, window ? a.first : c10::nullopt);
}

// h [T, D] in place through every layer. Per layer l: weights[4 l ..] = qkv, o, gate_up, down
// (dims: 5 per weight, see StackLinear); norms[P l ..] with P = 2 (llama: attn, ffn; residual
// adds) or 6 (Gemma 3: attn, ffn, post-attention, post-FFN, q, k; each half's output normed
// onto h); cos/sin[rope_of[l]] its RoPE table, windows[l] its sliding window (0: none);
// down_pre: the gated activation of gate_up (PRE_SWIGLU, PRE_GEGLU).
void decode_layers(torch::Tensor h, std::vector<torch::Tensor> weights, std::vector<int64_t> dims,
                   std::vector<torch::Tensor> norms, double eps, int64_t down_pre, torch::Tensor positions,
                   std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<int64_t> rope_of,
                   std::vector<int64_t> windows, std::vector<torch::Tensor> k_caches,
                   std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, int64_t H, int64_t Hkv,
                   int64_t kv_format, double scale, torch::Tensor slots, torch::Tensor ctx,
                   c10::optional<torch::Tensor> groups, c10::optional<torch::Tensor> shared,
                   c10::optional<torch::Tensor> first) {
  check_f32_rows(h, "h");
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && weights.size() == 4 * L && dims.size() == 5 * weights.size() &&
                  rope_of.size() == L && windows.size() == L && L > 0 && norms.size() % L == 0,
              "decode_layers: per-layer lists of different lengths");
  const size_t P = norms.size() / L;
  TORCH_CHECK(P == 2 || P == 6, "decode_layers: 2 or 6 norms per layer");
  TORCH_CHECK(down_pre == PRE_SWIGLU || down_pre == PRE_GEGLU, "decode_layers: down_pre must be a gated pre-op");
  for (int64_t r : rope_of) TORCH_CHECK(0 <= r && r < (int64_t)cos.size() && cos.size() == sin.size(), "bad rope_of");
  const StackAttn a{positions, slot_mapping, slots, ctx, groups, shared, first, H, Hkv, kv_format, scale};
  const c10::optional<torch::Tensor> none;
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* n = norms.data() + P * l;
    const auto lin = [&](size_t i) { return StackLinear{weights[4 * l + i], dims.data() + 5 * (4 * l + i)}; };
    const c10::optional<torch::Tensor> qn = P == 6 ? c10::optional<torch::Tensor>(n[4]) : none;
    const c10::optional<torch::Tensor> kn = P == 6 ? c10::optional<torch::Tensor>(n[5]) : none;
    torch::Tensor o = stack_attention(h, lin(0), n[0], eps, qn, kn, cos[rope_of[l]], sin[rope_of[l]], windows[l],
                                      k_caches[l], v_caches[l], a);
    if (P == 2) {   // llama: h += o W_o; h += down(act(gate_up(rmsnorm(h))))
      lin(1)(o, PRE_NONE, none, 0.0, h);
      lin(3)(lin(2)(h, PRE_RMSNORM, n[1], eps), down_pre, none, 0.0, h);
    } else {        // Gemma 3: h += rmsnorm(o W_o) * post_attn; h += rmsnorm(down(...)) * post_ffn
      add_rmsnorm(h, lin(1)(o, PRE_NONE, none, 0.0), n[2], eps);
      add_rmsnorm(h, lin(3)(lin(2)(h, PRE_RMSNORM, n[1], eps), down_pre, none, 0.0), n[3], eps);
    }
  }
}

}  // namespace loom
