"""`loom serve MODEL --replicas N` on Ray Serve (loom/cluster).

First the parts without Ray running: the prefix index, the routing decisions of the router
with stand-in replicas, the request marking, the metrics merge, the option checks and the
command's one-line errors. Then one local Ray cluster (`--replicas 2 --threads 1` on the tiny
llama) for the API through the ingress, prefix stickiness, per-replica metrics, a replica
killed under load, and SIGTERM leaving no process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from loom.cluster.config import ClusterConfig, ClusterConfigError, check_reachable
from loom.cluster.forwarding import ForwardedRequest, routing_text
from loom.cluster.launch import _deploy_error
from loom.cluster.metrics import cluster_exposition
from loom.cluster.prefix_index import PrefixIndex, prefix_keys
from loom_server import REPO_ROOT, LoomServer, free_port, metric, scrape

# -- the prefix index ------------------------------------------------------------------------


def test_prefix_keys_chain_the_blocks():
    a, b = prefix_keys("x" * 200, block_chars=64), prefix_keys("x" * 128 + "y" * 72, block_chars=64)
    assert len(a) == 3                        # full blocks only
    assert a[:2] == b[:2] and a[2] != b[2]    # a key stands for its whole prefix
    assert prefix_keys("y" + "x" * 199, block_chars=64)[1] != a[1]   # same block, other parent
    assert len(prefix_keys("x" * 10_000, block_chars=64, max_blocks=5)) == 5


def test_index_matches_the_longest_prefix_and_forgets():
    index = PrefixIndex(capacity_blocks=3)
    index.insert("r1", [1, 2, 3])
    index.insert("r2", [1, 9])
    assert index.match([1, 2, 3, 4], ["r1", "r2", "r3"]) == {"r1": 3, "r2": 1, "r3": 0}
    index.insert("r1", [7, 8])                 # capacity 3: the oldest keys of r1 go
    assert index.match([1, 2, 3], ["r1", "r2"]) == {"r1": 0, "r2": 1}
    assert index.sizes() == {"r1": 3, "r2": 2}
    index.remove("r2")
    assert index.match([1], ["r1", "r2"]) == {"r1": 0, "r2": 0} and index.replicas() == ["r1"]


# -- the router's decisions --------------------------------------------------------------------


class _Replica:
    """What choose_replicas reads of a RunningReplica."""

    def __init__(self, uid: str):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(uid, DeploymentID(name="LoomReplica", app_name="loom"))
        self.max_ongoing_requests = 100
        self.routing_stats = {}


def _pending(text: str, n: int, avoid: tuple[str, ...] = ()):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    req = ForwardedRequest("POST", "/v1/completions", b"", (), b"", text, avoid_replicas=avoid)
    return PendingRequest(args=[req], kwargs={},
                          metadata=RequestMetadata(request_id=str(n), internal_request_id=str(n)))


def _router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from loom.cluster.router import PrefixAwareRouter

    router = PrefixAwareRouter(deployment_id=DeploymentID(name="LoomReplica", app_name="loom"),
                               handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalance_threshold=4)
    return router


def test_router_prefers_the_replica_holding_the_prefix_until_it_is_overloaded():
    async def run() -> None:
        router, replicas = _router(), [_Replica("a"), _Replica("b"), _Replica("c")]

        async def route(text: str, n: int, avoid: tuple[str, ...] = ()) -> list[list[str]]:
            pending = _pending(text, n, avoid)
            ranks = await router.choose_replicas(replicas, pending)
            router.on_request_routed(pending, ranks[0][0].replica_id, None)
            return [[r.replica_id.unique_id for r in rank] for rank in ranks]

        system = "You are a careful assistant. " * 10
        first = (await route(system + "Q1", 1))[0][0]
        assert await route(system + "Q2", 2) == [[first]]                       # sticky
        other = (await route("Another long system prompt entirely. " * 8, 3))[0][0]
        assert other != first                                                    # new prefix: emptiest replica
        assert (await route(system + "Q3", 4, avoid=(first,)))[0][0] != first    # the ingress's avoid list
        for replica in replicas:                                                 # the holder is overloaded
            router.replica_queue_len_cache.update(replica.replica_id, 10 if replica.replica_id.unique_id == first
                                                  else 0)
        chosen = await route(system + "Q4", 5)
        assert first not in chosen[0]
        assert router.routed_by_replica[first] == 2
        for replica in replicas:        # one in flight, where the holder runs one at a time: it is full
            replica.routing_stats = {"max_num_seqs": 1}
            router.replica_queue_len_cache.update(replica.replica_id, 1 if replica.replica_id.unique_id == first
                                                  else 0)
        spill = (await route(system + "Q5", 6))[0]
        assert first not in spill
        for replica in replicas:
            replica.routing_stats = {"max_num_seqs": 8}
        sticky = await route(system + "Q6", 7)                                  # room again: a holder
        assert len(sticky) == 1 and len(sticky[0]) == 1 and sticky[0][0] in {first, *spill}

    asyncio.run(run())


# -- the ingress's retries (stand-in handle) ---------------------------------------------------------


class _Answers:
    """A stand-in for `handle.options(stream=True).forward.remote(req)`: each call plays the next
    scripted answer: a list of items (ResponseStart, bytes, or an exception to raise)."""

    def __init__(self, *scripts: list):
        self.scripts = list(scripts)
        self.requests: list[ForwardedRequest] = []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, req: ForwardedRequest):
        self.requests.append(req)
        script = self.scripts.pop(0)

        class _Gen:
            def __init__(self):
                self.items = iter(script)

            def __aiter__(self):
                return self

            async def __anext__(self):
                item = next(self.items, StopAsyncIteration)
                if item is StopAsyncIteration or isinstance(item, BaseException):
                    raise item
                return item

            def cancel(self):
                pass

        return _Gen()


class _StatsRouter:
    deployment_name = "LoomReplica"
    routed_by_replica: dict = {}

    def replica_stats(self):
        return {"a": {}, "b": {}}


def _forward(answers: _Answers, body: bytes, drain: str | None = None) -> tuple:
    """The ingress's answer to one POST; `drain`: "before" the request, or "during" its body."""
    from starlette.requests import Request

    from loom.cluster import registry
    from loom.cluster.ingress import IngressSettings, LoomIngress

    router = _StatsRouter()
    registry.register(router)
    ingress = object.__new__(LoomIngress)
    ingress.handle, ingress.settings = answers, IngressSettings(router="prefix-aware", max_body_bytes=1 << 20)
    ingress.retries, ingress.failures = __import__("collections").Counter(), 0
    ingress.draining, ingress.open = drain == "before", 0
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def run():
        response = await ingress.forward(Request(scope, receive))
        chunks = []
        ingress.draining = ingress.draining or drain == "during"
        if hasattr(response, "body_iterator"):
            async for chunk in response.body_iterator:
                chunks.append(chunk if isinstance(chunk, bytes) else chunk.encode())
        else:
            chunks.append(response.body)
        return response, b"".join(chunks)

    response, content = asyncio.run(run())
    return response, content, ingress


