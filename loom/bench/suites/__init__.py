"""The measurements a worker can run. `BenchSettings.suites` names the ones a run takes, in order.

A new suite (speculative decoding for ``--spec``, parallel sampling for ``--parallel``) is a
`Suite` subclass in this package, registered in `ALL_SUITES`; the CLI flag then only appends its
name to `BenchSettings.suites`, and workers, progress and JSON pick it up from there.
"""

from __future__ import annotations

from typing import Sequence

from loom.bench.settings import BenchError, BenchSettings
from loom.bench.suites.base import Suite, SuiteContext
from loom.bench.suites.concurrency import ConcurrencySuite
from loom.bench.suites.parallel import ParallelCostSuite, ParallelQualitySuite
from loom.bench.suites.single import DecodeContextSuite, DecodeSuite, PrefillSuite

ALL_SUITES: dict[str, Suite] = {s.name: s for s in (DecodeSuite(), PrefillSuite(), ConcurrencySuite(),
                                                     ParallelCostSuite(), ParallelQualitySuite(),
                                                     DecodeContextSuite())}
PARALLEL_SUITES: tuple[str, ...] = ("parallel", "parallel_quality")
DEFAULT_SUITES: tuple[str, ...] = BenchSettings.suites


def select_suites(names: Sequence[str]) -> list[Suite]:
    """The suites called `names`, in that order; BenchError for an unknown name."""
    unknown = [n for n in names if n not in ALL_SUITES]
    if unknown:
        raise BenchError(f"unknown bench suite(s) {', '.join(unknown)} (known: {', '.join(ALL_SUITES)})")
    return [ALL_SUITES[n] for n in names]


__all__ = ["ALL_SUITES", "DEFAULT_SUITES", "PARALLEL_SUITES", "Suite", "SuiteContext", "select_suites"]
