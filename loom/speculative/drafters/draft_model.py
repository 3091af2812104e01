"""A smaller model with the target's vocabulary drafts a greedy chain.

The draft model keeps its own paged KV cache (its own `KVCacheManager`, no prefix
caching). Per request it remembers which tokens its cache holds; at each proposal it keeps
the longest prefix that still agrees with the committed tokens (rejected drafts fall off),
computes the rest, then decodes greedily, all requests in one batch per round:

    round 0:  catch up: the committed tokens its cache lacks  -> d1 from the last row
    round i:  one token (d_i) per request still under budget   -> d_{i+1}

With no `model` given, the target itself serves, cut to its first `num_layers` layers
(early exit, sharing the target's weights).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from loom.contracts import DraftTree, ScheduledSeq
from loom.errors import InvalidRequestError
from loom.kv.manager import KVCacheManager
from loom.loader.registry import resolve_model
from loom.model.build import load_model
from loom.model.kv_cache import KVCacheTensors
from loom.model.runner import build_batch
from loom.sample.sampler import argmax_rows
from loom.speculative.drafters.base import Drafter, DraftRequest, register

COST_EMA = 0.2


def truncated(model, num_layers: int):
    """A shallow copy of `model` running only its first `num_layers` layers."""
    if num_layers > model.cfg.num_layers:
        raise InvalidRequestError(f"speculative_config num_layers ({num_layers}) exceeds the draft model's "
                                  f"{model.cfg.num_layers} layers")
    small = copy.copy(model)
    small.layers = model.layers[:num_layers]
    if getattr(model, "stack", None) is not None:
        small.stack = model.stack.first(num_layers)
    small.cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    return small


def load_draft_model(config, env):
    if config.model is None:
        model = env.target
    else:
        model = load_model(resolve_model(config.model), linear=env.linear_mode)
        if model.cfg.vocab_size != env.target.cfg.vocab_size:
            raise InvalidRequestError(f"draft model {config.model!r} has a vocabulary of {model.cfg.vocab_size} "
                                      f"tokens, the target {env.target.cfg.vocab_size}: they must match")
    return truncated(model, config.num_layers) if config.num_layers else model


@register("draft_model")
class DraftModelDrafter(Drafter):
    proposes_before_plan = False   # a proposal runs the draft model

    def __init__(self, config, env):
        self.model = load_draft_model(config, env)
        self.block_size = env.block_size
        self.kv = KVCacheManager(env.num_blocks, env.block_size, enable_prefix_caching=False)
        self.caches = KVCacheTensors(self.model.cfg, env.num_blocks * env.block_size, block_size=env.block_size)
        self.cached: dict[str, list[int]] = {}   # tokens whose KV the draft cache holds, per request
        self._cost = 0.0

    def finish(self, req_id: str) -> None:
        self.kv.free(req_id)
        self.cached.pop(req_id, None)

    def cost_per_token(self) -> float:
        return self._cost

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        t0 = time.perf_counter()
        drafts: dict[str, list[int]] = {r.req_id: [] for r in requests}
        feed = {r.req_id: self._catch_up(r) for r in requests}        # tokens to compute this round
        budgets = {r.req_id: r.budget for r in requests}
        while feed:
            nxt = self._forward(feed)
            feed = {}
            for rid, tok in nxt.items():
                drafts[rid].append(tok)
                if len(drafts[rid]) < budgets[rid]:
                    feed[rid] = [tok]
        made = sum(len(d) for d in drafts.values())
        if made:
            per = (time.perf_counter() - t0) / made
            self._cost = per if not self._cost else (1 - COST_EMA) * self._cost + COST_EMA * per
        return [DraftTree.chain(drafts[r.req_id]) if drafts[r.req_id] else None for r in requests]

    def _catch_up(self, r: DraftRequest) -> list[int]:
        """Trims the draft cache to its agreement with the committed tokens; returns the rest."""
        have = self.cached.get(r.req_id, [])
        keep = 0
        limit = min(len(have), len(r.token_ids) - 1)   # always recompute the last token: we need its logits
        while keep < limit and have[keep] == r.token_ids[keep]:
            keep += 1
        self.kv.trim(r.req_id, keep)
        self.cached[r.req_id] = list(r.token_ids[:keep])
        return list(r.token_ids[keep:])

    def _forward(self, feed: dict[str, list[int]]) -> dict[str, int]:
        """Computes `feed` for each request; returns its greedy next token (requests whose
        cache is full drop out)."""
        seqs = []
        for rid, toks in feed.items():
            start = len(self.cached[rid])
            if self.kv.allocate(rid, self.cached[rid] + toks, start, len(toks)) is None:
                continue
            seqs.append(ScheduledSeq(rid, toks, start, self.kv.block_table(rid), True))
            self.cached[rid] = self.cached[rid] + toks
        if not seqs:
            return {}
        ids, positions, meta = build_batch(seqs, self.block_size)
        hidden = self.model.forward(ids, positions, meta, self.caches.layers)
        rows = torch.tensor([meta.query_starts[i] + meta.query_lens[i] - 1 for i in range(len(seqs))])
        known = torch.empty(len(seqs), dtype=torch.int64)   # the argmax alone: no logits kept where it can
        logits = self.model.compute_logits(hidden[rows], known, argmax_only=True)
        best = (known if logits is None else argmax_rows(logits)).tolist()
        return {s.req_id: tok for s, tok in zip(seqs, best)}
