"""loom's compiled CPU kernels (csrc/loom_kernels.cpp), built once per machine.

`load()` returns the extension module, or None where it cannot be used: a CPU without
AVX-512 VNNI, no compiler, `LOOM_KERNELS=0` in the environment, or a failed build (the
reason is kept in `unavailable_reason()`). Callers then take the pure-torch path.

The build goes to ~/.cache/loom/kernels/<key>, keyed by the source, the torch version and
the CPU's flags, so a copied cache never runs on a CPU it was not compiled for.
`python -m loom.kernels` builds it ahead of time (`make install` does).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from loom.model.cpu import cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "loom_kernels.cpp"
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")

_lock = threading.Lock()
_module = None
_reason: str | None = None
_tried = False


def _build_dir() -> Path:
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    root = Path(os.environ.get("LOOM_CACHE", Path.home() / ".cache" / "loom"))
    return root / "kernels" / key


def load(verbose: bool = False):
    """The compiled module, or None (see `unavailable_reason()`)."""
    global _module, _reason, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("LOOM_KERNELS", "1") == "0":
            _reason = "disabled by LOOM_KERNELS=0"
            return None
        missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
        if missing:
            _reason = f"this CPU lacks {', '.join(missing)}"
            return None
        try:
            from torch.utils.cpp_extension import load as build
            d = _build_dir()
            d.mkdir(parents=True, exist_ok=True)
            _module = build(name="loom_kernels", sources=[str(SOURCE)], build_directory=str(d),
                            extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
                            extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as e:  # no compiler, no ninja, a build error: fall back to torch
            _reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            _module = None
        return _module


def unavailable_reason() -> str | None:
    load()
    return _reason


def available() -> bool:
    return load() is not None