def test_ingress_sends_a_refused_request_to_another_replica_and_passes_the_last_429():
    from ray.exceptions import ActorDiedError

    from loom.cluster.forwarding import ResponseStart

    full = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    ok = [(b"content-type", b"application/json")]
    answers = _Answers([ResponseStart(429, tuple(full), "a"), b'{"error": 1}'],
                       [ActorDiedError()],
                       [ResponseStart(200, tuple(ok), "b"), b'{"ok": true}'])
    response, content, ingress = _forward(answers, b'{"prompt": "hi"}')
    assert response.status_code == 200 and content == b'{"ok": true}'
    assert response.headers["x-loom-replica"] == "b"
    assert answers.requests[1].avoid_replicas == ("a",)            # the retry skips the full replica
    assert ingress.retries == {"queue_full": 1, "replica_died": 1} and ingress.failures == 1

    answers = _Answers([ResponseStart(429, tuple(full), "a"), b'{"error": 1}'],
                       [ResponseStart(429, tuple(full), "b"), b'{"error": 2}'])
    response, content, _ = _forward(answers, b'{"prompt": "hi"}')
    assert response.status_code == 429 and response.headers["retry-after"] == "1" and content == b'{"error": 2}'


def test_ingress_ends_a_stream_whose_replica_died_with_an_error_event():
    from ray.exceptions import ActorDiedError

    from loom.cluster.forwarding import ResponseStart

    sse = [(b"content-type", b"text/event-stream")]
    answers = _Answers([ResponseStart(200, tuple(sse), "a"), b'data: {"n": 1}\n\n', ActorDiedError()])
    response, content, ingress = _forward(answers, b'{"prompt": "hi", "stream": true}')
    events = [e for e in content.decode().split("\n\n") if e]
    assert response.status_code == 200 and events[0] == 'data: {"n": 1}'
    assert '"code":"replica_failed"' in events[1] and events[2] == "data: [DONE]"
    assert ingress.failures == 1


