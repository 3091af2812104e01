"""`loom bench --server URL`: a load test of a running OpenAI-compatible server, from this process.

Only the public OpenAI API is used (``GET /v1/models``, streaming ``POST /v1/chat/completions``
or ``POST /v1/completions`` with ``stream_options.include_usage``), so any such server can be
measured: loom's own, llama.cpp's ``llama-server``, vLLM. The load generator shares the machine
with the server under test, so it is kept light: the streams are read with aiohttp, which used
0.18 s of CPU for a 32-request load of 2,048 chunks where httpx's client used 0.56-0.68 s (a
seventh of one of two cores, taken from the server).

Endpoint (``--endpoint``, as vLLM's ``benchmark_serving``): ``chat`` sends each prompt as one user
message, ``completions`` sends it as the plain prompt text (a base model without a chat template,
such as Gemma 3 270M, answers only those), ``auto`` picks completions for a model without a chat
template: from the GGUF when the bench knows it (`endpoint_for_gguf`), else from the server's
``GET /tokenizer_info`` (vLLM's route, which loom serves), else chat.

After one unmeasured warm-up request, for every rate of a ladder (requests per second; ``max``
sends every request at once) requests arrive as a Poisson process (exponential gaps, seeded)
carrying Spec-Bench first turns; each rate takes the prompts after the previous rate's, so a
server's prefix cache does not favour the later rates. Each request records when it was sent,
when its first content token arrived (TTFT), the gaps between content chunks (inter-token
latency, ITL), when it ended (end-to-end latency) and its output tokens (the usage chunk;
without one, the content chunks). A 429 counts as rejected, any other failure as an error.

Per rate: ``duration`` runs from the first send to the last answer; achieved request throughput
is ok requests / duration and output throughput is their tokens / duration.

Saturation. With L0 the median end-to-end latency at the lowest rate (the unloaded latency),
a server that keeps up finishes each request about L0 after sending it, so N requests sent over
a window W are done after about W + L0: ``expected_rps = N / (W + L0)`` and
``tracking = achieved_rps / expected_rps`` (about 1 while the server keeps up). The saturation
rate is the lowest finite rate where tracking drops below `MIN_TRACKING`, the median end-to-end
latency exceeds `LATENCY_BLOWUP` × L0, or any request is rejected or fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.bench.prompts import SPEC_BENCH_PATH, load_spec_bench
from loom.bench.settings import BenchError
from loom.bench.stats import percentile
from loom.loader.gguf import GGUFFile

DEFAULT_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
QUICK_RATES = (1.0, math.inf)
DEFAULT_REQUESTS = 32
DEFAULT_MAX_TOKENS = 128
MIN_TRACKING = 0.9
LATENCY_BLOWUP = 3.0
PERCENTILES = (50, 99)
REQUEST_TIMEOUT_S = 600.0
SETUP_TIMEOUT_S = 30.0           # the set-up calls' (the model list, /tokenizer_info)
MAX_ERROR_SAMPLES = 5
# endpoint -> path under /v1; "auto" is resolved to one of them before the load starts
ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}
AUTO = "auto"
_ENDPOINT_ALIASES = {AUTO: AUTO, **{name: name for name in ENDPOINTS},
                     **{alias: name for name, path in ENDPOINTS.items()
                        for alias in (path, path.lstrip("/"), f"/v1{path}", f"v1{path}")}}


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.5,1,max' -> (0.5, 1.0, inf): positive rates in req/s, 'max' or 'inf' for all at once."""
    rates = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        if part in ("max", "inf"):
            rates.append(math.inf)
            continue
        try:
            rate = float(part)
        except ValueError:
            raise BenchError(f"--rates: expected numbers or 'max', got {part!r}") from None
        if not rate > 0 or math.isnan(rate):
            raise BenchError(f"--rates: a rate must be positive, got {part!r}")
        rates.append(rate)
    if not rates:
        raise BenchError("--rates: no rate given")
    return tuple(sorted(set(rates)))


def parse_endpoint(text: str) -> str:
    """'chat', 'completions', 'auto', or a path such as '/v1/completions' -> the endpoint's name."""
    name = _ENDPOINT_ALIASES.get(text.strip().lower())
    if name is None:
        raise BenchError(f"--endpoint: expected auto, chat or completions (or /v1/chat/completions, "
                         f"/v1/completions), got {text!r}")
    return name


