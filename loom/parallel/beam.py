"""Beam search and diverse (grouped) beam search over engine requests that share KV blocks.

Every live beam is an engine request held after one sampled token (`ChildSpec.hold`): each
engine step computes the beam's newest token and returns the top logprobs of the next one.
Once every live beam of a search has reported, the search picks the next beams and forks each
from its parent beam with the chosen token appended (`Engine.spawn`), then releases the old beams:

    beam a   | prompt ........ | x y |            (computed; its own sampled token is ignored)
               fork, append t1 -> | prompt ........ | x y t1 |   new beam, shares a's blocks
               fork, append t2 -> | prompt ........ | x y t2 |   new beam, shares a's blocks

so beams share every block of their common prefix (refcounts), and only the partly filled last
block is copied when a beam writes into it.

Scoring follows transformers' beam search (v5, `generate(num_beams=..., do_sample=False)`):

* a candidate's score is its beam's score plus the token's log-probability (float32 sums);
  each step keeps the top K = max(2, 1 + number of EOS ids) * beams candidates;
* the best `beams` candidates that do not end (EOS, or the length limit) become the next beams;
* candidates ranked within the first `beams` that end are finished hypotheses, scored
  score / generated_length ** length_penalty (the length counts the EOS token); the best
  `beams` hypotheses are kept;
* `early_stopping`: True stops once `beams` hypotheses exist; False (the default) stops when
  the best running score divided by the current length ** length_penalty cannot beat the worst
  kept hypothesis; "never" uses the longest possible length instead when length_penalty > 0.

Diverse beam search (Vijayakumar et al., 2018; transformers' former group beam search): the
beams split into `num_groups` groups that run the search above side by side; within a step,
group g's log-probabilities are lowered by diversity_penalty times the number of times the
token was chosen by groups 0..g-1 in this step (Hamming diversity), and those penalised scores
are what accumulates. Results of all groups are returned together, best score first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from loom.engine.groups import ChildSpec
from loom.errors import InvalidRequestError
from loom.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from loom.engine.engine import Engine

_NEG = np.float32(-1.0e9)
_search_ids = itertools.count()


@dataclass(frozen=True)
class BeamSearchSequence:
    """One returned hypothesis: generated tokens (with the EOS that ended it, if any) and their
    text (without the EOS unless include_stop_str_in_output; unlike vLLM's `text`, without the
    prompt). vLLM's names read the same: `tokens` (prompt and generated ids) and `cum_logprob`."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float  # sum of the tokens' log-probabilities (no penalties)
    score: float               # what ranks: (penalised) sum / length ** length_penalty
    finish_reason: str         # "stop" (EOS) or "length"
    group: int = 0
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_token_ids, *self.token_ids]

    @property
    def cum_logprob(self) -> float:
        return self.cumulative_logprob


@dataclass(frozen=True)
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first, beam_width of them (fewer if the search ran dry)


@dataclass
class _Beam:
    request_id: str
    tokens: list[int]          # generated so far
    score: np.float32          # accumulated (penalised) log-probabilities
    logprob: float             # accumulated raw log-probabilities
    top: dict[int, float] | None = None  # next-token logprobs, once reported


@dataclass
class _Group:
    beams: list[_Beam]
    finished: list[tuple[np.float32, list[int], float, str]] = field(default_factory=list)
    improvable: bool = True    # transformers' "early stop heuristic unsatisfied", sticky
    done: bool = False


@dataclass(frozen=True)
class _Candidate:
    score: np.float32
    logprob: float
    beam: _Beam
    token: int


