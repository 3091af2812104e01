"""Prompt logprobs: offline (`SamplingParams.prompt_logprobs`) and through `/v1/completions` echo."""

from __future__ import annotations

from conftest import run_to_end

import httpx
import pytest
import torch

from loom import SamplingParams
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.errors import InvalidRequestError
from loom.model.runner import score


finish = run_to_end   # engine, prompts, params -> final outputs in prompt order


@pytest.fixture(scope="module")
def exact_engine(tiny_llama_path):
    """float32 (exact) engine whose prompts run in chunks of 8 tokens over 4-token blocks."""
    return Engine(EngineConfig.create(str(tiny_llama_path), dtype="float32", block_size=4,
                                      max_num_batched_tokens=8, max_num_seqs=8))


PROMPT = "the cat sat on the mat and looked at the dog on the rug"


def test_prompt_logprobs_match_a_full_pass_across_chunks(exact_engine):
    out = finish(exact_engine, [PROMPT], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)])[0]
    ids = out.prompt_token_ids
    assert len(ids) > 8 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    ref = score(exact_engine.model, ids).log_softmax(dim=-1)          # row t predicts token t + 1
    for t in range(1, len(ids)):
        entry = out.prompt_logprobs[t]
        assert entry[ids[t]].logprob == pytest.approx(float(ref[t - 1, ids[t]]), abs=1e-5)
        assert entry[ids[t]].rank == int((ref[t - 1] > ref[t - 1, ids[t]]).sum()) + 1
        top = [tid for tid, lp in entry.items() if lp.rank is not None and lp.rank <= 3]
        assert sorted(top) == sorted(torch.topk(ref[t - 1], 3).indices.tolist())


def test_a_cached_prefix_is_recomputed_and_a_batch_changes_nothing(exact_engine):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    cold = finish(exact_engine, [PROMPT], [params])[0]
    warm, other = finish(exact_engine, [PROMPT, "a different prompt entirely"], [params, SamplingParams(max_tokens=4)])
    assert warm.num_cached_tokens == 0   # never served from the prefix cache: its logits are needed
    for a, b in zip(cold.prompt_logprobs[1:], warm.prompt_logprobs[1:]):
        assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}
    assert other.prompt_logprobs is None


def test_bad_prompt_logprobs_are_refused():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=-1)


def _entries(out) -> list:
    return [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs]


@pytest.mark.parametrize("fan_out", [{"n": 3}, {"n": 2, "best_of": 3}])
def test_n_choices_share_the_prompt_s_logprobs(exact_engine, fan_out):
    """As vLLM: the prompt is scored once (by the group's shared prefill) and every output of
    the request carries it."""
    one = finish(exact_engine, [PROMPT], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)])[0]
    out = finish(exact_engine, [PROMPT], [SamplingParams(max_tokens=3, temperature=0.8, seed=1, prompt_logprobs=2,
                                                         **fan_out)])[0]
    assert len(out.outputs) == fan_out["n"] and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    got, want = _entries(out), _entries(one)
    assert got[0] is None and [d.keys() for d in got[1:]] == [d.keys() for d in want[1:]]
    for a, b in zip(got[1:], want[1:]):     # float32 torch: the prefill's chunks differ (the parent stops at P - 1)
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt(tiny) -> None:
    """The request lm-eval's loglikelihood tasks send: echo, logprobs 1, max_tokens 0."""
    r = httpx.post(f"{tiny.url}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
                         "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(choice["prompt_logprobs"])
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]).endswith(PROMPT.split()[-1])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    firsts = [None] + [max(d.values(), key=lambda v: v["logprob"]) for d in choice["prompt_logprobs"][1:]]
    assert all(f["rank"] == 1 for f in firsts[1:])
    bad = httpx.post(f"{tiny.url}/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    two = httpx.post(f"{tiny.url}/v1/completions", timeout=30,
                     json={"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 2, "max_tokens": 2})
    assert two.status_code == 200, two.text
    echoed = [c["logprobs"]["token_logprobs"][:len(lp["tokens"])] for c in two.json()["choices"]]
    assert len(echoed) == 2 and echoed[0] == echoed[1] == lp["token_logprobs"]


def test_slice_logprobs_on_the_kernels_match_torch():
    """The per-slice logprobs, ranks and top-k the runner takes from its sampler: loom's kernels
    against torch's log-softmax."""
    from loom import kernels
    from loom.sample.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 777, generator=g) * 4
    logits[2, 40] = logits[2, 41] = 30.0   # a tie at the top
    target = torch.tensor([0, 5, 41, 776, 100, 3])
    module = kernels.load()
    assert module is not None, kernels.unavailable_reason()
    native = Sampler(0, kernels=module).token_logprobs(logits, target, 4, ranks=True)
    plain = Sampler(0).token_logprobs(logits, target, 4, ranks=True)
    torch.testing.assert_close(native[0], plain[0])
    assert native[1] == plain[1] and native[1][2] == 1
    assert torch.equal(native[2][[0, 1, 3, 4, 5]], plain[2][[0, 1, 3, 4, 5]]) and native[2][2, :2].tolist() == [40, 41]
    torch.testing.assert_close(native[3], plain[3])
