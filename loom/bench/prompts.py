"""The bench workload: Spec-Bench first turns tokenized with the model's own vocabulary.

Every engine reads the same GGUF vocabulary, so the ids built here mean the same text to all of
them; they are passed as ids, never re-tokenized per engine.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from loom.bench.settings import BenchError, BenchSettings, Workload

# ../shared/data/spec_bench/question.jsonl relative to the repository root.
SPEC_BENCH_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
WARMUP_PROMPTS = 2


def load_spec_bench(path: Path = SPEC_BENCH_PATH) -> list[str]:
    """First turns of the Spec-Bench questions, interleaved round-robin over categories (so any
    prefix of the list mixes writing, translation, summarization, QA, math and RAG)."""
    if not path.is_file():
        raise BenchError(f"Spec-Bench prompts not found at {path} (expected a question.jsonl with "
                         f"'turns' and 'category' per line); pass --prompts PATH")
    by_category: dict[str, list[str]] = defaultdict(list)
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                by_category[str(row.get("category", ""))].append(str(row["turns"][0]))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot read Spec-Bench prompts from {path}: {e}") from None
    queues = list(by_category.values())
    out: list[str] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    if len(out) < WARMUP_PROMPTS + 1:
        raise BenchError(f"{path} holds {len(out)} prompts; the bench needs at least {WARMUP_PROMPTS + 1}")
    return out


def build_workload(model_path: Path, settings: BenchSettings, prompts_path: Path = SPEC_BENCH_PATH) -> Workload:
    """Token ids for every run of `settings`, checked against the model's context length."""
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer

    gguf = GGUFFile.open(model_path)
    tok = Tokenizer.from_gguf(gguf)
    context = int(gguf.get(f"{gguf.architecture}.context_length", 0) or 0) or None
    texts = load_spec_bench(prompts_path)

    cap = settings.prompt_tokens
    longest_run = max(settings.max_tokens, settings.decode_tokens, settings.warmup_tokens)
    if context is not None:
        if settings.prefill_tokens + 1 > context:
            raise BenchError(f"--prefill-tokens {settings.prefill_tokens} does not fit the model's context of "
                             f"{context} tokens")
        cap = min(cap, context - longest_run - 1)
        too_long = [c for c in settings.decode_contexts if c + settings.decode_tokens + 1 > context]
        if too_long:
            raise BenchError(f"--decode-context {too_long[0]} + {settings.decode_tokens} new tokens does not fit "
                             f"the model's context of {context} tokens")
        if cap < 1:
            raise BenchError(f"the model's context of {context} tokens leaves no room for a prompt before "
                             f"{longest_run} new tokens; lower --max-tokens/--decode-tokens")

    encoded = [tok.encode(t)[:cap] for t in texts]
    warmup, rest = encoded[-WARMUP_PROMPTS:], encoded[:-WARMUP_PROMPTS]

    prefill = list(tok.encode(""))  # the BOS the model expects, if any
    for t in texts:
        if len(prefill) >= settings.prefill_tokens:
            break
        prefill.extend(tok.encode(t, add_special_tokens=False))
    if len(prefill) < settings.prefill_tokens:
        raise BenchError(f"the prompts hold only {len(prefill)} tokens; --prefill-tokens "
                         f"{settings.prefill_tokens} is more than they can fill")
    notes = [f"prompts: Spec-Bench first turns, round-robin over categories, cut to {cap} tokens"]
    return Workload(warmup_prompts=warmup, decode_prompt=rest[0], prefill_prompt=prefill[:settings.prefill_tokens],
                    prompts=rest, source=str(prompts_path), notes=notes,
                    context_prompts=[_long_prompt(tok, texts, n) for n in settings.decode_contexts])


def _long_prompt(tok, texts: list[str], n: int) -> list[int]:
    """Exactly n tokens: BOS (if the model wants one), then the prompts' texts one after another,
    from the start again as often as needed."""
    ids = list(tok.encode(""))
    body = [t for text in texts for t in tok.encode(text, add_special_tokens=False)]
    if not body:
        raise BenchError("the prompt file holds no text for --decode-context")
    while len(ids) < n:
        ids.extend(body[:n - len(ids)])
    return ids[:n]
