"""Llama (SmolLM2 and friends): GQA attention with RoPE, RMSNorm, SwiGLU MLP, optionally tied embeddings.

    h = embed(ids)
    for each layer:
        h = h + o_proj(attn(rope(q), rope(k), v))      q, k, v = split(qkv_proj(rmsnorm(h)))
        h = h + down(silu(gate) * up)                  gate, up = split(gate_up_proj(rmsnorm(h)))
    logits = lm_head(rmsnorm(h))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.model.config import ModelConfig
from loom.model.kv_dtypes import format_of
from loom.model.layers.attention import AttentionMetadata, paged_attention, paged_attention_stored
from loom.model.layers.linear import PRE_RMSNORM, PRE_SWIGLU, LinearBackend, fused_kernels, make_linear, output_logits
from loom.model.layers.norm import rms_norm
from loom.model.layers.rope import RotaryEmbedding, apply_rope
from loom.model.layers.stack import DecodeStack
from loom.model.weights import GGUFWeights, LinearWeight

# K and V of one layer, [blocks, Hkv, block_size, D] (loom/model/kv_cache.py)
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    qkv: LinearBackend
    o: LinearBackend
    ffn_norm: torch.Tensor
    gate_up: LinearBackend
    down: LinearBackend


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, w: GGUFWeights, linear: str = "exact"):
        """`linear`: a mode of loom.model.layers.linear (exact = dense float32)."""
        self.cfg, self.dtype = cfg, torch.float32  # activations and the residual stream stay float32
        D, H, Hkv, Dh, F_ = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            qkv = LinearWeight.cat([w.linear(p + "attn_q.weight", (H * Dh, D), unpermute_heads=H),
                                    w.linear(p + "attn_k.weight", (Hkv * Dh, D), unpermute_heads=Hkv),
                                    w.linear(p + "attn_v.weight", (Hkv * Dh, D))])
            gate_up = LinearWeight.cat([w.linear(p + "ffn_gate.weight", (F_, D)),
                                        w.linear(p + "ffn_up.weight", (F_, D))])
            self.layers.append(LlamaLayer(
                attn_norm=w.get(p + "attn_norm.weight", (D,)),
                qkv=make_linear(qkv, linear),
                o=make_linear(w.linear(p + "attn_output.weight", (D, H * Dh)), linear),
                ffn_norm=w.get(p + "ffn_norm.weight", (D,)),
                gate_up=make_linear(gate_up, linear),
                down=make_linear(w.linear(p + "ffn_down.weight", (D, F_)), linear),
            ))
        self.norm = w.get("output_norm.weight", (D,))
        embed = w.linear("token_embd.weight", (cfg.vocab_size, D))             # [V, D]
        head = embed if cfg.tie_embeddings else w.linear("output.weight", (cfg.vocab_size, D))
        self.lm_head = make_linear(head, linear)
        self.embed = w.embedding("token_embd.weight", (cfg.vocab_size, D))   # rows gathered from the stored table
        self.rope = RotaryEmbedding(Dh, cfg.rope_theta, cfg.context_length)
        self.kern = fused_kernels([self.lm_head] + [b for L in self.layers for b in (L.qkv, L.o, L.gate_up, L.down)],
                                  Dh, D)
        n, layers = cfg.num_layers, self.layers   # the norms' getter holds the layers, not the model (no cycle)
        # the layers in one call where a batch is all attention-kernel rows (loom.model.layers.stack)
        self.stack = None if self.kern is None else DecodeStack(
            self.kern, [[L.qkv, L.o, L.gate_up, L.down] for L in layers],
            lambda fmt: [t for L in layers for t in (L.attn_norm, L.ffn_norm)], [0] * n, [0] * n,
            PRE_SWIGLU, cfg.rms_norm_eps, H, Hkv, cfg.attn_scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions: [T]; returns final hidden states [T, D] (after the output norm)."""
        if self.kern is not None:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        cfg = self.cfg
        T, H, Hkv, Dh = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed[input_ids]                                          # [T, D]
        cos, sin = self.rope.tables(positions, self.dtype)                 # [T, 1, Dh]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            qkv = layer.qkv(rms_norm(h, layer.attn_norm, cfg.rms_norm_eps))  # [T, (H + 2Hkv) * Dh]
            qk = apply_rope(qkv[:, :(H + Hkv) * Dh].view(T, H + Hkv, Dh), cos, sin)  # q and k heads together
            v = qkv[:, (H + Hkv) * Dh:].view(T, Hkv, Dh)
            o = paged_attention(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, cfg.attn_scale)
            h = h + layer.o(o)
            gate, up = layer.gate_up(rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def _forward_fused(self, input_ids, positions, meta, kv_caches):
        """The same function on loom's kernels: six calls per layer, the residual updated in place."""
        cfg, kern, eps = self.cfg, self.kern, self.cfg.rms_norm_eps
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        h = self.embed[input_ids]                                          # [T, D]
        self.rope.ensure(int(positions.max()) + 1 if positions.numel() else 0)
        fmt = format_of(kv_caches[0][0], cfg.head_dim)   # the cache's row format
        tables = [(self.rope.cos, self.rope.sin)]
        if self.stack is not None and self.stack.run(h, positions, meta, kv_caches, tables, fmt):
            return rms_norm(h, self.norm, eps)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            qkv = layer.qkv(h, PRE_RMSNORM, layer.attn_norm, eps)          # [T, (H + 2Hkv) * Dh]
            kern.rope_store(qkv, positions, self.rope.cos, self.rope.sin, k_cache, v_cache,
                            meta.slot_mapping, H, Hkv, None, None, 0.0, fmt.kernel_id)
            o = paged_attention_stored(qkv, H, k_cache, v_cache, meta, cfg.attn_scale, None, kern)
            layer.o(o, out=h, accumulate=True)
            gate_up = layer.gate_up(h, PRE_RMSNORM, layer.ffn_norm, eps)
            layer.down(gate_up, PRE_SWIGLU, out=h, accumulate=True)
        return rms_norm(h, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor, argmax: torch.Tensor | None = None,
                       argmax_only: bool = False) -> torch.Tensor | None:
        """hidden [N, D] of the positions to sample -> float32 logits [N, V] (argmax, argmax_only:
        see output_logits; None only where argmax_only and every row's argmax is known)."""
        return output_logits(self.lm_head, hidden, argmax, argmax_only)
