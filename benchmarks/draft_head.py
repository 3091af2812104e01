"""Could a learned draft head lift speculation where n-gram drafts fail? How often a small head
on the model's last hidden state predicts the token after next, per Spec-Bench category.

A one-token head drafts t+2 at the step that makes t+1: the next step verifies it as a second
row, so each step makes 1 + (its top-1 accuracy) tokens for the price of one more row (and the
head's own pass through the output matrix). This measures that accuracy before anything is
built, for three heads over the final (normed) hidden state h_t, all ending in the model's
frozen, tied output matrix:

  medusa  h + SiLU(W h + b)                       (Medusa's head, one layer)
  eagle   h + SiLU(W [h, emb(t+1)] + b)           (EAGLE's idea: the next token's embedding too,
                                                   known when the head runs)
  mlp     h + W2 SiLU(W1 [h, emb(t+1)] + b1) + b2  (the same, a 2,048-wide hidden layer)

Data: the model's own greedy outputs (loom's engine), self-distillation as Medusa and EAGLE
train. Training prompts: the Spec-Bench first turns past the 4 per category that
`loom bench --spec` uses, and GSM8K train questions (chat-formatted); test: the bench's own
prompts (128 new tokens each). Hidden states come from transformers on the GGUF's weights
exported to Hugging Face format (`loom.bench.hf_export`, float32), on prompt + output. Each
head: AdamW with a one-cycle schedule (peak 2e-3), batches of 1,024 positions, zero-initialised
so it starts as the model's own next-token prediction.

Run from the repository root (15-20 minutes on 2 cores; stages are kept in --work):
    .venv/bin/python benchmarks/draft_head.py [--model smollm2-135m] [--gsm8k 1000] [--epochs 1.5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from loom.bench.prompts import SPEC_BENCH_PATH
from loom.bench.suites.parallel import load_gsm8k


def prompts(tok, gsm8k: int) -> tuple[list, list]:
    """(test, train): lists of (category, prompt ids)."""
    seen, test, train = defaultdict(int), [], []
    for line in SPEC_BENCH_PATH.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        ids = tok.encode_chat([{"role": "user", "content": row["turns"][0]}], add_generation_prompt=True)
        if len(ids) > 384:   # the bench's prompt limit
            continue
        if seen[row["category"]] < 4:
            seen[row["category"]] += 1
            test.append((row["category"], ids))
        else:
            train.append(("spec-bench", ids))
    for row in load_gsm8k(gsm8k):
        train.append(("gsm8k", tok.encode_chat([{"role": "user", "content": row["question"]}],
                                               add_generation_prompt=True)))
    return test, train


def generate(engine, items: list, new_tokens: int) -> list:
    """(category, prompt, greedy output) for every item, 32 requests at a time."""
    from loom import SamplingParams

    params, out = SamplingParams(temperature=0, max_tokens=new_tokens), []
    for i in range(0, len(items), 32):
        ids = {engine.add_request(p, params): (c, p) for c, p in items[i:i + 32]}
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        out += [(ids[r][0], ids[r][1], done[r]) for r in ids]
    return out


def features(model, rows: list) -> tuple:
    """h_t [P, d], t+1 [P], t+2 [P], category per position: every output position with two
    tokens after it (the first: the prompt's last)."""
    H, T1, T2, cats = [], [], [], []
    for cat, prompt, output in rows:
        seq, n0 = prompt + output, len(prompt) - 1
        with torch.no_grad():
            h = model.model(torch.tensor([seq])).last_hidden_state[0]
        H.append(h[n0:len(seq) - 2].clone())
        T1.append(torch.tensor(seq[n0 + 1:len(seq) - 1]))
        T2.append(torch.tensor(seq[n0 + 2:]))
        cats += [cat] * (len(seq) - 2 - n0)
    return torch.cat(H), torch.cat(T1), torch.cat(T2), cats


class Head(torch.nn.Module):
    def __init__(self, kind: str, E: torch.Tensor, emb: torch.Tensor):
        super().__init__()
        d = E.shape[1]
        self.kind, self.E, self.emb = kind, E, emb
        width = d if kind == "medusa" else 2 * d
        if kind == "mlp":
            self.f = torch.nn.Sequential(torch.nn.Linear(width, 2048), torch.nn.SiLU(), torch.nn.Linear(2048, d))
            last = self.f[2]
        else:
            self.f = torch.nn.Sequential(torch.nn.Linear(width, d), torch.nn.SiLU())
            last = self.f[0]
        torch.nn.init.zeros_(last.weight)
        torch.nn.init.zeros_(last.bias)

    def forward(self, h: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
        x = h if self.kind == "medusa" else torch.cat([h, self.emb[t1]], -1)
        return (h + self.f(x)) @ self.E.T   # [P, vocab]


def train_and_test(kind: str, data: dict, epochs: float) -> dict:
    torch.manual_seed(0)
    head = Head(kind, data["E"], data["emb"])
    h, t1, t2, _ = data["train"]
    steps, batch = max(1, int(epochs * h.shape[0] / 1024)), 1024
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    order = torch.randperm(h.shape[0])
    for s in range(steps):
        at = (s * batch) % (h.shape[0] - batch)
        idx = order[at:at + batch]
        loss = torch.nn.functional.cross_entropy(head(h[idx], t1[idx]), t2[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    h, t1, t2, cats = data["test"]
    with torch.no_grad():
        pred = torch.cat([head(h[i:i + 2048], t1[i:i + 2048]).argmax(-1) for i in range(0, h.shape[0], 2048)])
    hits = defaultdict(list)
    for cat, ok in zip(cats, (pred == t2).tolist()):
        hits[cat].append(ok)
    return {"all": (pred == t2).float().mean().item(), **{c: sum(v) / len(v) for c, v in hits.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gsm8k", type=int, default=1000, help="GSM8K train questions among the training prompts")
    ap.add_argument("--new-tokens", type=int, default=192, help="greedy tokens per training prompt")
    ap.add_argument("--epochs", type=float, default=1.5)
    ap.add_argument("--heads", default="medusa,eagle,mlp")
    ap.add_argument("--work", type=Path, default=Path("/tmp/loom-draft-head"), help="stages kept here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    feats = args.work / f"{args.model}-{args.gsm8k}-{args.new_tokens}.pt"
    if not feats.is_file():
        from transformers import AutoModelForCausalLM

        from loom.bench.hf_export import export_hf
        from loom.config import EngineConfig
        from loom.engine.engine import Engine
        from loom.loader.registry import resolve_model

        t = time.perf_counter()
        gguf = resolve_model(args.model)
        engine = Engine(EngineConfig.create(str(gguf)))
        test, train = prompts(engine.tokenizer, args.gsm8k)
        rows = {"test": generate(engine, test, 128), "train": generate(engine, train, args.new_tokens)}
        del engine
        print(f"generated {sum(len(r[2]) for r in rows['train'])} training tokens, "
              f"{sum(len(r[2]) for r in rows['test'])} test tokens ({time.perf_counter() - t:.0f} s)", flush=True)
        hf = AutoModelForCausalLM.from_pretrained(export_hf(gguf), dtype=torch.float32).eval()
        data = {split: features(hf, r) for split, r in rows.items()}
        data["E"] = hf.lm_head.weight.detach().clone()
        data["emb"] = hf.model.embed_tokens.weight.detach().clone()
        torch.save(data, feats)
        print(f"hidden states of {data['train'][0].shape[0]} training positions ({time.perf_counter() - t:.0f} s)",
              flush=True)
    data = torch.load(feats)
    own = (data["test"][0] @ data["E"].T).argmax(-1).eq(data["test"][1]).float().mean().item()
    print(f"{args.model}: {data['train'][0].shape[0]} training positions, {data['test'][0].shape[0]} test; the "
          f"float32 model's own next token agrees with loom's greedy one at {own:.3f} of test positions")
    results = {kind: train_and_test(kind, data, args.epochs) for kind in args.heads.split(",")}
    cats = [c for c in results[next(iter(results))] if c != "all"]
    print("\ntop-1 accuracy of the token after next (test: the Spec-Bench prompts of `loom bench --spec`)\n")
    print("| head | all | " + " | ".join(cats) + " |")
    print("|---|" + "---:|" * (len(cats) + 1))
    for kind, r in results.items():
        print(f"| {kind} | {r['all']:.3f} | " + " | ".join(f"{r[c]:.2f}" for c in cats) + " |")


if __name__ == "__main__":
    main()
