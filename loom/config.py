"""Engine configuration: one frozen dataclass per component, composed into `EngineConfig`.

Each validates itself on construction and raises `InvalidRequestError` (a `ValueError`)
naming the field, so a bad flag fails at start-up with a clear message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from loom.errors import InvalidRequestError, check_option_keys
from loom.eviction_params import KVEvictionParams

# dtype choice -> linear backend mode (loom.model.layers.linear). Activations, the residual
# stream and the KV cache stay float32 in every mode.
DTYPES = {
    "auto": "auto",       # the fastest: loom's kernels over the GGUF codes (int8 activations)
    "float32": "exact",   # dense float32: bit-identical to the reference implementation
    "bfloat16": "bf16",   # dense bfloat16 weights (oneDNN)
}

KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8", "int4")   # loom/model/kv_dtypes


def _bad(name: str, value, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to tell
        n = None
    return n or os.cpu_count() or 1


@dataclass(frozen=True)
class LoadConfig:
    model: str = "smollm2-135m"  # a registry name or a path to a .gguf file
    dtype: str = "auto"          # "auto" (fastest), "float32" (exact reference mode) or "bfloat16"
    threads: int | None = None   # torch intra-op threads; None = physical core count

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise _bad("threads", self.threads, "a positive integer")

    @property
    def linear_mode(self) -> str:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = a share of free RAM
    num_blocks: int | None = None       # overrides kv_cache_memory (tests)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"        # "auto": float16 with loom's kernels, float32 in the exact mode; int8, int4
    # the default KV eviction of requests that do not set SamplingParams.kv_eviction (a dict or
    # KVEvictionParams; loom serve --kv-eviction JSON); None: no eviction
    kv_eviction: KVEvictionParams | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise _bad("block_size", self.block_size, "an integer in [1, 1024]")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool) or not isinstance(
                self.kv_cache_memory, (int, float)) or not self.kv_cache_memory > 0):
            raise _bad("kv_cache_memory", self.kv_cache_memory, "a positive number of bytes")
        if self.kv_cache_memory is not None:
            if int(self.kv_cache_memory) < 1:   # (0.5 would have become 0: the default share)
                raise _bad("kv_cache_memory", self.kv_cache_memory, "a positive number of bytes")
            object.__setattr__(self, "kv_cache_memory", int(self.kv_cache_memory))
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks < 1):
            raise _bad("num_blocks", self.num_blocks, "a positive integer")
        if not isinstance(self.enable_prefix_caching, bool):
            raise _bad("enable_prefix_caching", self.enable_prefix_caching, "true or false")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", self.kv_cache_dtype, f"one of {', '.join(KV_CACHE_DTYPES)}")
        eviction = KVEvictionParams.create(self.kv_eviction)
        object.__setattr__(self, "kv_eviction", eviction if eviction is not None and eviction.enabled else None)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64             # sequences running at once
    max_model_len: int | None = None   # context limit; None = the model's
    max_waiting: int | None = None     # bounded waiting queue (server back-pressure); None = unbounded

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise _bad(name, value, "an integer")
        if self.max_num_batched_tokens < 1:
            raise _bad("max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise _bad("max_num_seqs", self.max_num_seqs, "in [1, max_num_batched_tokens]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise _bad("max_model_len", self.max_model_len, ">= 2")


# -- speculative_config: which drafter, how many draft tokens at most, and its knobs. Given as a
# dict, as in vLLM: LLM(model, speculative_config={"method": "prompt_lookup"}) or
# loom serve --speculative-config '{"method": "auto"}'. Unknown keys and bad values raise
# InvalidRequestError naming them.
SPECULATIVE_METHODS = ("prompt_lookup", "token_recycling", "lookahead", "draft_model", "retrieval", "auto",
                      "grammar", "prediction")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 8    # most draft nodes per sequence per step
    adaptive: bool = True              # the controller picks 0..num_speculative_tokens per step
    prompt_lookup_min: int = 1         # n-gram sizes tried by prompt lookup, longest first
    prompt_lookup_max: int = 4
    recycling_top_k: int = 8           # candidates per token in Token Recycling's matrix
    lookahead_window: int = 4          # Jacobi guesses per sequence
    lookahead_ngram: int = 4           # n of the pool's n-grams
    lookahead_guesses: int = 4         # most pool n-grams per step
    model: str | None = None           # draft_model: GGUF path or registry name (default: the target)
    num_layers: int | None = None      # draft_model: keep only the first n layers
    datastore: str | None = None       # retrieval (and auto): a corpus to draft from, a file or a directory
    datastore_max_mb: float = 1024     # retrieval: most memory its datastore may take; more is refused
    datastore_recent_tokens: int = 65536   # retrieval: tokens of finished requests kept to draft from (0: none)
    retrieval_min: int = 2             # n-gram sizes the datastore matches, longest first
    retrieval_max: int = 6

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                                      f"got {self.method!r}")
        ints = {"num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
                "recycling_top_k": 1, "lookahead_window": 1, "lookahead_ngram": 2, "lookahead_guesses": 0,
                "datastore_recent_tokens": 0, "retrieval_min": 1, "retrieval_max": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"speculative_config {name} must be an integer >= {low}, got {value!r}")
        if self.num_speculative_tokens > 64:
            raise InvalidRequestError(f"speculative_config num_speculative_tokens must be <= 64, "
                                      f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                                      f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.retrieval_min > self.retrieval_max:
            raise InvalidRequestError(f"speculative_config retrieval_min ({self.retrieval_min}) exceeds "
                                      f"retrieval_max ({self.retrieval_max})")
        self._check_datastore()
        if not isinstance(self.adaptive, bool):
            raise InvalidRequestError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        if self.num_layers is not None and (isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int)
                                            or self.num_layers < 1):
            raise InvalidRequestError(f"speculative_config num_layers must be a positive integer, "
                                      f"got {self.num_layers!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidRequestError(f"speculative_config model must be a path or model name, got {self.model!r}")
        if self.method != "draft_model" and (self.model is not None or self.num_layers is not None):
            raise InvalidRequestError("speculative_config model and num_layers apply to method 'draft_model' only")

    def _check_datastore(self) -> None:
        mb = self.datastore_max_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
            raise InvalidRequestError(f"speculative_config datastore_max_mb must be a positive number, got {mb!r}")
        if self.datastore is None:
            return
        if not isinstance(self.datastore, str):
            raise InvalidRequestError(f"speculative_config datastore must be a path, got {self.datastore!r}")
        if self.method not in ("retrieval", "auto"):
            raise InvalidRequestError("speculative_config datastore applies to methods 'retrieval' and 'auto' only")
        path = os.path.expanduser(self.datastore)
        if not os.path.exists(path):
            raise InvalidRequestError(f"speculative_config datastore: no such file or directory: {self.datastore}")
        if not os.access(path, os.R_OK):
            raise InvalidRequestError(f"speculative_config datastore: cannot read {self.datastore}")

    @classmethod
    def create(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"speculative_config must be a dict, got {type(value).__name__}")
        check_option_keys("speculative_config", value, sorted(f.name for f in fields(cls)), "method",
                          SPECULATIVE_METHODS)
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int | None = 0  # seeds the shared generator used by unseeded sampling (None: system entropy)
    speculative: SpeculativeConfig | None = None  # speculative decoding (loom/speculative); None: off

    @classmethod
    def create(cls, model: str = "smollm2-135m", **kwargs) -> "EngineConfig":
        """Flat keyword form (as `LLM(...)` and the CLI take them) -> the nested config."""
        parts = {"load": {"model": model}, "cache": {}, "scheduler": {}}
        owners = {name: part for part, klass in (("load", LoadConfig), ("cache", CacheConfig),
                                                 ("scheduler", SchedulerConfig))
                  for name in klass.__dataclass_fields__}
        seed = kwargs.pop("seed", 0)
        if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
            raise _bad("seed", seed, "an integer (or None: seeded from system entropy)")
        speculative = SpeculativeConfig.create(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            if key not in owners:
                raise InvalidRequestError(f"unknown engine option '{key}' "
                                          f"(known: {', '.join(sorted(owners))}, seed, speculative_config)")
            if value is not None:
                parts[owners[key]][key] = value
        return cls(LoadConfig(**parts["load"]), CacheConfig(**parts["cache"]),
                   SchedulerConfig(**parts["scheduler"]), seed, speculative)
