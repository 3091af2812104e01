"""`loom bench --spec`: speculative decoding per Spec-Bench category.

Per category, on the same prompts (chat-formatted where the model has a chat template) and
greedy decoding:

    single stream   each prompt alone: output tokens / seconds, summed over the prompts
    8 concurrent    8 prompts at once: output tokens / wall seconds

for loom without speculation, loom with each method, and (single stream, where
llama-cpp-python is installed) llama.cpp without and with its prompt-lookup drafter
(`LlamaPromptLookupDecoding`). The loom engines share one copy of the weights in this
process and run in turns of one step each, each timed by its own steps (`_loom_runs`), so
that their ratios do not depend on when the host was fast; each runs `repeats` times.
Reported: accepted draft tokens per verification step, tokens per step, each engine's fastest
run, and speedups over plain loom (the median of the repetitions' paired ratios) and over
llama.cpp's prompt lookup.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.bench.plots import pyplot, save_figure
from loom.bench.settings import BenchError

METHODS = ("prompt_lookup", "token_recycling", "lookahead", "retrieval", "auto")
CONCURRENCY = 8


@dataclass(frozen=True)
class SpecBenchSettings:
    prompts_per_category: int = 4
    max_tokens: int = 128
    prompt_tokens: int = 768
    methods: tuple[str, ...] = METHODS
    dtype: str = "auto"
    repeats: int = 2                 # runs of every engine, in turns of one step; speedups: the median paired ratio
    datastore: str | None = None     # corpus of methods retrieval and auto
    llamacpp: bool = True            # also time llama.cpp with and without its prompt lookup (if installed)

    @classmethod
    def preset(cls, quick: bool) -> "SpecBenchSettings":
        return (cls(prompts_per_category=1, max_tokens=32, prompt_tokens=384, methods=("auto",), repeats=1)
                if quick else cls())


def _rows(path: Path) -> list[tuple[str, str]]:
    """(category, first turn) of every line of a Spec-Bench question.jsonl; a file that is
    missing, unreadable or not in that shape is a BenchError naming the line."""
    if not path.is_file():
        raise BenchError(f"Spec-Bench prompts not found at {path}; pass --prompts PATH")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read Spec-Bench prompts from {path}: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category, text = row["category"], row["turns"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise BenchError(f"{path} line {number} is not a Spec-Bench question (JSON with 'category' and "
                             f"'turns'): {type(e).__name__}: {e}") from None
        if not isinstance(category, str) or not isinstance(text, str):
            raise BenchError(f"{path} line {number}: 'category' and the first of 'turns' must be strings")
        rows.append((category, text))
    return rows


def _prompts(path: Path, rows: list[tuple[str, str]], tok, s: SpecBenchSettings) -> dict[str, list[list[int]]]:
    """Up to `prompts_per_category` token-id prompts per category, of at most `prompt_tokens`."""
    by_cat: dict[str, list[list[int]]] = defaultdict(list)
    for cat, text in rows:
        if len(by_cat[cat]) < s.prompts_per_category:
            # chat-formatted where the model has a template (Gemma 3's GGUF has none)
            ids = (tok.encode(text) if tok.chat_template is None else
                   tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True))
            if len(ids) <= s.prompt_tokens:
                by_cat[cat].append(ids)
    kept = {c: p for c, p in by_cat.items() if p}
    if not rows:
        raise BenchError(f"{path} holds no Spec-Bench question: nothing to measure")
    if not kept:
        raise BenchError(f"no prompt in {path} fits in {s.prompt_tokens} tokens: nothing to measure")
    return kept


class _Run:
    """One engine's prompts, alone one by one or all at once, advanced a step at a time.

    Its time is the sum of its own steps, so several runs can share the machine in turns
    (`_loom_runs`). `tok_s` is end to end (prompt prefill included); `decode_tok_s` counts the
    tokens after each group's first ones over the steps after the one where every request of
    the group had its first token: the part of generation speculation can speed up (llama.cpp's
    runs time the first token in a separate one-token call and subtract it)."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, concurrent: bool):
        from loom.sampling_params import SamplingParams

        self.engine = engine
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.groups = [prompts] if concurrent else [[p] for p in prompts]
        self.tokens = self.steps = self.decode_tokens = 0
        self.seconds = self.decode_seconds = 0.0
        self._group: list[str] = []          # request ids of the group running now
        self._started: set[str] = set()
        self._decoding = False               # every request of the group has its first token
        self._group_tokens = 0

    def step(self) -> bool:
        """One engine step (starting the next group when none runs); False once all are done."""
        if not self._group:
            if not self.groups:
                return False
            group = self.groups.pop(0)
            self._group = [self.engine.add_request({"prompt_token_ids": p}, self.params) for p in group]
            self._started, self._decoding, self._group_tokens = set(), False, 0
        t0 = time.perf_counter()
        outs = self.engine.step()
        took = time.perf_counter() - t0
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                self._started.add(o.request_id)
            if o.finished:
                self._group_tokens += len(o.outputs[0].token_ids)
        self.steps += 1
        self.seconds += took
        if self._decoding:
            self.decode_seconds += took
        elif len(self._started) == len(self._group):
            self._decoding = True
        if not self.engine.has_unfinished_requests():
            self.tokens += self._group_tokens
            if self._decoding:
                self.decode_tokens += self._group_tokens - len(self._group)
            self._group = []
        return True

    def result(self) -> dict[str, float]:
        return _speeds(self.tokens, self.seconds, self.decode_tokens, self.decode_seconds) | {"steps": self.steps}


