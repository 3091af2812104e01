"""`loom bench --server URL|start --peers loom,llama-server,vllm`: the same load against several servers.

Targets: the server at URL (labelled ``loom``), or with ``start`` none, plus every peer in
``--peers``, which the bench starts itself on a free port with the same GGUF and thread count
(`loom.bench.server_peers`); the peer ``engine`` is no server but loom's engine alone under the
same load (`loom.bench.engine_load`), so loom's ratio to it is the share of the engine that
`loom serve` delivers. Every server gets the same endpoint: ``--endpoint auto`` is decided once
from the GGUF (completions for a model without a chat template, see `loom.bench.load`).
The runs are interleaved so a busy machine spreads over all of them: for each round, each
target in turn is started, answers the whole load (every request count of ``--num-requests``,
each through the rate ladder of `loom.bench.load`, the same prompts in the same order) and is
stopped before the next one starts. One server runs at a time.

Summary per (request count, rate) and target: the median over rounds of output tok/s, of the
TTFT and ITL p50s and, for the servers the bench started (and the engine column), of their CPU
use while answering (all their processes, in percent of one core); and per peer the median over
rounds of loom's ratio in that round (loom/peer for tok/s, peer/loom for the latencies: above 1×
loom is ahead), so a ratio compares runs made minutes apart, not a quiet round of one with a
busy round of the other.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.bench.engine_load import run_engine_load
from loom.bench.load import AUTO, LoadSettings, endpoint_for_gguf, run_load
from loom.bench.server_peers import (LocalServer, ServeJob, ServerKind, free_port,
                                     parse_server_peers)
from loom.bench.plots import pyplot, save_figure
from loom.bench.settings import BenchError

LOOM = "loom"
TOKENS_PER_CHAR = 0.5       # a generous bound on prompt tokens per character (chat template included)
SEQ_TOKENS_ROUND = 256
REQUESTS = {"chat": "streaming POST /v1/chat/completions", "completions": "streaming POST /v1/completions",
            AUTO: "chat or completions, as each server's /tokenizer_info tells (--endpoint auto without a GGUF)"}
# (key, column name, short name for the ratio columns, getter, higher is better)
METRICS = (("output_tok_s", "output tok/s", "tok/s", lambda lv: lv["output_tok_s"], True),
           ("ttft_p50_ms", "TTFT p50 ms", "TTFT", lambda lv: (lv["ttft_ms"] or {}).get("p50"), False),
           ("itl_p50_ms", "ITL p50 ms", "ITL", lambda lv: (lv["itl_ms"] or {}).get("p50"), False))


@dataclass(frozen=True)
class Target:
    """One column: a server already running at `url`, or a `kind` the bench starts."""

    label: str
    url: str | None = None
    kind: ServerKind | None = None


def targets(server: str, peers: str | None) -> list[Target]:
    """``--server URL`` -> that server as ``loom`` first; ``--server start`` -> only the peers.
    BenchError when loom would be there twice or nothing is to be measured."""
    kinds = parse_server_peers(peers) if peers else []
    if server == "start":
        if not kinds:
            raise BenchError("--server start needs --peers naming the servers to start (e.g. loom,llama-server)")
        return [Target(k.name, kind=k) for k in kinds]
    if any(k.name == LOOM for k in kinds):
        raise BenchError(f"--server {server} is the loom column: leave loom out of --peers, or use --server start")
    return [Target(LOOM, url=server), *(Target(k.name, kind=k) for k in kinds)]


def seq_tokens(settings: LoadSettings) -> int:
    """Tokens one request may hold: its prompt (cut to `prompt_chars`) plus its output, rounded up."""
    need = int(settings.prompt_chars * TOKENS_PER_CHAR) + settings.max_tokens + 64
    return -(-need // SEQ_TOKENS_ROUND) * SEQ_TOKENS_ROUND


def same_endpoint(plans: Sequence[LoadSettings], gguf: Path | None) -> list[LoadSettings]:
    """``--endpoint auto`` decided once from the GGUF (completions without a chat template), so every
    server gets the same requests; without a GGUF each load decides at its server."""
    if gguf is None or all(p.endpoint != AUTO for p in plans):
        return list(plans)
    endpoint = endpoint_for_gguf(gguf)
    return [dataclasses.replace(p, endpoint=endpoint) if p.endpoint == AUTO else p for p in plans]


def _run_target(target: Target, job: ServeJob | None, plans: Sequence[LoadSettings],
                load: Callable[..., dict[str, Any]], log: Callable[[str], None],
                engine_load: Callable[..., list[dict[str, Any]]] = run_engine_load) -> dict[str, Any]:
    """Every plan against one target (started and stopped around them when it is a peer)."""
    if target.kind is None:
        return {"start_seconds": None, "loads": [load(dataclasses.replace(p, url=target.url)) for p in plans]}
    if target.kind.launch is None:   # the engine alone, no server
        log(f"running {target.label}: the same load through loom's engine in a process of its own")
        return {"start_seconds": None, "loads": engine_load(plans, job.gguf, job.threads)}
    launch = target.kind.launch(job)
    log(f"starting {target.label}: {' '.join(launch.argv)}")
    with LocalServer(target.label, launch, job.url) as server:
        log(f"{target.label} ready in {server.start_seconds:.1f} s")
        loads = [load(dataclasses.replace(p, url=job.url), cpu=server.cpu_seconds) for p in plans]
    return {"start_seconds": server.start_seconds, "command": launch.argv, "env": launch.env, "loads": loads}


def run_comparison(columns: Sequence[Target], plans: Sequence[LoadSettings], gguf: Path | None, threads: int,
                   rounds: int = 1, load: Callable[..., dict[str, Any]] = run_load,
                   log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
                   on_run: Callable[[dict[str, Any]], None] = lambda report: None,
                   engine_load: Callable[..., list[dict[str, Any]]] = run_engine_load) -> dict[str, Any]:
    """Runs `plans` (one per request count) against every target, `rounds` times interleaved;
    `on_run` gets the report so far after every target's run (a long run stopped keeps those)."""
    if rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {rounds}")
    started = [t for t in columns if t.kind is not None]
    if started and gguf is None:
        raise BenchError("starting a server peer (or the engine column) needs the model's GGUF (--model)")
    slots = max(n for p in plans for n in p.counts())
    plans = same_endpoint(plans, gguf)
    for target in started:   # a peer not built is one line before any server runs, not after the others' loads
        if target.kind.launch is not None:
            target.kind.launch(ServeJob(gguf, threads, slots, seq_tokens(plans[0]), 0))
    report = {"kind": "load-compare", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "model": str(gguf) if gguf else None, "threads": threads, "rounds": rounds, "slots": slots,
              "endpoint": plans[0].endpoint,
              "targets": [{"label": t.label, "url": t.url,
                           "about": t.kind.about if t.kind else "the server at --server"} for t in columns],
              "runs": [], "summary": []}
    for r in range(rounds):
        for target in columns:
            job = ServeJob(gguf, threads, slots, seq_tokens(plans[0]), free_port()) if target.kind else None
            run = _run_target(target, job, plans, load, log, engine_load)
            report["runs"].append({"round": r, "label": target.label, **run})
            report["summary"] = summarize(report["runs"], [t.label for t in columns])
            on_run(report)
    return report


