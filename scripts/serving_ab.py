"""Interleaved A/B of `loom serve` builds against the engine alone (docs/benchmarks.md, "Serving path").

    python scripts/serving_ab.py --server before=/path/to/old/worktree --server after=. \
        [--concurrency 8,32] [--repeats 2] [--max-tokens 64] [--json out.json]

Starts every server at once (one port each), then for each repeat and each concurrency runs
`loom bench --server URL --rates max --num-requests N` against each server in turn, then the
engine alone (`engine_alone`: an Engine in a child process, no HTTP) on the same N requests. CPU% is the server's process tree
(front end + engine process), of 100% per core: the median of 0.5 s slices while loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

PROMPTS = "/work/shared/data/spec_bench/question.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the server process itself and of its children (the engine process)."""
    own, kids = 0.0, 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if p.pid == proc.pid:
            own += t.user + t.system
        else:
            kids += t.user + t.system
    return own, kids


class CpuSampler:
    """CPU% of a server (front end, engine process) in 0.5 s slices while a command runs; `loaded()`
    is the median over the slices where the server used more than half a core (the load
    generator's own start-up and the warm-up request are left out)."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.samples, self.stop = proc, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        last, t = tree_cpu(self.proc), time.monotonic()
        while not self.stop.wait(0.5):
            now, t1 = tree_cpu(self.proc), time.monotonic()
            self.samples.append(tuple(100 * (now[i] - last[i]) / (t1 - t) for i in (0, 1)))
            last, t = now, t1

    def __enter__(self) -> "CpuSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def loaded(self) -> tuple[float, float]:
        busy = sorted((s for s in self.samples if s[0] + s[1] > 50), key=lambda s: s[0] + s[1])
        return busy[len(busy) // 2] if busy else (0.0, 0.0)


def engine_alone(model: str, n: int, max_tokens: int, warm: bool = True) -> dict:
    """The engine alone (no HTTP) on the load generator's own requests: the first n Spec-Bench
    prompts (round-robin, cut to 1000 characters) as chat messages (as plain prompts for a model
    without a chat template, as `loom bench --server`'s --endpoint auto sends them), greedy,
    max_tokens, prefix caching off, all submitted at once after one warm-up request; tok/s over
    the same span."""
    from loom.bench.prompts import load_spec_bench
    from loom.config import EngineConfig
    from loom.engine.engine import Engine
    from loom.sampling_params import SamplingParams

    prompts = [p[:1000] for p in load_spec_bench(Path(PROMPTS))]
    engine = Engine(EngineConfig.create(model, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def run(texts: list[str]) -> dict:
        tok = engine.tokenizer
        ids = [tok.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True)
               if tok.chat_template is not None else tok.encode(t) for t in texts]
        t0 = time.perf_counter()
        for x in ids:
            engine.add_request({"prompt_token_ids": x}, params)
        first, last, counts = {}, {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                k = len(out.outputs[0].token_ids)
                if k and out.request_id not in first:
                    first[out.request_id] = now
                last[out.request_id], counts[out.request_id] = now, k
        wall = max(last.values()) - t0
        tpot = sorted((last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1)
        ttft = sorted(first[r] - t0 for r in first)
        return {"tok_s": sum(counts.values()) / wall, "ttft_p50": 1000 * ttft[len(ttft) // 2],
                "tpot_p50": 1000 * tpot[len(tpot) // 2]}

    if warm:
        run(prompts[-1:])
    return {"who": "engine", "n": n, **run(prompts[:n])}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-alone":  # a child run: model n max_tokens
        print(json.dumps(engine_alone(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", action="append", required=True, help="LABEL=WORKTREE[:extra serve args]")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = {}
    for spec in args.server:
        label, _, rest = spec.partition("=")
        tree, _, extra = rest.partition(":")
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        log = open(Path(tempfile.gettempdir()) / f"serving_ab_{label}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "loom", "serve", args.model, "--port", str(port),
                              "--no-access-log", "--log-level", "warning", *extra.split()],
                             env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
        servers[label] = (p, f"http://127.0.0.1:{port}", tree)
    for label, (p, url, _) in servers.items():
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"server {label} did not start")
    rows = []
    try:
        for rep in range(args.repeats):
            for n in levels:
                for label, (p, url, tree) in servers.items():
                    out = Path(tempfile.mkstemp(suffix=".json")[1])
                    proc = psutil.Process(p.pid)
                    with CpuSampler(proc) as sampler:
                        subprocess.run([sys.executable, "-m", "loom", "bench", "--server", url, "--rates", "max",
                                        "--num-requests", str(n), "--max-tokens", str(args.max_tokens),
                                        "--prompts", PROMPTS, "--json", str(out)],
                                       env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())},
                                       check=True, stdout=subprocess.DEVNULL)
                    front, engine = sampler.loaded()
                    lv = json.loads(out.read_text())["levels"][-1]
                    row = {"rep": rep, "who": label, "n": n, "tok_s": lv["output_tok_s"],
                           "ttft_p50": lv["ttft_ms"]["p50"], "itl_p50": lv["itl_ms"]["p50"], "cpu": front + engine, "cpu_front": front, "cpu_engine": engine,
                           "errors": lv["errors"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            for n in levels:
                done = subprocess.run([sys.executable, __file__, "--engine-alone", args.model, str(n),
                                       str(args.max_tokens)], check=True, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
                row = {"rep": rep, **json.loads(done.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for p, _, _ in servers.values():
            p.terminate()
        for p, _, _ in servers.values():
            p.wait(30)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
