"""Retrieval drafting's datastore and the cost model's cached calibration (no model: milliseconds).

  1. Datastore: longest-match look-up over a corpus and recent outputs, the trie merge,
     bounded memory (recent outputs evicted; a corpus over the limit refused, naming it),
     one-line errors for missing or unreadable corpora, concurrent use.
  2. Calibration: slow outliers re-timed or clipped to the order of the grid; the points
     cached per key and reused without timing.
"""

from __future__ import annotations

import json
import threading

import pytest

from loom.config import SpeculativeConfig
from loom.errors import InvalidRequestError
from loom.speculative import calibration
from loom.speculative.calibration import Grid, calibrated, measure
from loom.speculative.datastore import Datastore
from loom.speculative.drafters.retrieval import merge


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per word (its small integer code)."""
    return [sum(map(ord, w)) % 997 for w in text.split()]


# =============================================================================================
# 1. Datastore
# =============================================================================================


def test_the_longest_tail_match_wins_and_its_continuations_come_latest_first(tmp_path):
    (tmp_path / "a.txt").write_text("x a b c d e f . y b c g h")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "q a b c z z"}) + "\n")
    ds = Datastore(1, 4, 64, 0)
    ds.load(str(tmp_path), words)
    # tail "a b c" (n = 3) is in both documents; "b c" alone would also match "b c g h"
    conts = ds.continuations(words("w a b c"), 3)
    assert sorted(conts) == sorted([words("d e f"), words("z z")])
    # no n-gram crosses a document boundary: the continuation of "e f ." stops at its end
    assert ds.continuations(words("y"), 8) == [words("b c g h")]
    assert ds.continuations(words("nothing here"), 3) == []


def test_merge_keeps_the_most_shared_nodes_and_parents_first():
    tree = merge([[1, 2, 3], [1, 2, 4], [1, 5], [6]], 4)
    assert tree.tokens == (1, 6, 2, 5) or tree.tokens == (1, 2, 6, 5) or set(tree.tokens) == {1, 2, 5, 6}
    for node, parent in enumerate(tree.parents):
        assert parent < node
    # 1 (three continuations) and 2 (two) first
    assert tree.tokens[:1] == (1,) and 2 in tree.tokens
    assert merge([], 4) is None
    assert len(merge([[1, 2, 3, 4, 5]], 3)) == 3


def test_recent_outputs_are_searched_and_the_oldest_leave_first():
    ds = Datastore(2, 3, 64, recent_tokens=20)
    ds.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert ds.continuations([0, 2, 3], 3) == [[4, 5, 6]]
    for start in (100, 200, 300):     # 30 more tokens push the first output out
        ds.add(list(range(start, start + 10)))
    assert ds.recent_size <= 20
    assert ds.continuations([0, 2, 3], 3) == []
    assert ds.continuations([301, 302], 2) == [[303, 304]]
    assert len(ds.grams) <= 2 * 20 * 2     # stale entries rebuilt away


def test_missing_unreadable_and_too_big_datastores_are_refused_in_one_line(tmp_path):
    with pytest.raises(InvalidRequestError, match="no such file or directory"):
        SpeculativeConfig(method="retrieval", datastore=str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="methods 'retrieval' and 'auto'"):
        SpeculativeConfig(method="prompt_lookup", datastore=str(tmp_path))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \xff")
    with pytest.raises(InvalidRequestError, match="cannot read") as e:
        Datastore(1, 4, 64, 0).load(str(tmp_path), words)
    assert "\n" not in str(e.value)
    bad.unlink()
    for row in ('{"title": "no text"}', '{"text": 3}', "not json"):
        (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n' + row + "\n")
        with pytest.raises(InvalidRequestError, match="line 2"):
            Datastore(1, 4, 64, 0).load(str(tmp_path), words)
    (tmp_path / "rows.jsonl").unlink()
    (tmp_path / "big.txt").write_text("w " * 200_000)
    with pytest.raises(InvalidRequestError, match=r"datastore_max_mb=0\.5 MB"):
        Datastore(1, 4, 0.5, 0).load(str(tmp_path), words)
    with pytest.raises(InvalidRequestError, match="datastore_max_mb=1 MB"):
        Datastore(1, 4, 1, recent_tokens=10_000)     # the recent outputs' share alone is over it
    for value in (0, -1, "big", True):
        with pytest.raises(InvalidRequestError, match="datastore_max_mb"):
            SpeculativeConfig(method="retrieval", datastore_max_mb=value)
    with pytest.raises(InvalidRequestError, match="retrieval_min"):
        SpeculativeConfig(method="retrieval", retrieval_min=5, retrieval_max=2)


def test_concurrent_additions_and_lookups_stay_consistent():
    ds = Datastore(2, 4, 64, recent_tokens=500)
    errors = []

    def writer(base: int):
        try:
            for i in range(200):
                ds.add([base, base + 1, base + 2, i % 7, i % 5, base + 3])
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    def reader():
        try:
            for i in range(2000):
                for cont in ds.continuations([9, 1000, 1001], 3):
                    assert cont[0] == 1002
        except Exception as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(base,)) for base in (1000, 2000)] + \
        [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert ds.recent_size <= 500
    ds.add([1000, 1001, 1002, 7])
    assert ds.continuations([9, 1000, 1001], 3)[0] == [1002, 7]


# =============================================================================================
# 2. Calibration
# =============================================================================================

GRID = Grid(contexts=(64, 1024), batches=(1, 2, 4), drafts=(0, 2, 4))


def true_cost(n: int, b: int, x: int) -> float:
    """Seconds of a pass of b sequences carrying x draft nodes in all at a context of n."""
    return 0.010 + 0.001 * (b + x) + 0.000002 * n * b + (0.0005 if x else 0.0)


def point_of(seqs) -> tuple[int, int, int]:
    return seqs[0].start_pos, len(seqs), sum(len(s.token_ids) - 1 for s in seqs)


class Timer:
    """A fake forward pass: the true cost, but the first `slow` passes at each point 50x slower."""

    def __init__(self, slow: dict[tuple[int, int, int], int]):
        self.slow, self.calls = dict(slow), 0

    def __call__(self, seqs) -> float:
        self.calls += 1
        p = point_of(seqs)
        assert all(list(s.draft_parents) == list(range(-1, len(s.token_ids) - 2)) for s in seqs)   # chains
        cost = true_cost(*p)
        if self.slow.get(p, 0) > 0:
            self.slow[p] -= 1
            return 50 * cost
        return cost


def test_the_grid_times_k_nodes_on_every_sequence_and_one_node_alone():
    assert [x for n, b, x in GRID.points() if (n, b) == (64, 1)] == [0, 2, 4]
    assert [x for n, b, x in GRID.points() if (n, b) == (64, 4)] == [0, 1, 8, 16]
    assert GRID.larger((64, 2, 1)) == [(64, 2, 4), (64, 4, 1), (1024, 2, 1)]
    assert GRID.larger((64, 2, 4)) == [(64, 2, 8), (64, 4, 8), (1024, 2, 4)]
    seen = []
    measure(lambda seqs: seen.append(point_of(seqs)) or 0.01, GRID, vocab_size=50, block_size=16)
    assert set(seen) == set(GRID.points())


def test_slow_points_are_timed_again_or_clipped_to_the_grid_order():
    # (64, 2, 4) is slow for 3 passes (REPEATS): re-timed; (1024, 4, 0) slow for ever: clipped
    times = measure(Timer({(64, 2, 4): 3, (1024, 4, 0): 10 ** 6}), GRID, vocab_size=50, block_size=16)
    assert times[(64, 2, 4)] == pytest.approx(true_cost(64, 2, 4))
    assert times[(1024, 4, 0)] <= times[(1024, 4, 1)]
    for p in GRID.points():
        for q in GRID.larger(p):
            assert times[p] <= times[q]
        if p != (1024, 4, 0):
            assert times[p] == pytest.approx(true_cost(*p))


class Burst:
    """A fake forward pass: the true cost, but calls first .. first + length - 1 (a burst of
    interference, whatever point they time) 1.4x slower: too little to break the grid's order."""

    def __init__(self, first: int, length: int):
        self.first, self.length, self.calls = first, length, 0

    def __call__(self, seqs) -> float:
        self.calls += 1
        slow = self.first <= self.calls < self.first + self.length
        return true_cost(*point_of(seqs)) * (1.4 if slow else 1)


