"""KVCacheManager: block tables, prefix caching, copy-on-write forks, drafts, trimming.

Assertions name exact block ids: a fresh pool hands out 0, 1, 2, ... and freed blocks
rejoin the free queue at its end, last block first.
"""

import random

import pytest

from loom.kv import Allocation, KVCacheManager, PrefixHit, hash_request_blocks

BS = 4


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def assert_all_free(m: KVCacheManager) -> None:
    m.check_integrity()
    assert m.num_free_blocks() == m.pool.num_blocks
    assert m.usage() == 0.0


def pool_snapshot(m: KVCacheManager):
    pool = m.pool
    return (pool.free_block_ids(), [pool.refcount(b) for b in range(pool.num_blocks)],
            [pool.block_hash(b) for b in range(pool.num_blocks)])


# -- allocation ----------------------------------------------------------------------

def test_allocation_grows_the_table_in_block_id_order():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    t = toks(10)
    assert m.allocate("a", t, 0, 6) == Allocation([0, 1], [])
    assert m.block_table("a") == [0, 1]
    assert m.allocate("a", t, 6, 2) == Allocation([], [])  # fills block 1 exactly
    assert m.allocate("a", t, 8, 2) == Allocation([2], [])
    assert m.allocate("b", toks(3, 500), 0, 3) == Allocation([3], [])
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [3]
    assert m.slot("a", 0) == 0 and m.slot("a", 5) == 5 and m.slot("a", 9) == 2 * BS + 1
    assert m.slot("b", 2) == 3 * BS + 2
    with pytest.raises(IndexError):
        m.slot("b", 4)
    assert m.num_free_blocks() == 4 and m.usage() == 0.5
    m.check_integrity()
    m.free("a")
    m.free("b")
    assert_all_free(m)
    assert m.block_table("a") == []


def test_allocate_out_of_blocks_returns_none_and_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    m.allocate("a", toks(12), 0, 12)  # caches blocks 0, 1, 2
    m.free("a")  # free queue: 3, 2, 1, 0
    m.allocate("x", toks(4, 900), 0, 4)  # takes block 3
    b = toks(16)  # a's 12 tokens and 4 more
    hit = m.find_prefix("b", b)
    assert hit == PrefixHit([0, 1, 2], 12)
    before = pool_snapshot(m)
    # Reviving the 3 free hit blocks plus 1 new block needs 4 free blocks; 3 are.
    assert m.allocate("b", b, 12, 4, prefix=hit) is None
    assert pool_snapshot(m) == before
    assert m.block_table("b") == []
    assert m.allocate("c", toks(20, 300), 0, 20) is None
    assert pool_snapshot(m) == before
    assert m.block_table("c") == []
    m.check_integrity()
    # Room once x leaves; the hit is still valid (freeing evicts nothing).
    m.free("x")
    assert m.allocate("b", b, 12, 4, prefix=hit) == Allocation([3], [])
    assert m.block_table("b") == [0, 1, 2, 3]
    assert [m.pool.refcount(i) for i in range(4)] == [1, 1, 1, 1]
    m.free("b")
    assert_all_free(m)


def test_allocate_rejects_inconsistent_arguments():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    with pytest.raises(ValueError):
        m.allocate("a", toks(4), -1, 4)
    with pytest.raises(ValueError):
        m.allocate("a", toks(4), 0, 4, num_committed=5)
    with pytest.raises(ValueError):
        m.allocate("a", toks(8), 4, 4)  # claims 4 computed tokens but holds no blocks
    assert_all_free(m)


# -- prefix caching ------------------------------------------------------------------

