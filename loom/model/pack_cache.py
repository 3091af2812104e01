"""The packed-weight cache: the kernels' layout of a model's projections, kept on disk and
read on the next load instead of being repacked from the GGUF file.

One file per GGUF file (by content) and kernel variant, ``$LOOM_CACHE/packed/<sha256[:24]>-<variant>.pack``::

    magic "LOOMPACK" | format u32 | reserved u32 | index bytes u64 | data bytes u64 | sha256(index) 32 B
    index: UTF-8 JSON {"key": {...}, "entries": {name: {offset, nbytes, shape, n, k, bits, scales16, zero, crc}}}
    zero padding to a 4096-byte boundary
    data: each entry's packed uint8 stream at a 64-byte aligned offset

A load maps the file where the kernel maps it in 2 MB pages (loom/hugepages.py: a decode step
streams every weight, and 2 MB pages spare it a TLB miss per 4 KB; the mapping costs no copy,
and processes loading the same model share its pages). Where the file's pages are cached in
4 KB folios (read by other means), they are dropped from the page cache and read again through
the mapping, in 2 MB folios. Where the kernel maps no file there in 2 MB pages (no large folios
in its page cache for the file system: probed once per kernel, the verdict kept in the cache
directory), or the pages stay in 4 KB folios (another process maps them), the data section is
read into one huge-page buffer instead. `LOOM_HUGEPAGES=0` maps the file as it is.

The key names everything the bytes depend on: the GGUF file's sha256, the kernel variant, loom's
version, the file format (PACK_FORMAT, bumped when this module's layout changes) and a digest of
the code that builds the packed forms (quant.py, weights.py). A file is used only when its magic,
format, length, index checksum, key, entry bounds and each entry's sampled checksum (crc32 of its
first and last 256 bytes) all check out, and, once per file as it is (path, size, mtime, inode:
loom/loader/cache.py's identity records; the file loom just wrote counts as checked), each
entry's crc32 over all its bytes; otherwise the problem is reported in one line and the file is
rebuilt. (A full checksum on every load would cost a pass over every byte each time.)

Files are written whole to a temporary name and renamed into place, so concurrent loaders never
see a partial file. A directory that cannot be written (read-only, full) leaves loom running on
freshly packed weights, saying so once. ``LOOM_PACK_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loom import hugepages
from loom.loader.cache import (CacheWriteError, atomic_write, cache_root, checked, file_sha256, loom_version,
                               mark_checked, source_digest)
from loom.loader.gguf import GGUFFile
from loom.model.quant import PackedCodes

log = logging.getLogger("loom")

PACK_FORMAT = 4
MAGIC = b"LOOMPACK"
_PREFIX = struct.Struct("<8sIIQQ32s")          # 64 bytes
_DATA_ALIGN, _ENTRY_ALIGN, _SAMPLE = 4096, 64, 256
_TRIM_EVERY = 32 << 20   # bytes gathered between hand-backs of the heap (PackCache._gather)
FULL_CHECK = "pack-crc32"   # the record of a file whose every entry matched its full checksum
_CODE = [Path(__file__).parent / n for n in ("quant.py", "weights.py")]   # what the packed bytes depend on

_reported: set[str] = set()   # one line per problem and directory per process


class BadCacheFile(Exception):
    """A cache file that must not be used (the message says why)."""


def _say_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        log.warning(message)


def _sample_crc(buf: np.ndarray) -> int:
    buf = buf.reshape(-1)
    return zlib.crc32(buf[:_SAMPLE].tobytes() + buf[-_SAMPLE:].tobytes())


def enabled() -> bool:
    return os.environ.get("LOOM_PACK_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_key(f: GGUFFile, variant: str, on_hash: Callable[[int], None] | None = None) -> dict:
    return {"gguf_sha256": file_sha256(f.path, on_hash), "variant": variant, "loom": loom_version(),
            "format": PACK_FORMAT, "code": source_digest(*_CODE)}


def read_pack_file(path: Path, key: dict) -> dict[str, PackedCodes]:
    """The entries of a valid cache file for `key`; raises BadCacheFile."""
    size = path.stat().st_size
    if size < _PREFIX.size:
        raise BadCacheFile(f"truncated ({size} bytes)")
    with path.open("rb") as fh:
        magic, fmt, _, index_len, data_len, digest = _PREFIX.unpack(fh.read(_PREFIX.size))
        if magic != MAGIC:
            raise BadCacheFile("not a loom packed-weight file (bad magic bytes)")
        if fmt != PACK_FORMAT:
            raise BadCacheFile(f"stale (packing format {fmt}, this loom writes {PACK_FORMAT})")
        data_start = -(-(_PREFIX.size + index_len) // _DATA_ALIGN) * _DATA_ALIGN
        if data_start + data_len != size:
            raise BadCacheFile(f"truncated or overlong ({size} bytes, the header promises {data_start + data_len})")
        index_bytes = fh.read(index_len)
    if hashlib.sha256(index_bytes).digest() != digest:
        raise BadCacheFile("corrupt (index checksum mismatch)")
    index = json.loads(index_bytes)
    if index.get("key") != key:
        was = index.get("key") or {}
        diff = ", ".join(f"{k} {was.get(k)!r} -> {v!r}" for k, v in key.items() if was.get(k) != v)
        raise BadCacheFile(f"stale ({diff})")
    data = _read_data(path, data_start, data_len) if data_len else None
    full = not checked(path, FULL_CHECK)   # every byte, once per file as it is (then the samples)
    out = {}
    for name, e in index["entries"].items():
        off, nbytes = int(e["offset"]), int(e["nbytes"])
        if off < 0 or nbytes <= 0 or off + nbytes > data_len:
            raise BadCacheFile(f"corrupt (entry '{name}' out of bounds)")
        buf = data[off:off + nbytes]
        if _sample_crc(buf) != e["crc"] or (full and zlib.crc32(buf) != e["crc32"]):
            raise BadCacheFile(f"corrupt (entry '{name}' fails its data checksum)")
        shape = tuple(int(d) for d in e["shape"])
        if int(np.prod(shape)) != nbytes:
            raise BadCacheFile(f"corrupt (entry '{name}' has shape {shape} for {nbytes} bytes)")
        out[name] = PackedCodes(torch.from_numpy(buf).view(shape), int(e["n"]), int(e["k"]), int(e["bits"]),
                                bool(e["scales16"]), int(e["zero"]))
    if full:
        mark_checked(path, FULL_CHECK)
    return out


def _read_data(path: Path, start: int, nbytes: int) -> np.ndarray:
    """The file's data section: mapped in 2 MB pages (_map_huge), else read into a huge-page
    buffer (loom/hugepages.py), or mapped as it is where huge pages are off."""
    if not hugepages.enabled():
        return np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(nbytes,))
    mapped = _map_huge(path)
    if mapped is not None:
        return mapped[start:start + nbytes]
    data = hugepages.buffer(nbytes)
    view, got = memoryview(data), 0
    with path.open("rb", buffering=0) as fh:
        fh.seek(start)
        while got < nbytes:
            n = fh.readinto(view[got:])
            if not n:
                raise BadCacheFile(f"truncated while reading ({start + got} bytes)")
            got += n
    return data


def _map_huge(path: Path) -> np.ndarray | None:
    """The whole file mapped in 2 MB pages (hugepages.map_file): as its pages are cached, or
    else once they are dropped and read again through the advised mapping (pages that another
    process maps stay as they are). None where neither maps it so, or where the kernel maps no
    file of the cache's file system in 2 MB pages (_huge_file_pages)."""
    if path.stat().st_size < 2 * hugepages.HUGE_PAGE or not _huge_file_pages(path.parent):
        return None
    mapped = hugepages.map_file(path)
    if mapped is None:
        hugepages.drop_cached(path)
        mapped = hugepages.map_file(path)
    return mapped


