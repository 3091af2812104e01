"""`loom serve` with the engine in its own process: the wire format, a dying engine, shutdown.

Real `loom serve` processes (tests/loom_server.py) over a tiny llama: the engine process is
killed mid-stream (the stream ends with an error event, a waiting non-streamed request gets
503, /health and new requests get 503 with Retry-After) and, by default, replaced; SIGTERM and SIGINT leave no process
behind; `--no-engine-process` still serves.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import tempfile
import threading
import time

import httpx
import psutil
import pytest
from loom_server import LoomServer, wait_for

import tiny_gguf
from loom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loom.sampling_params import SamplingParams
from loom.server import wire
from loom.server.metrics import EngineSample

pytestmark = [pytest.mark.slow]

SAMPLE = EngineSample(num_running=1, num_waiting=2, kv_usage=0.25, num_preemptions=0, prompt_tokens=5,
                      generation_tokens=7, prefix_cache_queries=5, prefix_cache_hits=0,
                      prompt_tokens_computed=5)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny llama with room for a long stream (the engine is killed while it runs)."""
    return tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("engine_process") / "tiny-long.gguf", context=16384)


def start(name: str, model, log_dir, *extra: str) -> LoomServer:
    return LoomServer(name, model, ["--threads", "1", "--num-blocks", "2048", *extra], log_dir).wait_ready()


def engine_children(server: LoomServer) -> list[psutil.Process]:
    """The server's engine-core process: the child of multiprocessing's fork server (the server's
    other helpers are that fork server and the resource tracker)."""
    kids = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in kids if "forkserver" in " ".join(p.parent().cmdline())]


# -- the wire format ---------------------------------------------------------------------------


def test_step_outputs_round_trip() -> None:
    out = RequestOutput("r-1", "hi", [1, 2], [CompletionOutput(
        0, "ab", [3, 4], cumulative_logprob=-1.5, logprobs=[{3: Logprob(-0.5, 1, "a")}, {4: Logprob(-1.0, 2, "b")}],
        finish_reason="stop", stop_reason="\n", delta_text="b", delta_token_ids=[4])], True,
        RequestMetrics(arrival_time=1.0, first_token_time=2.0), num_cached_tokens=1)
    msg = wire.StepOutputs([wire.DeltaEncoder().encode(out)], [wire.RequestError("r-2", "QueueFullError", "full")],
                           SAMPLE)
    back = wire.output_decoder().decode(wire.output_encoder().encode(msg))
    assert back == msg
    assert wire.DeltaDecoder().decode(back.outputs[0]) == out


def _outputs() -> list[RequestOutput]:
    """A stream's outputs as the engine makes them: cumulative fields, two requests interleaved,
    one with two choices, logprobs and prompt logprobs that grow, a text the engine cut short."""
    def lp(t: int) -> dict[int, Logprob]:
        return {t: Logprob(-0.1 * t, 1, f"t{t}")}

    def choice(i: int, text: str, ids: list[int], new: int, dtext: str, lps: bool, fin: str | None = None):
        return CompletionOutput(i, text, ids, -1.0 * len(ids) if lps else None, [lp(t) for t in ids] if lps else None,
                                fin, None, dtext, ids[len(ids) - new:] if new else [])

    def req(rid: str, choices, finished: bool, plp=None) -> RequestOutput:
        return RequestOutput(rid, f"prompt {rid}", [9, 8, 7], choices, finished, RequestMetrics(1.0), 2, plp)

    half = [None, {8: Logprob(-0.2, 1, "8")}]              # prompt logprobs as the prompt's chunks run
    whole = half + [{7: Logprob(-0.3, 2, "7")}]
    return [
        req("a", [choice(0, "x", [1], 1, "x", True)], False, half),
        req("b", [choice(1, "p", [5], 1, "p", False)], False),
        req("a", [choice(0, "xy", [1, 2], 1, "y", True)], False, whole),
        req("b", [choice(0, "q", [6], 1, "q", False)], False),
        req("b", [choice(1, "pr", [5, 6], 1, "r", False)], False),
        req("a", [choice(0, "xyz", [1, 2, 3, 4], 2, "z", True)], False, whole),      # two tokens in one step
        req("a", [choice(0, "xy", [1, 2, 3], 0, "", True, "stop")], True, whole),     # the engine cut its text
        req("b", [choice(0, "qs", [6, 7], 1, "s", False, "length")], True),
    ]