def test_two_requests_sharing_two_and_a_half_blocks_hit_two():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    shared = toks(10)
    a = shared + toks(3, 500)
    b = shared + toks(3, 600)
    hit_a = m.find_prefix("a", a)
    assert hit_a == PrefixHit([], 0)
    assert m.allocate("a", a, 0, len(a), prefix=hit_a) == Allocation([0, 1, 2, 3], [])
    hit_b = m.find_prefix("b", b)
    # Block 2 holds shared[8:10] followed by a's own tokens: no hit there.
    assert hit_b == PrefixHit([0, 1], 8)
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (0, 0)   # a lookup counts when admitted
    for prompt, hit in ((a, hit_a), (b, hit_b)):
        m.count_lookup(len(prompt), hit.num_tokens)
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (26, 8)
    assert m.allocate("b", b, 8, 5, prefix=hit_b) == Allocation([4, 5], [])
    assert m.block_table("b") == [0, 1, 4, 5]
    assert [m.pool.refcount(i) for i in range(6)] == [2, 2, 1, 1, 1, 1]
    m.check_integrity()
    m.free("a")
    assert [m.pool.refcount(i) for i in range(6)] == [1, 1, 0, 0, 1, 1]
    m.free("b")
    assert_all_free(m)


def test_prefix_hit_revives_free_cached_blocks():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    m.allocate("a", toks(9), 0, 9)  # [0, 1, 2], blocks 0 and 1 cached
    m.free("a")
    assert m.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    hit = m.find_prefix("b", toks(9))
    assert hit == PrefixHit([0, 1], 8)
    assert m.allocate("b", toks(9), 8, 1, prefix=hit) == Allocation([3], [])
    assert m.block_table("b") == [0, 1, 3]
    assert m.pool.free_block_ids() == [4, 5, 2]
    m.free("b")
    assert_all_free(m)


def test_a_hit_never_covers_the_whole_prompt():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", toks(8), 0, 8)
    assert m.pool.lookup(hash_request_blocks(toks(8), BS)[1]) == 1  # both blocks cached
    assert m.find_prefix("b", toks(8)) == PrefixHit([0], 4)
    assert m.find_prefix("c", toks(9)) == PrefixHit([0, 1], 8)
    assert m.find_prefix("d", toks(4)) == PrefixHit([], 0)
    assert m.find_prefix("e", []) == PrefixHit([], 0)
    for r in "abcde":
        m.free(r)
    assert_all_free(m)


def test_same_block_tokens_after_different_preceding_tokens_do_not_hit():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 0], 0, 9)
    # Block [5, 6, 7, 8] is cached as "after [1, 2, 3, 4]" only.
    assert m.find_prefix("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == PrefixHit([], 0)
    assert m.pool.lookup(hash_request_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)[1]) is None
    assert m.find_prefix("c", [5, 6, 7, 8, 0]) == PrefixHit([], 0)
    assert m.find_prefix("d", [1, 2, 3, 4, 5, 6, 7, 9, 0]) == PrefixHit([0], 4)
    for r in "abcd":
        m.free(r)
    assert_all_free(m)


def test_extra_key_separates_identical_prompts():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    t = toks(9)
    hit = m.find_prefix("a", t, extra_key="lora-1")
    m.allocate("a", t, 0, 9, prefix=hit)
    assert m.find_prefix("b", t) == PrefixHit([], 0)
    assert m.find_prefix("c", t, extra_key="lora-2") == PrefixHit([], 0)
    assert m.find_prefix("d", t, extra_key="lora-1") == PrefixHit([0, 1], 8)
    # The key can also be given at the first allocation, without a find_prefix.
    m.allocate("e", toks(9, 300), 0, 9, extra_key="tenant-7")
    assert m.find_prefix("f", toks(9, 300)) == PrefixHit([], 0)
    assert m.find_prefix("g", toks(9, 300), extra_key="tenant-7") == PrefixHit([3, 4], 8)
    with pytest.raises(ValueError):
        m.allocate("a", t, 9, 1, extra_key="lora-2")
    for r in "abcdefg":
        m.free(r)
    assert_all_free(m)


def test_stale_prefix_hit_is_refused():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    m.allocate("a", toks(9), 0, 9)
    m.free("a")  # free queue: 2, 1, 0; blocks 0 and 1 cached
    hit = m.find_prefix("b", toks(9))
    assert hit == PrefixHit([0, 1], 8)
    m.allocate("x", toks(12, 700), 0, 12)  # evicts and reuses blocks 2, 1, 0
    m.free("x")
    with pytest.raises(ValueError, match="stale"):
        m.allocate("b", toks(9), 8, 1, prefix=hit)
    m.free("b")
    assert_all_free(m)


