"""loom's on-disk cache of derived files: where it lives, file identities, atomic writes.

Layout (``LOOM_CACHE``, default ``~/.cache/loom``)::

    models/          GGUF files pulled from the registry (loom/loader/registry.py)
    kernels/         compiled kernel modules (loom/kernels)
    packed/          packed weights per GGUF file and kernel variant (loom/model/pack_cache.py)
    costs/           speculative decoding's timed forward passes per model and machine (loom/speculative/calibration.py)
    tokenizers/      derived tokenizer tables (loom/loader/tokenizer.py)
    identity/        the sha256 of GGUF files outside models/, remembered per path, size and mtime,
                     and the checks a file passed (a packed-weight file's full checksum), per the same

Derived files are keyed by the *content* of the GGUF file (its sha256), never by its path, so a
renamed or copied model finds its cache and a model replaced in place does not. Hashing a file
costs a full read, so the digest is remembered per (path, size, mtime) and a warm load reads
only that record.

Every write is atomic: the data goes to a temporary file in the target's directory, which is
then renamed over the target. Two processes writing the same entry at once each rename a
complete file; a reader never sees a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import BinaryIO, Callable

from loom.paths import cache_root

log = logging.getLogger("loom")

_CHUNK = 1 << 20
_SIDECAR_SUFFIX = ".sha256"   # the registry's record next to a pulled model (same format)


class CacheWriteError(OSError):
    """A cache file could not be written (read-only or full directory, ...)."""




@lru_cache(maxsize=1)
def loom_version() -> str:
    try:
        return metadata.version("loom")
    except metadata.PackageNotFoundError:
        return "source"


@lru_cache(maxsize=None)
def source_digest(*files: str | os.PathLike) -> str:
    """A short digest of source files, so caches derived by code that changed are not reused
    even where the version number did not change (a development tree)."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def _record(path: Path) -> tuple[Path, dict]:
    st = path.stat()
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "identity" / f"{key}.json", {"path": str(path.resolve()), "size": st.st_size,
                                                        "mtime_ns": st.st_mtime_ns}


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def file_sha256(path: str | os.PathLike, on_hash: Callable[[int], None] | None = None) -> str:
    """The sha256 of `path`, read from a record that matches its size and mtime (the registry's
    sidecar or loom's own), else computed (reporting bytes read to `on_hash`) and recorded."""
    path = Path(path)
    record_path, stamp = _record(path)
    for rec in (_read_json(path.with_name(path.name + _SIDECAR_SUFFIX)), _read_json(record_path)):
        if rec and rec.get("size") == stamp["size"] and rec.get("mtime_ns") == stamp["mtime_ns"] \
                and isinstance(rec.get("sha256"), str):
            return rec["sha256"]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if on_hash:
                on_hash(len(chunk))
    digest = h.hexdigest()
    try:
        atomic_write(record_path, lambda out: out.write(json.dumps(stamp | {"sha256": digest}).encode()))
    except CacheWriteError:
        pass   # hashed again next time; the caller reports an unwritable cache once
    return digest


def _check_record(path: Path, tag: str) -> tuple[Path, dict]:
    record_path, stamp = _record(path)
    return record_path.with_name(f"{record_path.stem}-{tag}.json"), stamp | {"ino": path.stat().st_ino}


def checked(path: str | os.PathLike, tag: str) -> bool:
    """Whether check `tag` passed on `path` as it is now (same path, size, mtime and inode)."""
    record_path, stamp = _check_record(Path(path), tag)
    return _read_json(record_path) == stamp


def mark_checked(path: str | os.PathLike, tag: str) -> None:
    """Records that check `tag` passed on `path` as it is now (see `checked`)."""
    record_path, stamp = _check_record(Path(path), tag)
    try:
        atomic_write(record_path, lambda out: out.write(json.dumps(stamp).encode()))
    except CacheWriteError:
        pass   # checked again next time


def atomic_write(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Writes `target` through `write(file)` into a temporary file renamed over it; raises
    CacheWriteError (the temporary file removed) when the directory is read-only or full."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise CacheWriteError(e.errno, f"cannot write {target}: {e.strerror or e}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
