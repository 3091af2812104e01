"""Where a draft node's cost goes: one sequence's forward pass (output matrix included) with a
chain of k draft nodes, at a short and a long context, split by kernel.

Each draft node is one more row through every layer: the GEMMs read the same weights for it
(at a few rows they are bound by reading the weights, so a row costs little), but attention
reads the row's whole context again for its own queries. The split shows which of the two sets
the price of a node at each context length. Each point is the fastest of 15 passes, after one
warm-up pass per point; the kernel times are those of that fastest pass.

Run from the repository root: .venv/bin/python benchmarks/draft_row_cost.py [MODEL] [--threads N]
    [--contexts 64,512] [--nodes 0,1,2,4,8]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from loom import kernels
from loom.contracts import ScheduledSeq

PASSES = 15


class Timed:
    """The kernel module with every call's wall time added to `totals` by name."""

    def __init__(self, module, totals: dict[str, float]):
        self.module, self.totals = module, totals

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t0

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--nodes", default="0,1,2,4,8")
    args = ap.parse_args()
    totals: dict[str, float] = defaultdict(float)
    module = kernels.load()
    if module is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    kernels._module = Timed(module, totals)   # before the model binds the module
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    engine.runner.model.stack = None   # the layers' calls one by one, each timed (not in one decode_layers)
    runner, vocab = engine.runner, engine.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    nodes = [int(k) for k in args.nodes.split(",")]

    def seq(context: int, k: int) -> list[ScheduledSeq]:   # a chain of k nodes after one new token
        blocks = -(-(context + k + 1) // runner.block_size)
        return [ScheduledSeq("cost", torch.randint(vocab, (1 + k,), generator=gen).tolist(), context,
                             list(range(blocks)), True, tuple(range(-1, k - 1)))]

    print(f"{args.model}, kernels {kernels.variant()}, {args.threads} threads; one sequence, ms per pass")
    print("| context | draft nodes | pass | x plain | GEMMs | attention | other kernels | outside kernels |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        for k in nodes:
            runner.timed_forward(seq(context, k))
        base = None
        for k in nodes:
            best, split = float("inf"), {}
            for _ in range(PASSES):
                totals.clear()
                t = runner.timed_forward(seq(context, k))
                if t < best:
                    best, split = t, dict(totals)
            base = base or best
            gemm, attn = split.get("qgemm", 0.0), split.get("attn_decode", 0.0)
            other = sum(split.values()) - gemm - attn
            print(f"| {context} | {k} | {best * 1e3:.2f} | {best / base:.2f} | {gemm * 1e3:.2f} | {attn * 1e3:.2f} | "
                  f"{other * 1e3:.2f} | {(best - sum(split.values())) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
