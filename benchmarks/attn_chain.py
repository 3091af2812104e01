"""The attention kernel alone on one sequence's rows: R new tokens (a chain of draft nodes, or
R = 1 for a plain decode step) over `ctx` keys of float16 KV, SmolLM2's shapes (9 heads, 3 kv
heads, head_dim 64), the rows one group sharing the context. µs per call, fastest of 30 rounds,
warm (one layer's caches called again) and cold (eight layers' caches in turn).

With --before CHECKOUT, that checkout's kernels are timed in the same process and their outputs
checked to be bitwise equal.

Usage (repository root): PYTHONPATH=. python benchmarks/attn_chain.py [--threads 2] [--ctx 128,512,1024]
    [--rows 1,5,10] [--before /path/to/checkout]
"""

from __future__ import annotations

import argparse
import time

import torch
from attn_batch import kernels_of

from loom import kernels
from loom.model.kv_dtypes import kv_format

H, HKV, D, BLOCK, LAYERS = 9, 3, 64, 16, 8


def case(ctx: int, rows: int, g: torch.Generator):
    """caches for LAYERS layers, the rows' slots (the same shuffled blocks), ctx, q, groups, shared"""
    f = kv_format("float16")
    n = (ctx + rows + BLOCK - 1) // BLOCK * BLOCK + BLOCK
    caches = [(f.encode(torch.randn(n, HKV, D, generator=g)), f.encode(torch.randn(n, HKV, D, generator=g)))
              for _ in range(LAYERS)]
    blocks = torch.randperm(n // BLOCK, generator=g)
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:ctx + rows].repeat(rows, 1).contiguous()
    lens = torch.tensor([ctx + r + 1 for r in range(rows)])
    q = torch.randn(rows, H * D, generator=g)
    return caches, slots, lens, q, torch.tensor([0, rows]), torch.tensor([ctx]), f.kernel_id


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", default="128,256,512,1024")
    ap.add_argument("--rows", default="1,5,10")
    ap.add_argument("--before", default=None, help="another checkout whose kernels to compare with")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    impls = {"after": kernels.build(kernels.variant())}
    if args.before:
        impls["before"] = kernels_of(args.before).build(kernels.variant())
    g = torch.Generator().manual_seed(0)
    print(f"kernels {kernels.variant()}, {args.threads} thread(s), µs per call (fastest of 30 rounds)")
    for ctx in (int(c) for c in args.ctx.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            caches, slots, lens, q, groups, shared, kid = case(ctx, rows, g)
            cells, outs = [], []
            for name, m in impls.items():
                def call(i, m=m):
                    return m.attn_decode(q, *caches[i], slots, lens, H, HKV, D ** -0.5, 0, groups, shared, kid)
                for i in range(LAYERS):
                    call(i)
                warm, cold = [], []
                for _ in range(30):
                    t = time.perf_counter()
                    for _ in range(LAYERS):
                        call(0)
                    warm.append((time.perf_counter() - t) / LAYERS)
                    t = time.perf_counter()
                    for i in range(LAYERS):
                        call(i)
                    cold.append((time.perf_counter() - t) / LAYERS)
                outs.append(call(0))
                cells.append(f"{name}: warm {min(warm) * 1e6:6.1f} cold {min(cold) * 1e6:6.1f}")
            same = "" if len(outs) == 1 else ("  (bitwise equal)" if torch.equal(*outs) else "  OUTPUTS DIFFER")
            print(f"ctx {ctx:5d}  rows {rows:2d}  " + "  ".join(cells) + same, flush=True)


if __name__ == "__main__":
    main()
