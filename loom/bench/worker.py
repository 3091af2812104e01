"""One engine's measurements in a process of its own: ``python -m loom.bench.worker ENGINE JOB [OPTIONS]``.

ENGINE is a peer spec (``loom``, ``loom:float32``, ``transformers``, ``llama.cpp``); JOB is the
path of the JSON job the harness wrote (`make_job`); OPTIONS, the peer's options as JSON, replace
the ones ENGINE names (``loom bench --kv-cache-dtype int8`` sets one on the peer ``loom``). The
worker loads the engine, warms it up, runs every suite and exits. Its own process makes peak RSS this engine's alone.

Protocol: the worker writes JSON lines to its original stdout, one event each:

* ``{"event": "begin", "step": LABEL}`` / ``{"event": "end", "step": LABEL}`` around each step
  (the steps are `plan_steps`, in order);
* finally one of ``{"event": "result", "result": {...}}``,
  ``{"event": "skipped", "status": "skipped", "reason": ..., "hint": ...}`` or
  ``{"event": "error", "message": ..., "traceback": ...}``.

Anything libraries print to stdout is redirected to stderr so it cannot corrupt the protocol.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

from loom.bench.peers import create_peer, missing_modules, not_installed, parse_peers
from loom.bench.settings import BenchSettings, Workload
from loom.bench.suites import SuiteContext, select_suites

LOAD_STEP = "load"
WARMUP_STEP = "warmup"


def plan_steps(settings: BenchSettings) -> list[str]:
    """Every progress step a worker reports, in order."""
    suites = select_suites(settings.suites)
    return [LOAD_STEP, WARMUP_STEP, *(label for suite in suites for label in suite.steps(settings))]


def make_job(model_path: Path, threads: int, settings: BenchSettings, workload: Workload) -> dict[str, Any]:
    return {"model_path": str(model_path), "threads": threads, "settings": settings.to_json(),
            "workload": workload.to_json()}


def peak_rss_bytes() -> int:
    """This process's peak resident set size: psutil's peak where it reports one (Windows), else
    the kernel's high-water mark from getrusage, else the current RSS."""
    import psutil

    mem = psutil.Process().memory_info()
    peak = getattr(mem, "peak_wset", None)
    if peak:
        return int(peak)
    try:
        import resource
    except ImportError:
        return int(mem.rss)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes, Linux: KiB


class _Channel:
    def __init__(self, stream: TextIO):
        self.stream = stream

    def send(self, event: str, **fields: Any) -> None:
        self.stream.write(json.dumps({"event": event, **fields}) + "\n")
        self.stream.flush()

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        self.send("begin", step=label)
        yield
        self.send("end", step=label)


def run(label: str, job: dict[str, Any], channel: _Channel, options: dict[str, str] | None = None) -> int:
    """Measure engine `label` as `job` says (with `options`, where given, in place of the ones its
    label names); every outcome is sent on `channel`. Returns the exit status."""
    spec = parse_peers(label)[0]
    if options is not None:
        spec = dataclasses.replace(spec, options=dict(options))
    missing = missing_modules(spec.kind)
    if missing:
        channel.send("skipped", **not_installed(spec.kind, missing))
        return 0
    settings = BenchSettings.from_json(job["settings"])
    workload = Workload.from_json(job["workload"])
    threads = int(job["threads"])
    start = time.perf_counter()
    peer = create_peer(spec.kind, Path(job["model_path"]), threads, workload.capacity(settings), spec.options)
    import_seconds = time.perf_counter() - start   # the engine's package (torch, llama_cpp, ...)

    with channel.step(LOAD_STEP):
        start = time.perf_counter()
        peer.load()
        load_seconds = time.perf_counter() - start
    with channel.step(WARMUP_STEP):
        peer.generate(workload.warmup_prompts, settings.warmup_tokens)

    ctx = SuiteContext(peer=peer, workload=workload, settings=settings, step=channel.step)
    result: dict[str, Any] = {"status": "ok", "kind": spec.kind.name, "threads": threads,
                              "import_seconds": import_seconds, "load_seconds": load_seconds}
    for suite in select_suites(settings.suites):
        result[suite.name] = suite.run(ctx)
    result["peak_rss_mb"] = peak_rss_bytes() / 2**20
    result["info"] = peer.info
    result["notes"] = peer.notes
    peer.close()
    channel.send("result", result=result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m loom.bench.worker ENGINE JOB.json [OPTIONS_JSON]", file=sys.stderr)
        return 2
    # Keep the protocol on a private copy of stdout; point fd 1 (and sys.stdout) at stderr.
    channel = _Channel(os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        job = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
        return run(argv[0], job, channel, json.loads(argv[2]) if len(argv) == 3 else None)
    except Exception as e:  # the harness reports it as this engine's failure
        channel.send("error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main())
