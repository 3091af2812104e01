"""Parallel sampling suites (`loom bench --parallel`): what sharing the prompt costs and saves,
and what test-time scaling buys on GSM8K. Both measure loom's own fan-out, so other peers
report them as unsupported.

``parallel`` (cost): one `parallel_prompt_tokens` prompt, n completions of exactly
`parallel_max_tokens` sampled tokens each, for every n of `parallel_n`, three ways:

    fork          one request with n: the prompt is prefilled once, children share its blocks
    independent   n separate requests, prefix caching off: n prefills, n copies of the prompt
    prefix_cache  n separate requests, prefix caching on: sharing through cached full blocks

Per way: wall time from submission to the last token, prompt tokens computed, and the peak
number of KV blocks in use (blocks of 16 tokens).

``parallel_quality``: a fixed subset of GSM8K train (the first `quality_limit` problems of a
seeded permutation, so smaller subsets are prefixes of larger ones), asked to end with
``#### <number>`` (chat template where the model has one, else a few-shot prompt); accuracy and
tokens spent per problem for greedy, self-consistency@k (majority vote), short-m@k and best-of-k
(mean logprob). Two runs, every problem submitted at once to one engine: greedy (n=1), and k
samples per problem (n=k, the prompt prefilled once) from which `score_samples` computes all
three sampled methods.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.bench.settings import BenchError, BenchSettings
from loom.bench.suites.base import Suite, SuiteContext
from loom.outputs import FinalOutputs

if TYPE_CHECKING:
    from loom.outputs import CompletionOutput

# ../shared/data/gsm8k/train.jsonl relative to the repository root.
GSM8K_PATH = Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k" / "train.jsonl"
BLOCK_SIZE = 16
MODES = ("fork", "independent", "prefix_cache")
METHODS = ("greedy", "self_consistency", "short_m_at_k", "best_of")
SUBSET_SEED = 1234
SAMPLING_TEMPERATURE = 0.7
# Sequences decoding at once in the quality suite (every problem is submitted at once).
QUALITY_BATCH_SEQS = 64
# Worked examples before each question of the few-shot prompt (base models).
FEW_SHOTS = 4
INSTRUCTION = ("Solve the math problem. Reason step by step, then write the final answer on its own line "
               "as '#### <number>'.\n\n")


def _unsupported(ctx: SuiteContext) -> dict[str, Any] | None:
    engine = getattr(ctx.peer, "engine", None)
    if engine is None or not hasattr(engine, "groups"):
        return {"supported": False, "reason": "measures loom's parallel fan-out"}
    return None


def _engine(ctx: SuiteContext, num_blocks: int, max_seqs: int, prefix_caching: bool):
    """A fresh engine (own KV cache and scheduler) over the peer's loaded model."""
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    peer = ctx.peer.engine  # type: ignore[attr-defined]
    config = EngineConfig.create(str(ctx.peer.model_path), dtype=peer.config.load.dtype, threads=ctx.peer.threads,
                                 enable_prefix_caching=prefix_caching, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                 max_num_seqs=max(64, max_seqs))
    return Engine(config, model=peer.model, tokenizer=peer.tokenizer)


def _drive(engine) -> tuple[dict[str, Any], int]:
    """Steps until idle; returns the finished outputs by id and the peak count of blocks in use."""
    final: dict[str, Any] = {}
    peak = 0
    total = engine.kv.pool.num_blocks
    gather = FinalOutputs()
    while engine.has_unfinished_requests():
        for out in gather.add_all(engine.step()):
            final[out.request_id] = out
        peak = max(peak, total - engine.kv.num_free_blocks())
    return final, peak