def test_prefix_is_only_accepted_on_the_first_allocation():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", toks(9), 0, 9)
    hit = m.find_prefix("b", toks(9))
    m.allocate("b", toks(9), 8, 1, prefix=hit)
    with pytest.raises(ValueError):
        m.allocate("b", toks(9), 9, 1, prefix=hit)
    with pytest.raises(ValueError):
        m.allocate("c", toks(9), 4, 5, prefix=m.find_prefix("c", toks(9)))  # skips hit tokens
    for r in "abc":
        m.free(r)
    assert_all_free(m)


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    m.allocate("a", toks(9), 0, 9)
    assert m.find_prefix("b", toks(9)) == PrefixHit([], 0)
    m.count_lookup(9, 0)
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (0, 0)
    assert all(m.pool.block_hash(b) is None for b in range(8))
    m.free("a")
    m.free("b")
    assert_all_free(m)


# -- forks and copy-on-write ---------------------------------------------------------

def test_fork_then_child_writes_into_shared_partial_block():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    p = toks(6)
    m.allocate("p", p, 0, 6)  # [0, 1]; block 1 is partial
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1]
    assert (m.pool.refcount(0), m.pool.refcount(1)) == (2, 2)
    m.check_integrity()
    assert m.allocate("c", p + [7777], 6, 1) == Allocation([], [(1, 2)])
    assert m.block_table("c") == [0, 2]
    assert m.block_table("p") == [0, 1]
    assert [m.pool.refcount(i) for i in range(3)] == [2, 1, 1]
    m.check_integrity()
    # The parent is the only holder of block 1 now: it writes in place.
    assert m.allocate("p", p + [8888], 6, 1) == Allocation([], [])
    assert m.block_table("p") == [0, 1]
    m.free("p")
    m.free("c")
    assert_all_free(m)


def test_parent_writing_first_gets_the_copy():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("p", toks(6), 0, 6)
    m.fork("p", "c")
    assert m.allocate("p", toks(7), 6, 1) == Allocation([], [(1, 2)])
    assert m.block_table("p") == [0, 2] and m.block_table("c") == [0, 1]
    assert m.allocate("c", toks(6) + [5], 6, 1) == Allocation([], [])
    m.free("c")
    m.free("p")
    assert_all_free(m)


def test_fork_then_child_writes_into_a_fresh_block_needs_no_copy():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    p = toks(8)
    m.allocate("p", p, 0, 8)  # [0, 1], both full
    m.fork("p", "c")
    assert m.allocate("c", p + [1], 8, 1) == Allocation([2], [])
    assert m.block_table("c") == [0, 1, 2]
    assert [m.pool.refcount(i) for i in range(3)] == [2, 2, 1]
    m.free("p")
    assert [m.pool.refcount(i) for i in range(3)] == [1, 1, 1]
    m.free("c")
    assert_all_free(m)


def test_child_write_spanning_shared_and_new_blocks():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("p", toks(6), 0, 6)
    m.fork("p", "c")
    assert m.allocate("c", toks(6) + [1, 2, 3, 4], 6, 4) == Allocation([3], [(1, 2)])
    assert m.block_table("c") == [0, 2, 3]
    m.free("p")
    m.free("c")
    assert_all_free(m)


def test_copy_on_write_needs_a_free_block():
    m = KVCacheManager(num_blocks=2, block_size=BS)
    m.allocate("p", toks(6), 0, 6)
    m.fork("p", "c")
    before = pool_snapshot(m)
    assert m.allocate("c", toks(7), 6, 1) is None
    assert pool_snapshot(m) == before and m.block_table("c") == [0, 1]
    m.free("p")
    m.free("c")
    assert_all_free(m)


