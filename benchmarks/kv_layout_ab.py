"""Whole decode steps at batch 8 and 32 over the paged KV layout ([blocks, Hkv, block_size,
row]: a kv head's rows of a block contiguous) and over the slot-major one ([slots, Hkv, row]:
a slot's kv heads side by side, the layout before the paged one), in one process: one engine
whose cache tensors are swapped run by run, in rounds that alternate which goes first, so that a
shared machine's drift falls on both alike. The same kernels read both (a cache [slots, Hkv, row] is the paged
layout at block size 1); only where the rows lie differs. Prefix caching is off, so no run
starts on blocks another run wrote into the other tensors. Reports, per batch and layout, the
best round's tok/s and ms per decode step (benchmarks/step_profile.py's run).

Usage (repository root): [LOOM_KERNELS=avx2] PYTHONPATH=. python benchmarks/kv_layout_ab.py
    [--model smollm2-135m] [--batches 8,32] [--rounds 3]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from step_profile import run, step_arguments

from loom import kernels
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.kv_cache import KVCacheTensors


def main() -> None:
    ap = step_arguments(argparse.ArgumentParser())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model, threads=args.threads, enable_prefix_caching=False))
    runner = engine.runner
    paged = runner.kv
    slot_major = KVCacheTensors(runner.model.cfg, runner.num_blocks * runner.block_size, paged.format)
    layouts = [("slot-major", slot_major), ("paged", paged)]
    run(engine, 4, 4, args.prompt_len, defaultdict(float))   # warm-up: first calls, page faults
    best: dict = defaultdict(dict)
    for i in range(args.rounds):
        for b in (int(x) for x in args.batches.split(",")):
            for name, kv in layouts[::1 if i % 2 else -1]:   # each goes first every other round
                runner.kv = kv
                r = run(engine, b, args.new_tokens, args.prompt_len, defaultdict(float))
                if not best[b].get(name) or r["tok_s"] > best[b][name]["tok_s"]:
                    best[b][name] = r
    runner.kv = paged
    print(f"{args.model}, kernels {kernels.variant()}, block size {runner.block_size}, best of {args.rounds} rounds")
    for b, rs in best.items():
        s, p = rs["slot-major"], rs["paged"]
        print(f"batch {b}: slot-major {s['tok_s']:.0f} tok/s ({s['ms_per_step']:.1f} ms/step), paged "
              f"{p['tok_s']:.0f} tok/s ({p['ms_per_step']:.1f} ms/step), "
              f"paged/slot-major {p['tok_s'] / s['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
