"""Memory for the large arrays a decode step reads whole, in 2 MB pages: a file mapped where the
kernel maps its page cache in 2 MB pages (`map_file`), else anonymous memory, 2 MB aligned and
advised to the kernel as transparent huge pages (`buffer`, `madvise(MADV_HUGEPAGE)`).

A one-stream decode step streams every packed weight once: Gemma 3's 267 MB are 68,000 pages
of 4 KB, each a TLB miss that the page walker must serve and a boundary where the hardware
prefetchers stop; in 2 MB pages they are 134. Read from a huge-page buffer instead of the
packed-weight file's mapping, a Gemma 3 decode step ran 1.02-1.08x faster on an AVX2-only
AMD EPYC (Zen 2), while anonymous 4 KB pages ran as the file mapping did (docs/benchmarks.md,
"Packed weights in huge pages").

A file mapping costs no copy and no fresh memory: on a VM whose host backs a process's new
pages lazily, SmolLM2's 92 MB read into a fresh buffer took 0.03 s or 0.26 s, alternating from
load to load, where the file's mapping in 2 MB pages took 1 ms; its pages are shared by every
process that maps the file. The kernel maps a file in 2 MB pages where its page cache holds the
file in 2 MB folios (Linux 6.16 and later on ext4, earlier on XFS) and the mapping is advised
as huge pages, which also makes the faults that read the file from disk read 2 MB folios.

Where the kernel has no transparent huge pages (or they are set to `never`), the advice does
nothing and the buffer is ordinary anonymous memory. `LOOM_HUGEPAGES=0` turns this off: the
packed weights then stay in the cache file's mapping, whose pages processes loading the same
model share.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
# whether this platform can map a file in huge pages at all (Linux: madvise and fadvise)
FILE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(os, "posix_fadvise")


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


def map_file(path: Path) -> np.ndarray | None:
    """The whole file mapped copy-on-write (its pages the page cache's until written), where the
    kernel maps at least 90% of its 2 MB-aligned part in 2 MB pages once each is touched; None
    (nothing left mapped) where it does not, or the file is under two huge pages."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        whole = size // HUGE_PAGE * HUGE_PAGE
        if whole < 2 * HUGE_PAGE or not FILE_PAGES:
            return None
        m = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = np.frombuffer(m, dtype=np.uint8)
    addr = data.ctypes.data
    try:
        if addr % HUGE_PAGE == 0:   # the kernel aligns a large file mapping where it can map it in 2 MB pages
            m.madvise(mmap.MADV_HUGEPAGE)
            int(data[:whole:HUGE_PAGE].sum())   # one byte of each 2 MB page: its fault maps it whole
            if file_pmd_bytes(addr, size) >= 0.9 * whole:
                return data
    except OSError:
        pass   # a kernel without transparent huge pages
    del data
    m.close()
    return None


def drop_cached(path: Path) -> None:
    """Asks the kernel to drop the file's pages from its page cache (those no process maps and
    that are written back), so that the next faults on an advised mapping read it in 2 MB folios."""
    if not FILE_PAGES:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_pmd_bytes(addr: int, size: int) -> int:
    """Bytes of [addr, addr + size) that this process maps as 2 MB pages of a file (smaps, read
    up to the range's end: a process with torch loaded has over a thousand mappings)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):   # a mapping's first line: its address range
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    if lo >= addr + size:
                        break
                    inside = addr < hi
                elif inside and head == "FilePmdMapped:":
                    total += int(line.split()[1]) << 10
    except OSError:
        return 0
    return total


def probe_file_pages(directory: Path) -> bool:
    """Whether the kernel maps a file of `directory`'s file system in 2 MB pages once its pages
    are read through an advised mapping (map_file): a fresh file of two huge pages, written,
    dropped from the page cache and mapped. False where it cannot be written."""
    if not FILE_PAGES:
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".huge-pages-probe.", dir=directory)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"\x01" * (2 * HUGE_PAGE))
            out.flush()
            os.fsync(out.fileno())
        drop_cached(Path(name))
        mapped = map_file(Path(name))
        return mapped is not None
    except OSError:
        return False
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass
