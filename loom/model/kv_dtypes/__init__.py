"""KV cache element formats, one file each; `CacheConfig.kv_cache_dtype` names one of them.

    float32   the exact mode's                                      4 D bytes a row
    float16   "auto" with loom's kernels                            2 D bytes
    int8      Hadamard rotation, int8 codes, one scale a row        D + 2 bytes
    int4      Hadamard rotation, 4-bit codes, a scale per 32        D/2 + D/16 bytes

The quantized formats also ask a model with per-head q/k norms to store its keys divided by a
fixed per-channel factor and to scale its queries by it (smoothing.py): no extra bytes.

A row is one slot's key or value for one kv head. The kernels read every format directly from
the cache, 16 keys at a time (loom/kernels/csrc/loom_kernels_kv.h); the torch path decodes the
rows it gathers. A new format is one file here, one entry in FORMATS and its row type in the
kernels.
"""

from __future__ import annotations

import torch

from loom.config import KV_CACHE_DTYPES
from loom.model.kv_dtypes.base import KVFormat, hadamard
from loom.model.kv_dtypes.int4 import INT4
from loom.model.kv_dtypes.int8 import INT8
from loom.model.kv_dtypes.plain import FLOAT16, FLOAT32
from loom.model.kv_dtypes.smoothing import key_smoothing

FORMATS: dict[str, KVFormat] = {f.name: f for f in (FLOAT32, FLOAT16, INT8, INT4)}
assert set(FORMATS) | {"auto"} == set(KV_CACHE_DTYPES), "CacheConfig's names are the formats here"

__all__ = ["FORMATS", "KVFormat", "format_of", "hadamard", "key_smoothing", "kv_format"]


def kv_format(choice: str | torch.dtype | KVFormat, kernels: bool = False, head_dim: int | None = None) -> KVFormat:
    """The format for a kv_cache_dtype name ("auto": float16 where loom's kernels read the
    cache, float32 in the exact mode), a torch dtype, or a format; checked against head_dim."""
    if isinstance(choice, KVFormat):
        fmt = choice
    elif isinstance(choice, torch.dtype):
        fmt = {torch.float32: FLOAT32, torch.float16: FLOAT16}[choice]
    elif choice == "auto":
        fmt = FLOAT16 if kernels else FLOAT32
    elif choice in FORMATS:
        fmt = FORMATS[choice]
    else:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {choice!r}")
    if head_dim is not None:
        fmt.check(head_dim)
    return fmt


def format_of(cache: torch.Tensor, head_dim: int) -> KVFormat:
    """The format of a cache tensor [..., row] (loom/model/kv_cache.py) holding rows of head_dim values."""
    if cache.dtype != torch.uint8:
        return kv_format(cache.dtype)
    for fmt in (INT8, INT4):
        if fmt.row_size(head_dim) == cache.shape[-1]:
            return fmt
    raise ValueError(f"a uint8 cache with rows of {cache.shape[-1]} bytes is no format for head_dim {head_dim}")
