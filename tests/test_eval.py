"""`loom eval`: windows, perplexity, KL divergence against a computed or saved reference, and
the command line's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from loom.cli import app
from loom.errors import InvalidRequestError, LoomError
from loom.eval import Windows, evaluate, open_source
from loom.eval.report import summary
from loom.eval.sources import BaseSource, BaseWriter
from loom.model.runner import score

TEXT = " ".join(f"the cat number {i} sat on mat {i % 7} and looked at dog {i % 5}." for i in range(40))


def test_windows_score_every_token_once():
    ids = list(range(100, 150))                      # 50 text tokens
    w = Windows.build(ids, context=12, stride=5, bos=1)
    assert len(w) == 1 + (50 - 12) // 5
    scored = []
    for k, win in enumerate(w.windows):
        assert win.tokens[0] == 1 and win.tokens[1:] == tuple(ids[5 * k + 1:5 * k + 12])
        scored += list(win.targets)
    # window 0 scores text tokens 1 .. 11, each later window the 5 past its predecessor
    assert scored == ids[1:12 + 5 * (len(w) - 1)]
    assert w.num_scored == len(scored)
    assert len(Windows.build(ids, 12, 5, None, max_windows=2)) == 2


@pytest.mark.parametrize("kwargs, field", [(dict(context=1), "context"), (dict(context=12, stride=12), "stride"),
                                           (dict(context=12, stride=0), "stride"), (dict(context=60), "fewer than one window"),
                                           (dict(context=12, max_windows=0), "chunks")])
def test_windows_refuse_bad_options(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        Windows.build(list(range(50)), **kwargs)


@pytest.fixture(scope="module")
def exact_source(tiny_llama_path):
    # prefill chunks of 7 tokens: windows run in several chunks, as the engine runs a long prompt
    return open_source("loom", model=str(tiny_llama_path), dtype="float32", chunk=7)


@pytest.fixture(scope="module")
def windows(exact_source):
    ids = exact_source.tokenizer.encode(TEXT, add_special_tokens=False)
    return Windows.build(ids, context=24, stride=10, bos=exact_source.tokenizer.bos_token_id, max_windows=5)


def test_perplexity_matches_a_single_pass(exact_source, windows):
    res = evaluate(windows, exact_source)
    nll = []
    for w in windows.windows:
        lp = score(exact_source.model, w.tokens).log_softmax(dim=-1)        # row t predicts token t + 1
        t = torch.tensor(w.tokens[w.first + 1:])
        nll += (-lp[w.first:-1].gather(1, t[:, None])[:, 0]).tolist()
    assert len(res.nll) == windows.num_scored == len(nll)
    np.testing.assert_allclose(res.nll, nll, rtol=1e-5, atol=1e-5)
    s = summary(res)
    assert s["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-6) and s["ppl_stderr"] > 0
    assert "kld_mean" not in s


def test_kld_against_itself_is_zero_and_default_mode_is_close(exact_source, windows, tiny_llama_path):
    same = summary(evaluate(windows, exact_source, exact_source))
    assert same["kld_mean"] == 0.0 and same["same_top_pct"] == 100.0 and same["ppl_ratio"] == 1.0
    auto = open_source("loom", model=str(tiny_llama_path), dtype="auto")
    s = summary(evaluate(windows, auto, exact_source))
    assert 0.0 < s["kld_mean"] < 0.05 and s["same_top_pct"] > 80.0
    assert s["kld_quantiles"]["99"] >= s["kld_quantiles"]["50"] >= s["kld_min"]
    assert s["ref_ppl"] == pytest.approx(math.exp(np.mean(evaluate(windows, exact_source).nll)))


def test_saved_base_round_trip(exact_source, windows, tmp_path):
    base = tmp_path / "base"
    writer = BaseWriter(base, windows, exact_source.vocab_size, exact_source.label)
    first = evaluate(windows, exact_source, save=writer)
    writer.close()
    res = evaluate(windows, exact_source, BaseSource(base, windows))
    np.testing.assert_allclose(res.ref_nll, first.nll, rtol=1e-3, atol=1e-3)   # stored in 16-bit steps
    assert res.kld.mean() < 1e-6 and res.same_top.all()
    other = Windows.build(list(windows.windows[0].tokens) * 3, context=24, stride=10)
    with pytest.raises(LoomError, match="scored other tokens"):
        BaseSource(base, other)
    np.save(base / "logprobs.npy", np.zeros((3, 4), dtype=np.float16))
    with pytest.raises(LoomError, match="truncated"):
        BaseSource(base, windows)
    (base / "meta.json").unlink()
    with pytest.raises(LoomError, match="no complete base run"):
        BaseSource(base, windows)


def test_cli_eval_writes_table_json_and_plot(tiny_llama_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out_json, out_png = tmp_path / "eval.json", tmp_path / "kld.png"
    r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32", "--chunks", "3",
                                 "--kld", "--json", str(out_json), "--plot", str(out_png)])
    assert r.exit_code == 0, r.output
    assert "mean KLD" in r.output and "perplexity" in r.output
    s = json.loads(out_json.read_text())
    assert s["windows"] == 3 and s["tokens"] == 31 + 2 * 16 and s["kld_mean"] > 0
    assert out_png.stat().st_size > 1000


def test_cli_eval_with_a_quantized_kv_cache(tiny_llama_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out_json = tmp_path / "eval.json"
    r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32", "--chunks", "2",
                                 "--kv-cache-dtype", "int8", "--kld", "--json", str(out_json)])
    assert r.exit_code == 0, r.output
    assert "KV int8" in r.output
    assert 0 < json.loads(out_json.read_text())["kld_mean"] < 0.05
    for engine, kv, message in (("loom", "int3", "kv_cache_dtype must be one of auto, float32, float16, int8, int4"),
                                ("llama.cpp", "int8", "llama.cpp's KV cache type must be one of f16, q8_0, q4_0")):
        r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32",
                                     "--engine", engine, "--kv-cache-dtype", kv])
        assert r.exit_code == 1 and message in r.output, r.output


@pytest.mark.parametrize("content, message", [(None, "no such file"), ("", "is empty"),
                                              ("a few words", "fewer than one window")])
def test_cli_eval_errors_are_one_line(tiny_llama_path, tmp_path, content, message):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_text(content)
    r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(path)])
    assert r.exit_code == 1
    assert message in r.output and r.output.strip().count("\n") == 0


@pytest.mark.parametrize("args, message", [
    (["--json", "{tmp}/missing/eval.json"], "--json {tmp}/missing/eval.json: no such directory"),
    (["--json", "{tmp}"], "--json {tmp}: is a directory"),
    (["--kld", "--plot", "{tmp}/missing/kld.png"], "--plot {tmp}/missing/kld.png: no such directory"),
    (["--plot", "{tmp}/kld.png"], "--plot: a KLD histogram needs --kld or --base"),
    (["--kld", "--plot", "{tmp}/kld.txt"], "--plot {tmp}/kld.txt: an image file is written there"),
    (["--save-base", "{tmp}/text.txt"], "--save-base {tmp}/text.txt: is a file"),
    (["--save-base", "{tmp}/text.txt/sub"], "--save-base {tmp}/text.txt/sub: no such directory"),
    (["--context", "600"], "--context 600 is longer than the model's context length of 512 tokens"),
    (["--base", "{tmp}", "--save-base", "{tmp}/../{tmpname}"], "--base and --save-base name the same directory"),
    (["--engine", "llama.cpp", "--dtype", "float32"], "--dtype is loom's"),
])
def test_cli_eval_refuses_bad_outputs_and_context_before_the_model_loads(tiny_llama_path, tmp_path, monkeypatch,
                                                                          args, message):
    """Options that would fail only at the end of the run (or past the model's context) are one
    line before any model loads."""
    import loom.eval

    opened = []
    monkeypatch.setattr(loom.eval, "open_source", lambda *a, **k: opened.append(a))
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = [a.format(tmp=tmp_path, tmpname=tmp_path.name) for a in args]
    r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32", *args])
    assert r.exit_code == 1, r.output
    assert message.format(tmp=tmp_path) in r.output and r.output.strip().count("\n") == 0, r.output
    assert opened == [] and sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_cli_eval_output_that_fails_at_the_end_is_one_line(tiny_llama_path, tmp_path):
    """A JSON file the checks before the run cannot see fail (a full device) is one line after
    the figures, not a traceback."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32",
                                 "--json", "/dev/full"])
    assert r.exit_code == 1 and "perplexity" in r.output.lower(), r.output
    assert r.output.strip().splitlines()[-1].startswith("error: --json /dev/full: cannot write it: "), r.output


