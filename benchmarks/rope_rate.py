"""Time of loom's `rope_store` kernel (per-head q/k RMSNorm, RoPE, k/v into a float16 cache) per
call, for Gemma 3 270M's heads (4 q + 1 kv of 256, with q/k norms) and SmolLM2-135M's (9 q + 3 kv
of 64, no norms), at 1, 32 and 512 rows; best of 7 timed runs of ~2,000 rows' calls.

    .venv/bin/python benchmarks/rope_rate.py        # LOOM_KERNELS=avx2 for the other variant
"""

from __future__ import annotations

import time

import torch

from loom import kernels
from loom.model.layers.rope import RotaryEmbedding

SHAPES = {"Gemma 3 (4 + 1 heads of 256, q/k norms)": (4, 1, 256, True),
          "SmolLM2 (9 + 3 heads of 64)": (9, 3, 64, False)}


def main() -> None:
    kern = kernels.load()
    if kern is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    torch.manual_seed(0)
    print(f"kernels {kernels.variant()}, {torch.get_num_threads()} threads; us per call (best of 7)")
    print("| heads | rows | us |\n|---|---:|---:|")
    for name, (H, Hkv, D, norm) in SHAPES.items():
        rope = RotaryEmbedding(D, 10000.0, 1024)
        rope.ensure(1024)
        kc = torch.zeros(4096, Hkv, D, dtype=torch.float16)
        vc = kc.clone()
        qn = torch.rand(D) + 0.5 if norm else None
        kn = torch.rand(D) + 0.5 if norm else None
        for T in (1, 32, 512):
            qkv0 = torch.randn(T, (H + 2 * Hkv) * D)
            pos, slots = torch.randint(0, 1000, (T,)), torch.randperm(4096)[:T]
            calls, best = max(1, 2000 // T), float("inf")
            for _ in range(7):
                qkv = qkv0.clone()
                t0 = time.perf_counter()
                for _ in range(calls):
                    kern.rope_store(qkv, pos, rope.cos, rope.sin, kc, vc, slots, H, Hkv, qn, kn, 1e-6, 0)
                best = min(best, (time.perf_counter() - t0) / calls)
            print(f"| {name} | {T} | {best * 1e6:.1f} |")


if __name__ == "__main__":
    main()
