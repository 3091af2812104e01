"""The engine alone under the server bench's load: the ``engine`` column of
``loom bench --server start --peers loom,engine,...``.

A server should deliver what its engine can: this column is what the engine can, under the same
load, measured in the same run. It answers the requests every server gets
(`loom.bench.load.plan_ladder`: the same prompts, sent at the same offsets, with the same
endpoint's prompt rendering, sampling, ``max_tokens`` and ``ignore_eos``) with the engine `loom
serve` runs by default (the same GGUF, thread count and `EngineConfig` defaults), driven through
`Engine.add_request` / `Engine.step` in a process of its own: no HTTP, no front end, no second
process, no event stream. A request is sent when its offset has passed (and, under
``max_concurrency``, a slot is free); its tokens arrive when the step that made them returns
(one chunk per step, as the server streams them). The figures are the load's own
(`loom.bench.load.summarize`), so ``loom`` over ``engine`` in the comparison's ratio columns is
the share of the engine the server delivers.

Run as ``python -m loom.bench.engine_load``: a JSON job on stdin (`job`), the reports (one per
plan, `loom.bench.load.load_report`) as one JSON line on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from loom.bench.load import (AUTO, LoadSettings, RequestRecord, load_report, parse_rates, plan_ladder, summarize,
                             with_cpu)
from loom.bench.harness import worker_env
from loom.bench.server_peers import ENGINE
from loom.bench.settings import BenchError
from loom.sampling_params import SamplingParams


def job(settings: Sequence[LoadSettings], gguf: Path, threads: int) -> dict[str, Any]:
    """The child's job: the plans (endpoint resolved) and the engine's model and threads."""
    for s in settings:
        if s.endpoint == AUTO:
            raise BenchError("the engine column needs the endpoint decided (chat or completions): give --model")
    return {"gguf": str(gguf), "threads": threads, "plans": [s.to_json() for s in settings]}


def _settings(plan: dict[str, Any]) -> LoadSettings:
    fields = {f.name for f in dataclasses.fields(LoadSettings)}
    values = {k: v for k, v in plan.items() if k in fields}
    values["rates"] = parse_rates(",".join(plan["rates"]))
    values["prompts_path"] = Path(plan["prompts_path"])
    return LoadSettings(**values)


def run_engine_load(settings: Sequence[LoadSettings], gguf: Path, threads: int,
                    timeout: float | None = None) -> list[dict[str, Any]]:
    """Every plan through the engine in a child process; BenchError with its last lines if it fails."""
    done = subprocess.run([sys.executable, "-m", "loom.bench.engine_load"],
                          input=json.dumps(job(settings, gguf, threads)), capture_output=True, text=True,
                          env=worker_env(threads), timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise BenchError(f"the engine column failed (exit {done.returncode}): {tail}")
    return json.loads(lines[-1])


class EngineLoad:
    """The requests of one plan, as `loom serve` would turn them into engine requests."""

    def __init__(self, engine: Any, settings: LoadSettings):
        self.engine, self.settings = engine, settings
        sampled = {"top_p": settings.top_p, "top_k": -1, "min_p": 0.0} if settings.temperature > 0 else {}
        self.params = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens,
                                     ignore_eos=settings.ignore_eos, **sampled)

    def prompt(self, text: str) -> Any:
        """A chat request's one user message rendered by the chat template (as the server does), or
        a completion's plain text, tokenized by the engine with its special tokens."""
        if self.settings.endpoint == "chat":
            return {"prompt_token_ids": self.engine.tokenizer.encode_chat([{"role": "user", "content": text}],
                                                                         add_generation_prompt=True)}
        return text

    def run(self, prompts: Sequence[str], offsets: Sequence[float]) -> list[RequestRecord]:
        """Sends request i at offsets[i] (at most max_concurrency in flight) and steps the engine
        until every request has finished."""
        engine, limit = self.engine, self.settings.max_concurrency or len(prompts)
        start = time.perf_counter()
        records: list[RequestRecord] = []
        live: dict[str, RequestRecord] = {}
        while len(records) < len(prompts) or live:
            now = time.perf_counter() - start
            while len(records) < len(prompts) and offsets[len(records)] <= now and len(live) < limit:
                record = RequestRecord(sent=time.perf_counter() - start)
                live[engine.add_request(self.prompt(prompts[len(records)]), self.params)] = record
                records.append(record)
            if not live:   # nothing to run before the next arrival
                time.sleep(max(0.0, offsets[len(records)] - (time.perf_counter() - start)))
                continue
            outputs = engine.step()
            stamp = time.perf_counter() - start
            for out in outputs:
                record = live.get(out.request_id)
                if record is None:
                    continue
                if out.outputs[0].delta_token_ids:
                    record.first_token = stamp if record.first_token is None else record.first_token
                    record.chunk_times.append(stamp)
                if out.finished:
                    record.status, record.end = 200, stamp
                    record.output_tokens, record.usage_reported = len(out.outputs[0].token_ids), True
                    del live[out.request_id]
        return records


def _run(job: dict[str, Any]) -> list[dict[str, Any]]:
    # the engine (and torch) only in the child: the bench's own process stays without them
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    gguf = Path(job["gguf"])
    engine = Engine(EngineConfig.create(str(gguf), threads=job["threads"]))
    reports = []
    for plan in job["plans"]:
        settings = _settings(plan)
        load = EngineLoad(engine, settings)
        warmup_prompt, rates = plan_ladder(settings)
        load.run([warmup_prompt], [0.0])
        started = time.time()
        levels = []
        for r in rates:   # the engine's CPU use: this process's, every thread
            c0, t0 = time.process_time(), time.perf_counter()
            records = load.run(r.prompts, r.offsets)
            levels.append(with_cpu(summarize(r.rate, records), time.process_time() - c0, time.perf_counter() - t0))
        reports.append(load_report(settings, ENGINE, gguf.stem, settings.endpoint, None, levels, started))
    return reports


def main() -> int:
    reports = _run(json.loads(sys.stdin.read()))
    print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
