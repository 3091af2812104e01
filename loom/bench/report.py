"""The bench report as a rich table (absolute numbers plus loom-vs-peer ratios) and as JSON.

Ratios read "how many times better loom is": loom/peer for rates (tok/s), peer/loom for times
and memory, so above 1× always means loom is ahead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from loom.bench.settings import BenchError


@dataclass(frozen=True)
class Metric:
    key: str                 # flat key, as in report["ratios"][peer]
    label: str
    unit: str
    higher_is_better: bool
    section: str
    get: Callable[[dict[str, Any]], float | None]
    digits: int = 1


def _path(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    def get(entry: dict[str, Any]) -> float | None:
        value: Any = entry
        for k in keys:
            if not isinstance(value, dict) or value.get(k) is None:
                return None
            value = value[k]
        return float(value)

    return get


def metrics(settings: dict[str, Any]) -> list[Metric]:
    """Every metric of a report made with `settings`, in table order."""
    out = [
        Metric("import_seconds", "library import", "s", False, "engine", _path("import_seconds"), 2),
        Metric("load_seconds", "load time", "s", False, "engine", _path("load_seconds"), 2),
        Metric("peak_rss_mb", "peak RSS", "MB", False, "engine", _path("peak_rss_mb"), 0),
        Metric("serve_start_seconds", "serve start to ready /health", "s", False, "engine",
               _path("serve_start_seconds"), 2),
        Metric("decode_tok_s", "decode, 1 stream", "tok/s", True, "single stream", _path("decode", "tok_s")),
        Metric("prefill_tok_s", f"prefill, {settings['prefill_tokens']}-token prompt", "tok/s", True,
               "single stream", _path("prefill", "tok_s")),
    ]
    for n in settings.get("decode_contexts", ()):
        out.append(Metric(f"decode_ctx{n}_tok_s", f"decode at context {n}", "tok/s", True, "single stream",
                          _path("decode_context", str(n), "tok_s")))
    for n in settings["concurrency"]:
        c, section = str(n), f"concurrency {n}"
        out += [
            Metric(f"c{n}_throughput_tok_s", "output throughput", "tok/s", True, section,
                   _path("concurrency", c, "throughput_tok_s")),
            Metric(f"c{n}_decode_tok_s", "decode, all decoding", "tok/s", True, section,
                   _path("concurrency", c, "decode_tok_s")),
            Metric(f"c{n}_ttft_p50_ms", "TTFT p50", "ms", False, section, _path("concurrency", c, "ttft_ms", "p50")),
            Metric(f"c{n}_ttft_p99_ms", "TTFT p99", "ms", False, section, _path("concurrency", c, "ttft_ms", "p99")),
            Metric(f"c{n}_tpot_p50_ms", "TPOT p50", "ms", False, section, _path("concurrency", c, "tpot_ms", "p50")),
            Metric(f"c{n}_tpot_p99_ms", "TPOT p99", "ms", False, section, _path("concurrency", c, "tpot_ms", "p99")),
        ]
    return out + _parallel_metrics(settings)


def _parallel_metrics(settings: dict[str, Any]) -> list[Metric]:
    """Rows of the parallel suites, when the run had them."""
    suites = settings.get("suites", ())
    out = []
    if "parallel" in suites:
        for n in settings["parallel_n"]:
            section = f"parallel sampling, n={n}"
            for mode in ("fork", "independent", "prefix_cache"):
                level = ("parallel", "levels", str(n), mode)
                out += [Metric(f"par{n}_{mode}_seconds", f"{mode}: wall time", "s", False, section,
                               _path(*level, "wall_seconds"), 2),
                        Metric(f"par{n}_{mode}_blocks", f"{mode}: peak KV blocks", "blocks", False, section,
                               _path(*level, "peak_kv_blocks"), 0)]
    if "parallel_quality" in suites and settings.get("quality_limit"):
        for method in ("greedy", "self_consistency", "short_m_at_k", "best_of"):
            where = ("parallel_quality", "methods", method)
            out += [Metric(f"gsm8k_{method}_accuracy", f"{method}: accuracy", "", True, "GSM8K",
                           _path(*where, "accuracy"), 3),
                    Metric(f"gsm8k_{method}_tokens", f"{method}: tokens / problem", "tok", False, "GSM8K",
                           _path(*where, "tokens_per_problem"), 0)]
    return out


def ratio(metric: Metric, loom: float | None, peer: float | None) -> float | None:
    """How many times better loom is than the peer on `metric` (None if either is missing)."""
    if loom is None or peer is None or loom <= 0 or peer <= 0:
        return None
    return loom / peer if metric.higher_is_better else peer / loom


def compute_ratios(report: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{peer label: {metric key: ratio}}`` of the primary loom engine against every other ok engine."""
    primary = report.get("primary")
    engines = report["engines"]
    if primary is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for label, entry in engines.items():
        if label == primary or entry.get("status") != "ok":
            continue
        out[label] = {m.key: ratio(m, m.get(engines[primary]), m.get(entry)) for m in metrics(report["settings"])}
    return out


