"""`loom bench --server ... --peers`: naming the server peers, their command lines, starting and
stopping a server process group, the interleaved comparison and its summary; and one real run
that starts `loom serve` on the tiny model. No timing thresholds."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from loom.bench.load import LoadSettings
from loom.bench import server_compare
from loom.bench.server_compare import (markdown, run_comparison, seq_tokens, summarize, table, targets,
                                      write_plots)
from loom.bench.server_peers import (LocalServer, Launch, ServeJob, ServerKind, free_port, llama_server_launch,
                                     parse_server_peers, vllm_launch)
from loom.bench.settings import BenchError
from loom.cli import app

# A stand-in server: answers /health with 200 after an optional delay and starts one child
# process (as vLLM's engine core), so stopping must take the whole group.
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _job(tmp_path: Path) -> ServeJob:
    return ServeJob(gguf=tmp_path / "m.gguf", threads=2, slots=32, seq_tokens=768, port=8123)


def test_parse_server_peers_keeps_order_and_rejects_unknown_names() -> None:
    assert [k.name for k in parse_server_peers("vllm, llama-server,vllm")] == ["vllm", "llama-server"]
    with pytest.raises(BenchError, match="unknown server peer 'tgi'"):
        parse_server_peers("loom,tgi")
    with pytest.raises(BenchError, match="names no server"):
        parse_server_peers(" , ")


def test_targets_put_the_url_first_as_loom() -> None:
    cols = targets("http://h:1", "llama-server,vllm")
    assert [(t.label, t.url, t.kind.name if t.kind else None) for t in cols] == [
        ("loom", "http://h:1", None), ("llama-server", None, "llama-server"), ("vllm", None, "vllm")]
    assert [t.label for t in targets("start", "loom,vllm")] == ["loom", "vllm"]
    with pytest.raises(BenchError, match="needs --peers"):
        targets("start", None)
    with pytest.raises(BenchError, match="leave loom out of --peers"):
        targets("http://h:1", "loom,vllm")


def test_llama_server_command_has_one_slot_per_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = _executable(tmp_path / "llama-server")
    monkeypatch.setenv("LOOM_LLAMA_SERVER", str(binary))
    launch = llama_server_launch(_job(tmp_path))
    argv = launch.argv
    assert argv[0] == str(binary) and argv[argv.index("-m") + 1] == str(tmp_path / "m.gguf")
    assert argv[argv.index("-np") + 1] == "32" and argv[argv.index("-c") + 1] == str(32 * 768)
    assert argv[argv.index("-t") + 1] == "2" == argv[argv.index("-tb") + 1]
    assert argv[argv.index("--port") + 1] == "8123"


def test_missing_peer_executables_are_reported_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("LOOM_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LOOM_VLLM_PYTHON", raising=False)
    with pytest.raises(BenchError, match=r"llama-server not found .*build_peers.sh llama-server"):
        llama_server_launch(_job(tmp_path))
    with pytest.raises(BenchError, match=r"vllm's Python not found .*build_peers.sh vllm"):
        vllm_launch(_job(tmp_path), export=lambda gguf: gguf.parent)
    (tmp_path / "not-exec").write_text("")
    monkeypatch.setenv("LOOM_LLAMA_SERVER", str(tmp_path / "not-exec"))
    with pytest.raises(BenchError, match="is not an executable file"):
        llama_server_launch(_job(tmp_path))


def test_vllm_command_serves_the_exported_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = _executable(tmp_path / "python")
    monkeypatch.setenv("LOOM_VLLM_PYTHON", str(python))
    exported = []
    launch = vllm_launch(_job(tmp_path), export=lambda gguf: exported.append(gguf) or tmp_path / "hf")
    argv = launch.argv
    assert exported == [tmp_path / "m.gguf"]
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(tmp_path / "hf")
    assert "--enforce-eager" in argv and argv[argv.index("--max-num-seqs") + 1] == "32"
    assert argv[argv.index("--max-model-len") + 1] == "768"
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_seq_tokens_cover_prompt_and_output() -> None:
    settings = LoadSettings(url="http://h", prompt_chars=1000, max_tokens=64)
    assert seq_tokens(settings) == 768 and seq_tokens(settings) >= 500 + 64


def _children(out_text: str) -> list[int]:
    return [int(line.split()[1]) for line in out_text.splitlines() if line.startswith("child ")]


def test_local_server_waits_for_health_and_stops_the_whole_group(fake_server: Path) -> None:
    port = free_port()
    server = LocalServer("fake", Launch([sys.executable, str(fake_server), str(port), "0.3"], {}),
                         f"http://127.0.0.1:{port}")
    with server:
        assert server.start_seconds is not None and server.start_seconds > 0
        pid = server.proc.pid
        server._log.seek(0)
        child = _children(server._log.read().decode())[0]
        assert psutil.pid_exists(child)
    assert server.proc.poll() is not None and not psutil.pid_exists(pid)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_local_server_that_exits_fails_with_its_output() -> None:
    port = free_port()
    launch = Launch([sys.executable, "-c", "import sys; print('bad flag --xyz'); sys.exit(3)"], {})
    with pytest.raises(BenchError, match=r"fake exited with status 3 before it was ready: bad flag --xyz"):
        with LocalServer("fake", launch, f"http://127.0.0.1:{port}"):
            pass


def _level(label: str, tok_s: float, ttft: float, itl: float) -> dict:
    return {"label": label, "output_tok_s": tok_s, "ttft_ms": {"p50": ttft, "p99": ttft},
            "itl_ms": {"p50": itl, "p99": itl}, "errors": 0, "rejected_429": 0}


def test_comparison_interleaves_rounds_and_takes_median_ratios(fake_server: Path, tiny_gemma3_path: Path,
                                                                tmp_path: Path) -> None:
    def fake_launch(job: ServeJob) -> Launch:
        return Launch([sys.executable, str(fake_server), str(job.port), "0"], {})

    peer = ServerKind("peer", fake_launch, "a stand-in")
    from loom.bench.server_compare import Target

    columns = [Target("loom", url="http://loom.invalid"), Target("peer", kind=peer)]
    calls, endpoints = [], set()
    # loom: 100 then 300 tok/s; peer: 50 then 100 -> per-round ratios 2 and 3, median 2.5
    speeds = {("loom", 0): 100.0, ("peer", 0): 50.0, ("loom", 1): 300.0, ("peer", 1): 100.0}

    def fake_load(settings: LoadSettings, cpu=None) -> dict:
        label = "loom" if settings.url == "http://loom.invalid" else "peer"
        assert (cpu is None) == (label == "loom")   # the started server's CPU meter; none for a URL
        rnd = sum(1 for c in calls if c[0] == label and c[1] == settings.num_requests)
        calls.append((label, settings.num_requests))
        endpoints.add(settings.endpoint)
        tok = speeds[(label, rnd)] * settings.num_requests
        level = _level("max", tok, 1000.0 / tok, 10.0)
        if cpu is not None:
            assert cpu() >= 0.0   # the fake server and its child, alive
            level["server_cpu_percent"] = 150.0 + 10 * rnd
        return {"settings": {"num_requests": settings.num_requests}, "levels": [level]}

    plans = [LoadSettings(url="x", rates=(float("inf"),), num_requests=n) for n in (8, 32)]
    partial = []
    report = run_comparison(columns, plans, tiny_gemma3_path, threads=2, rounds=2, load=fake_load,
                            log=lambda m: None, on_run=lambda rep: partial.append(len(rep["runs"])))
    assert partial == [1, 2, 3, 4]
    # --endpoint auto, decided once from the GGUF (no chat template): every server gets completions
    assert endpoints == {"completions"} and report["endpoint"] == "completions"
    assert calls == [("loom", 8), ("loom", 32), ("peer", 8), ("peer", 32)] * 2
    assert report["slots"] == 32 and [r["label"] for r in report["runs"]] == ["loom", "peer", "loom", "peer"]
    assert all(r["start_seconds"] is not None for r in report["runs"] if r["label"] == "peer")
    rows = report["summary"]
    assert [(r["requests"], r["rate"]) for r in rows] == [(8, "max"), (32, "max")]
    assert rows[0]["values"]["loom"]["output_tok_s"] == pytest.approx(1600.0)   # median of 800, 2400
    assert rows[0]["ratios"]["peer"]["output_tok_s"] == pytest.approx(2.5)
    assert rows[0]["ratios"]["peer"]["ttft_p50_ms"] == pytest.approx(2.5)      # peer/loom: lower is better
    assert rows[0]["ratios"]["peer"]["itl_p50_ms"] == pytest.approx(1.0)
    assert rows[0]["values"]["peer"]["cpu_percent"] == pytest.approx(155.0) and rows[0]["values"]["loom"]["cpu_percent"] is None
    header, cells = table(report)
    assert [c[:3] for c in cells] == [["8", "max", "loom"], ["8", "max", "peer"], ["32", "max", "loom"],
                                      ["32", "max", "peer"]]
    assert cells[1][header.index("loom vs it: tok/s")] == "2.50×" and cells[0][header.index("loom vs it: tok/s")] == ""
    assert cells[1][header.index("CPU %")] == "155" and cells[0][header.index("CPU %")] == "—"
    assert "| 8 | max | peer |" in markdown(report) and "streaming POST /v1/completions" in markdown(report)
    [chart] = write_plots(report, tmp_path / "plots")
    assert chart.name == "server_compare.png" and chart.stat().st_size > 0
    saved = tmp_path / "compare.json"
    saved.write_text(json.dumps(report))
    server_compare.main([str(saved), "--plot", str(tmp_path / "again")])    # a saved report, charted later
    assert (tmp_path / "again" / "server_compare.png").is_file()


def test_summary_without_loom_has_no_ratios() -> None:
    runs = [{"round": 0, "label": "vllm", "loads": [{"settings": {"num_requests": 4},
                                                      "levels": [_level("max", 10.0, 5.0, 1.0)]}]}]
    rows = summarize(runs, ["vllm"])
    assert rows[0]["ratios"] == {} and rows[0]["values"]["vllm"]["output_tok_s"] == 10.0


@pytest.mark.parametrize("model, endpoint", [("tiny_llama_path", "chat"), ("tiny_gemma3_path", "completions")])
def test_bench_starts_loom_serve_and_loads_it(model: str, endpoint: str, tmp_path: Path,
                                              request: pytest.FixtureRequest) -> None:
    """The tiny llama has a chat template, the tiny gemma3 none: --endpoint auto sends it completions."""
    gguf = request.getfixturevalue(model)
    rows = [{"question_id": i, "category": "qa", "turns": [f"Question {i}: why is the sky blue?"]} for i in range(6)]
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report_path = tmp_path / "compare.json"
    result = CliRunner().invoke(app, ["bench", "--server", "start", "--peers", "loom,engine", "--model", str(gguf),
                                      "--threads", "1", "--rates", "max", "--num-requests", "2,3", "--max-tokens", "4",
                                      "--prompts", str(prompts), "--json", str(report_path),
                                      "--plot", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "server_compare.png").stat().st_size > 0
    report = json.loads(report_path.read_text())
    assert [r["label"] for r in report["runs"]] == ["loom", "engine"] and report["slots"] == 3
    assert report["endpoint"] == endpoint and f"{endpoint} endpoint" in result.output
    run, engine = report["runs"]
    assert run["start_seconds"] > 0 and run["command"][1:4] == ["-m", "loom", "serve"]
    for load, alone, count in zip(run["loads"], engine["loads"], (2, 3)):
        assert load["endpoint"] == alone["endpoint"] == endpoint and alone["server"] == "engine"
        level, level_alone = load["levels"][0], alone["levels"][0]
        assert level["requests"] == count == level["ok"], level["error_samples"]
        assert level_alone["requests"] == count == level_alone["ok"] and level_alone["ttft_ms"] is not None
        # the server's CPU is read in clock ticks (10 ms), which a load of a few tiny steps may not reach;
        # the engine column reads its own process's CPU clock
        assert level["server_cpu_percent"] >= 0 and level_alone["server_cpu_percent"] > 0
        # greedy, 4 tokens each (or fewer at EOS): the same requests make the same tokens
        assert level_alone["output_tokens"] == level["output_tokens"]
    assert [(r["requests"], r["rate"]) for r in report["summary"]] == [(2, "max"), (3, "max")]
    assert all(r["ratios"]["engine"]["output_tok_s"] > 0 for r in report["summary"])   # the server's share
    assert "output tok/s" in result.output


def test_hf_export_writes_a_loadable_unquantized_model_once(tiny_llama_path: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig

    from loom.bench import hf_export

    out = hf_export.export_hf(tiny_llama_path, tmp_path / "hf", log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert AutoConfig.from_pretrained(out).model_type == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]          # no staging directory left
    monkeypatch.setattr(hf_export, "shutil", None)                 # a second export would need it
    assert hf_export.export_hf(tiny_llama_path, tmp_path / "hf", log=lambda m: None) == out


def test_hf_export_of_a_model_without_a_chat_template(tiny_gemma3_path: Path, tmp_path: Path) -> None:
    """vLLM's Gemma 3 weights come from the same export: a text-only Gemma3ForCausalLM with the GGUF's
    sliding-window layout, no chat template, and a tokenizer that gives vLLM loom's prompt tokens."""
    from transformers import AutoTokenizer

    from loom.bench import hf_export
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer

    out = hf_export.export_hf(tiny_gemma3_path, tmp_path / "hf", log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    gguf = GGUFFile.open(tiny_gemma3_path)
    assert config["num_hidden_layers"] == 6 and config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == gguf.get("gemma3.attention.sliding_window")
    assert not (out / "chat_template.jinja").exists()
    text = "Question 3: explain why the sky looks blue at noon."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == Tokenizer.from_gguf(gguf).encode(text)


class _FakeEngine:
    """Engine.add_request / step / has_unfinished_requests: each request makes one token per step
    and finishes after `tokens`; steps are counted."""

    def __init__(self, tokens: int):
        self.tokens, self.live, self.steps, self.peak, self.prompts = tokens, {}, 0, 0, []

    def add_request(self, prompt, params) -> str:
        rid = f"r{len(self.prompts)}"
        self.prompts.append(prompt)
        self.live[rid] = 0
        self.peak = max(self.peak, len(self.live))
        return rid

    def step(self) -> list:
        from types import SimpleNamespace as NS

        self.steps += 1
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == self.tokens
            outs.append(NS(request_id=rid, finished=done,
                           outputs=[NS(delta_token_ids=[7], token_ids=[7] * self.live[rid])]))
            if done:
                del self.live[rid]
        return outs


def test_engine_column_sends_at_the_offsets_under_the_concurrency_limit() -> None:
    from loom.bench.engine_load import EngineLoad

    engine = _FakeEngine(tokens=3)
    settings = LoadSettings(url="engine", rates=(float("inf"),), num_requests=5, max_tokens=3, endpoint="completions",
                            max_concurrency=2)
    records = EngineLoad(engine, settings).run([f"p{i}" for i in range(5)], [0.0, 0.0, 0.0, 0.0, 0.05])
    assert engine.prompts == [f"p{i}" for i in range(5)] and engine.peak == 2
    assert all(r.ok and r.output_tokens == 3 and len(r.chunk_times) == 3 for r in records)
    assert records[-1].sent >= 0.05                                # not before its offset
    ends = sorted(r.end for r in records)
    assert all(any(e <= r.sent for e in ends) for r in records[2:])   # sent once a slot was free
    assert all(r.first_token == r.chunk_times[0] <= r.end for r in records)


def test_engine_column_is_a_peer_the_comparison_runs_without_a_server(tiny_gemma3_path: Path) -> None:
    from loom.bench.server_compare import Target

    [kind] = parse_server_peers("engine")
    assert kind.launch is None
    columns = [Target("loom", url="http://loom.invalid"), Target("engine", kind=kind)]
    seen = []

    def fake_load(settings: LoadSettings, cpu=None) -> dict:
        return {"settings": {"num_requests": settings.num_requests}, "levels": [_level("max", 90.0, 10.0, 5.0)]}

    def fake_engine(plans, gguf, threads) -> list[dict]:
        seen.append(([p.endpoint for p in plans], gguf, threads))
        return [{"settings": {"num_requests": p.num_requests}, "levels": [_level("max", 100.0, 8.0, 4.0)]}
                for p in plans]

    plans = [LoadSettings(url="x", rates=(float("inf"),), num_requests=n) for n in (8, 32)]
    report = run_comparison(columns, plans, tiny_gemma3_path, threads=2, load=fake_load, log=lambda m: None,
                            engine_load=fake_engine)
    assert seen == [(["completions", "completions"], tiny_gemma3_path, 2)]
    assert [r["start_seconds"] for r in report["runs"]] == [None, None]
    assert report["summary"][0]["ratios"]["engine"]["output_tok_s"] == pytest.approx(0.9)   # the server's share


def test_a_peer_not_built_is_found_before_any_server_runs(tiny_gemma3_path: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every started peer's executable is resolved before the first run: a missing one is one
    line at once, not after the other servers' whole loads."""
    from loom.bench.load import LoadSettings
    from loom.bench.server_compare import run_comparison, targets

    monkeypatch.setenv("LOOM_LLAMA_SERVER", str(tmp_path / "not-there"))
    ran = []
    plans = [LoadSettings(url="http://x", num_requests=1, endpoint="completions")]
    with pytest.raises(BenchError, match="LOOM_LLAMA_SERVER"):
        run_comparison(targets("start", "loom,llama-server"), plans, tiny_gemma3_path, threads=1,
                       load=lambda *a, **k: ran.append(a), log=lambda m: None)
    assert ran == []
