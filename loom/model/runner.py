"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the model, the paged KV cache tensors and the per-request sampling state
(parameters, seeded generator, output ids for penalties). It builds the flat batch:

    input_ids    | seq0 new tokens | seq1 new tokens | ... |      [T]
    positions    | s0 .. s0+n0-1   | s1 .. s1+n1-1   | ... |      [T]
    slot_mapping | cache slot of each new token's K/V        |      [T]
    kv_slots[s]  | slots of positions 0 .. context_s - 1     |      per sequence

With KV eviction a sequence's positions and its KV indices part: positions (what RoPE rotates
by) count every computed token, while its KV list holds only the kept entries, in order, and the
new tokens go at KV index `kv_start`. Keys were rotated at their own positions when stored, so
a kept key keeps its rotation and the attention between a new query and it sees their true
distance (docs/kv_eviction.md). The position of every kept entry (`ScheduledSeq.kv_runs`) goes
to the attention metadata, for the sliding-window layers.

and computes logits only for the rows it samples (the last new token of a sequence
whose grant reaches its end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from loom import kernels
from loom.contracts import (GRAMMAR_DEAD_END, NO_ALLOWED_TOKEN, DraftTree, RunnerOutput, ScheduledSeq, SchedulerOutput,
                            SpecHost, TokenLogprobs)
from loom.kv.eviction import EvictionPolicy, make_policy, positions_tensor
from loom.model.kv_cache import KVCacheTensors, kv_keys
from loom.model.kv_dtypes import KVFormat
from loom.model.layers.attention import AttentionMetadata, is_chain, tree_attention_mask
from loom.sample.sampler import Sampler, SamplingBatch, argmax_rows, request_generator
from loom.sampling_params import SamplingParams
from loom.structured import GrammarMatcher, StructuredOutputs


@dataclass
class _ReqState:
    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    banned_until_min: tuple[int, ...]        # ids banned while output < min_tokens
    output_token_ids: list[int] = field(default_factory=list)
    matcher: GrammarMatcher | None = None    # structured output: the grammar's position
    prompt_lp_done: int = 0                  # prompt positions whose next-token logprobs were returned
    eviction: EvictionPolicy | None = None
    observed: list[list[tuple[torch.Tensor, int | None]]] = field(default_factory=list)  # SnapKV, per chunk
    allowed: torch.Tensor | None = None                       # allowed_token_ids [k] int64
    bias: tuple[torch.Tensor, torch.Tensor] | None = None    # logit_bias: ids [k] int64, values [k] float32
    greedy_params: bool = field(init=False)   # plain_greedy's parts that the request's params fix

    def __post_init__(self) -> None:
        p = self.params
        # asked twice for every row of every step, so decided once (under cProfile the property
        # was 16% of a speculative step at 8 rows)
        self.greedy_params = (p.is_greedy and p.logprobs is None and p.presence_penalty == 0
                              and p.frequency_penalty == 0 and p.repetition_penalty == 1 and not p.restricts_tokens)
        if p.allowed_token_ids:
            self.allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
        if p.logit_bias:
            self.bias = (torch.tensor(list(p.logit_bias), dtype=torch.int64),
                         torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))

    @property
    def plain_greedy(self) -> bool:
        """Argmax and nothing else: no penalties, logprobs, banned tokens or token controls this step."""
        return self.greedy_params and len(self.output_token_ids) >= self.params.min_tokens

    @property
    def argmax_only(self) -> bool:
        """Plain greedy without a grammar: this step's token is the logits' argmax as computed."""
        return self.plain_greedy and self.matcher is None

    def banned(self) -> tuple[int, ...]:
        """The ids this step must not sample: stop ids before min_tokens, and the last token of
        every bad word whose other tokens end the output (vLLM's rule: the output only)."""
        p, out = self.params, self.output_token_ids
        ids = self.banned_until_min if len(out) < p.min_tokens else ()
        for seq in p.bad_words_token_ids or ():
            k = len(seq) - 1
            if k <= len(out) and (k == 0 or out[-k:] == list(seq[:-1])):
                ids += (seq[-1],)
        return ids


