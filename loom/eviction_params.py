"""KV eviction settings of a request (or a server default): which policy, under what budget.

    kv_eviction={"policy": "streaming", "budget": 1024, "sinks": 4}
    kv_eviction={"policy": "snapkv", "budget": 512, "window": 32}
    kv_eviction={"policy": "none"}          # a request opting out of the server's default

`streaming` (StreamingLLM): the first `sinks` tokens and the most recent ones are kept; the
oldest blocks between them are freed whenever the sequence's cache would exceed `budget`.
The sequence may run past the context window (positions keep counting; see docs/kv_eviction.md).
`window` (optional) is the number of recent tokens never evicted; by default everything the
budget leaves after the sinks.

`snapkv` (SnapKV): when the prompt is computed, its tokens are scored by the attention the last
`window` prompt tokens (the observation window) pay them, pooled over `pool` neighbours; the
`budget - sinks - window` best, the first `sinks` and the window are kept and the rest freed.
Generated tokens are kept, as in the paper.

The implementations live in loom/kv/eviction (one file per policy, a registry by name); this
module only validates, so that SamplingParams and the engine config can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from loom.errors import InvalidRequestError, check_option_keys

EVICTION_POLICIES = ("streaming", "snapkv", "none")
SNAPKV_DEFAULT_WINDOW = 32
SNAPKV_DEFAULT_POOL = 7


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequestError(f"kv_eviction {name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class KVEvictionParams:
    policy: str
    budget: int | None = None      # most tokens of the sequence kept in the KV cache
    sinks: int = 4                 # first tokens always kept (attention sinks)
    window: int | None = None      # recent tokens always kept (snapkv: the observation window)
    pool: int | None = None        # snapkv: width of the score pooling (odd; 1 = none)

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise InvalidRequestError(f"kv_eviction policy must be one of {', '.join(EVICTION_POLICIES)}, "
                                      f"got {self.policy!r}")
        if self.policy == "none":
            return
        _int("sinks", self.sinks, 0)
        if self.window is not None:
            _int("window", self.window, 1)
        if self.budget is None:
            if self.window is None:
                raise InvalidRequestError(f"kv_eviction policy {self.policy!r} needs a budget (tokens kept)")
            object.__setattr__(self, "budget", self.sinks + self.window)
        _int("budget", self.budget, 1)
        if self.policy == "snapkv":
            if self.window is None:
                object.__setattr__(self, "window", min(SNAPKV_DEFAULT_WINDOW, max(1, self.budget - self.sinks)))
            if self.pool is None:
                object.__setattr__(self, "pool", SNAPKV_DEFAULT_POOL)
            if _int("pool", self.pool, 1) % 2 == 0:
                raise InvalidRequestError(f"kv_eviction pool must be odd, got {self.pool}")
        elif self.pool is not None:
            raise InvalidRequestError("kv_eviction pool applies to policy 'snapkv' only")
        window = self.window or 0
        if self.budget < self.sinks + window:
            raise InvalidRequestError(f"kv_eviction budget must be at least sinks + window ({self.sinks} + "
                                      f"{window}), got {self.budget}")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @classmethod
    def create(cls, value: "KVEvictionParams | dict | None") -> "KVEvictionParams | None":
        """From a dict (the JSON of a request or of `--kv-eviction`); unknown keys are refused."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"kv_eviction must be an object such as "
                                      f"{{\"policy\": \"streaming\", \"budget\": 1024}}, got {value!r}")
        check_option_keys("kv_eviction", value, [f.name for f in fields(cls)], "policy", EVICTION_POLICIES)
        return cls(**value)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