def test_an_interrupted_save_leaves_the_base_in_its_directory(exact_source, windows, tmp_path):
    base = tmp_path / "base"
    writer = BaseWriter(base, windows, exact_source.vocab_size, exact_source.label)
    evaluate(windows, exact_source, save=writer)
    writer.close()
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    again = BaseWriter(base, windows, exact_source.vocab_size, "another run")
    again.add(torch.zeros(3, exact_source.vocab_size))
    again.abort()                                      # as the CLI does on Ctrl-C or an error
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    BaseSource(base, windows)


def test_cli_eval_ctrl_c_is_one_line_and_status_130(tiny_llama_path, tmp_path, monkeypatch):
    import loom.eval

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def wrapped(*args, **kwargs):   # as Python reports Ctrl-C during a class's creation at import
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'window' in '_Seq'") from e

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    for stop in (interrupted, wrapped):
        monkeypatch.setattr(loom.eval, "evaluate", stop)
        r = CliRunner().invoke(app, ["eval", str(tiny_llama_path), "--file", str(text), "--context", "32"])
        assert r.exit_code == 130 and r.output.strip() == "interrupted"


# -- lm-eval against `loom serve` -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.real_model
def test_lm_eval_runs_a_loglikelihood_and_a_generation_task(real, tmp_path):
    """lm-eval's local-completions model, tokenizing through the server's /tokenize: a
    multiple-choice task (prompt logprobs through echo) and a generate_until task, both from
    local files built from ../shared/data."""
    import subprocess
    import sys

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "benchmarks" / "lm_eval" / "make_tasks.py"), str(tmp_path), "--docs", "3"],
                   check=True)
    out = simple_evaluate(
        model="local-completions",
        model_args=f"model=smollm2-135m,base_url={real.url}/v1/completions,tokenizer_backend=remote,"
                   "num_concurrent=2,max_retries=1",
        tasks=["loom_shakespeare_cloze", "loom_gsm8k_cot"], task_manager=TaskManager(include_path=str(tmp_path)),
        limit=3, log_samples=True)
    res = out["results"]
    assert 0.0 <= res["loom_shakespeare_cloze"]["acc,none"] <= 1.0
    assert 0.0 <= res["loom_gsm8k_cot"]["exact_match,strict-match"] <= 1.0
    cloze = out["samples"]["loom_shakespeare_cloze"]
    assert len(cloze) == 3
    for sample in cloze:   # four choices, each a finite log-likelihood of its continuation
        lls = [r[0][0] for r in sample["resps"]]
        assert len(lls) == 4 and all(math.isfinite(x) and x < 0 for x in lls)
    gens = [s["resps"][0][0] for s in out["samples"]["loom_gsm8k_cot"]]
    assert len(gens) == 3 and all(isinstance(g, str) for g in gens) and any(gens)   # "" when it stops at once
