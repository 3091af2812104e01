"""loom's compiled CPU kernels, built once per machine from one of two sources:

    avx512   csrc/loom_kernels.cpp        AVX-512 + VNNI
    avx2     csrc/loom_kernels_avx2.cpp   AVX2 + FMA + F16C (most laptops, many servers)

Both export the same functions with the same semantics over the same packed weights; the
first variant whose instructions this CPU has is built (`variant()` names it).

`load()` returns the extension module, or None where it cannot be used: a CPU with neither
instruction set, no compiler, `LOOM_KERNELS=0` in the environment, or a failed build (the
reason is kept in `unavailable_reason()`). Callers then take the pure-torch path.

The build goes to ~/.cache/loom/kernels/<key>, keyed by the chosen source, the torch version
and the CPU's flags, so a copied cache never runs on a CPU it was not compiled for.
`python -m loom.kernels` builds it ahead of time (`make install` does).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from loom.model.cpu import cpu_flags

CSRC = Path(__file__).parent / "csrc"
HOST_HEADER = CSRC / "loom_kernels_host.h"   # included by both sources
# Variants in order of preference: name -> (source, the CPU flags it needs).
VARIANTS = {
    "avx512": (CSRC / "loom_kernels.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avx2": (CSRC / "loom_kernels_avx2.cpp", ("avx2", "fma", "f16c")),
}
REQUIRED_FLAGS = {name: flags for name, (_, flags) in VARIANTS.items()}

_lock = threading.Lock()
_module = None
_variant: str | None = None
_reason: str | None = None
_tried = False


def cpu_variant() -> str | None:
    """The variant this CPU can run (whether or not it is built), or None."""
    flags = cpu_flags()
    return next((name for name, need in REQUIRED_FLAGS.items() if all(f in flags for f in need)), None)


def _build_dir(source: Path) -> Path:
    flags = " ".join(sorted(cpu_flags()))
    code = source.read_bytes() + HOST_HEADER.read_bytes()
    key = hashlib.sha256(code + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    root = Path(os.environ.get("LOOM_CACHE", Path.home() / ".cache" / "loom"))
    return root / "kernels" / key


def load(verbose: bool = False):
    """The compiled module, or None (see `unavailable_reason()`)."""
    global _module, _variant, _reason, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("LOOM_KERNELS", "1") == "0":
            _reason = "disabled by LOOM_KERNELS=0"
            return None
        variant = cpu_variant()
        if variant is None:
            _reason = "this CPU has neither " + " nor ".join(f"{n} ({', '.join(f)})" for n, f in REQUIRED_FLAGS.items())
            return None
        source = VARIANTS[variant][0]
        try:
            from torch.utils.cpp_extension import load as build
            d = _build_dir(source)
            d.mkdir(parents=True, exist_ok=True)
            _module = build(name="loom_kernels", sources=[str(source)], build_directory=str(d),
                            extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
                            extra_ldflags=["-fopenmp"], verbose=verbose)
            _variant = variant
        except Exception as e:  # no compiler, no ninja, a build error: fall back to torch
            _reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            _module = None
        return _module


def unavailable_reason() -> str | None:
    load()
    return _reason


def available() -> bool:
    return load() is not None


def variant() -> str | None:
    """Which source the loaded module was built from ("avx512" or "avx2"), None without one."""
    return _variant if load() is not None else None
