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
from loom.model.layers.attention import AttentionMetadata, paged_attention
from loom.model.layers.linear import LinearBackend, make_linear
from loom.model.layers.norm import rms_norm
from loom.model.layers.rope import RotaryEmbedding, apply_rope
from loom.model.weights import GGUFWeights

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([slots, Hkv, D], [slots, Hkv, D]) for one layer


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    qkv: LinearBackend
    o: LinearBackend
    ffn_norm: torch.Tensor
    gate_up: LinearBackend
    down: LinearBackend


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, w: GGUFWeights, dtype: torch.dtype = torch.float32,
                 linear: str = "dense"):
        self.cfg, self.dtype = cfg, dtype
        D, H, Hkv, Dh, F_ = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.embed = w.get("token_embd.weight", (cfg.vocab_size, D))           # [V, D]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            q = w.get_unpermuted(p + "attn_q.weight", H, (H * Dh, D))
            k = w.get_unpermuted(p + "attn_k.weight", Hkv, (Hkv * Dh, D))
            v = w.get(p + "attn_v.weight", (Hkv * Dh, D))
            self.layers.append(LlamaLayer(
                attn_norm=w.get(p + "attn_norm.weight", (D,)),
                qkv=make_linear(torch.cat([q, k, v]), linear, dtype=dtype),
                o=make_linear(w.get(p + "attn_output.weight", (D, H * Dh)), linear, dtype=dtype),
                ffn_norm=w.get(p + "ffn_norm.weight", (D,)),
                gate_up=make_linear(torch.cat([w.get(p + "ffn_gate.weight", (F_, D)),
                                               w.get(p + "ffn_up.weight", (F_, D))]), linear, dtype=dtype),
                down=make_linear(w.get(p + "ffn_down.weight", (D, F_)), linear, dtype=dtype),
            ))
        self.norm = w.get("output_norm.weight", (D,))
        head = self.embed if cfg.tie_embeddings else w.get("output.weight", (cfg.vocab_size, D))
        self.lm_head = make_linear(head, linear, dtype=dtype)
        self.rope = RotaryEmbedding(Dh, cfg.rope_theta, cfg.context_length)
        self.embed = self.embed.to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions: [T]; returns final hidden states [T, D] (after the output norm)."""
        cfg = self.cfg
        T, H, Hkv, Dh = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed[input_ids]                                          # [T, D]
        cos, sin = self.rope.tables(positions, self.dtype)                 # [T, 1, Dh/2]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            qkv = layer.qkv(rms_norm(h, layer.attn_norm, cfg.rms_norm_eps))  # [T, (H + 2Hkv) * Dh]
            q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
            q = apply_rope(q.view(T, H, Dh), cos, sin)                     # [T, H, Dh]
            k = apply_rope(k.view(T, Hkv, Dh), cos, sin)                   # [T, Hkv, Dh]
            o = paged_attention(q, k, v.view(T, Hkv, Dh), k_cache, v_cache, meta, cfg.attn_scale)
            h = h + layer.o(o)
            gate, up = layer.gate_up(rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] of the positions to sample -> float32 logits [N, V]."""
        return self.lm_head(hidden).float()