def test_rewriting_a_cached_block_after_trim_copies_it():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", toks(8), 0, 8)  # [0, 1], both cached
    old_hash = m.pool.block_hash(1)
    m.trim("a", 6)
    assert m.block_table("a") == [0, 1]
    # Positions 6, 7 get new tokens: block 1 must keep serving the cached content.
    assert m.allocate("a", toks(6) + [55, 56], 6, 2) == Allocation([], [(1, 2)])
    assert m.block_table("a") == [0, 2]
    assert m.pool.refcount(1) == 0 and m.pool.lookup(old_hash) == 1
    assert m.pool.lookup(hash_request_blocks(toks(6) + [55, 56], BS)[1]) == 2
    assert m.find_prefix("b", toks(9)) == PrefixHit([0, 1], 8)
    m.free("a")
    m.free("b")
    assert_all_free(m)


def test_rewriting_cached_positions_without_trim_copies_and_recaches():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", toks(8), 0, 8)  # [0, 1], both cached
    old = hash_request_blocks(toks(8), BS)
    new_tokens = toks(4) + [1, 2, 3, 4]
    assert m.allocate("a", new_tokens, 4, 4) == Allocation([], [(1, 2)])
    assert m.pool.lookup(old[1]) == 1
    assert m.pool.lookup(hash_request_blocks(new_tokens, BS)[1]) == 2
    m.check_integrity()
    m.free("a")
    assert_all_free(m)


def test_fork_errors():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    with pytest.raises(KeyError):
        m.fork("nope", "c")
    m.allocate("p", toks(4), 0, 4)
    m.allocate("q", toks(4), 0, 4)
    with pytest.raises(ValueError):
        m.fork("p", "q")
    m.free("p")
    m.free("q")
    assert_all_free(m)


# -- drafts and trimming -------------------------------------------------------------

def test_draft_tokens_are_never_cached():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    committed = toks(5)
    drafts = [900, 901, 902]
    ids = committed + drafts
    assert m.allocate("a", ids, 0, 8, num_committed=5) == Allocation([0, 1], [])
    assert m.pool.lookup(hash_request_blocks(ids, BS)[0]) == 0
    assert m.pool.block_hash(1) is None
    assert m.pool.lookup(hash_request_blocks(ids, BS)[1]) is None
    assert m.find_prefix("b", ids + [1]) == PrefixHit([0], 4)
    # Drafts accepted: they are committed tokens now and their block gets cached.
    ids2 = ids + [903]
    assert m.allocate("a", ids2, 8, 1) == Allocation([2], [])
    assert m.pool.lookup(hash_request_blocks(ids2, BS)[1]) == 1
    m.free("a")
    m.free("b")
    assert_all_free(m)


def test_rejected_drafts_are_trimmed_and_their_block_cached_with_the_real_tokens():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    committed = toks(7, 200)
    ids = committed + [1, 2, 3, 4, 5]
    assert m.allocate("a", ids, 0, 12, num_committed=7) == Allocation([0, 1, 2], [])
    m.trim("a", 7)  # every draft rejected
    assert m.block_table("a") == [0, 1]
    assert m.pool.free_block_ids()[-1] == 2
    real = committed + [42]
    assert m.allocate("a", real, 7, 1) == Allocation([], [])
    assert m.pool.lookup(hash_request_blocks(ids, BS)[1]) is None
    assert m.pool.lookup(hash_request_blocks(real, BS)[1]) == 1
    m.free("a")
    assert_all_free(m)


def test_trim_frees_exactly_the_tail_blocks_last_first():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("a", toks(17), 0, 17)  # [0, 1, 2, 3, 4]
    assert m.pool.free_block_ids() == [5, 6, 7]
    m.trim("a", 9)
    assert m.block_table("a") == [0, 1, 2]
    assert m.pool.free_block_ids() == [5, 6, 7, 4, 3]
    m.trim("a", 8)
    assert m.block_table("a") == [0, 1]
    assert m.pool.free_block_ids() == [5, 6, 7, 4, 3, 2]
    m.trim("a", 8)
    m.trim("a", 100)
    assert m.block_table("a") == [0, 1]
    m.check_integrity()
    m.trim("a", 0)
    assert m.block_table("a") == []
    assert m.pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1, 0]
    m.free("a")
    assert_all_free(m)


