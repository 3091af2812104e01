"""Whole decode steps at batch 8 and 32 with this tree's kernels and another checkout's, in one
process: one engine (this tree's Python), whose kernel module is switched between the two builds
run by run, in alternating rounds (a shared machine's drift then falls on both alike). Only the
compiled kernels differ, so the ratio is theirs. Reports, per batch and build, the best round's
tok/s and ms per decode step (benchmarks/step_profile.py's run: N requests of 128-token prompts,
greedy past EOS, decode steps only).

--scatter gives the engine a 1,024-block KV pool and first runs requests of random lengths
through it until three times its tokens have passed, so that its free blocks are out of order,
as a long-running server's are: each sequence's blocks are then scattered over the cache (a
fresh engine's are mostly consecutive).

Usage (repository root): PYTHONPATH=. python benchmarks/step_ab.py --before /work/main [--rounds 3] [--scatter]
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict

from attn_batch import kernels_of
from step_profile import run, step_arguments

from loom import SamplingParams, kernels
from loom.config import EngineConfig
from loom.engine.engine import Engine


class Older:
    """A build from before qgemm took the matrix's zero point (its last argument): called
    without it, so that the affine path runs there, as it did."""

    def __init__(self, module):
        self.module = module
        self.takes_zero = "arg11" in (module.qgemm.__doc__ or "")

    def qgemm(self, *args):
        return self.module.qgemm(*(args if self.takes_zero else args[:11]))

    def __getattr__(self, attr):
        return getattr(self.module, attr)


class Switch:
    """A stand-in for the kernel module that forwards to whichever build `use` names."""

    def __init__(self, builds: dict):
        self.builds, self.current = builds, next(iter(builds))

    def use(self, name: str) -> None:
        self.current = name

    def __getattr__(self, attr):
        return getattr(self.builds[self.current], attr)


def scatter(engine: Engine, seed: int = 0) -> float:
    """Runs requests of random prompt and output lengths (some aborted early) to completion until
    three times the pool's tokens have passed through it, leaving its free blocks out of order;
    returns the share of consecutive block pairs in the tables of 32 fresh 256-token requests
    allocated afterwards."""
    rng = random.Random(seed)
    vocab, kv = engine.model.cfg.vocab_size, engine.scheduler.kv
    budget, ids = 3 * kv.pool.num_blocks * kv.block_size, []
    while budget > 0:
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(16, 400))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 96), ignore_eos=True)
        ids.append(engine.add_request(prompt, params))
        budget -= len(prompt) + params.max_tokens
        if len(ids) % 8 == 0:
            for _ in range(rng.randrange(1, 6)):
                engine.step()
            if rng.random() < 0.3:
                engine.abort(ids[rng.randrange(len(ids))])
    while engine.has_unfinished_requests():
        engine.step()
    pairs, runs = 0, 0
    for i in range(32):
        kv.allocate(f"probe-{i}", list(range(256)), 0, 256)
        table = kv.block_table(f"probe-{i}")
        pairs += len(table) - 1
        runs += sum(1 for a, b in zip(table, table[1:]) if b == a + 1)
    for i in range(32):
        kv.free(f"probe-{i}")
    return runs / max(pairs, 1)


def main() -> None:
    ap = step_arguments(argparse.ArgumentParser())
    ap.add_argument("--before", required=True, help="another checkout whose kernels to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scatter", action="store_true", help="scatter the KV pool's free blocks first (see above)")
    args = ap.parse_args()
    after = kernels.load()
    if after is None:
        raise SystemExit(f"no kernels: {kernels.unavailable_reason()}")
    switch = Switch({"before": Older(kernels_of(args.before).build(kernels.variant())), "after": after})
    kernels._module = switch   # every layer built from here on calls through the switch
    # scattered: a pool small enough to cycle through (32 rows of 256 + 64 tokens take 640 blocks)
    extra = {"num_blocks": 1024} if args.scatter else {}
    engine = Engine(EngineConfig.create(args.model, threads=args.threads, **extra))
    if not all(hasattr(b, "decode_layers") for b in switch.builds.values()):
        engine.runner.model.stack = None   # a build from before decode_layers: both take the Python loop
    run(engine, 4, 4, args.prompt_len, defaultdict(float))   # warm-up: first calls, page faults
    if args.scatter:
        print(f"free blocks scattered: {scatter(engine):.0%} of a fresh table's block pairs consecutive")
    best: dict = defaultdict(dict)
    for _ in range(args.rounds):
        for b in (int(x) for x in args.batches.split(",")):
            for name in ("before", "after"):
                switch.use(name)
                r = run(engine, b, args.new_tokens, args.prompt_len, defaultdict(float))
                if not best[b].get(name) or r["tok_s"] > best[b][name]["tok_s"]:
                    best[b][name] = r
    print(f"{args.model}, kernels {kernels.variant()}, best of {args.rounds} rounds")
    for b, rs in best.items():
        bt, at = rs["before"], rs["after"]
        print(f"batch {b}: before {bt['tok_s']:.0f} tok/s ({bt['ms_per_step']:.1f} ms/step), after "
              f"{at['tok_s']:.0f} tok/s ({at['ms_per_step']:.1f} ms/step), after/before {at['tok_s'] / bt['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