class ParallelCostSuite(Suite):
    name = "parallel"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"parallel n={n}" for n in settings.parallel_n]

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        skipped = _unsupported(ctx)
        s = ctx.settings
        prompt = self._prompt(ctx)
        levels: dict[str, Any] = {}
        for n, label in zip(s.parallel_n, self.steps(s)):
            with ctx.step(label):
                if skipped is None:
                    levels[str(n)] = {mode: self._measure(ctx, prompt, n, mode) for mode in MODES}
        if skipped is not None:
            return skipped
        return {"prompt_tokens": len(prompt), "max_tokens": s.parallel_max_tokens, "block_size": BLOCK_SIZE,
                "levels": levels}

    @staticmethod
    def _prompt(ctx: SuiteContext) -> list[int]:
        """`parallel_prompt_tokens` ids of real text: the prefill prompt, then the other prompts."""
        w = ctx.workload
        ids = list(w.prefill_prompt) + [t for p in w.prompts for t in p]
        want = ctx.settings.parallel_prompt_tokens
        if len(ids) < want:
            raise BenchError(f"the workload holds {len(ids)} tokens, fewer than parallel_prompt_tokens={want}")
        return ids[:want]

    @staticmethod
    def _measure(ctx: SuiteContext, prompt: list[int], n: int, mode: str) -> dict[str, Any]:
        from loom.contracts import derive_seed
        from loom.sampling_params import SamplingParams

        s = ctx.settings
        per_seq = -(-(len(prompt) + s.parallel_max_tokens) // BLOCK_SIZE) + 1
        engine = _engine(ctx, n * per_seq + 1, n, prefix_caching=mode == "prefix_cache")
        params = SamplingParams(max_tokens=s.parallel_max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        start = time.perf_counter()
        if mode == "fork":
            engine.add_request({"prompt_token_ids": prompt}, params.clone(n=n))
        else:
            for i in range(n):
                engine.add_request({"prompt_token_ids": prompt}, params.clone(seed=derive_seed(0, i)))
        final, peak = _drive(engine)
        wall = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for out in final.values() for c in out.outputs)
        if tokens != n * s.parallel_max_tokens:
            raise RuntimeError(f"{mode} n={n} generated {tokens} tokens, expected {n * s.parallel_max_tokens}")
        return {"wall_seconds": wall, "output_tokens": tokens, "throughput_tok_s": tokens / wall,
                "prompt_tokens_computed": engine.scheduler.stats.prompt_tokens_computed, "peak_kv_blocks": peak}


class ParallelQualitySuite(Suite):
    name = "parallel_quality"

    def steps(self, settings: BenchSettings) -> list[str]:
        return ["gsm8k greedy", f"gsm8k {settings.quality_k} samples"] if settings.quality_limit else []

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        from loom.llm import LLM
        from loom.parallel.aggregators import create_extractor
        from loom.sampling_params import SamplingParams

        skipped = _unsupported(ctx)
        s = ctx.settings
        if skipped is not None or not s.quality_limit:
            for label in self.steps(s):
                with ctx.step(label):
                    pass
            return skipped or {"problems": 0, "methods": {}}
        greedy_label, samples_label = self.steps(s)
        problems = load_gsm8k(s.quality_limit)
        tokenizer = ctx.peer.engine.tokenizer  # type: ignore[attr-defined]
        prompts, stop, prompt_format = quality_prompts(tokenizer, problems)
        llm = LLM.from_engine(_quality_engine(ctx, prompts))
        base = SamplingParams(max_tokens=s.quality_max_tokens, stop=stop)
        runs: dict[str, tuple[list[Any], float]] = {}
        for label, params in ((greedy_label, base.clone(temperature=0.0)),
                              (samples_label, base.clone(n=s.quality_k, temperature=SAMPLING_TEMPERATURE, seed=0,
                                                         logprobs=0))):
            with ctx.step(label):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                runs[label] = (outputs, time.perf_counter() - start)
        extract = create_extractor("gsm8k")
        (greedy, greedy_wall), (samples, samples_wall) = runs[greedy_label], runs[samples_label]
        scored = [{"greedy": (extract(g.outputs[0].text), len(g.outputs[0].token_ids)),
                   **score_samples(out.outputs, s.quality_m, extract)} for g, out in zip(greedy, samples)]
        methods = {}
        for method in METHODS:
            correct = sum(row[method][0] == p["answer"] for row, p in zip(scored, problems))
            methods[method] = {"accuracy": correct / len(problems), "correct": correct,
                               "tokens_per_problem": sum(row[method][1] for row in scored) / len(problems),
                               "wall_seconds": greedy_wall if method == "greedy" else samples_wall}
        return {"problems": len(problems), "k": s.quality_k, "m": s.quality_m, "max_tokens": s.quality_max_tokens,
                "temperature": SAMPLING_TEMPERATURE, "prompt_format": prompt_format, "source": str(GSM8K_PATH),
                "methods": methods}


def score_samples(children: Sequence[CompletionOutput], m: int,
                  extract: Callable[[str], str | None]) -> dict[str, tuple[str | None, int]]:
    """(answer, tokens spent) of self-consistency, short-m@k and best-of, all from one problem's
    k finished samples.

    Self-consistency and best-of (highest mean token logprob) need every sample: they spend all
    tokens. short-m@k votes over the m first samples to finish; samples forked together decode
    in lockstep, so those are the m shortest, and a run stopped at the m-th finish (length L)
    would have spent min(length, L) tokens on each sample.
    """
    from loom.parallel.aggregators import BestOfN, MajorityVote, ShortMAtK

    lengths = [len(c.token_ids) for c in children]
    stop_at = sorted(lengths)[min(m, len(lengths)) - 1]
    best = BestOfN("mean").aggregate(children)
    return {"self_consistency": (MajorityVote(extract).aggregate(children).answer, sum(lengths)),
            "short_m_at_k": (ShortMAtK(m, extract).aggregate(children).answer,
                             sum(min(n, stop_at) for n in lengths)),
            "best_of": (extract(best.answer) if best.answer is not None else None, sum(lengths))}


def quality_prompts(tokenizer: Any, problems: list[dict[str, str]]) -> tuple[list[dict[str, Any]], list[str], str]:
    """(prompts, stop strings, format name) of the problems: the chat template where the model has
    one (instruction-tuned models), else a few-shot ``Question: / Answer:`` prompt of worked GSM8K
    solutions (base models), stopped where the model starts the next question."""
    if tokenizer.chat_template is not None:
        prompts = [{"prompt_token_ids": tokenizer.encode_chat([{"role": "user",
                                                                 "content": INSTRUCTION + p["question"]}])}
                   for p in problems]
        return prompts, [], "chat"
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in few_shot_examples(FEW_SHOTS))
    prompts = [{"prompt_token_ids": tokenizer.encode(f"{shots}Question: {p['question']}\nAnswer:")}
               for p in problems]
    return prompts, ["Question:"], f"{FEW_SHOTS}-shot"


