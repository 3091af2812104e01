"""How many draft nodes each sequence gets next step: measured gain against measured cost.

Cost. `CostModel` holds the measured seconds of one forward pass as a function of the
batch: B sequences decoding or verifying, carrying X draft tokens in all. It starts from a
calibration (timed forward passes of the runner at a few (B, X) points and two context
lengths, made before any request exists) and keeps learning from every step without
prefill chunks (an average per observed (B, X)). Between points it interpolates linearly;
X = 0 is its own point, since an all-decode batch may take a faster path than one with
drafts, and the calibration times X = 1 in every batch, since the first node costs more than
each further one. The calibration's ratio cost(B, X) / cost(B, 0), at the batch's mean context
length, is a floor under the learned one (see `CostModel`): a draft row attends over its
whole context, so drafts cost more, relative to plain decoding, in long contexts.

Gain. Each sequence has a per-depth acceptance rate `a` per draft source (accepted nodes /
tried depths, decayed over recent steps), starting from the average over all sequences of
that source, which starts from the average over every source. A tree of k nodes reaching
depth D(k) is expected to add sum_{d=1..D(k)} a^d tokens. The source is what the tree was
drafted from (`DraftTree.source`: prompt lookup names its match length), known before the
plan where the drafter proposes first: a sequence whose tail has just matched a 4-gram of
its context drafts long, the same sequence guessing from Token Recycling a step later
drafts little or nothing (SmolLM2 over Spec-Bench: 0.85 against 0.36 per depth). A
sequence that brings its own draft source (a predicted output) starts from PREDICTION_RATE
instead, and its steps stay out of the averages the others start from.

Choice. Increments (one more depth for one sequence, the one that gains the most per
node first) are taken in order; the step's objective is tokens per second,

    (B + expected accepted) / (cost(B, X) + drafting seconds per node * X
                               + overhead seconds per drafting sequence * S),

where the overhead (verification, learning from the logits, proposing: Python work outside
the forward pass) is measured as it runs. The prefix of increments that maximises it wins,
if it beats plain decoding by MARGIN (estimates are noisy; a wrong guess must not cost: in a
batch the drafts granted were accepted ~15-25% less than their rates promised, the plan
granting the drafts rated highest, and the cost of one more node is less sure; 8 SmolLM2
streams, 8 categories x 2 in one process: 10% gave 0.991 of plain decoding where 5% gave
0.980, translation 1.48x where 5% gave 1.52x); a lone sequence's by LONE_MARGIN, none: at one
stream the calibration predicts a drafting step's cost within ~4%, and in one-process A/Bs
over Spec-Bench's 13 categories a 2% margin gained 0.5% and 1.0% over 5%, no margin 0.6%
and 0.8% over 2%.
When drafts do not pay (a large batch, low acceptance, a slow drafter) that prefix is empty
and the step runs plain decoding. A sequence left without drafts is offered a one-node
probe every PROBE_EVERY x batch steps (more where one node costs more than a sequence's share
of a step) so that its estimate can recover; one sequence per step at most, so that requests
that started together do not all probe in the same step. After a plan without
drafts the next IDLE_REPLAN - 1 steps of that batch size skip the search (probes still run),
twice as many after each further plan without drafts, up to IDLE_MAX - 1: where drafting does
not pay, the search is most of speculation's cost. The decoder may wake them early (`pays`):
a lone sequence whose drafter names a source that would pay now (a fresh prompt-lookup match)
plans in full at once. It may also settle a plan without proposing (`decline`): in a batch, a
plan that the best sources the drafter could name would not make pay drafts nothing.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

DECAY = 0.8            # weight of the older acceptance evidence per step
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 2.0
PREDICTION_RATE = 0.8  # the starting rate of a sequence drafting from its predicted output
PROBE_EVERY = 16
PATIENCE = 8           # increments without a better objective (at least; one per sequence) before the search stops
IDLE_REPLAN = 4        # after a plan without drafts, the next full plan at that batch size is 4 steps on
IDLE_MAX = 32          # ... 8, 16, then 32 steps on while the plans keep drafting nothing
MARGIN = 0.10          # drafting must promise this much more speed than plain decoding
LONE_MARGIN = 0.0      # ... for a lone sequence, whose costs the calibration predicts within ~4%: none
COST_EMA = 0.2
CONTEXT_BUCKET = 64   # contexts this close share a memoised cost
MEMO_REFRESH = 16     # observed steps between recomputations of the memoised costs
PAYS_MEMO = 4096      # memoised answers of pays() kept at most
PAYS_REFRESH = 16     # refreshes of the memoised costs an answer of pays() outlives


class _Curve:
    """Seconds of a forward pass over (B, X) points, interpolated between them."""

    def __init__(self):
        self.rows: dict[int, dict[int, float]] = {}   # B -> {X: seconds}
        self._usable: dict[bool, dict[int, dict[int, float]]] = {}   # cache of the rows estimate may use

    def put(self, batch: int, extra: int, seconds: float, ema: float = 1.0) -> None:
        self._usable.clear()
        row = self.rows.setdefault(batch, {})
        old = row.get(extra)
        row[extra] = seconds if old is None else (1 - ema) * old + ema * seconds

    @staticmethod
    def _along(row: dict[int, float], extra: int) -> float:
        """Row cost at `extra`: piecewise linear over its X > 0 points, extended by the
        nearest segment (by the line from X = 0 when it has one such point)."""
        if extra == 0:
            return row[0]
        xs = sorted(x for x in row if x > 0)
        if len(xs) == 1:
            x1 = xs[0]
            return row[x1] + (row[x1] - row[0]) / x1 * (extra - x1)
        i = min(max(bisect.bisect_left(xs, extra), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        return row[x0] + (row[x1] - row[x0]) * (extra - x0) / (x1 - x0)

    def estimate(self, batch: int, extra: int) -> float | None:
        usable = self._usable.get(extra == 0)
        if usable is None:
            usable = self._usable[extra == 0] = {
                b: r for b, r in self.rows.items() if 0 in r and (extra == 0 or len(r) > 1)}
        if not usable:
            return None
        if batch in usable:
            return max(self._along(usable[batch], extra), 0.0)
        bs = sorted(usable)
        i = bisect.bisect_left(bs, batch)
        if i == 0 or i == len(bs):   # outside the measured batches: scale the nearest in proportion
            b = bs[0] if i == 0 else bs[-1]
            return max(self._along(usable[b], round(extra * b / batch)), 0.0) * batch / b
        b0, b1 = bs[i - 1], bs[i]
        c0, c1 = self._along(usable[b0], extra), self._along(usable[b1], extra)
        return max(c0 + (c1 - c0) * (batch - b0) / (b1 - b0), 0.0)


class CostModel:
    """Learned step costs, kept from drifting below the calibration's shape.

    Observed steps are few at each X > 0 and are compared with an X = 0 average taken at
    other moments; on a machine whose speed drifts that comparison can make drafts look
    free. The calibration's points were timed together, so their ratio cost(B, X) / cost(B, 0)
    is trusted as a floor: a draft never looks cheaper, relative to plain decoding, than it
    was measured to be. The calibration is timed at a few context lengths; the ratio at the
    batch's context comes from costs interpolated linearly in the context (attention, the
    part that grows with it, is linear in it), extended past the longest one measured."""

    def __init__(self):
        self.learned = _Curve()
        self.calib: dict[int, _Curve] = {}          # context length -> calibrated curve
        self._memo: dict[tuple[int, int, int], float] = {}   # cost(), until a new point or MEMO_REFRESH steps
        self._observed = 0
        self.stamp = 0          # bumped whenever the memoised costs are dropped

    @property
    def rows(self) -> dict[int, dict[int, float]]:
        return self.learned.rows

    def _forget(self) -> None:
        self._memo.clear()
        self.stamp += 1

    def calibrate(self, batch: int, extra: int, seconds: float, context: int = 0) -> None:
        self._forget()
        self.calib.setdefault(context, _Curve()).put(batch, extra, seconds)
        if context == min(self.calib):
            self.learned.put(batch, extra, seconds)

    def observe(self, batch: int, extra: int, seconds: float) -> None:
        """A timed step. Every step is observed, and the plan asks for costs every step: the
        memoised costs are recomputed when a new (B, X) point appears and every MEMO_REFRESH
        observations, not after each one (an average moving by COST_EMA per step changes a plan
        only over many steps; recomputing every step was most of a batch-1 plan's time)."""
        self._observed += 1
        if extra not in self.learned.rows.get(batch, {}) or self._observed >= MEMO_REFRESH:
            self._forget()
            self._observed = 0
        self.learned.put(batch, extra, seconds, COST_EMA)

    def cost(self, batch: int, extra: int, context: int = 0) -> float:
        """Estimated seconds of a forward pass of `batch` sequences carrying `extra` draft tokens,
        at a mean context of `context` tokens: never below the pass without drafts, never zero
        (noisy points can slope downwards)."""
        key = (batch, extra, context // CONTEXT_BUCKET)
        c = self._memo.get(key)
        if c is None:
            c = self._memo[key] = self._cost(batch, extra, context)
        return c

    def _cost(self, batch: int, extra: int, context: int) -> float:
        base = self._estimate(batch, 0)
        if not extra:
            return max(base, 1e-9)
        c = max(self._estimate(batch, extra), base)
        c0, cx = self._calibrated(batch, 0, context), self._calibrated(batch, extra, context)
        if c0 and cx:
            c = max(c, base * cx / c0)
        return max(c, 1e-9)

    def _calibrated(self, batch: int, extra: int, context: int) -> float | None:
        """The calibration's cost at `context`: linear between the two nearest context lengths
        measured (extended past the ends, never below the shortest context's cost)."""
        points = [(n, e) for n, curve in sorted(self.calib.items())
                  if (e := curve.estimate(batch, extra)) is not None]
        if len(points) < 2:
            return points[0][1] if points else None
        i = min(max(bisect.bisect_left([n for n, _ in points], context), 1), len(points) - 1)
        (n0, e0), (n1, e1) = points[i - 1], points[i]
        return max(e0 + (e1 - e0) * (context - n0) / (n1 - n0), points[0][1])

    def _estimate(self, batch: int, extra: int) -> float:
        c = self.learned.estimate(batch, extra)
        return 1.0 + extra if c is None else c   # unmeasured: every token costs alike


@dataclass
class _Rate:
    hits: float = 0.0
    tries: float = 0.0

    def add(self, accepted: int, tries: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.tries = DECAY * self.tries + tries

    def value(self, prior: float) -> float:
        return (self.hits + prior * PRIOR_WEIGHT) / (self.tries + PRIOR_WEIGHT)


class SpecController:
    def __init__(self, max_nodes: int, depth, adaptive: bool = True):
        """`depth(k)`: depth of the drafter's trees of k nodes."""
        self.max_nodes, self._depth_of, self.adaptive = max_nodes, depth, adaptive
        self._depths: dict[int, int] = {}
        self._idle_plans: dict[int, int] = {}   # batch -> plans left to skip after one that drafted nothing
        self._idle_streak: dict[int, int] = {}  # batch -> full plans in a row that drafted nothing
        self.cost = CostModel()
        self.rates: dict[str, dict[str | None, _Rate]] = {}   # request -> source -> its rate
        self.clock = 0                                         # plans made or skipped, every batch size
        self.drafted_at: dict[str, int] = {}                   # request -> the clock when it last drafted (or came)
        self._probe_check = (0, 0)                             # (batch, clock): no probe is due before it
        self._pays: dict[tuple, bool] = {}                     # memoised pays(), until the next verdict
        self.predicting: set[str] = set()                      # requests drafting from a predicted output
        self.total = _Rate()                                   # every source's, every sequence's
        self.verdicts = 0                                      # verdicts recorded (rates changed)
        self.totals: dict[str | None, _Rate] = {}              # per source, every sequence's

    def depth(self, size: int) -> int:
        d = self._depths.get(size)
        if d is None:
            d = self._depths[size] = self._depth_of(size)
        return d

    def rate(self, req_id: str, source: str | None = None) -> float:
        """The per-depth acceptance rate of `req_id`'s next tree drafted from `source`."""
        if req_id in self.predicting:
            prior = PREDICTION_RATE
        else:
            prior = self.total.value(PRIOR_RATE)
            if source in self.totals:
                prior = self.totals[source].value(prior)
        own = self.rates.get(req_id, {}).get(source)
        return prior if own is None else own.value(prior)

    def predicted(self, req_id: str) -> None:
        """The sequence drafts from its own predicted output: its rate starts from
        PREDICTION_RATE, and its steps stay out of the average other sequences start from."""
        self.predicting.add(req_id)

    def record(self, req_id: str, accepted: int, max_depth: int, source: str | None = None) -> None:
        """A verified tree of depth `max_depth`, drafted from `source`, gave `accepted` nodes."""
        tries = accepted + (1 if accepted < max_depth else 0)
        self._pays.clear()
        self.verdicts += 1
        own = self.rates.setdefault(req_id, {})
        if source not in own:
            own[source] = _Rate()
        own[source].add(accepted, tries)
        if req_id not in self.predicting:
            if source not in self.totals:
                self.totals[source] = _Rate()
            for r in (self.totals[source], self.total):
                r.add(accepted, tries)

    def finish(self, req_id: str) -> None:
        self.rates.pop(req_id, None)
        self.drafted_at.pop(req_id, None)
        self.predicting.discard(req_id)

    def wake(self, batch: int) -> None:
        """The next plan at this batch size searches, whatever the last ones found."""
        self._idle_plans[batch] = 0

    def idle(self, batch: int) -> bool:
        """Whether the next plan at this batch size skips its search (the last drafted nothing)."""
        return self.adaptive and self._idle_plans.get(batch, 0) > 0

    def plan(self, req_ids: list[str], batch: int, caps: list[int], draft_cost: float,
             seq_overhead: float = 0.0, context: int = 0, sources: list[str | None] | None = None,
             depths: list[list[int] | None] | None = None) -> list[int]:
        """Nodes per sequence (0: no draft) for a next step of `batch` sequences in all;
        `caps[i]` bounds sequence i. `draft_cost`: seconds of drafting per node;
        `seq_overhead`: seconds outside the forward pass per drafting sequence (verification,
        learning, proposing); `context`: the batch's mean context length in tokens;
        `sources[i]`: what sequence i's tree comes from (None: not known); `depths[i][k - 1]`:
        the depth of the first k nodes of its tree (None: `depth(k)`, the drafter's shape)."""
        if not self.adaptive:
            return list(caps)
        if self.idle(batch):    # drafting did not pay at this batch just now
            self._idle_plans[batch] -= 1
            return self._probe(req_ids, [0] * len(req_ids), caps, batch, context)
        shapes = [self.depth if not depths or depths[i] is None else (lambda k, p=depths[i]: p[k - 1])
                  for i in range(len(req_ids))]
        rates = [self.rate(rid, sources[i] if sources else None) for i, rid in enumerate(req_ids)]
        sizes = self._search(caps, rates, shapes, batch, draft_cost, seq_overhead, context)
        return self._settle(req_ids, sizes, caps, batch, context)

    def decline(self, req_ids: list[str], batch: int, caps: list[int], context: int = 0) -> list[int]:
        """A plan settled without its search, as one that drafted nothing (the decoder found no
        source that would pay): the sizes of the probes due (ones and zeros)."""
        return self._settle(req_ids, [0] * len(req_ids), caps, batch, context)

    def _settle(self, req_ids: list[str], sizes: list[int], caps: list[int], batch: int, context: int) -> list[int]:
        """Counts a plan's outcome in the skips of the plans after it; adds the probes due."""
        streak = 0 if any(sizes) else self._idle_streak.get(batch, 0) + 1
        self._idle_streak[batch] = streak
        self._idle_plans[batch] = min(IDLE_REPLAN << (streak - 1), IDLE_MAX) - 1 if streak else 0
        return self._probe(req_ids, sizes, caps, batch, context)

    def pays(self, req_ids: list[str], sources: list[str | None], batch: int, draft_cost: float,
             seq_overhead: float = 0.0, context: int = 0) -> bool:
        """Whether drafting from `sources` (None: no draft) would pay for these sequences of a
        batch whose plans skip their search: a source the skip did not see (a sequence whose
        tail has just matched its context) wakes the plans."""
        if not any(sources):
            return False
        # asked on most steps of a batch that skips its search, with the same answer until a
        # verdict changes a rate (record() forgets the answers) or the costs move: memoised (the
        # costs' memo is refreshed every MEMO_REFRESH steps; an answer outlives PAYS_REFRESH of
        # those, and the measured overheads, which move every step, are read in steps of 10 us:
        # truncated, as round(x, 5) formats the float, 3x the key's time in the step)
        key = (tuple(req_ids), tuple(sources), batch, context // CONTEXT_BUCKET, int(draft_cost * 1e5),
               int(seq_overhead * 1e5), self.cost.stamp // PAYS_REFRESH)
        found = self._pays.get(key)
        if found is None:
            if len(self._pays) > PAYS_MEMO:
                self._pays.clear()
            caps = [self.max_nodes if src is not None else 0 for src in sources]
            rates = [self.rate(rid, src) for rid, src in zip(req_ids, sources)]
            found = self._pays[key] = any(self._search(caps, rates, [self.depth] * len(caps), batch, draft_cost,
                                                       seq_overhead, context))
        return found

    def _search(self, caps: list[int], rates: list[float], shapes: list, batch: int, draft_cost: float,
                seq_overhead: float, context: int) -> list[int]:
        """The sizes that maximise tokens per second, sequence i at rate rates[i], its tree's
        depth shapes[i](k) at k nodes, at most caps[i] nodes (all zero: plain decoding pays best)."""
        heap = []
        for i, (a, cap, shape) in enumerate(zip(rates, caps, shapes)):
            self._push(heap, i, 0, a, cap, shape)
        sizes = [0] * len(caps)
        steps: list[tuple[int, int, float]] = []        # (sequence, new size, gain)
        plain = batch / self.cost.cost(batch, 0, context)
        margin = LONE_MARGIN if batch == 1 else MARGIN
        best, best_at, tokens, extra, misses = plain * (1 + margin), 0, float(batch), 0, 0
        drafting = 0
        # Increments come best gain per node first, so past its peak the objective only falls
        # (up to noise in the cost curve): the search stops `patience` increments past the best.
        patience = max(PATIENCE, len(caps))
        while heap and misses < patience:
            _, i, k, gain, a = heapq.heappop(heap)
            steps.append((i, k, gain))
            self._push(heap, i, k, a, caps[i], shapes[i])
            drafting += sizes[i] == 0
            extra += k - sizes[i]
            sizes[i] = k
            tokens += gain
            speed = tokens / (self.cost.cost(batch, extra, context) + draft_cost * extra + seq_overhead * drafting)
            if speed > best:
                best, best_at, misses = speed, len(steps), 0
            else:
                misses += 1
        sizes = [0] * len(caps)
        for i, k, _ in steps[:best_at]:
            sizes[i] = k
        return sizes

    def _push(self, heap, i: int, k: int, a: float, cap: int, depth) -> None:
        """The next increment of sequence i from k nodes: up to the size where its depth grows
        (`depth(n)`: the depth of its first n nodes)."""
        d = depth(k) if k else 0
        for k2 in range(k + 1, cap + 1):
            d2 = depth(k2)
            if d2 > d:
                gain = sum(a ** j for j in range(d + 1, d2 + 1))
                heapq.heappush(heap, (-gain / (k2 - k), i, k2, gain, a))
                return

    def _probe(self, req_ids: list[str], sizes: list[int], caps: list[int], batch: int, context: int = 0) -> list[int]:
        """Adds a one-node probe for the sequence idle longest, if it has been idle for
        `probe_every` steps (one a step: requests that came together probe in turn); counts
        the step on the clock."""
        clock, since = self.clock, self.drafted_at
        self.clock += 1
        oldest, due_at = -1, clock
        for i, rid in enumerate(req_ids):
            if sizes[i]:
                since[rid] = clock
            else:
                at = since.setdefault(rid, clock)
                if caps[i] and at < due_at:
                    oldest, due_at = i, at
        if oldest < 0:
            return sizes
        every = self.probe_every(batch, context)
        if clock - due_at + 1 >= every:     # its idle steps, this one included
            sizes[oldest] = 1
            since[req_ids[oldest]] = clock
        else:
            self._probe_check = (batch, due_at + math.ceil(every) - 1)
        return sizes

    def idle_step(self, batch: int, req_ids: list[str], context: int = 0) -> list[str]:
        """A step of a batch whose plan skips its search (`idle`): counts it against the skip and
        on the clock; returns the sequences due a one-node probe (one at most). Most such steps
        come before any probe can be due and touch no sequence."""
        self._idle_plans[batch] -= 1
        if self._probe_check[0] == batch and self.clock < self._probe_check[1]:
            self.clock += 1     # a request that came since is counted from the next full look
            return []
        n = len(req_ids)
        return [rid for rid, k in zip(req_ids, self._probe(req_ids, [0] * n, [1] * n, batch, context)) if k]

    def probe_every(self, batch: int, context: int = 0) -> float:
        """Idle steps between a sequence's probes: PROBE_EVERY x batch, so that probes cost about
        1/PROBE_EVERY of one sequence's share of the steps, stretched by what a one-node probe
        costs over that share. One more row can cost far more than a row's share: past a full
        register tile of rows (8 on AVX-512) it streams the weights again in a tile of its own,
        +40% of an 8-row SmolLM2 step where a row's share is 12%. The cost model learns a probe
        step's cost from the first one timed."""
        c0 = self.cost.cost(batch, 0, context)
        share = c0 / batch
        return PROBE_EVERY * batch * max(1.0, (self.cost.cost(batch, 1, context) - c0) / share)
