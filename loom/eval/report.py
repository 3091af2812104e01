"""Statistics of an EvalResult, as llama-perplexity reports them: perplexity with its standard
error, the KL divergence's mean, standard error and quantiles, how often the top token agrees,
and the RMS shift of the actual token's probability."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from loom.eval.run import EvalResult

QUANTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    """exp(mean NLL) and its standard error (delta method)."""
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return math.exp(mean), math.exp(mean) * se


def summary(res: EvalResult) -> dict:
    ppl, ppl_se = _ppl(res.nll)
    out = {"label": res.label, "tokens": int(len(res.nll)), "ppl": ppl, "ppl_stderr": ppl_se, **res.info}
    if res.kld is None:
        return out
    n = len(res.kld)
    ref_ppl, ref_se = _ppl(res.ref_nll)
    out.update({
        "reference": res.reference,
        "ref_ppl": ref_ppl, "ref_ppl_stderr": ref_se,
        "ppl_ratio": ppl / ref_ppl,
        "kld_mean": float(res.kld.mean()),
        "kld_stderr": float(res.kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        "kld_max": float(res.kld.max()),
        "kld_min": float(res.kld.min()),
        "kld_quantiles": {f"{q:g}": float(np.percentile(res.kld, q)) for q in QUANTILES},
        "same_top_pct": 100.0 * float(res.same_top.mean()),
        "rms_dp_pct": 100.0 * float(math.sqrt((res.dp ** 2).mean())),
        "dp_mean_pct": 100.0 * float(res.dp.mean()),
    })
    return out


def table_rows(s: dict) -> list[tuple[str, str]]:
    rows = [("tokens scored", f"{s['tokens']}"), ("perplexity", f"{s['ppl']:.4f} ± {s['ppl_stderr']:.4f}")]
    if "kld_mean" not in s:
        return rows
    q = s["kld_quantiles"]
    rows += [
        ("reference", s["reference"]),
        ("reference perplexity", f"{s['ref_ppl']:.4f} ± {s['ref_ppl_stderr']:.4f}"),
        ("perplexity ratio", f"{s['ppl_ratio']:.5f}"),
        ("mean KLD", f"{s['kld_mean']:.6f} ± {s['kld_stderr']:.6f}"),
        ("max KLD", f"{s['kld_max']:.6f}"),
        *[(f"{k}% KLD", f"{v:.6f}") for k, v in q.items()],
        ("min KLD", f"{s['kld_min']:.6f}"),
        ("same top token", f"{s['same_top_pct']:.3f}%"),
        ("RMS Δp", f"{s['rms_dp_pct']:.4f}%"),
        ("mean Δp", f"{s['dp_mean_pct']:+.4f}%"),
    ]
    return rows


def plot_kld(res: EvalResult, path: Path) -> None:
    """Histogram of per-token KL divergence on a log axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kld = np.clip(res.kld, 1e-10, None)
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.logspace(-10, max(1.0, math.log10(kld.max()) + 0.1), 80)
    ax.hist(kld, bins=bins, color="#3b6ea8")
    ax.set_xscale("log")
    ax.axvline(float(res.kld.mean()), color="#c0392b", linestyle="--", label=f"mean {res.kld.mean():.2e}")
    ax.set_xlabel("KL divergence per token (nats), clipped at 1e-10")
    ax.set_ylabel("tokens")
    ax.set_title(f"{res.label} vs {res.reference}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
