"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _mkl_code_path_for_amd() -> None:
    """On AMD CPUs MKL's default dispatch runs torch's float32 GEMMs (the exact mode and the
    transformers references) well under its AVX2 code path: Gemma 3's 262k-row output matrix at
    10 rows took 0.29 s against 0.17 s with MKL_CBWR=AVX2 on a Zen 3 (2 threads), and the
    reference tests' greedy runs 31 s / 34 s against 20 s / 20 s. Both sides of every comparison
    run in this one environment; a user's setting is kept."""
    try:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if amd:
        os.environ.setdefault("MKL_CBWR", "AVX2")


_mkl_code_path_for_amd()  # before anything imports torch (MKL reads it once)

# The repository root makes `loom` importable without installing it; tests/ makes the helper
# modules here (tiny_gguf) importable from any test.
_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS.parent, _TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import tiny_gguf  # noqa: E402
from loom.outputs import FinalOutputs  # noqa: E402

# -- tiny GGUF models (written once per session) -------------------------------------------


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama GGUF with a SmolLM2-like byte-level BPE vocabulary and ChatML."""
    return tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random gemma3 GGUF (5 sliding-window layers + 1 global) with a Gemma-like vocabulary."""
    return tiny_gguf.write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3") / "tiny-gemma3.gguf")


# -- real models (pulled by `make test` / `loom pull`) ------------------------------------------

# Registry name -> file name under $LOOM_CACHE/models.
REAL_MODEL_FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}


def real_model_path(name: str) -> Path:
    """Path of a shipped real model (`name` is its registry name, e.g. ``"smollm2-135m"``).

    A missing file fails the calling test (never skips it): real-model tests are part of the
    suite, and the fix is to fetch the model.
    """
    filename = REAL_MODEL_FILES[name]
    path = Path(os.environ.get("LOOM_CACHE", "~/.cache/loom")).expanduser() / "models" / filename
    if not path.is_file():
        pytest.fail(f"real model {name!r} is missing: {path} does not exist. Run `make test` (which pulls "
                    f"the models) or `loom pull {name}` first.", pytrace=False)
    return path


# -- `loom serve` subprocesses (server and playground tests) -----------------------------------

STRICT_API_KEY = "sk-loom-test"


