"""GGUF file reading: metadata, tensor directory and dequantization.

The header is parsed here directly (string arrays of 262k-token vocabularies take
seconds through `gguf.GGUFReader`, a fraction of a second this way); tensor data is
memory-mapped and decoded with the `gguf` package's reference dequantizers.

Every problem with the file surfaces as one `ModelLoadError` naming the file and the
problem: missing, not GGUF, truncated, corrupt, unsupported tensor type.

Layout reminder (GGUF v2/v3, little endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, type: u32, value)
    n_tensors x (name: str, n_dims: u32, dims: u64 x n_dims, type: u32, offset: u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from loom.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# Tensor types loom reads. Others (IQ*, TQ*, ...) are rejected with a clear error.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF metadata value types -> (struct format, size) for scalars.
_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # logical numpy order: outermost first (reverse of GGUF dims)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Bounds-checked reader over a memory map; running off the end means truncation."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(self.path, f"file is truncated or corrupt (header needs byte {self.pos + n}, "
                                            f"file has {len(self.buf)})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int):
        fmt, size = _SCALAR[vtype]
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        if n > 1 << 30:
            raise ModelLoadError(self.path, f"corrupt string length {n} at byte {self.pos - 8}")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary). One loop finds where each starts; numpy then
        drops the length fields, leaving one NUL between strings, and the bytes are decoded at
        once and split: a third of the time of decoding each string on its own (`string`),
        which remains the path for strings that hold a NUL themselves."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        starts, length = [], _U64.unpack_from
        append = starts.append
        for _ in range(count):
            if pos + 8 > end:
                break
            append(pos)
            pos += 8 + length(buf, pos)[0]
        if pos > end or len(starts) < count:
            raise ModelLoadError(self.path, f"file is truncated or corrupt (header needs byte {max(pos, end + 1)}, "
                                            f"file has {end})")
        self.pos = pos
        if not count:
            return []
        first = starts[0]
        rel = np.asarray(starts, dtype=np.int64) - first                    # [count] length fields
        region = np.frombuffer(buf[first:pos], dtype=np.uint8).copy()
        drop = np.zeros(len(region) + 1, dtype=np.int8)                      # +1 where a field starts,
        drop[rel] += 1                                                       # -1 at its last byte
        drop[rel + 7] -= 1
        region[rel + 7] = 0                                                  # each field's last byte: NUL
        out = region[np.cumsum(drop[:-1], dtype=np.int8) == 0].tobytes().decode("utf-8", "replace").split("\x00")
        if len(out) == count + 1:
            return out[1:]
        cur = _Cursor(buf, self.path)                                        # a string holds a NUL
        cur.pos = first
        return [cur.string() for _ in range(count)]

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.scalar(vtype)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.u32(), self.u64()
            if itype in _NP:
                size = _SCALAR[itype][1]
                return np.frombuffer(self.take(count * size), dtype=_NP[itype]).copy()
            if itype == _STRING:
                return self.strings(count)
            if itype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ModelLoadError(self.path, f"corrupt metadata: unknown array element type {itype}")
        raise ModelLoadError(self.path, f"corrupt metadata: unknown value type {vtype} at byte {self.pos - 4}")


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> Python/numpy value) and `tensors` (name -> TensorInfo).

    Use `GGUFFile.open(path)`. Tensor data is read lazily from a read-only memory map.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], mm: np.memmap):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._mm = mm

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        path = Path(path)
        if not path.exists():
            raise ModelLoadError(path, "no such file")
        if path.is_dir():
            raise ModelLoadError(path, "is a directory, expected a .gguf file")
        if path.stat().st_size < 24:
            raise ModelLoadError(path, f"file is too small to be GGUF ({path.stat().st_size} bytes)")
        try:
            mm = np.memmap(path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelLoadError(path, f"cannot read file: {e}") from None
        cur = _Cursor(memoryview(mm), path)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ModelLoadError(path, "not a GGUF file (bad magic bytes)")
        version = cur.u32()
        if version not in (2, 3):
            raise ModelLoadError(path, f"unsupported GGUF version {version} (loom reads versions 2 and 3)")
        n_tensors, n_kv = cur.u64(), cur.u64()
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise ModelLoadError(path, f"corrupt header (claims {n_tensors} tensors, {n_kv} metadata keys)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.u32())
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise ModelLoadError(path, f"corrupt tensor '{name}': {n_dims} dimensions")
            dims = [cur.u64() for _ in range(n_dims)]
            raw.append((name, dims, cur.u32(), cur.u64()))
        align = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        tensors = {}
        for name, dims, tcode, off in raw:
            tensors[name] = _tensor_info(path, name, dims, tcode, data_start + off, len(mm))
        return cls(path, metadata, tensors, mm)

    # -- metadata helpers -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(self.path, "metadata has no 'general.architecture'")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(self.path, f"metadata key '{key}' is missing")
        return self.metadata[key]

    # -- tensor data --------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (uint8 view into the memory map, no copy)."""
        info = self.tensor_info(name)
        return self._mm[info.offset:info.offset + info.nbytes]

    def raw_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 - 1 of a 2-D tensor's stored bytes (a row's blocks are contiguous)."""
        info = self.tensor_info(name)
        return self.raw(name).reshape(info.shape[0], -1)[r0:r1]

    def release(self, data: np.ndarray) -> None:
        """Drops the whole pages under `data` (a view into this file's memory map) from the
        process's resident memory; they stay in the page cache and are read again if touched.
        A cold load packs each matrix once, after which its stored bytes need not stay resident
        beside the packed copy."""
        mapping = getattr(self._mm, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED") or data.size == 0:
            return
        start = data.ctypes.data - self._mm.ctypes.data
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelLoadError(self.path, f"tensor '{name}' is missing")
        return self.tensors[name]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its logical shape."""
        from gguf.quants import dequantize

        info = self.tensor_info(name)
        data = self.raw(name)
        t = info.qtype
        if t == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if t == GGMLQuantizationType.F16:
            return data.view(np.float16).astype(np.float32).reshape(info.shape)
        block, bsize = GGML_QUANT_SIZES[t]
        rows = data.reshape(*info.shape[:-1], info.shape[-1] // block * bsize)
        out = dequantize(rows, t)
        if not np.isfinite(out).all():
            raise ModelLoadError(self.path, f"tensor '{name}' holds non-finite values (corrupt data)")
        return out.reshape(info.shape).astype(np.float32, copy=False)


def _tensor_info(path: Path, name: str, dims: list[int], tcode: int, offset: int, file_size: int) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(tcode)
    except ValueError:
        raise ModelLoadError(path, f"tensor '{name}' has unknown tensor type code {tcode}") from None
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(path, f"tensor '{name}' has unsupported tensor type {qtype.name} "
                                   f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
    shape = tuple(int(d) for d in reversed(dims))
    block, bsize = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block:
        raise ModelLoadError(path, f"tensor '{name}' row length {shape[-1]} is not a multiple of the "
                                   f"{qtype.name} block size {block}")
    nbytes = n // block * bsize
    if offset + nbytes > file_size:
        raise ModelLoadError(path, f"file is truncated: tensor '{name}' needs bytes up to {offset + nbytes}, "
                                   f"file has {file_size}")
    return TensorInfo(name, shape, qtype, offset, nbytes)
