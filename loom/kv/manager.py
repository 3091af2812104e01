"""Per-request block tables over a `BlockPool`: allocation, prefix caching, forks.

The scheduler speaks in token counts; this module turns them into blocks. Each step a
request has `num_computed` tokens whose KV is already in its blocks and `num_new`
tokens to compute now; `allocate` makes the table cover both, and afterwards caches
every block that is then completely filled with committed tokens.

One request, block_size 4, on a step that verifies 4 draft tokens::

    position     0   4   8   12  16  20
                 |   |   |   |   |   |
    tokens       HHHHHHHHCCNNNNNNNdddd
    table        [b0][b1][b2][b3][b4][b5]
    hashed       [b0][b1][b2][b3]
                           ^      ^   ^
                           |      |   num_computed + num_new = 21
                           |      num_committed = 17
                           num_computed = 10

    H  prefix-cache hit (PrefixHit: b0, b1 touched, counted in num_computed)
    C  computed in earlier steps
    N  new this step, committed
    d  new this step, draft: speculative, may be rolled back by `trim`

Blocks wholly below min(num_computed + num_new, num_committed) = 17 are hashed and
cached: b0, b1 (already cached) and b2, b3 (cached now). b4 holds drafts and b5 is
partial: neither is cached until a later step fills it with committed tokens.

Copy-on-write: a block may be shared (a fork, or a prefix hit); a request never writes
into a block that another holder or the prefix cache relies on. Before writing, such a
block is replaced in this request's table by a fresh one and the (old, new) pair is
reported in `Allocation.copies` for the runner to copy first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from loom.kv.block_pool import BlockHash, BlockPool, hash_block_tokens


@dataclass(frozen=True)
class PrefixHit:
    """Cached leading blocks of a request's tokens, found by `KVCacheManager.find_prefix`."""

    block_ids: list[int]  # cached blocks to reuse, in order; not yet touched
    num_tokens: int  # tokens they cover = len(block_ids) * block_size


@dataclass(frozen=True)
class Allocation:
    """What one successful `allocate` changed."""

    new_block_ids: list[int]  # blocks appended to the end of the table, in table order
    copies: list[tuple[int, int]]  # (src, dst): copy src's KV into dst before this step; dst replaced src


@dataclass
class PrefixCacheStats:
    """Cumulative token counts, vLLM metric semantics: hits / queries is the hit rate."""

    prefix_cache_queries: int = 0  # tokens of the prompts looked up
    prefix_cache_hits: int = 0  # of those, tokens served from the cache


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    # Chained hashes of the request's leading full committed blocks; only ever extended
    # with committed tokens, cut back by `trim`.
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached: int = 0  # leading table entries already offered to the prefix cache
    extra_key: object = None
    # set by eviction: the table no longer holds every token, so later blocks hold KV computed
    # over a cut context and must never enter the prefix cache
    evicted: bool = False


