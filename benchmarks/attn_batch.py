"""The attention kernel alone on a plain decode batch: B rows (one new token each, every row its
own group) at 128-512 keys of context, paged in 16-slot blocks, SmolLM2's shapes (9 heads, 3 kv
heads, head_dim 64) and Gemma 3 270M's (4 heads, 1 kv head, head_dim 256), float16 KV.

With --before CHECKOUT, the kernels of that checkout (e.g. /work/main) are built or loaded in the
same process as this tree's, their outputs checked to be bitwise equal, and both timed in
interleaved rounds: the ratio before / after is the one number a shared machine keeps. A round
calls each case once per layer, over that layer's own caches (8 layers by default: more than L3,
so the rows come from memory as in a model's step; a 64 MB buffer is written before each case, so no case
starts on rows the previous one left in L3); the fastest round is reported, in µs per
layer call (of the thread's CPU time with one thread).

Usage (from the repository root; PYTHONPATH=. so that this tree's loom is the one imported):
    PYTHONPATH=. python benchmarks/attn_batch.py [--threads 1] [--before /work/main] [--variants avx512,avx2]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

from loom import kernels
from loom.model.kv_dtypes import kv_format

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}   # H, Hkv, D
BLOCK = 16


def kernels_of(checkout: str):
    """The loom.kernels package of another checkout, loaded under its own name (its builds are
    keyed by its own sources, so they never collide with this tree's)."""
    path = Path(checkout) / "loom" / "kernels" / "__init__.py"
    if not path.is_file():
        sys.exit(f"--before: {path} does not exist")
    spec = importlib.util.spec_from_file_location("loom_kernels_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def decode_batch(shape: tuple[int, int, int], batch: int, fmt: str, layers: int, seed: int = 0):
    """q [B, H*D], per layer a pair of caches, slots [B, Lmax] (each row its own shuffled 16-slot
    blocks), ctx [B]."""
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(128, 513, (batch,), generator=g)
    blocks = [(int(c) + BLOCK - 1) // BLOCK for c in ctx]
    order = torch.randperm(sum(blocks), generator=g)
    slots = torch.zeros(batch, int(ctx.max()), dtype=torch.int64)
    b0 = 0
    for r, (c, nb) in enumerate(zip(ctx.tolist(), blocks)):
        per_slot = (order[b0:b0 + nb, None] * BLOCK + torch.arange(BLOCK)).flatten()
        slots[r, :c] = per_slot[:c]
        b0 += nb
    n = sum(blocks) * BLOCK
    f = kv_format(fmt)
    caches = [(f.encode(torch.randn(n, Hkv, D, generator=g)), f.encode(torch.randn(n, Hkv, D, generator=g)))
              for _ in range(layers)]
    q = torch.randn(batch, H * D, generator=g)
    return q, caches, slots, ctx, f.kernel_id


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=None, help="another checkout whose kernels to compare with")
    ap.add_argument("--variants", default="avx512,avx2")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--fmt", default="float16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8,
                    help="calls cycle over this many layers' caches (8: more than L3, as in a model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    impls = {}
    for var in args.variants.split(","):
        if var not in kernels.supported_variants():
            continue
        if args.before:
            impls[("before", var)] = kernels_of(args.before).build(var)
        impls[("after", var)] = kernels.build(var)
    cases = []
    for model, shape in SHAPES.items():
        H, Hkv, D = shape
        for batch in (int(b) for b in args.batches.split(",")):
            q, caches, slots, ctx, kid = decode_batch(shape, batch, args.fmt, args.layers)
            for (which, var), m in impls.items():
                fn = (lambda i=0, m=m, q=q, kv=caches, s=slots, c=ctx, H=H, Hkv=Hkv, D=D, kid=kid:
                      m.attn_decode(q, *kv[i % len(kv)], s, c, H, Hkv, D ** -0.5, 0, None, None, kid))
                cases.append(((model, batch, var), which, fn))
    outs: dict = {}
    for key, which, fn in cases:
        outs.setdefault(key, {})[which] = [fn(i) for i in range(args.layers)]
    for key, o in outs.items():
        if "before" in o and not all(torch.equal(b, a) for b, a in zip(o["before"], o["after"])):
            sys.exit(f"{key}: before and after differ")
    # one thread: the calling thread's CPU time, which time slices lost to other processes do not count
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times = {(key, which): [] for key, which, _ in cases}
    flush = torch.zeros(64 << 20, dtype=torch.uint8)   # more than L3: no case starts on another's rows
    for _ in range(args.rounds):
        for key, which, fn in cases:
            flush.add_(1)
            fn(args.layers - 1)   # with one layer: its caches warm for every case alike
            t = clock()
            for i in range(args.layers):
                fn(i)
            times[(key, which)].append((clock() - t) / args.layers)
    print(f"threads {args.threads}, {args.fmt} KV, {args.layers} layers, fastest of {args.rounds} rounds, µs "
          f"{'of CPU time ' if args.threads == 1 else ''}per call"
          + (" (outputs bitwise equal before/after)" if args.before else ""))
    for key in outs:
        model, batch, var = key
        after = min(times[(key, "after")]) * 1e6
        line = f"{model:8s} B={batch:<3d} {var:7s} after {after:8.0f}"
        if (key, "before") in times:
            before = min(times[(key, "before")]) * 1e6
            line += f"  before {before:8.0f}  before/after {before / after:5.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
