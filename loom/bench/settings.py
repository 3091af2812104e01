"""What a bench run measures (`BenchSettings`) and the exact token ids it feeds (`Workload`).

Both travel to every worker as JSON, so all engines see the same settings and the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from loom.errors import LoomError


class BenchError(LoomError):
    """A bench run cannot start: bad flags, a missing prompt file, a model too small for the workload."""


FULL_CONCURRENCY = (1, 4, 16, 32, 64)
QUICK_CONCURRENCY = (1, 4)


@dataclass(frozen=True)
class BenchSettings:
    """The measurement plan; every engine runs exactly this.

    decode_tokens: new tokens of the single-stream decode run (timed after the first token).
    prefill_tokens: length of the prompt whose time to first token gives the prefill rate.
    prefill_repeats: the prefill is timed this many times, the median is reported.
    max_tokens: new tokens per request in the concurrency runs (generated past EOS).
    concurrency: request counts submitted at once, one run each.
    prompt_tokens: Spec-Bench prompts longer than this are cut to it (keeps runs comparable).
    warmup_tokens: tokens generated once before any timing, to settle caches and thread pools.
    suites: names of the measurements to run, in order (see `loom.bench.suites`).
    parallel_n: completions per prompt in the parallel-sampling cost runs.
    parallel_prompt_tokens / parallel_max_tokens: the prompt and answer length of those runs.
    quality_limit: GSM8K problems of the parallel quality suite (a fixed subset).
    quality_k / quality_m: children per problem (self-consistency, best-of, short-m@k) and m.
    quality_max_tokens: most new tokens per answer in the quality suite.
    decode_contexts: context lengths of the decode-at-context suite: a prompt of exactly that many
        tokens, then `decode_tokens` new ones timed as in the decode suite.
    """

    concurrency: tuple[int, ...] = FULL_CONCURRENCY
    decode_tokens: int = 128
    prefill_tokens: int = 512
    prefill_repeats: int = 3
    max_tokens: int = 64
    prompt_tokens: int = 256
    warmup_tokens: int = 8
    suites: tuple[str, ...] = ("decode", "prefill", "concurrency")
    quick: bool = False
    parallel_n: tuple[int, ...] = (1, 4, 8, 16)
    parallel_prompt_tokens: int = 500
    parallel_max_tokens: int = 128
    quality_limit: int = 200
    quality_k: int = 8
    quality_m: int = 3
    quality_max_tokens: int = 256
    decode_contexts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = {"decode_tokens": 2, "prefill_tokens": 1, "prefill_repeats": 1, "max_tokens": 2,
                  "prompt_tokens": 1, "warmup_tokens": 1, "parallel_prompt_tokens": 1, "parallel_max_tokens": 2,
                  "quality_limit": 0, "quality_k": 1, "quality_m": 1, "quality_max_tokens": 1}
        for name, least in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise BenchError(f"{name} must be an integer >= {least}, got {value!r}")
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise BenchError(f"concurrency must be a list of positive integers, got {self.concurrency!r}")
        object.__setattr__(self, "concurrency", tuple(sorted(set(self.concurrency))))
        if not self.parallel_n or any(not isinstance(c, int) or c < 1 for c in self.parallel_n):
            raise BenchError(f"parallel_n must be a list of positive integers, got {self.parallel_n!r}")
        object.__setattr__(self, "parallel_n", tuple(sorted(set(self.parallel_n))))
        object.__setattr__(self, "suites", tuple(self.suites))
        if any(not isinstance(c, int) or c < 1 for c in self.decode_contexts):
            raise BenchError(f"decode_contexts must be positive integers, got {self.decode_contexts!r}")
        object.__setattr__(self, "decode_contexts", tuple(self.decode_contexts))

    @classmethod
    def preset(cls, quick: bool) -> "BenchSettings":
        """The full plan, or the `--quick` smoke plan (seconds on a small model)."""
        if quick:
            return cls(concurrency=QUICK_CONCURRENCY, decode_tokens=16, prefill_tokens=64, prefill_repeats=1,
                       max_tokens=8, prompt_tokens=48, warmup_tokens=4, quick=True, parallel_n=(1, 4),
                       parallel_prompt_tokens=64, parallel_max_tokens=8, quality_limit=2, quality_k=4, quality_m=2,
                       quality_max_tokens=16)
        return cls()

    def replace(self, **changes: Any) -> "BenchSettings":
        """A copy with the non-None `changes` applied (and validated)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "concurrency": list(self.concurrency), "suites": list(self.suites),
                "parallel_n": list(self.parallel_n), "decode_contexts": list(self.decode_contexts)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BenchSettings":
        data = {**data, "concurrency": tuple(data["concurrency"]), "suites": tuple(data["suites"])}
        for key in ("parallel_n", "decode_contexts"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


@dataclass(frozen=True)
class Capacity:
    """The most any engine must hold at once (KV sizing): sequences, tokens of the longest
    sequence, and tokens of all sequences of the largest run together."""

    max_seqs: int
    max_seq_len: int
    max_total_tokens: int

    def blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens enough for every run (each sequence may waste a partial block)."""
        return math.ceil(self.max_total_tokens / block_size) + self.max_seqs


@dataclass(frozen=True)
class Workload:
    """Token ids every engine is given; built once by the harness from the model's tokenizer."""

    warmup_prompts: list[list[int]]
    decode_prompt: list[int]
    prefill_prompt: list[int]
    prompts: list[list[int]]          # the concurrency runs take the first N (cycled when short)
    source: str = ""                  # where the prompts came from, for the report
    notes: list[str] = field(default_factory=list)
    context_prompts: list[list[int]] = field(default_factory=list)   # one per settings.decode_contexts

    def batch(self, n: int) -> list[list[int]]:
        """The prompts of a run with `n` concurrent requests."""
        return [self.prompts[i % len(self.prompts)] for i in range(n)]

    def runs(self, settings: BenchSettings) -> list[tuple[list[list[int]], int]]:
        """Every (prompts, new tokens) run of the plan, for sizing caches."""
        return [(self.warmup_prompts, settings.warmup_tokens), ([self.decode_prompt], settings.decode_tokens),
                ([self.prefill_prompt], 1), *((self.batch(n), settings.max_tokens) for n in settings.concurrency),
                *(([p], settings.decode_tokens) for p in self.context_prompts)]

    def capacity(self, settings: BenchSettings) -> Capacity:
        runs = self.runs(settings)
        return Capacity(max_seqs=max(len(prompts) for prompts, _ in runs),
                        max_seq_len=max(len(p) + new for prompts, new in runs for p in prompts),
                        max_total_tokens=max(sum(len(p) + new for p in prompts) for prompts, new in runs))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Workload":
        return cls(**data)
