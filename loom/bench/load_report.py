"""The load test's report: a rich table, a Markdown section for docs/benchmarks.md, PNG charts.

``python -m loom.bench.load_report REPORT.json`` prints the Markdown section of a report written
by ``loom bench --server URL --json REPORT.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from loom.bench.plots import pyplot, save_figure
from loom.bench.settings import BenchError


def _quantile(key: str, q: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda lv: (lv[key] or {}).get(q)


# (header, unit, getter) of every column after the rate.
COLUMNS: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
    ("sent", "", lambda lv: lv["requests"]),
    ("ok", "", lambda lv: lv["ok"]),
    ("429", "", lambda lv: lv["rejected_429"]),
    ("errors", "", lambda lv: lv["errors"]),
    ("achieved", "req/s", lambda lv: lv["achieved_rps"]),
    ("tracking", "", lambda lv: lv.get("tracking")),
    ("output", "tok/s", lambda lv: lv["output_tok_s"]),
    *((f"{name} {q}", "ms", _quantile(key, q))
      for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")) for q in ("p50", "p99")),
]


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def rows(report: dict[str, Any]) -> list[list[str]]:
    """One row of formatted cells per rate, the rate first (``max``: all requests at once)."""
    return [[lv["label"], *(_fmt(get(lv)) for _, _, get in COLUMNS)] for lv in report["levels"]]


def verdict(report: dict[str, Any]) -> str:
    sat = report["saturation"]
    finite = [lv["label"] for lv in report["levels"] if lv["rate"] is not None]
    if sat["rate"] is None:
        return f"saturation: none up to {finite[-1]} req/s" if finite else "saturation: no finite rate measured"
    return f"saturation: {sat['rate']:g} req/s ({'; '.join(sat['reasons'])})"


def _endpoint(report: dict[str, Any]) -> str:
    """'chat completions (POST /v1/chat/completions)' or the completions one, with how auto chose it."""
    name = report.get("endpoint", "chat")   # reports from before --endpoint measured chat
    what = "chat completions (POST /v1/chat/completions)" if name == "chat" else "completions (POST /v1/completions)"
    note = report.get("endpoint_note")
    return f"{what}, {note}" if note else what


def notes(report: dict[str, Any]) -> list[str]:
    s, sat = report["settings"], report["saturation"]
    per_rate = (f"{s['num_requests']} requests per rate" if s["num_requests"] is not None
                else f"rate × {s['duration']:g} s requests per rate")
    if s.get("max_concurrency"):
        per_rate += f", at most {s['max_concurrency']} in flight"
    baseline = f"{sat['baseline_e2e_ms']:,.0f} ms" if sat["baseline_e2e_ms"] is not None else "—"
    lines = [f"server {report['server']}, model {report['model']}; {per_rate}, Poisson arrivals "
             f"(max: all at once); streaming {_endpoint(report)}, max_tokens {s['max_tokens']}"
             f"{' (ignore_eos)' if s.get('ignore_eos') else ''}, "
             f"temperature {s['temperature']:g}{_top_p(s)}; {report['prompts']}",
             "achieved = ok requests / (first send to last answer); output tok/s over the same time; "
             "TTFT to the first content chunk; ITL = gaps between content chunks; E2E = send to last chunk",
             f"tracking = achieved / (requests / (send window + L0)), L0 = median E2E at the lowest rate "
             f"({baseline}); saturated where tracking < {sat['min_tracking']}, median E2E > "
             f"{sat['latency_blowup']:g}×L0, or any request fails",
             verdict(report)]
    if not all(lv["usage_reported"] for lv in report["levels"] if lv["ok"]):
        lines.append("the server sent no usage chunk for some requests: their tokens are content chunks")
    for lv in report["levels"]:
        lines += [f"rate {lv['label']}: {sample}" for sample in lv["error_samples"]]
    return lines


def build_table(report: dict[str, Any]) -> Table:
    """Metrics as rows, one column per rate (narrow enough for a terminal); the saturation rate's
    column is marked."""
    table = Table(title=f"loom bench --server: {escape(report['model'])} at {escape(report['server'])}",
                  title_justify="left")
    table.add_column("rate (req/s)", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    saturated = report["saturation"]["rate"]
    for lv in report["levels"]:
        mark = " [yellow]*[/yellow]" if saturated is not None and lv["rate"] == saturated else ""
        table.add_column(escape(lv["label"]) + mark, justify="right", no_wrap=True)
    for header, unit, get in COLUMNS:
        table.add_row(header, unit, *(_fmt(get(lv)) for lv in report["levels"]))
    if saturated is not None:
        table.caption = "* the saturation rate"
        table.caption_justify = "left"
    return table


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print(build_table(report))
    for line in notes(report):
        console.print(f"[dim]•[/dim] {escape(line)}", soft_wrap=True)


def _top_p(settings: dict[str, Any]) -> str:
    """", top_p P" for a sampled load test with a nucleus, else nothing."""
    return f", top_p {settings['top_p']:g}" if settings.get("temperature") and settings.get("top_p", 1) < 1 else ""


def markdown(report: dict[str, Any]) -> str:
    """The section docs/benchmarks.md holds: a heading, the command, the table and the notes."""
    s = report["settings"]
    per_rate = (f"--num-requests {s['num_requests']}" if s["num_requests"] is not None
                else f"--duration {s['duration']:g}")
    endpoint = (f" --endpoint {s['endpoint']}" if s.get("endpoint", "auto") != "auto" else "") + \
        (" --ignore-eos" if s.get("ignore_eos") else "") + \
        (f" --temperature {s['temperature']:g}{' --top-p %g' % s['top_p'] if s.get('top_p', 1) < 1 else ''}"
         if s.get("temperature") else "")
    if s.get("max_concurrency"):
        per_rate += f" --max-concurrency {s['max_concurrency']}"
    header = ["rate req/s", *(f"{h} {u}".strip() for h, u, _ in COLUMNS)]
    lines = [f"## Load test: {report['model']}, {report['created'][:10]}", "",
             "Command (server started separately):", "", "```bash",
             f"loom bench --server {s['url']} --rates {','.join(s['rates'])} {per_rate}{endpoint} "
             f"--max-tokens {s['max_tokens']} --json load.json --plot load_plots", "```", "",
             "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows(report)]
    lines += ["", *(f"- {line}" for line in notes(report)), ""]
    return "\n".join(lines)


def _x_positions(report: dict[str, Any]) -> tuple[list[float], list[str]]:
    """x of every level on a log2 axis; ``max`` sits one doubling right of the largest rate."""
    finite = [lv["rate"] for lv in report["levels"] if lv["rate"] is not None]
    top = max(finite, default=0.5) * 2
    xs = [lv["rate"] if lv["rate"] is not None else top for lv in report["levels"]]
    return xs, [lv["label"] for lv in report["levels"]]


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """load_throughput.png (achieved vs offered req/s, output tok/s) and load_latency.png (TTFT,
    ITL, E2E p50/p99) against the offered rate; returns their paths."""
    plt = pyplot()

    xs, labels = _x_positions(report)
    levels = report["levels"]
    title = f"{report['model']} at {report['server']}"
    sat = report["saturation"]["rate"]
    written = []

    def finish(ax: Any) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3, which="both")
        if sat is not None:
            ax.axvline(sat, color="grey", linestyle=":", label=f"saturation {sat:g} req/s")
        ax.legend(fontsize="small")

    def points(get: Any) -> tuple[list[float], list[float]]:
        pairs = [(x, get(lv)) for x, lv in zip(xs, levels) if get(lv) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    finite = [(x, lv["rate"]) for x, lv in zip(xs, levels) if lv["rate"] is not None]
    axes[0].plot([x for x, _ in finite], [r for _, r in finite], "--", color="grey", label="offered")
    axes[0].plot(*points(lambda lv: lv["achieved_rps"]), marker="o", label="achieved")
    axes[0].set_ylabel("requests / s")
    axes[0].set_title("request throughput")
    axes[1].plot(*points(lambda lv: lv["output_tok_s"]), marker="o", color="C1", label="output")
    axes[1].set_ylabel("output tokens / s")
    axes[1].set_title("output throughput")
    for ax in axes:
        finish(ax)
    fig.suptitle(f"Throughput vs offered rate ({title})")
    written.append(save_figure(fig, out_dir / "load_throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"),
                             ("time to first token", "inter-token latency", "end-to-end latency")):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ax.plot(*points(lambda lv: (lv[key] or {}).get(q)), style, label=q)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(name)
        finish(ax)
    fig.suptitle(f"Latency vs offered rate ({title})")
    written.append(save_figure(fig, out_dir / "load_latency.png"))
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m loom.bench.load_report REPORT.json", file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if report.get("kind") != "load":
        print(f"{argv[0]} is not a `loom bench --server` report", file=sys.stderr)
        return 2
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
