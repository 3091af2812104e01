"""KV eviction policies, one file each, found by name (`KVEvictionParams.policy`).

A policy decides which of a sequence's KV entries to keep; the KV manager frees whole blocks
(`KVCacheManager.drop_blocks`) or packs kept entries into fresh blocks (`compact`), and the
scheduler keeps a request's positions apart from its KV length (see docs/kv_eviction.md).
"""

from __future__ import annotations

from loom.eviction_params import EVICTION_POLICIES, KVEvictionParams
from loom.kv.eviction.base import EvictionPolicy
from loom.kv.eviction.positions import KVRuns, kept_runs, positions_tensor
from loom.kv.eviction.snapkv import SnapKVEviction
from loom.kv.eviction.streaming import StreamingEviction

POLICIES: dict[str, type[EvictionPolicy]] = {
    StreamingEviction.name: StreamingEviction,
    SnapKVEviction.name: SnapKVEviction,
}
assert set(POLICIES) | {"none"} == set(EVICTION_POLICIES), "every named policy has one implementation"


def make_policy(params: KVEvictionParams | None) -> EvictionPolicy | None:
    """The policy `params` names; None for no eviction."""
    if params is None or not params.enabled:
        return None
    return POLICIES[params.policy](params)


__all__ = ["EvictionPolicy", "KVRuns", "POLICIES", "SnapKVEviction", "StreamingEviction", "kept_runs", "make_policy",
           "positions_tensor"]
