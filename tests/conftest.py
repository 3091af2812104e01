"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The repository root makes `loom` importable without installing it; tests/ makes the helper
# modules here (tiny_gguf) importable from any test.
_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS.parent, _TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import tiny_gguf  # noqa: E402


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
