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

transformers' greedy continuations (`greedy`) are kept there too, one small JSON file per set of
prompts, keyed by the prompts, the length and what could change a near tie's argmax (the CPU's
model and vector extensions, MKL's code path): generating them is most of the greedy reference
tests' time (Gemma 3, 10 prompts x 64 tokens: ~20 s on a 2-core Zen 3), and they depend on
nothing of loom's. A file that does not parse or does not fit is generated and written again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
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


def _cpu_identity() -> str:
    """The CPU's model name and vector extensions (MKL picks its code path from them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    first = info.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx", "fma")))
    return f"{fields.get('model name', '').strip()} {' '.join(flags)}"


def _read_json(path: Path):
    """The JSON value in `path`, or None where it is missing or does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def greedy(path: Path, model: Callable[[], object], prompts: list[list[int]], new_tokens: int,
           pad_token_id: int = 0) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` (one length, one unpadded batch),
    `new_tokens` each with EOS disabled (as loom's ignore_eos); `model()` gives the model of
    the GGUF at `path` (called only when they are not on disk yet)."""
    import torch
    from transformers import GenerationConfig

    key = hashlib.sha256(json.dumps([prompts, new_tokens, pad_token_id, _cpu_identity(),
                                     os.environ.get("MKL_CBWR", "")]).encode()).hexdigest()[:16]
    saved = _cache_dir(path) / f"greedy-{key}.json"
    kept = _read_json(saved)
    if isinstance(kept, list) and len(kept) == len(prompts) and all(len(r) == new_tokens for r in kept):
        return kept
    hf = model()
    # an unset eos_token_id in the call falls back to the model's generation config, so that one
    # is cleared for the call too
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_token_id)
    model_eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            x = torch.tensor(prompts)
            ref = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[:, x.shape[1]:].tolist()
    finally:
        hf.generation_config.eos_token_id = model_eos
    if saved.parent.is_dir():
        partial = saved.with_name(f"{saved.name}.partial-{os.getpid()}")
        try:
            partial.write_text(json.dumps(ref))
            os.replace(partial, saved)
        except OSError:
            partial.unlink(missing_ok=True)
    return ref
