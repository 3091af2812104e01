"""Prometheus metrics with vLLM's names, so existing vLLM dashboards work unchanged.

Each app owns its `CollectorRegistry`. Two kinds of series:

* engine state (gauges, and counters the engine keeps cumulatively) is read at scrape time
  from the engine client (`EngineClient.stats`): one consistent step, read under the engine
  lock in process or sent by the engine process with its latest step;
* per-request latencies and outcomes are observed by the API layer as outputs arrive
  (`RequestTracker`), from the engine's monotonic timestamps.

Every series carries the label ``model_name``. Counter names are given without ``_total``;
the exposition format appends it (``vllm:prompt_tokens_total``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from loom.contracts import SpecStats, iteration_buckets
from loom.outputs import RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

FINISH_REASONS = ("stop", "length", "abort", "error")   # vLLM's: "error" where the engine failed a request


def token_buckets(limit: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets of token counts, up to `limit`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class EngineSample:
    """The engine counters and gauges at one instant."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prompt_tokens_computed: int
    prefix_cache_hits: int
    spec: SpecStats | None = None     # speculative decoding counters; None when it is off
    iteration_tokens: tuple[int, ...] = ()   # steps per bucket of ITERATION_BUCKETS (+ one above), cumulative
    iteration_tokens_sum: int = 0


def read_engine_sample(engine) -> EngineSample:
    """The counters and gauges of `engine` now (the caller holds whatever keeps it still)."""
    s, kv, spec = engine.scheduler.stats, engine.kv, engine.spec
    return EngineSample(num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
                        kv_usage=float(kv.usage()), num_preemptions=s.num_preemptions,
                        prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
                        prefix_cache_queries=kv.stats.prefix_cache_queries,
                        prefix_cache_hits=kv.stats.prefix_cache_hits,
                        prompt_tokens_computed=s.prompt_tokens_computed,
                        iteration_tokens=tuple(s.iteration_tokens), iteration_tokens_sum=s.iteration_tokens_sum,
                        spec=None if spec is None else copy.deepcopy(spec.stats))


def sample_engine(client) -> EngineSample:
    """The engine's counters through its client (`loom.server.engine_client`): read under the
    engine lock in process, or the figures the engine process sent with its latest step."""
    return client.stats()


class _EngineCollector(Collector):
    """Engine series, computed at each scrape."""

    def __init__(self, ae, model_name: str):
        self.ae = ae
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = sample_engine(self.ae)
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.", s.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Older name of vllm:kv_cache_usage_perc (the cache is in RAM).",
                    s.kv_usage)
        yield counter("vllm:num_preemptions", "Requests preempted to free KV blocks.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens of the requests that produced a first token (each "
                      "choice of n counts its prompt), as vLLM counts them.", s.prompt_tokens)
        yield counter("loom:prompt_tokens_computed", "Prompt tokens computed (prefix-cache hits excluded).",
                      s.prompt_tokens_computed)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        if s.iteration_tokens:
            yield _iteration_histogram(s, labels)
        info = getattr(self.ae, "cache_info", None) or {}
        if info:
            g = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings, as labels.",
                                  labels=[*info, "model_name"])
            g.add_metric([*info.values(), self.model_name], 1.0)
            yield g
        yield counter("loom:engine_restarts", "Engine processes started anew after one died (loom serve "
                      "--engine-restarts); the engine counters above start from zero with each.",
                      self.ae.restarts)
        if s.spec is not None:
            yield from _spec_metrics(s.spec, labels, counter)


def _iteration_histogram(s: EngineSample, labels: list[str]) -> HistogramMetricFamily:
    """vllm:iteration_tokens_total from the engine's per-bucket step counts."""
    h = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (prompt tokens computed "
                              "and tokens generated).", labels=["model_name"])
    h.add_metric(labels, iteration_buckets(s.iteration_tokens), s.iteration_tokens_sum)
    return h


def _spec_metrics(st: SpecStats, labels: list[str], counter) -> Iterator[Metric]:
    yield counter("vllm:spec_decode_num_drafts", "Draft trees verified.", st.num_drafts)
    yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", st.num_draft_tokens)
    yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", st.num_accepted_tokens)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.",
                                  labels=["model_name", "position"])
    for pos, n in enumerate(st.accepted_per_pos):
        per_pos.add_metric(labels + [str(pos)], n)
    yield per_pos


class _Renamed(Collector):
    """Another metric's series under another name, read at each scrape: vLLM exports its
    inter-token latencies twice (the older name kept), observed here once per token."""

    def __init__(self, source: Histogram, name: str, documentation: str):
        self.source, self.name, self.documentation = source, name, documentation

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            old = family.name
            renamed = Metric(self.name, self.documentation, family.type, family.unit)
            renamed.samples = [s._replace(name=self.name + s.name[len(old):]) for s in family.samples]
            yield renamed