class BeamSearch:
    """One prompt's search; `run_beam_search` steps the engine for many of them at once."""

    def __init__(self, engine: Engine, prompt: Any, params: BeamSearchParams):
        self.engine, self.params = engine, params
        eos = frozenset() if params.ignore_eos else engine.tokenizer.stop_token_ids
        self.eos = eos | frozenset(params.stop_token_ids)
        num_logprobs = params.num_logprobs(len(self.eos))
        if num_logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"beam search needs the top {num_logprobs} logprobs per beam, more than "
                                      f"{MAX_LOGPROBS}: lower beam_width (or num_groups)")
        # beams fork: the engine's default KV eviction does not apply to them
        self.beam_params = SamplingParams(temperature=0.0, logprobs=num_logprobs, max_tokens=None, ignore_eos=True,
                                          kv_eviction={"policy": "none"})
        self.prefix = f"beam{next(_search_ids)}"
        root = engine.add_request(prompt, self.beam_params, request_id=self._fresh_id("root"))
        req = engine.scheduler.requests[root]
        self.prompt, self.prompt_ids = req.prompt, list(req.prompt_token_ids)
        req.compute_limit = req.num_tokens
        self.max_tokens = min(params.max_tokens, engine.max_model_len - len(self.prompt_ids))
        start = _Beam(root, [], np.float32(0.0), 0.0)
        self.groups = [_Group([start]) for _ in range(params.num_groups)]
        self.pending = {root: start}
        self._step = 0

    @property
    def done(self) -> bool:
        return all(g.done for g in self.groups)

    def collect(self, out) -> None:
        """Takes a beam's step output (its next-token logprobs)."""
        beam = self.pending.get(out.request_id)
        lps = out.outputs[0].logprobs
        if beam is None or not lps:
            return
        beam.top = {tok: lp.logprob for tok, lp in lps[-1].items()}

    def ready(self) -> bool:
        return not self.done and all(b.top is not None for b in self.pending.values())

    def advance(self) -> list[str]:
        """Chooses the next beams of every group, forks them, releases the old ones; returns
        the new beams' request ids."""
        old = list(self.pending.values())
        chosen: list[int] = []  # tokens the groups before the current one picked this step
        nexts: list[list[_Candidate]] = []
        for index, group in enumerate(self.groups):
            survivors = self._select(group, self._candidates(group, chosen if index else []))
            chosen += [c.token for c in survivors]
            nexts.append(survivors)
        self._step += 1
        self.pending = {}
        for index, (group, survivors) in enumerate(zip(self.groups, nexts)):
            group.beams = self._fork(index, survivors) if not group.done else []
            self.pending.update((b.request_id, b) for b in group.beams)
        for beam in {b.request_id: b for b in old}.values():
            self.engine.abort(beam.request_id)
        return list(self.pending)

    def result(self) -> BeamSearchOutput:
        seqs = []
        for g, group in enumerate(self.groups):
            for score, tokens, logprob, reason in group.finished:
                shown = tokens if self.params.include_stop_str_in_output or reason != "stop" else tokens[:-1]
                text = self.engine.tokenizer.decode(shown, skip_special_tokens=not self.params.include_stop_str_in_output)
                seqs.append(BeamSearchSequence(tokens, text, logprob, float(score), reason, g, self.prompt_ids))
        seqs.sort(key=lambda s: -s.score)
        return BeamSearchOutput(self.prompt, self.prompt_ids, seqs)

    def abort(self) -> None:
        for rid in self.pending:
            self.engine.abort(rid)
        self.pending = {}
        for group in self.groups:
            group.done = True

    # -- one group's step -----------------------------------------------------------------------------

    def _candidates(self, group: _Group, chosen: list[int]) -> list[_Candidate]:
        """The group's top K continuations, best first (ties: earlier beam, then likelier token)."""
        penalty = np.float32(self.params.diversity_penalty)
        counts = {t: chosen.count(t) for t in set(chosen)}
        out = []
        for beam in group.beams:
            for token, lp in (beam.top or {}).items():
                step = np.float32(lp) - penalty * np.float32(counts.get(token, 0))
                out.append(_Candidate(np.float32(beam.score + step), beam.logprob + lp, beam, token))
        order = {id(b): i for i, b in enumerate(group.beams)}
        out.sort(key=lambda c: (-float(c.score), order[id(c.beam)]))
        k = max(2, 1 + len(self.eos)) * self.params.group_size
        return out[:k]

    def _select(self, group: _Group, candidates: list[_Candidate]) -> list[_Candidate]:
        """Updates the group's hypotheses and stopping state; returns the continuing candidates."""
        if group.done:
            return []
        p, width = self.params, self.params.group_size
        length = self._step + 1  # generated tokens of every candidate, the new one included
        at_limit = length >= self.max_tokens
        ends = [at_limit or c.token in self.eos for c in candidates]
        survivors = [c for c, end in zip(candidates, ends) if not end][:width]
        full = len(group.finished) >= width
        if group.improvable and not (full and p.early_stopping is True):
            denom = np.float32(length ** p.length_penalty)
            new = [(np.float32(c.score / denom), c.beam.tokens + [c.token], c.logprob,
                    "length" if c.token not in self.eos else "stop")
                   for c, end in zip(candidates[:width], ends[:width]) if end]
            merged = group.finished + new
            keep = sorted(range(len(merged)), key=lambda i: (-float(merged[i][0]), i))[:width]
            group.finished = [merged[i] for i in keep]
        group.improvable = group.improvable and self._improvable(group, survivors, length)
        full = len(group.finished) >= width
        group.done = (not group.improvable or (full and p.early_stopping is True)
                      or all(ends) or not survivors)
        return survivors

    def _improvable(self, group: _Group, survivors: list[_Candidate], length: int) -> bool:
        """Can the best running beam still beat the worst kept hypothesis?"""
        p = self.params
        if len(group.finished) < p.group_size:
            return True
        if not survivors:
            return False
        best_len = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
        best = np.float32(survivors[0].score / np.float32(best_len ** p.length_penalty))
        return bool(best > min(f[0] for f in group.finished))

    def _fork(self, group_index: int, survivors: list[_Candidate]) -> list[_Beam]:
        """One new beam per survivor (same order), forked from its parent beam with its token."""
        by_parent: dict[str, list[int]] = {}
        for i, c in enumerate(survivors):
            by_parent.setdefault(c.beam.request_id, []).append(i)
        beams: list[_Beam] = [None] * len(survivors)  # type: ignore[list-item]
        for parent_id, picks in by_parent.items():
            parent = survivors[picks[0]].beam
            keep = len(self.prompt_ids) + len(parent.tokens)  # drops the parent's own sampled token
            specs = [ChildSpec(self._fresh_id(f"{self._step}.{group_index}.{i}"), self.beam_params,
                               (survivors[i].token,), keep_tokens=keep, hold=True) for i in picks]
            for i, rid in zip(picks, self.engine.spawn(parent_id, specs)):
                c = survivors[i]
                beams[i] = _Beam(rid, parent.tokens + [c.token], c.score, c.logprob)
        return beams

    def _fresh_id(self, suffix: str) -> str:
        return self.engine.fresh_id(f"{self.prefix}-{suffix}")


def run_beam_search(engine: Engine, prompts: Sequence[Any], params: BeamSearchParams,
                    on_done: Callable[[], None] | None = None) -> list[BeamSearchOutput]:
    """Beam search for every prompt, all searches sharing the engine's batches; in prompt order.
    `on_done` is called as each search finishes."""
    searches: list[BeamSearch] = []
    try:
        for prompt in prompts:
            searches.append(BeamSearch(engine, prompt, params))
        owner = {rid: s for s in searches for rid in s.pending}
        while not all(s.done for s in searches):
            if not engine.has_unfinished_requests():
                raise RuntimeError("beam search stalled: its beams left the engine")
            for out in engine.step():
                search = owner.pop(out.request_id, None)
                if search is not None:
                    search.collect(out)
            for search in searches:
                if search.ready():
                    owner.update((rid, search) for rid in search.advance())
                    if search.done and on_done is not None:
                        on_done()
    except BaseException:
        for search in searches:
            search.abort()
        raise
    return [s.result() for s in searches]