@pytest.mark.parametrize("first", [2, 7, 20])
def test_a_burst_of_interference_spoils_no_point(first):
    """The passes go in rounds over the grid: a burst shorter than a round slows at most one
    pass of each point, and the fastest of the others counts (back to back, a burst of three
    passes took a point's every repeat)."""
    times = measure(Burst(first, len(GRID.points()) - 1), GRID, vocab_size=50, block_size=16)
    for p in GRID.points():
        assert times[p] == pytest.approx(true_cost(*p))


def test_calibration_is_cached_per_key_and_reused_without_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration.kernels, "variant", lambda: "avx2")   # no kernel build in an empty cache
    monkeypatch.setattr(calibration.kernels, "build_key", lambda: "kernels-1")
    identity = {"model": "abc", "linear": "exact", "kv_dtype": "float32", "block_size": 16}
    first = Timer({})
    times = calibrated(first, GRID, identity, 50, 16)
    assert first.calls > len(GRID.points()) and list((tmp_path / "costs").glob("*.json"))
    again = Timer({})
    assert calibrated(again, GRID, identity, 50, 16) == times and again.calls == 0
    other = Timer({})      # another model: timed afresh
    calibrated(other, GRID, identity | {"model": "def"}, 50, 16)
    assert other.calls > 0
    monkeypatch.setattr(calibration.kernels, "build_key", lambda: "kernels-2")
    rebuilt = Timer({})    # the same model on kernels built from other sources: timed afresh
    calibrated(rebuilt, GRID, identity, 50, 16)
    assert rebuilt.calls > 0
    monkeypatch.setattr(calibration.kernels, "build_key", lambda: "kernels-1")
    for f in (tmp_path / "costs").glob("*.json"):
        f.write_text("{not json")
    broken = Timer({})     # a damaged file is timed again and rewritten
    assert calibrated(broken, GRID, identity, 50, 16) == times and broken.calls > 0
    monkeypatch.setenv("LOOM_COST_CACHE", "0")
    off = Timer({})
    calibrated(off, GRID, identity, 50, 16)
    assert off.calls > 0 and calibration.enabled() is False