def test_a_stopping_ingress_refuses_new_requests_and_ends_open_streams():
    from loom.cluster.forwarding import ResponseStart

    sse = [(b"content-type", b"text/event-stream")]
    stream = [ResponseStart(200, tuple(sse), "a"), b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n']
    response, content, ingress = _forward(_Answers(list(stream)), b'{"prompt": "hi", "stream": true}', drain="during")
    events = [e for e in content.decode().split("\n\n") if e]
    assert response.status_code == 200 and "shutting down" in events[0] and events[1] == "data: [DONE]"
    assert ingress.open == 0
    response, _, ingress = _forward(_Answers(list(stream)), b'{"prompt": "hi"}', drain="before")
    assert response.status_code == 503 and "retry-after" in response.headers and ingress.open == 0


def test_cluster_stats_sum_the_replicas():
    from loom.cluster.ingress import cluster_stats

    rows = {r: {"stats": {"num_requests_running": 2, "prompt_tokens": 10 * i, "kv_cache_usage": 0.2 * i}}
            for i, r in enumerate(("a", "b"), start=1)}
    got = cluster_stats({"model": "m", "max_model_len": 64}, rows)
    assert got["num_requests_running"] == 4 and got["prompt_tokens"] == 30 and got["model"] == "m"
    assert got["kv_cache_usage"] == pytest.approx(0.3)


# -- request marking, metrics, options -----------------------------------------------------------


def test_routing_text_of_completions_chat_and_responses():
    assert routing_text(b'{"prompt": "hello", "stream": true}') == ("hello", True)
    assert routing_text(b'{"prompt": ["first", "second"]}') == ("first", False)
    chat = (b'{"messages": [{"role": "system", "content": "be brief"}, '
            b'{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}')
    assert routing_text(chat) == ("<system>be brief<user>hi", False)
    assert routing_text(b'{"input": "hi", "instructions": "be brief"}') == ("<system>be brief<user>hi", False)
    assert routing_text(b'{"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}') == \
        ("<user>hi", False)
    assert routing_text(b'{"system": [{"type": "text", "text": "be brief"}], "stream": true, '   # Anthropic's
                        b'"messages": [{"role": "user", "content": "hi"}]}') == ("<system>be brief<user>hi", True)
    assert routing_text(b"{not json") == ("", False)
    assert routing_text(b'[1, 2]') == ("", False)


def test_cluster_exposition_labels_each_replica():
    replica = ('# HELP vllm:prefix_cache_hits_total Prompt tokens found.\n'
               '# TYPE vllm:prefix_cache_hits_total counter\n'
               'vllm:prefix_cache_hits_total{model_name="m"} 30.0\n'
               '# HELP vllm:prefix_cache_hits_created Prompt tokens found.\n'
               '# TYPE vllm:prefix_cache_hits_created gauge\n'
               'vllm:prefix_cache_hits_created{model_name="m"} 1.7e+09\n')
    stats = {"r1": {"metrics": replica, "prefix_cache_hits": 30, "prefix_cache_queries": 40},
             "r2": {"metrics": replica.replace("30.0", "0.0"), "prefix_cache_hits": 0, "prefix_cache_queries": 40}}
    text = cluster_exposition(stats, {"r1": 5}, "prefix-aware", {"replica_died": 2}, 2).decode()
    assert text.count("# TYPE vllm:prefix_cache_hits_total counter") == 1 and "_created" not in text
    assert 'vllm:prefix_cache_hits_total{model_name="m",replica="r1"} 30.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m",replica="r2"} 0.0' in text
    assert 'loom:prefix_cache_hit_rate{replica="r1"} 0.75' in text
    assert "loom:cluster_prefix_cache_hit_rate 0.375" in text
    assert 'loom:cluster_retries_total{reason="replica_died"} 2.0' in text
    assert 'loom:cluster_routed_requests_total{replica="r1",router="prefix-aware"} 5.0' in text


@pytest.mark.parametrize("kwargs, message", [
    ({"replicas": 0}, "--replicas must be at least 1"),
    ({"router": "random"}, "--router must be one of"),
    ({"replicas": 5, "max_replicas": 3}, "must lie within"),
    ({"min_replicas": 2, "max_replicas": 1}, "--max-replicas must be at least 1 and at least --min-replicas"),
    ({"autoscaling_extra": (("upscale_delay_s", 1),)}, "--autoscaling-config needs autoscaling on"),
    ({"max_replicas": 2, "autoscaling_extra": (("upscale_delay", 1),)}, "unknown key 'upscale_delay'"),
    ({"max_replicas": 2, "autoscaling_extra": (("upscale_delay_s", -1),)}, "upscale_delay_s must be a number >= 0"),
])
def test_cluster_config_refuses_bad_options(kwargs, message):
    with pytest.raises(ClusterConfigError, match=message):
        ClusterConfig(**kwargs)


def test_autoscaling_options_pass_through():
    options = ClusterConfig(replicas=2, threads=1, min_replicas=1, max_replicas=4,
                            target_ongoing_requests=8).replica_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                             "target_ongoing_requests": 8}
    extra = ClusterConfig(replicas=1, max_replicas=2, autoscaling_extra=(("downscale_delay_s", 60),
                                                                          ("upscale_delay_s", 2)))
    assert extra.replica_options()["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2,
                                                             "initial_replicas": 1, "downscale_delay_s": 60,
                                                             "upscale_delay_s": 2}
    assert ClusterConfig(replicas=3, threads=2).replica_options()["ray_actor_options"] == {"num_cpus": 2}