# Prompt positions whose logits are made at once for prompt logprobs ([rows, vocab] float32).
PROMPT_LOGPROB_ROWS = 64


class ModelRunner:
    """`spec`, when given, is the speculative decoder (loom.speculative.SpecDecoder): after each
    forward pass it gets the sampled rows' logits and a `SpecHost` of callbacks into this runner,
    never the runner itself."""

    def __init__(self, model, num_blocks: int, block_size: int, stop_token_ids: frozenset[int],
                 kv_dtype: torch.dtype | KVFormat = torch.float32, seed: int = 0, spec=None,
                 structured: StructuredOutputs | None = None):
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.vocab_size = model.cfg.vocab_size
        self.stop_token_ids = stop_token_ids
        self.kv = KVCacheTensors(model.cfg, num_blocks * block_size, kv_dtype, block_size)
        self.sampler = Sampler(seed, kernels=kernels.load())
        self.states: dict[str, _ReqState] = {}
        self.spec = spec
        self.structured = structured   # compiles constraints into per-request grammar matchers

    def _spec_host(self) -> SpecHost:
        """What one step lends speculation (built per step: kept, its bound methods would tie the
        runner into a cycle that only the garbage collector frees)."""
        return SpecHost(sample=self._sample, draw=self._drawer, request=self.states.__getitem__,
                        commit=self._commit, move_kv=self.kv.move_slots, constrain=self._constrain_tree)

    @staticmethod
    def kv_bytes_per_token(cfg, kv_dtype: torch.dtype | KVFormat = torch.float32) -> int:
        return KVCacheTensors.bytes_per_token(cfg, kv_dtype)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
            if self.spec is not None:
                self.spec.finish(rid)
        for rid in out.preempted_req_ids:   # recomputed from scratch: a half-recorded window is void
            if rid in self.states:
                self.states[rid].observed.clear()
        for new in out.new_requests:
            p = new.params
            # stop ids past the vocabulary are never sampled: nothing to ban (nor a tensor can hold 2**63)
            stops = {t for t in p.stop_token_ids if t < self.vocab_size}
            banned = () if p.min_tokens == 0 else tuple(sorted(
                stops | (set() if p.ignore_eos else set(self.stop_token_ids))))
            matcher = None if p.structured_outputs is None else self.structured.matcher(p.structured_outputs)
            self.states[new.req_id] = _ReqState(p, new.prompt_token_ids, request_generator(p), banned,
                                                matcher=matcher, eviction=make_policy(p.kv_eviction))
        if out.kv_moves:   # before the copies: a block freed by eviction may be a copy's destination
            src, dst = zip(*out.kv_moves)
            self.kv.move_slots(torch.tensor(src), torch.tensor(dst))
        if not out.seqs:
            return RunnerOutput({})
        self.kv.copy_blocks(out.block_copies, self.block_size)
        input_ids, positions, meta = build_batch(out.seqs, self.block_size)
        observers = self._observe(meta, out.seqs)
        t0 = time.perf_counter()
        hidden = self.model.forward(input_ids, positions, meta, self.kv.layers)      # [T, D]
        prompt_lps = self._prompt_logprobs(hidden, meta, out.seqs)
        kv_keep = self._select(meta, out.seqs, observers) if observers else {}
        sample_seqs = [i for i, s in enumerate(out.seqs) if s.sample]
        if not sample_seqs:
            return RunnerOutput({}, prompt_logprobs=prompt_lps, kv_keep=kv_keep)
        # one row per sampled sequence, or 1 + its draft nodes when it verifies a draft
        counts = [1 + len(out.seqs[i].draft_parents) for i in sample_seqs]
        rows = torch.cat([torch.arange(meta.query_starts[i] + meta.query_lens[i] - c, meta.query_starts[i]
                                       + meta.query_lens[i]) for i, c in zip(sample_seqs, counts)])
        # each row's argmax where the output layer's refinement knows it, else -1
        known = torch.empty(len(rows), dtype=torch.int64)
        # a step of plain greedy rows reads only the argmax: the logits need not be kept (None)
        argmax_only = (all(self.states[out.seqs[i].req_id].argmax_only for i in sample_seqs) and
                       (self.spec is None or not self.spec.reads_logits([out.seqs[i] for i in sample_seqs],
                                                                         len(out.seqs))))
        logits = self.model.compute_logits(hidden[rows], known, argmax_only)          # [R, V]
        if self.spec is None:
            result = self._sample(logits, [out.seqs[i].req_id for i in sample_seqs], known)
        else:
            self.spec.record_step(out, time.perf_counter() - t0)
            result = self.spec.step(self._spec_host(), out, meta, [out.seqs[i] for i in sample_seqs], counts, logits,
                                    known)
        result.prompt_logprobs.update(prompt_lps)
        result.kv_keep.update(kv_keep)
        return result

    def _observe(self, meta, seqs: list[ScheduledSeq]) -> list[tuple[int, int, int]]:
        """Asks the layers to record the queries of SnapKV's observation windows in this batch;
        returns (sequence, first batch row, rows) of each."""
        found, rows = [], []
        for i, s in enumerate(seqs):
            if s.observe_from is None:
                continue
            lo = max(s.observe_from, s.start_pos)
            if lo == s.observe_from:   # the window starts in this chunk: forget an earlier attempt
                self.states[s.req_id].observed.clear()
            first = meta.query_starts[i] + lo - s.start_pos
            n = s.start_pos + len(s.token_ids) - lo
            found.append((i, first, n))
            rows.append(torch.arange(first, first + n))
        if found:
            meta.observe_rows = torch.cat(rows)
        return found

    def _select(self, meta, seqs: list[ScheduledSeq], observers) -> dict[str, list[int]]:
        """Files each sequence's recorded queries; at the end of a prompt, its policy's selection."""
        keep, at = {}, 0
        for i, first, n in observers:
            s, st = seqs[i], self.states[seqs[i].req_id]
            st.observed.append([(q[at:at + n], w) for q, w in meta.observed])
            at += n
            if not s.select:
                continue
            layers = [(torch.cat([chunk[j][0] for chunk in st.observed]), st.observed[0][j][1])
                      for j in range(len(st.observed[0]))]
            st.observed.clear()
            keys = kv_keys(self.kv.layers, meta.kv_slots[i], self.model.cfg.head_dim)
            chosen = st.eviction.select(layers, keys, self.model.cfg.attn_scale)
            if chosen is not None:
                keep[s.req_id] = chosen
        return keep

    def _prompt_logprobs(self, hidden: torch.Tensor, meta, seqs) -> dict[str, list[TokenLogprobs]]:
        """For requests that asked (SamplingParams.prompt_logprobs = k): the logprob of each prompt
        token this step's chunk predicts (position p predicts token p + 1), with its rank and the k
        most probable tokens. Logits are made PROMPT_LOGPROB_ROWS rows at a time, so memory stays
        bounded by the slice, never [prompt_len, vocab]. Positions already returned (a prompt
        recomputed after preemption) are not returned again."""
        out: dict[str, list[TokenLogprobs]] = {}
        for i, s in enumerate(seqs):
            st = self.states.get(s.req_id)
            if st is None or st.params.prompt_logprobs is None:
                continue
            lo = max(s.start_pos, st.prompt_lp_done)
            hi = min(s.start_pos + len(s.token_ids), len(st.prompt_token_ids) - 1)
            entries: list[TokenLogprobs] = []
            for a in range(lo, hi, PROMPT_LOGPROB_ROWS):
                b = min(hi, a + PROMPT_LOGPROB_ROWS)
                rows = torch.arange(a, b) - s.start_pos + meta.query_starts[i]
                logits = self.model.compute_logits(hidden[rows]).float()                            # [r, V]
                target = torch.tensor(st.prompt_token_ids[a + 1:b + 1])
                chosen, ranks, top_i, top_v = self.sampler.token_logprobs(logits, target, st.params.prompt_logprobs,
                                                                          ranks=True)
                for r in range(b - a):
                    entries.append(TokenLogprobs(float(chosen[r]), list(zip(top_i[r].tolist(), top_v[r].tolist())),
                                                 ranks[r]))
            if entries:
                st.prompt_lp_done = hi
                out[s.req_id] = entries
        return out

    @torch.inference_mode()
    def timed_forward(self, seqs) -> float:
        """Seconds of one forward pass plus logits over `seqs` (ScheduledSeqs whose blocks are
        free: it writes into them); the speculative cost model's calibration."""
        ids, positions, meta = build_batch(seqs, self.block_size)
        t0 = time.perf_counter()
        hidden = self.model.forward(ids, positions, meta, self.kv.layers)
        self.model.compute_logits(hidden)
        return time.perf_counter() - t0

    def _mask_constrained(self, logits: torch.Tensor, req_ids: list[str], states: list[_ReqState]) -> set[str]:
        """Masks the rows of requests with a grammar; returns the ids of those whose grammar admits
        no token at all (it needs a character no token of this vocabulary spells)."""
        matchers = [st.matcher for st in states]
        if all(m is None for m in matchers):
            return set()
        return {req_ids[i] for i in self.structured.mask_rows(logits, matchers)}

    def _constrain_tree(self, req_id: str, tree: DraftTree, logits: torch.Tensor) -> list[bool] | None:
        """Masks the verification rows [1 + len(tree), V] of a constrained request's draft by its
        grammar along each path, in place; returns which rows admit no token (None: no grammar).
        Such rows are left unmasked (the verifier needs a distribution); the caller ends the
        request if its accepted path reaches one."""
        matcher = self.states[req_id].matcher
        if matcher is None:
            return None
        return self.structured.mask_tree(logits, matcher, tree.tokens, tree.parents)

    def _commit(self, req_id: str, tokens: list[int]) -> None:
        st = self.states[req_id]
        for tok in tokens:
            self._take(st, tok)

    @staticmethod
    def _take(st: _ReqState, token: int) -> None:
        """A sampled or accepted token joins the request's output (and advances its grammar)."""
        st.output_token_ids.append(token)
        if st.matcher is not None and not st.matcher.is_terminated():
            st.matcher.accept(token)

    def _drawer(self, logits: torch.Tensor, req_id: str) -> Callable[[int], int]:
        """Samples row r of `logits` [R, V] for one request as its plain step does: the same
        sampler call on that row, one draw of its random stream."""
        batch = self.sampling_batch([req_id])

        def draw(r: int) -> int:
            return int(self.sampler(logits[r:r + 1].clone(), batch).token_ids[0])

        return draw

    def sampling_batch(self, req_ids: list[str]) -> SamplingBatch:
        states = [self.states[r] for r in req_ids]
        return SamplingBatch.build(
            [st.params for st in states],
            generators=[st.generator for st in states],
            prompt_ids=[st.prompt_token_ids for st in states],
            output_ids=[st.output_token_ids for st in states],
            banned=[st.banned() for st in states],
            allowed=[st.allowed for st in states],
            bias=[st.bias for st in states],
        )

    def _take_greedy(self, states: list[_ReqState], req_ids: list[str], tokens: list[int]) -> RunnerOutput:
        for st, tok in zip(states, tokens):
            self._take(st, tok)
        return RunnerOutput({rid: [tok] for rid, tok in zip(req_ids, tokens)}, {})

    def _sample(self, logits: torch.Tensor, req_ids: list[str], known: torch.Tensor | None = None,
                rows: list[int] | None = None, raw: torch.Tensor | None = None) -> RunnerOutput:
        """known [R]: each row's argmax where the output layer already found it, else -1 (valid
        for the logits as computed: a grammar's mask changes them, and then it is not used).
        rows: which rows of `logits` are req_ids' (None: all, in order); they are gathered only
        where the logits are read (a speculative step's plain rows, taken by their known argmax,
        are not: a gather of 262k-wide rows costs ~0.1 ms each). raw: the rows before a grammar
        masked them, where one asks for logprobs (made here when None)."""
        states = [self.states[r] for r in req_ids]
        greedy = all(st.plain_greedy for st in states)   # the common case: no sampling batch to build
        if known is not None and all(st.argmax_only for st in states):
            tokens = known.tolist()
            if tokens and min(tokens) >= 0:   # always so where logits is None (output_logits)
                return self._take_greedy(states, req_ids, tokens)
        if rows is not None:
            logits = logits[rows]
        if raw is None and any(st.matcher is not None and st.params.logprobs is not None for st in states):
            raw = logits.clone()   # logprobs are the model's own, as for every other token control
        dead = self._mask_constrained(logits, req_ids, states)
        if dead:
            keep = [i for i, rid in enumerate(req_ids) if rid not in dead]
            out = (self._sample(logits[keep], [req_ids[i] for i in keep], raw=None if raw is None else raw[keep])
                   if keep else RunnerOutput({}))
            out.dead_ends.update(dict.fromkeys(sorted(dead), GRAMMAR_DEAD_END))
            return out
        if greedy:
            return self._take_greedy(states, req_ids, argmax_rows(logits).tolist())
        res = self.sampler(logits, self.sampling_batch(req_ids), raw=raw)
        tokens = res.token_ids.tolist()
        sampled, logprobs, dead = {}, {}, {}
        for i, (rid, st, tok) in enumerate(zip(req_ids, states, tokens)):
            if st.allowed is not None and not bool(logits[i, st.allowed].isfinite().any()):
                dead[rid] = NO_ALLOWED_TOKEN   # its grammar or bad words banned every allowed id
                continue
            self._take(st, tok)
            sampled[rid] = [tok]
            k = st.params.logprobs
            if k is not None and res.logprobs is not None:
                top = list(zip(res.top_token_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist()))
                rank = int(res.ranks[i]) if res.ranks is not None else None
                logprobs[rid] = [TokenLogprobs(float(res.logprobs[i]), top, rank)]
        return RunnerOutput(sampled, logprobs, dead_ends=dead)


