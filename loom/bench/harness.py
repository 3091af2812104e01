"""Runs one worker process per engine, in turn, and gathers their results into one report.

Engines run one after another (never at the same time), each on the same GGUF file, thread
count and token ids. A peer whose package is missing is reported as skipped; a worker that
fails is reported as failed with its error, and the other engines still run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loom.bench.peers import PeerSpec, missing_modules, not_installed
from loom.bench.prompts import SPEC_BENCH_PATH, build_workload
from loom.bench.report import compute_ratios
from loom.bench.serve_start import measure_serve_start
from loom.bench.settings import BenchSettings, Workload
from loom.bench.worker import make_job, plan_steps

REPORT_VERSION = 1
_STDERR_TAIL = 4000


@dataclass(frozen=True)
class BenchRequest:
    """A bench run as the CLI asks for it."""

    model: str              # registry name or GGUF path
    peers: list[PeerSpec]
    settings: BenchSettings
    threads: int
    prompts_path: Path = SPEC_BENCH_PATH


def worker_env(threads: int) -> dict[str, str]:
    """The worker's environment: loom importable from this checkout, one thread count for all."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _host() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "physical_cores": psutil.cpu_count(logical=False), "logical_cores": psutil.cpu_count(logical=True),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version()}


def _read_events(proc: subprocess.Popen, spec: PeerSpec, progress: Progress, task: Any
                 ) -> tuple[dict[str, Any] | None, int]:
    """The worker's JSON event lines, as they come: (its outcome, steps done)."""
    assert proc.stdout is not None
    outcome: dict[str, Any] | None = None
    done = 0
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("event")
        if kind == "begin":
            progress.update(task, description=f"[bold]{spec.label}[/bold]: {event.get('step')}")
        elif kind == "end":
            done += 1
            progress.advance(task)
        elif kind == "result":
            outcome = {**event["result"], "status": "ok"}
        elif kind == "skipped":
            outcome = {key: event.get(key) for key in ("status", "reason", "hint")}
        elif kind == "error":
            outcome = {"status": "failed", "reason": event.get("message", "error"),
                       "traceback": event.get("traceback")}
    return outcome, done


def _run_worker(spec: PeerSpec, job_path: Path, steps: list[str], threads: int, progress: Progress,
                task: Any) -> dict[str, Any]:
    """One worker, start to exit; advances `task` once per finished step and returns the engine entry."""
    # the options travel whole: a flag such as --kv-cache-dtype sets one without changing the label
    cmd = [sys.executable, "-m", "loom.bench.worker", spec.label, str(job_path), json.dumps(spec.options)]
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as errfile:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errfile, text=True, env=worker_env(threads))
        try:
            outcome, done = _read_events(proc, spec, progress, task)
        except BaseException:   # a stop (Ctrl-C, SIGTERM, SIGHUP): the worker stops with the bench
            proc.kill()
            proc.wait()
            raise
        rc = proc.wait()
        errfile.seek(0)
        stderr = errfile.read()[-_STDERR_TAIL:]
    progress.advance(task, len(steps) - done)
    if outcome is None:
        outcome = {"status": "failed", "reason": f"worker exited with status {rc} without a result",
                   "stderr": stderr}
    elif outcome["status"] == "failed":
        outcome["stderr"] = stderr
    outcome["elapsed_seconds"] = time.perf_counter() - started
    return outcome


def run_bench(request: BenchRequest, console: Console | None = None) -> dict[str, Any]:
    """Measure every peer of `request` and return the report (JSON-able; see `report.py`)."""
    from loom.loader.registry import resolve_model

    from loom.config import CacheConfig, LoadConfig

    for spec in request.peers:  # a bad loom dtype or KV cache dtype fails here, before anything runs
        if spec.is_loom and not missing_modules(spec.kind):
            LoadConfig(dtype=spec.options.get("dtype", LoadConfig().dtype))
            CacheConfig(kv_cache_dtype=spec.options.get("kv_cache_dtype", CacheConfig().kv_cache_dtype))
    console = console or Console(stderr=True)
    model_path = resolve_model(request.model)
    settings = request.settings
    workload: Workload = build_workload(model_path, settings, request.prompts_path)
    steps = plan_steps(settings)
    engines: dict[str, dict[str, Any]] = {}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with tempfile.TemporaryDirectory(prefix="loom-bench-") as tmp, \
            Progress(*columns, console=console, transient=True) as progress:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(make_job(model_path, request.threads, settings, workload)), encoding="utf-8")
        task = progress.add_task("starting", total=len(steps) * len(request.peers))
        for spec in request.peers:
            missing = missing_modules(spec.kind)
            if missing:
                engines[spec.label] = not_installed(spec.kind, missing)
                progress.advance(task, len(steps))
            else:
                engines[spec.label] = _run_worker(spec, job_path, steps, request.threads, progress, task)
            entry = engines[spec.label]
            if spec.is_loom and entry["status"] == "ok":
                progress.update(task, description=f"[bold]{spec.label}[/bold]: serve start")
                entry.update(measure_serve_start(model_path, request.threads, worker_env(request.threads),
                                                 spec.options.get("dtype")))
            if entry["status"] == "ok":
                progress.console.print(f"[green]✓[/green] {spec.label}: done in {entry['elapsed_seconds']:.1f}s")
            else:
                style = "yellow" if entry["status"] == "skipped" else "red"
                hint = f"; {entry['hint']}" if entry.get("hint") else ""
                progress.console.print(f"[{style}]•[/{style}] {spec.label}: {entry['status']} "
                                       f"({escape(str(entry['reason']))}{escape(hint)})", soft_wrap=True)
    primary = next((s.label for s in request.peers if s.is_loom and engines[s.label]["status"] == "ok"), None)
    report = {
        "version": REPORT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": request.model, "path": str(model_path), "size_bytes": model_path.stat().st_size},
        "threads": request.threads,
        "host": _host(),
        "settings": settings.to_json(),
        "workload": {"source": workload.source, "notes": workload.notes,
                     "decode_prompt_tokens": len(workload.decode_prompt),
                     "prefill_prompt_tokens": len(workload.prefill_prompt),
                     "concurrency_prompt_tokens": {str(n): sum(len(p) for p in workload.batch(n))
                                                   for n in settings.concurrency}},
        "primary": primary,
        "engines": engines,
    }
    report["ratios"] = compute_ratios(report)
    return report