def test_unreachable_ray_address_fails_fast():
    start = time.monotonic()
    with pytest.raises(ClusterConfigError, match="cannot reach the Ray cluster at 127.0.0.1"):
        check_reachable(f"127.0.0.1:{free_port()}")
    with pytest.raises(ClusterConfigError, match="must be HOST:PORT"):
        check_reachable("nowhere")
    assert time.monotonic() - start < 5


def test_a_replica_model_error_is_reported_in_one_line():
    text = ("Deploying app 'loom' failed with exception:\nTraceback (most recent call last):\n  File ...\n"
            "loom.cluster.replica.ReplicaLoadError: InvalidRequestError: num_blocks too small\n")
    assert _deploy_error(text) == "a replica could not load the model: InvalidRequestError: num_blocks too small"
    assert _deploy_error("...\nModuleNotFoundError: No module named 'loom.cluster'\n") == (
        "the Ray workers cannot import loom.cluster: install this loom version on every node of the cluster")


def test_a_missing_cluster_token_is_said_with_its_remedy():
    from ray.exceptions import AuthenticationError

    from loom.cluster.launch import _join_error

    try:
        try:
            raise AuthenticationError("RPC error: InvalidAuthToken")
        except AuthenticationError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause
    except ConnectionError as e:
        assert "set RAY_AUTH_MODE=token" in _join_error(e)
    assert _join_error(ConnectionError("Failed to connect\nmore")) == "Failed to connect"


