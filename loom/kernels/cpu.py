"""What this CPU can do fast, read once (Linux /proc/cpuinfo; elsewhere nothing is assumed)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): only then do bf16 GEMMs beat fp32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
