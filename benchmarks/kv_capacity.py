"""Concurrent 2,048-token sequences that fit a fixed KV budget, per kv_cache_dtype, from the engine's
own sizing (blocks = budget // (bytes per token * block size), each sequence whole blocks).
Usage: python benchmarks/kv_capacity.py [BUDGET_GIB] [SEQ_TOKENS]"""

from __future__ import annotations

import sys

from loom.config import EngineConfig
from loom.engine.engine import Engine

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
seq = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
print(f"| model | KV cache | bytes / token | KV blocks in {budget:g} GiB | {seq}-token sequences | vs float16 |")
print("|---|---|---|---|---|---|")
for model in ("smollm2-135m", "gemma3-270m"):
    base = None
    for kv in ("float16", "int8", "int4"):
        engine = Engine(EngineConfig.create(model, kv_cache_memory=int(budget * (1 << 30)), kv_cache_dtype=kv,
                                            max_model_len=seq + 64))
        per_token = engine.runner.kv_bytes_per_token(engine.model.cfg, engine.kv_dtype)
        bs = engine.config.cache.block_size
        fits = engine.runner.num_blocks // -(-(seq + 1) // bs)
        base = base or fits
        print(f"| {model} | {kv} | {per_token:,} | {engine.runner.num_blocks:,} | {fits} | {fits / base:.2f}x |")
