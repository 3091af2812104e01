"""Rate of loom's quantized GEMM kernel per layer shape and batch size, in multiply-adds per second.

    .venv/bin/python benchmarks/gemm_rate.py [--threads 1] [--rows 1,8,32]   # LOOM_KERNELS=avx2 for the other variant
    PYTHONPATH=. .venv/bin/python benchmarks/gemm_rate.py --before CHECKOUT [--variant avx2]

SmolLM2-135M's shapes (4-bit projections, the 8-bit tied output matrix) and Gemma 3 270M's output
matrix, each as the general affine form and the zero-point one (see loom_kernels_loops.h), packed weights of random
codes with float16 scales of 0.01 (the kernel's time does not depend on the values); best of 5
timed runs of enough calls to take ~0.1 s. (The AVX2 variant runs Q8_0's zero point on the affine
path: its two rows of those shapes time the same code; Q5_0's takes the integer path there too.) Compare with the CPU's integer dot-product peak
(benchmarks/vnni_peak.cpp) to see how far the kernel is from the instruction's limit.

With --before CHECKOUT, that checkout's kernels (built or loaded under their own name, as
benchmarks/attn_batch.py does) and this tree's run in the same process on the same weights (the
affine form of each shape), their outputs checked to be bitwise equal, in alternating turns (the first of a turn alternating): the
ratio before / after is the number a VM whose speed swings from minute to minute keeps (separate
runs of the table above differ by up to 2x there). Times are of the thread's CPU with one thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def compare(before_checkout: str, variant: str, rows: list[int], threads: int, rounds: int = 7) -> None:
    """Before / after per shape and row count, both kernels in this process (see the docstring)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from attn_batch import kernels_of

    if variant is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    if variant not in kernels.supported_variants():
        raise SystemExit(f"variant {variant} does not run on this CPU ({', '.join(kernels.supported_variants())} do)")
    impls = {"before": kernels_of(before_checkout).build(variant), "after": kernels.build(variant)}
    clock = time.thread_time if threads == 1 else time.perf_counter
    print(f"kernels {variant}, {threads} thread(s); µs per call, fastest of {rounds} alternating turns "
          f"(outputs bitwise equal before/after)")
    print("| layer (N x K, bits) | M | before | after | before / after |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, k, bits) in SHAPES.items():
        w = packed(n, k, bits, 0)
        for m in rows:
            x = torch.randn(m, k)
            outs = {label: torch.empty(m, n) for label in impls}
            calls = {label: (lambda kern=kern, o=outs[label]: kern.qgemm(x, w, n, k, bits, True, 0, None, 0.0, o,
                                                                          False, 0)) for label, kern in impls.items()}
            for call in calls.values():
                call()
            if not torch.equal(outs["before"], outs["after"]):
                raise SystemExit(f"{name}, M = {m}: before and after differ")
            reps, best = max(2, int(3e7 / (n * k * m))), dict.fromkeys(impls, float("inf"))
            for r in range(rounds):
                for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    t = clock()
                    for _ in range(reps):
                        calls[label]()
                    best[label] = min(best[label], (clock() - t) / reps)
            print(f"| {name} ({n} x {k}, {bits}) | {m} | {best['before'] * 1e6:.0f} | {best['after'] * 1e6:.0f} | "
                  f"{best['before'] / best['after']:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32", help="activation rows (the batch), comma-separated")
    ap.add_argument("--before", default=None, help="another checkout whose kernels to compare with")
    ap.add_argument("--variant", default=None, help="with --before: the kernel variant (default: this CPU's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    if args.before:
        compare(args.before, args.variant or kernels.variant(), rows, args.threads)
        return
    kern = kernels.load()
    if kern is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
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