def _loom(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "loom", "serve", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--replicas", "1", "--threads", "4096"], "--threads 4096 is more than this machine's"),
    (["--replicas", "4096", "--threads", "1"], "4096 replicas x 1 threads need 4096 cores"),
    (["--replicas", "1", "--ray-address", "127.0.0.1:{port}"], "cannot reach the Ray cluster at 127.0.0.1:"),
    (["--max-replicas", "2", "--autoscaling-config", '{"warp": 9}'], "--autoscaling-config: unknown key 'warp'"),
])
def test_bad_cluster_options_are_one_line_errors(tiny_llama_path, args, message):
    from typer.testing import CliRunner

    from loom.cli import app

    args = [a.replace("{port}", str(free_port())) for a in args]
    result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), *args])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_a_port_in_use_is_one_line_before_ray_starts(tiny_llama_path):
    import socket

    from typer.testing import CliRunner

    from loom.cli import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--replicas", "1", "--threads", "1",
                                          "--port", str(port)])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", result.stderr


def test_a_missing_model_fails_before_ray_starts(tmp_path):
    result = _loom(str(tmp_path / "absent.gguf"), "--replicas", "1", "--threads", "1")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "absent.gguf" in result.stderr


# -- one local Ray cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    server = LoomServer("cluster", tiny_llama_path, ["--replicas", "2", "--threads", "1", "--no-access-log"],
                        tmp_path_factory.mktemp("cluster_logs"))
    try:
        yield server.wait_ready(timeout=180)
    finally:
        server.stop()


def _replicas(server: LoomServer) -> list[dict]:
    return httpx.get(f"{server.url}/v1/loom/replicas", timeout=10).json()["replicas"]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
