"""The runner's side of speculative decoding: verify drafts, learn, propose the next ones.

After the forward pass the runner hands over the logits of every sampled sequence: one
row, or 1 + its tree's nodes when it verified a draft. Per step:

    verify     plain decoding's token at each row, down the tree (loom.speculative.verify)
    compact    copy the KV of accepted nodes that sit off their depth's slot
    observe    the target's top-k per row -> drafters that learn from it
    propose    drafter: each candidate's tree at its node cap, tagged with its source
    plan       controller: nodes per sequence for the next step (zero included), priced by
               each tree's source and shape; the trees cut to them -> RunnerOutput.drafts
               (the scheduler grants them next step)

A drafter whose proposals run a model (a draft model) or set state its next observation
reads (Lookahead) is asked only after the plan, for the nodes the plan grants. In a batch
whose step verified no draft, a plan is first screened: where no source the drafter can name
without proposing (a prompt-lookup match, Token Recycling) would pay at its best rate, the
plan drafts nothing and observe / propose / plan are skipped (`_screened`).

Tree slots are allocated in node order, so an accepted path 0 -> 2 -> 4 has its KV at
slots base+0, base+2, base+4 but belongs at positions root+1..root+3 = slots base+0..2:

    slots   base+0  base+1  base+2  base+3  base+4
    before  [n0]    n1      [n2]    n3      [n4]        accepted: n0, n2, n4
    after   n0      n2      n4      (rolled back by the scheduler's trim)

Requests that use penalties, logprobs, or have not reached min_tokens are never drafted for:
their next-token rule depends on state the verifier does not replay. A request with a grammar
(structured output) is: its verification rows are masked by the grammar along the tree (row
i + 1 by the grammar after the path to node i; `SpecHost.constrain`), so the verifier picks
exactly what plain constrained decoding would; its matcher advances only on the tokens
committed. The `grammar` drafter proposes the text the grammar forces (jump-forward).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import numpy as np
import torch

from loom.config import SpeculativeConfig
from loom.contracts import (GRAMMAR_DEAD_END, DraftTree, RunnerOutput, ScheduledSeq, SchedulerOutput, SpecHost,
                            SpecStats)
from loom.kernels import topk_indices
from loom.sample.sampler import argmax_rows
from loom.speculative.calibration import Grid, calibrated, measure
from loom.speculative.controller import CONTEXT_BUCKET, SpecController
from loom.speculative.drafters import DRAFTERS, DraftEnv, DraftRequest, Observation
from loom.speculative.verify import verify_greedy, verify_path

OVERHEAD_EMA = 0.2
OBSERVE_PLAIN_BATCH = 2                  # sequences per step that feed the drafter in a batch without drafts
# Batches up to this size ask the drafter, while their plans skip the search, whether a source
# it can name without proposing (a fresh prompt-lookup match) would pay, and plan in full if so.
# One SmolLM2 stream over six Spec-Bench categories: 1.32x -> 1.41x plain decoding (geomean);
# 8 streams: 2% slower (extraction, roleplay), the matches' drafts not paying for the full plans.
HINT_MAX_BATCH = 1


def behind(cands: list[str], caps: list[int], lefts: list[int]) -> tuple[list[str], list[int]]:
    """The candidates with at least the median budget left (`lefts`: tokens each may still
    generate). With no request waiting the batch ends with its last request: tokens a request
    ahead of the others gains shorten nothing (they only thin the steps after it ends), while
    its draft nodes make every step slower now, the last request's included. So in a closed
    batch only the requests furthest behind draft; in turn, as they catch up."""
    cut = statistics.median(lefts)
    keep = [i for i, left in enumerate(lefts) if left >= cut]
    return [cands[i] for i in keep], [caps[i] for i in keep]


def eligible(params, num_output: int) -> bool:
    return (params.logprobs is None and params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1 and num_output >= params.min_tokens and not params.restricts_tokens)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, env: DraftEnv):
        self.config, self.env = config, env
        self.drafter = DRAFTERS[config.method](config, env)
        # a request that brings a predicted output drafts from it alone, whatever the method
        self.predicted = self.drafter if config.method == "prediction" else DRAFTERS["prediction"](config, env)
        self.controller = SpecController(config.num_speculative_tokens, self.drafter.depth, config.adaptive)
        self.drafter.use_rates(self.controller.rate)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._turn = 0       # which sequences of a large plain batch feed the drafter next
        self.overheads: dict[str, float] = {}   # measured seconds per drafting sequence, by part
        self._sources: dict[str, str | None] = {}   # request -> the source of its pending draft
        self._tokens: dict[str, list[int]] = {}     # request -> its committed tokens (prompt + output), grown in place
        self._met: dict[str, int | None] = {}       # requests seen -> the output length they may draft from
        self._hint_reqs: dict[str, DraftRequest] = {}   # request -> what `hints` is asked with
        self._hint_screen: tuple[tuple, bool] = ((), True)  # (what it was asked for, whether a hint may pay)
        self._predicting: set[str] = set()          # those of them that bring a predicted output

    def finish(self, req_id: str) -> None:
        self._sources.pop(req_id, None)
        self._tokens.pop(req_id, None)
        self._met.pop(req_id, None)
        self._hint_reqs.pop(req_id, None)
        self._predicting.discard(req_id)
        self.drafter.finish(req_id)
        self.predicted.finish(req_id)
        self.controller.finish(req_id)

    # -- cost ---------------------------------------------------------------------------
    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feeds a step's forward time to the cost model (steps without prefill chunks only)."""
        extra = 0
        for s in out.seqs:
            if len(s.token_ids) - len(s.draft_parents) != 1:
                return
            extra += len(s.draft_parents)
        self.controller.cost.observe(len(out.seqs), extra, seconds)

    def calibrate(self, time_forward: Callable[[list[ScheduledSeq]], float], max_num_seqs: int,
                  identity: dict | None = None) -> bool:
        """Feeds the cost model the times of forward passes (`time_forward(seqs)` -> seconds) at a
        grid of (sequences, draft nodes) and context lengths (loom.speculative.calibration),
        cached under `identity` (what names the model and its set-up; None: not cached). Run
        before any request holds KV blocks (the passes write into free blocks). Returns whether
        any pass ran (False: every time came from the cache)."""
        cfg, env = self.env.target.cfg, self.env
        grid = Grid.fitting(cfg.context_length, max_num_seqs, self.config.num_speculative_tokens,
                            env.num_blocks, env.block_size)
        passes = 0

        def timed(seqs: list[ScheduledSeq]) -> float:
            nonlocal passes
            passes += 1
            return time_forward(seqs)

        if identity is None:
            times = measure(timed, grid, cfg.vocab_size, env.block_size) if grid.points() else {}
        else:
            times = calibrated(timed, grid, identity, cfg.vocab_size, env.block_size)
        for (ctx, b, x), seconds in times.items():
            self.controller.cost.calibrate(b, x, seconds, ctx)
        return passes > 0

    # -- one step -------------------------------------------------------------------------
    def reads_logits(self, seqs: list[ScheduledSeq], batch: int) -> bool:
        """Whether step() reads the logits beyond what sampling the plain rows needs: a draft to
        verify, or rows the drafter learns from (none while the controller skips its plans at
        this batch size: see _observed). A step of plain greedy rows that reads none is given
        the argmax alone, as a step without speculation is."""
        all_plain = not any(s.draft_parents for s in seqs)
        return not all_plain or self._observes(all_plain, batch)

    def _observes(self, all_plain: bool, batch: int) -> bool:
        """Whether this step feeds the drafter any rows' top-k (see _observed)."""
        return bool(self.drafter.observe_topk) and not (all_plain and self.controller.idle(batch))

    def step(self, host: SpecHost, out: SchedulerOutput, meta, seqs: list[ScheduledSeq], counts: list[int],
             logits: torch.Tensor | None, known: torch.Tensor | None = None) -> RunnerOutput:
        """`seqs` are the sampled sequences; `logits` holds `counts[i]` rows for seqs[i] (1, or
        1 + its draft's nodes), or is None where reads_logits was false and every row's argmax is
        known; `known` [R]: each row's argmax where the output layer found it, else -1 (None: not
        given); everything of the runner it needs comes through `host`."""
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        plain = [i for i, s in enumerate(seqs) if not s.draft_parents]
        at = None if len(plain) == starts[-1] else [starts[i] for i in plain]
        plain_known = known if at is None or known is None else known[at]
        result = host.sample(logits, [seqs[i].req_id for i in plain], plain_known, at) if plain else RunnerOutput({})
        batch, all_plain = len(out.seqs), len(plain) == len(seqs)
        self._meet(host, seqs)
        if all_plain and self.controller.idle(batch) and not self._in_batch(self._predicting, seqs):
            # most steps where drafting does not pay: nothing to verify, learn from or screen
            result.drafts.update(self._idle(host, seqs, batch, out.num_waiting))
            return result
        drafts = self._screened(host, seqs, batch, out.num_waiting) if all_plain else None
        if drafts is None:
            topk = self._observed(seqs, all_plain, logits, batch)
            if not all_plain or topk is not None:
                self._verify_and_learn(host, out, meta, seqs, starts, logits, known, topk, result)
            drafts = self._propose(host, seqs, batch, out.num_waiting)
        result.drafts.update(drafts)
        return result

    def _meet(self, host: SpecHost, seqs: list[ScheduledSeq]) -> None:
        """Notes the requests new to the decoder: which of them bring a predicted output, and from
        which output length each may draft (`eligible`: its parameters are fixed; None: never)."""
        for rid in [s.req_id for s in seqs if s.req_id not in self._met]:
            params = host.request(rid).params
            self._met[rid] = params.min_tokens if eligible(params, params.min_tokens) else None
            if params.prediction_token_ids:
                self._predicting.add(rid)
                self.controller.predicted(rid)

    def _screened(self, host: SpecHost, seqs: list[ScheduledSeq], batch: int,
                  waiting: int) -> dict[str, DraftTree] | None:
        """A batch's full plan settled without proposing, where the best source the drafter can
        name for each candidate (a prompt-lookup match, its steady sources) would not make
        drafting pay: the probes due, drafted (None: plan in full). A full plan proposes every
        candidate's tree and learns from every row's top-k first, ~0.5 ms at 8 SmolLM2
        sequences; most plans of a batch draft nothing. The screen prices each candidate as a
        chain from its best-rated source, so it declines only plans that would draft nothing."""
        d, ctl = self.drafter, self.controller
        if (batch <= HINT_MAX_BATCH or d.steady_sources is None or not d.proposes_before_plan
                or not ctl.adaptive or ctl.idle(batch) or self._in_batch(self._predicting, seqs)):
            return None
        cands, caps, lefts = self._candidates(host, seqs)
        if not waiting and len(cands) > 1:
            cands, caps = behind(cands, caps, lefts)
        if not cands:
            return None
        hints = d.hints([self._request(host, rid, 1) for rid in cands])
        sources = [max(((h,) if h else ()) + d.steady_sources, key=lambda src, r=rid: ctl.rate(r, src), default=None)
                   for rid, h in zip(cands, hints)]
        context = self._context(seqs)
        if ctl.pays(cands, sources, batch, d.cost_per_token(), self.overheads.get("verify", 0.0), context):
            return None
        probes = [rid for rid, k in zip(cands, ctl.decline(cands, batch, caps, context)) if k]
        return self._granted(probes, self._proposals(host, probes, [1] * len(probes)))

    @staticmethod
    def _in_batch(req_ids: set[str], seqs: list[ScheduledSeq]) -> bool:
        return bool(req_ids) and any(s.req_id in req_ids for s in seqs)

    @staticmethod
    def _context(seqs: list[ScheduledSeq]) -> int:
        """The batch's mean context length."""
        return sum(s.start_pos + len(s.token_ids) for s in seqs) // len(seqs)

    def _observed(self, seqs: list[ScheduledSeq], all_plain: bool, logits: torch.Tensor,
                  batch: int) -> np.ndarray | list[np.ndarray | None] | None:
        """The top-k rows the drafter learns from this step, int64 [rows, k] (None: none; in a
        list, an entry None: that row is not observed). A large batch without drafts (where
        drafting does not pay) feeds it OBSERVE_PLAIN_BATCH sequences per step, in turn: a top-k
        over the vocabulary for every row would cost more than it could teach. While the
        controller skips its plans at this batch size (the last ones drafted nothing) it feeds
        nothing: what it would learn serves drafts the controller has just found not to pay, and
        the top-k was most of an idle step's cost (Gemma 3's 262k-wide rows)."""
        if not self._observes(all_plain, batch):
            return None
        if not (all_plain and len(seqs) > OBSERVE_PLAIN_BATCH):
            return topk_indices(logits, self.drafter.observe_topk).numpy()
        # rows a .. a + OBSERVE_PLAIN_BATCH, wrapping: at most two views of `logits` (a gather
        # of rows by index copies them, 3-10x the top-k's own time)
        n, a = len(seqs), (self._turn + OBSERVE_PLAIN_BATCH) % len(seqs)
        self._turn = a
        head = min(OBSERVE_PLAIN_BATCH, n - a)
        observed = list(range(a, a + head)) + list(range(OBSERVE_PLAIN_BATCH - head))
        rows = list(topk_indices(logits[a:a + head], self.drafter.observe_topk).numpy())
        if head < OBSERVE_PLAIN_BATCH:
            rows += list(topk_indices(logits[:OBSERVE_PLAIN_BATCH - head], self.drafter.observe_topk).numpy())
        topk: list[np.ndarray | None] = [None] * len(seqs)    # all plain: row i is sequence i's only row
        for i, r in zip(observed, rows):
            topk[i] = r
        return topk

    def _verify_and_learn(self, host: SpecHost, out: SchedulerOutput, meta, seqs: list[ScheduledSeq],
                          starts: list[int], logits: torch.Tensor, known: torch.Tensor | None,
                          topk: np.ndarray | list[np.ndarray | None] | None, result: RunnerOutput) -> None:
        """Verifies each drafted sequence's tree into `result` (its tokens, or a dead end),
        compacts the accepted nodes' KV, and feeds the observed rows to the drafter."""
        index = {s.req_id: i for i, s in enumerate(out.seqs)}
        t_verify, n_verify = time.perf_counter(), 0
        for i, s in enumerate(seqs):
            nd = len(s.draft_parents)
            accepted = 0
            if nd:
                n_verify += 1
                tree = DraftTree(tuple(s.token_ids[-nd:]), s.draft_parents)
                verdict = self._verify(host, s.req_id, tree, logits[starts[i]:starts[i + 1]],
                                       None if known is None else known[starts[i]:starts[i + 1]])
                if verdict is None:
                    result.dead_ends[s.req_id] = GRAMMAR_DEAD_END
                    continue
                accepted = len(verdict.accepted_nodes)
                host.commit(s.req_id, verdict.tokens)
                result.sampled[s.req_id] = verdict.tokens
                self._compact(host, meta.kv_slots[index[s.req_id]], len(s.token_ids) - nd + s.start_pos,
                              verdict.accepted_nodes)
                self._count(s.req_id, tree, accepted)
            if topk is not None and topk[starts[i]] is not None:
                root = len(s.token_ids) - nd - 1
                self.drafter.observe(Observation(
                    s.req_id, s.token_ids[root:], [-1] + [p + 1 for p in s.draft_parents],
                    topk[starts[i]:starts[i + 1]], accepted))
        if n_verify:
            self._overhead("verify", (time.perf_counter() - t_verify) / n_verify)

    def _overhead(self, part: str, seconds: float) -> None:
        """Per drafting sequence: seconds outside the forward pass (verify + learn, propose)."""
        old = self.overheads.get(part)
        self.overheads[part] = seconds if old is None else (1 - OVERHEAD_EMA) * old + OVERHEAD_EMA * seconds

    def _verify(self, host: SpecHost, req_id: str, tree: DraftTree, logits: torch.Tensor,
                known: torch.Tensor | None = None):
        """The verdict on `tree` from its rows `logits` (masked by the request's grammar first, if
        it has one; `known`: the rows' argmax as the output layer found it, or -1); None when the
        accepted path reaches a row the grammar admits no token in (the request ends there, as
        plain constrained decoding would)."""
        st = host.request(req_id)
        stuck = host.constrain(req_id, tree, logits)
        if st.params.is_greedy:
            best = known.tolist() if known is not None and stuck is None else None   # a mask changes the argmax
            if best is None or min(best) < 0:
                best = argmax_rows(logits).tolist()
            verdict = verify_greedy(tree, best)
        else:
            verdict = verify_path(tree, host.draw(logits, req_id))
        if stuck is not None and any(stuck[r] for r in [0] + [n + 1 for n in verdict.accepted_nodes]):
            return None
        return verdict

    @staticmethod
    def _compact(host: SpecHost, slots: torch.Tensor, base: int, nodes: list[int]) -> None:
        moves = [(base + node, base + d) for d, node in enumerate(nodes) if node != d]
        if moves:
            host.move_kv(slots[torch.tensor([m[0] for m in moves])], slots[torch.tensor([m[1] for m in moves])])

    def _count(self, req_id: str, tree: DraftTree, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += len(tree)
        st.num_accepted_tokens += accepted
        for d in range(accepted):
            st.accepted_per_pos[d] += 1
        self.controller.record(req_id, accepted, max(tree.depths), self._sources.pop(req_id, None))

    def _idle(self, host: SpecHost, seqs: list[ScheduledSeq], batch: int, waiting: int) -> dict[str, DraftTree]:
        """A plain batch whose plans skip their search (the controller's `idle`): only the probes
        due may draft, one node each, unless a source the drafter names without proposing (a
        fresh prompt-lookup match of a lone sequence) wakes a full plan. Most steps of a batch
        where drafting does not pay take this path, after a forward pass that has streamed the
        weights through the caches: its Python runs ~10x as long as in a loop, about as long as
        the code and objects it touches take to come back from memory (docs/benchmarks.md)."""
        context = self._context(seqs)
        if batch <= HINT_MAX_BATCH and self._hinted(host, seqs, batch, context):
            self.controller.wake(batch)
            return self._propose(host, seqs, batch, waiting)
        due = self.controller.idle_step(batch, [s.req_id for s in seqs], context)
        if not due:
            return {}
        cands = self._candidates(host, [s for s in seqs if s.req_id in due])[0]
        return self._granted(cands, self._proposals(host, cands, [1] * len(cands)))

    def _propose(self, host: SpecHost, seqs: list[ScheduledSeq], batch: int, waiting: int = 0) -> dict[str, DraftTree]:
        if self._in_batch(self._predicting, seqs):   # a predicted output may pay where the others' drafts did not
            self.controller.wake(batch)
        if self.controller.idle(batch):
            return self._idle(host, seqs, batch, waiting)
        context = self._context(seqs)
        cands, caps, lefts = self._candidates(host, seqs)
        if not waiting and len(cands) > 1:
            cands, caps = behind(cands, caps, lefts)
        if not cands:
            return {}
        if not self.drafter.proposes_before_plan:
            sizes = self.controller.plan(cands, batch, caps, self.drafter.cost_per_token(),
                                         sum(self.overheads.values()), context)
            chosen = [(rid, k) for rid, k in zip(cands, sizes) if k]
            trees = self._proposals(host, [rid for rid, _ in chosen], [k for _, k in chosen])
            return self._granted([rid for rid, _ in chosen], trees)
        # every candidate's tree at its cap first: the plan prices each by its source and shape,
        # and the proposing is paid whatever it grants (only verification counts per draft)
        trees = self._proposals(host, cands, caps)
        depths = [None if t is None else list(itertools.accumulate(t.depths, max)) for t in trees]
        sizes = self.controller.plan(cands, batch, [len(t) if t else 0 for t in trees], self.drafter.cost_per_token(),
                                     self.overheads.get("verify", 0.0), context,
                                     [t.source if t else None for t in trees], depths)
        return self._granted(cands, [t.cut(k) if t and k else None for t, k in zip(trees, sizes)])

    def _hinted(self, host: SpecHost, seqs: list[ScheduledSeq], batch: int, context: int) -> bool:
        """Whether a source the drafter can name without proposing (a fresh prompt-lookup match)
        would make drafting pay in a batch whose plans skip their search."""
        cands = self._candidates(host, seqs)[0]
        if not cands:
            return False
        ctl, draft_cost, overhead = self.controller, self.drafter.cost_per_token(), self.overheads.get("verify", 0.0)
        # Whether any source the hints may name could pay: drafting pays more as a rate grows,
        # so it is whether each candidate's best-rated one would. Asked again only when a verdict
        # or the costs have moved; where none could, the hints are not asked for (each look-up
        # extends the request's n-gram index, which the next proposal then extends in bulk).
        asked = (tuple(cands), batch, context // CONTEXT_BUCKET, ctl.verdicts, ctl.cost.stamp,
                 int(draft_cost * 1e5), int(overhead * 1e5))
        if self._hint_screen[0] != asked and self.drafter.hint_sources:
            best = [max(self.drafter.hint_sources, key=lambda src, r=rid: ctl.rate(r, src), default=None)
                    for rid in cands]
            self._hint_screen = (asked, ctl.pays(cands, best, batch, draft_cost, overhead, context))
        if not self._hint_screen[1]:
            return False
        hints = self.drafter.hints([self._hint_request(host, rid) for rid in cands])
        return any(hints) and ctl.pays(cands, hints, batch, draft_cost, overhead, context)

    def _hint_request(self, host: SpecHost, rid: str) -> DraftRequest:
        """`_request(host, rid, 1)`, kept per request while its committed tokens are the same
        list (grown in place): asked on every idle step of a lone sequence."""
        st = host.request(rid)
        toks = self._committed(rid, st)
        req = self._hint_reqs.get(rid)
        if req is None or req.token_ids is not toks:
            req = self._hint_reqs[rid] = self._request(host, rid, 1)
        return req

    def _request(self, host: SpecHost, rid: str, budget: int) -> DraftRequest:
        st = host.request(rid)
        return DraftRequest(rid, self._committed(rid, st), budget, st.matcher, len(st.prompt_token_ids),
                            st.params.prediction_token_ids)

    def _committed(self, rid: str, st) -> list[int]:
        """The request's prompt + output tokens: one list per request, extended by the tokens
        committed since it was last asked for (not a copy of the whole context at every look-up)."""
        toks, prompt, output = self._tokens.get(rid), st.prompt_token_ids, st.output_token_ids
        if toks is None or len(toks) > len(prompt) + len(output):
            toks = self._tokens[rid] = prompt + output
        elif len(toks) < len(prompt) + len(output):
            toks.extend(output[len(toks) - len(prompt):])
        return toks

    def _proposals(self, host: SpecHost, cands: list[str], sizes: list[int]) -> list[DraftTree | None]:
        """The trees of `sizes[i]` nodes at most proposed for cands[i] (timed per request)."""
        if not cands:
            return []
        reqs = [self._request(host, rid, k) for rid, k in zip(cands, sizes)]
        t0 = time.perf_counter()
        trees = self._drafts(reqs)
        self._overhead("propose", (time.perf_counter() - t0) / len(reqs))
        return [t.cut(r.budget) if t is not None and len(t) else None for r, t in zip(reqs, trees)]

    def _granted(self, cands: list[str], trees: list[DraftTree | None]) -> dict[str, DraftTree]:
        """The drafts to hand the scheduler; each one's source kept for its verdict."""
        out = {}
        for rid, t in zip(cands, trees):
            if t is not None:
                out[rid] = t
                self._sources[rid] = t.source
        return out

    def _drafts(self, reqs: list[DraftRequest]) -> list[DraftTree | None]:
        """Each request's tree: from its prediction where it brings one, else from the drafter."""
        if self.predicted is self.drafter or not any(r.prediction for r in reqs):
            return self.drafter.propose(reqs)
        trees: list[DraftTree | None] = [None] * len(reqs)
        for group, drafter in (([i for i, r in enumerate(reqs) if r.prediction], self.predicted),
                               ([i for i, r in enumerate(reqs) if not r.prediction], self.drafter)):
            if group:
                for i, tree in zip(group, drafter.propose([reqs[i] for i in group])):
                    trees[i] = tree
        return trees

    def _candidates(self, host: SpecHost, seqs: list[ScheduledSeq]) -> tuple[list[str], list[int], list[int]]:
        """The sequences that may draft, their node caps, and the tokens each may still generate."""
        cands, caps, lefts = [], [], []
        for s in seqs:
            if s.req_id not in self._met:
                self._meet(host, [s])
            start = self._met[s.req_id]
            if start is None:
                continue
            st = host.request(s.req_id)
            done = len(st.output_token_ids)
            left = (st.params.max_tokens or 1 << 30) - done - 1
            if done >= start and left > 0:
                cands.append(s.req_id)
                caps.append(min(self.config.num_speculative_tokens, left))
                lefts.append(left)
        return cands, caps, lefts
