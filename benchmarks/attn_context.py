"""The attention kernel alone at long context: one decode row of SmolLM2's shapes (9 heads, 3 kv
heads, head_dim 64) over L keys, per KV format and kernel variant (both built and loaded in this
process), in interleaved rounds; the fastest round (5 calls each) of 15 is reported, the one a
shared machine disturbed least. Usage: python benchmarks/attn_context.py THREADS"""
import sys
import time

import torch

from loom import kernels
from loom.model.kv_dtypes import kv_format

threads = int(sys.argv[1]); torch.set_num_threads(threads)
mods = {}
for v in ("avx512", "avx2"):
    mods[("new", v)] = kernels.build(v)
H, Hkv, D = 9, 3, 64
for L in (2048, 6000):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    q = torch.randn(1, H * D, generator=g); slots = torch.arange(L)[None]; ctx = torch.tensor([L])
    cases = []
    for var in ("avx512", "avx2"):
        for fmt in ("float16", "int8", "int4"):
            f = kv_format(fmt)
            cases.append((f"{var} {fmt}", lambda m=mods[("new", var)], kc=f.encode(k), vc=f.encode(v), i=f.kernel_id:
                          m.attn_decode(q, kc, vc, slots, ctx, H, Hkv, 0.125, 0, None, None, i)))
    times = {name: [] for name, _ in cases}
    for _ in range(15):
        for name, fn in cases:
            fn(); t = time.perf_counter()
            for _ in range(5): fn()
            times[name].append((time.perf_counter() - t) / 5)
    print(f"L={L}: " + ", ".join(f"{n} {min(t) * 1e6:.0f}us" for n, t in times.items()), flush=True)
