"""Rate of loom's quantized GEMM kernel per layer shape and batch size, in multiply-adds per second.

    .venv/bin/python benchmarks/gemm_rate.py [--threads 1] [--rows 1,8,32]   # LOOM_KERNELS=avx2 for the other variant

SmolLM2-135M's shapes (4-bit projections, the 8-bit tied output matrix) and Gemma 3 270M's output
matrix, each as the general affine form and the zero-point one (see loom_kernels_loops.h), packed weights of random
codes with float16 scales of 0.01 (the kernel's time does not depend on the values); best of 5
timed runs of enough calls to take ~0.1 s. (The AVX2 variant runs Q8_0's zero point on the affine
path: its two rows of those shapes time the same code; Q5_0's takes the integer path there too.) Compare with the CPU's integer dot-product peak
(benchmarks/vnni_peak.cpp) to see how far the kernel is from the instruction's limit.
"""

from __future__ import annotations

import argparse
import time

import torch

from loom import kernels

SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
          "output": (49152, 576, 8), "gemma3 gate_up": (4096, 640, 8), "gemma3 output": (262144, 640, 8)}
# the zero-point forms timed as a second row: Q4_0's 8 for 4-bit codes, Q8_0's 128 for 8-bit ones,
# and Q5_0's 16 for Gemma 3's gate/up (5-bit codes in bytes)
ZERO = {"gemma3 gate_up": 16, 4: 8, 8: 128}


def packed(n: int, k: int, bits: int, zero: int) -> torch.Tensor:
    """Blocks of 16 output rows x 32 inputs: codes, then 16 float16 scales a and, without a zero
    point, 16 offsets b."""
    blocks, code, scales = (n + 15) // 16 * (k // 32), 256 if bits == 4 else 512, 16 if zero else 32
    w = torch.randint(0, 256, (blocks, code + 2 * scales), dtype=torch.uint8)
    w[:, code:] = torch.full((blocks, scales), 0.01, dtype=torch.float16).view(torch.uint8)
    return w.reshape(-1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32", help="activation rows (the batch), comma-separated")
    args = ap.parse_args()
    kern = kernels.load()
    if kern is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    print(f"kernels {kernels.variant()}, {args.threads} thread(s); GMAC/s per call (best of 5)")
    print("| layer (N x K, bits) | " + " | ".join(f"M = {m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    forms = [(name, shape, zero) for name, shape in SHAPES.items() for zero in (0, ZERO.get(name, ZERO[shape[2]]))]
    for name, (n, k, bits), zero in forms:
        w, cells = packed(n, k, bits, zero), []
        for m in rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            call = lambda: kern.qgemm(x, w, n, k, bits, True, 0, None, 0.0, out, False, zero)  # noqa: E731
            for _ in range(3):
                call()
            reps, best = max(3, int(1e8 / (n * k * m))), float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    call()
                best = min(best, (time.perf_counter() - t) / reps)
            cells.append(f"{n * k * m / best / 1e9:.0f} ({best * 1e6:.0f} us)")
        form = f"zero point {zero}" if zero else "affine"
        print(f"| {name} ({n} x {k}, {bits}, {form}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
