"""Structured output on the shared JSON Schema sets: compile rate and time, and validity of what
the model generates under each schema (checked with `jsonschema`), greedy and sampled.

    .venv/bin/python benchmarks/structured_bench.py --model smollm2-135m --generate 10

Prints a Markdown table (the docs/benchmarks.md section).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema

from loom import LLM, SamplingParams
from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "json_schema"
SETS = ("github_easy", "glaive_functions", "bfcl_parallel")


def load(name: str) -> list[dict]:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    # BFCL rows wrap the schema with its description and metadata
    return [r["schema"]["schema"] if "meta" in r["schema"] else r["schema"] for r in rows]


def compile_all(llm: LLM, schemas: list[dict]) -> tuple[list[dict], list[float], list[str]]:
    ok, times, errors = [], [], []
    for schema in schemas:
        t0 = time.perf_counter()
        try:
            llm.engine.structured.compile(StructuredOutputsParams(json=schema))
        except InvalidRequestError as e:
            errors.append(str(e))
            continue
        times.append(time.perf_counter() - t0)
        ok.append(schema)
    return ok, times, errors


def generate(llm: LLM, schemas: list[dict], temperature: float, max_tokens: int) -> dict[str, int]:
    prompts = [llm.engine.tokenizer.encode_chat([{"role": "user", "content": "Answer with one JSON value that "
                                                  f"follows this JSON Schema:\n{json.dumps(s)[:1500]}"}])
               for s in schemas]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                             structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counts = {"finished": 0, "valid": 0, "length": 0, "invalid": 0}
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            counts["length"] += 1
            continue
        counts["finished"] += 1
        try:
            jsonschema.validate(json.loads(c.text), schema)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            counts["invalid"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--generate", type=int, default=10, help="schemas per set to generate under (0: compile only)")
    ap.add_argument("--max-tokens", type=int, default=384)
    args = ap.parse_args()
    llm = LLM(args.model)
    lines = [f"| set | schemas | compiled | compile p50 ms | p99 ms | greedy valid / finished (length) | "
             f"sampled valid / finished (length) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in SETS:
        schemas = load(name)
        ok, times, errors = compile_all(llm, schemas)
        times.sort()
        p50 = statistics.median(times) * 1e3 if times else float("nan")
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3 if times else float("nan")
        cells = []
        for temperature in (0.0, 0.8):
            if args.generate:
                c = generate(llm, ok[:args.generate], temperature, args.max_tokens)
                cells.append(f"{c['valid']} / {c['finished']} ({c['length']})")
            else:
                cells.append("-")
        lines.append(f"| {name} | {len(schemas)} | {len(ok)} ({100 * len(ok) / len(schemas):.0f}%) | {p50:.1f} | "
                     f"{p99:.1f} | {cells[0]} | {cells[1]} |")
        for e in errors[:3]:
            print(f"  {name}: {e[:160]}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
