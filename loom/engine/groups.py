"""n > 1 and best_of: one request becomes a group of children that share its KV blocks.

The fork primitive (`Engine.spawn`, `Engine.fork`) and these groups live in the engine, as
vLLM keeps its parallel-sampling parent requests in its engine; strategies built on them
(aggregators, beam search, fork/join programs) live above, in `loom.parallel`.

The scheduler knows only one hook, `Scheduler.fork(parent_id, children)`; everything about
n, best_of and early stopping lives here. A request with n > 1 (or best_of > n) runs as:

    parent   | prompt 0 .. P-2 computed once |      compute_limit = P-1, never samples
                                      | fork (refcount += 1 per child on every block)
    child 0  | shared ...................... | P-1 | out ...   seed s (the request's seed)
    child 1  | shared ...................... | P-1 | out ...   seed s + 1
    child i  | shared ...................... | P-1 | out ...   seed s + i

Each child computes the prompt's last token itself (one token of duplicate work, so that every
child gets its own logits and its own first sample); the first write into the shared, partly
filled last block copies it (`KVCacheManager.allocate`). The parent is finished right after the
fork: its references go, the children's keep the blocks alive.

Rules:

* seeds: child i of a seeded request samples with `derive_seed(seed, i)` (seed + i, wrapped to
  the seed range); child 0 keeps the request's seed, so n=1 and the first of n agree;
* logprobs: children always compute the logprob of their tokens, so every completion carries a
  `cumulative_logprob` (best_of ranks by it); per-token logprobs are returned only when asked;
* outputs: per choice, never merged. Each step returns one `RequestOutput` per child that
  changed, under the request's id, holding that child's one `CompletionOutput` (its `index`
  is the choice index, 0..n-1); `RequestOutput.finished` is set on the request's last output,
  when every child has finished. The server maps these to choices as they come; the offline
  API gathers them with `loom.outputs.FinalOutputs`. With best_of > n nothing is returned
  until the end, then the n children with the highest cumulative logprob, re-indexed;
* early stopping: `FanOutOptions.stop_policy` is asked after every step in which a child
  changed; when it says stop, the unfinished children are aborted (finish_reason "abort")
  and their blocks freed.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom.contracts import FanOutOptions, TokenLogprobs, derive_seed
from loom.engine.detokenize import append_prompt_logprobs
from loom.engine.request import Request, RequestStatus, check_token_ids
from loom.errors import InvalidRequestError
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.engine.engine import Engine  # the groups' owner

@dataclass(frozen=True)
class ChildSpec:
    """One child of `spawn`.

    Its tokens are the parent's first `keep_tokens` (None: all of them, including a sampled
    token not yet computed) followed by `append_token_ids`; all of these are the child's prompt,
    its output is what it generates after them. `hold`: compute them, sample one token, then
    wait (compute_limit), so a driver such as beam search decides what happens next.
    """

    request_id: str
    params: SamplingParams
    append_token_ids: tuple[int, ...] = ()
    keep_tokens: int | None = None
    hold: bool = False
    index: int = 0  # the CompletionOutput index of the child's outputs


def child_request(parent: Request, spec: ChildSpec, vocab_size: int, max_model_len: int) -> Request:
    """The child `spec` describes, continuing `parent` (validated; not yet scheduled)."""
    keep = parent.num_tokens if spec.keep_tokens is None else spec.keep_tokens
    if not 0 <= keep <= parent.num_tokens:
        raise InvalidRequestError(f"keep_tokens must be in [0, {parent.num_tokens}], got {keep}")
    ids = parent.all_token_ids[:keep] + [int(t) for t in spec.append_token_ids]
    check_token_ids(ids, vocab_size, max_model_len, f"a child of '{parent.request_id}'")
    params = spec.params.clone()
    room = max_model_len - len(ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    same_prompt = ids == parent.prompt_token_ids
    child = Request(spec.request_id, ids, params, max_tokens, prompt=parent.prompt if same_prompt else None,
                    priority=parent.priority, eos_token_ids=parent.eos_token_ids, arrival_seq=parent.arrival_seq,
                    metrics=RequestMetrics(arrival_time=parent.metrics.arrival_time,
                                           first_scheduled_time=parent.metrics.first_scheduled_time))
    if same_prompt:
        child.num_cached_tokens = parent.num_cached_tokens
    if spec.hold:
        child.compute_limit = child.num_tokens
    return child


def per_child_appends(append, k: int) -> list[list[int]]:
    """`append` (None, one token list, or one list per child) as one token list per child."""
    if append is None:
        return [[] for _ in range(k)]
    items = list(append)
    if items and all(isinstance(a, (list, tuple)) for a in items):
        if len(items) != k:
            raise InvalidRequestError(f"got {len(items)} appended token lists for {k} children")
        return [list(a) for a in items]
    return [list(items) for _ in range(k)]


# -- n > 1 and best_of: groups of children behind one request id ------------------------------------


@dataclass
class _Group:
    parent: Request
    params: SamplingParams               # the request's own (n, best_of, logprobs as asked)
    options: FanOutOptions
    child_ids: list[str] = field(default_factory=list)
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: dict[int, RequestMetrics] = field(default_factory=dict)
    changed: set[int] = field(default_factory=set)
    # with prompt_logprobs: the parent's, which computed every prompt position that predicts a
    # prompt token (the children compute only the last), returned with every choice's output
    prompt_logprobs: list | None = None

    @property
    def request_id(self) -> str:
        return self.parent.request_id

    @property
    def size(self) -> int:
        return self.params.effective_best_of

    @property
    def forked(self) -> bool:
        return bool(self.child_ids)

    def done(self) -> bool:
        return len(self.latest) == self.size and all(c.finish_reason is not None for c in self.latest.values())


class RequestGroups:
    """The engine's groups of n > 1 / best_of requests (see the module docstring).

    The engine calls `add` for such a request instead of creating its output state, `step`
    after every step (forks parents that reached their limit, emits the changed children's
    outputs one per choice, applies early stopping) and `abort` for an id `in` it.
    """

    def __init__(self, engine: Engine):
        self.engine = weakref.proxy(engine)   # the engine owns the groups: no cycle to keep it alive
        self.groups: dict[str, _Group] = {}
        self._children: dict[str, tuple[_Group, int]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.groups or request_id in self._children

    def add(self, req: Request, options: FanOutOptions | None = None) -> None:
        """Takes over `req` (already added to the scheduler): it prefills all but its last
        prompt token, then `step` forks it into its children."""
        req.compute_limit = req.num_prompt_tokens - 1
        self.groups[req.request_id] = _Group(req, req.params, options or FanOutOptions())

    def add_prompt_logprobs(self, request_id: str, entries: list[TokenLogprobs]) -> None:
        """The next prompt tokens' logprobs, which a group's parent computed (see `_Group`)."""
        group = self.groups.get(request_id)
        if group is None or group.params.prompt_logprobs is None:
            return
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        append_prompt_logprobs(group.prompt_logprobs, group.parent.prompt_token_ids, entries, self.engine.tokenizer,
                               group.params.detokenize)

    def step(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs with the children's replaced by their groups' outputs."""
        for group in list(self.groups.values()):
            if not group.forked and group.parent.status is RequestStatus.RUNNING \
                    and group.parent.num_computed_tokens >= (group.parent.compute_limit or 0):
                self._fork(group)
        passed, touched = [], {}
        for out in outs:
            entry = self._children.get(out.request_id)
            if entry is None:
                passed.append(out)
                continue
            group, index = entry
            self._record(group, index, out)
            touched[group.request_id] = group
        for group in touched.values():
            policy = group.options.stop_policy
            if policy is not None and not group.done() and policy.should_stop(self._completions(group)):
                self._abort_children(group)
        return passed + [o for g in touched.values() for o in self._emit(g)]

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Aborts a whole group (its id) or one child; returns the outputs of the children it
        ended, the last `finished` when this ended the group."""
        group = self.groups.get(request_id)
        if group is None:
            entry = self._children.get(request_id)
            if entry is None:
                return []
            group = entry[0]
            self._abort_one(group, entry[1])
        elif not group.forked:
            self.engine.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
            for i in range(group.size):
                group.latest[i] = CompletionOutput(i, "", [], finish_reason="abort")
                group.changed.add(i)
        else:
            self._abort_children(group)
        return self._emit(group) if group.done() else []

    # -- internals -------------------------------------------------------------------------------

    def _fork(self, group: _Group) -> None:
        params = group.params
        child_params = params.clone(n=1, best_of=None, logprobs=0 if params.logprobs is None else params.logprobs,
                                    prompt_logprobs=None)
        specs = [ChildSpec(self.engine.fresh_id(f"{group.request_id}/{i}"),
                           child_params.clone(seed=derive_seed(params.seed, i)), index=i)
                 for i in range(group.size)]
        group.child_ids = self.engine.spawn(group.request_id, specs)
        for i, cid in enumerate(group.child_ids):
            self._children[cid] = (group, i)
        # The children hold their own references to every block now.
        self.engine.scheduler.finish(group.request_id, RequestStatus.FINISHED_STOPPED)

    def _record(self, group: _Group, index: int, out: RequestOutput) -> None:
        group.latest[index] = out.outputs[0]
        if out.metrics is not None:
            group.metrics[index] = out.metrics
        group.changed.add(index)
        if out.finished:
            self._children.pop(group.child_ids[index], None)

    def _abort_children(self, group: _Group) -> None:
        for index in range(group.size):
            current = group.latest.get(index)
            if current is None or current.finish_reason is None:
                self._abort_one(group, index)

    def _abort_one(self, group: _Group, index: int) -> None:
        rid = group.child_ids[index]
        self.engine.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
        state = self.engine.outputs.pop(rid, None)
        if state is not None:
            self._record(group, index, state.process())

    def _completions(self, group: _Group) -> list[CompletionOutput]:
        return [group.latest.get(i) or CompletionOutput(i, "", []) for i in range(group.size)]

    def _emit(self, group: _Group) -> list[RequestOutput]:
        """One output per changed child (one completion each); the last is `finished` when
        the group is done. best_of > n: nothing until done, then the n best."""
        done = group.done()
        if not done and group.size > group.params.n:
            group.changed.clear()
            return []  # best_of ranks finished children only
        if done:
            del self.groups[group.request_id]
        if done and group.size > group.params.n:  # the first output of each chosen child: all of it is new
            choices = [dataclasses.replace(c, delta_text=c.text, delta_token_ids=list(c.token_ids))
                       for c in _best(self._completions(group), group.params.n)]
        else:
            choices = [group.latest[i] for i in sorted(group.changed)]
        group.changed.clear()
        if group.params.logprobs is None:
            choices = [dataclasses.replace(c, logprobs=None) for c in choices]
        parent, metrics = group.parent, self._metrics(group, done)
        prompt_lps = None if group.prompt_logprobs is None else list(group.prompt_logprobs)
        return [RequestOutput(group.request_id, parent.prompt, list(parent.prompt_token_ids), [c],
                              done and i == len(choices) - 1, metrics, parent.num_cached_tokens, prompt_lps)
                for i, c in enumerate(choices)]

    @staticmethod
    def _metrics(group: _Group, done: bool) -> RequestMetrics:
        """The group's times: arrival of the request, first token of any child, last of all."""
        own = group.parent.metrics
        times = list(group.metrics.values())
        firsts = [m.first_token_time for m in times if m.first_token_time is not None]
        lasts = [m.last_token_time for m in times if m.last_token_time is not None]
        ends = [m.finished_time for m in times if m.finished_time is not None]
        return RequestMetrics(own.arrival_time, own.first_scheduled_time, min(firsts, default=None),
                              max(lasts, default=None), max(ends, default=None) if done else None,
                              group.parent.num_cached_tokens)


def _best(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """All completions when there are n; else the n with the highest cumulative logprob, re-indexed."""
    if len(completions) == n:
        return completions
    ranked = sorted(completions, key=lambda c: -math.inf if c.cumulative_logprob is None else c.cumulative_logprob,
                    reverse=True)
    return [dataclasses.replace(c, index=i) for i, c in enumerate(ranked[:n])]