def _huge_file_pages(directory: Path) -> bool:
    """Whether this kernel maps the cache directory's files in 2 MB pages: probed once per
    kernel release (hugepages.probe_file_pages), the verdict kept beside the cache files. Where
    it does not, a load copies the data section (a dropped file's second read from disk would
    cost every load)."""
    verdict = directory / f".huge-file-pages-{os.uname().release}"
    try:
        return verdict.read_text().strip() == "1"
    except OSError:
        pass
    ok = hugepages.probe_file_pages(directory)
    try:
        atomic_write(verdict, lambda out: out.write(b"1\n" if ok else b"0\n"))
    except CacheWriteError:
        pass   # probed again next time
    return ok


def write_pack_file(out: BinaryIO, key: dict, entries: dict[str, PackedCodes]) -> None:
    index, offset = {}, 0
    for name, p in entries.items():
        nbytes = p.w.numel()
        index[name] = {"offset": offset, "nbytes": nbytes, "shape": list(p.w.shape), "n": p.n, "k": p.k,
                       "bits": p.bits, "scales16": p.scales16, "zero": p.zero, "crc": _sample_crc(p.w.numpy()),
                       "crc32": zlib.crc32(p.w.numpy().reshape(-1))}
        offset += -(-nbytes // _ENTRY_ALIGN) * _ENTRY_ALIGN
    index_bytes = json.dumps({"key": key, "entries": index}).encode()
    data_start = -(-(_PREFIX.size + len(index_bytes)) // _DATA_ALIGN) * _DATA_ALIGN
    out.write(_PREFIX.pack(MAGIC, PACK_FORMAT, 0, len(index_bytes), offset, hashlib.sha256(index_bytes).digest()))
    out.write(index_bytes)
    out.write(b"\0" * (data_start - _PREFIX.size - len(index_bytes)))
    for name, p in entries.items():
        out.write(memoryview(p.w.numpy().reshape(-1)))
        out.write(b"\0" * (-p.w.numel() % _ENTRY_ALIGN))
    out.flush()
    os.fsync(out.fileno())   # on disk before the rename, its pages clean: the next load can drop them (_map_huge)


class PackCache:
    """Packed forms of one GGUF file's projections for one kernel variant.

    `get(name, pack)` returns the cached form or packs (and keeps) a new one; leaving the
    `with` block writes the file when anything new was packed. A cold load shows a progress
    bar of the matrices packed."""

    def __init__(self, path: Path | None, key: dict | None, entries: dict[str, PackedCodes], bar: "_Bar"):
        self.path, self.key, self.entries, self.bar = path, key, entries, bar
        self.new: dict[str, PackedCodes] = {}

    @classmethod
    def open(cls, f: GGUFFile, variant: str) -> "PackCache":
        bar = _Bar(sum(1 for t in f.tensors.values() if len(t.shape) == 2), f.path)
        if not enabled():
            return cls(None, None, {}, bar)
        try:
            key = cache_key(f, variant, bar.hashed)
        finally:
            bar.close()
        path = cache_root() / "packed" / f"{key['gguf_sha256'][:24]}-{variant}.pack"
        entries: dict[str, PackedCodes] = {}
        try:
            entries = read_pack_file(path, key)
        except (FileNotFoundError, NotADirectoryError):
            pass   # nothing cached yet (or no cache directory: saving says so)
        except (BadCacheFile, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("packed-weight cache %s is %s: rebuilding it", path, e)
        return cls(path, key, entries, bar)

    def get(self, name: str, pack: Callable[[], PackedCodes]) -> PackedCodes:
        p = self.entries.get(name)
        if p is None:
            self.bar.packed(name.count("+") + 1)
            p = self.entries[name] = self.new[name] = pack()
        return p

    def save(self) -> None:
        """Writes every entry (cached and new) when anything new was packed, then holds them
        in a huge-page buffer, or as the written file's pages where huge pages are off. (Not
        as a warm load maps the file: that would hold the file's pages and the packing's
        copies at once, Gemma 3's cold load peaking 113 MB higher; _gather frees the copies as
        it goes.)"""
        if not self.new:
            return
        if self.path is not None and self._write() and not hugepages.enabled():
            self._map_written()
        else:
            self._gather()   # (nothing to do where huge pages are off)

    def _write(self) -> bool:
        try:
            atomic_write(self.path, lambda out: write_pack_file(out, self.key, self.entries))
            mark_checked(self.path, FULL_CHECK)   # its bytes are the ones just packed
            return True
        except CacheWriteError as e:
            _say_once(f"packed-weight cache unavailable ({e.strerror}): loom runs without it and packs "
                      f"the weights at every load")
            return False

    def _gather(self) -> None:
        """Moves the packed forms into one huge-page buffer, as a warm load holds them
        (loom/hugepages.py), freeing the packing's copies as it goes: the heap is handed back
        every _TRIM_EVERY bytes, so the two copies never coexist whole."""
        if not hugepages.enabled():
            return
        sizes = {name: -(-p.w.numel() // _ENTRY_ALIGN) * _ENTRY_ALIGN for name, p in self.entries.items()}
        data, offset, since_trim = hugepages.buffer(sum(sizes.values())), 0, 0
        for name, p in self.entries.items():
            w = torch.from_numpy(data[offset:offset + p.w.numel()]).view(p.w.shape)
            w.copy_(p.w)
            p.w = w   # the model's layers and stack hold p, so they read the new copy
            offset += sizes[name]
            since_trim += sizes[name]
            if since_trim >= _TRIM_EVERY:
                _trim_heap()
                since_trim = 0
        _trim_heap()

    def _map_written(self) -> None:
        """Points the packed forms at the file just written: the process then holds the weights
        as after a warm load, and the packing's own copies are freed."""
        try:
            mapped = read_pack_file(self.path, self.key)
        except (BadCacheFile, OSError, ValueError, KeyError, TypeError):
            return   # keep the in-memory copies; the next load checks the file again
        for name, p in self.entries.items():
            if name in mapped and mapped[name].w.shape == p.w.shape:
                p.w = mapped[name].w
        _trim_heap()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "PackCache":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc_type is None:
            self.save()


def _trim_heap() -> None:
    """Hands the heap's free pages back to the system (glibc): the packing's copies, freed, stay
    resident otherwise (Gemma 3's cold load: 123 MB of them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass   # not glibc


class _Bar:
    """The cold load's progress display on stderr (started on first use): hashing the file
    when its digest is not on record yet, then the matrices packed."""

    def __init__(self, matrices: int, path: Path):
        self.matrices, self.path = matrices, path
        self.progress: Progress | None = None
        self.tasks: dict[str, object] = {}

    def _task(self, label: str, total: int):
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.progress.start()
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total)
        return self.tasks[label]

    def hashed(self, nbytes: int) -> None:
        self.advance(f"hashing {self.path.name} (MB)", self.path.stat().st_size // 2**20 + 1, nbytes / 2**20)

    def packed(self, n: int) -> None:
        self.advance("packing weights", self.matrices, n)

    def advance(self, label: str, total: int, n: float) -> None:
        task = self._task(label, total)
        self.progress.advance(task, n)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
            self.tasks.clear()
