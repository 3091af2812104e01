"""Turning GGUF tensors into the weights a model file asks for.

A `LinearWeight` read from a file is a recipe, not a copy: its forms (dense float32, exact
codes, the kernels' packed layout) are built when a backend first asks for one. A model on
loom's kernels asks only for the packed form, which comes from the packed-weight cache on a
warm load (loom/model/pack_cache.py), so no float copy of a quantized tensor is ever made.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile
from loom.model.layers.embedding import QuantEmbedding
from loom.model.pack_cache import PackCache
from loom.model.quant import PackedCodes, QuantCodes, exact_codes, has_exact_codes, pack_codes, pack_rows

_UNSET = object()


class LinearWeight:
    """One [out, in] matrix (possibly several tensors stacked by rows, e.g. fused QKV).

    `dense` is the exact float32 dequantization; `quant` its code form (loom.model.quant),
    exact for the GGUF types that have one, else None; `codes()` then requantizes to 8 bits;
    `packed()` is the kernels' layout of `codes()`. Given tensors are used as they are; a
    weight made by `GGUFWeights` builds each form on first use (and keeps it while it lives).
    """

    def __init__(self, dense: torch.Tensor | None = None, quant: QuantCodes | None = None, *,
                 shape: tuple[int, int] | None = None, make_dense: Callable[[], torch.Tensor] | None = None,
                 make_quant: Callable[[], QuantCodes | None] | None = None,
                 quant_rows: Callable[[int, int], QuantCodes] | None = None,
                 key: str | None = None, cache: PackCache | None = None):
        if dense is None and make_dense is None:
            raise ValueError("LinearWeight needs a dense tensor or a way to make one")
        self._dense, self._make_dense = dense, make_dense
        self._quant = quant if dense is not None or quant is not None or make_quant is None else _UNSET
        self._make_quant = make_quant
        self._quant_rows = quant_rows   # the exact codes by row range, where the stored type has them
        self.shape = tuple(shape) if shape is not None else tuple(dense.shape)   # (out, in)
        self.key, self.cache = key, cache   # the packed form's name in the cache, and the cache

    @property
    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._make_dense()
        return self._dense

    @property
    def quant(self) -> QuantCodes | None:
        if self._quant is _UNSET:
            self._quant = self._make_quant()
        return self._quant

    def codes(self) -> QuantCodes:
        return self.quant if self.quant is not None else QuantCodes.requantize(self.dense)

    def packed(self) -> PackedCodes:
        """The kernels' layout of `codes()`: from the packed-weight cache when it holds it."""
        if self.cache is not None and self.key is not None:
            return self.cache.get(self.key, self._pack)
        return self._pack()

    def _pack(self) -> PackedCodes:
        # by row range where the file gives exact codes that way and none were made yet (Gemma 3's
        # 262k-row output matrix: its codes and scales would be 210 MB more at once)
        if self._quant_rows is not None and self._quant is _UNSET:
            return pack_rows(*self.shape, self._quant_rows)
        return pack_codes(self.codes())

    @property
    def int4(self) -> QuantCodes | None:
        """The exact 4-bit codes, if the stored type is a 4-bit one."""
        return self.quant if self.quant is not None and self.quant.bits == 4 else None

    def permute_rows(self, order: torch.Tensor, tag: str = "perm") -> "LinearWeight":
        """Rows reordered (lazily); `tag` names the order in the cache key."""
        def quant():
            q = self.quant
            return q.permute_rows(order) if q is not None else None
        return LinearWeight(shape=self.shape, make_dense=lambda: self.dense[order].contiguous(), make_quant=quant,
                            key=f"{self.key}@{tag}" if self.key else None, cache=self.cache)

    @staticmethod
    def cat(parts: list["LinearWeight"]) -> "LinearWeight":
        """Row-stacked (fused QKV, gate/up); parts without an exact form are requantized."""
        def quant():
            if all(p.quant is None for p in parts):
                return None
            return QuantCodes.cat([p.codes() for p in parts])
        keys = [p.key for p in parts]
        return LinearWeight(shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]),
                            make_dense=lambda: torch.cat([p.dense for p in parts]), make_quant=quant,
                            key="+".join(keys) if all(keys) else None, cache=parts[0].cache)


class GGUFWeights:
    """Named weights of a GGUF file, with llama.cpp's layout quirks undone. `cache`, when
    given, supplies (and keeps) the packed forms of the projections."""

    def __init__(self, f: GGUFFile, cache: PackCache | None = None):
        self.file = f
        self.cache = cache

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def _check_shape(self, name: str, shape: tuple[int, ...] | None) -> None:
        info = self.file.tensor_info(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise ModelLoadError(self.file.path, f"tensor '{name}' has shape {tuple(info.shape)}, "
                                                 f"the model config implies {tuple(shape)}")

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor dequantized to float32."""
        self._check_shape(name, shape)
        arr = self.file.dequantize(name)
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))

    def linear(self, name: str, shape: tuple[int, int], unpermute_heads: int | None = None) -> LinearWeight:
        """A projection matrix, with its exact code form when the stored type has one.

        `unpermute_heads`: Q/K of llama-architecture files, whose rows llama.cpp's converter
        interleaved per head for pairwise RoPE; undone here (a pure row reorder) so the
        rotate-half RoPE applies.
        """
        self._check_shape(name, shape)
        info = self.file.tensor_info(name)
        rows = (lambda r0, r1: self._exact_rows(name, r0, r1)) if has_exact_codes(info.qtype) else None
        w = LinearWeight(shape=shape, make_dense=lambda: self.get(name, shape),
                         make_quant=lambda: self._exact_rows(name, 0, shape[0]), quant_rows=rows,
                         key=name, cache=self.cache)
        if unpermute_heads:
            n = shape[0]
            half = n // unpermute_heads // 2
            order = torch.arange(n).view(unpermute_heads, half, 2).transpose(1, 2).reshape(n)
            w = w.permute_rows(order, f"unpermute{unpermute_heads}")
        return w

    def _exact_rows(self, name: str, r0: int, r1: int) -> QuantCodes | None:
        """The exact codes of rows r0 .. r1 - 1 (None for a type without them); the stored rows'
        pages then leave the resident set (the codes are copies)."""
        info, raw = self.file.tensor_info(name), self.file.raw_rows(name, r0, r1)
        codes = exact_codes(np.asarray(raw), info.qtype, (r1 - r0, info.shape[1]))
        self.file.release(raw)
        return codes

    def embedding(self, name: str, shape: tuple[int, int]) -> QuantEmbedding:
        """Rows of an embedding table, dequantized from the stored rows as they are gathered."""
        self._check_shape(name, shape)
        info = self.file.tensor_info(name)
        return QuantEmbedding(self.file.path, info.offset, info.qtype, shape)