def _levels(runs: list[dict[str, Any]]) -> dict[tuple[str, int, int, str], dict[str, Any]]:
    """(label, round, request count, rate label) -> that level of that run."""
    out = {}
    for run in runs:
        for report in run["loads"]:
            count = report["settings"]["num_requests"]
            for lv in report["levels"]:
                out[(run["label"], run["round"], count, lv["label"])] = lv
    return out


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """One row per (request count, rate): medians per target, loom's median ratio per peer."""
    levels = _levels(runs)
    rounds = sorted({r for (_, r, _, _) in levels})
    points = list(dict.fromkeys((c, rate) for (_, _, c, rate) in levels))
    rows = []
    for count, rate in points:
        row: dict[str, Any] = {"requests": count, "rate": rate, "values": {}, "ratios": {}}
        for label in labels:
            per_round = [levels.get((label, r, count, rate)) for r in rounds]
            row["values"][label] = {key: _median([get(lv) if lv else None for lv in per_round])
                                    for key, _, _, get, _ in METRICS}
            row["values"][label]["cpu_percent"] = _median([lv.get("server_cpu_percent") if lv else None
                                                           for lv in per_round])
            row["values"][label]["errors"] = sum((lv["errors"] + lv["rejected_429"]) if lv else 0 for lv in per_round)
        if LOOM in labels:
            for peer in (lb for lb in labels if lb != LOOM):
                row["ratios"][peer] = {key: _median([_ratio(levels.get((LOOM, r, count, rate)),
                                                            levels.get((peer, r, count, rate)), get, higher)
                                                     for r in rounds])
                                       for key, _, _, get, higher in METRICS}
        rows.append(row)
    return rows


