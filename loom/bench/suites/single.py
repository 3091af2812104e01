"""Single-stream suites: decode speed of one request, and prefill speed of one long prompt."""

from __future__ import annotations

from typing import Any

from loom.bench.settings import BenchSettings
from loom.bench.stats import median
from loom.bench.suites.base import Suite, SuiteContext


class DecodeSuite(Suite):
    """One request, `decode_tokens` new tokens after a short prompt. Only decoding is timed:
    (last token time - first token time) / (tokens - 1)."""

    name = "decode"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"decode {settings.decode_tokens} tokens"]

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        with ctx.step(self.steps(ctx.settings)[0]):
            run = ctx.peer.generate([ctx.workload.decode_prompt], ctx.settings.decode_tokens)
        req = run.requests[0]
        if req.tpot is None or req.tpot <= 0:
            raise RuntimeError("the decode run produced no timed tokens")
        return {"prompt_tokens": len(ctx.workload.decode_prompt), "tokens": req.output_tokens,
                "ms_per_token": req.tpot * 1e3, "tok_s": 1.0 / req.tpot}


class DecodeContextSuite(Suite):
    """Decode speed at long context: for each of `decode_contexts`, one request whose prompt has
    exactly that many tokens, then `decode_tokens` new tokens timed as in the decode suite (reading
    the whole KV cache every token)."""

    name = "decode_context"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"decode {settings.decode_tokens} tokens at context {n}" for n in settings.decode_contexts]

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, prompt in zip(self.steps(ctx.settings), ctx.workload.context_prompts):
            with ctx.step(name):
                req = ctx.peer.generate([prompt], ctx.settings.decode_tokens).requests[0]
            if req.tpot is None or req.tpot <= 0:
                raise RuntimeError(f"the decode run at context {len(prompt)} produced no timed tokens")
            out[str(len(prompt))] = {"tokens": req.output_tokens, "ms_per_token": req.tpot * 1e3,
                                     "tok_s": 1.0 / req.tpot}
        return out


class PrefillSuite(Suite):
    """Time to first token of a `prefill_tokens` prompt no cache has seen; median of the repeats."""

    name = "prefill"

    def steps(self, settings: BenchSettings) -> list[str]:
        return [f"prefill {settings.prefill_tokens} tokens"]

    def run(self, ctx: SuiteContext) -> dict[str, Any]:
        prompt = ctx.workload.prefill_prompt
        with ctx.step(self.steps(ctx.settings)[0]):
            times = [ctx.peer.prefill(prompt) for _ in range(ctx.settings.prefill_repeats)]
        seconds = median(times)
        return {"tokens": len(prompt), "repeats": len(times), "seconds": seconds, "tok_s": len(prompt) / seconds}