def test_outputs_travel_as_deltas_and_are_rebuilt_exactly() -> None:
    enc, dec = wire.DeltaEncoder(), wire.DeltaDecoder()
    coder, decoder = wire.output_encoder(), wire.output_decoder()
    outs = _outputs()
    for out in outs:
        delta = enc.encode(out)
        first = out is outs[0] or out is outs[1]
        assert (delta.head is not None) == first                      # the prompt goes with the first output only
        assert all(c.token_ids is None or c.tokens_at < len(out.outputs[0].token_ids) for c in delta.choices)
        got = dec.decode(decoder.decode(coder.encode(wire.StepOutputs([delta], [], SAMPLE))).outputs[0])
        assert got == out
    assert not enc._sent and not dec._seen                          # both forget a finished request
    # a step's message no longer grows with the prompt or the output so far
    long = RequestOutput("c", "x" * 4000, list(range(1000)), [CompletionOutput(0, "y" * 4000, list(range(1000)),
                         delta_text="y", delta_token_ids=[999])], False)
    enc.encode(long)
    assert len(coder.encode(enc.encode(long))) < 200


def test_add_request_round_trip() -> None:
    params = SamplingParams(temperature=0.5, stop=["\n", "END"], stop_token_ids=[7], max_tokens=9, logprobs=2)
    msg = wire.AddRequest("r-1", {"prompt": "x", "prompt_token_ids": [1, 2]}, pickle.dumps(params), 3, None)
    back = wire.input_decoder().decode(wire.input_encoder().encode(msg))
    assert pickle.loads(back.params) == params and back.prompt == msg.prompt and back.priority == 3
    assert isinstance(wire.input_decoder().decode(wire.input_encoder().encode(wire.AbortRequests(["a"]))),
                      wire.AbortRequests)


# -- a dying engine process --------------------------------------------------------------------


