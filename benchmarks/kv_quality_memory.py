"""Quality against KV memory: what each KV cache type and each eviction budget costs in KL divergence
from the full float16 cache, against the KV bytes one sequence of the window's length holds.

Every configuration is a `loom eval` run over the same windows of ../shared/data/text/shakespeare.txt
(default: one window of 2,048 tokens, stride 512, so SnapKV compresses the first 1,536 tokens as a
prompt), against loom's own float16 full-KV run saved once as the reference. Memory per sequence =
the cache's bytes per token (all layers, K and V) x the entries held at the window's last token
(the window length; StreamingLLM's budget; SnapKV's budget for the compressed prompt plus the
`stride` tokens scored after it, which it does not compress). Writes a markdown table and a plot (KLD against memory, log-log) per model.

Usage (from the repository root):
    python benchmarks/kv_quality_memory.py [--models smollm2-135m,gemma3-270m] [--context 2048]
        [--stride 512] [--chunks 1] [--budgets 256,512,1024] [--threads 1] [--out bench_out/kv_quality]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loom.loader.gguf import GGUFFile  # noqa: E402
from loom.loader.registry import resolve_model  # noqa: E402
from loom.model.build import load_model  # noqa: E402
from loom.engine.engine import kv_cache_format  # noqa: E402
from loom.model.runner import ModelRunner  # noqa: E402

TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text" / "shakespeare.txt"


@dataclass(frozen=True)
class Config:
    label: str
    kv: str                      # kv_cache_dtype
    policy: str | None = None    # eviction policy
    budget: int | None = None

    def args(self) -> list[str]:
        out = ["--kv-cache-dtype", self.kv]
        if self.policy:
            out += ["--kv-eviction", json.dumps({"policy": self.policy, "budget": self.budget})]
        return out

    def slug(self) -> str:
        return self.label.replace(" ", "_").replace(",", "")


def configs(budgets: list[int]) -> list[Config]:
    out = [Config("int8", "int8"), Config("int4", "int4")]
    for policy, name in (("streaming", "StreamingLLM"), ("snapkv", "SnapKV")):
        out += [Config(f"{name} {b}", "float16", policy, b) for b in budgets]
    out += [Config(f"SnapKV {b} + int8", "int8", "snapkv", b) for b in budgets]
    return out


def bytes_per_token(model: str) -> dict[str, int]:
    """KV bytes per token (every layer, K and V) of each cache type, as the engine sizes them."""
    m = load_model(GGUFFile.open(resolve_model(model)))
    return {kv: ModelRunner.kv_bytes_per_token(m.cfg, kv_cache_format(kv, m)) for kv in ("float16", "int8", "int4")}


def run_eval(model: str, args, extra: list[str], json_path: Path) -> dict:
    cmd = [sys.executable, "-m", "loom.cli", "eval", model, "-f", str(TEXT), "--context", str(args.context),
           "--stride", str(args.stride), "--chunks", str(args.chunks), "--threads", str(args.threads),
           "--json", str(json_path), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(json_path.read_text())


def measure(model: str, args) -> list[tuple[Config, dict, int]]:
    out_dir = Path(args.out) / model
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / "base"
    ref = run_eval(model, args, ["--kv-cache-dtype", "float16", "--save-base", str(base)], out_dir / "float16.json")
    bpt = bytes_per_token(model)
    rows = [(Config("float16 (reference)", "float16"), ref, bpt["float16"] * args.context)]
    for c in configs(args.budgets):
        s = run_eval(model, args, [*c.args(), "--base", str(base)], out_dir / f"{c.slug()}.json")
        kept = args.context if not c.budget else min(args.context, c.budget + (args.stride if c.policy == "snapkv" else 0))
        rows.append((c, s, bpt[c.kv] * kept))
        print(f"# {model} {c.label}: KLD {s['kld_mean']:.5f}, {rows[-1][2] / 2**20:.1f} MiB", file=sys.stderr)
    return rows


def table(model: str, rows, ref_ppl: float) -> str:
    lines = [f"\n{model}, full float16 KV perplexity {ref_ppl:.3f}:\n",
             "| configuration | KV MiB per sequence | vs float16 | perplexity | ratio | mean KLD | 99% KLD | same top token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    full = rows[0][2]
    for c, s, mem in rows:
        kld = s.get("kld_mean") or 0.0
        q99 = (s.get("kld_quantiles") or {}).get("99", 0.0)
        lines.append(f"| {c.label} | {mem / 2**20:.1f} | {mem / full:.3f} | {s['ppl']:.3f} | "
                     f"{s['ppl'] / ref_ppl:.4f} | {kld:.5f} | {q99:.4f} | {s.get('same_top_pct', 100.0):.2f}% |")
    return "\n".join(lines)


def plot(results: dict[str, list], path: Path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    def style(c: Config) -> dict:
        family = "int" if c.policy is None else c.policy + ("+" + c.kv if c.kv != "float16" else "")
        return {"int": dict(marker="s", color="tab:blue"), "streaming": dict(marker="o", color="tab:red"),
                "snapkv": dict(marker="^", color="tab:green")}.get(family, dict(marker="v", color="tab:purple"))

    for ax, (model, rows) in zip(axes[0], results.items()):
        for c, s, mem in rows[1:]:
            ax.scatter(mem / 2**20, max(s["kld_mean"], 1e-5), s=40, **style(c))
            ax.annotate(c.label, (mem / 2**20, max(s["kld_mean"], 1e-5)), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
        ax.axvline(rows[0][2] / 2**20, color="grey", ls="--", lw=0.8, label="full float16 KV")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV cache per sequence (MiB)")
        ax.set_ylabel("mean KL divergence from full float16 KV (nats)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_out/kv_quality")
    ap.add_argument("--plot", default="docs/plots_kv/quality_vs_memory.png")
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    results = {m: measure(m, args) for m in args.models.split(",")}
    for model, rows in results.items():
        print(table(model, rows, rows[0][1]["ppl"]))
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(results, Path(args.plot))
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
