"""What a suite is: a named measurement that a worker runs against one loaded peer.

A suite declares its progress steps up front (so the harness can size the progress bar before
any worker starts) and returns a JSON-able dict that becomes ``result[suite.name]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from loom.bench.peers.base import Peer
from loom.bench.settings import BenchSettings, Workload


@dataclass
class SuiteContext:
    """Everything a suite may use. `step(label)` wraps one progress step (reported to the harness)."""

    peer: Peer
    workload: Workload
    settings: BenchSettings
    step: Callable[[str], AbstractContextManager[None]]


class Suite(ABC):
    name: str

    @abstractmethod
    def steps(self, settings: BenchSettings) -> list[str]:
        """Labels of the progress steps `run` will take, in order."""

    @abstractmethod
    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        """Measure; raise to fail the engine (the worker reports the error)."""