class ServerMetrics:
    """The registry of one app, and the request-level series the API layer feeds."""

    def __init__(self, ae, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(ae, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive output tokens.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_Renamed(self.itl, "vllm:time_per_output_token_seconds",
                                        "Older name of vllm:inter_token_latency_seconds."))
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last output.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)
        # per finished request, as vLLM's: its lengths, and where its time went
        tokens = token_buckets(max(1, int(getattr(ae, "max_model_len", 0) or 0)) or 1)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                                    labels, buckets=tokens, registry=self.registry)
        self.output_len = Histogram("vllm:request_generation_tokens", "Tokens generated by each finished request.",
                                    labels, buckets=tokens, registry=self.registry)
        phase = {name: Histogram(f"vllm:request_{name}_time_seconds", doc, labels, buckets=E2E_BUCKETS,
                                 registry=self.registry) for name, doc in (
            ("queue", "Time a request waited before it was first scheduled."),
            ("prefill", "Time from a request's first scheduling to its first token."),
            ("decode", "Time from a request's first token to its last."),
            ("inference", "Time from a request's first scheduling to its end."))}
        self.time_per_output = Histogram("vllm:request_time_per_output_token_seconds",
                                         "Each finished request's mean time per output token after its first.",
                                         labels, buckets=ITL_BUCKETS, registry=self.registry)
        # per prompt of an API request (all its choices), as vLLM's parent requests
        self.params_n = Histogram("vllm:request_params_n", "The n of each request.", labels,
                                  buckets=(1, 2, 5, 10, 20), registry=self.registry)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens of each request "
                                           "that set one.", labels, buckets=tokens, registry=self.registry)
        self.max_generation = Histogram("vllm:request_max_num_generation_tokens", "The most tokens any choice "
                                        "of a request generated.", labels, buckets=tokens, registry=self.registry)
        # the server process's own (vLLM's default registry has them): memory, CPU, open files, GC
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.success = Counter("vllm:request_success", "Requests finished, by reason.",
                               ["finished_reason", "model_name"], registry=self.registry)
        # Every reason is exported from the start, so rate() works before the first request ends.
        for reason in FINISH_REASONS:
            self.success.labels(reason, model_name)
        # the series of this model, looked up once (labels() takes a lock and a dict lookup:
        # ~3 us, twice per streamed token)
        self.ttft_of, self.itl_of, self.e2e_of = (h.labels(model_name) for h in (self.ttft, self.itl, self.e2e))
        self.prompt_len_of, self.output_len_of = self.prompt_len.labels(model_name), self.output_len.labels(model_name)
        self.phase_of = {name: h.labels(model_name) for name, h in phase.items()}
        self.time_per_output_of = self.time_per_output.labels(model_name)
        self.params_n_of, self.params_max_tokens_of = self.params_n.labels(model_name), self.params_max_tokens.labels(model_name)
        self.max_generation_of = self.max_generation.labels(model_name)

    def on_prompt_finished(self, n: int, max_tokens: int | None, most_generated: int) -> None:
        """One prompt of an API request finished all its choices (vLLM's parent request)."""
        self.params_n_of.observe(n)
        if max_tokens is not None:
            self.params_max_tokens_of.observe(max_tokens)
        self.max_generation_of.observe(most_generated)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request's outputs: TTFT once, ITL per token, e2e and outcome at the end.

    An output's `metrics` object is shared with the engine thread, which keeps updating
    `last_token_time` after the output was sent; only the fields written once (arrival, first
    token, finish) are read from it. Inter-token gaps are measured when outputs arrive here,
    on the same monotonic clock.
    """

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.last_seen: float | None = None
        self.num_tokens = 0
        self.ended = False

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        times = out.metrics
        completion = out.outputs[0]
        new = len(completion.token_ids) - self.num_tokens
        if new > 0:
            if self.last_seen is None:
                if times is not None and times.first_token_time is not None:
                    self.m.ttft_of.observe(max(0.0, times.first_token_time - times.arrival_time))
                new -= 1
                if new and out.finished and times is not None and times.first_token_time is not None \
                        and times.last_token_time is not None:   # all at once (best_of): the engine's gaps
                    gap = max(0.0, times.last_token_time - times.first_token_time) / new
                    for _ in range(new):
                        self.m.itl_of.observe(gap)
            else:
                gap = max(0.0, now - self.last_seen) / new
                for _ in range(new):
                    self.m.itl_of.observe(gap)
            self.last_seen = now
            self.num_tokens = len(completion.token_ids)
        if out.finished and times is not None:
            if not self.ended:
                self._finished(out, times, now)
            self._end(completion.finish_reason or "abort", times.finished_time or now, times.arrival_time)

    def _finished(self, out: RequestOutput, times, now: float) -> None:
        """vLLM's per-request lengths and phases of a request that ended in the engine."""
        m = self.m
        m.prompt_len_of.observe(len(out.prompt_token_ids))
        m.output_len_of.observe(len(out.outputs[0].token_ids))
        end = times.finished_time or now
        spans = {"queue": (times.arrival_time, times.first_scheduled_time),
                 "prefill": (times.first_scheduled_time, times.first_token_time),
                 "decode": (times.first_token_time, times.last_token_time or end),
                 "inference": (times.first_scheduled_time, end)}
        for name, (a, b) in spans.items():
            if a is not None and b is not None:
                m.phase_of[name].observe(max(0.0, b - a))
        tokens = len(out.outputs[0].token_ids)
        if tokens > 1 and times.first_token_time is not None and times.last_token_time is not None:
            m.time_per_output_of.observe(max(0.0, times.last_token_time - times.first_token_time) / (tokens - 1))

    def on_abandoned(self, arrival_time: float | None, now: float, reason: str = "abort") -> None:
        """The request ended before finishing: "abort" (client gone, call cancelled) or "error"
        (the engine failed it: its process died, say)."""
        self._end(reason, now, arrival_time)

    def _end(self, reason: str, end: float | None, arrival: float | None) -> None:
        if self.ended:
            return
        self.ended = True
        name = self.m.model_name
        self.m.success.labels(reason if reason in FINISH_REASONS else "abort", name).inc()
        if end is not None and arrival is not None:
            self.m.e2e_of.observe(max(0.0, end - arrival))
