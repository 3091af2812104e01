"""Model hyper-parameters read from a GGUF file's metadata, one frozen dataclass for every architecture."""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tie_embeddings: bool
    # gemma3 only: local (sliding-window) layers use their own RoPE base and a window
    rope_theta_local: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int = 0  # every Nth layer is global; 0 = all layers global
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return base ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Gemma 3: layers 0..4 are local, layer 5 global, and so on (pattern 6)."""
        if not self.sliding_window or not self.sliding_window_pattern:
            return False
        return (layer + 1) % self.sliding_window_pattern != 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        arch = f.architecture
        if arch not in ("llama", "gemma3"):
            raise ModelLoadError(f.path, f"unsupported model architecture '{arch}' (loom runs: llama, gemma3)")

        def key(name, default=None):
            v = f.get(f"{arch}.{name}", default)
            if v is None:
                raise ModelLoadError(f.path, f"metadata key '{arch}.{name}' is missing")
            return v

        n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = int(f.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0)) \
            or f.tensor_info("token_embd.weight").shape[0]
        common = dict(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=n_embd,
            num_layers=int(key("block_count")),
            num_heads=n_head,
            num_kv_heads=int(key("attention.head_count_kv", n_head)),
            head_dim=int(key("attention.key_length", n_embd // n_head)),
            intermediate_size=int(key("feed_forward_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            context_length=int(key("context_length")),
            tie_embeddings="output.weight" not in f.tensors,
        )
        if arch == "gemma3":
            common.update(
                rope_theta_local=10000.0,
                sliding_window=int(key("attention.sliding_window")),
                sliding_window_pattern=6,
                query_pre_attn_scalar=float(common["head_dim"]),
            )
        return cls(**common)
