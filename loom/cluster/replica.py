"""The replica deployment: one loom engine and loom's OpenAI app in a Ray Serve replica.

Each replica loads the model in its constructor (Ray places it on a node with `--threads`
free CPUs) and serves forwarded requests by replaying them through `build_app`'s app
(`forwarding.run_asgi`): the same request handling as `loom serve` on one machine. The engine
runs on a thread of the replica's process (`InProcessEngineClient`): the replica actor is
already a process of its own, so killing it (or its node) takes its engine down with it.

Ray Serve hooks it implements:

* `record_routing_stats`: the engine's counters and the replica's Prometheus exposition,
  polled by the controller every `request_routing_stats_period_s` and handed to the routers
  in the ingress (router.py), which use them and the ingress's /metrics shows them;
* `check_health`: fails once the engine thread died, so Ray replaces the replica;
* `__del__`: stops the engine when Ray stops the replica.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from loom.cluster.forwarding import ForwardedRequest, ResponseStart, run_asgi
from loom.config import EngineConfig
from loom.errors import LoomError
from loom.server.engine_client import engine_client
from loom.server.metrics import sample_engine
from loom.server.openai_api import DEFAULT_MAX_BODY_BYTES, build_app


class ReplicaLoadError(LoomError):
    """The replica could not load its model; the message is the engine's."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is built from (pickled to each one)."""

    config: EngineConfig
    api_key: str | None = None
    served_model_name: str | None = None
    max_tokens_limit: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None


class LoomReplica:
    """A Ray Serve deployment class (wrapped with `serve.deployment` by launch.py)."""

    async def __init__(self, spec: ReplicaSpec):
        self.replica = serve.get_replica_context().replica_id.unique_id
        try:
            self.client = await asyncio.to_thread(engine_client, spec.config, engine_process=False)
        except LoomError as e:
            raise ReplicaLoadError(f"{type(e).__name__}: {e}") from None
        self.app = build_app(self.client, api_key=spec.api_key, served_model_name=spec.served_model_name,
                             max_tokens_limit=spec.max_tokens_limit, max_body_bytes=spec.max_body_bytes,
                             cors=None, chat_template=spec.chat_template)   # the ingress answers CORS
        self._stack = AsyncExitStack()
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        self.pid = os.getpid()
        self.node = ray.get_runtime_context().get_node_id()
        self.max_num_seqs = spec.config.scheduler.max_num_seqs

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in run_asgi(self.app, req, self.replica):
            yield item

    def info(self) -> dict[str, Any]:
        serving = self.app.state.serving
        return {"replica": self.replica, "model": serving.model, "root": self.client.model_name,
                "max_model_len": self.client.max_model_len}

    async def record_routing_stats(self) -> dict[str, Any]:
        s = await asyncio.to_thread(sample_engine, self.client)
        exposition = await asyncio.to_thread(self.app.state.metrics.exposition)
        stats = {"num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                 "kv_cache_usage": s.kv_usage, "num_preemptions": s.num_preemptions, "prompt_tokens": s.prompt_tokens,
                 "prompt_tokens_computed": s.prompt_tokens_computed, "generation_tokens": s.generation_tokens, "prefix_cache_queries": s.prefix_cache_queries,
                 "prefix_cache_hits": s.prefix_cache_hits}
        return {"replica": self.replica, "pid": self.pid, "node": self.node, "num_running": s.num_running,
                "num_waiting": s.num_waiting, "kv_usage": s.kv_usage, "max_num_seqs": self.max_num_seqs,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "stats": stats,
                "healthy": self.client.error is None, "metrics": exposition.decode()}

    def check_health(self) -> None:
        if self.client.error is not None:
            raise RuntimeError(f"engine failed: {self.client.error}")

    async def __del__(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            await stack.aclose()
