"""Where loom keeps its files: one reading of ``LOOM_CACHE`` for every cache (models, packed
weights, kernels, cost curves)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LOOM_CACHE`` with ``~`` expanded where it is set and not empty, else ``~/.cache/loom``."""
    env = os.environ.get("LOOM_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loom"
