"""Concurrency sweep: N requests submitted at once, each generating `max_tokens` past EOS.

Per level: aggregate output throughput (all output tokens / wall time from submission to the
last finish), aggregate decode throughput (output tokens per second while all N requests decode:
from the last request's first token to the first request's last, so without the prompts'
prefill; the levels' prompt sets differ in length) and the p50/p99 of per-request TTFT and time
per output token.
"""

from __future__ import annotations

from typing import Any

from loom.bench.settings import BenchSettings
from loom.bench.stats import percentile
from loom.bench.suites.base import Suite, SuiteContext

PERCENTILES = (50, 99)


def _ms(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) * 1e3 for q in PERCENTILES}


class ConcurrencySuite(Suite):
    name = "concurrency"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"concurrency {n}" for n in settings.concurrency]

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        limit = ctx.peer.max_concurrency()
        levels: dict[str, Any] = {}
        for n, label in zip(ctx.settings.concurrency, self.steps(ctx.settings)):
            with ctx.step(label):
                if limit is not None and n > limit:
                    continue
                run = ctx.peer.generate(ctx.workload.batch(n), ctx.settings.max_tokens)
            tpots = [r.tpot for r in run.requests if r.tpot is not None]
            levels[str(n)] = {
                "requests": n,
                "output_tokens": run.output_tokens,
                "wall_seconds": run.wall_seconds,
                "throughput_tok_s": run.output_tokens / run.wall_seconds,
                "decode_tok_s": run.decode_throughput(),
                "ttft_ms": _ms([r.ttft for r in run.requests]),
                "tpot_ms": _ms(tpots) if tpots else None,
            }
        return levels
