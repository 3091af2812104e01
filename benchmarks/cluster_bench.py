"""`loom serve --replicas N` on Ray Serve: prefix-aware routing vs Ray's default, replicas vs threads,
and a replica killed under load.

Workload: PREFIXES long system prompts x QUESTIONS user questions each, shuffled (one seed for
every configuration), sent as streamed chat completions by CONCURRENCY clients in a closed
loop. Per configuration: prefix-cache hit rate (prompt tokens, from /metrics), TTFT p50/p99
(client side: first content chunk), throughput. The KV cache of each replica (--num-blocks)
holds only part of the system prompts, as a real cache under load does.

    A  2 replicas x 1 thread, prefix-aware router
    B  2 replicas x 1 thread, Ray Serve's power-of-two router (the same replicas otherwise)
    C  1 server x 2 threads (plain `loom serve`, twice the KV blocks: the same memory)
    K  kill test on A: KILL_REQUESTS non-streamed requests, one replica SIGKILLed mid-run

Run from the repository root (about 10 minutes on 2 cores):

    .venv/bin/python benchmarks/cluster_bench.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loom.bench.server_peers import free_port

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["astronomy", "cooking", "tax law", "gardening", "chess", "marine biology", "jazz history", "woodworking",
          "cryptography", "mountaineering", "beekeeping", "typography"]


def system_prompt(topic: str, words: int) -> str:
    rng = random.Random(topic)
    rules = [f"Rule {i}: when asked about {topic}, {rng.choice(['cite', 'explain', 'summarize', 'compare'])} "
             f"the {rng.choice(['history', 'method', 'tools', 'risks', 'vocabulary'])} of {topic} "
             f"in {rng.choice(['plain', 'precise', 'friendly', 'formal'])} words." for i in range(words // 16)]
    return f"You are an expert assistant on {topic}. " + " ".join(rules)


def workload(prefixes: int, questions: int, words: int, seed: int) -> list[list[dict]]:
    items = [[{"role": "system", "content": system_prompt(TOPICS[p % len(TOPICS)] + f" #{p}", words)},
              {"role": "user", "content": f"Question {q}: what matters most about point {q * 7 % 13}?"}]
             for p in range(prefixes) for q in range(questions)]
    random.Random(seed).shuffle(items)
    return items


class Server:
    def __init__(self, model: str, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([sys.executable, "-m", "loom", "serve", model, "--port", str(self.port),
                                         "--no-access-log", "--log-level", "warning", *args],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited: see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        time.sleep(3)   # replicas' first stats reach the ingress

    def counters(self) -> tuple[float, float]:
        hits = queries = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
        return hits, queries

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


async def run_load(url: str, items: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    ttfts: list[float] = []
    errors = 0
    tokens = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal errors, tokens
        while not queue.empty():
            messages = queue.get_nowait()
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            first = None
            async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors += 1
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if first is None and data["choices"] and data["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - start
                    if data.get("usage"):
                        tokens += data["usage"]["completion_tokens"]
            if first is not None:
                ttfts.append(first)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttfts.sort()
    return {"requests": len(items), "errors": errors, "wall_s": wall, "req_per_s": len(items) / wall,
            "tok_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def measure(name: str, model: str, args: list[str], items, opts, logs: Path) -> tuple[dict, Server]:
    server = Server(model, args, logs / f"{name}.log")
    h0, q0 = server.counters()
    result = asyncio.run(run_load(server.url, items, opts.concurrency, opts.max_tokens))
    time.sleep(2.5)  # the replicas' last stats
    h1, q1 = server.counters()
    result["hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    print(f"{name}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", flush=True)
    return result, server


async def kill_test(server: Server, n: int, concurrency: int, max_tokens: int, kill_after_s: float) -> dict:
    replicas = httpx.get(f"{server.url}/v1/loom/replicas", timeout=10).json()["replicas"]
    sem = asyncio.Semaphore(concurrency)
    statuses: list[int] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
        async with sem:
            body = {"messages": [{"role": "user", "content": f"Tell me fact number {i}."}],
                    "max_tokens": max_tokens, "ignore_eos": True}
            try:
                statuses.append((await c.post(f"{server.url}/v1/chat/completions", json=body)).status_code)
            except httpx.HTTPError:
                statuses.append(-1)

    async with httpx.AsyncClient(timeout=600) as c:
        tasks = [asyncio.create_task(one(c, i)) for i in range(n)]
        await asyncio.sleep(kill_after_s)
        os.kill(replicas[0]["pid"], signal.SIGKILL)
        killed_at = time.perf_counter()
        await asyncio.gather(*tasks)
    recovered = None
    while time.perf_counter() - killed_at < 120:
        now = httpx.get(f"{server.url}/v1/loom/replicas", timeout=10).json()["replicas"]
        if len(now) == 2 and replicas[0]["replica"] not in [r["replica"] for r in now] \
                and all(r.get("pid") is not None for r in now):
            recovered = time.perf_counter() - killed_at
            break
        time.sleep(1)
    retried = [ln for ln in httpx.get(f"{server.url}/metrics").text.splitlines()
               if ln.startswith('loom:cluster_retries_total{reason="replica_died"}')]
    return {"requests": n, "ok": statuses.count(200), "lost": n - statuses.count(200),
            "retried": float(retried[0].rsplit(" ", 1)[1]) if retried else 0.0, "replacement_ready_s": recovered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--words", type=int, default=400, help="system prompt length in words")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=192, help="KV blocks per replica (x2 for the single server)")
    ap.add_argument("--kill-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="A,B,C", help="which configurations, in this order (K runs after A)")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    logs = ROOT / "benchmarks" / "cluster_logs"
    logs.mkdir(exist_ok=True)
    items = workload(opts.prefixes, opts.questions, opts.words, opts.seed)
    blocks = ["--num-blocks", str(opts.num_blocks)]
    configs = {
        "A": ("A prefix-aware 2x1", ["--replicas", "2", "--threads", "1", "--router", "prefix-aware", *blocks]),
        "B": ("B power-of-two 2x1", ["--replicas", "2", "--threads", "1", "--router", "power-of-two", *blocks]),
        "C": ("C one server 1x2", ["--threads", "2", "--num-blocks", str(2 * opts.num_blocks)]),
    }
    results = {}
    for key in opts.configs.split(","):
        name, args = configs[key.strip()]
        results[name], server = measure(key.strip(), opts.model, args, items, opts, logs)
        if key.strip() == "A" and opts.kill_requests:
            results["K kill test"] = asyncio.run(kill_test(server, opts.kill_requests, 16, opts.max_tokens, 4.0))
            print(f"K: {results['K kill test']}", flush=True)
        server.stop()
    print_table(results)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))


def print_table(results: dict) -> None:
    print("| configuration | hit rate | TTFT p50 (s) | TTFT p99 (s) | req/s | tok/s | errors |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "hit_rate" in r:
            print(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                  f"{r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {r['errors']} |")
    k = results.get("K kill test")
    if k:
        ready = k["replacement_ready_s"]
        print(f"\nkill test: {k['ok']}/{k['requests']} answered, {k['lost']} lost, {k['retried']:.0f} retried on "
              f"the other replica, replacement ready after {ready:.0f} s" if ready is not None else
              "replacement not ready within 120 s")


if __name__ == "__main__":
    main()
