"""The ingress deployment: the one OpenAI endpoint in front of the replicas.

Ray Serve's HTTP proxy hands every request to this deployment's FastAPI app, which:

* forwards /v1/* (and the playground) to a replica through the replica deployment's
  `DeploymentHandle`, whose request router (router.py) picks the replica from the prompt's
  leading text (`forwarding.routing_text`);
* answers /health (200 while a replica runs), /metrics (every replica's series with a
  `replica` label, cluster.metrics), /v1/loom/replicas (each replica's load and hits) and
  /v1/loom/stats (the single server's load figures, summed over the replicas); the last two
  need the API key as /v1 does on a replica. /docs and /openapi.json are a replica's.

Failures, per forwarded request:

    replica died before the answer started     -> sent again to another replica (any request)
    replica died during a non-streamed answer  -> sent again (the client saw nothing yet)
    replica died during a stream               -> the stream ends with an error event and [DONE]
    replica answered 429 (its queue is full)   -> sent again to a replica not yet tried; the
                                                  last 429 goes to the client (Retry-After)
    no replica running                         -> 503 with Retry-After
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

import loom
from loom.cluster.forwarding import ForwardedRequest, ResponseStart, routing_text
from loom.cluster.metrics import cluster_exposition
from loom.cluster.registry import routers_of
from loom.server.errors import ENGINE_RETRY_AFTER_SECONDS, error_response
from loom.server.limits import KEY_MESSAGE, BodySizeLimit, Cors, has_key
from loom.server.sse import DONE, event

log = logging.getLogger("loom.cluster")

REPLICA_DEPLOYMENT = "LoomReplica"
REPLICA_HEADER = "x-loom-replica"   # on every forwarded answer: the replica that served it
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


@dataclass(frozen=True)
class IngressSettings:
    router: str                    # the replica deployment's router name (router.ROUTERS)
    max_body_bytes: int
    max_attempts: int = 4          # sends of one request: the first, then retries elsewhere
    cors: Cors | None = Cors()     # cross-origin access, answered here (the replicas add none)
    api_key: str | None = None     # the routes answered here need it as the replicas' /v1 routes do


class _ReplicaGone(Exception):
    """The replica serving a request died (or became unreachable)."""


def _unavailable(message: str) -> Response:
    return error_response(503, message, code="no_replica",
                          headers={"Retry-After": str(ENGINE_RETRY_AFTER_SECONDS)})


class LoomIngress:
    """A Ray Serve deployment class (wrapped with `serve.ingress()` and `serve.deployment` by launch.py)."""

    async def __init__(self, replicas: DeploymentHandle, settings: IngressSettings):
        self.handle = replicas
        self.settings = settings
        self.retries: Counter[str] = Counter()
        self.failures = 0
        self.draining = False     # the server is stopping: new requests 503, open streams end
        self.open = 0             # requests being answered (streams until their last chunk)
        self.model_info = await replicas.info.remote()   # waits for a replica; starts the router

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # -- replicas ------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, dict[str, Any]]:
        stats: dict[str, dict[str, Any]] = {}
        for router in routers_of(REPLICA_DEPLOYMENT):
            stats.update(router.replica_stats())
        return stats

    def routed(self) -> dict[str, int]:
        routed: Counter[str] = Counter()
        for router in routers_of(REPLICA_DEPLOYMENT):
            routed.update(router.routed_by_replica)
        return dict(routed)

    async def drain(self, timeout_s: float) -> None:
        """Called as the server stops: new requests get a 503, each open stream ends with an
        error event (as the single server's do), and answers under way get up to `timeout_s`."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    # -- forwarding ----------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        if self.draining:
            return _unavailable("the server is shutting down")
        self.open += 1
        try:
            response = await self._forward(request)
        except BaseException:
            self.open -= 1
            raise
        if isinstance(response, StreamingResponse):   # counted until the relay's last chunk
            return response
        self.open -= 1
        return response

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        text, stream = routing_text(body) if request.method == "POST" else ("", False)
        req = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                               tuple((bytes(k), bytes(v)) for k, v in request.scope["headers"]), body, text, stream)
        last: Response | None = None
        for attempt in range(self.settings.max_attempts):
            if attempt and not self.replica_stats():
                await asyncio.sleep(0.5)    # Ray is starting a replacement
            gen = self.handle.options(stream=True).forward.remote(req)
            try:
                start = await _first(gen)
                if start.status == 429 and attempt + 1 < self.settings.max_attempts and self._others(req, start):
                    last = await _collect(gen, start)
                    self.retries["queue_full"] += 1
                    req = req.avoiding(start.replica)
                    continue
                if stream and start.status == 200:
                    return StreamingResponse(_relay(gen, self), status_code=start.status,
                                             headers=_headers(start))
                return await _collect(gen, start)
            except _ReplicaGone as e:
                self.failures += 1
                self.retries["replica_died"] += 1
                log.warning("replica failed during a request (%s); sending it again", e)
                req = req.avoiding(getattr(e, "replica", None))
                last = _unavailable(f"the replica serving the request failed: {e}")
            except BaseException:
                gen.cancel()
                raise
        assert last is not None
        return last

    def _others(self, req: ForwardedRequest, start: ResponseStart) -> bool:
        """Whether a replica not yet tried for `req` is running."""
        tried = set(req.avoid_replicas) | {start.replica}
        return any(r not in tried for r in self.replica_stats())


