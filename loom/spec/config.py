"""`speculative_config`: which drafter, how many draft tokens at most, and its knobs.

Given as a dict, as in vLLM: ``LLM(model, speculative_config={"method": "prompt_lookup"})``
or ``loom serve --speculative-config '{"method": "auto"}'``. Unknown keys and bad values
raise `InvalidRequestError` naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from loom.errors import InvalidRequestError

METHODS = ("prompt_lookup", "token_recycling", "lookahead", "draft_model", "auto")


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

    def __post_init__(self):
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                                      f"got {self.method!r}")
        ints = {"num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
                "recycling_top_k": 1, "lookahead_window": 1, "lookahead_ngram": 2, "lookahead_guesses": 0}
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

    @classmethod
    def create(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"unknown speculative_config key(s) {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise InvalidRequestError(f"speculative_config needs a 'method' (one of {', '.join(METHODS)})")
        return cls(**value)
