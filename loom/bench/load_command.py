"""``loom bench --server URL|start [--peers ...]``: turns the CLI flags into `LoadSettings`, runs the
ladder under a progress bar (against several servers in turn with --peers, see
`loom.bench.server_compare`) and prints, saves and plots the report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loom.bench.load import (AUTO, DEFAULT_MAX_TOKENS, DEFAULT_RATES, DEFAULT_REQUESTS, QUICK_RATES,
                             LoadSettings, parse_endpoint, parse_rates, run_load)
from loom.bench.load_report import print_report, write_plots
from loom.bench.report import write_output
from loom.bench.prompts import SPEC_BENCH_PATH
from loom.bench.server_compare import run_comparison, table, targets
from loom.bench.server_compare import write_plots as compare_plots
from loom.bench.settings import BenchError
from loom.config import physical_cores
from loom.loader.registry import resolve_model

QUICK_REQUESTS = 4
QUICK_MAX_TOKENS = 16


COLUMNS = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def load_plans(url: str, *, model: str | None, rates: str | None, num_requests: Sequence[int] | None,
               duration: float | None, max_tokens: int | None, quick: bool,
               prompts: Path | None, endpoint: str = AUTO, ignore_eos: bool = False,
               max_concurrency: int | None = None, temperature: float = 0.0,
               top_p: float = 1.0, model_required: bool = False,
               model_aliases: tuple[str, ...] = ()) -> list[LoadSettings]:
    """One `LoadSettings` per request count (one for --duration); `endpoint` as --endpoint takes it."""
    counts: Sequence[int | None] = ((None,) if duration is not None else
                                    num_requests or ((QUICK_REQUESTS if quick else DEFAULT_REQUESTS),))
    return [LoadSettings(url=url, model=model, model_required=model_required, model_aliases=model_aliases,
                         rates=parse_rates(rates) if rates is not None else (QUICK_RATES if quick else DEFAULT_RATES),
                         num_requests=n, duration=duration,
                         max_tokens=max_tokens or (QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS),
                         prompts_path=prompts or SPEC_BENCH_PATH, endpoint=parse_endpoint(endpoint),
                         ignore_eos=ignore_eos, max_concurrency=max_concurrency, temperature=temperature,
                         top_p=top_p)
            for n in counts]


def _save(report: dict, json_path: Path | None) -> None:
    """The report so far, after each server's run: marked incomplete until `_write_json` writes
    the whole one (a run that fails or is stopped keeps what it measured, said in the file)."""
    if json_path is not None:
        write_output(json_path, json.dumps({**report, "complete": False}, indent=2) + "\n")


def _write_json(report: dict, json_path: Path | None, out: Console) -> None:
    if json_path is not None:
        write_output(json_path, json.dumps({**report, "complete": True}, indent=2) + "\n")
        out.print(f"report written to {escape(str(json_path))}")


def run_load_command(url: str, *, model: str | None, rates: str | None, num_requests: Sequence[int] | None,
                     duration: float | None, max_tokens: int | None, quick: bool, prompts: Path | None,
                     json_path: Path | None, plot: Path | None, out: Console, err: Console,
                     peers: str | None = None, rounds: int = 1, threads: int | None = None,
                     endpoint: str = AUTO, ignore_eos: bool = False, max_concurrency: int | None = None,
                     temperature: float = 0.0, top_p: float = 1.0, model_given: bool = False) -> None:
    """`loom bench --server`; `model_given`: --model was on the command line, so a server at a URL
    that does not serve it is an error (else its first model is load-tested)."""
    if num_requests is not None and (not num_requests or min(num_requests) < 1):
        raise BenchError(f"--num-requests must be positive integers, got {','.join(map(str, num_requests))}")
    if num_requests is not None and duration is not None:
        raise BenchError("give --num-requests (requests per rate) or --duration (seconds per rate), not both")
    # beside --peers, a server at a URL must serve the peers' model (their ratios compare the two)
    beside_peers = url != "start" and bool(peers)
    aliases = (resolve_model(model).stem,) if beside_peers and model is not None else ()
    plans = load_plans(url, model=model, rates=rates, num_requests=num_requests, duration=duration,
                       max_tokens=max_tokens, quick=quick, prompts=prompts, endpoint=endpoint,
                       ignore_eos=ignore_eos, max_concurrency=max_concurrency, temperature=temperature,
                       top_p=top_p, model_required=url != "start" and (model_given or beside_peers),
                       model_aliases=aliases)
    if url != "start" and not peers and len(plans) == 1:
        with Progress(*COLUMNS, console=err, transient=True) as progress:
            report = run_load(plans[0], progress)
        print_report(report, out)
        _write_json(report, json_path, out)
        if plot is not None:
            for path in write_plots(report, plot):
                out.print(f"plot written to {escape(str(path))}")
        return
    _compare(url, plans, model, peers, rounds, threads, json_path, plot, out, err)


def _compare(url: str, plans: list[LoadSettings], model: str | None, peers: str | None, rounds: int,
             threads: int | None, json_path: Path | None, plot: Path | None, out: Console, err: Console) -> None:
    """The same plans against the server at `url` and/or the started --peers, interleaved."""
    columns = targets(url, peers)
    gguf = resolve_model(model) if model and any(t.kind for t in columns) else None
    threads = threads or physical_cores()
    saved = []

    def save(partial: dict) -> None:
        _save(partial, json_path)
        saved.append(True)

    try:
        with Progress(*COLUMNS, console=err, transient=True) as progress:
            report = run_comparison(columns, plans, gguf, threads, rounds,
                                    load=lambda s, **kw: run_load(s, progress, **kw),
                                    log=lambda m: progress.console.print(escape(m)), on_run=save)
    except BaseException:
        if json_path is not None and saved:
            err.print(f"the runs so far are kept in {escape(str(json_path))} (marked \"complete\": false)")
        raise
    header, rows = table(report)
    sampled = (f", temperature {plans[0].temperature:g}"
               + (f", top_p {plans[0].top_p:g}" if plans[0].top_p < 1 else "")) if plans[0].temperature else ", greedy"
    grid = Table(title=f"loom bench --server: {len(columns)} servers, {rounds} round(s), {threads} threads, "
                       f"{report['endpoint']} endpoint{sampled}, medians",
                 title_justify="left")
    for i, name in enumerate(header):
        grid.add_column(name, justify="left" if i < 3 else "right")
    for row in rows:
        grid.add_row(*row)
    out.print(grid)
    for t in report["targets"]:
        out.print(f"• {escape(t['label'])}: {escape(t['about'])}")
    _write_json(report, json_path, out)
    if plot is not None:
        for path in compare_plots(report, plot):
            out.print(f"plot written to {escape(str(path))}")
