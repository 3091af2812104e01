"""The interface every benchmarked engine implements, and the timings it returns.

A peer generates greedily from token ids, past end-of-sequence, exactly the number of tokens
asked; all requests of one `generate` call are submitted at the same moment. Times come from
`time.monotonic`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from loom.bench.settings import Capacity


@dataclass(frozen=True)
class RequestTiming:
    """One request of a run: time to first token, mean time per later token, tokens produced, and
    when each token existed (seconds after submission; empty where the engine cannot say)."""

    ttft: float
    tpot: float | None  # None when only one token was generated
    output_tokens: int
    token_times: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunTiming:
    """One `generate` call: wall time from submitting all requests until the last one finished."""

    wall_seconds: float
    requests: list[RequestTiming]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def decode_throughput(self) -> float | None:
        """Output tokens per second while every request decodes: over the window from the last
        request's first token to the first request's last one (all requests past their prompts,
        none finished), the tokens produced in it over its length. Free of the prompts' prefill,
        which the wall time includes. None without such a window or without token times."""
        reqs = self.requests
        if not reqs or any(len(r.token_times) != r.output_tokens or r.output_tokens < 2 for r in reqs):
            return None
        lo, hi = max(r.token_times[0] for r in reqs), min(r.token_times[-1] for r in reqs)
        if hi <= lo:
            return None
        return sum(lo < t <= hi for r in reqs for t in r.token_times) / (hi - lo)


def request_timing(submitted: float, first: float, last: float, tokens: int,
                   token_times: Sequence[float] = ()) -> RequestTiming:
    """Timing of a request submitted at `submitted` whose first/last tokens came at `first`/`last`
    (`token_times`: every token's time, if known)."""
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestTiming(ttft=first - submitted, tpot=tpot, output_tokens=tokens,
                         token_times=tuple(t - submitted for t in token_times))


@dataclass
class Peer(ABC):
    """An engine under test. `load` once, then any number of `generate` / `prefill` calls.

    model_path: the GGUF file; threads: compute threads to use; capacity: the most sequences and
    tokens per sequence any later call needs (size KV caches to this, not to free RAM);
    options: engine-specific choices from the peer spec (e.g. ``{"dtype": "float32"}``).
    """

    model_path: Path
    threads: int
    capacity: Capacity
    options: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # how this engine was run, for the report
    info: dict[str, Any] = field(default_factory=dict)  # versions and settings, for the JSON

    @abstractmethod
    def load(self) -> None:
        """Load the model and make the engine ready to generate (this is what load time measures)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        """Submit all `prompts` at once; each produces exactly `max_tokens` greedy tokens."""

    def prefill(self, prompt: Sequence[int]) -> float:
        """Seconds from submitting `prompt` (not cached anywhere) until its first token exists."""
        return self.generate([prompt], 1).requests[0].ttft

    def max_concurrency(self) -> int | None:
        """The most requests one `generate` call can take (None: no limit)."""
        return None

    def close(self) -> None:
        """Release the model (the worker exits right after; this is for in-process use)."""


def now() -> float:
    return time.monotonic()
