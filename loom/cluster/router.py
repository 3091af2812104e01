"""Request routers for the replica deployment, plugged in through Ray Serve's extension point
(`RequestRouterConfig(request_router_class=...)`); they run inside the ingress process, where
the ingress's `DeploymentHandle` routes each forwarded request.

`PrefixAwareRouter.choose_replicas`, per request:

    keys  = the prompt's chained block keys (prefix_index.prefix_keys)
    load  = requests in flight on each candidate (Ray's queue-length cache of this handle)
    depth = leading blocks each candidate served recently (PrefixIndex.match)
    if a candidate holds a prefix and its load <= the least load + imbalance_threshold,
            and it is not full (load >= its max_num_seqs) while another has room:
        [[that candidate]]                              # sticky: its KV cache has the prefix
    elif the loads are balanced:
        [[least loaded, ties to the replica holding fewest keys]]
    else:
        [[two random candidates]]                       # power of two choices (Ray's default)

Ray then sends the request to a replica of the first rank that accepts it (a queue-length
probe); from the fourth try of a request on, the other replicas follow as a second rank, so a
full or unresponsive replica is passed over. `on_request_routed` records the prefix under the
replica that took it. Multi-turn conversations stick to a replica because each turn's
prompt extends the previous one.

Both routers keep the replicas' `record_routing_stats` (engine counters and the replica's
Prometheus exposition, see replica.py) where the ingress's /metrics reads them
(`registry.routers_of`): `PowerOfTwoRouter` is Ray's default policy with only that added, the
baseline of the benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loom.cluster import registry
from loom.cluster.prefix_index import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_MAX_BLOCKS,
    PrefixIndex,
    prefix_keys,
)

DEFAULT_IMBALANCE_THRESHOLD = 8   # in-flight requests a prefix match may cost over the least loaded replica

def _routing_text(pending: PendingRequest | None) -> str:
    """The text the ingress marked for routing (`ForwardedRequest.routing_text`), else ''."""
    if pending is None:
        return ""
    for arg in pending.args:
        text = getattr(arg, "routing_text", None)
        if isinstance(text, str):
            return text
    return ""


def _avoided(pending: PendingRequest | None) -> frozenset[str]:
    """Replicas the ingress asks to skip (they just failed or refused this request)."""
    if pending is None:
        return frozenset()
    for arg in pending.args:
        avoid = getattr(arg, "avoid_replicas", None)
        if avoid:
            return frozenset(avoid)
    return frozenset()


class _StatsMixin:
    """Registers the router for the ingress; counts the requests routed to each replica."""

    # Ray probes a replica's queue length before sending to it and skips the replica when the
    # answer is late; its 0.1 s default misfires on a busy CPU host (the replicas compute on
    # every core), turning a prefix-aware choice into a random one.
    queue_len_response_deadline_s = 0.5

    def _init_stats(self) -> None:
        self.deployment_name = self._deployment_id.name
        self.routed_by_replica: dict[str, int] = {}   # cumulative, by replica unique id
        registry.register(self)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Replica unique id -> its latest `record_routing_stats` dict."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}

    def load(self, replica_id: ReplicaID) -> int:
        """Requests in flight on a replica: Ray's queue-length cache (kept by every send, completion
        and probe of this handle), 0 when it has no fresh entry."""
        return self.replica_queue_len_cache.get(replica_id) or 0

    def _count_routed(self, replica_id: ReplicaID) -> None:
        key = replica_id.unique_id
        self.routed_by_replica[key] = self.routed_by_replica.get(key, 0) + 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._count_routed(replica_id)


class PrefixAwareRouter(_StatsMixin, RequestRouter):
    """Longest cached prefix when loads are balanced, else power of two choices (module docstring)."""

    def initialize_state(self, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS,
                         capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
                         imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD, **_: Any) -> None:
        self._init_stats()
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.imbalance_threshold = imbalance_threshold
        self.index = PrefixIndex(capacity_blocks)
        self._keys: dict[str, list[int]] = {}   # internal request id -> its keys, until routed
        self._tries: dict[str, int] = {}        # internal request id -> choose_replicas calls
        self.num_prefix_routed = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        avoid = _avoided(pending_request)
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        if len(candidates) <= 1:
            return [candidates]
        keys = self._request_keys(pending_request)
        loads = {r.replica_id: self.load(r.replica_id) for r in candidates}
        least = min(loads.values())
        by_load = sorted(candidates, key=lambda r: loads[r.replica_id])
        if keys:
            depth = self.index.match(keys, loads)
            best = max(depth.values())
            if best > 0:
                top = [r for r in by_load if depth[r.replica_id] == best]
                if loads[top[0].replica_id] <= least + self.imbalance_threshold and not (
                        self._full(top[0], loads) and not self._full(by_load[0], loads)):
                    self.num_prefix_routed += 1
                    return self._ranks(top[0], by_load, pending_request)
        if max(loads.values()) - least <= self.imbalance_threshold:
            sizes = self.index.sizes()
            first = min(by_load, key=lambda r: (loads[r.replica_id], sizes.get(r.replica_id, 0), random.random()))
            return self._ranks(first, by_load, pending_request)
        return [random.sample(candidates, 2)]

    @staticmethod
    def _full(replica: RunningReplica, loads: dict) -> bool:
        """The replica runs as many requests as it can at once (its `max_num_seqs`, from its
        routing stats): a new one would wait in its queue."""
        cap = (getattr(replica, "routing_stats", None) or {}).get("max_num_seqs")
        return cap is not None and loads[replica.replica_id] >= cap

    def _ranks(self, first: RunningReplica, by_load: list[RunningReplica],
               pending: PendingRequest | None) -> list[list[RunningReplica]]:
        """The choice alone for its first tries (a slow queue-length probe is tried again rather
        than losing the prefix), then the others by load as fallbacks."""
        if pending is not None:
            rid = pending.metadata.internal_request_id
            tries = self._tries[rid] = self._tries.get(rid, 0) + 1
            if tries <= 3:
                return [[first]]
        return [[first], [r for r in by_load if r is not first]]

    def _request_keys(self, pending: PendingRequest | None) -> list[int]:
        if pending is None:
            return []
        rid = pending.metadata.internal_request_id
        keys = self._keys.get(rid)
        if keys is None:
            keys = prefix_keys(_routing_text(pending), self.block_chars, self.max_blocks)
            self._keys[rid] = keys
        return keys

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._count_routed(replica_id)
        self._tries.pop(pending_request.metadata.internal_request_id, None)
        keys = self._keys.pop(pending_request.metadata.internal_request_id, None)
        if keys is None:
            keys = self._request_keys(pending_request)
            self._keys.pop(pending_request.metadata.internal_request_id, None)
        if keys:
            self.index.insert(replica_id, keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._keys.pop(internal_request_id, None)
        self._tries.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive: set[Hashable] = set(self._replica_id_set)
        self.index.retain(alive)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)


class PowerOfTwoRouter(_StatsMixin, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default policy (FIFO, two random candidates, the shorter queue wins), plus the
    stats the ingress reports and the ingress's avoid list."""

    def initialize_state(self, **_: Any) -> None:
        self._init_stats()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        avoid = _avoided(pending_request)
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        return [random.sample(candidates, min(2, len(candidates)))]


ROUTERS = {"prefix-aware": PrefixAwareRouter, "power-of-two": PowerOfTwoRouter}
