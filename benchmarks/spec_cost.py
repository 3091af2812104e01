"""What a draft token costs: the speculation controller's start-up calibration, printed.

An engine with speculative decoding times forward passes (output matrix included) of B
sequences carrying k draft tokens each, at a short and a long context, before it serves
anything (loom.speculative.calibration), or reads them from its cache ($LOOM_CACHE/costs). This
prints those timings and their ratio to the pass without drafts: with tokens per step T at k
drafts, speculation can gain at most T / ratio(k) in that forward pass. --fresh times them anew
(and does not touch the cache).

Run from the repository root: .venv/bin/python benchmarks/spec_cost.py [MODEL] [--threads N] [--fresh]
"""

from __future__ import annotations

import argparse
import os

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.speculative.calibration import CONTEXTS as CALIBRATION_CONTEXTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="time the passes, ignoring the cache")
    args = ap.parse_args()
    if args.fresh:
        os.environ["LOOM_COST_CACHE"] = "0"
    engine = Engine(EngineConfig.create(args.model, threads=args.threads, num_blocks=2048, block_size=16,
                                        max_num_seqs=8, speculative_config={"method": "prompt_lookup"}))
    calib = engine.spec.controller.cost.calib
    for ctx in CALIBRATION_CONTEXTS:
        if ctx not in calib:
            continue
        rows = calib[ctx].rows
        ks = sorted({x // b for b, row in rows.items() for x in row})
        print(f"\ncontext {ctx}: ms per forward pass (ratio to k = 0), k draft tokens per sequence")
        print("| B | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("|---:|" + "---:|" * len(ks))
        for b, row in sorted(rows.items()):
            cells = [f"{row[b * k] * 1e3:.2f} ({row[b * k] / row[0]:.2f})" if b * k in row else "-" for k in ks]
            print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
