"""Paged KV-cache bookkeeping: the block pool and the per-request manager over it."""

from loom.kv.block_pool import BlockHash, BlockPool, NoFreeBlocksError, hash_block_tokens, hash_request_blocks
from loom.kv.manager import Allocation, KVCacheManager, PrefixCacheStats, PrefixHit

__all__ = [
    "Allocation",
    "BlockHash",
    "BlockPool",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "PrefixHit",
    "hash_block_tokens",
    "hash_request_blocks",
]
