"""The positions of a sequence's kept KV entries, as runs.

After eviction a sequence's KV list holds the kept entries in position order: a few runs of
consecutive positions (StreamingLLM: the sink block, then the recent blocks; SnapKV: the sinks,
the selected entries, the window and what was generated since). `KVRuns` lists where each run
starts, as (KV index, position) pairs; entries after a run's start follow on one position each.
The empty tuple is a list with nothing evicted (entry i at position i).

    kv index   0 1 2 3 | 4  5  6  7        runs ((0, 0), (4, 40))
    position   0 1 2 3 | 40 41 42 43

New tokens go at the end of the list at the next positions, so they extend the last run: the
runs change only when entries are evicted. Attention needs the positions for sliding-window
layers, which see the entries within W positions of the query, not the last W entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KVRuns = tuple[tuple[int, int], ...]


def expand(runs: KVRuns, n: int) -> list[int]:
    """The positions of the first n entries of a list with these runs."""
    if not runs:
        return list(range(n))
    out: list[int] = []
    ends = [k for k, _ in runs[1:]] + [n]
    for (k, p), end in zip(runs, ends):
        end = min(end, n)
        out.extend(range(p, p + end - k))
    return out


def compress(positions: Sequence[int]) -> KVRuns:
    """The runs of ascending positions (empty when entry i is at position i throughout)."""
    runs = tuple((i, p) for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1)
    return () if runs in ((), ((0, 0),)) else runs


def kept_runs(runs: KVRuns, kv_len: int, keep: Sequence[int]) -> KVRuns:
    """The runs after the list of kv_len entries keeps only the entries at `keep` (ascending).
    The next entry appended is at the next position whatever was evicted, so it takes part:
    keeping the first entries [0, 1, 2, 3] of a list of 16 gives ((0, 0), (4, 16))."""
    pos = expand(runs, kv_len + 1)                  # with the position of the next entry
    return compress([pos[i] for i in keep] + [pos[kv_len]])


def positions_tensor(runs: KVRuns, n: int) -> torch.Tensor:
    """[n] int64: the positions of the first n entries, computed from the runs in torch."""
    idx = torch.arange(n)
    if not runs:
        return idx
    starts = torch.tensor([k for k, _ in runs], dtype=torch.int64)
    first = torch.tensor([p for _, p in runs], dtype=torch.int64)
    run = torch.searchsorted(starts, idx, right=True) - 1                 # [n] the run of each entry
    return first[run] + idx - starts[run]
