"""Where log-probabilities come from. A source turns one window into slices of next-token
log-probabilities [r, V] for the window's scored positions, in order, `ROWS` rows at a time
(the last slice may be shorter), so memory stays bounded whatever the vocabulary.

    loom        loom in any configuration (dtype, KV cache dtype), through the engine's prefill path
    llama.cpp   llama-cpp-python with logits_all over the same tokens (the peer)
    base        a reference run saved with --save-base (see `BaseWriter`)

Sources are registered by name in SOURCES; `open_source(name, **options)` builds one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from loom.config import CacheConfig, LoadConfig, physical_cores
from loom.engine.engine import kv_cache_format
from loom.errors import InvalidRequestError, LoomError
from loom.eviction_params import KVEvictionParams
from loom.eval.windows import Window, Windows
from loom.loader.gguf import GGUFFile
from loom.loader.registry import resolve_model
from loom.loader.tokenizer import Tokenizer
from loom.model.build import load_model
from loom.kv.eviction import make_policy
from loom.model.runner import score_slices
from loom.model.score_evicted import score_evicted

ROWS = 64   # scored positions per slice


class LogprobSource(Protocol):
    label: str            # how tables name it
    vocab_size: int

    def logprobs(self, window: Window) -> Iterator[torch.Tensor]: ...


EVICTION_BLOCK = 16   # the block size score_evicted frees, the engine's default


class LoomSource:
    """loom as `LLM(model, dtype=..., kv_cache_dtype=...)` computes a prompt: the same model
    backends, KV cache element type and prefill chunk size. With `kv_eviction` (a dict or
    KVEvictionParams) the KV list is cut as the engine cuts it (loom/model/score_evicted.py); a
    selecting policy (SnapKV) takes each window's first `prompt_tokens` as the prompt."""

    def __init__(self, model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", chunk: int = 512,
                 threads: int | None = None, kv_eviction: dict | KVEvictionParams | None = None,
                 prompt_tokens: int | None = None):
        load = LoadConfig(model=model, dtype=dtype, threads=threads)
        self.eviction = make_policy(KVEvictionParams.create(kv_eviction))
        if self.eviction is not None and self.eviction.budget < 2 * EVICTION_BLOCK:
            raise LoomError(f"kv_eviction budget must be at least two KV blocks ({2 * EVICTION_BLOCK} tokens at "
                            f"block_size {EVICTION_BLOCK}), as the engine's: eviction frees whole blocks; "
                            f"got {self.eviction.budget}")
        if threads:
            torch.set_num_threads(threads)
        self.path = resolve_model(model)
        gguf = GGUFFile.open(self.path)
        self.tokenizer = Tokenizer.from_gguf(gguf)
        self.model = load_model(gguf, linear=load.linear_mode)
        CacheConfig(kv_cache_dtype=kv_cache_dtype)   # validates it
        self.kv_dtype = kv_cache_format(kv_cache_dtype, self.model)
        self.chunk = chunk
        self.vocab_size = self.model.cfg.vocab_size
        self.prompt_tokens = prompt_tokens
        cut = "" if self.eviction is None else f", {self.eviction.name} {self.eviction.budget}"
        self.label = f"loom {dtype} (KV {self.kv_dtype.name}{cut})"

    def logprobs(self, window: Window) -> Iterator[torch.Tensor]:
        if self.eviction is not None:
            prompt = self.prompt_tokens if self.prompt_tokens is not None else window.first + 1
            return score_evicted(self.model, window.tokens, window.first, self.eviction, prompt, self.kv_dtype,
                                 prefill_chunk=self.chunk, rows=ROWS)
        return score_slices(self.model, window.tokens, window.first, self.kv_dtype, self.chunk, ROWS)


# llama.cpp's KV cache types by their names in llama.cpp (--cache-type-k/-v) -> ggml type ids
LLAMA_CPP_KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