def endpoint_for_gguf(gguf: Path) -> str:
    """``completions`` when the GGUF carries no chat template (a base model), else ``chat``."""
    try:
        template = GGUFFile.open(gguf).get("tokenizer.chat_template")
    except Exception as e:  # noqa: BLE001 - any failure to read it is reported as one line
        raise BenchError(f"--endpoint auto: cannot read the chat template of {gguf}: {e}") from None
    return "chat" if isinstance(template, str) and template.strip() else "completions"


def rate_label(rate: float) -> str:
    return "max" if math.isinf(rate) else f"{rate:g}"


@dataclass(frozen=True)
class LoadSettings:
    """The load test's plan.

    url: the server's base URL (``/v1`` is appended unless it ends with it).
    rates: offered request rates in req/s, ascending; inf sends every request at once.
    num_requests / duration: requests per rate, either a fixed count or rate × duration
    seconds (the ``max`` point then takes the largest count of the ladder).
    max_tokens: the ``max_tokens`` of every request.
    temperature, top_p: every request's sampling (default greedy). A sampled request also
        sends ``top_k: -1`` and ``min_p: 0``, so that a server with defaults of its own
        (llama-server: top-k 40, min-p 0.05) samples from the same distribution as the others.
    prompt_chars: prompts are cut to this many characters (about 4 per token).
    max_concurrency: at most this many requests in flight (vLLM's benchmark_serving
        --max-concurrency): a request that arrives while they are busy waits, and its times
        count from when it is sent; with rate ``max`` and more requests than this, a closed
        loop that holds the server at this many streams.
    endpoint: ``chat``, ``completions`` or ``auto`` (see the module docstring).
    ignore_eos: ask for exactly `max_tokens` per request (``ignore_eos``, an extension loom,
    vLLM and llama-server all take), so every server generates the same tokens.
    """

    url: str
    rates: tuple[float, ...] = DEFAULT_RATES
    num_requests: int | None = DEFAULT_REQUESTS
    duration: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    prompt_chars: int = 1000
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    prompts_path: Path = SPEC_BENCH_PATH
    max_concurrency: int | None = None
    endpoint: str = AUTO
    ignore_eos: bool = False
    model_required: bool = False   # `model` was named: a server that does not serve it is an error
    model_aliases: tuple[str, ...] = ()   # other names `model` is served under (a GGUF file's stem)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.endpoint != AUTO and self.endpoint not in ENDPOINTS:
            raise BenchError(f"unknown endpoint {self.endpoint!r} (auto, {', '.join(ENDPOINTS)})")
        if (self.num_requests is None) == (self.duration is None):
            raise BenchError("give either a request count per rate or a duration per rate, not both")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise BenchError(f"--duration must be positive, got {self.duration}")
        if self.max_tokens < 1 or self.prompt_chars < 1:
            raise BenchError("max_tokens and prompt_chars must be >= 1")
        if not self.temperature >= 0:
            raise BenchError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BenchError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not self.rates:
            raise BenchError("no rate to measure")

    @property
    def api_base(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else f"{base}/v1"

    @property
    def endpoint_url(self) -> str:
        """The URL every request goes to (the endpoint must be resolved: not auto)."""
        return f"{self.api_base}{ENDPOINTS[self.endpoint]}"

    def counts(self) -> list[int]:
        """Requests sent at each rate of the ladder."""
        if self.num_requests is not None:
            return [self.num_requests] * len(self.rates)
        finite = [max(1, round(r * self.duration)) for r in self.rates if not math.isinf(r)]
        top = max(finite, default=max(1, round(self.duration)))
        return [top if math.isinf(r) else max(1, round(r * self.duration)) for r in self.rates]

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "rates": [rate_label(r) for r in self.rates], "num_requests": self.num_requests,
                "duration": self.duration, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "prompt_chars": self.prompt_chars, "seed": self.seed,
                "prompts_path": str(self.prompts_path),
                "max_concurrency": self.max_concurrency, "endpoint": self.endpoint, "ignore_eos": self.ignore_eos}


@dataclass
class RequestRecord:
    """One request's timeline, in seconds from the start of its rate's run."""

    sent: float
    status: int | None = None        # HTTP status (None: no answer)
    error: str | None = None
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end is not None

    @property
    def rejected(self) -> bool:
        return self.status == 429


def arrival_times(rate: float, count: int, rng: random.Random) -> list[float]:
    """Send offsets of `count` Poisson arrivals at `rate` per second, the first at 0; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * count
    times, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True)
class RatePlan:
    """One rate of the ladder: its requests' prompts and send offsets (seconds from its start)."""

    rate: float
    prompts: list[str]
    offsets: list[float]


