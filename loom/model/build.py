"""load_model: a GGUF path -> a ready model object of the right architecture."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Callable

from loom import kernels

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile
from loom.model.arch.gemma3 import Gemma3ForCausalLM
from loom.model.arch.llama import LlamaForCausalLM
from loom.model.config import ModelConfig
from loom.model.pack_cache import PackCache
from loom.model.weights import GGUFWeights

ARCHITECTURES: dict[str, Callable] = {"llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}


def load_model(path: str | os.PathLike | GGUFFile, linear: str = "exact"):
    """Returns the model (with `.cfg`, `.forward(...)`, `.compute_logits(...)`); raises ModelLoadError.

    `linear` picks the projection backend (see loom.model.layers.linear): "exact" is
    dense float32, bit-identical to the reference implementation."""
    f = path if isinstance(path, GGUFFile) else GGUFFile.open(path)
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f.path, f"unsupported model architecture '{arch}' "
                                     f"(loom runs: {', '.join(ARCHITECTURES)})")
    cfg = ModelConfig.from_gguf(f)
    with _pack_cache(f, linear) as cache:
        return ARCHITECTURES[arch](cfg, GGUFWeights(f, cache), linear=linear)


def _pack_cache(f: GGUFFile, linear: str):
    """The packed-weight cache, for the modes that run loom's kernels (see loom/model/pack_cache.py)."""
    if linear in ("quant", "auto") and kernels.load() is not None:
        return PackCache.open(f, kernels.variant())
    return nullcontext(None)
