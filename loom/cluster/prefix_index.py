"""What each replica has served recently, as chained hashes of the prompt's leading blocks.

A prompt's text is cut into blocks of `block_chars` characters; block i's key hashes block i
together with the key of block i-1, so a key stands for the whole prefix up to its block
(as the engine's own prefix cache keys its KV blocks by token prefix):

    keys(text)   = [h(b0), h(h(b0), b1), h(h(h(b0), b1), b2), ...]     # at most max_blocks
    index[key]   = replica, or {replicas}         # inverted: who holds this prefix (a set once shared)
    lru[replica] = OrderedDict(key -> None)       # per replica, oldest first, capped

`match(keys, candidates)` walks the keys while some candidate still holds them and returns,
per candidate, how many leading blocks it holds: O(blocks x holders), not O(replicas). The
index only sees what the router routed, so it approximates the replicas' caches (a replica's
cache also evicts under memory pressure); `capacity_blocks` bounds it per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DEFAULT_BLOCK_CHARS = 64
DEFAULT_MAX_BLOCKS = 256              # 16 KiB of leading text per prompt
DEFAULT_CAPACITY_BLOCKS = 16_384      # per replica: 1 MiB of text, about 250k tokens of KV


def prefix_keys(text: str, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[int]:
    """The chained block keys of the full blocks of `text` (a partial last block has none).
    Python's string hash: keys are compared only inside the process that made them (the router's)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1, block_chars):
        parent = hash((parent, text[start:start + block_chars]))
        keys.append(parent)
    return keys


class PrefixIndex:
    """The inverted index of the module docstring."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, Hashable | set[Hashable]] = {}   # one holder stored bare: most keys
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        """Keys held, over all replicas."""
        return sum(len(lru) for lru in self._lru.values())

    def replicas(self) -> list[Hashable]:
        return list(self._lru)

    def sizes(self) -> dict[Hashable, int]:
        """Replica -> keys it holds."""
        return {r: len(lru) for r, lru in self._lru.items()}

    def insert(self, replica: Hashable, keys: Sequence[int]) -> None:
        """`replica` now holds every prefix in `keys` (most recently used)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._add_holder(key, replica)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self._drop_holder(old, replica)

    def remove(self, replica: Hashable) -> None:
        """Forgets a replica (it died or was scaled down)."""
        for key in self._lru.pop(replica, ()):
            self._drop_holder(key, replica)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forgets every replica not in `replicas`."""
        keep = set(replicas)
        for replica in [r for r in self._lru if r not in keep]:
            self.remove(replica)

    def match(self, keys: Sequence[int], candidates: Iterable[Hashable]) -> dict[Hashable, int]:
        """Per candidate, the number of leading `keys` it holds (0 for most)."""
        alive = set(candidates)
        depth = dict.fromkeys(alive, 0)
        reached = 0
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if holders is None:
                break
            if isinstance(holders, set):
                held = alive & holders
            else:
                held = {holders} if holders in alive else set()
            if not held:
                break
            if len(held) < len(alive):
                for dropped in alive - held:
                    depth[dropped] = reached
            alive, reached = held, i + 1
        for replica in alive:
            depth[replica] = reached
        return depth

    def _add_holder(self, key: int, replica: Hashable) -> None:
        holders = self._holders.get(key)
        if holders is None:
            self._holders[key] = replica
        elif isinstance(holders, set):
            holders.add(replica)
        elif holders != replica:
            self._holders[key] = {holders, replica}

    def _drop_holder(self, key: int, replica: Hashable) -> None:
        holders = self._holders.get(key)
        if isinstance(holders, set):
            holders.discard(replica)
            if len(holders) == 1:
                self._holders[key] = next(iter(holders))
        elif holders is not None and holders == replica:
            del self._holders[key]
