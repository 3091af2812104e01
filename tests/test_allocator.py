"""The C heap's settings in an engine's process (loom/engine/allocator.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

GLIBC_LINUX = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A fresh interpreter: mallopt is process-wide, and the test process's own history must not count.
PROBE = """
import resource, sys, torch
from loom.engine.allocator import tune_malloc
tuned = tune_malloc()
def faults_of_a_40mb_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(10 << 20)   # 40 MB, every page written
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(12):   # torch's 64-byte aligned blocks: the heap takes a few rounds to settle
    faults_of_a_40mb_tensor()
print(tuned, sum(faults_of_a_40mb_tensor() for _ in range(4)))
"""


def _probe(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_large_tensor_is_reused_without_page_faults():
    """Once a dozen 40 MB tensors have come and gone, the next ones come from the heap: a few
    page faults instead of one per 4 KB page (10,240 each), which glibc's defaults cost every
    time. (The first rounds grow the heap: torch asks for 64-byte aligned blocks, and a freed
    one is a little short of what the next aligned request needs until its neighbours are
    free too.)"""
    tuned, faults = _probe({})
    assert tuned == GLIBC_LINUX   # other C libraries are left alone
    if GLIBC_LINUX:
        assert faults < 1000


def test_the_users_malloc_settings_are_kept():
    """A process started with glibc's malloc tunables keeps them: loom sets nothing, and a
    40 MB tensor (above the mmap threshold the user asked for) is mapped afresh each time."""
    tuned, faults = _probe({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert not tuned
    if GLIBC_LINUX:
        assert faults > 4 * 5000
