"""BlockPool: exact block ids, refcounts and eviction order; stable chained block hashes."""

import subprocess
import sys
from pathlib import Path

import pytest

from loom.errors import LoomError
from loom.kv import BlockPool, NoFreeBlocksError, hash_block_tokens, hash_request_blocks

REPO_ROOT = Path(__file__).resolve().parents[1]


def h(*tokens: int):
    return hash_block_tokens(None, tokens)


# -- allocation and freeing ----------------------------------------------------------

def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(8)
    assert pool.num_free_blocks() == 8
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(2) == [3, 4]
    assert [pool.refcount(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks() == 3
    assert pool.usage() == pytest.approx(5 / 8)
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_too_many_blocks_raises_and_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(NoFreeBlocksError) as err:
        pool.get_new_blocks(2)
    assert isinstance(err.value, LoomError)
    assert (err.value.wanted, err.value.free) == (2, 1)
    assert pool.num_free_blocks() == 1
    assert pool.free_block_ids() == [3]
    pool.check_integrity()


def test_reverse_free_makes_the_tail_block_evicted_first():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)  # [0, 1, 2]
    pool.free(reversed(blocks))
    # Never-used blocks first, then the request's tail, its prefix last.
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.get_new_blocks(4) == [3, 4, 5, 2]
    assert pool.get_new_blocks(1) == [1]
    pool.check_integrity()


def test_eviction_drops_the_hash_of_the_reused_block_only():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_blocks(list(range(12)), 4)
    for b, bh in zip(blocks, hashes):
        pool.cache_block(b, bh)
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0]
    # Cached-but-free blocks are free.
    assert pool.num_free_blocks() == 3
    assert pool.get_new_blocks(1) == [2]
    assert pool.lookup(hashes[2]) is None
    assert pool.block_hash(2) is None
    assert pool.lookup(hashes[0]) == 0 and pool.lookup(hashes[1]) == 1
    pool.check_integrity()


def test_touch_revives_a_cached_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(1, h(7, 7))
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    pool.touch([pool.lookup(h(7, 7))])
    assert pool.refcount(1) == 1
    assert pool.free_block_ids() == [3, 2, 0]
    assert pool.num_free_blocks() == 3
    assert pool.lookup(h(7, 7)) == 1  # still cached while in use
    assert pool.get_new_blocks(3) == [3, 2, 0]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    pool.check_integrity()


def test_touch_on_a_used_block_only_counts_a_reference():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.touch([0, 0, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (3, 2)
    pool.free([0, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (2, 1)
    assert pool.free_block_ids() == [2]
    pool.check_integrity()


def test_free_below_zero_raises_and_frees_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block 1"):
        pool.free([0, 1, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (1, 1)
    with pytest.raises(ValueError):
        pool.free([2])
    with pytest.raises(ValueError):
        pool.free([3])
    pool.check_integrity()


def test_freed_block_goes_to_the_end_of_the_queue():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # [0, 1]
    pool.free([a[1]])
    assert pool.free_block_ids() == [2, 3, 1]
    pool.free([a[0]])
    assert pool.free_block_ids() == [2, 3, 1, 0]


# -- prefix cache map ----------------------------------------------------------------

def test_cache_block_keeps_the_existing_mapping_for_a_duplicate():
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    pool.cache_block(0, h(1, 2))
    pool.cache_block(1, h(1, 2))
    assert pool.lookup(h(1, 2)) == 0
    assert pool.block_hash(0) == h(1, 2)
    assert pool.block_hash(1) is None
    pool.cache_block(0, h(1, 2))  # same hash again: no-op
    with pytest.raises(ValueError):
        pool.cache_block(0, h(3, 4))
    with pytest.raises(ValueError):
        pool.cache_block(2, h(5, 6))  # free block
    pool.check_integrity()


def test_reused_duplicate_does_not_disturb_the_cached_block():
    pool = BlockPool(2)
    pool.get_new_blocks(2)
    pool.cache_block(0, h(1))
    pool.cache_block(1, h(1))
    pool.free([1, 0])
    assert pool.get_new_blocks(1) == [1]
    assert pool.lookup(h(1)) == 0
    pool.check_integrity()


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    pool.get_new_blocks(1)
    pool.cache_block(0, h(1))
    assert pool.lookup(h(1)) is None
    assert pool.block_hash(0) is None
    pool.check_integrity()


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(0, h(1))
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h(1)) == 0
    pool.free(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h(1)) is None and pool.block_hash(0) is None
    assert pool.free_block_ids() == [2, 1, 0]
    pool.check_integrity()


def test_usage_counts_blocks_in_use():
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.usage() == 1.0
    pool.free(blocks[:1])
    assert pool.usage() == 0.75


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError):
        BlockPool(n)


# -- integrity checks catch corruption -----------------------------------------------

def test_check_integrity_catches_a_used_block_in_the_free_queue():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    pool._free[0] = None
    with pytest.raises(AssertionError, match="block 0 has refcount 1 but is in the free queue"):
        pool.check_integrity()


def test_check_integrity_catches_a_lost_free_block():
    pool = BlockPool(3)
    del pool._free[2]
    with pytest.raises(AssertionError, match="block 2 has refcount 0 but is not in the free queue"):
        pool.check_integrity()


def test_check_integrity_catches_a_negative_refcount():
    pool = BlockPool(3)
    pool._refcount[1] = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_integrity()


def test_check_integrity_catches_a_hash_map_disagreement():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.cache_block(0, h(1))
    pool._cached[h(1)] = 1
    with pytest.raises(AssertionError, match="hash"):
        pool.check_integrity()


# -- block hashes --------------------------------------------------------------------

def test_block_hash_depends_on_parent_tokens_and_extra():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert base == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(base, bytes) and len(base) == 32
    parent = hash_block_tokens(None, [9, 9, 9, 9])
    variants = [
        hash_block_tokens(parent, [1, 2, 3, 4]),
        hash_block_tokens(None, [1, 2, 3, 5]),
        hash_block_tokens(None, [1, 2, 3]),
        hash_block_tokens(None, [1, 2, 3, 4], extra="lora-a"),
        hash_block_tokens(None, [1, 2, 3, 4], extra=""),
        hash_block_tokens(None, [1, 2, 3, 4], extra=0),
        hash_block_tokens(None, [1, 2, 3, 4], extra="0"),
        hash_block_tokens(None, [1, 2, 3, 4], extra=("a", "b")),
        hash_block_tokens(None, [1, 2, 3, 4], extra=("ab",)),
        hash_block_tokens(None, [1, 2, 3, 4], extra=b"ab"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    other_parent = hash_block_tokens(None, [9, 9, 9, 8])
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(other_parent, [1, 2])


def test_block_hash_rejects_unhashable_kinds_of_extra():
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], extra=1.5)


def test_hash_request_blocks_chains_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_request_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    assert hash_request_blocks(tokens[:3], 4) == []
    assert hash_request_blocks(tokens[:8], 4, extra="x") == [
        hash_block_tokens(None, tokens[0:4], "x"),
        hash_block_tokens(hash_block_tokens(None, tokens[0:4], "x"), tokens[4:8], "x"),
    ]


def test_block_hash_is_stable_across_processes():
    code = ("from loom.kv import hash_request_blocks;"
            "print(hash_request_blocks([5, 6, 7, 8, 9], 2, extra=('t', 1))[-1].hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {"PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert len(outs) == 1
    assert outs == {hash_request_blocks([5, 6, 7, 8, 9], 2, extra=("t", 1))[-1].hex()}
