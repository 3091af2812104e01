"""The attention kernel alone on a plain decode batch: B rows (one new token each, every row its
own group) at 128-512 keys of context, paged in 16-slot blocks, SmolLM2's shapes (9 heads, 3 kv
heads, head_dim 64) and Gemma 3 270M's (4 heads, 1 kv head, head_dim 256), float16 KV.

With --layouts, this tree's kernels read the same rows from the paged cache layout ([blocks,
Hkv, 16, row]: a kv head's rows of a block contiguous) and from the slot-major one ([slots, Hkv,
row]), interleaved as below; "before" is then the slot-major layout. --sequential gives each
row consecutive blocks (a fresh engine's allocation) instead of shuffled ones (a long-running
one's). --models adds Llama 3 8B's shapes (32 heads, 8 kv heads, head_dim 128), "llama3-8b".

With --before CHECKOUT, the kernels of that checkout (e.g. /work/main) are built or loaded in the
same process as this tree's, their outputs checked to be bitwise equal, and both timed in
interleaved rounds: the ratio before / after is the one number a shared machine keeps. A round
calls each case once per layer, over that layer's own caches (8 layers by default: more than L3,
so the rows come from memory as in a model's step; a 64 MB buffer is written before each case, so no case
starts on rows the previous one left in L3); the fastest round is reported, in µs per
layer call (of the thread's CPU time with one thread).

Usage (from the repository root; PYTHONPATH=. so that this tree's loom is the one imported):
    PYTHONPATH=. python benchmarks/attn_batch.py [--threads 1] [--before /work/main | --layouts]
        [--variants avx512,avx2] [--models smollm2,gemma3,llama3-8b] [--sequential]
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

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "llama3-8b": (32, 8, 128)}   # H, Hkv, D
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


def paged(cache: torch.Tensor) -> torch.Tensor:
    """A cache [slots, Hkv, row] as the paged layout [blocks, Hkv, BLOCK, row] of the same rows."""
    n, hkv, rb = cache.shape
    return cache.view(n // BLOCK, BLOCK, hkv, rb).transpose(1, 2).contiguous()


def decode_batch(shape: tuple[int, int, int], batch: int, fmt: str, layers: int, seed: int = 0,
                 sequential: bool = False):
    """q [B, H*D], per layer a pair of slot-major caches, slots [B, Lmax] (each row its own
    16-slot blocks, shuffled or in order), ctx [B]."""
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(128, 513, (batch,), generator=g)
    blocks = [(int(c) + BLOCK - 1) // BLOCK for c in ctx]
    order = torch.arange(sum(blocks)) if sequential else torch.randperm(sum(blocks), generator=g)
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
    ap.add_argument("--layouts", action="store_true", help="the paged cache layout against the slot-major one")
    ap.add_argument("--sequential", action="store_true", help="each row's blocks in order, not shuffled")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--variants", default="avx512,avx2")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--fmt", default="float16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8,
                    help="calls cycle over this many layers' caches (8: more than L3, as in a model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.before and args.layouts:
        sys.exit("--before and --layouts each compare with a 'before' of their own: give one")
    impls = {}
    for var in args.variants.split(","):
        if var not in kernels.supported_variants():
            continue
        if args.before:
            impls[("before", var)] = kernels_of(args.before).build(var)
        impls[("after", var)] = kernels.build(var)
    cases = []
    for model in args.models.split(","):
        H, Hkv, D = shape = SHAPES[model]
        for batch in (int(b) for b in args.batches.split(",")):
            q, caches, slots, ctx, kid = decode_batch(shape, batch, args.fmt, args.layers, sequential=args.sequential)
            if args.layouts:   # "before": the slot-major caches, "after": the same rows paged
                runs = [(which, var, m, kv) for (_, var), m in impls.items()
                        for which, kv in (("before", caches), ("after", [tuple(map(paged, c)) for c in caches]))]
            else:
                runs = [(which, var, m, caches) for (which, var), m in impls.items()]
            for which, var, m, kvs in runs:
                fn = (lambda i=0, m=m, q=q, kv=kvs, s=slots, c=ctx, H=H, Hkv=Hkv, D=D, kid=kid:
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
          + (", blocks in order" if args.sequential else "")
          + (", before: slot-major layout, after: paged" if args.layouts else "")
          + (" (outputs bitwise equal before/after)" if args.before or args.layouts else ""))
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