def _ratio(loom_lv: dict | None, peer_lv: dict | None, get, higher_is_better: bool) -> float | None:
    a, b = (get(loom_lv) if loom_lv else None), (get(peer_lv) if peer_lv else None)
    if not a or not b:
        return None
    return a / b if higher_is_better else b / a


def _fmt(v: float | None, ratio: bool = False) -> str:
    if v is None:
        return "—"
    if ratio:
        return f"{v:.2f}×"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per (request count, rate, server) with its medians and loom's
    ratios to it (loom/server for tok/s, server/loom for latencies; none on loom's own row)."""
    labels = [t["label"] for t in report["targets"]]
    header = ["requests", "rate", "server", *(name for _, name, _, _, _ in METRICS), "CPU %",
              *(f"loom vs it: {short}" for _, _, short, _, _ in METRICS)]
    rows = []
    for row in report["summary"]:
        for lb in labels:
            ratios = row["ratios"].get(lb, {})
            rows.append([str(row["requests"]), row["rate"], lb,
                         *(_fmt(row["values"][lb][key]) for key, _, _, _, _ in METRICS),
                         _fmt(row["values"][lb].get("cpu_percent")),
                         *(_fmt(ratios.get(key), ratio=True) if ratios else "" for key, _, _, _, _ in METRICS)])
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    header, rows = table(report)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    starts = [f"{run['label']} round {run['round'] + 1}: ready in {run['start_seconds']:.1f} s"
              for run in report["runs"] if run.get("start_seconds") is not None]
    about = [f"* {t['label']}: {t['about']}" for t in report["targets"]]
    about.append(f"* requests: {REQUESTS[report.get('endpoint', 'chat')]}")   # older reports: chat
    return "\n".join(lines + [""] + about + ([f"* start-up: {'; '.join(starts)}"] if starts else []))


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """server_compare.png: per (request count, rate), each server's output tok/s, TTFT p50 and ITL
    p50, a bar at the median over the rounds and a dot per round; returns its path."""
    plt = pyplot()
    labels = [t["label"] for t in report["targets"]]
    points = [(row["requests"], row["rate"]) for row in report["summary"]]
    if not points:
        raise BenchError("the report holds no measured level to plot")
    levels = _levels(report["runs"])
    rounds = sorted({r for (_, r, _, _) in levels})
    width = 0.8 / len(labels)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4.5))
    for ax, (key, name, _, get, higher) in zip(axes, METRICS):
        for j, label in enumerate(labels):
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(points))]
            medians = [row["values"][label][key] for row in report["summary"]]
            ax.bar(xs, [m or 0 for m in medians], width, label=label, color=f"C{j}", alpha=0.8)
            for x, (count, rate) in zip(xs, points):
                vals = [get(lv) for r in rounds if (lv := levels.get((label, r, count, rate))) is not None]
                ax.plot([x] * len(vals), vals, "k.", markersize=4)
        ax.set_xticks(range(len(points)), [f"{count} requests\nrate {rate}" for count, rate in points])
        ax.set_ylabel(name)
        ax.set_title(f"{name} ({'higher' if higher else 'lower'} is better)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    model = Path(report["model"]).name if report.get("model") else "the server"
    fig.suptitle(f"{model}: {', '.join(labels)}; {report['threads']} threads, {report['rounds']} round(s), "
                 f"{report.get('endpoint', 'chat')} endpoint (bars: medians, dots: rounds)")
    return [save_figure(fig, out_dir / "server_compare.png")]


def main(argv: list[str] | None = None) -> None:
    """``python -m loom.bench.server_compare REPORT.json [--plot DIR]`` prints the Markdown table of a
    report (and writes its chart into DIR)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--plot"):
        raise SystemExit("usage: python -m loom.bench.server_compare REPORT.json [--plot DIR]")
    report = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    print(markdown(report))
    if len(args) == 3:
        for path in write_plots(report, Path(args[2])):
            print(f"plot written to {path}")


if __name__ == "__main__":
    main()