def test_the_api_through_the_ingress(cluster):
    url = cluster.url
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny-llama"
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}).json()
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": "hello", "max_tokens": 4, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    wrong = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "model": "other"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400
    page = {"Origin": "http://page.example"}   # cross-origin: the ingress answers, once
    pre = httpx.options(f"{url}/v1/completions", timeout=30,
                        headers=page | {"Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers.get_list("access-control-allow-origin") == ["*"]
    posted = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=page, timeout=30)
    assert posted.status_code == 200 and posted.headers.get_list("access-control-allow-origin") == ["*"]
    _wait(lambda: httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok", "replicas": 2}, 30,
          "/health to count both replicas")


@pytest.mark.slow
def test_shared_prefixes_stick_to_a_replica_and_hit_its_cache(cluster):
    systems = [f"System prompt {i}: you answer questions about topic number {i}. " * 6 for i in range(4)]
    served: dict[int, set[str]] = {i: set() for i in range(4)}
    cached = []
    for k in range(12):
        i = k % 4
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                       json={"prompt": systems[i] + f"Question {k}?", "max_tokens": 2})
        served[i].add(r.headers["x-loom-replica"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(s) == 1 for s in served.values()), served            # each prefix on one replica
    assert len(set().union(*served.values())) == 2                       # and both replicas used
    assert all(c > 0 for c in cached[4:]), cached                        # repeats hit the cache

    def per_replica_hits():
        samples = scrape(cluster)
        rates = {r["replica"]: metric(samples, "loom:prefix_cache_hit_rate", replica=r["replica"])
                 for r in _replicas(cluster)}
        return rates if all(v > 0 for v in rates.values()) else None

    rates = _wait(per_replica_hits, 15, "per-replica hit rates in /metrics")
    assert len(rates) == 2
    samples = scrape(cluster)
    for replica in rates:
        assert metric(samples, "vllm:request_success_total", replica=replica, finished_reason="length") > 0


@pytest.mark.slow
def test_a_killed_replica_loses_no_request(cluster):
    """SIGKILL to the replica serving a stream, under non-streamed load: every non-streamed
    request succeeds (retried elsewhere), the stream ends with an error event and [DONE], Ray
    starts a new replica, and /health and /metrics show it."""
    url = cluster.url

    async def run() -> tuple[list[int], list[str], int]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> int:
                body = {"prompt": f"request {i} " * 8, "max_tokens": 300, "ignore_eos": True}
                return (await client.post(f"{url}/v1/completions", json=body)).status_code

            async with client.stream("POST", f"{url}/v1/completions",
                                     json={"prompt": "stream me " * 8, "max_tokens": 400, "ignore_eos": True,
                                           "stream": True}) as stream:
                victim = stream.headers["x-loom-replica"]
                pid = next(r["pid"] for r in _replicas(cluster) if r["replica"] == victim)
                load = [asyncio.create_task(one(i)) for i in range(30)]
                await asyncio.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                events = [line async for line in stream.aiter_lines() if line]
            return await asyncio.gather(*load), events, pid

    statuses, events, pid = asyncio.run(run())
    assert statuses == [200] * 30
    assert events[-1] == "data: [DONE]" and '"code":"replica_failed"' in events[-2], events[-3:]
    def replaced() -> list[dict] | None:
        r = _replicas(cluster)
        pids = [x.get("pid") for x in r]   # a new replica reports its stats within a second or two
        return r if len(r) == 2 and None not in pids and pid not in pids else None

    replicas = _wait(replaced, 60, "a replacement replica")
    assert httpx.get(f"{url}/health", timeout=10).json()["replicas"] == 2

    def idle_metrics() -> dict[str, float] | None:
        samples = scrape(cluster)
        running = [metric(samples, "vllm:num_requests_running", replica=r["replica"]) for r in replicas]
        return samples if running == [0, 0] else None

    samples = _wait(idle_metrics, 15, "both replicas' series in /metrics")
    assert metric(samples, "loom:cluster_replica_failures_total") >= 1
    assert metric(samples, "loom:cluster_replicas") == 2


@pytest.mark.slow
def test_sigterm_stops_every_process(cluster):
    children = psutil.Process(cluster.process.pid).children(recursive=True)
    assert len(children) >= 4     # Ray's processes, the controller, the proxy, the deployments
    cluster.process.send_signal(signal.SIGTERM)
    assert cluster.process.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.info if hasattr(p, "info") else p.pid for p in alive]


@pytest.mark.slow
def test_a_replica_that_cannot_load_reports_the_model_error(tiny_llama_path):
    """The model file opens, but the replica's engine fails (its draft model is missing): the
    command ends with the engine's message in one line, and Ray is stopped."""
    result = _loom(str(tiny_llama_path), "--replicas", "1", "--threads", "1", "--port", str(free_port()),
                   "--speculative-config", '{"method": "draft_model", "model": "/nonexistent/draft.gguf"}')
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[-1]] and "a replica could not load the model: RegistryError" in errors[0], result.stderr
    assert "/nonexistent/draft.gguf" in errors[0] and "Traceback" not in result.stderr


def test_ingress_takes_the_key_as_bearer_or_x_api_key():
    """The ingress' own routes (/v1/loom/stats, /v1/loom/replicas) take the key as the replicas
    do: Authorization: Bearer or Anthropic's x-api-key."""
    from starlette.requests import Request

    from loom.cluster.ingress import _unauthorized

    def request(**headers: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/v1/loom/stats",
                        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]})

    assert _unauthorized(request(authorization="Bearer k"), "k") is None
    assert _unauthorized(request(x_api_key="k"), "k") is None
    for bad in (request(), request(x_api_key="nope"), request(authorization="Bearer nope")):
        assert _unauthorized(bad, "k").status_code == 401
    assert _unauthorized(request(), None) is None