def _loom_runs(runs: dict[str, _Run]) -> dict[str, dict[str, float]]:
    """Runs every engine's prompts in turns of one step each (the first of a turn rotating), so
    that a drift of the host's speed reaches every engine alike: each is timed by its own steps,
    which lie milliseconds apart from the others'. Results by the runs' labels."""
    live = list(runs)
    turn = 0
    while live:
        k = turn % len(live)
        done = {label for label in live[k:] + live[:k] if not runs[label].step()}
        live = [label for label in live if label not in done]
        turn += 1
    return {label: run.result() for label, run in runs.items()}


def _spec_config(method: str, settings: SpecBenchSettings) -> dict:
    spec = {"method": method}
    if settings.datastore is not None and method in ("retrieval", "auto"):
        spec["datastore"] = settings.datastore
    return spec


def _fastest(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Per mode (single, concurrent) the run with the higher decode speed; draft counts add up."""
    if old is None:
        return new
    out = {mode: max(old[mode], new[mode], key=lambda r: r["decode_tok_s"]) for mode in ("single", "concurrent")}
    for key in ("num_drafts", "num_accepted_tokens"):
        if key in new:
            out[key] = old[key] + new[key]
    return out


def _speeds(tokens: int, seconds: float, decode_tokens: int, decode_seconds: float) -> dict[str, float]:
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "decode_tokens": decode_tokens,
            "decode_seconds": decode_seconds,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds > 0 else 0.0}


def _llamacpp_run(path: Path, threads: int, prompts: list[list[int]], max_tokens: int,
                  lookup: bool) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(str(path), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False, draft_model=draft,
                logits_all=lookup)

    def timed(p: list[int], limit: int) -> tuple[int, float]:
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(p, max_tokens=limit, temperature=0.0, top_k=1)
        return out["usage"]["completion_tokens"], time.perf_counter() - t0

    timed(prompts[0], 1)   # one-time start-up costs, untimed
    tokens, seconds, first_seconds = 0, 0.0, 0.0
    for p in prompts:
        first_seconds += timed(p, 1)[1]   # prefill + the first token, timed on its own
        n, took = timed(p, max_tokens)
        tokens += n
        seconds += took
    return _speeds(tokens, seconds, max(tokens - len(prompts), 0), max(seconds - first_seconds, 0.0))


def run_spec_bench(model: str, threads: int, prompts_path: Path, settings: SpecBenchSettings,
                   log=print) -> dict[str, Any]:
    from loom.config import EngineConfig
    from loom.engine.engine import Engine
    from loom.loader.gguf import GGUFFile
    from loom.loader.registry import resolve_model
    from loom.loader.tokenizer import Tokenizer
    from loom.model.build import load_model

    rows = _rows(prompts_path)   # a bad prompt file is refused before the model loads
    path = resolve_model(model)
    gguf = GGUFFile.open(path)
    tok = Tokenizer.from_gguf(gguf)
    cats = _prompts(prompts_path, rows, tok, settings)
    weights = load_model(gguf, linear=EngineConfig.create(model, dtype=settings.dtype).load.linear_mode)
    budget = dict(block_size=16, num_blocks=4096, max_num_batched_tokens=1024, max_num_seqs=CONCURRENCY)

    def engine(spec=None) -> Engine:
        return Engine(EngineConfig.create(str(path), dtype=settings.dtype, threads=threads,
                                          speculative_config=spec, **budget), model=weights, tokenizer=tok)

    rows: dict[str, dict[str, Any]] = {}
    for cat, prompts in cats.items():
        batch = [prompts[i % len(prompts)] for i in range(CONCURRENCY)]
        row: dict[str, Any] = {"prompts": len(prompts)}
        paired = {m: {"single": [], "concurrent": []} for m in settings.methods}   # per repetition
        # Repetitions interleave the engines: per mode (single stream, then the concurrent batch)
        # every engine runs its prompts in turns of one step each (`_loom_runs`), each timed by
        # its own steps, so that a drift of the host's speed (10-20% over tens of seconds here)
        # reaches all of them alike. Every run is on a fresh engine (no prefix cache or learned
        # drafter state carried over: a drafter that remembers finished requests would copy the
        # single-stream answers into the concurrent run). The speedups are the median of each
        # repetition's paired ratio; the fastest run of each engine is kept for its speeds. The
        # order of the turns alternates between repetitions, so no engine always steps first.
        for rep in range(settings.repeats):
            labels = ("loom",) + settings.methods
            order = labels if rep % 2 == 0 else labels[::-1]
            entries: dict[str, dict[str, Any]] = {label: {} for label in labels}
            for mode, group in (("single", prompts), ("concurrent", batch)):
                engines = {label: engine(None if label == "loom" else _spec_config(label, settings))
                           for label in order}
                runs = {label: _Run(eng, group, settings.max_tokens, mode == "concurrent")
                        for label, eng in engines.items()}
                for label, res in _loom_runs(runs).items():
                    entries[label][mode] = res
                for label, eng in engines.items():
                    if label != "loom" and mode == "single":
                        st = eng.spec.stats
                        entries[label] |= {"num_drafts": st.num_drafts, "num_accepted_tokens": st.num_accepted_tokens}
                del engines, runs
            for label in labels:
                row[label] = _fastest(row.get(label), entries[label])
            for method in settings.methods:
                for mode in ("single", "concurrent"):
                    ratio = _ratio(entries[method][mode]["decode_tok_s"], entries["loom"][mode]["decode_tok_s"])
                    if ratio is not None:
                        paired[method][mode].append(ratio)
        for method in settings.methods:
            m = row[method]
            m["paired"] = paired[method]
            m["accepted_per_draft"] = m["num_accepted_tokens"] / m["num_drafts"] if m["num_drafts"] else 0.0
        for label, lookup in (("llama.cpp", False), ("llama.cpp+lookup", True)) if settings.llamacpp else ():
            res = _llamacpp_run(path, threads, prompts, settings.max_tokens, lookup)
            if res is not None:
                row[label] = {"single": res}
        rows[cat] = row
        log(f"{cat}: done")
    return {"model": path.name, "threads": threads, "settings": settings.__dict__, "categories": rows}


def _speedups(row: dict[str, Any], method: str) -> dict[str, float | None]:
    """Decode-phase speedups (single stream, concurrent: the median of the repetitions' paired
    ratios, or of the fastest runs in reports without them), end-to-end single-stream speedup,
    and the single-stream decode speed over llama.cpp's prompt lookup."""
    m, base = row[method], row["loom"]
    lcpp = row.get("llama.cpp+lookup")
    paired = m.get("paired", {})

    def speedup(mode: str) -> float | None:
        if paired.get(mode):
            return statistics.median(paired[mode])
        return _ratio(m[mode]["decode_tok_s"], base[mode]["decode_tok_s"])

    return {"single": speedup("single"), "concurrent": speedup("concurrent"),
            "single_e2e": _ratio(m["single"]["tok_s"], base["single"]["tok_s"]),
            "llama.cpp": _ratio(m["single"]["decode_tok_s"], lcpp["single"]["decode_tok_s"]) if lcpp else None}


def _ratio(a: float, b: float) -> float | None:
    """a / b, or None where b measured nothing (a run that ended after its first token)."""
    return a / b if b > 0 else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _summary(report: dict[str, Any]) -> list[str]:
    """Per method: geometric mean and lowest decode speedup over the categories, alone and concurrent."""
    lines = ["| method | single geomean | single min | "
             f"{CONCURRENCY} concurrent geomean | {CONCURRENCY} concurrent min |", "|---|---:|---:|---:|---:|"]
    for method in report["settings"]["methods"]:
        cells = []
        for mode in ("single", "concurrent"):
            ratios = [r for row in report["categories"].values() if (r := _speedups(row, method)[mode]) is not None]
            cells += [_x(_geomean(ratios)), _x(min(ratios, default=None))]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return lines + [""]


def spec_lines(report: dict[str, Any]) -> list[str]:
    """A Markdown table per method: the `--spec` section of docs/benchmarks.md."""
    s = report["settings"]
    lines = [f"## Speculative decoding ({report['model']}, {report['threads']} threads)", "",
             f"Spec-Bench, {s['prompts_per_category']} prompt(s) per category (chat-formatted where the model has a "
             f"chat template), greedy, {s['max_tokens']} new "
             f"tokens, dtype {s['dtype']}. Speedups are of decode speed (output tokens after the first, over the "
             f"time after the first; speculation cannot change the prompt's prefill) with speculation over "
             f"without, the median over the {s['repeats']} repetitions of each one's paired ratio (engines run "
             f"in turns of one step, each timed by its own steps; decode tok/s: the fastest run); e2e = whole requests, prefill included (fastest "
             f"runs); vs llama.cpp = decode speed over llama.cpp with "
             f"`LlamaPromptLookupDecoding` (single stream); tokens / step: single stream, prefill steps included; "
             f"accepted / draft: single stream.", ""]
    lines += _summary(report)
    for method in s["methods"]:
        lines += [f"### `{method}`", "",
                  "| category | accepted / draft | tokens / step | single decode tok/s | single speedup | "
                  f"single e2e speedup | {CONCURRENCY} concurrent speedup | vs llama.cpp lookup |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for cat, row in report["categories"].items():
            sp = _speedups(row, method)
            single = row[method]["single"]
            per_step = single["tokens"] / single["steps"] if single.get("steps") else 0.0
            lines.append(f"| {cat} | {row[method]['accepted_per_draft']:.2f} | {per_step:.2f} | "
                         f"{single['decode_tok_s']:.1f} | {_x(sp['single'])} | "
                         f"{_x(sp['single_e2e'])} | {_x(sp['concurrent'])} | {_x(sp['llama.cpp'])} |")
        lines.append("")
    return lines


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """spec_speedup.png: per method, each category's decode speedup alone and at CONCURRENCY
    requests, with the 1.0 line; returns its path."""
    plt = pyplot()
    methods, cats = report["settings"]["methods"], list(report["categories"])
    fig, axes = plt.subplots(len(methods), 1, figsize=(max(8.0, 0.8 * len(cats)), 3.2 * len(methods)), squeeze=False)
    for ax, method in zip(axes[:, 0], methods):
        speed = [_speedups(report["categories"][c], method) for c in cats]
        for j, (mode, name) in enumerate((("single", "single stream"), ("concurrent", f"{CONCURRENCY} concurrent"))):
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(cats))], [s[mode] or 0 for s in speed], 0.4,
                   label=name, color=f"C{j}")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel("decode speedup")
        ax.set_title(f"`{method}` over plain decoding")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"Spec-Bench, {report['model']}, {report['threads']} threads, greedy, "
                 f"{report['settings']['max_tokens']} new tokens")
    return [save_figure(fig, out_dir / "spec_speedup.png")]
