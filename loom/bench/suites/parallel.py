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
seeded permutation, so smaller subsets are prefixes of larger ones), chat-formatted and asked
to end with ``#### <number>``; accuracy and generated tokens per problem (aborted children's
tokens included) for greedy, self-consistency@k (majority vote), short-m@k and best-of-k (mean
logprob).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from loom.bench.settings import BenchError, BenchSettings
from loom.bench.suites.base import Suite, SuiteContext

# ../shared/data/gsm8k/train.jsonl relative to the repository root.
GSM8K_PATH = Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k" / "train.jsonl"
BLOCK_SIZE = 16
MODES = ("fork", "independent", "prefix_cache")
METHODS = ("greedy", "self_consistency", "short_m_at_k", "best_of")
SUBSET_SEED = 1234
SAMPLING_TEMPERATURE = 0.7
# Sequences decoding at once in the quality suite (problems are submitted in chunks of this).
QUALITY_BATCH_SEQS = 32
INSTRUCTION = ("Solve the math problem. Reason step by step, then write the final answer on its own line "
               "as '#### <number>'.\n\n")


def _unsupported(ctx: SuiteContext) -> dict[str, Any] | None:
    engine = getattr(ctx.peer, "engine", None)
    if engine is None or not hasattr(engine, "fanout"):
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
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
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
        from loom.parallel.fanout import derive_seed
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
                "prompt_tokens_computed": engine.scheduler.stats.prompt_tokens, "peak_kv_blocks": peak}


class ParallelQualitySuite(Suite):
    name = "parallel_quality"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"gsm8k {m}" for m in METHODS] if settings.quality_limit else []

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        skipped = _unsupported(ctx)
        s = ctx.settings
        problems = load_gsm8k(s.quality_limit) if skipped is None else []
        methods: dict[str, Any] = {}
        for method, label in zip(METHODS, self.steps(s)):
            with ctx.step(label):
                if skipped is None:
                    methods[method] = self._method(ctx, problems, method)
        if skipped is not None:
            return skipped
        return {"problems": len(problems), "k": s.quality_k, "m": s.quality_m, "max_tokens": s.quality_max_tokens,
                "temperature": SAMPLING_TEMPERATURE, "source": str(GSM8K_PATH), "methods": methods}

    @staticmethod
    def _plan(s: BenchSettings, method: str):
        """(params, aggregator) of one method."""
        from loom.parallel.aggregators import BestOfN, MajorityVote, ShortMAtK
        from loom.sampling_params import SamplingParams

        if method == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=s.quality_max_tokens), MajorityVote("gsm8k")
        params = SamplingParams(n=s.quality_k, temperature=SAMPLING_TEMPERATURE, seed=0,
                                max_tokens=s.quality_max_tokens)
        aggregator = {"self_consistency": MajorityVote("gsm8k"), "short_m_at_k": ShortMAtK(s.quality_m, "gsm8k"),
                      "best_of": BestOfN("mean")}[method]
        return params, aggregator

    def _method(self, ctx: SuiteContext, problems: list[dict[str, str]], method: str) -> dict[str, Any]:
        from loom.parallel.aggregators import create_extractor, sample_and_aggregate

        s = ctx.settings
        params, aggregator = self._plan(s, method)
        tok = ctx.peer.engine.tokenizer  # type: ignore[attr-defined]
        prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": INSTRUCTION + p["question"]}])}
                   for p in problems]
        chunk = max(1, QUALITY_BATCH_SEQS // params.n)
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        engine = _engine(ctx, chunk * params.n * (-(-(longest + s.quality_max_tokens) // BLOCK_SIZE) + 1) + 1,
                         chunk * params.n, prefix_caching=True)
        extract = create_extractor("gsm8k")
        correct = tokens = 0
        start = time.perf_counter()
        for i in range(0, len(prompts), chunk):
            for problem, got in zip(problems[i:i + chunk],
                                    sample_and_aggregate(engine, prompts[i:i + chunk], params, aggregator)):
                tokens += sum(len(c.token_ids) for c in got.output.outputs)
                correct += got.answer is not None and extract(got.answer) == problem["answer"]
        wall = time.perf_counter() - start
        return {"accuracy": correct / len(problems), "correct": correct,
                "tokens_per_problem": tokens / len(problems), "wall_seconds": wall}


def load_gsm8k(limit: int, path: Path = GSM8K_PATH) -> list[dict[str, str]]:
    """`limit` problems as {question, answer (normalised number)}: a fixed seeded subset."""
    from loom.parallel.aggregators import normalize_number

    if not path.is_file():
        raise BenchError(f"GSM8K data not found at {path} (expected train.jsonl with question/answer lines)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    order = list(range(len(rows)))
    random.Random(SUBSET_SEED).shuffle(order)
    out = []
    for i in order[:limit]:
        answer = normalize_number(rows[i]["answer"].rsplit("####", 1)[-1])
        if answer is None:
            raise BenchError(f"GSM8K line {i + 1} of {path} has no '#### <number>' answer")
        out.append({"question": rows[i]["question"], "answer": answer})
    return out
