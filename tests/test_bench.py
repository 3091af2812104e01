"""`loom bench`: a --quick run of the loom peer on the tiny model yields every metric, a peer whose
package is missing is reported as skipped, and the helpers behave. No timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loom.bench import peers as bench_peers
from loom.bench.peers import PeerKind, parse_peers
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


def test_future_flags_are_refused_clearly() -> None:
    for args in (["--spec"], ["--server", "http://127.0.0.1:8000"]):
        result = CliRunner().invoke(app, ["bench", *args])
        assert result.exit_code == 1
        assert "not yet available" in result.output


def test_parse_peers() -> None:
    specs = parse_peers("loom, loom:float32,llama.cpp,loom")
    assert [s.label for s in specs] == ["loom", "loom:float32", "llama.cpp"]
    assert specs[1].options == {"dtype": "float32"} and specs[0].is_loom and not specs[2].is_loom
    for bad in ("vllm", "llama.cpp:fast", "transformers:bfloat16", ","):
        with pytest.raises(BenchError):
            parse_peers(bad)


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