@pytest.fixture(scope="session")
def server_pool(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Three `loom serve` processes, launched together so their start-up overlaps:

    * ``real``: smollm2-135m, served as ``smollm2-135m``;
    * ``tiny``: the tiny llama (ChatML template), served under its file stem ``tiny-llama``,
      with max_tokens capped at 16 (the schemathesis target);
    * ``strict``: a tiny SentencePiece llama with no chat template and a 4096-token context,
      one running sequence, one waiting, and an API key (overload, auth, disconnects).
    """
    from loom_server import LoomServer, ServerPool

    logs = tmp_path_factory.mktemp("server_logs")
    strict_model = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("tiny_spm") / "tiny-spm.gguf",
                                              vocab="spm", context=4096)
    pool = ServerPool()
    try:
        pool.launch(LoomServer("real", real_model_path("smollm2-135m"),
                               ["--served-model-name", "smollm2-135m", "--threads", "2", "--num-blocks", "128",
                                "--max-num-seqs", "8"], logs))
        pool.launch(LoomServer("tiny", tiny_llama_path,
                               ["--threads", "1", "--num-blocks", "256", "--max-tokens-limit", "16",
                                "--no-access-log"], logs))
        pool.launch(LoomServer("strict", strict_model,
                               ["--threads", "1", "--num-blocks", "512", "--max-num-seqs", "1", "--max-waiting", "1"],
                               logs, api_key=STRICT_API_KEY))
        yield pool
    finally:
        pool.stop_all()


# -- Spec-Bench prompts (real text; read in place from the shared data folder) ------------------

SPEC_BENCH_QUESTIONS = _TESTS.parent.parent / "shared" / "data" / "spec_bench" / "question.jsonl"

_spec_bench_cache: list[dict] = []


def spec_bench_questions() -> list[dict]:
    """Spec-Bench's questions (dicts with ``question_id``, ``category`` and ``turns``), in file order."""
    if not _spec_bench_cache:
        import json

        if not SPEC_BENCH_QUESTIONS.is_file():
            pytest.fail(f"Spec-Bench prompts are missing: {SPEC_BENCH_QUESTIONS} does not exist.", pytrace=False)
        with SPEC_BENCH_QUESTIONS.open(encoding="utf-8") as f:
            _spec_bench_cache.extend(json.loads(line) for line in f if line.strip())
    return _spec_bench_cache


# -- real models, loaded at most once per session --------------------------------------------------

# The two modes of a real-model test: loom's exact mode (float32 weights and activations on torch's
# GEMMs and attention; marked, since it runs no kernel of the variant under test) and the default.
MODEL_DTYPES = [pytest.param("float32", marks=pytest.mark.float32_model), "auto"]


class RealModels:
    """Lazy, per-session loads of the shipped models: loom's (model, tokenizer) and transformers'
    float32 reference model. Each is loaded on first use and kept for the rest of the session."""

    def __init__(self):
        self._loom: dict[str, tuple] = {}
        self._hf: dict[str, object] = {}

    def loom(self, name: str, dtype: str = "float32"):
        """(model, tokenizer) as loom loads them in `dtype` (default float32, the exact mode)."""
        if (name, dtype) not in self._loom:
            from loom.config import LoadConfig
            from loom.loader.gguf import GGUFFile
            from loom.loader.tokenizer import Tokenizer
            from loom.model.build import load_model

            f = GGUFFile.open(real_model_path(name))
            self._loom[name, dtype] = (load_model(f, linear=LoadConfig(dtype=dtype).linear_mode), Tokenizer.from_gguf(f))
        return self._loom[name, dtype]

    def hf(self, name: str):
        """The transformers model of the same file, float32, in eval mode (converted by transformers
        once per file and version: tests/hf_reference.py)."""
        if name not in self._hf:
            import hf_reference

            self._hf[name] = hf_reference.load(real_model_path(name))
        return self._hf[name]

    def engine(self, name: str, dtype: str = "float32", **options):
        """A fresh Engine over the session's loom model in `dtype` (no second load of the weights)."""
        from loom.config import EngineConfig
        from loom.engine.engine import Engine

        model, tokenizer = self.loom(name, dtype)
        return Engine(EngineConfig.create(str(real_model_path(name)), dtype=dtype, **options), model=model,
                      tokenizer=tokenizer)


@pytest.fixture(scope="session")
def real_models() -> RealModels:
    return RealModels()


# -- the tiny llama as engine parts, and engines over it ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_parts(tiny_llama_path):
    """(path, model, tokenizer) of the tiny llama, loaded once per module."""
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer
    from loom.model.build import load_model

    f = GGUFFile.open(tiny_llama_path)
    return tiny_llama_path, load_model(f), Tokenizer.from_gguf(f)


@pytest.fixture
def make_tiny(tiny_parts):
    """Engines over the tiny llama; block size 4 so that short prompts span several blocks."""
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    path, model, tok = tiny_parts

    def make(**options) -> Engine:
        opts = dict(block_size=4, num_blocks=512, max_num_batched_tokens=64) | options
        opts.setdefault("max_num_seqs", min(16, opts["max_num_batched_tokens"]))
        return Engine(EngineConfig.create(str(path), **opts), model=model, tokenizer=tok)

    return make


# -- the pool's servers, one fixture each ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real(server_pool):
    return server_pool.get("real")


@pytest.fixture(scope="module")
def tiny(server_pool):
    return server_pool.get("tiny")


@pytest.fixture(scope="module")
def strict(server_pool):
    return server_pool.get("strict")


def run_to_end(engine, prompts, params) -> list:
    """Adds one request per (prompt, params), steps the engine until idle and returns the final
    outputs in the order of `prompts`."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals, gather = {}, FinalOutputs()
    while engine.has_unfinished_requests():
        for out in gather.add_all(engine.step()):
            finals[out.request_id] = out
    return [finals[i] for i in ids]


def spy_logits(monkeypatch, engine) -> list[tuple[bool, bool]]:
    """Records each of the engine's output-layer calls as (argmax_only asked, no logits kept)."""
    calls: list[tuple[bool, bool]] = []
    logits = engine.runner.model.compute_logits

    def spy(hidden, argmax=None, argmax_only=False):
        out = logits(hidden, argmax, argmax_only)
        calls.append((argmax_only, out is None))
        return out

    monkeypatch.setattr(engine.runner.model, "compute_logits", spy)
    return calls
