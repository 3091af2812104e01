"""The C heap's settings in a process that runs an engine.

torch allocates every CPU tensor with malloc. glibc serves a request above its mmap threshold
(128 KB at first, rising as such blocks are freed, to at most 32 MB) with a fresh mapping that
it unmaps again on free, and hands the heap's top back to the system past its trim threshold.
So the larger tensors of every step came back as fresh pages, each one zeroed by the kernel
on first touch: Gemma 3's logits at 32 rows (32 x 262,144 floats, 33.5 MB, above the ceiling)
cost 8,400 page faults a decode step, a 512-token prefill chunk's activations 10,000-12,000.
Raising both thresholds keeps those blocks in the heap, where the next step reuses them
(docs/benchmarks.md, "The C heap's thresholds").

A process whose environment sets glibc's malloc tunables keeps them: loom only sets what the
user has not. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30     # blocks below 1 GiB come from the heap
TRIM_THRESHOLD = 1 << 30     # and the heap keeps up to 1 GiB of free top
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Sets glibc's mmap and trim thresholds once per process; True when they are loom's."""
    global _tuned
    if _tuned is None:
        _tuned = _tune()
    return _tuned


def _tune() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if any(k in os.environ for k in _USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        log.debug("malloc thresholds left as the environment sets them")
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version   # glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc before 2.35 refuses an mmap threshold above 32 MB on 64-bit systems
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, 32 << 20)):
        return False
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return True