def build_batch(seqs, block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The flat batch of `seqs` (`ScheduledSeq`s): ids, positions and attention metadata.

    A sequence verifying a draft tree holds its committed new tokens, then the tree's
    nodes; node i takes the next slot in order but the position of its depth, and a tree
    mask (loom.model.layers.attention.tree_attention_mask) lets it see only the committed tokens and its ancestors:

        slots      s  s+1 s+2 s+3 s+4       (committed c, nodes 0..3, parents [-1, -1, 0, 2])
        tokens     c  n0  n1  n2  n3
        positions  p  p+1 p+1 p+2 p+3
    """
    # per sequence in numpy, then one tensor per result: the small torch ops this took cost
    # ~17 us a sequence (~0.5 ms of a 32-decode step), numpy's a few us
    ids, pos, query_lens, ctx_lens, kv_slots, masks, kv_pos = [], [], [], [], [], [], []
    offsets = np.arange(block_size, dtype=np.int64)
    for s in seqs:
        kv_start = s.start_pos if s.kv_start is None else s.kv_start
        n, ctx = len(s.token_ids), kv_start + len(s.token_ids)     # ctx: KV entries, not positions
        ids += s.token_ids
        nd = len(s.draft_parents)
        root = s.start_pos + n - nd - 1
        if is_chain(s.draft_parents):   # a chain is causal: its rows take the plain path, no mask
            pos.append(np.arange(s.start_pos, root + nd + 1, dtype=np.int64))
            masks.append(None)
        else:
            depths = DraftTree(tuple(s.token_ids[n - nd:]), s.draft_parents).depths
            pos += [np.arange(s.start_pos, root + 1, dtype=np.int64), root + np.asarray(depths, dtype=np.int64)]
            masks.append(tree_attention_mask(n - nd, s.draft_parents))
        table = np.asarray(s.block_table[:(ctx + block_size - 1) // block_size], dtype=np.int64)
        kv_slots.append((table[:, None] * block_size + offsets).reshape(-1)[:ctx])   # [ctx]
        kv_pos.append(positions_tensor(s.kv_runs, ctx) if s.kv_runs else None)     # [ctx] after eviction
        query_lens.append(n)
        ctx_lens.append(ctx)
    positions = torch.from_numpy(np.concatenate(pos)) if pos else torch.zeros(0, dtype=torch.int64)
    slot_mapping = (torch.from_numpy(np.concatenate([sl[len(sl) - n:] for sl, n in zip(kv_slots, query_lens)]))
                    if kv_slots else torch.zeros(0, dtype=torch.int64))
    meta = AttentionMetadata.build(slot_mapping, query_lens, ctx_lens, [torch.from_numpy(sl) for sl in kv_slots],
                                   masks if any(m is not None for m in masks) else None,
                                   kv_pos if any(p is not None for p in kv_pos) else None)
    return torch.tensor(ids, dtype=torch.int64), positions, meta


@torch.inference_mode()
def score(model, token_ids) -> torch.Tensor:
    """Float32 logits [T, V] at every position of one sequence, computed in a single pass
    over a private contiguous KV cache (slot i holds position i). Row t predicts token t+1;
    used for reference checks and perplexity."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    T = ids.shape[0]
    if T == 0:
        raise ValueError("score() needs at least one token")
    slots = torch.arange(T)
    meta = AttentionMetadata.build(slots, [T], [T], [slots])
    hidden = model.forward(ids, torch.arange(T), meta, KVCacheTensors(model.cfg, T, model.dtype).layers)
    return model.compute_logits(hidden)


def scoring_sequence(caller: str, model, token_ids, first: int, kv_dtype) -> tuple[torch.Tensor, list, torch.Tensor]:
    """A sequence to score from position `first`: its ids [T], a private KV cache of `kv_dtype`
    (the model's by default) with one slot per token, and the slots [T]."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    T = ids.shape[0]
    if T < 2 or not 0 <= first < T - 1:
        raise ValueError(f"{caller} needs at least two tokens and 0 <= first < {T - 1}, got {T} tokens, first={first}")
    return ids, KVCacheTensors(model.cfg, T, kv_dtype or model.dtype).layers, torch.arange(T)


@torch.inference_mode()
def score_slices(model, token_ids, first: int = 0, kv_dtype: torch.dtype | KVFormat | None = None, chunk: int = 512,
                 rows: int = PROMPT_LOGPROB_ROWS) -> Iterator[torch.Tensor]:
    """Log-probabilities [r, V] (float32) of the next token at positions first .. T-2 of one
    sequence, `rows` positions at a time, in order. The sequence runs in prefill chunks of
    `chunk` tokens over a private KV cache of `kv_dtype` (the model's by default), as the engine
    runs a prompt; memory stays bounded by one chunk's hidden states and one slice of logits."""
    ids, kv, slots = scoring_sequence("score_slices", model, token_ids, first, kv_dtype)
    T = ids.shape[0]
    for a in range(0, T - 1, chunk):
        b = min(T, a + chunk)
        meta = AttentionMetadata.build(slots[a:b], [b - a], [b], [slots[:b]])
        hidden = model.forward(ids[a:b], slots[a:b], meta, kv)                       # [b - a, D]
        for r0 in range(max(a, first), min(b, T - 1), rows):
            r1 = min(b, T - 1, r0 + rows)
            yield model.compute_logits(hidden[r0 - a:r1 - a]).float().log_softmax(dim=-1)   # [r1 - r0, V]