def test_killed_engine_fails_streams_and_answers_503(long_model, tmp_path) -> None:
    """With --engine-restarts 0 the engine stays gone: 503 to everything, the front end up."""
    server = start("killed", long_model, tmp_path, "--engine-restarts", "0")
    try:
        [engine] = engine_children(server)
        body = {"model": "tiny-long", "prompt": "hello", "max_tokens": 15000, "ignore_eos": True,
                "temperature": 0}
        waiting: dict = {}

        def non_streamed() -> None:
            waiting["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        thread = threading.Thread(target=non_streamed)
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:  # the stream runs: kill its engine
                if line.startswith("data: {"):
                    thread.start()
                    wait_for(lambda: _running(server) >= 2, what="both requests running")
                    engine.kill()
                    break
            events = [line for line in lines if line.startswith("data: ")]
        thread.join(60)
        assert not thread.is_alive()
        errors = [json.loads(e[6:])["error"] for e in events if e.startswith("data: {\"error\"")]
        assert events[-1] == "data: [DONE]"
        assert len(errors) == 1 and "engine process exited" in errors[0]["message"]
        assert errors[0]["type"] == "server_error"
        answer = waiting["response"]     # gone for good: no Retry-After (only a new server helps)
        assert answer.status_code == 503 and "retry-after" not in answer.headers
        assert "engine process exited" in answer.json()["error"]["message"]
        assert "restarts are off" in answer.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "retry-after" not in health.headers
        assert "engine" in health.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and "retry-after" not in late.headers
        assert late.json()["error"]["code"] == "engine_unavailable" and errors[0]["code"] == "engine_unavailable"
        assert _metric(server, "vllm:num_requests_running") == 0.0   # nothing runs on a dead engine
        ended = {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                 for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
                 if line.startswith("vllm:request_success_total{")}
        assert ended["error"] == 2 and ended["abort"] == 0   # the engine failed them; no client left
        assert server.process.poll() is None  # the front end stays up and says so
    finally:
        server.stop()


def test_a_killed_engine_is_restarted_within_its_budget(long_model, tmp_path) -> None:
    """The default: a new engine process replaces a killed one. The stream it was running ends
    with an error event, then requests are served again (the 503s while it loads: the test
    below). Past --engine-restarts (here 1) it stays gone."""
    server = start("restarted", long_model, tmp_path, "--engine-restarts", "1")
    try:
        [engine] = engine_children(server)
        body = {"model": "tiny-long", "prompt": "hello", "max_tokens": 15000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            engine.kill()
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "engine process exited" in events[-2]
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, what="a ready engine")
        [successor] = engine_children(server)
        assert successor.pid != engine.pid
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                           timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
        assert "loom:engine_restarts_total{model_name=" in httpx.get(f"{server.url}/metrics", timeout=10).text
        assert _metric(server, "loom:engine_restarts_total") == 1.0
        successor.kill()   # the budget is spent: this one is not replaced
        health = wait_for(lambda: (h := httpx.get(f"{server.url}/health", timeout=10)).status_code == 503 and h,
                          what="503 from /health")
        assert "not restarted" in health.json()["error"]["message"]
        assert not engine_children(server) and server.process.poll() is None
    finally:
        server.stop()


def test_a_killed_fork_server_leaves_no_engine_running_unseen(long_model, tmp_path) -> None:
    """The engine process's sentinel is the fork server's pipe: killing the fork server reads as
    the engine's exit. The engine, still running, is stopped before its successor starts."""
    server = start("forkserver", long_model, tmp_path, "--engine-restarts", "1")
    try:
        [engine] = engine_children(server)
        engine.parent().kill()
        wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE,
                 what="the orphaned engine process to be stopped")
        # (a new fork server starts first, importing the engine's modules: seconds on a busy machine)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, timeout=120,
                 what="a new engine")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def test_requests_get_503_while_the_new_engine_process_loads(long_model, monkeypatch) -> None:
    """ProcessEngineClient in this process, the new engine held back until released: meanwhile
    generate() raises EngineRestartingError, and the app's /health and requests answer 503 with
    Retry-After; once it is ready, requests run on it."""
    from fastapi.testclient import TestClient

    from loom.config import EngineConfig
    from loom.errors import EngineRestartingError
    from loom.server.engine_client import ProcessEngineClient
    from loom.server.openai_api import build_app

    client = ProcessEngineClient(EngineConfig.create(str(long_model), threads=1, num_blocks=64))
    release = threading.Event()
    spawn = client._spawn_and_wait
    monkeypatch.setattr(client, "_spawn_and_wait", lambda: release.wait(60) and spawn())
    with TestClient(build_app(client, served_model_name="tiny")) as http:
        first = client.process
        first.kill()
        wait_for(lambda: isinstance(client.error, EngineRestartingError), what="the restart to begin")
        for r in (http.get("/health"), http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})):
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "engine_unavailable"
            assert "a new one is loading the model" in r.json()["error"]["message"]
        assert http.get("/health").json()["error"]["message"].startswith("engine restarting: ")
        release.set()
        wait_for(lambda: http.get("/health").status_code == 200, what="the new engine")
        assert client.process.pid != first.pid and client.restarts == 1
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _metric(server: LoomServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _running(server: LoomServer) -> float:
    stats = httpx.get(f"{server.url}/v1/loom/stats", timeout=10).json()
    return stats["num_requests_running"]


# -- shutdown ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_process(long_model, tmp_path, sig) -> None:
    server = start(f"signal-{sig.name}", long_model, tmp_path)
    try:
        kids = psutil.Process(server.process.pid).children(recursive=True)
        assert engine_children(server)
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(sig)
            rest: list[str] = []
            cut = False
            try:
                rest.extend(lines)   # the server ends the stream at once: an error event, then [DONE]
            except httpx.HTTPError:  # ... or the connection closes mid-chunk
                cut = True
            if not cut:
                assert any("the server is shutting down" in line for line in rest), rest[-3:]
                assert [line for line in rest if line][-1] == "data: [DONE]"
        # uvicorn shuts down, then re-raises the signal: the status is 0 or the signal's
        assert server.process.wait(timeout=30) in (0, -sig, 128 + sig)
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        assert not server.logged_tracebacks()
    finally:
        server.stop()


def test_a_single_server_on_a_port_in_use_fails_before_the_model_loads(tiny_llama_path, monkeypatch):
    import socket

    from typer.testing import CliRunner

    import loom.server.serve
    from loom.cli import app

    loaded = []
    monkeypatch.setattr(loom.server.serve, "engine_client", lambda *a, **k: loaded.append(a))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--port", str(port)])
    assert result.exit_code == 1 and loaded == []
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", result.stderr


def test_a_second_server_on_the_port_of_one_still_loading_fails_at_once(tiny_llama_path, monkeypatch):
    """The first server's socket listens while its model loads: a second one on that port (which
    SO_REUSEADDR let bind a socket that was only bound) fails instead of running unheard."""
    from typer.testing import CliRunner

    import loom.server.serve
    from loom.cli import app

    monkeypatch.setattr(loom.server.serve, "engine_client", lambda *a, **k: None)
    with loom.server.serve.listen("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--port", str(port)])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", result.stderr