def test_trim_of_a_forked_table_keeps_the_other_holder():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate("p", toks(10), 0, 10)
    m.fork("p", "c")
    m.trim("c", 3)
    assert m.block_table("c") == [0] and m.block_table("p") == [0, 1, 2]
    assert [m.pool.refcount(i) for i in range(3)] == [2, 1, 1]
    m.free("p")
    m.free("c")
    assert_all_free(m)


# -- integrity -----------------------------------------------------------------------

def test_check_integrity_catches_a_table_holding_an_unreferenced_block():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    m.allocate("a", toks(4), 0, 4)
    m._reqs["a"].blocks.append(3)
    with pytest.raises(AssertionError, match="block 3"):
        m.check_integrity()


def test_no_leaks_after_a_mixed_workload():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    m.allocate("a", toks(10), 0, 10)
    m.fork("a", "b")
    m.allocate("b", toks(10) + [1], 10, 1)
    hit = m.find_prefix("c", toks(11))
    m.allocate("c", toks(11), hit.num_tokens, 11 - hit.num_tokens, prefix=hit)
    m.allocate("d", toks(9) + [5, 6, 7], 0, 12, num_committed=9)
    m.trim("d", 10)
    for r in "dbca":
        m.check_integrity()
        m.free(r)
    assert_all_free(m)
    m.free("a")  # freeing twice is harmless
    assert_all_free(m)


# -- randomized stress ---------------------------------------------------------------

