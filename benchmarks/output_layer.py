"""The output layer three ways: the GEMM, then the refinement of each row's top logits with its two
passes over the row (`QuantLinear.__call__` + `refine_top`); one call whose GEMM tiles gather the
candidates and store the logits past the caches (`QuantLinear.top_logits`); and that call for a
step of plain greedy rows, which keeps no logits (`top_logits(..., logits=False)`: on AVX-512 the
tiles store nothing and only the argmax comes back). Checks that all give the same logits and
argmax, then times them alternating, a 64 MB buffer written before each call (the weights and
logits come from memory, as in a model's step).

The rows are hidden states of the model's own: its embedding rows of random tokens through the
output norm (scaled), so that each row has a peak as a model's last hidden state does.

    PYTHONPATH=. .venv/bin/python benchmarks/output_layer.py --model gemma3-270m --rows 1,8,32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.layers.linear import TOP_LOGITS_CAP, TOP_LOGITS_MARGIN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = Engine(EngineConfig.create(args.model, threads=args.threads)).runner.model
    head = model.lm_head
    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    print(f"{args.model}, output matrix {head.p.n} x {head.p.k}, {args.threads} threads; ms per call, "
          f"best (median) of {args.rounds}")
    print("| rows | GEMM + refine_top | top_logits | top_logits, argmax only | ratios (best) |\n"
          "|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        ids = torch.randint(100, 5000, (m,), generator=torch.Generator().manual_seed(m))
        h = F.rms_norm(model.embed[ids].float(), (model.cfg.hidden_size,), model.norm, 1e-6) * 3
        am_old, am_new, am_only = (torch.empty(m, dtype=torch.int64) for _ in range(3))

        def old() -> torch.Tensor:
            return head.refine_top(h, head(h), TOP_LOGITS_MARGIN, TOP_LOGITS_CAP, am_old)

        def new() -> torch.Tensor:
            return head.top_logits(h, TOP_LOGITS_MARGIN, TOP_LOGITS_CAP, am_new)

        def only() -> torch.Tensor | None:
            return head.top_logits(h, TOP_LOGITS_MARGIN, TOP_LOGITS_CAP, am_only, logits=False)

        if not (torch.equal(old(), new()) and torch.equal(am_old, am_new)):
            raise SystemExit(f"{m} rows: the two ways differ")
        if only() is None and not torch.equal(am_only, am_new):
            raise SystemExit(f"{m} rows: the argmax without logits differs")
        times: dict[str, list[float]] = {"old": [], "new": [], "only": []}
        for _ in range(args.rounds):
            for name, fn in (("old", old), ("new", new), ("only", only)):
                flush.add_(1)
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        best = {k: min(v) * 1e3 for k, v in times.items()}
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        print(f"| {m} | {best['old']:.2f} ({med['old']:.2f}) | {best['new']:.2f} ({med['new']:.2f}) | "
              f"{best['only']:.2f} ({med['only']:.2f}) | {best['old'] / best['new']:.2f}x, "
              f"{best['old'] / best['only']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
