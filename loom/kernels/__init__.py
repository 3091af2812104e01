"""loom's compiled CPU kernels, built once per machine from one of two sources:

    avx512   csrc/loom_kernels.cpp        AVX-512 + VNNI
    avxvnni  csrc/loom_kernels_avx2.cpp   AVX2 + FMA + F16C + AVX-VNNI (Intel laptops since Alder Lake)
    avx2     csrc/loom_kernels_avx2.cpp   AVX2 + FMA + F16C (most laptops, many servers)

All three export the same functions with the same semantics over the same packed weights: the loops
are written once in the shared headers (csrc/*.h: vector traits per instruction set, the loops
over them, the Python-facing functions), and each source adds its integer dot products. The
first variant whose instructions this CPU has is built (`variant()` names it). The environment
variable `LOOM_KERNELS` chooses:

    auto (default)   the first variant this CPU runs
    avx512 | avxvnni | avx2   that variant; one the CPU cannot run is an error naming the missing flags
    0                no kernels: the pure-torch path

The AVX2 variants are compiled with AVX-512 turned off (`-mno-avx512f`), and avx2 with AVX-VNNI
off as well, so forcing avx2 on an AVX-512 machine runs exactly the code an AVX2-only CPU (a Zen 2
or 3) runs, and avxvnni the code of an AVX2 CPU with AVX-VNNI; `make test` runs the kernel and
invariance tests once per variant the CPU supports.

`load()` returns the extension module, or None where it cannot be used: a CPU with neither
instruction set, no compiler, `LOOM_KERNELS=0`, or a failed build (the reason is kept in
`unavailable_reason()`). Callers then take the pure-torch path.

The build goes to ~/.cache/loom/kernels/<key>, keyed by the chosen source, the shared headers,
its compiler flags, the torch version and the CPU's flags, so a copied cache never runs on a
CPU it was not compiled for. `python -m loom.kernels` builds it ahead of time (`make install` does).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch

from loom.errors import LoomError
from loom.kernels.cpu import cpu_flags
from loom.paths import cache_root

log = logging.getLogger("loom.kernels")

CSRC = Path(__file__).parent / "csrc"
HEADERS = sorted(CSRC.glob("*.h"))   # included by both sources
# Variants in order of preference: name -> (source, the CPU flags it needs).
VARIANTS = {
    "avx512": (CSRC / "loom_kernels.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avxvnni": (CSRC / "loom_kernels_avx2.cpp", ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (CSRC / "loom_kernels_avx2.cpp", ("avx2", "fma", "f16c")),
}
REQUIRED_FLAGS = {name: flags for name, (_, flags) in VARIANTS.items()}

_lock = threading.Lock()
_module = None
_variant: str | None = None
_reason: str | None = None
_tried = False


class KernelVariantError(LoomError):
    """LOOM_KERNELS names a variant that does not exist or that this CPU cannot run."""


def supported_variants() -> list[str]:
    """Every variant this CPU can run, best first."""
    flags = cpu_flags()
    return [name for name, need in REQUIRED_FLAGS.items() if all(f in flags for f in need)]


def cpu_variant() -> str | None:
    """The best variant this CPU can run (whether or not it is built), or None."""
    return next(iter(supported_variants()), None)


def requested_variant() -> str | None:
    """The variant `LOOM_KERNELS` asks for on this CPU: None for `0` or a CPU without either
    instruction set under `auto`; raises KernelVariantError for an unknown or unrunnable name."""
    choice = os.environ.get("LOOM_KERNELS", "auto").strip().lower() or "auto"
    if choice == "0":
        return None
    if choice in ("auto", "1"):
        return cpu_variant()
    if choice not in VARIANTS:
        raise KernelVariantError(f"LOOM_KERNELS must be one of auto, {', '.join(VARIANTS)}, 0; got {choice!r}")
    missing = [f for f in REQUIRED_FLAGS[choice] if f not in cpu_flags()]
    if missing:
        raise KernelVariantError(f"LOOM_KERNELS={choice}: this CPU lacks {', '.join(missing)}")
    return choice


def _cflags(variant: str) -> list[str]:
    # hidden: a module's template instances bind to its own code, never to another loaded
    # build's (benchmarks load a second checkout's kernels beside this tree's)
    flags = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-fvisibility=hidden"]
    if variant in ("avx2", "avxvnni"):
        flags.append("-mno-avx512f")   # exactly an AVX2 machine's code, even on an AVX-512 one
        flags.append("-mavxvnni" if variant == "avxvnni" else "-mno-avxvnni")
    return flags


def _build_dir(variant: str) -> Path:
    source = VARIANTS[variant][0]
    flags = " ".join(sorted(cpu_flags())) + " | " + " ".join(_cflags(variant))
    code = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(code + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / key


def _import_built(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(variant: str, verbose: bool = False):
    """Compiles (or finds in the cache) and imports one variant's module; raises on failure.

    The build directory is keyed by the source's content, so a module already built there is
    imported directly (no compiler toolchain, no ninja run), unless a build holds its lock."""
    d = _build_dir(variant)
    # The module's name carries its build key: Python keeps one extension module per name, so
    # two builds (a benchmark comparing this tree's kernels with another checkout's) would
    # otherwise both be whichever was imported first.
    name = f"loom_kernels_{variant}_{d.name}"
    built = d / f"{name}.so"
    module = _import_if_built(name, built) if built.is_file() and not (d / "lock").exists() else None
    if module is None:
        d.mkdir(parents=True, exist_ok=True)
        # Builds take an flock of their own, which the kernel releases when its holder dies: torch's
        # lock file, which a build killed half-way leaves behind, made every later start wait for
        # it forever. Under the flock, such a file is stale.
        with open(d / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (d / "lock").unlink(missing_ok=True)
            module = _import_if_built(name, built) if built.is_file() else None   # another process built it
            if module is None:
                from torch.utils.cpp_extension import load as cpp_load   # heavy: only when building
                log.warning("compiling loom's %s kernels for this CPU into %s (once; a minute or two)", variant, d)
                module = cpp_load(name=name, sources=[str(VARIANTS[variant][0])], build_directory=str(d),
                                  extra_cflags=_cflags(variant), extra_ldflags=["-fopenmp"], verbose=verbose)
    module.build_key = d.name   # what it was built from, as loaded (the sources may change later)
    return module


def _import_if_built(name: str, built: Path):
    try:
        return _import_built(name, built)
    except ImportError:
        return None   # an unusable file: build it again


def load(verbose: bool = False):
    """The compiled module, or None (see `unavailable_reason()`)."""
    global _module, _variant, _reason, _tried
    with _lock:
        if _tried:
            return _module
        try:
            variant = requested_variant()
        except KernelVariantError:
            _tried = False   # asked again, it raises again
            raise
        _tried = True
        if variant is None:
            disabled = os.environ.get("LOOM_KERNELS", "").strip() == "0"
            _reason = ("disabled by LOOM_KERNELS=0" if disabled else
                       "this CPU has neither " + " nor ".join(f"{n} ({', '.join(f)})"
                                                              for n, f in REQUIRED_FLAGS.items()))
            if not disabled:
                log.warning("loom's kernels do not run here (%s): torch's slower kernels instead", _reason)
            return None
        try:
            _module = build(variant, verbose)
            _variant = variant
        except Exception as e:  # no compiler, no ninja, a build error: fall back to torch
            _reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            _module = None
            log.warning("loom's kernels are unavailable (%s): torch's slower kernels instead", _reason)
        return _module


def unavailable_reason() -> str | None:
    load()
    return _reason


def available() -> bool:
    return load() is not None


def variant() -> str | None:
    """Which variant the loaded module is ("avx512" or "avx2"), None without one."""
    return _variant if load() is not None else None


def build_key() -> str | None:
    """What the loaded module was built from (its sources, torch, the flags): the name of its
    build directory, so that data measured on the kernels (the speculative cost model's timings)
    can be keyed by it; None without a module."""
    module = load()
    return module.build_key if module is not None else None


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [R, k]: the indices of each row's k largest logits, largest first, as
    `logits.topk(k).indices` (ties: the lower index). loom's kernel where it runs: one vector
    compare per logit instead of torch's sort of the candidates (~10x less on a 49k row)."""
    kern = load()
    if kern is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1:
        return kern.topk_rows(logits, k)
    return logits.topk(k, dim=-1).indices
