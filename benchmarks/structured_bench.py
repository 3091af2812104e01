"""Structured output on the shared JSON Schema sets (github_easy, glaive_functions, bfcl_parallel).

    .venv/bin/python benchmarks/structured_bench.py --model smollm2-135m --generate 6 --tpot 8

Per set: compile rate and compile time p50/p99 with xgrammar (loom's backend), llguidance and
llama.cpp's `LlamaGrammar.from_json_schema` (the peer), and the time to fill one token mask at
the start of each grammar (xgrammar and llguidance); validity (`jsonschema`) of what the model
generates under the first `--generate` schemas that compile, greedy and sampled (loom, and
llama.cpp's grammar sampling on the same prompts). Then TPOT, constrained vs unconstrained,
at 1 and `--concurrency` concurrent requests: the unconstrained run gives each request the
constrained run's output length (`ignore_eos`), so both runs decode the same tokens per request
and the same batch at every step; jump-forward (`speculative_config={"method": "grammar"}`)
is a third run. llama.cpp runs one request at a time (its Python API has no batching).
These runs are one after another on short outputs, so one of them moves by ±10 points: the
constrained-decoding overhead itself is measured by benchmarks/structured_tpot.py (paired,
interleaved rounds in one engine).

llguidance and llama-cpp-python are needed for their columns only (benchmark-only imports).
Prints Markdown tables (the docs/benchmarks.md section).
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


def pct(times: list[float], q: float) -> float:
    if not times:
        return float("nan")
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


# -- compilers ------------------------------------------------------------------------------------


def compile_loom(llm: LLM, schemas: list[dict]) -> tuple[list[bool], list[float], list[float]]:
    """(compiled?, compile seconds, seconds to fill the first mask) per schema, xgrammar."""
    so = llm.engine.structured
    ok, times, masks = [], [], []
    for schema in schemas:
        t0 = time.perf_counter()
        try:
            compiled = so.backend.compile(StructuredOutputsParams(json=schema))
        except ValueError:
            ok.append(False)
            continue
        times.append(time.perf_counter() - t0)
        ok.append(True)
        m, mask = so.backend.matcher(compiled), so.backend.allocate_mask(1)
        t0 = time.perf_counter()
        m.fill_mask(mask, 0)
        masks.append(time.perf_counter() - t0)
    return ok, times, masks


def token_bytes(tok) -> list[bytes]:
    """Each token's bytes (special tokens: 0xFF + name, llguidance's convention)."""
    special = set(tok.special_token_ids)
    if tok.vocab_kind == "byte_level":
        bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
        cs, n = list(bs), 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        inv = {chr(c): b for b, c in zip(bs, cs)}
        spell = lambda t: bytes(inv[ch] for ch in t) if all(ch in inv for ch in t) else t.encode()  # noqa: E731
    else:
        def spell(t: str) -> bytes:
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                return bytes([int(t[3:5], 16)])
            return t.replace("\u2581", " ").encode()
    return [b"\xff" + t.encode() if i in special else spell(t) for i, t in enumerate(tok.raw_tokens)]


def compile_llguidance(tok, schemas: list[dict]) -> tuple[list[bool], list[float], list[float]]:
    import llguidance
    import llguidance.torch as lltorch

    class _Tok:
        def __init__(self):
            self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id
            self.tokens, self.special_token_ids = token_bytes(tok), list(tok.special_token_ids)

        def __call__(self, s):
            return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_special_tokens=False)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tok()))
    ok, times, masks = [], [], []
    for schema in schemas:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        if matcher.is_error():
            ok.append(False)
            continue
        times.append(time.perf_counter() - t0)
        ok.append(True)
        mask = lltorch.allocate_token_bitmask(1, lltok.vocab_size)
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        masks.append(time.perf_counter() - t0)
    return ok, times, masks


def compile_llama(schemas: list[dict]) -> tuple[list[bool], list[float]]:
    from llama_cpp import LlamaGrammar

    ok, times = [], []
    for schema in schemas:
        t0 = time.perf_counter()
        try:
            LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        except Exception:   # noqa: BLE001 - the converter raises whatever it meets
            ok.append(False)
            continue
        times.append(time.perf_counter() - t0)
        ok.append(True)
    return ok, times


# -- generation ------------------------------------------------------------------------------------


def prompt_text(llm: LLM, schema: dict) -> str:
    ask = f"Answer with one JSON value that follows this JSON Schema:\n{json.dumps(schema)[:1500]}\n"
    tok = llm.engine.tokenizer
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False)
    return ask + "JSON:"   # a base model without a chat template (Gemma 3 270M)


def check(text: str, finish: str, schema: dict, counts: dict[str, int]) -> None:
    if finish != "stop":
        counts["length"] += 1
        return
    counts["finished"] += 1
    try:
        jsonschema.validate(json.loads(text), schema)
        counts["valid"] += 1
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        counts["invalid"] += 1
        counts.setdefault("bad", []).append(text[:200])


def validity(llm: LLM, schemas: list[dict], temperature: float, max_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                             structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    outs = llm.generate([prompt_text(llm, s) for s in schemas], params, use_tqdm=False)
    counts = {"finished": 0, "valid": 0, "length": 0, "invalid": 0}
    for schema, out in zip(schemas, outs):
        check(out.outputs[0].text, out.outputs[0].finish_reason, schema, counts)
    return counts


def tpot(outs) -> float:
    """Mean over requests of (last token time - first token time) / (tokens - 1)."""
    per = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    return statistics.mean(per) * 1e3 if per else float("nan")


def tpot_runs(llm: LLM, jump: LLM, auto: LLM, schemas: list[dict], max_tokens: int) -> dict[str, float]:
    """TPOT ms of the same requests constrained, unconstrained (same lengths), jump-forward forced
    (every forced run drafted) and jump-forward under the controller's cost model (the default)."""
    prompts = [prompt_text(llm, s) for s in schemas]
    cons = [SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs={"json": s}) for s in schemas]
    first = llm.generate(prompts, cons, use_tqdm=False)
    lengths = [max(2, len(o.outputs[0].token_ids)) for o in first]
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    result = {"tokens": sum(lengths)}
    for label, engine, params in (("free", llm, free), ("constrained", llm, cons), ("jump", jump, cons),
                                  ("auto", auto, cons), ("free2", llm, free)):
        result[label] = tpot(engine.generate(prompts, params, use_tqdm=False))
    result["free"] = min(result.pop("free2"), result["free"])   # bracketed: the machine's drift
    return result


