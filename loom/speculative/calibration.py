"""The cost model's calibration: timed forward passes, cleaned of interference, cached per machine.

Points. A pass of B sequences at a context of N tokens carrying X draft nodes in all is timed at
every (N, B, X) of a small grid (`Grid`): X = B * k with k nodes on every sequence, and, in a batch
of several, X = 1 (one sequence drafts one node). That first node costs more than each of the
next ones (SmolLM2 at 8 sequences, AVX-512: +1.0 ms on a 6.4 ms forward pass, then ~0.4 ms a
node), and without the point the controller's curve over X > 0 extended the segment between B
and 2B nodes down to X = 1, where it priced a single node at nothing. Each point is the fastest
of REPEATS passes, taken in REPEATS rounds over the whole grid rather than back to back: a burst
of interference (another process on a core for a second) then slows one pass of a point, not
all of them. Timed back to back, a burst once took all three passes of SmolLM2's plain 8-sequence
points (22 ms measured against 12 ms), so drafts there looked nearly free and the controller
drafted at a loss at 8 concurrent requests (Spec-Bench 0.93-0.97x in five categories) until the
cached calibration was thrown away. On a shared machine a point can still come out slow; the cost
of a pass never falls when N, B or X grows, so a point slower than one of its larger neighbours
is timed again (RETRIES rounds), and whatever still breaks the order is clipped to its
neighbours' cost:

    (N, B, X) <= (N, B, X'), (N, B', X B' / B), (N', B, X)     for X' > X, B' > B, N' > N

(one node among B sequences, X = 1, counts as one among B' as well: (N, B, 1) <= (N, B', 1)).

Cache. Timing the grid takes seconds, so the points are kept beside the packed weights
(loom/model/pack_cache.py), one JSON file per machine and model set-up:

    $LOOM_CACHE/costs/<sha256(key)[:24]>.json     {"key": {...}, "points": [[N, B, X, seconds], ...]}

The key names what the times depend on: the model (GGUF sha256, from the engine), linear
mode, KV dtype and block size, the kernel variant and the sources it was built from (a change
to the kernels times the grid again), the thread count, the CPU model, loom's version, the
file format and the grid. A file whose key differs or does not parse is ignored
and rewritten; an unwritable directory leaves loom calibrating at each start-up, said once.
``LOOM_COST_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from loom import kernels
from loom.contracts import ScheduledSeq
from loom.loader.cache import CacheWriteError, atomic_write, cache_root, loom_version

log = logging.getLogger("loom")

COST_FORMAT = 3                   # 3: points by total draft nodes, with one node alone (2: nodes per sequence)
BATCHES = (1, 2, 4, 8, 16)
DRAFTS = (0, 1, 2, 4, 8)          # draft nodes per sequence
CONTEXTS = (64, 1024)             # context lengths (tokens in the cache), shortest first
REPEATS = 3                       # rounds of passes over the grid; a point's fastest counts
RETRIES = 3                       # rounds of re-timing the points that break the order

Point = tuple[int, int, int]      # (context, batch, draft nodes in all)


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    drafts: tuple[int, ...]

    @classmethod
    def fitting(cls, context_length: int, max_num_seqs: int, max_drafts: int, num_blocks: int,
                block_size: int) -> "Grid":
        """The grid's points that fit the model's context, the batch and draft limits and the
        KV cache (the largest batch at the longest context must fit at once; a context one
        sequence cannot hold is left out, the shorter ones kept)."""
        ctxs = tuple(n for n in CONTEXTS if n + max(DRAFTS) + 1 <= context_length
                     and -(-(n + max(DRAFTS) + 1) // block_size) <= num_blocks)
        per_seq = -(-(max(ctxs, default=0) + max(DRAFTS) + 1) // block_size)
        batches = tuple(b for b in BATCHES if b <= max_num_seqs and b * per_seq <= num_blocks)
        return cls(ctxs, batches, tuple(k for k in DRAFTS if k <= max_drafts))

    def extras(self, batch: int) -> list[int]:
        """The draft node counts timed at `batch` sequences: k on every one, and one alone."""
        lone = [1] if batch > 1 and any(self.drafts) else []
        return sorted(set(lone) | {batch * k for k in self.drafts})

    def points(self) -> list[Point]:
        return [(n, b, x) for n in self.contexts for b in self.batches for x in self.extras(b)]

    def larger(self, p: Point) -> list[Point]:
        """The next point up along each axis: more nodes, more sequences (as many nodes each, or
        still one alone), a longer context."""
        n, b, x = p
        xs, i, j = self.extras(b), self.batches.index(b), self.contexts.index(n)
        out = []
        if xs.index(x) + 1 < len(xs):
            out.append((n, b, xs[xs.index(x) + 1]))
        if i + 1 < len(self.batches):
            b2 = self.batches[i + 1]
            out.append((n, b2, x if x == 1 and b > 1 else x // b * b2))
        if j + 1 < len(self.contexts):
            out.append((self.contexts[j + 1], b, x))
        return out


def measure(time_forward: Callable[[list[ScheduledSeq]], float], grid: Grid, vocab_size: int,
            block_size: int) -> dict[Point, float]:
    """Seconds of a pass at each grid point; the passes write into KV blocks 0.. (free ones)."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-(max(grid.contexts) + max(grid.drafts) + 1) // block_size)

    def seqs(p: Point) -> list[ScheduledSeq]:
        n, b, x = p
        nodes = [x // b + (i < x % b) for i in range(b)]   # chains, spread evenly from the first sequence
        return [ScheduledSeq(f"calibrate{i}", torch.randint(vocab_size, (1 + k,), generator=gen).tolist(), n,
                             list(range(i * per_seq, (i + 1) * per_seq)), True, tuple(range(-1, k - 1)))
                for i, k in enumerate(nodes)]

    points = grid.points()
    time_forward(seqs(points[0]))      # the first pass pays one-time costs
    times = {p: float("inf") for p in points}
    for _ in range(REPEATS):           # rounds over the grid (see the module doc)
        for p in points:
            times[p] = min(times[p], time_forward(seqs(p)))
    for _ in range(RETRIES):
        slow = {p for p in points for q in grid.larger(p) if times[p] > times[q]}
        if not slow:
            break
        for p in slow:
            times[p] = min(times[p], time_forward(seqs(p)))
    for p in reversed(points):          # larger points first: clip what still breaks the order
        times[p] = min([times[p]] + [times[q] for q in grid.larger(p)])
    return times


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(identity: dict, grid: Grid) -> dict:
    return identity | {"variant": kernels.variant(), "kernels": kernels.build_key(), "threads": torch.get_num_threads(),
                       "cpu": _cpu(), "loom": loom_version(), "format": COST_FORMAT, "grid": asdict(grid)}


def enabled() -> bool:
    return os.environ.get("LOOM_COST_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "costs" / f"{digest}.json"


def load(key: dict) -> dict[Point, float] | None:
    try:
        data = json.loads(_path(key).read_text())
        if data.get("key") != json.loads(json.dumps(key)):
            return None
        return {(int(n), int(b), int(x)): float(s) for n, b, x, s in data["points"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


_unwritable: set[str] = set()


def save(key: dict, times: dict[Point, float]) -> None:
    body = json.dumps({"key": key, "points": [[n, b, x, s] for (n, b, x), s in sorted(times.items())]})
    target = _path(key)
    try:
        atomic_write(target, lambda f: f.write(body.encode()))
    except CacheWriteError as e:
        if str(target.parent) not in _unwritable:
            _unwritable.add(str(target.parent))
            log.warning("speculative cost calibration not cached (%s); it is timed again at each start-up", e)


def calibrated(time_forward: Callable[[list[ScheduledSeq]], float], grid: Grid, identity: dict,
               vocab_size: int, block_size: int) -> dict[Point, float]:
    """The grid's times: from the cache when it holds this machine's and model's, else timed
    (and cached)."""
    if not grid.points():
        return {}
    key = cache_key(identity, grid)
    times = load(key) if enabled() else None
    if times is not None and set(times) == set(grid.points()):
        return times
    times = measure(time_forward, grid, vocab_size, block_size)
    if enabled():
        save(key, times)
    return times