async def _first(gen: DeploymentResponseGenerator) -> ResponseStart:
    try:
        first = await gen.__anext__()
    except (RayActorError, RequestCancelledError) as e:
        raise _ReplicaGone(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except StopAsyncIteration:
        raise _ReplicaGone("the replica ended the answer before its status line") from None
    assert isinstance(first, ResponseStart)
    return first


def _headers(start: ResponseStart) -> dict[str, str]:
    """The replica's headers (less those of its own framing) and which replica answered."""
    skip = {"content-length", "transfer-encoding", "connection"}
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower().decode() not in skip}
    headers[REPLICA_HEADER] = start.replica
    return headers


async def _collect(gen: DeploymentResponseGenerator, start: ResponseStart) -> Response:
    chunks: list[bytes] = []
    try:
        async for chunk in gen:
            chunks.append(chunk)
    except RayActorError as e:
        gone = _ReplicaGone(str(e).splitlines()[0] if str(e) else type(e).__name__)
        gone.replica = start.replica   # type: ignore[attr-defined]
        raise gone from None
    media = dict(_headers(start)).get("content-type")
    return Response(b"".join(chunks), status_code=start.status, headers=_headers(start), media_type=media)


async def _relay(gen: DeploymentResponseGenerator, ingress: LoomIngress) -> AsyncIterator[bytes]:
    """A stream's body; a replica that dies mid-stream, or the server stopping, ends it with an
    error event and [DONE]."""
    try:
        async for chunk in gen:
            if ingress.draining:
                yield event({"error": {"message": "the server is shutting down; the request was stopped",
                                       "type": "server_error", "param": None, "code": None}}).encode()
                yield DONE.encode()
                return
            yield chunk
    except RayError as e:
        ingress.failures += 1
        log.warning("replica failed during a stream: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        yield event({"error": {"message": "the replica serving this stream failed; send the request again",
                               "type": "server_error", "param": None, "code": "replica_failed"}}).encode()
        yield DONE.encode()
    finally:
        ingress.open -= 1
        gen.cancel()


def _unauthorized(request: Request, api_key: str | None) -> Response | None:
    """The replicas' 401 for a request without the API key (None when it may pass)."""
    if api_key is None:
        return None
    if has_key(request.headers.get("authorization", "").encode(), request.headers.get("x-api-key", "").encode(),
               api_key.encode()):
        return None
    return error_response(401, KEY_MESSAGE, type="authentication_error", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})


_SUMMED_STATS = ("num_requests_running", "num_requests_waiting", "num_preemptions", "prompt_tokens",
                 "prompt_tokens_computed",
                 "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")


def cluster_stats(info: dict[str, Any], stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """/v1/loom/stats for the whole endpoint: the replicas' counts summed, their KV use averaged."""
    rows = [s.get("stats", {}) for s in stats.values()]
    out: dict[str, Any] = {"model": info.get("model"), "max_model_len": info.get("max_model_len")}
    out.update({k: sum(int(r.get(k, 0)) for r in rows) for k in _SUMMED_STATS})
    out["kv_cache_usage"] = sum(float(r.get("kv_cache_usage", 0.0)) for r in rows) / max(1, len(rows))
    return out


def build_ingress_app(ingress: LoomIngress) -> FastAPI:
    # no docs of its own: /docs and /openapi.json go to a replica, which documents the API
    app = FastAPI(title="loom cluster", version=loom.__version__, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_body_bytes=ingress.settings.max_body_bytes)
    api_key = ingress.settings.api_key

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one replica runs; 503 (with Retry-After) otherwise."""
        stats = ingress.replica_stats()
        healthy = [r for r, s in stats.items() if s.get("healthy", True)]
        if not healthy:
            return _unavailable("no replica is running")
        return JSONResponse({"status": "ok", "replicas": len(healthy)})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = cluster_exposition(ingress.replica_stats(), ingress.routed(), ingress.settings.router,
                                  ingress.retries, ingress.failures)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/loom/replicas")
    async def replicas(request: Request) -> Response:
        """Extension: each replica's id, process, load and prefix-cache counters."""
        if (denied := _unauthorized(request, api_key)) is not None:
            return denied
        stats = ingress.replica_stats()
        routed = ingress.routed()
        return JSONResponse({"router": ingress.settings.router, "model": ingress.model_info.get("model"),
                             "replicas": [{**{k: v for k, v in s.items() if k not in ("metrics", "stats")},
                                           "replica": r, "routed_requests": routed.get(r, 0)}
                                          for r, s in sorted(stats.items())]})

    @app.get("/v1/loom/stats")
    async def stats(request: Request) -> Response:
        """The single server's load figures (the playground polls them), over every replica."""
        if (denied := _unauthorized(request, api_key)) is not None:
            return denied
        return JSONResponse(cluster_stats(ingress.model_info, ingress.replica_stats()))

    @app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    if ingress.settings.cors is not None:
        ingress.settings.cors.install(app)
    return app