class LlamaCppSource:
    """llama.cpp (llama-cpp-python) on the same GGUF, fed loom's token ids. `kv_cache_dtype`:
    its K and V cache type (f16, q8_0, q4_0), with its flash-attention path (a quantized V cache
    needs it; named, f16 takes it too, so the three compare like with like); None: f16 without."""

    def __init__(self, model: str, context: int, threads: int | None = None, kv_cache_dtype: str | None = None):
        if kv_cache_dtype is not None and kv_cache_dtype not in LLAMA_CPP_KV_TYPES:
            raise InvalidRequestError(f"llama.cpp's KV cache type must be one of {', '.join(LLAMA_CPP_KV_TYPES)}, "
                                      f"got {kv_cache_dtype!r}")
        try:
            import llama_cpp
        except ImportError:
            raise LoomError("the llama.cpp source needs llama-cpp-python (pip install 'llama-cpp-python==0.3.36')") from None
        kv = LLAMA_CPP_KV_TYPES[kv_cache_dtype or "f16"]
        self.path = resolve_model(model)
        threads = threads or physical_cores()
        try:
            self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=context, n_batch=min(context, 512),
                                       n_ubatch=min(context, 512), logits_all=True, verbose=False,
                                       n_threads=threads, n_threads_batch=threads,
                                       type_k=kv, type_v=kv, flash_attn=kv_cache_dtype is not None)
        except ValueError as e:   # llama.cpp could not load what loom reads
            raise LoomError(f"llama.cpp cannot load {self.path.name}: {e}") from None
        self.vocab_size = int(self.llm.n_vocab())
        kv_note = f" (KV {kv_cache_dtype}, flash attention)" if kv_cache_dtype else ""
        self.label = f"llama.cpp {getattr(llama_cpp, '__version__', '')}".strip() + kv_note

    def logprobs(self, window: Window) -> Iterator[torch.Tensor]:
        self.llm.reset()
        self.llm.eval(list(window.tokens))
        logits = self.llm.scores                                      # [n_ctx, V] float32, rows 0 .. T-1 filled
        for a in range(window.first, len(window.tokens) - 1, ROWS):
            b = min(len(window.tokens) - 1, a + ROWS)
            yield torch.from_numpy(np.array(logits[a:b], dtype=np.float32)).log_softmax(dim=-1)


# -- a saved run --------------------------------------------------------------------------------

BASE_FORMAT = 1


def windows_key(windows: Windows) -> str:
    """Identifies the exact token windows a saved run scored."""
    h = hashlib.sha256()
    h.update(f"{windows.context}:{windows.stride}:{len(windows)}".encode())
    for w in windows.windows:
        h.update(np.asarray(w.tokens, dtype=np.int64).tobytes())
        h.update(str(w.first).encode())
    return h.hexdigest()


# Log-probabilities are stored as 16-bit steps between a row's floor and its maximum (as
# llama-perplexity stores its base logits): lp ~ floor + q * step, q in 0..65535. A floor at most
# FLOOR_SPAN below the row's maximum keeps the step near 1e-3 nats; what lies below it has a
# probability under e^-50 and is stored as the floor.
FLOOR_SPAN = 50.0


class BaseWriter:
    """Writes a run's log-probabilities as a reference: DIR/logprobs.npy (uint16 [N, V], one row
    per scored token, in order), DIR/scales.npy (float32 [N, 2]: floor, step) and DIR/meta.json.
    They are written as *.tmp files beside the ones they replace, their space taken up front
    (a full disk is an error at the start, never a SIGBUS from a mapped page), and renamed into
    place by `close`, meta.json last: an interrupted run leaves a base already in DIR as it was,
    and a half-written base is never read (`abort` removes the *.tmp files)."""

    FILES = ("logprobs.npy", "scales.npy")

    def __init__(self, path: Path, windows: Windows, vocab_size: int, label: str):
        self.dir = Path(path)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.rows = self._open("logprobs.npy", np.uint16, (windows.num_scored, vocab_size))
            self.scales = self._open("scales.npy", np.float32, (windows.num_scored, 2))
        except OSError as e:
            self.abort()
            raise LoomError(f"cannot write the base run to {self.dir}: {e.strerror or e}") from None
        self.meta = {"format": BASE_FORMAT, "label": label, "vocab_size": vocab_size, "rows": windows.num_scored,
                     "windows": windows_key(windows), "context": windows.context, "stride": windows.stride}
        self.at = 0

    def _open(self, name: str, dtype, shape: tuple[int, int]) -> np.memmap:
        tmp = self.dir / f"{name}.tmp"
        rows = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        with open(tmp, "r+b") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, os.path.getsize(tmp))
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        return rows

    def add(self, lp: torch.Tensor) -> None:
        hi = lp.max(dim=1, keepdim=True).values                              # [r, 1]
        lo = torch.maximum(lp.min(dim=1, keepdim=True).values, hi - FLOOR_SPAN)
        step = ((hi - lo) / 65535.0).clamp(min=1e-12)
        q = ((lp.clamp(min=lo) - lo) / step).round().clamp(0, 65535)
        n = lp.shape[0]
        self.rows[self.at:self.at + n] = q.numpy().astype(np.uint16)
        self.scales[self.at:self.at + n] = torch.cat([lo, step], dim=1).numpy()
        self.at += n

    def close(self) -> None:
        try:
            self.rows.flush()
            self.scales.flush()
            del self.rows, self.scales
            (self.dir / "meta.json").unlink(missing_ok=True)      # the old base is whole until here
            for name in self.FILES:
                os.replace(self.dir / f"{name}.tmp", self.dir / name)
            tmp = self.dir / "meta.json.tmp"
            tmp.write_text(json.dumps(self.meta, indent=1))
            os.replace(tmp, self.dir / "meta.json")
        except OSError as e:
            self.abort()
            raise LoomError(f"cannot write the base run to {self.dir}: {e.strerror or e}") from None

    def abort(self) -> None:
        """Removes what this run wrote; a base already in the directory stays as it was."""
        for name in (*self.FILES, "meta.json"):
            try:
                (self.dir / f"{name}.tmp").unlink(missing_ok=True)
            except OSError:   # no such directory to clean (it could not be made)
                pass