def _quality_engine(ctx: SuiteContext, prompts: list[dict[str, Any]]):
    """One engine for every problem: room for `QUALITY_BATCH_SEQS` sequences at once, each with its
    own prompt tail and answer, plus the prefix all prompts share (the prefix cache keeps one copy)."""
    ids = [p["prompt_token_ids"] for p in prompts]
    shared = len(os.path.commonprefix(ids))
    per_seq = -(-(max(len(i) for i in ids) - shared + ctx.settings.quality_max_tokens) // BLOCK_SIZE) + 2
    return _engine(ctx, shared // BLOCK_SIZE + QUALITY_BATCH_SEQS * per_seq + 1, QUALITY_BATCH_SEQS,
                   prefix_caching=True)


def _gsm8k_rows(path: Path) -> list[dict[str, str]]:
    """Every GSM8K line, in a fixed seeded order (evaluation subsets are prefixes of it)."""
    if not path.is_file():
        raise BenchError(f"GSM8K data not found at {path} (expected train.jsonl with question/answer lines)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(SUBSET_SEED).shuffle(rows)
    return rows


def load_gsm8k(limit: int, path: Path = GSM8K_PATH) -> list[dict[str, str]]:
    """`limit` problems as {question, answer (normalised number)}: a fixed seeded subset."""
    from loom.parallel.aggregators import normalize_number

    out = []
    for row in _gsm8k_rows(path)[:limit]:
        answer = normalize_number(row["answer"].rsplit("####", 1)[-1])
        if answer is None:
            raise BenchError(f"GSM8K problem {row['question'][:60]!r} in {path} has no '#### <number>' answer")
        out.append({"question": row["question"], "answer": answer})
    return out


def few_shot_examples(count: int, path: Path = GSM8K_PATH) -> list[tuple[str, str]]:
    """`count` (question, worked answer ending in '#### N') pairs from the end of the seeded order,
    so they are never among the evaluated problems; calculator annotations (<<2*3=6>>) removed."""
    return [(row["question"], re.sub(r"<<[^>]*>>", "", row["answer"])) for row in _gsm8k_rows(path)[-count:]]
