"""loom: an LLM inference and serving engine for parallel generation on CPUs."""

from loom.llm import LLM
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
