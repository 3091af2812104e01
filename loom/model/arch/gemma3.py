"""Gemma 3 (text): GQA with q/k RMSNorm, 5 sliding-window layers to 1 global, per-kind RoPE
bases, pre- and post-norms around attention and MLP, GeGLU MLP, scaled tied embeddings.

    h = embed(ids) * sqrt(D)
    for each layer (local: window W, base 10k; global: full, base 1M):
        q, k, v = split(qkv_proj(rmsnorm(h)));  q, k = rope(rmsnorm_head(q)), rope(rmsnorm_head(k))
        h = h + post_attn_norm(o_proj(attn(q, k, v)))
        h = h + post_ffw_norm(down(gelu_tanh(gate) * up))   gate, up = split(gate_up(rmsnorm(h)))
    logits = embed^T(rmsnorm(h))

GGUF files store Gemma's RMSNorm weights already offset (w + 1), so every norm here is a
plain multiply. With a quantized KV cache the q/k norm weights carry the key smoothing
(loom/model/kv_dtypes/smoothing.py): k is stored divided by a fixed per-channel factor, q is
scaled by it, the scores are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.model.config import ModelConfig
from loom.model.kv_dtypes import KVFormat, format_of, key_smoothing
from loom.model.layers.attention import AttentionMetadata, paged_attention, paged_attention_stored
from loom.model.layers.linear import PRE_GEGLU, PRE_RMSNORM, LinearBackend, fused_kernels, make_linear, output_logits
from loom.model.layers.norm import rms_norm
from loom.model.layers.rope import RotaryEmbedding, apply_rope
from loom.model.layers.stack import DecodeStack
from loom.model.weights import GGUFWeights, LinearWeight

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Gemma3Layer:
    sliding: bool
    attn_norm: torch.Tensor
    qkv: LinearBackend
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: LinearBackend
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: LinearBackend
    down: LinearBackend
    post_ffn_norm: torch.Tensor
    q_norm_kv: torch.Tensor | None = None   # q_norm * s, k_norm / s: for quantized KV caches
    k_norm_kv: torch.Tensor | None = None

    def __post_init__(self):
        s = key_smoothing(self.q_norm, self.k_norm)                       # [Dh]
        self.q_norm_kv = (self.q_norm * s).to(self.q_norm.dtype)
        self.k_norm_kv = (self.k_norm / s).to(self.k_norm.dtype)

    def qk_norms(self, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k norm weights for a KV cache in format `fmt`."""
        return (self.q_norm_kv, self.k_norm_kv) if fmt.smooth_keys else (self.q_norm, self.k_norm)


