"""`loom bench`: a --quick run of the loom peer on the tiny model yields every metric, a peer whose
package is missing is reported as skipped, and the helpers behave. No timing thresholds."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loom.bench import peers as bench_peers
from loom.bench.peers import PeerKind, parse_peers
from loom.bench.peers.base import RunTiming, request_timing
from loom.bench.prompts import load_spec_bench
from loom.bench.report import metrics
from loom.bench.settings import BenchError, BenchSettings
from loom.bench.stats import percentile
from loom.cli import app

CATEGORIES = ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    """A small Spec-Bench-shaped question.jsonl."""
    rows = [{"question_id": i, "category": CATEGORIES[i % len(CATEGORIES)],
             "turns": [f"Question {i}: explain why the sky looks blue at noon and red at sunset, briefly.",
                       "Now shorter."]}
            for i in range(12)]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def ghost_peer(monkeypatch: pytest.MonkeyPatch) -> str:
    """A registered peer whose package can never be found."""
    kind = PeerKind("ghost", ("loom_bench_module_that_does_not_exist",), "ghost-engine",
                    "loom.bench.peers.loom_peer:LoomPeer")
    monkeypatch.setitem(bench_peers.PEER_KINDS, kind.name, kind)
    return kind.name


def test_quick_bench_reports_every_metric_and_skips_missing_peer(tiny_llama_path: Path, prompts_file: Path,
                                                                  ghost_peer: str, tmp_path: Path) -> None:
    report_path, plot_dir = tmp_path / "report.json", tmp_path / "plots"
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick", "--threads", "1",
                                      "--peers", f"loom,{ghost_peer}", "--prompts", str(prompts_file),
                                      "--json", str(report_path), "--plot", str(plot_dir)])
    assert result.exit_code == 0, result.output
    assert "skipped" in result.output

    report = json.loads(report_path.read_text())
    loom, ghost = report["engines"]["loom"], report["engines"][ghost_peer]
    assert loom["status"] == "ok", loom
    assert ghost["status"] == "skipped" and ghost["reason"] == "not installed"
    assert not any(key in ghost for key in ("decode", "prefill", "concurrency", "load_seconds"))
    assert report["primary"] == "loom" and report["threads"] == 1

    settings = report["settings"]
    assert settings["quick"] and settings["concurrency"] == [1, 4]
    for metric in metrics(settings):
        value = metric.get(loom)
        assert value is not None and value > 0, metric.key
    assert loom["decode"]["tokens"] == settings["decode_tokens"]
    assert loom["prefill"]["tokens"] == settings["prefill_tokens"]
    for n in settings["concurrency"]:
        level = loom["concurrency"][str(n)]
        assert level["requests"] == n
        assert level["output_tokens"] == n * settings["max_tokens"]
        assert level["wall_seconds"] > 0
    assert {p.name for p in plot_dir.iterdir()} == {"throughput.png", "latency.png", "single_stream.png"}


def test_the_loom_peer_times_every_request_on_one_clock(tiny_llama_path) -> None:
    """decode_throughput compares token times across requests: the loom peer times them all from
    the run's start, as the other peers do (from each request's own arrival, a step's tokens fell
    apart and N - 1 of a run's were not counted: 12-14% at --quick)."""
    from loom.bench.peers.loom_peer import LoomPeer
    from loom.bench.settings import Capacity

    peer = LoomPeer(tiny_llama_path, 1, Capacity(max_seqs=4, max_seq_len=64, max_total_tokens=256))
    peer.load()
    run = peer.generate([[5, 6, 7, 8]] * 4, 6)
    assert all(r.token_times == run.requests[0].token_times for r in run.requests)   # one step, one time
    times = run.requests[0].token_times
    assert run.decode_throughput() == pytest.approx(4 * (len(times) - 1) / (times[-1] - times[0]))


def test_decode_throughput_counts_only_the_window_where_every_request_decodes() -> None:
    """Request a's first token comes at 1.0 s, b's (a longer prompt) at 1.5 s; both then get a
    token every 0.1 s, a finishing first. In [1.5, a's last token] both decode: 2 tokens / 0.1 s."""
    a = [1.0 + 0.1 * i for i in range(11)]            # 1.0 .. 2.0
    b = [1.5] + [1.6 + 0.1 * i for i in range(10)]    # 1.5, then 1.6 .. 2.5
    run = RunTiming(2.5, [request_timing(0.0, a[0], a[-1], len(a), a), request_timing(0.0, b[0], b[-1], len(b), b)])
    assert run.decode_throughput() == pytest.approx(20.0)
    assert run.output_tokens / run.wall_seconds == pytest.approx(8.8)   # prefill and the tail included
    # one request: its own tokens per second after the first
    assert RunTiming(2.0, run.requests[:1]).decode_throughput() == pytest.approx(10.0)
    # without token times, or with no moment where both decode: no figure
    assert RunTiming(2.5, [request_timing(0.0, 1.0, 2.0, 11)]).decode_throughput() is None
    late = [3.0 + 0.1 * i for i in range(11)]
    assert RunTiming(4.0, [run.requests[0], request_timing(0.0, 3.0, 4.0, 11, late)]).decode_throughput() is None


