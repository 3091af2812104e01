"""The physical KV-cache block pool: refcounts, the free queue and the prefix-cache map.

The pool knows nothing about requests or scheduling; it hands out block ids, counts
references to them, and remembers which full blocks hold which token content. Policy
(who gets blocks, when to preempt, which blocks to cache) lives in `KVCacheManager`.

Free queue, next evicted first::

    front                                                      end
    [ never used / long free ... | tail of req A | prefix of req A ]
      ^ get_new_blocks pops here                  free() appends here ^

A block whose refcount drops to 0 keeps its content and its hash: it stays findable by
`lookup` until `get_new_blocks` reuses it (evicting the hash) or `touch` revives it
(taking it out of the queue, wherever it is). Requests free their blocks tail first,
so a conversation's private tail is evicted before the prefix it shares with others.

Block hashes chain: a block's hash covers its parent's hash, so equal tokens after
different preceding tokens never share a hash. Digests are BLAKE2b, stable across
processes and runs (Python's `hash()` is salted per process and too short).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import NewType

from loom.errors import LoomError

BlockHash = NewType("BlockHash", bytes)

# 256-bit digests: a collision (one block's KV served for another's tokens) is not a
# realistic event at any cache size.
_DIGEST_SIZE = 32
_PERSON = b"loom.kv.block"


class NoFreeBlocksError(LoomError):
    """More blocks were asked of the pool than it has free."""

    def __init__(self, wanted: int, free: int):
        self.wanted = wanted
        self.free = free
        super().__init__(f"KV cache is full: {wanted} blocks wanted, {free} free")


def _encode_extra(value: object, out: bytearray) -> None:
    """Appends an unambiguous, process-independent encoding of an extra key.

    Each value is tagged with its type and length-prefixed, so e.g. "1" and 1, or
    ("a", "b") and ("ab",), never encode alike.
    """
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = str(value).encode("ascii")
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"S" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (bytes, bytearray)):
        out += b"B" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, (tuple, list)):
        out += b"L" + struct.pack("<I", len(value))
        for item in value:
            _encode_extra(item, out)
    else:
        raise TypeError(f"a block-hash extra key must be built from None, bool, int, str, bytes "
                        f"and tuples of them, got {type(value).__name__}")


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int], extra: object = None) -> BlockHash:
    """Hash of one block: its parent block's hash, its token ids and an optional extra key.

    `extra` separates caches that must not mix although the tokens agree (a LoRA
    adapter, a multimodal input, a tenant); it is built from None/bool/int/str/bytes and
    tuples of them.
    """
    buf = bytearray()
    if parent is None:
        buf += b"\x00"
    else:
        buf += b"\x01" + struct.pack("<I", len(parent)) + parent
    buf += struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens)
    _encode_extra(extra, buf)
    return BlockHash(hashlib.blake2b(bytes(buf), digest_size=_DIGEST_SIZE, person=_PERSON).digest())


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra: object = None) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block gets none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


class BlockPool:
    """Owns block ids 0..num_blocks-1: refcounts, a free queue in eviction (LRU) order, and
    the hash -> block map of the prefix cache.

    Invariants (verified by `check_integrity`):
      - a block is in the free queue exactly when its refcount is 0;
      - `lookup(h) == b` exactly when block b carries hash h; at most one block per hash;
      - with caching disabled no block carries a hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refcount: list[int] = [0] * num_blocks
        # Keys only; insertion order is eviction order and deletion is O(1) anywhere.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}

    # -- queries ---------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, cached or not: all of them can be handed out."""
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, next evicted first."""
        return list(self._free)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block_id is cached under, or None if it is not in the prefix cache."""
        self._check_id(block_id)
        return self._hash_of[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block caching this content, whether in use or free; None if not cached."""
        return self._cached.get(block_hash)

    def usage(self) -> float:
        """Fraction of blocks in use (refcount > 0)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    # -- mutations -------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Takes n blocks from the front of the free queue, each with refcount 1 and no hash.

        Raises NoFreeBlocksError, taking nothing, when fewer than n are free.
        """
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(n, len(self._free))
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._refcount[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block; a free block leaves the free queue (a cache hit
        revives it with its content)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
        for block_id in block_ids:
            if self._refcount[block_id] == 0:
                del self._free[block_id]
            self._refcount[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block, in the order given; a block reaching 0 joins the
        END of the free queue and stays cached.

        Pass a request's blocks last-first, so its tail is evicted before its prefix.
        Raises ValueError, freeing nothing, if some block would drop below 0.
        """
        block_ids = list(block_ids)
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if times > self._refcount[block_id]:
                raise ValueError(f"block {block_id} freed {times} time(s) but holds only "
                                 f"{self._refcount[block_id]} reference(s)")
        for block_id in block_ids:
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a FULL, in-use block as holding the content `block_hash` names.

        If another block already caches that hash, the existing mapping wins and this block
        stays an uncached duplicate. Re-registering a block under its own hash is a no-op;
        a block's content is fixed once full, so a different hash is an error.
        No-op when caching is disabled.
        """
        self._check_id(block_id)
        if not self.enable_caching:
            return
        if self._refcount[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only blocks in use can be cached")
        current = self._hash_of[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under a different hash")
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (returns False) while any block is in use,
        since its holders may still register or rely on those hashes."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return True

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first inconsistency found."""
        n_zero = 0
        for block_id, rc in enumerate(self._refcount):
            assert rc >= 0, f"block {block_id} has negative refcount {rc}"
            in_queue = block_id in self._free
            if rc == 0:
                n_zero += 1
                assert in_queue, f"block {block_id} has refcount 0 but is not in the free queue"
            else:
                assert not in_queue, f"block {block_id} has refcount {rc} but is in the free queue"
        assert len(self._free) == n_zero, (
            f"free queue holds {len(self._free)} entries but {n_zero} blocks have refcount 0")
        for block_id in self._free:
            assert 0 <= block_id < self.num_blocks, f"free queue holds unknown block id {block_id}"
        for block_hash, block_id in self._cached.items():
            assert 0 <= block_id < self.num_blocks, f"hash map points at unknown block id {block_id}"
            assert self._hash_of[block_id] == block_hash, (
                f"hash map points at block {block_id}, which carries a different hash")
        n_hashed = 0
        for block_id, block_hash in enumerate(self._hash_of):
            if block_hash is not None:
                n_hashed += 1
                assert self._cached.get(block_hash) == block_id, (
                    f"block {block_id} carries a hash the hash map does not point back from")
        assert n_hashed == len(self._cached), (
            f"{n_hashed} blocks carry hashes but the hash map has {len(self._cached)} entries")
        if not self.enable_caching:
            assert not self._cached, "caching is disabled but the hash map is not empty"

    # -- internals -------------------------------------------------------------------

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if not (isinstance(block_id, int) and 0 <= block_id < self.num_blocks):
            raise ValueError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")
