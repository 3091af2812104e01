"""`loom serve` start-up time: from launching the process to the first 200 from ``/health``.

This is what a user waits for after typing ``loom serve MODEL``: interpreter and library
imports, the model load (the packed-weight cache warm, as after the bench's own load), the KV
cache, the HTTP server. The server runs on a free local port with the bench's thread count and
is stopped with SIGINT once ready.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loom.bench.server_peers import free_port

SERVE_START_TIMEOUT_S = 300.0
_POLL_S = 0.02


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def measure_serve_start(model_path: Path, threads: int, env: dict[str, str], dtype: str | None = None,
                        num_blocks: int = 256) -> dict[str, Any]:
    """{"serve_start_seconds": s} or {"serve_start_error": why}."""
    port = free_port()
    cmd = [sys.executable, "-m", "loom", "serve", str(model_path), "--port", str(port), "--threads", str(threads),
           "--num-blocks", str(num_blocks), "--no-access-log", "--log-level", "warning"]
    if dtype:
        cmd += ["--dtype", dtype]
    url = f"http://127.0.0.1:{port}/health"
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            while time.perf_counter() - start < SERVE_START_TIMEOUT_S:
                if _ready(url):
                    return {"serve_start_seconds": time.perf_counter() - start}
                if proc.poll() is not None:
                    err.seek(0)
                    tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
                    return {"serve_start_error": f"loom serve exited: {tail[0] if tail else proc.returncode}"}
                time.sleep(_POLL_S)
            return {"serve_start_error": f"no ready /health within {SERVE_START_TIMEOUT_S:.0f}s"}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