def test_a_non_streamed_answer_under_way_at_a_stop_is_a_503(long_model, tmp_path) -> None:
    """As a stream ends with an error event, a non-streamed answer is a JSON 503 at once, not a
    plain-text 500 once the graceful shutdown's time is out."""
    import concurrent.futures

    server = start("stop-non-streamed", long_model, tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=60,
                                 json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True})
            deadline = time.monotonic() + 30
            while _running(server) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
            r = answer.result(timeout=30)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        assert not server.logged_tracebacks()
    finally:
        server.stop()


def test_requests_queued_at_a_stop_get_a_503_at_once(long_model, tmp_path) -> None:
    """One request runs, two wait in the engine's queue (one streamed): at SIGTERM the running
    stream ends with the error event, and both queued ones get a JSON 503 (they had hung until
    the graceful shutdown's time ran out, then got a plain-text 500 or a stream cut short)."""
    import concurrent.futures

    server = start("stop-queued", long_model, tmp_path, "--max-num-seqs", "1")
    body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}

    def streamed() -> tuple[int, list[str]]:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            return r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")] \
                if r.status_code == 200 else [r.read().decode()]

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = pool.submit(streamed)
            wait_for(lambda: _running(server) >= 1, what="the first request running")
            queued = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60),
                      pool.submit(streamed)]
            wait_for(lambda: httpx.get(f"{server.url}/v1/loom/stats", timeout=10).json()["num_requests_waiting"] >= 2,
                     what="two requests queued")
            server.process.send_signal(signal.SIGTERM)
            plain, (status, events) = queued[0].result(timeout=30), queued[1].result(timeout=30)
            first_status, first_events = running.result(timeout=30)
        assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"], plain.text
        assert status == 503 and "shutting down" in json.loads(events[0])["error"]["message"], events
        assert first_status == 200 and first_events[-1] == "data: [DONE]" and "shutting down" in first_events[-2]
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        assert not server.logged_tracebacks()
    finally:
        server.stop()


def test_sigterm_to_the_whole_process_group_is_a_quiet_stop(long_model, tmp_path) -> None:
    """systemd's default stop (and `kill -- -PGID`) signals every process of the server at once:
    the engine process ending with it is the expected exit, not a failure logged as an error."""
    server = start("group-sigterm", long_model, tmp_path)
    try:
        kids = psutil.Process(server.process.pid).children(recursive=True)
        assert engine_children(server)
        for p in [psutil.Process(server.process.pid), *kids]:
            p.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        log = server.log_text()
        assert "ERROR" not in log and not server.logged_tracebacks(), log[-2000:]
    finally:
        server.stop()