# -- llama.cpp (the peer) --------------------------------------------------------------------------


def llama_peer(model_path: str, prompts: list[str], schemas: list[dict], max_tokens: int) -> dict:
    """Validity (greedy) and TPOT constrained vs unconstrained (same length), one at a time."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=model_path, n_ctx=4096, n_threads=2, verbose=False)
    counts = {"finished": 0, "valid": 0, "length": 0, "invalid": 0}
    t_con, t_free = [], []
    for prompt, schema in zip(prompts, schemas):
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        text, times, finish = "", [], None
        for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, grammar=grammar,
                                           stream=True):
            text += chunk["choices"][0]["text"]
            times.append(time.perf_counter())
            finish = chunk["choices"][0]["finish_reason"] or finish
        check(text, finish, schema, counts)
        n = len(times)
        if n > 2:
            t_con.append((times[-1] - times[0]) / (n - 1))
            times = [time.perf_counter() for _ in llm.create_completion(
                prompt, max_tokens=n, temperature=0, stream=True, logit_bias={llm.token_eos(): -1e9})]
            t_free.append((times[-1] - times[0]) / (len(times) - 1))
    counts["tpot_con"] = statistics.mean(t_con) * 1e3 if t_con else float("nan")
    counts["tpot_free"] = statistics.mean(t_free) * 1e3 if t_free else float("nan")
    return counts


# -- the run ------------------------------------------------------------------------------------------


def compile_table(llm: LLM, sets: dict[str, list[dict]], peers: bool) -> tuple[list[str], dict[str, list[dict]]]:
    lines = ["| set | schemas | xgrammar compiled | p50 ms | p99 ms | first mask us (p50) | llguidance compiled "
             "| p50 ms | p99 ms | first mask us (p50) | llama.cpp compiled | p50 ms | p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    compiled = {}
    for name, schemas in sets.items():
        ok, t, m = compile_loom(llm, schemas)
        compiled[name] = [s for s, good in zip(schemas, ok) if good]
        row = f"| {name} | {len(schemas)} | {sum(ok)} | {pct(t, .5):.1f} | {pct(t, .99):.1f} | {pct(m, .5) * 1e3:.0f} |"
        if peers:
            lok, lt, lm = compile_llguidance(llm.engine.tokenizer, schemas)
            cok, ct = compile_llama(schemas)
            row += (f" {sum(lok)} | {pct(lt, .5):.1f} | {pct(lt, .99):.1f} | {pct(lm, .5) * 1e3:.0f} |"
                    f" {sum(cok)} | {pct(ct, .5):.1f} | {pct(ct, .99):.1f} |")
        else:
            row += " - | - | - | - | - | - | - |"
        lines.append(row)
    return lines, compiled


def cell(c: dict) -> str:
    return f"{c['valid']} / {c['finished']} ({c['length']})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--generate", type=int, default=6, help="schemas per set to generate under (0: compile only)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--peer-generate", type=int, default=3, help="of those, schemas per set for llama.cpp")
    ap.add_argument("--schemas", type=int, default=0, help="the first N schemas of each set only (0: all)")
    ap.add_argument("--tpot", type=int, default=4, help="requests, one at a time, for TPOT at concurrency 1 "
                                                         "(0: no TPOT runs)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tpot-tokens", type=int, default=128)
    ap.add_argument("--no-peers", action="store_true", help="leave out llguidance and llama.cpp")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=max(args.concurrency, 8), num_blocks=2048)
    jump = LLM(args.model, max_num_seqs=max(args.concurrency, 8), num_blocks=2048,
               speculative_config={"method": "grammar", "adaptive": False}) if args.tpot else None
    auto = LLM(args.model, max_num_seqs=max(args.concurrency, 8), num_blocks=2048,
               speculative_config={"method": "grammar"}) if args.tpot else None
    sets = {name: load(name)[:args.schemas or None] for name in SETS}
    raw: dict = {"model": args.model}
    lines, compiled = compile_table(llm, sets, not args.no_peers)
    print("\n".join(lines), flush=True)
    out = ["| set | n | greedy valid / finished (length) | sampled T=0.8 | llama.cpp greedy (first n) |",
           "|---|---:|---:|---:|---:|"]
    peer_tpot = {"tpot_con": [], "tpot_free": []}
    for name, schemas in compiled.items():
        some = schemas[:args.generate]
        if not some:
            continue
        g, s = validity(llm, some, 0.0, args.max_tokens), validity(llm, some, 0.8, args.max_tokens)
        p = ({} if args.no_peers else
             llama_peer(str(llm.engine.model_path), [prompt_text(llm, x) for x in some[:args.peer_generate]],
                        some[:args.peer_generate], args.max_tokens))
        raw[name] = {"greedy": g, "sampled": s, "llama": p}
        out.append(f"| {name} | {len(some)} | {cell(g)} | {cell(s)} | "
                   f"{cell(p) + f' (n={args.peer_generate})' if p else '-'} |")
        for k in peer_tpot:
            if p:
                peer_tpot[k].append(p[k])
        print(out[-1], raw[name], flush=True)
    print("\n".join(out), flush=True)
    if args.tpot:
        tpot_table(llm, jump, auto, compiled, args, peer_tpot, raw)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str))


def tpot_table(llm: LLM, jump: LLM, auto: LLM, compiled: dict[str, list[dict]], args, peer_tpot: dict, raw: dict) -> None:
    mixed = [s for group in zip(*compiled.values()) for s in group]
    rows = ["| concurrent | tokens | unconstrained ms | constrained ms | overhead | jump-forward forced ms "
            "| vs unconstrained | jump-forward, cost model ms | vs unconstrained |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tpot_runs(llm, jump, auto, mixed[:args.concurrency], args.tpot_tokens)   # warm-up: every engine, this batch
    singles = [tpot_runs(llm, jump, auto, [s], args.tpot_tokens) for s in mixed[:args.tpot]]
    batch = tpot_runs(llm, jump, auto, mixed[:args.concurrency], args.tpot_tokens)
    one = {k: statistics.mean(r[k] for r in singles) for k in singles[0]}
    for c, r in ((1, one), (args.concurrency, batch)):
        raw[f"tpot_{c}"] = r
        rows.append(f"| {c} | {r['tokens']:.0f} | {r['free']:.1f} | {r['constrained']:.1f} | "
                    f"{100 * (r['constrained'] / r['free'] - 1):+.1f}% | {r['jump']:.1f} | "
                    f"{100 * (r['jump'] / r['free'] - 1):+.1f}% | {r['auto']:.1f} | "
                    f"{100 * (r['auto'] / r['free'] - 1):+.1f}% |")
    if peer_tpot["tpot_con"]:
        con, free = statistics.mean(peer_tpot["tpot_con"]), statistics.mean(peer_tpot["tpot_free"])
        raw["llama_tpot_1"] = {"free": free, "constrained": con}
        rows.append(f"| 1 (llama.cpp) | - | {free:.1f} | {con:.1f} | {100 * (con / free - 1):+.1f}% | - | - |")
    print("\n".join(rows), flush=True)
    raw["jump_stats"], raw["auto_stats"] = vars(jump.engine.spec.stats), vars(auto.engine.spec.stats)
    print("forced:", raw["jump_stats"], "cost model:", raw["auto_stats"])


if __name__ == "__main__":
    main()