def test_parallel_suites_quick(tiny_llama_path: Path, prompts_file: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick", "--threads", "1",
                                      "--peers", "loom", "--prompts", str(prompts_file), "--parallel", "--limit", "1",
                                      "--concurrency", "1", "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    loom, settings = report["engines"]["loom"], report["settings"]
    assert settings["suites"][-2:] == ["parallel", "parallel_quality"]
    for n in settings["parallel_n"]:
        level = loom["parallel"]["levels"][str(n)]
        assert level["fork"]["prompt_tokens_computed"] == settings["parallel_prompt_tokens"] - 1 + n
        assert level["independent"]["prompt_tokens_computed"] == n * settings["parallel_prompt_tokens"]
        assert level["fork"]["peak_kv_blocks"] <= level["independent"]["peak_kv_blocks"]
    quality = loom["parallel_quality"]
    assert quality["problems"] == 1 and set(quality["methods"]) == {"greedy", "self_consistency", "short_m_at_k",
                                                                    "best_of"}
    assert all(m["tokens_per_problem"] > 0 for m in quality["methods"].values())



def test_parse_peers() -> None:
    specs = parse_peers("loom, loom:float32,llama.cpp,loom")
    assert [s.label for s in specs] == ["loom", "loom:float32", "llama.cpp"]
    assert specs[1].options == {"dtype": "float32"} and specs[0].is_loom and not specs[2].is_loom
    for bad in ("vllm", "llama.cpp:fast", "transformers:bfloat16", ",", "loom:kb=int8", "llama.cpp:kv=q8_0"):
        with pytest.raises(BenchError):
            parse_peers(bad)
    kv = parse_peers("loom:kv=int8,loom:float32+kv=int4")
    assert kv[0].options == {"kv_cache_dtype": "int8"}
    assert kv[1].options == {"dtype": "float32", "kv_cache_dtype": "int4"}


def test_decode_at_context_with_a_quantized_kv_cache(tiny_llama_path: Path, prompts_file: Path,
                                                     tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick", "--threads", "1",
                                      "--peers", "loom:kv=int8", "--prompts", str(prompts_file), "--concurrency", "1",
                                      "--decode-context", "40,300", "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    loom, settings = report["engines"]["loom:kv=int8"], report["settings"]
    assert settings["decode_contexts"] == [40, 300] and settings["suites"][-1] == "decode_context"
    assert loom.get("info", {}).get("kv_cache_dtype") == "int8", sorted(loom)
    for n in ("40", "300"):
        assert loom["decode_context"][n]["tokens"] == settings["decode_tokens"]
        assert loom["decode_context"][n]["tok_s"] > 0
    assert "decode at context 300" in result.output


def test_the_dtype_flags_reach_the_worker(tiny_llama_path: Path, prompts_file: Path, tmp_path: Path) -> None:
    """--dtype and --kv-cache-dtype set options on the peer `loom` without changing its label: the
    worker must run with them, not with the ones the label names."""
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick", "--threads", "1",
                                      "--peers", "loom", "--dtype", "float32", "--kv-cache-dtype", "int8",
                                      "--prompts", str(prompts_file), "--concurrency", "1", "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    info = json.loads(report_path.read_text())["engines"]["loom"]["info"]
    assert info["kv_cache_dtype"] == "int8" and info["dtype"] == "float32", info


def test_bad_kv_cache_dtype_fails_before_running(tiny_llama_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick",
                                      "--kv-cache-dtype", "int3"])
    assert result.exit_code == 1 and "kv_cache_dtype must be one of auto, float32, float16, int8, int4" in result.output


def test_bad_loom_dtype_fails_before_running(tiny_llama_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_llama_path), "--quick", "--peers", "loom:int3"])
    assert result.exit_code == 1 and "dtype" in result.output


def test_settings_preset_and_validation() -> None:
    quick = BenchSettings.preset(quick=True)
    assert quick.quick and quick.replace(max_tokens=None) == quick
    assert quick.replace(concurrency=(4, 1, 4)).concurrency == (1, 4)
    with pytest.raises(BenchError):
        BenchSettings(max_tokens=1)
    with pytest.raises(BenchError):
        BenchSettings(concurrency=(0,))


def test_spec_bench_prompts_interleave_categories(prompts_file: Path, tmp_path: Path) -> None:
    texts = load_spec_bench(prompts_file)
    assert len(texts) == 12 and texts[0].startswith("Question 0:") and texts[1].startswith("Question 1:")
    with pytest.raises(BenchError, match="not found"):
        load_spec_bench(tmp_path / "missing.jsonl")


def test_percentile() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)


