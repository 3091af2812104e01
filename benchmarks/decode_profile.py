"""Where one single-stream decode step goes: time per layer in each kernel call, and the rest
(Python and torch dispatch), for loom's default (kernel) path.

Every kernel call of the fused forward is wrapped in a timer for the run; the glue is the
forward's wall time minus the kernels' sum. Context: a 128-token prompt, then decode steps.

Run from the repository root: .venv/bin/python benchmarks/decode_profile.py [MODEL] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from loom import LLM, SamplingParams


class Timed:
    """Proxy that times every call of `name` on `target` into `totals`."""

    def __init__(self, target, totals, label):
        self.target, self.totals, self.label = target, totals, label

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.target(*args, **kwargs)
        self.totals[self.label] += time.perf_counter() - t0
        return out


class TimedKernels:
    def __init__(self, kern, totals):
        self.kern, self.totals = kern, totals

    def __getattr__(self, name):
        return Timed(getattr(self.kern, name), self.totals, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, threads=args.threads)
    model = llm.engine.model
    if model.kern is None:
        raise SystemExit("loom's kernels are not in use on this machine; nothing to profile")
    prompt = list(range(1000, 1128))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)

    totals: dict[str, float] = defaultdict(float)
    layers = model.layers
    for layer in layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, Timed(getattr(layer, name), totals, name))
    model.kern = TimedKernels(model.kern, totals)
    model.stack = None   # the layers' calls one by one (decode_layers would make them all in one)
    forward, logits = model.forward, model.compute_logits
    model.forward = Timed(forward, totals, "forward (wall)")
    model.compute_logits = Timed(logits, totals, "lm_head + logits")
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True),
                 use_tqdm=False)
    step_wall = (time.perf_counter() - t0) / args.steps
    model.forward, model.compute_logits = forward, logits

    n, L = args.steps + 1, len(layers)  # the prefill step is one forward too: amortised below
    kernel_names = [k for k in totals if k not in ("forward (wall)", "lm_head + logits")]
    in_kernels = sum(totals[k] for k in kernel_names)
    print(f"{args.model}: {torch.get_num_threads()} threads, {L} layers, {args.steps} decode steps "
          f"(+1 prefill of {len(prompt)} tokens in the totals)")
    print(f"{'':24s}{'per step (ms)':>14s}{'per layer (us)':>16s}")
    print(f"{'engine step (wall)':24s}{1e3 * step_wall:14.2f}")
    print(f"{'forward (wall)':24s}{1e3 * totals['forward (wall)'] / n:14.2f}{1e6 * totals['forward (wall)'] / n / L:16.1f}")
    for k in sorted(kernel_names, key=lambda k: -totals[k]):
        print(f"{'  ' + k:24s}{1e3 * totals[k] / n:14.2f}{1e6 * totals[k] / n / L:16.1f}")
    glue = totals["forward (wall)"] - in_kernels
    print(f"{'  python + dispatch':24s}{1e3 * glue / n:14.2f}{1e6 * glue / n / L:16.1f}")
    print(f"{'lm_head + logits':24s}{1e3 * totals['lm_head + logits'] / n:14.2f}")
    rest = step_wall - (totals["forward (wall)"] + totals["lm_head + logits"]) / n
    print(f"{'scheduler/sampler/rest':24s}{1e3 * rest:14.2f}")


if __name__ == "__main__":
    main()