def test_engine_dies_with_a_killed_front_end(long_model, tmp_path) -> None:
    server = start("orphan", long_model, tmp_path)
    try:
        [engine] = engine_children(server)
        server.process.kill()
        server.process.wait(timeout=10)
        gone, alive = psutil.wait_procs([engine], timeout=15)
        assert not alive
    finally:
        server.stop()


def test_in_process_engine_still_serves(long_model, tmp_path) -> None:
    server = start("in-process", long_model, tmp_path, "--no-engine-process")
    try:
        assert not engine_children(server)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        stats = httpx.get(f"{server.url}/v1/loom/stats", timeout=10).json()
        assert stats["generation_tokens"] >= 5
    finally:
        server.stop()


def test_a_killed_front_end_leaves_no_process_behind(long_model, tmp_path) -> None:
    """SIGKILL gives the front end no chance to stop anything: the engine process (forked by the
    fork server, not by the front end) sees the front end's pidfd close and ends itself, and the
    fork server and resource tracker follow."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "loom-engine-*")))
    server = start("front-killed", long_model, tmp_path)
    try:
        kids = psutil.Process(server.process.pid).children(recursive=True)
        assert engine_children(server)
        ipc_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "loom-engine-*"))) - before   # its sockets
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))   # the engine is busy
            server.process.kill()
        server.process.wait(timeout=30)
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()[-1][:60]) for p in alive]}"
        assert ipc_dirs and not any(os.path.exists(d) for d in ipc_dirs)   # the engine removed its sockets
    finally:
        server.stop()


def test_long_texts_are_tokenized_off_the_event_loop(tiny_llama_path) -> None:
    """A megabyte prompt takes seconds to tokenize: past LONG_TEXT_CHARS the front end encodes
    it on a worker thread (through the backend's batch call, which lets go of the GIL), so the
    event loop keeps serving every other stream meanwhile. Same ids either way."""
    import asyncio
    import threading

    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import LONG_TEXT_CHARS, Tokenizer
    from loom.server.engine_client import off_loop

    def where(text: str) -> int:
        return threading.get_ident()

    async def run() -> tuple[int, int, int]:
        return (threading.get_ident(), await off_loop(10, where, "short"),
                await off_loop(LONG_TEXT_CHARS + 1, where, "long"))

    loop_thread, short, long = asyncio.run(run())
    assert short == loop_thread and long != loop_thread
    tok = Tokenizer.from_gguf(GGUFFile.open(tiny_llama_path))
    unit, k = "hello world.\n", LONG_TEXT_CHARS // 10
    text = unit * k
    assert len(text) > LONG_TEXT_CHARS > len(unit * (k // 2))
    assert tok.encode(text) == tok.encode(unit * (k // 2)) + tok.encode(unit * (k - k // 2), add_special_tokens=False)


def test_output_kind_shapes_the_engine_process_stream_as_the_threads(long_model) -> None:
    """SamplingParams.output_kind through ProcessEngineClient (the default `loom serve` engine):
    DELTA pieces join to the cumulative answer and FINAL_ONLY is one output with every choice,
    as AsyncEngine gives them."""
    import asyncio

    from loom.config import EngineConfig
    from loom.sampling_params import RequestOutputKind, SamplingParams
    from loom.server.engine_client import ProcessEngineClient

    client = ProcessEngineClient(EngineConfig.create(str(long_model), threads=1, num_blocks=64))

    async def run(kind, n=1):
        params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0, n=n, output_kind=kind)
        return [out async for out in client.generate("hello there", params)]

    async def all_kinds():
        client.start()
        return (await run(RequestOutputKind.CUMULATIVE), await run(RequestOutputKind.DELTA),
                await run(RequestOutputKind.FINAL_ONLY, n=2))

    try:
        cumulative, delta, final = asyncio.run(all_kinds())
    finally:
        client.shutdown()
    assert len(delta) == len(cumulative) > 1
    assert [t for o in delta for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text
    assert len(final) == 1 and [len(c.token_ids) for c in final[0].outputs] == [5, 5]