def plan_ladder(settings: LoadSettings) -> tuple[str, list[RatePlan]]:
    """The warm-up prompt and every rate's requests, the same for every server (and for the engine
    alone, `loom.bench.engine_load`): Spec-Bench first turns cut to ``prompt_chars``, the last one
    kept for the warm-up, each rate continuing where the previous one stopped; Poisson offsets
    seeded per rate."""
    prompts = [p[:settings.prompt_chars] for p in load_spec_bench(settings.prompts_path)]
    measured = prompts[:-1]  # the last one warms the server up
    plans, sent = [], 0
    for i, (rate, count) in enumerate(zip(settings.rates, settings.counts())):
        fresh = [measured[(sent + j) % len(measured)] for j in range(count)]
        plans.append(RatePlan(rate, fresh, arrival_times(rate, count, random.Random(settings.seed * 1000 + i))))
        sent += count
    return prompts[-1], plans


def load_report(asked: LoadSettings, server: str, model: str, endpoint: str, why: str | None,
                levels: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """The whole ladder's report (JSON-able) from its levels (`summarize`)."""
    measured = len(load_spec_bench(asked.prompts_path)) - 1
    return {"kind": "load", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "server": server, "model": model, "settings": asked.to_json(),
            "endpoint": endpoint, "endpoint_note": why,
            "prompts": f"Spec-Bench first turns, round-robin over categories, cut to {asked.prompt_chars} "
                       f"characters; each rate continues where the previous one stopped (no prompt repeats "
                       f"before all {measured} were sent), after one unmeasured warm-up request",
            "levels": levels, "saturation": saturation(levels)}


def _payload(settings: LoadSettings, model: str, prompt: str) -> dict[str, Any]:
    """The request body: the prompt as one user message (chat) or as the plain prompt text (completions)."""
    text = ({"messages": [{"role": "user", "content": prompt}]} if settings.endpoint == "chat"
            else {"prompt": prompt})
    sampled = {"top_p": settings.top_p, "top_k": -1, "min_p": 0.0} if settings.temperature > 0 else {}
    return {"model": model, **text, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            **sampled, "stream": True, "stream_options": {"include_usage": True},
            **({"ignore_eos": True} if settings.ignore_eos else {})}


def _has_text(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries output text: a chat ``delta.content`` or a completion ``text``."""
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in chunk.get("choices") or ())


async def _send(client: Any, settings: LoadSettings, payload: dict[str, Any], record: RequestRecord,
                clock: Callable[[], float]) -> None:
    """Streams one completion or chat completion into `record` (`client`: an aiohttp session);
    never raises for a failed request."""
    try:
        async with client.post(settings.endpoint_url, json=payload) as response:
            record.status = response.status
            if response.status != 200:
                body = (await response.read()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status}: {body[:200]}"
                return
            done = False
            async for data in _sse_data(response.content):
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"in-stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                if _has_text(chunk):
                    now = clock()
                    record.first_token = now if record.first_token is None else record.first_token
                    record.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
                    record.usage_reported = True
        if not record.usage_reported:
            record.output_tokens = len(record.chunk_times)
        if not done:   # vLLM's benchmark counts these failed too: a stream must end with [DONE]
            record.error = "the stream ended without [DONE] (a server that does not stream, or one cut off)"
        elif record.output_tokens == 0:
            record.error = "the stream carried no output token"
        record.end = clock()
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement, not a crash
        record.error = f"{type(e).__name__}: {e}"[:300]


async def _sse_data(stream: Any) -> Any:
    """The payloads of a response's ``data:`` lines as they arrive (bytes, stripped), however the
    network splits them: no limit on a line's length (aiohttp's own line reader has one)."""
    pending = bytearray()   # the text since the last newline (grows in place: no quadratic copies)
    async for piece in stream.iter_any():
        pending += piece
        if b"\n" not in piece:
            continue
        *lines, rest = pending.split(b"\n")
        pending = bytearray(rest)
        for line in lines:
            if line.startswith(b"data:"):
                yield bytes(line[5:].strip())
    if pending.startswith(b"data:"):
        yield bytes(pending[5:].strip())


async def run_rate(client: Any, settings: LoadSettings, model: str, plan: RatePlan,
                   on_done: Callable[[], None] = lambda: None) -> list[RequestRecord]:
    """Sends the plan's requests at its offsets, at most `settings.max_concurrency` at a time, and
    waits for every answer."""
    prompts, offsets, count = plan.prompts, plan.offsets, len(plan.offsets)
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    slots = asyncio.Semaphore(settings.max_concurrency or count)

    async def one(i: int, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, offset - clock()))
        async with slots:
            record = RequestRecord(sent=clock())
            await _send(client, settings, _payload(settings, model, prompts[i % len(prompts)]), record, clock)
        on_done()
        return record

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(offsets))))


def _quantiles(values: list[float]) -> dict[str, float] | None:
    return {f"p{q}": percentile(values, q) * 1e3 for q in PERCENTILES} if values else None


def summarize(rate: float, records: list[RequestRecord]) -> dict[str, Any]:
    """One rate's figures (latencies in ms); `saturation` adds tracking and the verdict later."""
    ok = [r for r in records if r.ok]
    end = max((r.end for r in ok), default=None)
    duration = (end - min(r.sent for r in records)) if end is not None else None
    tokens = sum(r.output_tokens for r in ok)
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    errors = [r.error for r in records if not r.ok and not r.rejected and r.error]
    return {
        "rate": None if math.isinf(rate) else rate,
        "label": rate_label(rate),
        "requests": len(records),
        "ok": len(ok),
        "rejected_429": sum(r.rejected for r in records),
        "errors": len(records) - len(ok) - sum(r.rejected for r in records),
        "error_samples": list(dict.fromkeys(errors))[:MAX_ERROR_SAMPLES],
        "send_window_seconds": max(r.sent for r in records) - min(r.sent for r in records),
        "duration_seconds": duration,
        "achieved_rps": len(ok) / duration if duration else None,
        "output_tokens": tokens,
        "output_tok_s": tokens / duration if duration else None,
        "usage_reported": all(r.usage_reported for r in ok),
        "ttft_ms": _quantiles([r.first_token - r.sent for r in ok if r.first_token is not None]),
        "itl_ms": _quantiles(itls),
        "e2e_ms": _quantiles([r.end - r.sent for r in ok]),
    }


def saturation(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Adds ``expected_rps``, ``tracking`` and ``saturated`` to each finite level (see the module
    docstring) and returns the verdict: the saturation rate (None: every finite rate kept up)."""
    finite = [lv for lv in levels if lv["rate"] is not None]
    baseline = next((lv["e2e_ms"]["p50"] / 1e3 for lv in finite if lv["e2e_ms"]), None)
    first = None
    for lv in finite:
        reasons = []
        if lv["rejected_429"] or lv["errors"]:
            reasons.append("failed requests")
        if baseline is not None and lv["achieved_rps"]:
            lv["expected_rps"] = lv["requests"] / (lv["send_window_seconds"] + baseline)
            lv["tracking"] = lv["achieved_rps"] / lv["expected_rps"]
            if lv["tracking"] < MIN_TRACKING:
                reasons.append(f"tracking {lv['tracking']:.2f} < {MIN_TRACKING}")
            if lv["e2e_ms"]["p50"] / 1e3 > LATENCY_BLOWUP * baseline:
                reasons.append(f"median latency > {LATENCY_BLOWUP:g}x the lowest rate's")
        lv["saturated"] = reasons
        if reasons and first is None:
            first = lv
    return {"rate": first["rate"] if first else None, "reasons": first["saturated"] if first else [],
            "baseline_e2e_ms": baseline * 1e3 if baseline is not None else None,
            "min_tracking": MIN_TRACKING, "latency_blowup": LATENCY_BLOWUP}


async def _served_model(client: Any, settings: LoadSettings, timeout: Any) -> str:
    """`settings.model` when the server lists it, else (unless the model was named: an error)
    the first model of ``GET /v1/models`` (`client`: an aiohttp session, `timeout`: the call's)."""
    try:
        async with client.get(f"{settings.api_base}/models", timeout=timeout) as response:
            response.raise_for_status()
            ids = [m["id"] for m in (await response.json(content_type=None)).get("data", [])]
    except Exception as e:  # noqa: BLE001 - any failure here means the URL is not a usable server
        raise BenchError(f"cannot list models at {settings.api_base}/models: {e}") from None
    if not ids:
        raise BenchError(f"{settings.api_base}/models lists no model")
    for name in (settings.model, *settings.model_aliases):
        if name in ids:
            return name
    if settings.model_required:
        also = f" (or {', '.join(map(repr, settings.model_aliases))})" if settings.model_aliases else ""
        raise BenchError(f"{settings.api_base} does not serve model {settings.model!r}{also}: it serves "
                         f"{', '.join(ids)}; its figures would not compare with the peers' on {settings.model!r} "
                         f"(start it with --served-model-name, or name its model with --model)")
    return ids[0]


async def _server_endpoint(client: Any, settings: LoadSettings, timeout: Any) -> tuple[str, str]:
    """``auto`` at a server: (endpoint, why) from its ``GET /tokenizer_info`` (loom's, vLLM's with
    ``--enable-tokenizer-info-endpoint``); chat when the server does not tell."""
    root = settings.api_base.removesuffix("/v1")
    try:
        async with client.get(f"{root}/tokenizer_info", timeout=timeout) as response:
            info = await response.json(content_type=None) if response.status == 200 else None
    except Exception:  # noqa: BLE001 - an unreadable answer tells nothing: fall back to chat
        info = None
    if not isinstance(info, dict) or "chat_template" not in info:
        return "chat", "auto: the server's /tokenizer_info does not say whether the model has a chat template"
    if info["chat_template"]:
        return "chat", "auto: the model has a chat template (the server's /tokenizer_info)"
    return "completions", "auto: the model has no chat template (the server's /tokenizer_info)"


def _warmup_error(settings: LoadSettings, warmup: RequestRecord) -> BenchError:
    """The one-line error of a failed warm-up; a chat request the server refused hints at completions."""
    refused = warmup.status is not None and 400 <= warmup.status < 500 and warmup.status != 429
    hint = (" (a model without a chat template answers only plain prompts: --endpoint completions)"
            if settings.endpoint == "chat" and refused else "")
    return BenchError(f"the warm-up request to {settings.endpoint_url} failed: {warmup.error}{hint}")


def _headers(settings: LoadSettings) -> dict[str, str]:
    key = settings.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def with_cpu(level: dict[str, Any], cpu_seconds: float | None, wall_seconds: float) -> dict[str, Any]:
    """`level` with ``server_cpu_percent``: the server's CPU seconds over the level's wall time, in
    percent of one core (200 = two cores busy); None where the server's processes are not known."""
    level["server_cpu_percent"] = (100.0 * cpu_seconds / wall_seconds
                                   if cpu_seconds is not None and wall_seconds > 0 else None)
    return level


def _run_loop(main):
    """Runs the load generator's coroutine on uvloop (uvicorn's loop, installed with it) where it
    imports: the generator shares the machine with the server it measures, and on the default
    loop it used ~20% more CPU (160 requests at 32 streams: 0.90 s against 0.75 s, means of
    three, start-up left out)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_load(settings: LoadSettings, progress: Any = None, cpu: Callable[[], float] | None = None) -> dict[str, Any]:
    """Runs the whole ladder and returns the report (JSON-able). `progress`, a rich Progress,
    gets one task advanced per answered request. `cpu`, where given, reads the server's CPU
    seconds so far (all its processes): each level then reports the server's CPU use."""
    try:
        import aiohttp
    except ImportError:
        raise BenchError("--server needs aiohttp (pip install aiohttp)") from None

    warmup_prompt, plans = plan_ladder(settings)
    task = progress.add_task("load test", total=sum(settings.counts())) if progress is not None else None

    async def ladder() -> tuple[str, str, str | None, list[dict[str, Any]]]:
        """(the served model, the endpoint, why that endpoint, the levels)"""
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=30)
        levels = []
        async with aiohttp.ClientSession(headers=_headers(settings), timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as client:
            setup = aiohttp.ClientTimeout(total=SETUP_TIMEOUT_S)
            model = await _served_model(client, settings, setup)
            endpoint, why = (await _server_endpoint(client, settings, setup)
                             if settings.endpoint == AUTO else (settings.endpoint, None))
            run = dataclasses.replace(settings, endpoint=endpoint)
            warmup = RequestRecord(sent=0.0)
            await _send(client, run, _payload(run, model, warmup_prompt), warmup, time.perf_counter)
            if not warmup.ok:
                raise _warmup_error(run, warmup)
            for plan in plans:
                if task is not None:
                    progress.update(task, description=f"rate {rate_label(plan.rate)} req/s, "
                                                      f"{len(plan.prompts)} requests")
                c0, t0 = cpu() if cpu else None, time.perf_counter()
                records = await run_rate(client, run, model, plan,
                                         (lambda: progress.advance(task)) if task is not None else (lambda: None))
                used = cpu() - c0 if cpu else None
                levels.append(with_cpu(summarize(plan.rate, records), used, time.perf_counter() - t0))
        return model, endpoint, why, levels

    started = time.time()
    model, endpoint, why, levels = _run_loop(ladder())
    return load_report(settings, settings.api_base, model, endpoint, why, levels, started)