class Gemma3ForCausalLM:
    def __init__(self, cfg: ModelConfig, w: GGUFWeights, linear: str = "exact"):
        """`linear`: a mode of loom.model.layers.linear (exact = dense float32)."""
        self.cfg, self.dtype = cfg, torch.float32  # activations and the residual stream stay float32
        D, H, Hkv, Dh, F_ = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        embed = w.linear("token_embd.weight", (cfg.vocab_size, D))           # [V, D]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            qkv = LinearWeight.cat([w.linear(p + "attn_q.weight", (H * Dh, D)),
                                    w.linear(p + "attn_k.weight", (Hkv * Dh, D)),
                                    w.linear(p + "attn_v.weight", (Hkv * Dh, D))])
            gate_up = LinearWeight.cat([w.linear(p + "ffn_gate.weight", (F_, D)),
                                        w.linear(p + "ffn_up.weight", (F_, D))])
            self.layers.append(Gemma3Layer(
                sliding=cfg.is_sliding(i),
                attn_norm=w.get(p + "attn_norm.weight", (D,)),
                qkv=make_linear(qkv, linear),
                q_norm=w.get(p + "attn_q_norm.weight", (Dh,)),
                k_norm=w.get(p + "attn_k_norm.weight", (Dh,)),
                o=make_linear(w.linear(p + "attn_output.weight", (D, H * Dh)), linear),
                post_attn_norm=w.get(p + "post_attention_norm.weight", (D,)),
                ffn_norm=w.get(p + "ffn_norm.weight", (D,)),
                gate_up=make_linear(gate_up, linear),
                down=make_linear(w.linear(p + "ffn_down.weight", (D, F_)), linear),
                post_ffn_norm=w.get(p + "post_ffw_norm.weight", (D,)),
            ))
        self.norm = w.get("output_norm.weight", (D,))
        head = embed if cfg.tie_embeddings else w.linear("output.weight", (cfg.vocab_size, D))
        self.lm_head = make_linear(head, linear)
        self.embed = w.embedding("token_embd.weight", (cfg.vocab_size, D))   # rows gathered from the stored table
        self.embed_scale = torch.tensor(D ** 0.5, dtype=torch.float32)
        self.rope_global = RotaryEmbedding(Dh, cfg.rope_theta, cfg.context_length)
        self.rope_local = RotaryEmbedding(Dh, cfg.rope_theta_local or cfg.rope_theta, cfg.context_length)
        self.kern = fused_kernels([self.lm_head] + [b for L in self.layers for b in (L.qkv, L.o, L.gate_up, L.down)],
                                  Dh, D)
        layers = self.layers   # the norms' getter holds the layers, not the model (no cycle)
        # the layers in one call where a batch is all attention-kernel rows (loom.model.layers.stack)
        self.stack = None if self.kern is None else DecodeStack(
            self.kern, [[L.qkv, L.o, L.gate_up, L.down] for L in layers],
            lambda fmt: [t for L in layers
                         for t in (L.attn_norm, L.ffn_norm, L.post_attn_norm, L.post_ffn_norm, *L.qk_norms(fmt))],
            [0 if L.sliding else 1 for L in self.layers],
            [cfg.sliding_window if L.sliding else 0 for L in self.layers], PRE_GEGLU, cfg.rms_norm_eps, H, Hkv,
            cfg.attn_scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions: [T]; returns final hidden states [T, D] (after the output norm)."""
        if self.kern is not None:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        T, H, Hkv, Dh = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed[input_ids] * self.embed_scale                       # [T, D]
        rope = {True: self.rope_local.tables(positions, self.dtype),
                False: self.rope_global.tables(positions, self.dtype)}     # [T, 1, Dh] each
        fmt = format_of(kv_caches[0][0], Dh)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = rope[layer.sliding]
            q_norm, k_norm = layer.qk_norms(fmt)
            qkv = layer.qkv(rms_norm(h, layer.attn_norm, eps))             # [T, (H + 2Hkv) * Dh]
            q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
            q = apply_rope(rms_norm(q.view(T, H, Dh), q_norm, eps), cos, sin)    # [T, H, Dh]
            k = apply_rope(rms_norm(k.view(T, Hkv, Dh), k_norm, eps), cos, sin)  # [T, Hkv, Dh]
            window = cfg.sliding_window if layer.sliding else None
            o = paged_attention(q, k, v.view(T, Hkv, Dh), k_cache, v_cache, meta, cfg.attn_scale, window)
            h = h + rms_norm(layer.o(o), layer.post_attn_norm, eps)
            gate, up = layer.gate_up(rms_norm(h, layer.ffn_norm, eps)).chunk(2, dim=-1)
            h = h + rms_norm(layer.down(F.gelu(gate, approximate="tanh") * up), layer.post_ffn_norm, eps)
        return rms_norm(h, self.norm, eps)

    def _forward_fused(self, input_ids, positions, meta, kv_caches):
        """The same function on loom's kernels, the residual updated in place."""
        cfg, kern, eps = self.cfg, self.kern, self.cfg.rms_norm_eps
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        h = self.embed[input_ids] * self.embed_scale                       # [T, D]
        top = int(positions.max()) + 1 if positions.numel() else 0
        self.rope_local.ensure(top)
        self.rope_global.ensure(top)
        fmt = format_of(kv_caches[0][0], cfg.head_dim)   # the cache's row format
        tables = [(self.rope_local.cos, self.rope_local.sin), (self.rope_global.cos, self.rope_global.sin)]
        if self.stack is not None and self.stack.run(h, positions, meta, kv_caches, tables, fmt):
            return rms_norm(h, self.norm, eps)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            rope = self.rope_local if layer.sliding else self.rope_global
            qkv = layer.qkv(h, PRE_RMSNORM, layer.attn_norm, eps)          # [T, (H + 2Hkv) * Dh]
            kern.rope_store(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                            H, Hkv, *layer.qk_norms(fmt), eps, fmt.kernel_id)
            window = cfg.sliding_window if layer.sliding else None
            o = paged_attention_stored(qkv, H, k_cache, v_cache, meta, cfg.attn_scale, window, kern)
            kern.add_rmsnorm(h, layer.o(o), layer.post_attn_norm, eps)
            down = layer.down(layer.gate_up(h, PRE_RMSNORM, layer.ffn_norm, eps), PRE_GEGLU)
            kern.add_rmsnorm(h, down, layer.post_ffn_norm, eps)
        return rms_norm(h, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor, argmax: torch.Tensor | None = None,
                       argmax_only: bool = False) -> torch.Tensor | None:
        """hidden [N, D] of the positions to sample -> float32 logits [N, V] (argmax, argmax_only:
        see output_logits; None only where argmax_only and every row's argmax is known)."""
        return output_logits(self.lm_head, hidden, argmax, argmax_only)