def _fmt(value: float | None, digits: int) -> str:
    if value is None:
        return "—"
    if digits == 0 or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "—"
    style = "green" if r >= 1.0 else "red"
    return f"[{style}]{r:.2f}×[/{style}]"


def build_table(report: dict[str, Any]) -> Table:
    engines: dict[str, dict[str, Any]] = report["engines"]
    primary = report.get("primary")
    ratios = report.get("ratios") or compute_ratios(report)
    model = Path(report["model"]["path"]).name
    table = Table(title=f"loom bench: {escape(model)}, {report['threads']} threads", title_justify="left",
                  caption="ratio = how many times better loom is than the peer (loom/peer for tok/s, "
                          "peer/loom for times and memory); above 1× loom is ahead",
                  caption_justify="left")
    table.add_column("metric", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    for label, entry in engines.items():
        head = escape(label) if entry["status"] == "ok" else f"{escape(label)}\n[dim]{entry['status']}[/dim]"
        table.add_column(head, justify="right", no_wrap=True)
    for label in ratios:
        table.add_column(f"{escape(primary or 'loom')}\nvs {escape(label)}", justify="right", no_wrap=True)
    section = None
    for m in metrics(report["settings"]):
        if m.section != section:
            if section is not None:
                table.add_section()
            table.add_row(f"[bold]{escape(m.section)}[/bold]")
            section = m.section
        cells = [_fmt(m.get(e), m.digits) if e["status"] == "ok" else "[dim]—[/dim]" for e in engines.values()]
        table.add_row(f"  {m.label}", m.unit, *cells, *(_fmt_ratio(ratios[label].get(m.key)) for label in ratios))
    return table


def notes(report: dict[str, Any]) -> list[str]:
    """Lines printed under the table: how each engine ran, what was skipped and why."""
    s = report["settings"]
    lines = [f"model {report['model']['path']}; {report['threads']} threads"
             + ("; --quick" if s.get("quick") else ""),
             f"decode: {s['decode_tokens']} new tokens, timed from the first token to the last; prefill: time to "
             f"first token of a {s['prefill_tokens']}-token prompt, median of {s['prefill_repeats']}",
             f"concurrency N: N requests submitted at once, {s['max_tokens']} new tokens each; throughput = all "
             f"output tokens / wall time; decode = output tokens per second while all N decode (from the last first "
             f"token to the first finish, no prefill in it); TTFT = time to first token, TPOT = time per output "
             f"token after the first",
             "all engines decode greedily past EOS from the same token ids",
             "load time: the engine's model load in its worker, after its libraries are imported; peak RSS: "
             "the worker's high-water mark over load and every suite; serve start: `loom serve` from "
             "process launch (imports included) to the first ready /health"]
    if "parallel" in s.get("suites", ()):
        lines.append(f"parallel sampling: one {s['parallel_prompt_tokens']}-token prompt, n sampled completions of "
                     f"{s['parallel_max_tokens']} tokens; fork = one request with n (prompt prefilled once, blocks "
                     f"shared), independent = n requests without prefix caching, prefix_cache = n requests with it")
    if "parallel_quality" in s.get("suites", ()) and s.get("quality_limit"):
        lines.append(f"GSM8K: {s['quality_limit']} fixed train problems; k={s['quality_k']}, m={s['quality_m']}, "
                     f"at most {s['quality_max_tokens']} tokens per answer; the three sampled methods share one "
                     f"set of k samples per problem; tokens / problem: every sample's tokens, for short-m@k "
                     f"only those generated until the m-th sample finished")
    lines += report["workload"]["notes"]
    for label, entry in report["engines"].items():
        if entry["status"] == "ok":
            lines += [f"{label}: {n}" for n in entry.get("notes", [])]
            if entry.get("serve_start_error"):
                lines.append(f"{label}: serve start not measured ({entry['serve_start_error']})")
        else:
            hint = f"; {entry['hint']}" if entry.get("hint") else ""
            lines.append(f"{label}: {entry['status']} ({entry['reason']}{hint})")
    return lines


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print(build_table(report))
    for line in notes(report):
        console.print(f"[dim]•[/dim] {escape(line)}", soft_wrap=True)


def write_json(report: dict[str, Any], path: Path) -> None:
    write_output(path, json.dumps(report, indent=2) + "\n")


def write_output(path: Path, text: str) -> None:
    """A report file written whole or not at all (a temporary file beside it, renamed; a path
    that is no regular file, such as a pipe or /dev/stdout, is written to as it is); a failure
    (a full disk, a path under /proc) is one BenchError line after the figures."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file() and not path.is_dir():
            path.write_text(text, encoding="utf-8")
            return
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror or e}") from None