class KVCacheManager:
    """Per-request block tables over a BlockPool, with automatic prefix caching and
    copy-on-write forks.

    A request's extra key (see `hash_block_tokens`) is fixed by the first `find_prefix`
    or `allocate` that names it; None later means "unchanged".
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._reqs: dict[Hashable, _Request] = {}

    # -- queries ---------------------------------------------------------------------

    def block_table(self, req_id: Hashable) -> list[int]:
        """A copy of the request's block table; [] for an unknown request."""
        req = self._reqs.get(req_id)
        return list(req.blocks) if req is not None else []

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        return self.pool.usage()

    def slot(self, req_id: Hashable, position: int) -> int:
        """The KV slot of the request's token at `position`."""
        blocks = self._reqs[req_id].blocks
        index = position // self.block_size
        if position < 0 or index >= len(blocks):
            raise IndexError(f"position {position} is outside request {req_id!r}'s "
                             f"{len(blocks)} blocks of {self.block_size}")
        return blocks[index] * self.block_size + position % self.block_size

    def find_prefix(self, req_id: Hashable, token_ids: Sequence[int], extra_key: object = None) -> PrefixHit:
        """The longest run of leading full blocks of `token_ids` found in the prefix cache.

        The hit never covers the whole list: at least the last token is left to compute,
        since the model needs its logits. `token_ids` must be committed tokens (no drafts).
        The hashes are memoised for the request's allocation; `free(req_id)` drops them if the
        request is never allocated. `count_lookup` counts what an admission took.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        req = self._state(req_id, extra_key)
        # (n - 1) // bs full blocks always leave >= 1 token; for n a multiple of bs this
        # drops the last full block.
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        self._extend_hashes(req, token_ids, max_blocks)
        block_ids: list[int] = []
        for block_hash in req.hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixHit(block_ids, len(block_ids) * self.block_size)

    def count_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Counts a prompt's lookup once, when its request is admitted (a request that waits for
        blocks looks again every step: those lookups are not counted)."""
        if self.enable_prefix_caching:
            self.stats.prefix_cache_queries += num_tokens
            self.stats.prefix_cache_hits += num_hit

    # -- mutations -------------------------------------------------------------------

    def allocate(self, req_id: Hashable, token_ids: Sequence[int], num_computed: int, num_new: int,
                 prefix: PrefixHit | None = None, num_committed: int | None = None, *,
                 extra_key: object = None) -> Allocation | None:
        """Makes the request's table cover num_computed + num_new token slots.

        `prefix` (first allocation only, from `find_prefix` for this request and these
        tokens): its blocks are touched and head the table; num_computed must include them.
        Shared or cached blocks the new tokens write into are copied (see module doc).
        Afterwards blocks wholly filled by tokens < min(num_computed + num_new,
        num_committed) are cached; num_committed defaults to len(token_ids) and tokens past
        it are drafts, never cached. Slots past len(token_ids) may be reserved too.

        Returns None, changing nothing, when the pool has too few free blocks.
        """
        bs = self.block_size
        req = self._reqs.get(req_id)
        if req is not None and extra_key is not None and extra_key != req.extra_key:
            raise ValueError(f"request {req_id!r} already uses a different extra key")
        if num_computed < 0 or num_new < 0:
            raise ValueError(f"num_computed ({num_computed}) and num_new ({num_new}) must be >= 0")
        num_committed = len(token_ids) if num_committed is None else num_committed
        if not 0 <= num_committed <= len(token_ids):
            raise ValueError(f"num_committed ({num_committed}) must be in 0..len(token_ids) ({len(token_ids)})")
        held = req.blocks if req is not None else []
        prefix_blocks = self._check_prefix(req_id, req, prefix, num_computed)
        table_len = len(held) + len(prefix_blocks)
        if num_computed > table_len * bs:
            raise ValueError(f"num_computed ({num_computed}) exceeds the {table_len * bs} slots "
                             f"request {req_id!r} holds")

        end = num_computed + num_new
        needed_len = -(-end // bs)
        num_append = max(needed_len - table_len, 0)
        # Held blocks the new tokens write into that others rely on: copy them first.
        first_written = num_computed // bs
        cow = [i for i in range(first_written, min(needed_len, len(held)))
               if num_new > 0 and (self.pool.refcount(held[i]) > 1 or self.pool.block_hash(held[i]) is not None)]
        # A free cached block is counted as free, but touching it takes it out of the queue.
        revived = sum(1 for b in set(prefix_blocks) if self.pool.refcount(b) == 0)
        if num_append + len(cow) + revived > self.pool.num_free_blocks():
            return None

        # Touch before taking new blocks, or get_new_blocks could evict the hit blocks.
        self.pool.touch(prefix_blocks)
        fresh = self.pool.get_new_blocks(len(cow) + num_append)
        if req is None:
            req = self._reqs[req_id] = _Request(extra_key=extra_key)
        if prefix_blocks:
            req.blocks = list(prefix_blocks)
            req.num_cached = len(prefix_blocks)
        copies: list[tuple[int, int]] = []
        for i, dst in zip(cow, fresh):
            copies.append((req.blocks[i], dst))
            req.blocks[i] = dst
        self.pool.free(src for src, _ in reversed(copies))
        appended = fresh[len(cow):]
        req.blocks.extend(appended)
        if num_new > 0 and first_written < req.num_cached:
            # Rewriting already cached positions (without a trim first): the hashes of
            # those blocks describe the old tokens.
            req.num_cached = first_written
            del req.hashes[first_written:]

        if self.enable_prefix_caching and not req.evicted:
            num_full = min(end, num_committed) // bs
            if num_full > req.num_cached:
                self._extend_hashes(req, token_ids, num_full)
                for i in range(req.num_cached, num_full):
                    self.pool.cache_block(req.blocks[i], req.hashes[i])
                req.num_cached = num_full
        return Allocation(appended, copies)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Gives child_id a copy of parent_id's table, sharing every block (refcount += 1).

        Whichever of the two writes into a shared block first gets a private copy.
        """
        parent = self._reqs.get(parent_id)
        if parent is None:
            raise KeyError(f"cannot fork unknown request {parent_id!r}")
        existing = self._reqs.get(child_id)
        if existing is not None and existing.blocks:
            raise ValueError(f"cannot fork into request {child_id!r}: it already holds blocks")
        self.pool.touch(parent.blocks)
        self._reqs[child_id] = _Request(list(parent.blocks), list(parent.hashes), parent.num_cached,
                                        parent.extra_key, parent.evicted)

    def trim(self, req_id: Hashable, num_tokens: int) -> None:
        """Keeps only the blocks covering slots 0..num_tokens-1 and frees the rest, last first.

        Tokens from num_tokens on are forgotten (rejected drafts, rolled-back tokens); a
        kept block that is cached is copied before anything is written into it.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot trim to a negative token count ({num_tokens})")
        req = self._reqs.get(req_id)
        if req is None:
            return
        keep = -(-num_tokens // self.block_size)
        dropped = req.blocks[keep:]
        del req.blocks[keep:]
        self.pool.free(reversed(dropped))
        full = num_tokens // self.block_size
        del req.hashes[full:]
        req.num_cached = min(req.num_cached, full)

    def drop_blocks(self, req_id: Hashable, indices: Sequence[int]) -> None:
        """KV eviction: takes the table entries at `indices` out of the request's table and drops
        its reference to each (last first). The table closes up, so the request's KV entries
        after them move down by block_size each; a block others hold (a prefix-cache hit, a
        fork) stays theirs, unchanged, and a cached one stays findable in the prefix cache."""
        req = self._reqs[req_id]
        indices = sorted(set(indices))
        if not indices:
            return
        if indices[0] < 0 or indices[-1] >= len(req.blocks):
            raise IndexError(f"block indices {indices} are outside request {req_id!r}'s {len(req.blocks)} blocks")
        dropped = [req.blocks[i] for i in indices]
        for i in reversed(indices):
            del req.blocks[i]
        self._stop_caching(req, indices[0])
        self.pool.free(reversed(dropped))

    def compact(self, req_id: Hashable, keep: Sequence[int]) -> list[tuple[int, int]] | None:
        """KV eviction at token granularity: the request keeps only its KV entries at indices
        `keep` (ascending), in that order. Leading blocks kept whole stay in place; the other kept
        entries are packed into fresh blocks and every block after the leading ones is released
        (never written: shared and cached blocks stay as they are). Returns the (src slot, dst slot)
        moves the runner makes before anything else of the next step, or None, changing nothing,
        when the pool has too few free blocks."""
        req = self._reqs[req_id]
        bs = self.block_size
        lead = 0
        while lead < len(keep) and keep[lead] == lead:
            lead += 1
        lead_blocks = lead // bs
        rest = keep[lead_blocks * bs:]
        need = -(-len(rest) // bs)
        if need > self.pool.num_free_blocks():
            return None
        fresh = self.pool.get_new_blocks(need)
        moves = [(req.blocks[x // bs] * bs + x % bs, fresh[j // bs] * bs + j % bs) for j, x in enumerate(rest)]
        released = req.blocks[lead_blocks:]
        req.blocks = req.blocks[:lead_blocks] + fresh
        self._stop_caching(req, lead_blocks)
        self.pool.free(reversed(released))
        return moves

    def free(self, req_id: Hashable) -> None:
        """Releases all of the request's blocks, last first, and forgets the request."""
        req = self._reqs.pop(req_id, None)
        if req is not None:
            self.pool.free(reversed(req.blocks))

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pool integrity, plus: each block's refcount equals the number of table entries
        holding it, and cached table prefixes agree with the pool's hashes."""
        self.pool.check_integrity()
        holdings: Counter[int] = Counter()
        for req_id, req in self._reqs.items():
            holdings.update(req.blocks)
            assert 0 <= req.num_cached <= len(req.blocks), (
                f"request {req_id!r} counts {req.num_cached} cached blocks of {len(req.blocks)}")
            assert req.num_cached <= len(req.hashes), (
                f"request {req_id!r} counts {req.num_cached} cached blocks but has {len(req.hashes)} hashes")
            for i in range(req.num_cached):
                # A duplicate of content another block caches stays unhashed.
                block_hash = self.pool.block_hash(req.blocks[i])
                assert block_hash in (None, req.hashes[i]), (
                    f"request {req_id!r} block {i} (id {req.blocks[i]}) is cached under another hash")
        for block_id in range(self.pool.num_blocks):
            rc = self.pool.refcount(block_id)
            assert rc == holdings[block_id], (
                f"block {block_id} has refcount {rc} but {holdings[block_id]} table entries hold it")
        total = sum(self.pool.refcount(b) for b in range(self.pool.num_blocks))
        assert total == sum(holdings.values()), (
            f"refcounts sum to {total} but tables hold {sum(holdings.values())} entries")

    # -- internals -------------------------------------------------------------------

    def _state(self, req_id: Hashable, extra_key: object) -> _Request:
        req = self._reqs.get(req_id)
        if req is None:
            req = self._reqs[req_id] = _Request(extra_key=extra_key)
        elif extra_key is not None and extra_key != req.extra_key:
            if req.blocks:
                raise ValueError(f"request {req_id!r} already uses a different extra key")
            req.extra_key, req.hashes = extra_key, []
        return req

    @staticmethod
    def _stop_caching(req: _Request, first_changed: int) -> None:
        req.evicted = True
        req.num_cached = min(req.num_cached, first_changed)
        del req.hashes[req.num_cached:]

    def _extend_hashes(self, req: _Request, token_ids: Sequence[int], num_blocks: int) -> None:
        """Memoised chain: hashes only the blocks not hashed before."""
        bs = self.block_size
        for i in range(len(req.hashes), num_blocks):
            parent = req.hashes[i - 1] if i else None
            req.hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], req.extra_key))

    def _check_prefix(self, req_id: Hashable, req: _Request | None, prefix: PrefixHit | None,
                      num_computed: int) -> list[int]:
        """The prefix blocks to touch, after checking the hit is still valid for this request."""
        if prefix is None or not prefix.block_ids:
            return []
        if req is None or req.blocks:
            raise ValueError(f"a prefix hit is only accepted on request {req_id!r}'s first allocation, "
                             f"after find_prefix for it")
        if prefix.num_tokens != len(prefix.block_ids) * self.block_size:
            raise ValueError(f"prefix hit covers {len(prefix.block_ids)} blocks but claims {prefix.num_tokens} tokens")
        if num_computed < prefix.num_tokens:
            raise ValueError(f"num_computed ({num_computed}) must include the {prefix.num_tokens} prefix-hit tokens")
        # Blocks may have been evicted and reused since find_prefix; never adopt those.
        for i, block_id in enumerate(prefix.block_ids):
            if i >= len(req.hashes) or self.pool.block_hash(block_id) != req.hashes[i]:
                raise ValueError(f"stale prefix hit for request {req_id!r}: block {block_id} no longer "
                                 f"caches block {i} of its tokens")
        return list(prefix.block_ids)
