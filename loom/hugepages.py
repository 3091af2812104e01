"""Memory for the large arrays a decode step reads whole: anonymous, 2 MB aligned, and advised
to the kernel as transparent huge pages (`madvise(MADV_HUGEPAGE)`).

A one-stream decode step streams every packed weight once: Gemma 3's 267 MB are 68,000 pages
of 4 KB, each a TLB miss that the page walker must serve and a boundary where the hardware
prefetchers stop; in 2 MB pages they are 134. Read from a huge-page buffer instead of the
packed-weight file's mapping, a Gemma 3 decode step ran 1.02-1.08x faster on an AVX2-only
AMD EPYC (Zen 2), while anonymous 4 KB pages ran as the file mapping did (docs/benchmarks.md,
"Packed weights in huge pages").

Where the kernel has no transparent huge pages (or they are set to `never`), the advice does
nothing and the buffer is ordinary anonymous memory. `LOOM_HUGEPAGES=0` turns this off: the
packed weights then stay in the cache file's mapping, whose pages processes loading the same
model share.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return os.environ.get("LOOM_HUGEPAGES", "1").strip().lower() not in ("0", "false", "off", "no")


def buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of zeroed uint8 memory starting on a 2 MB boundary, advised as huge pages.

    The mapping lives as long as any array viewing it."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, len(m) - start)
        except OSError:
            pass   # a kernel built without transparent huge pages: 4 KB pages
    return whole[start:start + nbytes]
