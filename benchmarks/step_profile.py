"""Where one batched decode step goes at batch 8 vs 32: scheduler, batch building, the model's
forward (kernels), logits, sampling, scheduler update, detokenization; and aggregate tok/s.

N requests of the same prompt length are added at once (greedy, past EOS); after their
prefills, every step is a decode of N rows. Each phase is timed with perf_counter around the
call; "other" is the step's wall time minus the phases.

Run from the repository root: .venv/bin/python benchmarks/step_profile.py [--batches 8,32] [--model M]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from loom import SamplingParams
from loom.config import EngineConfig
from loom.engine.engine import Engine


def wrap(obj, name, totals, label):
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def run(engine: Engine, batch: int, new_tokens: int, prompt_len: int, totals: dict[str, float]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(list(range(100 + i, 100 + i + prompt_len)), params)
    while any(r.num_computed_tokens < len(r.all_token_ids) - 1 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    totals.clear()  # decode steps only from here
    steps, tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        totals["step"] += time.perf_counter() - t
        steps += 1
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
    wall = time.perf_counter() - t0
    return {"batch": batch, "steps": steps, "tok_s": tokens / wall, "ms_per_step": 1000 * wall / steps}


def step_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of run()'s workload, shared by the scripts that time it."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    return ap


def main() -> None:
    ap = step_arguments(argparse.ArgumentParser())
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    totals: dict[str, float] = defaultdict(float)
    model, runner, sched = engine.model, engine.runner, engine.scheduler
    wrap(sched, "schedule", totals, "schedule")
    wrap(sched, "update", totals, "update")
    wrap(model, "forward", totals, "forward")
    wrap(model, "compute_logits", totals, "logits")
    wrap(runner, "_sample", totals, "sample")
    wrap(engine, "_process_outputs", totals, "detokenize")
    import loom.model.arch.llama as llama_mod
    import loom.model.layers.linear as linear_mod
    import loom.model.runner as runner_mod
    wrap(runner_mod, "build_batch", totals, "build_batch")
    wrap(llama_mod, "paged_attention_stored", totals, "attention")      # inside forward
    wrap(linear_mod.QuantLinear, "__call__", totals, "qgemm")           # inside forward and logits
    best: dict[int, dict] = {}
    for _ in range(args.repeats):
        for b in (int(x) for x in args.batches.split(",")):
            r = run(engine, b, args.new_tokens, args.prompt_len, totals)
            phases = {k: 1000 * v / r["steps"] for k, v in totals.items()}
            r.update({f"{k}_ms": round(v, 3) for k, v in phases.items()})
            if b not in best or r["tok_s"] > best[b]["tok_s"]:
                best[b] = r
    for b, r in best.items():
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
