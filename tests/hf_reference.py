"""transformers' float32 model of a shipped GGUF file: the reference the real-model tests compare
loom with, kept on disk between sessions.

transformers converts the GGUF itself (its own tensor names, permutations and dequantization),
which keeps the reference independent of loom's loader, but slowly: 34-39 s for Gemma 3 here,
most of it `gguf.GGUFReader` parsing the 262,144-token vocabulary element by element, once for
the config and once more for the weights. The conversion here parses the file once, and its
result is saved (`save_pretrained`, float32 safetensors) under

    $LOOM_CACHE/test-references/<sha256 of the GGUF>[:16]-transformers-<version>-torch-<version>/

so later sessions load it in 0.1 s (1.5 GB for both shipped models; a conversion under other
versions replaces the file's older directories). A directory that does not load (a run
killed while writing it, a disk that filled up) is converted and written again; one that cannot
be written leaves the conversion to every session.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

from loom.loader.cache import cache_root
from loom.loader.registry import file_sha256


def _cache_dir(path: Path) -> Path:
    import torch
    import transformers

    key = f"{file_sha256(path)[:16]}-transformers-{transformers.__version__}-torch-{torch.__version__}"
    return cache_root() / "test-references" / key


@contextlib.contextmanager
def _one_parse():
    """transformers' GGUF loading opens the file twice (config, then weights): one reader for both."""
    import gguf

    reader = gguf.GGUFReader
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(reader)
    try:
        yield
    finally:
        gguf.GGUFReader = reader


def load(path: Path):
    """The float32 transformers model of the GGUF file at `path`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = _cache_dir(path)
    if saved.is_dir():
        try:
            return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
        except Exception:   # a truncated file is safetensors' own error type: any failure converts again
            shutil.rmtree(saved, ignore_errors=True)
    with _one_parse():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    partial = saved.with_name(f"{saved.name}.partial-{os.getpid()}")
    quantizer, model.hf_quantizer = model.hf_quantizer, None   # its GGUF "quantizer" only dequantized the file
    try:
        model.save_pretrained(str(partial))
        os.replace(partial, saved)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    finally:
        model.hf_quantizer = quantizer
    for stale in saved.parent.glob(saved.name.split("-transformers-")[0] + "-transformers-*"):
        if stale != saved and not stale.name.startswith(f"{saved.name}.partial-"):   # the same file, older versions
            shutil.rmtree(stale, ignore_errors=True)
    return model.eval()
