"""Iteration-level scheduler: hands out token counts under a per-step budget.

Each step:
  1. running requests in decode (one token left) are granted first, so a long prompt
     never stalls them (Sarathi-Serve); then running prefills get chunks;
  2. waiting requests are admitted in priority/FCFS order while budget, sequence slots
     and KV blocks last; an admitted prompt first reuses its longest cached prefix;
  3. when a running request cannot get blocks, the least urgent running request
     (highest priority value, latest arrival) is preempted: its blocks are freed and it
     goes back to waiting to be recomputed later.

Prefill chunks, decodes and prefix hits are one code path: a request is granted
`min(num_tokens - num_computed_tokens, budget)` tokens; a token is sampled when the grant
reaches the end of its known tokens. `update` applies the runner's sampled tokens and
finishes requests on EOS / stop token / length.

Speculative decoding: the runner may return a draft tree per request (`RunnerOutput.drafts`);
the request keeps it, and its next decode grant is 1 + the tree's nodes, cut to the token
budget and to what max_tokens / the context still allow. The tree's tokens follow the last
committed token in `ScheduledSeq.token_ids` and are never part of `all_token_ids`, so the
prefix cache never hashes them. `update` appends the accepted tokens plus one, counts only
them as computed and trims the KV blocks past that (rejected drafts):

    step:      | computed ... | t | d0 d1 d2 d3 |     granted 1 + 4
    accepted:  d0 d1, then bonus b
    after:     | computed ...  t  d0 d1 | b         num_computed = start + 3; blocks trimmed there

KV eviction (`Request.eviction`, loom/kv/eviction): before a running request's grant is
allocated, its policy may free whole blocks (StreamingLLM) or a selection made at the end of its
prompt is applied by packing the kept entries into fresh blocks (SnapKV; the slot moves go to the
runner in `kv_moves`). The request's positions keep counting every computed token; its KV length
(`kv_len`) is what the block table holds, `ScheduledSeq.kv_start` tells the runner where the
new tokens go and `ScheduledSeq.kv_runs` which position each kept entry has (for sliding
windows). A StreamingLLM request is not stopped at max_model_len.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from loom.config import CacheConfig, SchedulerConfig
from loom.contracts import ITERATION_BUCKETS, NewRequestData, RunnerOutput, ScheduledSeq, SchedulerOutput
from loom.engine.request import Request, RequestStatus
from loom.kv.eviction import kept_runs
from loom.kv.manager import KVCacheManager, PrefixHit


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0    # cumulative: each request's whole prompt, counted at its first token (vLLM's)
    prompt_tokens_computed: int = 0   # cumulative, computed (not cached) prompt tokens
    generation_tokens: int = 0
    # tokens per step (prompt tokens computed + tokens generated): cumulative counts per bucket of
    # ITERATION_BUCKETS (the last: above them all), and their sum (vllm:iteration_tokens_total)
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def count_step(self, tokens: int) -> None:
        self.iteration_tokens[bisect.bisect_left(ITERATION_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int):
        self.config = sched
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seen_by_runner: set[str] = set()
        self._finished_since_last: list[str] = []
        self.stats = SchedulerStats()
        self._step_prompt_tokens = 0   # prompt tokens the scheduled step computes (counted at its update)

    # -- requests in and out --------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def fork(self, parent_id: str, children: list[Request]) -> None:
        """Adds `children`, each sharing the KV of the parent's computed tokens (refcounts).

        A child's tokens must start with the parent's first `shared` tokens, where shared =
        min(parent's computed tokens, child's tokens - 1): a child always computes at least its
        last token itself, for its logits. Past that prefix its tokens may differ (appended or
        replaced tokens); the first write into a shared block copies it (`KVCacheManager.allocate`).
        Children of a running parent run at once (possibly beyond max_num_seqs for a while);
        otherwise they wait, with nothing computed.
        """
        parent = self.requests.get(parent_id)
        if parent is None:
            raise KeyError(f"cannot fork unknown request {parent_id!r}")
        for child in children:
            if child.request_id in self.requests:
                raise ValueError(f"request id {child.request_id!r} is already in use")
            shared = min(parent.num_computed_tokens, child.num_tokens - 1)
            if child.all_token_ids[:shared] != parent.all_token_ids[:shared]:
                raise ValueError(f"child {child.request_id!r} does not start with its parent's computed tokens")
            self.requests[child.request_id] = child
            if parent.status is not RequestStatus.RUNNING or shared <= 0:
                self.waiting.append(child)
                continue
            self.kv.fork(parent_id, child.request_id)
            self.kv.trim(child.request_id, shared)
            child.num_computed_tokens = shared
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    def finish(self, req_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, ...): frees its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
        self.kv.free(req_id)
        if req_id in self._seen_by_runner:
            self._seen_by_runner.discard(req_id)
            self._finished_since_last.append(req_id)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._step_prompt_tokens = 0
        grants: dict[str, int] = {}
        copies: list[tuple[int, int]] = []
        moves: list[tuple[int, int]] = []
        preempted: list[str] = []
        # decodes first, then prefill chunks; each in priority/FCFS order
        for req in sorted(self.running, key=lambda r: (r.is_prefill, r.sort_key())):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.compute_end - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            if req.eviction is not None:
                n = _limited(n, _eviction_limit(req, req.kv_len, self.block_size))
                moves += self._evict(req, n)
            alloc = self._allocate_draft(req, budget) if n == 1 and req.draft is not None else None
            if alloc is None:
                req.draft = None
                alloc = self._allocate_or_preempt(req, n, grants, preempted)
            if alloc is None:
                continue
            n += len(req.draft) if req.draft is not None else 0
            copies += alloc.copies
            grants[req.request_id] = n
            budget -= n
        if not preempted:
            budget = self._admit(budget, grants, copies)
        return self._build_output(grants, copies, preempted, moves)

    def _evict(self, req: Request, n: int) -> list[tuple[int, int]]:
        """Applies the request's eviction policy before a grant of n tokens; returns slot moves.
        A selection that cannot be packed yet (too few free blocks) is tried again next step,
        the request decoding meanwhile: waiting for blocks, or preempting others for them, could
        wait forever (a prompt that holds most of the cache) or trade blocks back and forth."""
        if req.kv_keep is not None:
            moves = self.kv.compact(req.request_id, req.kv_keep)
            if moves is None:
                return []
            req.kv_runs = kept_runs(req.kv_runs, req.kv_len, req.kv_keep)
            req.num_evicted += req.kv_len - len(req.kv_keep)
            req.kv_keep = None
            return moves
        drop = req.eviction.blocks_to_drop(req.kv_len, n, self.block_size)
        if drop:
            self.kv.drop_blocks(req.request_id, drop)
            bs, gone = self.block_size, set(drop)
            req.kv_runs = kept_runs(req.kv_runs, req.kv_len, [i for i in range(req.kv_len) if i // bs not in gone])
            req.num_evicted += len(drop) * self.block_size
        return []

    def _allocate_or_preempt(self, req: Request, n: int, grants: dict[str, int], preempted: list[str]):
        while True:
            alloc = self.kv.allocate(req.request_id, req.all_token_ids, req.kv_len, n)
            if alloc is not None:
                return alloc
            victims = [r for r in self.running if r.request_id not in grants]
            victim = max(victims, key=Request.sort_key)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return None

    def _allocate_draft(self, req: Request, budget: int):
        """Cuts the request's draft to what fits and allocates its slots; None (draft dropped
        by the caller) when nothing fits or the pool is short: drafts never preempt."""
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)
        if req.output_limit is not None:   # a driver stops the request at that length (Engine.limit_drafts)
            room = min(room, req.output_limit - req.num_output_tokens - 1)
        if room <= 0 or req.compute_limit is not None:
            return None
        req.draft = req.draft.cut(room)
        return self.kv.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, 1 + len(req.draft))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft = None
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_evicted, req.kv_keep, req.kv_selected, req.kv_runs = 0, None, False, ()
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.append(req)

    def _admit(self, budget: int, grants: dict[str, int], copies: list) -> int:
        self.waiting.sort(key=Request.sort_key)
        admitted = []
        for req in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            salt = req.params.cache_salt   # a salted request shares cached blocks only with the same salt
            hit = self.kv.find_prefix(req.request_id, req.all_token_ids, None if salt is None else ("salt", salt))
            if req.params.prompt_logprobs is not None and req.num_output_tokens == 0:
                hit = PrefixHit([], 0)   # every prompt position's logits are needed: compute it all
            elif req.eviction is not None:
                hit = self._evicting_hit(req, hit)
            n = max(0, min(req.compute_end - hit.num_tokens, budget))
            if req.eviction is not None:
                n = _limited(n, _eviction_limit(req, hit.num_tokens, self.block_size))
            alloc = self.kv.allocate(req.request_id, req.all_token_ids, hit.num_tokens, n, prefix=hit)
            if alloc is None:
                self.kv.free(req.request_id)  # forget the lookup; retry next step
                break
            copies += alloc.copies
            req.num_computed_tokens = hit.num_tokens
            if req.status is RequestStatus.WAITING:   # its first admission (not one after a preemption)
                req.num_cached_tokens = hit.num_tokens
                req.metrics.first_scheduled_time = time.monotonic()
                self.kv.count_lookup(req.num_prompt_tokens, hit.num_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            grants[req.request_id] = n
            budget -= n
        self.waiting = [r for r in self.waiting if r not in admitted]
        return budget

    def _evicting_hit(self, req: Request, hit: PrefixHit) -> PrefixHit:
        """A prefix hit cut for an evicting request: StreamingLLM takes less than its budget (cached
        KV past it was computed over context the request would have evicted, and the step after
        the hit frees nothing); SnapKV computes
        its observation window itself (its queries are needed), the rest may come from the cache."""
        pol = req.eviction
        if pol.observes:   # (the prompt's window: a preempted request's output comes after its selection)
            prompt = req.num_prompt_tokens
            limit = prompt - pol.params.window if prompt > pol.budget else hit.num_tokens
        else:   # below the budget: the next token is computed before any block is freed, as cold
            limit = pol.budget - 1
        k = min(hit.num_tokens, max(limit, 0)) // self.block_size
        return hit if k == len(hit.block_ids) else PrefixHit(hit.block_ids[:k], k * self.block_size)

    def _build_output(self, grants: dict[str, int], copies: list, preempted: list[str],
                      moves: list) -> SchedulerOutput:
        seqs, new = [], []
        for req in self.running:
            n = grants.get(req.request_id)
            if not n:
                continue
            start = req.num_computed_tokens
            if req.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(req.request_id)
                new.append(NewRequestData(req.request_id, list(req.prompt_token_ids), req.params))
            draft = req.draft if req.draft is not None and start + 1 == req.num_tokens else None
            if req.eviction is not None:
                seqs.append(self._evicting_seq(req, start, n))
            elif draft is None:
                seqs.append(ScheduledSeq(req.request_id, req.all_token_ids[start:start + n], start,
                                         self.kv.block_table(req.request_id), start + n == req.num_tokens))
            else:
                seqs.append(ScheduledSeq(req.request_id, req.all_token_ids[start:] + list(draft.tokens), start,
                                         self.kv.block_table(req.request_id), True, draft.parents))
            self._step_prompt_tokens += min(n, max(0, req.num_prompt_tokens - start))
        finished, self._finished_since_last = self._finished_since_last, []
        return SchedulerOutput(seqs, new, finished, copies, preempted, moves, len(self.waiting))

    def _evicting_seq(self, req: Request, start: int, n: int) -> ScheduledSeq:
        """The step of a request under KV eviction: its new tokens go at KV index kv_len; an
        observing policy (SnapKV) records the prompt's last `window` queries and selects at its
        end. A preempted request computes its prompt again, selects there (`_eviction_limit` ends
        a chunk at the prompt's end), then its output on the kept entries, as it first ran."""
        end = start + n
        observe_from, select = None, False
        pol, prompt = req.eviction, req.num_prompt_tokens
        if pol.observes and not req.kv_selected and prompt > pol.budget:
            first = prompt - pol.params.window
            if end > first:
                observe_from, select = first, end == prompt
        if end >= prompt:
            req.kv_selected = True   # a short prompt needs no selection; a long one gets it now
        return ScheduledSeq(req.request_id, req.all_token_ids[start:end], start, self.kv.block_table(req.request_id),
                            end == req.num_tokens, kv_start=req.kv_len, kv_runs=req.kv_runs,
                            observe_from=observe_from, select=select)

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Applies a step's results; returns the requests that got tokens or finished."""
        touched = []
        now = time.monotonic()
        generated = self.stats.generation_tokens
        for seq in out.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.req_id in result.dead_ends:   # e.g. its grammar cannot go on in this vocabulary
                req.status, req.stop_reason = RequestStatus.FINISHED_ABORTED, result.dead_ends[seq.req_id]
                touched.append(req)
                continue
            req.draft = result.drafts.get(seq.req_id)
            if seq.req_id in result.kv_keep:
                req.kv_keep = result.kv_keep[seq.req_id]
            tokens = result.sampled.get(seq.req_id)
            if seq.draft_parents:  # the accepted drafts are computed, the rest rolled back
                req.num_computed_tokens -= len(seq.draft_parents) - (len(tokens) - 1)
                req.metrics.num_draft_tokens += len(seq.draft_parents)
                req.metrics.num_accepted_draft_tokens += len(tokens) - 1
                self.kv.trim(req.request_id, req.num_computed_tokens)
            if not tokens:
                continue
            lps = result.logprobs.get(seq.req_id)
            for i, tok in enumerate(tokens):
                req.append_token(tok)
                self.stats.generation_tokens += 1
                if lps is not None:
                    req.cumulative_logprob += lps[i].logprob
                if self._check_stop(req, tok):
                    break
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                self.stats.prompt_tokens += req.num_prompt_tokens
            req.metrics.last_token_time = now
            touched.append(req)
        for req in touched:
            if req.status.finished:
                self.finish(req.request_id, req.status)
        self.stats.prompt_tokens_computed += self._step_prompt_tokens
        self.stats.count_step(self._step_prompt_tokens + self.stats.generation_tokens - generated)
        self._step_prompt_tokens = 0
        self._refresh_stats()
        return touched

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if tok in p.stop_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                return True
        if req.num_output_tokens >= req.max_tokens or (req.num_tokens >= self.max_model_len
                                                       and not req.runs_past_context):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _refresh_stats(self) -> None:
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.kv_usage = self.kv.usage()


def _limited(n: int, limit: int | None) -> int:
    return n if limit is None else min(n, limit)


def _eviction_limit(req: Request, kv_len: int, block_size: int) -> int | None:
    """The most tokens an evicting request's next chunk may compute: its policy's limit, and for
    an observing one (SnapKV) not past the prompt's end before the selection made there."""
    limit = req.eviction.chunk_limit(kv_len, block_size)
    if req.eviction.observes and not req.kv_selected and kv_len < req.num_prompt_tokens:
        limit = _limited(req.num_prompt_tokens - kv_len, limit)   # (before the selection kv_len is the position)
    return limit
