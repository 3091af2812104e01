"""PNG charts of a bench report (matplotlib, headless): throughput and latency vs concurrency,
and the single-stream rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.bench.settings import BenchError


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend, or BenchError where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lays out `fig`, writes it to `path` (creating its directory) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(report: dict[str, Any], *keys: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{engine: (concurrency levels, values)}`` for the ok engines that have the value."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for label, entry in report["engines"].items():
        if entry.get("status") != "ok":
            continue
        xs, ys = [], []
        for n in report["settings"]["concurrency"]:
            value: Any = entry.get("concurrency", {}).get(str(n))
            for k in keys:
                value = value.get(k) if isinstance(value, dict) else None
            if value is not None:
                xs.append(n)
                ys.append(float(value))
        if xs:
            out[label] = (xs, ys)
    return out


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write throughput.png, latency.png and single_stream.png into `out_dir`; return their paths."""
    plt = pyplot()

    title = f"{Path(report['model']['path']).name}, {report['threads']} threads"
    levels = report["settings"]["concurrency"]
    colors = {label: f"C{i}" for i, label in enumerate(report["engines"])}
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in _series(report, "throughput_tok_s").items():
        ax.plot(xs, ys, marker="o", color=colors[label], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Aggregate output throughput ({title})")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(save_figure(fig, out_dir / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, name in ((axes[0], "ttft_ms", "time to first token"),
                             (axes[1], "tpot_ms", "time per output token")):
        for q, style, marker in (("p50", "-", "o"), ("p99", "--", "s")):
            for label, (xs, ys) in _series(report, metric, q).items():
                ax.plot(xs, ys, style, marker=marker, markerfacecolor="none" if q == "p99" else colors[label],
                        color=colors[label], label=f"{label} {q}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.suptitle(f"Latency percentiles ({title})")
    written.append(save_figure(fig, out_dir / "latency.png"))

    ok = {label: e for label, e in report["engines"].items() if e.get("status") == "ok"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "decode", "decode, 1 stream"), (axes[1], "prefill", "prefill")):
        labels = list(ok)
        values = [float(ok[label][key]["tok_s"]) for label in labels]
        ax.bar(labels, values, color=[colors[label] for label in labels])
        ax.set_ylabel("tokens / s")
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Single stream ({title})")
    written.append(save_figure(fig, out_dir / "single_stream.png"))
    return written
