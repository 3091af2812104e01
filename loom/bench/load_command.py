"""``loom bench --server URL``: turns the CLI flags into `LoadSettings`, runs the ladder under a
progress bar and prints, saves and plots the report."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loom.bench.load import (DEFAULT_MAX_TOKENS, DEFAULT_RATES, DEFAULT_REQUESTS, QUICK_RATES, LoadSettings,
                             parse_rates, run_load)
from loom.bench.load_report import print_report, write_plots
from loom.bench.prompts import SPEC_BENCH_PATH

QUICK_REQUESTS = 4
QUICK_MAX_TOKENS = 16


def run_load_command(url: str, *, model: str | None, rates: str | None, num_requests: int | None,
                     duration: float | None, max_tokens: int | None, quick: bool, prompts: Path | None,
                     json_path: Path | None, plot: Path | None, out: Console, err: Console) -> None:
    settings = LoadSettings(
        url=url, model=model,
        rates=parse_rates(rates) if rates is not None else (QUICK_RATES if quick else DEFAULT_RATES),
        num_requests=num_requests if num_requests is not None or duration is not None
        else (QUICK_REQUESTS if quick else DEFAULT_REQUESTS),
        duration=duration, max_tokens=max_tokens or (QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS),
        prompts_path=prompts or SPEC_BENCH_PATH)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        report = run_load(settings, progress)
    print_report(report, out)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        out.print(f"report written to {escape(str(json_path))}")
    if plot is not None:
        for path in write_plots(report, plot):
            out.print(f"plot written to {escape(str(path))}")