# -- loom bench --server (load test) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """One `loom serve` process on the tiny llama."""
    from loom_server import LoomServer

    server = LoomServer("load", tiny_llama_path, ["--threads", "1", "--num-blocks", "256", "--no-access-log"],
                        tmp_path_factory.mktemp("load_logs"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_load_test_against_a_real_server(tiny_server, prompts_file: Path, tmp_path: Path) -> None:
    report_path, plot_dir = tmp_path / "load.json", tmp_path / "plots"
    result = CliRunner().invoke(app, ["bench", "--server", tiny_server.url, "--rates", "4,max", "--num-requests", "3",
                                      "--max-tokens", "6", "--prompts", str(prompts_file), "--json", str(report_path),
                                      "--plot", str(plot_dir)])
    assert result.exit_code == 0, result.output
    assert "saturation" in result.output
    report = json.loads(report_path.read_text())
    assert report["kind"] == "load" and report["model"] == "tiny-llama"
    assert [lv["label"] for lv in report["levels"]] == ["4", "max"]
    for level in report["levels"]:
        assert level["requests"] == 3 == level["ok"] + level["rejected_429"] + level["errors"]
        assert level["errors"] == 0, level["error_samples"]
        assert level["usage_reported"] and 0 < level["output_tokens"] <= 6 * level["ok"]
        assert level["achieved_rps"] > 0 and level["output_tok_s"] > 0
        for key in ("ttft_ms", "e2e_ms"):
            assert 0 <= level[key]["p50"] <= level[key]["p99"]
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p99"]
        if level["itl_ms"] is not None:
            assert 0 <= level["itl_ms"]["p50"] <= level["itl_ms"]["p99"]
    assert "tracking" in report["levels"][0] and "tracking" not in report["levels"][1]
    assert {p.name for p in plot_dir.iterdir()} == {"load_throughput.png", "load_latency.png"}

    from loom.bench.load_report import markdown

    section = markdown(report)
    assert "| rate req/s |" in section and "\n| max |" in section


def test_load_test_of_no_server_fails_clearly(prompts_file: Path) -> None:
    from loom_server import free_port

    result = CliRunner().invoke(app, ["bench", "--server", f"http://127.0.0.1:{free_port()}", "--quick",
                                      "--prompts", str(prompts_file)])
    assert result.exit_code == 1 and "cannot list models" in result.output


@pytest.fixture(scope="module")
def tiny_gemma_server(tiny_gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """`loom serve` on the tiny gemma3: a base model without a chat template."""
    from loom_server import LoomServer

    server = LoomServer("load-gemma", tiny_gemma3_path, ["--threads", "1", "--num-blocks", "256", "--no-access-log"],
                        tmp_path_factory.mktemp("load_gemma_logs"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_load_test_sends_completions_to_a_model_without_a_chat_template(tiny_gemma_server, prompts_file: Path,
                                                                        tmp_path: Path) -> None:
    report_path = tmp_path / "load.json"
    args = ["bench", "--server", tiny_gemma_server.url, "--rates", "max", "--num-requests", "3", "--max-tokens", "5",
            "--prompts", str(prompts_file), "--json", str(report_path)]
    result = CliRunner().invoke(app, args)   # --endpoint auto: the server's /tokenizer_info has no template
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["endpoint"] == "completions" and report["settings"]["endpoint"] == "auto"
    assert "no chat template" in report["endpoint_note"] and "POST /v1/completions" in result.output
    level = report["levels"][0]
    assert level["requests"] == 3 == level["ok"], level["error_samples"]
    assert level["usage_reported"] and 0 < level["output_tokens"] <= 15
    assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]

    result = CliRunner().invoke(app, [*args, "--endpoint", "/v1/completions", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["endpoint"] == "completions" and report["endpoint_note"] is None
    assert report["settings"]["ignore_eos"] and "(ignore_eos)" in result.output
    assert report["levels"][0]["ok"] == 3 and report["levels"][0]["output_tokens"] == 3 * 5

    result = CliRunner().invoke(app, [*args, "--endpoint", "chat"])
    assert result.exit_code == 1
    assert "warm-up request to" in result.output and "/v1/chat/completions failed: HTTP 400" in result.output
    assert "--endpoint completions" in result.output


def test_completions_endpoint_on_a_chat_model(tiny_server, prompts_file: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "load.json"
    for endpoint, expected in (("completions", "completions"), ("auto", "chat")):
        result = CliRunner().invoke(app, ["bench", "--server", tiny_server.url, "--rates", "max", "--num-requests", "2",
                                          "--max-tokens", "4", "--endpoint", endpoint, "--prompts", str(prompts_file),
                                          "--json", str(report_path)])
        assert result.exit_code == 0, result.output
        report = json.loads(report_path.read_text())
        assert report["endpoint"] == expected and report["levels"][0]["ok"] == 2, report["levels"][0]["error_samples"]


class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Lists model "fake"; no /tokenizer_info; chat answers 400 (no chat template); completions
    answer with `statuses` in turn (then 200): 200 streams "a", "b", "c" and a usage chunk."""

    statuses: list[int] = []
    bodies: list[dict] = []

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.path == "/v1/chat/completions":
            return self._json(400, {"error": {"message": "the model has no chat template"}})
        status = type(self).statuses.pop(0) if type(self).statuses else 200
        if status == 299:   # a stream cut off: no usage, no [DONE]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n')
            return None
        if status != 200:
            return self._json(status, {"error": {"message": f"failing with {status}"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b", "c")]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_openai():
    """A stand-in OpenAI server in a thread; yields (url, handler class)."""
    _FakeOpenAI.statuses, _FakeOpenAI.bodies = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _FakeOpenAI
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_beside_peers_must_serve_their_model(fake_openai, tiny_llama_path: Path) -> None:
    """--server URL --peers ...: the URL's server must serve the model the peers run (its name or
    its GGUF file's stem): a ratio between two models is refused before anything runs."""
    url, _ = fake_openai
    result = CliRunner().invoke(app, ["bench", "--server", url, "--peers", "engine", "--model", str(tiny_llama_path),
                                      "--rates", "max", "--num-requests", "1", "--max-tokens", "2"])
    assert result.exit_code == 1 and "does not serve model" in result.output and "tiny-llama" in result.output
    assert "it serves fake" in result.output


def test_a_stream_without_done_is_a_failed_request(fake_openai, prompts_file: Path) -> None:
    """As vLLM's benchmark counts it: a 200 whose stream ends before [DONE] failed."""
    from loom.bench.load import LoadSettings, run_load

    url, handler = fake_openai
    handler.statuses = [200, 299, 200]   # the warm-up, then one of two requests cut off
    plan = LoadSettings(url=url, rates=(float("inf"),), num_requests=2, max_tokens=3, endpoint="completions",
                        prompts_path=prompts_file)
    level = run_load(plan)["levels"][0]
    assert level["ok"] == 1 and any("without [DONE]" in e for e in level["error_samples"]), level


def test_completions_load_reports_server_errors(fake_openai, prompts_file: Path) -> None:
    from loom.bench.load import LoadSettings, run_load

    url, handler = fake_openai
    plan = LoadSettings(url=url, rates=(float("inf"),), num_requests=4, max_tokens=7, endpoint="completions",
                        prompts_path=prompts_file)
    handler.statuses = [503]
    with pytest.raises(BenchError, match=r"warm-up request to http://127\.0\.0\.1:\d+/v1/completions failed: "
                                         r"HTTP 503: .*failing with 503") as failed:
        run_load(plan)
    assert "--endpoint" not in str(failed.value)
    handler.statuses, handler.bodies = [200, 500, 200, 422, 200], []
    report = run_load(plan)
    level = report["levels"][0]
    assert (level["ok"], level["errors"], level["rejected_429"]) == (2, 2, 0)
    assert sorted(s[:8] for s in level["error_samples"]) == ["HTTP 422", "HTTP 500"]
    assert level["output_tokens"] == 6 and level["usage_reported"] and level["itl_ms"] is not None
    sent = handler.bodies
    assert all(b["stream"] and b["max_tokens"] == 7 and b["model"] == "fake" and "messages" not in b for b in sent)
    assert all(b["prompt"] and b["stream_options"] == {"include_usage": True} and "ignore_eos" not in b for b in sent)
    handler.bodies = []
    run_load(dataclasses.replace(plan, ignore_eos=True, num_requests=1))
    assert [b["ignore_eos"] for b in handler.bodies] == [True, True]   # the warm-up and the one request
    assert all(b["temperature"] == 0 and "top_p" not in b and "top_k" not in b for b in handler.bodies)
    handler.bodies = []   # sampled: one distribution on every server, whatever its defaults
    sampled = run_load(dataclasses.replace(plan, temperature=0.8, top_p=0.95, num_requests=1))
    assert [(b["temperature"], b["top_p"], b["top_k"], b["min_p"]) for b in handler.bodies] == [(0.8, 0.95, -1, 0.0)] * 2
    from loom.bench.load_report import markdown
    assert "--temperature 0.8 --top-p 0.95" in markdown(sampled)


def test_auto_endpoint_without_tokenizer_info_sends_chat(fake_openai, prompts_file: Path) -> None:
    from loom.bench.load import LoadSettings, run_load

    url, handler = fake_openai
    plan = LoadSettings(url=url, rates=(float("inf"),), num_requests=1, prompts_path=prompts_file)
    with pytest.raises(BenchError, match=r"/v1/chat/completions failed: HTTP 400.*--endpoint completions"):
        run_load(plan)
    assert handler.bodies[0]["messages"][0]["role"] == "user" and "prompt" not in handler.bodies[0]


def test_a_named_model_a_server_does_not_serve_is_an_error(fake_openai, prompts_file: Path) -> None:
    """--model named with --server URL: a typo is an error listing what the server serves; left
    at its default, the server's first model is load-tested."""
    url, handler = fake_openai
    result = CliRunner().invoke(app, ["bench", "--server", url, "-m", "fakee", "--rates", "max", "--num-requests", "1",
                                      "--prompts", str(prompts_file), "--endpoint", "completions"])
    assert result.exit_code == 1 and "does not serve model 'fakee': it serves fake" in result.output, result.output
    handler.statuses, handler.bodies = [], []
    result = CliRunner().invoke(app, ["bench", "--server", url, "--rates", "max", "--num-requests", "1",
                                      "--prompts", str(prompts_file), "--endpoint", "completions", "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert handler.bodies and all(b["model"] == "fake" for b in handler.bodies)


def test_endpoint_names_and_the_gguf_chat_template(tiny_llama_path: Path, tiny_gemma3_path: Path,
                                                   tmp_path: Path) -> None:
    from loom.bench.load import LoadSettings, endpoint_for_gguf, parse_endpoint
    from loom.bench.server_compare import same_endpoint

    for text, name in (("chat", "chat"), (" Completions", "completions"), ("auto", "auto"),
                       ("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
                       ("chat/completions", "chat"), ("/completions", "completions")):
        assert parse_endpoint(text) == name
    for bad in ("", "embeddings", "/v1/responses"):
        with pytest.raises(BenchError, match="--endpoint: expected auto, chat or completions"):
            parse_endpoint(bad)
    with pytest.raises(BenchError, match="unknown endpoint"):
        LoadSettings(url="http://x", endpoint="responses")
    assert endpoint_for_gguf(tiny_llama_path) == "chat" and endpoint_for_gguf(tiny_gemma3_path) == "completions"
    with pytest.raises(BenchError, match="cannot read the chat template"):
        endpoint_for_gguf(tmp_path / "missing.gguf")
    plans = [LoadSettings(url="http://x", num_requests=n) for n in (8, 32)]
    assert [p.endpoint for p in same_endpoint(plans, tiny_gemma3_path)] == ["completions"] * 2
    assert [p.endpoint for p in same_endpoint(plans, None)] == ["auto"] * 2
    chat = [LoadSettings(url="http://x", num_requests=8, endpoint="chat")]
    assert same_endpoint(chat, tiny_gemma3_path)[0].endpoint == "chat"


def test_bad_endpoint_option_fails_before_any_request() -> None:
    result = CliRunner().invoke(app, ["bench", "--server", "http://127.0.0.1:9", "--endpoint", "embeddings"])
    assert result.exit_code == 1 and "--endpoint: expected auto, chat or completions" in result.output


def test_sampling_options_of_a_load_test_are_checked() -> None:
    result = CliRunner().invoke(app, ["bench", "--server", "http://127.0.0.1:9", "--temperature", "1", "--top-p", "0"])
    assert result.exit_code == 1 and "--top-p must be in (0, 1], got 0.0" in result.output
    result = CliRunner().invoke(app, ["bench", "--temperature", "0.7"])   # not a load test: refused, not ignored
    assert result.exit_code == 1 and "--temperature has no effect in the peer suites" in result.output
    assert "it is for a load test (--server)" in result.output


@pytest.mark.parametrize("args, message", [
    (["--spec", "--concurrency", "4"], "--concurrency has no effect in --spec"),
    (["--server", "http://127.0.0.1:9", "--spec-methods", "auto"], "--spec-methods has no effect in a load test"),
    (["--server", "http://127.0.0.1:9", "--spec"], "--spec has no effect in a load test"),
    (["--endpoint", "completions"], "--endpoint has no effect in the peer suites"),
    (["--server", "http://127.0.0.1:9", "--rounds", "2"], "--rounds interleaves the servers of --peers"),
    (["--peers", "llama.cpp", "--dtype", "float32"], "--dtype sets the plain `loom` peer"),
    (["--concurrency", "abc"], "--concurrency: expected comma-separated integers"),
    (["--plot", "README.md"], "--plot README.md: is a file"),
    (["--server", "http://127.0.0.1:9", "--duration", "1", "--num-requests", "3"], "not both"),
])
def test_bench_options_a_mode_would_not_read_are_refused_before_it_runs(args, message) -> None:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 1 and message in result.output, result.output


def test_load_rates_counts_and_arrivals() -> None:
    import math
    import random

    from loom.bench.load import LoadSettings, arrival_times, parse_rates

    assert parse_rates("2, 0.5,max,2") == (0.5, 2.0, math.inf)
    for bad in ("", "0", "-1", "fast", "nan"):
        with pytest.raises(BenchError):
            parse_rates(bad)
    times = arrival_times(2.0, 50, random.Random(0))
    assert times[0] == 0 and times == sorted(times) and len(set(times)) == 50
    assert arrival_times(2.0, 50, random.Random(0)) == times
    assert arrival_times(math.inf, 3, random.Random(0)) == [0.0, 0.0, 0.0]
    by_time = LoadSettings(url="http://x", rates=(0.5, 4.0, math.inf), num_requests=None, duration=10)
    assert by_time.counts() == [5, 40, 40] and by_time.api_base == "http://x/v1"
    with pytest.raises(BenchError):
        LoadSettings(url="http://x", num_requests=4, duration=10)


def test_load_max_concurrency_holds_that_many_requests_in_flight(monkeypatch) -> None:
    """--max-concurrency: never more than N requests in flight; a waiting request's clock starts
    when it is sent, so its TTFT is the server's, not the queue's."""
    import asyncio
    import math
    import random

    from loom.bench import load

    busy, peak = 0, 0

    async def fake_send(client, settings, payload, record, clock):
        nonlocal busy, peak
        busy += 1
        peak = max(peak, busy)
        await asyncio.sleep(0.02)
        record.first_token = clock()
        record.end, record.status, record.output_tokens = clock(), 200, 1
        busy -= 1

    monkeypatch.setattr(load, "_send", fake_send)
    settings = load.LoadSettings(url="http://x", rates=(math.inf,), num_requests=10, max_concurrency=3)
    records = asyncio.run(load.run_rate(None, settings, "m", load.RatePlan(math.inf, ["p"], [0.0] * 10)))
    assert peak == 3 and len(records) == 10
    ends = sorted(r.end for r in records)
    later = sorted(records, key=lambda r: r.sent)[3:]                      # sent once a slot was free:
    assert all(any(e <= r.sent for e in ends) for r in later)              # after an earlier answer ended
    assert settings.to_json()["max_concurrency"] == 3
    with pytest.raises(BenchError, match="--max-concurrency must be >= 1"):
        load.LoadSettings(url="http://x", num_requests=4, max_concurrency=0)


def test_load_summary_and_saturation_from_hand_made_records() -> None:
    from loom.bench.load import RequestRecord, saturation, summarize

    def answered(sent: float, first: float, chunks: list[float], tokens: int) -> RequestRecord:
        return RequestRecord(sent=sent, status=200, first_token=first, end=chunks[-1], chunk_times=chunks,
                             output_tokens=tokens, usage_reported=True)

    calm = summarize(1.0, [answered(0.0, 0.1, [0.1, 0.2, 0.4], 3), answered(1.0, 1.1, [1.1, 1.3, 1.6], 3)])
    assert calm["ok"] == 2 and calm["output_tokens"] == 6 and calm["duration_seconds"] == pytest.approx(1.6)
    assert calm["achieved_rps"] == pytest.approx(2 / 1.6) and calm["send_window_seconds"] == 1.0
    assert calm["ttft_ms"]["p50"] == pytest.approx(100) and calm["e2e_ms"]["p99"] == pytest.approx(597, abs=3)
    assert calm["itl_ms"]["p50"] == pytest.approx(200)  # gaps 100, 200, 200, 300

    overloaded = summarize(2.0, [answered(0.0, 2.0, [2.0, 3.0], 2), RequestRecord(sent=0.5, status=429,
                                                                                   error="HTTP 429: full"),
                                 RequestRecord(sent=0.6, error="ConnectError: refused")])
    assert (overloaded["ok"], overloaded["rejected_429"], overloaded["errors"]) == (1, 1, 1)
    assert overloaded["error_samples"] == ["ConnectError: refused"]
    slow = summarize(4.0, [answered(0.0, 1.5, [1.5, 2.4], 2), answered(0.25, 2.0, [2.0, 2.9], 2)])
    at_once = summarize(float("inf"), [answered(0.0, 0.1, [0.1, 0.5], 2)])
    assert at_once["rate"] is None and at_once["label"] == "max"

    verdict = saturation([calm, slow, at_once])
    assert verdict["baseline_e2e_ms"] == pytest.approx(500)
    assert calm["tracking"] == pytest.approx((2 / 1.6) / (2 / 1.5)) and calm["saturated"] == []
    assert slow["saturated"] and verdict["rate"] == 4.0 and "saturated" not in at_once
    assert "failed requests" in saturation([calm, overloaded])["reasons"]
    assert saturation([calm])["rate"] is None


# -- GSM8K quality suite: every sampled method from one set of samples -------------------------------


def _sample(index: int, text: str, length: int, mean_logprob: float):
    from loom.outputs import CompletionOutput

    return CompletionOutput(index=index, text=text, token_ids=list(range(length)),
                            cumulative_logprob=mean_logprob * length, finish_reason="stop")


def test_score_samples_shares_one_set_of_samples() -> None:
    from loom.bench.suites.parallel import score_samples
    from loom.parallel.aggregators import create_extractor

    samples = [_sample(0, "so #### 7", 30, -0.9), _sample(1, "#### 5", 10, -0.5), _sample(2, "it is 5", 12, -0.4),
               _sample(3, "#### 7", 40, -0.2), _sample(4, "#### 7", 50, -0.3), _sample(5, "no idea", 20, -1.0)]
    got = score_samples(samples, 3, create_extractor("gsm8k"))
    total = 30 + 10 + 12 + 40 + 50 + 20
    assert got["self_consistency"] == ("7", total)  # 7 x3, 5 x2
    assert got["best_of"] == ("7", total)  # sample 3: mean logprob -0.2
    # the 3 first to finish are the 10-, 12- and 20-token samples (answers 5, 5, none); the run
    # would have stopped at token 20, spending min(length, 20) on each sample
    assert got["short_m_at_k"] == ("5", 20 + 10 + 12 + 20 + 20 + 20)
    assert score_samples(samples, 99, create_extractor("gsm8k"))["short_m_at_k"] == ("7", total)
    assert score_samples(samples, 1, create_extractor("gsm8k"))["short_m_at_k"] == ("5", 6 * 10)


def test_quality_prompts_chat_or_few_shot(tiny_llama_path: Path, tiny_gemma3_path: Path) -> None:
    from loom.bench.suites.parallel import FEW_SHOTS, load_gsm8k, quality_prompts
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer

    problems = load_gsm8k(2)
    assert load_gsm8k(1) == problems[:1] and all(p["answer"] for p in problems)
    chat_tok = Tokenizer.from_gguf(GGUFFile.open(tiny_llama_path))
    prompts, stop, kind = quality_prompts(chat_tok, problems)
    assert kind == "chat" and stop == [] and len(prompts) == 2
    plain_tok = Tokenizer.from_gguf(GGUFFile.open(tiny_gemma3_path))
    assert plain_tok.chat_template is None
    prompts, stop, kind = quality_prompts(plain_tok, problems)
    text = plain_tok.decode(prompts[0]["prompt_token_ids"])
    assert kind == f"{FEW_SHOTS}-shot" and stop == ["Question:"]
    assert text.count("Question:") == FEW_SHOTS + 1 and text.count("####") == FEW_SHOTS
    assert text.endswith("Answer:") and problems[0]["question"] in text and "<<" not in text


def test_spec_bench_quick_reports_every_category(tiny_llama_path: Path, prompts_file: Path, tmp_path: Path) -> None:
    md, out = tmp_path / "spec.md", tmp_path / "spec.json"
    result = CliRunner().invoke(app, ["bench", "--spec", "--quick", "--model", str(tiny_llama_path), "--threads", "1",
                                      "--prompts", str(prompts_file), "--spec-methods", "prompt_lookup",
                                      "--spec-repeats", "2", "--json", str(out), "--markdown", str(md),
                                      "--plot", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["categories"]) == set(CATEGORIES)
    assert (tmp_path / "plots" / "spec_speedup.png").stat().st_size > 0
    for row in report["categories"].values():
        single = row["prompt_lookup"]["single"]
        assert single["tok_s"] > 0 and single["decode_tok_s"] > 0
        assert [len(row["prompt_lookup"]["paired"][m]) for m in ("single", "concurrent")] == [2, 2]   # one per repeat
        assert single["decode_tokens"] == single["tokens"] - row["prompts"]   # the first tokens are not decode
    text = md.read_text()
    assert "### `prompt_lookup`" in text and all(f"| {c} |" in text for c in CATEGORIES)


def test_spec_bench_keeps_each_engines_fastest_run_and_adds_up_its_drafts() -> None:
    from loom.bench.spec_bench import _fastest

    def run(single: float, concurrent: float, drafts: int) -> dict:
        return {"single": {"decode_tok_s": single}, "concurrent": {"decode_tok_s": concurrent},
                "num_drafts": drafts, "num_accepted_tokens": 2 * drafts}

    best = _fastest(_fastest(None, run(100.0, 50.0, 3)), run(90.0, 60.0, 4))
    assert best["single"]["decode_tok_s"] == 100.0 and best["concurrent"]["decode_tok_s"] == 60.0
    assert best["num_drafts"] == 7 and best["num_accepted_tokens"] == 14


def test_spec_bench_runs_the_engines_in_turns_each_timed_by_its_own_steps(monkeypatch) -> None:
    from types import SimpleNamespace

    from loom.bench import spec_bench

    clock, trace = [0.0], []
    monkeypatch.setattr(spec_bench.time, "perf_counter", lambda: clock[0])

    class Fake:
        """One token per request and step; a step costs `prefill` with a new prompt, else `decode`."""

        def __init__(self, name: str, decode: float, prefill: float = 1.0):
            self.name, self.decode, self.prefill, self.left, self.fresh = name, decode, prefill, {}, set()

        def add_request(self, prompt, params):
            rid = f"{self.name}{len(self.left)}-{clock[0]}"
            self.left[rid], self.max = params.max_tokens, params.max_tokens
            self.fresh.add(rid)
            return rid

        def has_unfinished_requests(self) -> bool:
            return any(self.left.values())

        def step(self):
            trace.append(self.name)
            clock[0] += self.prefill if self.fresh else self.decode
            self.fresh.clear()
            outs = []
            for rid, n in self.left.items():
                if n:
                    self.left[rid] = n - 1
                    done = self.max - n + 1
                    outs.append(SimpleNamespace(request_id=rid, finished=n == 1,
                                                outputs=[SimpleNamespace(token_ids=list(range(done)))]))
            return outs

    slow, fast = Fake("s", decode=0.010), Fake("f", decode=0.005)
    runs = {"s": spec_bench._Run(slow, [[1], [2]], 4, concurrent=False),
            "f": spec_bench._Run(fast, [[1], [2]], 4, concurrent=True)}
    res = spec_bench._loom_runs(runs)
    # turns of one step each, the first of a turn rotating, until the shorter run (one group) ends
    assert trace[:8] == ["s", "f", "f", "s", "s", "f", "f", "s"] and trace.count("s") == 8 and trace.count("f") == 4
    # each engine's time is its own steps only: 2 prompts x (1 prefill + 3 decode steps); decode
    # speed counts the tokens after each group's first over the steps after that first one
    assert res["s"]["seconds"] == pytest.approx(2 * (1.0 + 3 * 0.010)) and res["s"]["tokens"] == 8
    assert res["s"]["decode_tok_s"] == pytest.approx(6 / (6 * 0.010))
    assert res["f"]["decode_tok_s"] == pytest.approx(6 / (3 * 0.005)) and res["f"]["steps"] == 4


def test_spec_bench_speedups_are_the_median_of_the_paired_ratios() -> None:
    from loom.bench.spec_bench import _speedups

    runs = {"single": {"decode_tok_s": 100.0, "tok_s": 90.0}, "concurrent": {"decode_tok_s": 400.0, "tok_s": 380.0}}
    fast = {"single": {"decode_tok_s": 130.0, "tok_s": 110.0}, "concurrent": {"decode_tok_s": 300.0, "tok_s": 290.0}}
    row = {"loom": runs, "auto": fast | {"paired": {"single": [1.1, 1.4, 1.2], "concurrent": [0.99, 1.01, 0.97]}}}
    got = _speedups(row, "auto")
    # paired: each repetition's ratio, medians 1.2 and 0.99 (the fastest runs' ratio would be 1.3 and 0.75)
    assert got["single"] == pytest.approx(1.2) and got["concurrent"] == pytest.approx(0.99)
    assert got["single_e2e"] == pytest.approx(110 / 90)
    del row["auto"]["paired"]                      # a report from before the paired ratios
    assert _speedups(row, "auto")["concurrent"] == pytest.approx(0.75)


def test_spec_bench_rejects_unknown_methods(tiny_llama_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--spec", "--model", str(tiny_llama_path), "--spec-methods", "psychic"])
    assert result.exit_code == 1 and "psychic" in result.output and "retrieval" in result.output


def test_spec_bench_refuses_a_bad_prompt_file_in_one_line(tiny_llama_path: Path, tmp_path: Path) -> None:
    """--spec's --prompts file: not JSON, a line without 'turns', not UTF-8, or nothing short
    enough to measure, each a one-line error naming the file (a traceback before)."""
    bad = tmp_path / "q.jsonl"
    for content, words in ((b'{"category": "qa", "turns": ["hi"]}\nnot json\n', "line 2 is not a Spec-Bench"),
                           (b'{"category": "qa"}\n', "line 1 is not a Spec-Bench"),
                           (b'\xff\xfe{"category"\n', "cannot read Spec-Bench prompts"),
                           (b'{"category": "qa", "turns": ["' + b"word " * 2000 + b'"]}\n', "fits in"),
                           (b"\n", "holds no Spec-Bench question")):
        bad.write_bytes(content)
        result = CliRunner().invoke(app, ["bench", "--spec", "--quick", "--model", str(tiny_llama_path),
                                          "--threads", "1", "--prompts", str(bad)])
        assert result.exit_code == 1 and words in result.output and str(bad) in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_spec_bench_gives_retrieval_its_datastore_and_refuses_a_missing_one(tiny_llama_path: Path, prompts_file: Path,
                                                                           tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(load_spec_bench(prompts_file)))
    out = tmp_path / "spec.json"
    args = ["bench", "--spec", "--quick", "--model", str(tiny_llama_path), "--threads", "1", "--prompts",
            str(prompts_file), "--spec-methods", "retrieval,auto", "--json", str(out)]
    result = CliRunner().invoke(app, args + ["--spec-datastore", str(corpus)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["datastore"] == str(corpus)
    assert "| `retrieval` |" in result.output and "| `auto` |" in result.output     # the summary table
    missing = CliRunner().invoke(app, args + ["--spec-datastore", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no such file or directory" in missing.output
    assert len(missing.output.strip().splitlines()) == 1


def test_load_reads_sse_data_lines_however_the_network_splits_them() -> None:
    """`_sse_data`: a data line split over reads, several in one read, one longer than aiohttp's
    64 KiB line limit, comments and blank lines skipped, a last line without its newline."""
    import asyncio

    from loom.bench import load

    long_text = "x" * 100_000
    body = (f": a comment\n\ndata: {{\"a\": 1}}\r\n\ndata: {{\"t\": \"{long_text}\"}}\n\n"
            "data: [DONE]").encode()

    class Stream:
        def __init__(self, pieces):
            self.pieces = pieces

        async def iter_any(self):
            for piece in self.pieces:
                yield piece

    async def read(pieces):
        return [d async for d in load._sse_data(Stream(pieces))]

    want = [b'{"a": 1}', f'{{"t": "{long_text}"}}'.encode(), b"[DONE]"]
    assert asyncio.run(read([body])) == want
    assert asyncio.run(read([body[i:i + 7] for i in range(0, len(body), 7)])) == want
    assert asyncio.run(read([bytes([b]) for b in body[:40]] + [body[40:]])) == want


def test_report_files_are_written_whole_or_refused_in_one_line(tmp_path: Path) -> None:
    """A report is renamed into place (no half-written file); a failure is one BenchError line;
    --json and --markdown naming one file, or a file as a directory, are refused before the run."""
    from loom.bench.report import write_output

    target = tmp_path / "r.json"
    write_output(target, "{}\n")
    assert target.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(BenchError, match="cannot write /dev/full"):   # a device is written to, never replaced
        write_output(Path("/dev/full"), "x" * 10)
    assert Path("/dev/full").is_char_device()
    (tmp_path / "adir").mkdir()
    with pytest.raises(BenchError, match="cannot write"):
        write_output(tmp_path / "adir", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "r.json"]
    (tmp_path / "plain").write_text("")
    for args, words in ((["--json", str(tmp_path / "plain" / "x.json")], "cannot make its directory"),
                        (["--spec", "--json", str(target), "--markdown", str(target)], "name the same file")):
        result = CliRunner().invoke(app, ["bench", *args])
        assert result.exit_code == 1 and words in result.output, result.output


def test_peer_suite_options_the_run_would_not_read_are_refused() -> None:
    """--limit and --parallel-n without --parallel, --kv-cache-dtype without a loom peer: one
    line before anything runs (they passed unread)."""
    for args, words in ((["--limit", "3"], "--limit sets the parallel"),
                        (["--parallel-n", "2"], "--parallel-n sets the parallel"),
                        (["--kv-cache-dtype", "int8", "--peers", "llama.cpp"], "--kv-cache-dtype sets loom")):
        result = CliRunner().invoke(app, ["bench", *args])
        assert result.exit_code == 1 and words in result.output, result.output