class BaseSource:
    """A run saved by BaseWriter, read back for the same windows."""

    def __init__(self, path: Path, windows: Windows):
        d = Path(path)
        try:
            meta = json.loads((d / "meta.json").read_text())
            self.rows = np.load(d / "logprobs.npy", mmap_mode="r")
            self.scales = np.load(d / "scales.npy", mmap_mode="r")
        except FileNotFoundError:
            raise LoomError(f"{d} holds no complete base run (meta.json and logprobs.npy, written by --save-base)") from None
        except (OSError, ValueError) as e:
            raise LoomError(f"cannot read the base run in {d}: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != BASE_FORMAT:
            raise LoomError(f"{d}/meta.json is not a loom base run of format {BASE_FORMAT}")
        if meta.get("windows") != windows_key(windows):
            raise LoomError(f"the base run in {d} scored other tokens (context {meta.get('context')}, stride "
                            f"{meta.get('stride')}): run it again with this text, model and window options")
        if self.rows.shape != (meta.get("rows"), meta.get("vocab_size")) or self.scales.shape != (meta.get("rows"), 2):
            raise LoomError(f"{d}/logprobs.npy is truncated or does not match meta.json")
        self.vocab_size = int(meta["vocab_size"])
        self.label = f"base {meta.get('label', d.name)}"
        self._offsets = {}
        at = 0
        for w in windows.windows:
            self._offsets[id(w)] = at
            at += len(w.targets)

    def logprobs(self, window: Window) -> Iterator[torch.Tensor]:
        at, n = self._offsets[id(window)], len(window.targets)
        for a in range(0, n, ROWS):
            b = min(n, a + ROWS)
            q = torch.from_numpy(np.asarray(self.rows[at + a:at + b], dtype=np.float32))
            lo, step = torch.from_numpy(np.array(self.scales[at + a:at + b], dtype=np.float32)).unbind(1)
            lp = lo[:, None] + q * step[:, None]
            yield lp - lp.logsumexp(dim=1, keepdim=True)      # renormalized after rounding


SOURCES: dict[str, Callable[..., LogprobSource]] = {
    "loom": LoomSource,
    "llama.cpp": LlamaCppSource,
}


def open_source(name: str, **options) -> LogprobSource:
    if name not in SOURCES:
        raise InvalidRequestError(f"unknown engine {name!r} (known: {', '.join(SOURCES)})")
    return SOURCES[name](**options)


def tokenizer_for(model: str) -> tuple[Tokenizer, int | None]:
    """The model's tokenizer and context length (None where its GGUF names none), read before
    its weights load (raises ModelLoadError for a bad path or file)."""
    gguf = GGUFFile.open(resolve_model(model))
    context = int(gguf.get(f"{gguf.architecture}.context_length", 0) or 0) or None
    return Tokenizer.from_gguf(gguf), context
