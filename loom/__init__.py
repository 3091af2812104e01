"""loom: an LLM inference and serving engine for parallel generation on CPUs.

The public names are imported on first use (PEP 562), so importing a light submodule such as
`loom.errors` or `loom.bench.worker` does not pull in torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.llm import LLM
    from loom.outputs import CompletionOutput, RequestOutput
    from loom.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "loom.llm",
    "SamplingParams": "loom.sampling_params",
    "BeamSearchParams": "loom.sampling_params",
    "RequestOutput": "loom.outputs",
    "CompletionOutput": "loom.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loom' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