class _Sim:
    """Drives a manager like a scheduler and runner would, tracking which token's KV each
    slot physically holds, so that any write into a block someone else relies on, or a
    prefix hit returning wrong content, shows up as a KV mismatch."""

    def __init__(self, seed: int, num_blocks: int, caching: bool):
        self.rng = random.Random(seed)
        self.m = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
        self.kv: list[int | None] = [None] * (num_blocks * BS)
        self.live: dict[int, tuple[list[int], int, object]] = {}  # id -> (tokens, computed, extra)
        self.waiting: list[tuple[list[int], object]] = []  # preempted requests to restart
        self.next_id = 0
        self.events = {"hit_blocks": 0, "copies": 0, "none": 0, "forks": 0, "trims": 0}
        # A tiny vocabulary makes equal blocks under different parents common.
        self.templates = [[self.rng.randrange(4) for _ in range(self.rng.randrange(0, 15))] for _ in range(4)]

    def snapshot(self):
        return pool_snapshot(self.m), {r: self.m.block_table(r) for r in self.live}

    def run_step(self, rid: int, tokens: list[int], computed: int, num_new: int, prefix=None,
                 drafts: list[int] = (), extra=None) -> Allocation | None:
        ids = tokens + list(drafts)
        before = self.snapshot()
        alloc = self.m.allocate(rid, ids, computed, num_new + len(drafts), prefix=prefix,
                                num_committed=len(tokens), extra_key=extra)
        if alloc is None:
            assert self.snapshot() == before
            self.events["none"] += 1
            return None
        for src, dst in alloc.copies:
            self.kv[dst * BS:(dst + 1) * BS] = self.kv[src * BS:(src + 1) * BS]
        self.events["copies"] += len(alloc.copies)
        for pos in range(computed, computed + num_new + len(drafts)):
            self.kv[self.m.slot(rid, pos)] = ids[pos]
        return alloc

    def op_new(self) -> None:
        rng = self.rng
        if self.waiting and rng.random() < 0.5:
            tokens, extra = self.waiting.pop(rng.randrange(len(self.waiting)))
        else:
            tokens = rng.choice(self.templates) + [rng.randrange(4) for _ in range(rng.randint(1, 12))]
            extra = rng.choice([None, None, "x"])
        rid = self.next_id
        self.next_id += 1
        hit = self.m.find_prefix(rid, tokens, extra_key=extra)
        self.m.count_lookup(len(tokens), hit.num_tokens)
        assert hit.num_tokens < len(tokens)
        for i, b in enumerate(hit.block_ids):
            assert self.kv[b * BS:(b + 1) * BS] == tokens[i * BS:(i + 1) * BS], "prefix hit served wrong KV"
        self.events["hit_blocks"] += len(hit.block_ids)
        num_new = rng.randint(1, len(tokens) - hit.num_tokens)
        if self.run_step(rid, tokens, hit.num_tokens, num_new, prefix=hit, extra=extra) is None:
            self.m.free(rid)
            self.waiting.append((tokens, extra))
            self.preempt()
            return
        computed = hit.num_tokens + num_new
        if computed == len(tokens):
            tokens = tokens + [rng.randrange(4)]
        self.live[rid] = (tokens, computed, extra)

    def op_step(self, rid: int) -> None:
        rng = self.rng
        tokens, computed, extra = self.live[rid]
        chunk = rng.randint(1, len(tokens) - computed)
        drafts: list[int] = []
        if computed + chunk == len(tokens) and rng.random() < 0.4:
            drafts = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        if self.run_step(rid, tokens, computed, chunk, drafts=drafts) is None:
            self.preempt()
            return
        accepted = rng.randint(0, len(drafts))
        tokens = tokens + drafts[:accepted]
        computed += chunk + accepted
        if accepted < len(drafts):
            self.m.trim(rid, computed)
        if computed == len(tokens):
            tokens = tokens + [rng.randrange(4)]
        if len(tokens) > 80:
            self.m.free(rid)
            del self.live[rid]
        else:
            self.live[rid] = (tokens, computed, extra)

    def op_fork(self, rid: int) -> None:
        tokens, computed, extra = self.live[rid]
        child = self.next_id
        self.next_id += 1
        self.m.fork(rid, child)
        # The last token is not computed yet, so the child may sample a different one.
        self.live[child] = (tokens[:-1] + [self.rng.randrange(4)], computed, extra)
        self.events["forks"] += 1

    def op_trim(self, rid: int) -> None:
        tokens, computed, extra = self.live[rid]
        keep = self.rng.randint(0, computed)
        self.m.trim(rid, keep)
        self.live[rid] = (tokens[:keep] + [self.rng.randrange(4)], keep, extra)
        self.events["trims"] += 1

    def preempt(self) -> None:
        if self.live:
            victim = self.rng.choice(list(self.live))
            tokens, _, extra = self.live.pop(victim)
            self.m.free(victim)
            self.waiting.append((tokens, extra))

    def check(self) -> None:
        self.m.check_integrity()
        for rid, (tokens, computed, _) in self.live.items():
            assert computed < len(tokens)
            assert len(self.m.block_table(rid)) >= -(-computed // BS)
            for pos in range(computed):
                assert self.kv[self.m.slot(rid, pos)] == tokens[pos], f"request {rid} lost its KV at {pos}"

    def run(self, num_ops: int) -> None:
        rng = self.rng
        for _ in range(num_ops):
            r = rng.random()
            if not self.live or r < 0.2:
                self.op_new()
            else:
                rid = rng.choice(list(self.live))
                if r < 0.75:
                    self.op_step(rid)
                elif r < 0.85:
                    self.op_fork(rid)
                elif r < 0.93:
                    self.op_trim(rid)
                else:
                    self.m.free(rid)
                    del self.live[rid]
            self.check()
        for rid in list(self.live):
            self.m.free(rid)
            self.m.check_integrity()
        self.live.clear()
        assert_all_free(self.m)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_operations_keep_the_cache_consistent(seed):
    sim = _Sim(seed, num_blocks=40, caching=True)
    sim.run(2500)
    assert all(n > 0 for n in sim.events.values()), sim.events
    stats = sim.m.stats
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries


@pytest.mark.parametrize("seed", range(2))
def test_randomized_operations_without_prefix_caching(seed):
    sim = _Sim(100 + seed, num_blocks=30, caching=False)
    sim.run(1500)
    assert sim.events["hit_blocks"] == 0 and sim.events["copies"] > 0
