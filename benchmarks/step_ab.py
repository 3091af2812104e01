"""Whole decode steps at batch 8 and 32 with this tree's kernels and another checkout's, in one
process: one engine (this tree's Python), whose kernel module is switched between the two builds
run by run, in alternating rounds (a shared machine's drift then falls on both alike). Only the
compiled kernels differ, so the ratio is theirs. Reports, per batch and build, the best round's
tok/s and ms per decode step (benchmarks/step_profile.py's run: N requests of 128-token prompts,
greedy past EOS, decode steps only).

Usage (repository root): PYTHONPATH=. python benchmarks/step_ab.py --before /work/main [--rounds 3]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from attn_batch import kernels_of
from step_profile import run, step_arguments

from loom import kernels
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


def main() -> None:
    ap = step_arguments(argparse.ArgumentParser())
    ap.add_argument("--before", required=True, help="another checkout whose kernels to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    after = kernels.load()
    if after is None:
        raise SystemExit(f"no kernels: {kernels.unavailable_reason()}")
    switch = Switch({"before": Older(kernels_of(args.before).build(kernels.variant())), "after": after})
    kernels._module = switch   # every layer built from here on calls through the switch
    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    if not all(hasattr(b, "decode_layers") for b in switch.builds.values()):
        engine.runner.model.stack = None   # a build from before decode_layers: both take the Python loop
    run(engine, 4, 4, args.prompt_len, defaultdict(float))   # warm-up: first calls, page faults
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
