"""SamplingParams validation and the batched sampler's semantics (pure CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from loom import kernels
from loom.errors import InvalidRequestError
from loom.sample import (
    Sampler,
    SamplingBatch,
    apply_allowed,
    apply_banned,
    apply_logit_bias,
    apply_penalties,
    apply_top_k_top_p,
    request_generator,
)
from loom.sampling_params import SamplingParams, SamplingType

V = 1000


def random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# Every sampler test runs on both implementations of step 5 and the draw: torch's ops and the
# compiled kernels' sample_rows (loom_kernels_sample.h), which the engine uses where they run.
BACKEND = {"kernels": None}


@pytest.fixture(autouse=True, params=["torch", "kernels"])
def backend(request):
    if request.param == "kernels":
        module = kernels.load()
        assert module is not None, f"loom's kernels did not load: {kernels.unavailable_reason()}"
        BACKEND["kernels"] = module
    yield request.param
    BACKEND["kernels"] = None


def make_sampler(seed: int | None = 0) -> Sampler:
    return Sampler(seed, kernels=BACKEND["kernels"])


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **build_args):
    """Sample a copy of `logits` (the sampler may modify its input)."""
    batch = SamplingBatch.build(params, **build_args)
    return make_sampler(seed)(logits.clone(), batch)


# ---------------------------------------------------------------- SamplingParams

BAD_PARAMS = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("best_of", {"n": 3, "best_of": 2}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": "7"}),
    ("seed", {"seed": 2**64}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop_token_ids", {"stop_token_ids": [1, "2"]}),
    ("stop_token_ids", {"stop_token_ids": [1, 2.0]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"max_tokens": 10, "min_tokens": 11}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {5: "up"}}),
    ("logit_bias", {"logit_bias": {5: 100.5}}),
    ("logit_bias", {"logit_bias": {5: float("nan")}}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [1, -2]}),
    ("allowed_token_ids", {"allowed_token_ids": 7}),
    ("bad_words", {"bad_words": "word"}),
    ("bad_words", {"bad_words": ["ok", " "]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[1, 2], []]}),
]


@pytest.mark.parametrize("name,kwargs", BAD_PARAMS, ids=[f"{n}={kw[n]!r}" for n, kw in BAD_PARAMS])
def test_invalid_params_name_field_and_value(name, kwargs):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{name} must be ")
    assert repr(kwargs[name]) in message


def test_token_controls_are_normalised():
    sp = SamplingParams(logit_bias={7: 1, 3: -2.5}, allowed_token_ids=[9, 2, 9], bad_words=["a b"],
                        bad_words_token_ids=[[4, 5]])
    assert sp.logit_bias == {7: 1.0, 3: -2.5} and sp.allowed_token_ids == (2, 9)
    assert sp.bad_words == ("a b",) and sp.bad_words_token_ids == ((4, 5),) and sp.restricts_tokens
    assert not SamplingParams(logit_bias={}).restricts_tokens


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1).temperature == 1.0
    assert SamplingParams(top_k=-1, max_tokens=None, min_tokens=5).max_tokens is None


def test_clone_copies_and_revalidates():
    p = SamplingParams(temperature=0.5, stop=["x"], seed=4)
    q = p.clone()
    assert q == p and q is not p
    q.temperature = 0.9
    assert p.temperature == 0.5
    assert p.clone(max_tokens=3).max_tokens == 3
    with pytest.raises(InvalidRequestError, match="temperature"):
        p.clone(temperature=-1.0)


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax():
    logits = random_logits(16)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.token_ids, logits.argmax(dim=1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_p=0.9) for i in range(8)]
    out = sample(logits, params)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(dim=1))


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(3, 10)
    logits[0, [7, 3, 5]] = 2.0
    logits[2, [9, 4]] = -0.5
    logits[2, :4] = -1.0
    logits[2, 5:9] = -1.0
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.token_ids.tolist() == [3, 0, 4]


@pytest.mark.parametrize("vocab", [100, 4096, 49152, 50001, 262144])
@pytest.mark.parametrize("rows", [1, 5])
def test_chunked_argmax_equals_torch_argmax_ties_included(vocab, rows):
    from loom.sample.sampler import argmax_rows

    gen = torch.Generator().manual_seed(vocab + rows)
    cases = [torch.randn(rows, vocab, generator=gen),
             torch.randint(-3, 4, (rows, vocab), generator=gen).float()]   # many ties, across chunks
    last = torch.zeros(rows, vocab)
    last[:, -1] = 1.0                      # the max in the last id (a partial last chunk where vocab % 1024)
    both_ends = torch.zeros(rows, vocab)
    both_ends[:, [0, -1]] = 1.0            # a tie between the first and the last chunk
    for logits in cases + [last, both_ends]:
        got = argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=1))


def test_top_k_one_is_greedy():
    logits = random_logits(64, scale=1.0)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(dim=1))


# ---------------------------------------------------------------- filtering

DRAWS = 2000


def allowed_top_k(row: torch.Tensor, k: int) -> set[int]:
    return set(row.topk(k).indices.tolist())


def allowed_top_p(row: torch.Tensor, temperature: float, p: float) -> set[int]:
    """The nucleus: most probable first, a token is kept while the mass before it is < p."""
    probs, order = (row / temperature).softmax(dim=0).double().sort(descending=True)
    before = probs.cumsum(dim=0) - probs
    return set(order[before < p].tolist())


def allowed_min_p(row: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    probs = (row / temperature).softmax(dim=0)
    return set((probs >= min_p * probs.max()).nonzero().squeeze(1).tolist())


def draw_many(row: torch.Tensor, params: SamplingParams, seed: int = 1) -> set[int]:
    out = sample(row.expand(DRAWS, -1).contiguous(), [params] * DRAWS, seed=seed)
    return set(out.token_ids.tolist())


def test_top_k_stays_in_top_k():
    row = random_logits(1, scale=1.0)[0]
    drawn = draw_many(row, SamplingParams(temperature=1.0, top_k=20))
    assert drawn <= allowed_top_k(row, 20)
    assert len(drawn) > 10


def test_top_p_stays_in_nucleus():
    row = random_logits(1, seed=2)[0]
    allowed = allowed_top_p(row, 0.8, 0.7)
    drawn = draw_many(row, SamplingParams(temperature=0.8, top_p=0.7))
    assert drawn <= allowed
    assert len(drawn) > 1 and len(allowed) < V // 2


def test_min_p_stays_above_threshold():
    row = random_logits(1, seed=3)[0]
    allowed = allowed_min_p(row, 1.2, 0.05)
    drawn = draw_many(row, SamplingParams(temperature=1.2, min_p=0.05))
    assert drawn <= allowed
    assert len(drawn) > 1 and len(allowed) < V // 2


def test_top_k_top_p_min_p_combined():
    row = random_logits(1, seed=4, scale=1.5)[0]
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02)
    top_k = allowed_top_k(row, 50)
    # top-p acts on the distribution top-k left; min-p is relative to the best token.
    masked = torch.full_like(row, float("-inf"))
    masked[list(top_k)] = row[list(top_k)]
    allowed = top_k & allowed_top_p(masked, 0.9, 0.8) & allowed_min_p(row, 0.9, 0.02)
    drawn = draw_many(row, params)
    assert drawn <= allowed
    assert len(drawn) > 1


def test_min_p_comes_before_top_p():
    # vLLM v1's order: min-p drops 0.1 (< 0.3 x 0.4), top-p 0.75 then takes the nucleus of what
    # is left, [0.4, 0.3, 0.2] / 0.9: 0.444 + 0.333 reaches it, so 0.2 goes too
    row = torch.full((1, 64), -float("inf"))
    row[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = [SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)]
    want = torch.tensor([4 / 7, 3 / 7, 0.0, 0.0])
    for got in (torch_distribution(row, params), native_distribution(row, params)):
        assert torch.allclose(got[0, :4], want, atol=1e-6)
        assert not got[0, 4:].any()


def test_filters_apply_per_row():
    logits = random_logits(4, seed=5)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3),
              SamplingParams()]
    allowed = [allowed_top_k(logits[0], 3), allowed_top_p(logits[1], 1.0, 0.5),
               allowed_min_p(logits[2], 1.0, 0.3)]
    copies = 300
    out = sample(logits.repeat(copies, 1), params * copies, seed=7)
    drawn = [set(out.token_ids[i::4].tolist()) for i in range(4)]
    for i in range(3):
        assert drawn[i] <= allowed[i]
    assert not drawn[3] <= allowed_top_p(logits[3], 1.0, 0.5)  # the unfiltered row roams


# ---------------------------------------------------------------- distribution

# 99.9th percentile of the chi-square distribution with 7 degrees of freedom.
CHI2_7_999 = 24.32


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_temperature_frequencies_match_softmax(temperature):
    draws = 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 1.5, 0.2])
    out = sample(row.expand(draws, -1).contiguous(), [SamplingParams(temperature=temperature)] * draws,
                 seed=11)
    observed = torch.bincount(out.token_ids, minlength=8).double()
    expected = (row.double() / temperature).softmax(dim=0) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_7_999


def test_shared_seed_reproduces():
    logits = random_logits(32)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 32
    assert torch.equal(sample(logits, params, seed=5).token_ids, sample(logits, params, seed=5).token_ids)


# ---------------------------------------------------------------- seeded requests

SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
          SamplingParams(temperature=1.1, top_k=40, seed=1234),
          SamplingParams(temperature=0.8, min_p=0.05, seed=99),
          SamplingParams(seed=0, frequency_penalty=0.5)]


@pytest.mark.parametrize("seeded", SEEDED, ids=["top_p", "top_k", "min_p", "penalty"])
def test_seeded_row_is_independent_of_the_batch(seeded):
    steps, others = 20, 7
    logits = random_logits(steps, scale=1.0, seed=9)

    alone_gen = request_generator(seeded)
    alone_sampler = make_sampler(0)
    alone_batch = SamplingBatch.build([seeded], [alone_gen], prompt_ids=[[1, 2, 3]], output_ids=[[4, 5, 4]])
    alone = [int(alone_sampler(logits[s:s + 1].clone(), alone_batch).token_ids[0]) for s in range(steps)]

    pick = torch.Generator().manual_seed(99)
    other_params = [SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.0),
                    SamplingParams(min_p=0.1, seed=7), SamplingParams(top_p=0.5),
                    SamplingParams(temperature=0.7, presence_penalty=1.0, repetition_penalty=1.2),
                    SamplingParams(logprobs=3), SamplingParams(temperature=2.0, seed=5, top_k=100)]
    other_gens = [request_generator(p) for p in other_params]
    in_batch_gen = request_generator(seeded)
    batch_sampler = make_sampler(123)
    in_batch = []
    for s in range(steps):
        index = int(torch.randint(0, others + 1, (1,), generator=pick))
        params = other_params[:index] + [seeded] + other_params[index:]
        gens = other_gens[:index] + [in_batch_gen] + other_gens[index:]
        rows = random_logits(others + 1, scale=1.0, seed=100 + s)
        rows[index] = logits[s]
        batch = SamplingBatch.build(params, gens, prompt_ids=[[1, 2, 3]] * (others + 1),
                                    output_ids=[[4, 5, 4]] * (others + 1))
        in_batch.append(int(batch_sampler(rows, batch).token_ids[index]))

    assert in_batch == alone
    assert len(set(alone)) > 1


def test_seeded_rows_differ_by_seed():
    logits = random_logits(1, scale=0.1)
    tokens = []
    for seed in (1, 2):
        p = SamplingParams(seed=seed)
        batch = SamplingBatch.build([p], [request_generator(p)])
        sampler = make_sampler(0)
        tokens.append([int(sampler(logits.clone(), batch).token_ids[0]) for _ in range(10)])
    assert tokens[0] != tokens[1]


# ---------------------------------------------------------------- penalties

def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.clone()
    for i in range(out.shape[0]):
        for t in set(prompt[i]) | set(output[i]):
            value = out[i, t]
            out[i, t] = value / repetition[i] if value > 0 else value * repetition[i]
        for t in set(output[i]):
            out[i, t] -= frequency[i] * output[i].count(t) + presence[i]
    return out


def test_penalties_follow_the_formulas():
    logits = random_logits(3, vocab=50, seed=6)
    prompt = [[1, 2, 2, 10], [], [7, 8]]
    output = [[2, 3, 3, 3, 40], [5, 5], []]
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.25, 1.5, -2.0], [1.3, 0.7, 2.0]
    got = logits.clone()
    apply_penalties(got, prompt, output, torch.tensor(presence), torch.tensor(frequency),
                    torch.tensor(repetition))
    expected = reference_penalties(logits, prompt, output, presence, frequency, repetition)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[:, 20:40], logits[:, 20:40])  # unseen tokens are untouched
    assert got[0, 10] != logits[0, 10]  # repetition covers prompt tokens
    assert got[2, 7] != logits[2, 7]


def dense_penalties(logits, prompt, output, presence, frequency, repetition):
    """The formulas over whole [R, V] rows, as an earlier version computed them."""
    def counts(rows):
        c = torch.zeros(logits.shape, dtype=torch.int64)
        for i, ids in enumerate(rows):
            for t in ids:
                c[i, t] += 1
        return c
    out, seen = counts(output), counts(output) > 0
    penalty = torch.where(seen | (counts(prompt) > 0), repetition.unsqueeze(1), 1.0)
    x = torch.where(logits > 0, logits / penalty, logits * penalty)
    return x - (frequency.unsqueeze(1) * out + presence.unsqueeze(1) * seen)


def test_sparse_penalties_give_the_dense_formulas_bits():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 300, generator=g) * 4
    prompt = [torch.randint(300, (n,), generator=g).tolist() for n in (50, 0, 7, 120)]
    output = [torch.randint(300, (n,), generator=g).tolist() for n in (30, 12, 0, 90)]
    presence, frequency = torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.tensor([0.25, 1.5, -2.0, 0.1])
    repetition = torch.tensor([1.3, 0.7, 2.0, 1.0])
    expected = dense_penalties(logits, prompt, output, presence, frequency, repetition)
    got = logits.clone()
    apply_penalties(got, prompt, output, presence, frequency, repetition)
    assert torch.equal(got, expected)
    wide = torch.zeros(4, 600)   # a non-contiguous view: written back in place
    wide[:, ::2] = logits
    apply_penalties(wide[:, ::2], prompt, output, presence, frequency, repetition)
    assert torch.equal(wide[:, ::2], expected) and not wide[:, 1::2].any()


def test_penalties_in_sampler_apply_to_their_rows_only():
    logits = torch.zeros(3, 20)
    logits[:, 4] = 2.0
    logits[:, 9] = 1.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=0.4)]
    # row 0: 2.0 / 3 < 1.0; row 2: 2.0 - 3 * 0.4 < 1.0; row 1 has no penalty.
    out = sample(logits, params, prompt_ids=[[4], [4], [4]], output_ids=[[], [4, 4, 4], [4, 4, 4]])
    assert out.token_ids.tolist() == [9, 4, 9]


def test_presence_penalty_in_sampler():
    logits = torch.zeros(1, 20)
    logits[0, 4] = 2.0
    logits[0, 9] = 1.5
    params = [SamplingParams(temperature=0.0, presence_penalty=0.6)]
    assert sample(logits, params, output_ids=[[4, 4, 4, 4]]).token_ids.tolist() == [9]
    assert sample(logits, params, output_ids=[[]]).token_ids.tolist() == [4]


# ---------------------------------------------------------------- banned ids

def test_banned_ids_never_sampled():
    logits = random_logits(1, seed=8)[0]
    banned = logits.topk(5).indices.tolist() + [V + 10]  # out-of-vocabulary ids are ignored
    greedy = sample(logits.unsqueeze(0), [SamplingParams(temperature=0.0)], banned=[banned])
    rest = logits.clone()
    rest[banned[:5]] = float("-inf")
    assert int(greedy.token_ids[0]) == int(rest.argmax())
    out = sample(logits.expand(DRAWS, -1).contiguous(), [SamplingParams(temperature=1.0)] * DRAWS,
                 banned=[banned] * DRAWS)
    assert not set(out.token_ids.tolist()) & set(banned)


def test_apply_banned_per_row():
    logits = torch.zeros(2, 6)
    apply_banned(logits, [[1, 5], []])
    assert logits[0].isneginf().nonzero().squeeze(1).tolist() == [1, 5]
    assert not logits[1].isneginf().any()


def test_apply_allowed_and_logit_bias_per_row():
    logits = random_logits(3, seed=4)
    before = logits.clone()
    apply_allowed(logits, [torch.tensor([2, 7]), None, torch.tensor([0])])
    assert logits[0].isfinite().nonzero().squeeze(1).tolist() == [2, 7]
    assert torch.equal(logits[0, [2, 7]], before[0, [2, 7]]) and torch.equal(logits[1], before[1])
    assert logits[2].isfinite().nonzero().squeeze(1).tolist() == [0]
    logits = before.clone()
    apply_logit_bias(logits, [None, (torch.tensor([5, 1]), torch.tensor([2.0, -3.0])), None])
    expect = before.clone()
    expect[1, 5] += 2.0
    expect[1, 1] -= 3.0
    assert torch.equal(logits, expect)


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_logprobs():
    logits = random_logits(1, seed=12)
    low = int(logits[0].argmin())
    bias = (torch.tensor([low]), torch.tensor([100.0]))
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)], bias=[bias])
    assert int(out.token_ids[0]) == low
    raw = logits[0].log_softmax(dim=0)
    assert float(out.logprobs[0]) == pytest.approx(float(raw[low]))      # the model's own logprob
    assert int(out.top_token_ids[0, 0]) == int(raw.argmax())
    rows = logits.expand(DRAWS, -1).contiguous()
    drawn = sample(rows, [SamplingParams(temperature=1.0)] * DRAWS, bias=[bias] * DRAWS).token_ids
    assert (drawn == low).float().mean() > 0.99


def test_allowed_ids_bound_every_draw():
    logits = random_logits(1, seed=13)
    allowed = torch.tensor([3, 50, 600])
    rows = logits.expand(DRAWS, -1).contiguous()
    drawn = sample(rows, [SamplingParams(temperature=2.0)] * DRAWS, allowed=[allowed] * DRAWS).token_ids
    assert set(drawn.tolist()) <= set(allowed.tolist()) and len(set(drawn.tolist())) > 1
    greedy = sample(logits, [SamplingParams(temperature=0.0)], allowed=[allowed]).token_ids
    assert int(greedy[0]) == int(allowed[logits[0, allowed].argmax()])


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_of_raw_logits():
    logits = random_logits(5, seed=10)
    params = [SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.2, top_k=10, logprobs=5, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, logprobs=1, presence_penalty=2.0)]
    out = sample(logits, params, prompt_ids=[[0, 1]] * 5, output_ids=[[2, 3, 3]] * 5)
    raw = logits.log_softmax(dim=1)
    asked = [0, 1, 3, 4]

    assert out.top_logprobs.shape == (5, 5) and out.top_token_ids.shape == (5, 5)
    chosen = raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs[asked], chosen[asked])
    assert out.logprobs[2].isnan() and (out.top_token_ids[2] == -1).all()

    for i in asked:
        k = params[i].logprobs
        top_lp, top_ids = out.top_logprobs[i, :k], out.top_token_ids[i, :k]
        assert torch.equal(top_ids, raw[i].topk(k).indices)
        torch.testing.assert_close(top_lp, raw[i, top_ids])
        assert torch.all(top_lp[:-1] >= top_lp[1:])
        if k:
            assert out.logprobs[i] <= top_lp[0]
    # Probabilities from the logprobs add up over the whole vocabulary.
    torch.testing.assert_close(raw.exp().sum(dim=1), torch.ones(5))


def test_sampled_token_rank_counts_the_tokens_above_it():
    """vLLM gives the sampled token's rank even outside the top k: 1 + the tokens with a higher
    logprob; rows that asked for no logprobs get none."""
    logits = random_logits(6, seed=11)
    params = [SamplingParams(temperature=5.0, seed=s, logprobs=k) for s, k in enumerate((0, 2, 0, 1, 3))]
    params.append(SamplingParams(temperature=5.0, seed=9))
    out = sample(logits, params)
    raw = logits.log_softmax(dim=1)
    want = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(out.token_ids.tolist())]
    assert out.ranks.tolist()[:5] == want[:5] and out.ranks[5] == 0
    assert max(want[:5]) > 3    # hot sampling: ranks far outside the top k
    greedy = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 6)
    assert greedy.ranks.tolist() == [1] * 6
    assert sample(logits, [SamplingParams(temperature=5.0, seed=1)] * 6).ranks is None


def test_draw_by_inversion_edges():
    from loom.sample.sampler import draw

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    for u, want in [(0.0, [1, 2]), (0.2499, [1, 2]), (0.25, [3, 2]), (0.999999, [3, 2]),
                    (1 - 2 ** -53, [3, 2])]:
        assert draw(probs, torch.tensor([u, u], dtype=torch.float64)).tolist() == want


def test_draw_two_levels_matches_a_full_running_sum():
    from loom.sample import sampler as S

    g = torch.Generator().manual_seed(0)
    for V in (5, 1024, 3000, 5000):
        probs = torch.rand(6, V, generator=g) ** 8        # many tiny values
        probs[:, ::7] = 0.0
        probs[1] = 0.0
        probs[1, V - 1] = 1.0                             # all mass on the last id
        u = torch.rand(6, generator=g, dtype=torch.float64)
        u[0] = 0.0
        u[2] = 1 - 2 ** -53
        cdf = probs.double().cumsum(1)
        want = torch.searchsorted(cdf, torch.minimum(u.unsqueeze(1) * cdf[:, -1:],
                                                     torch.nextafter(cdf[:, -1:], torch.zeros(6, 1))),
                                  right=True).squeeze(1)
        got = S.draw(probs, u)
        target = u * cdf[:, -1]
        for r in range(6):   # block sums round differently: a pick may move only across a rounding gap
            if got[r] != want[r]:
                lo, hi = sorted((int(got[r]), int(want[r])))
                assert abs(float(cdf[r, lo] - target[r])) <= 1e-6 * float(cdf[r, -1]), (V, r)
        assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())


def test_a_penalty_that_rounds_to_zero_still_draws_a_real_token():
    """repetition_penalty=5e-324 is 0 in float32: the repeated token's logit becomes +inf; it is
    drawn, never an id of -1 from a NaN distribution."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    logits[:, 7], logits[:, 9] = 2.0, 3.0     # positive: divided by the penalty
    params = [SamplingParams(repetition_penalty=5e-324, seed=1), SamplingParams(repetition_penalty=1e300, seed=2)]
    batch = SamplingBatch.build(params, generators=[request_generator(p) for p in params],
                                prompt_ids=[[7, 9], [7, 9]], output_ids=[[], []], banned=[(), ()])
    tokens = make_sampler(0)(logits, batch).token_ids.tolist()
    assert tokens[0] in (7, 9) and 0 <= tokens[1] < 300


def test_top_p_on_its_candidates_keeps_what_the_whole_row_sort_keeps():
    """Top-p sorts only each row's TOP_P_CANDIDATES most probable tokens where the rest weigh
    at most 1 - p, else the whole row: the same tokens kept as sorting every row, on peaked and
    flat rows (these take the whole sort), ties at the nucleus' end and at the candidates' edge,
    banned tokens, and with top-k."""
    from loom.sample.sampler import TOP_P_CANDIDATES, _top_p_sorted

    vocab = 5000
    logits = random_logits(8, vocab, seed=31)
    logits[0] *= 4.0                               # peaked: a few tokens hold the nucleus
    logits[1] *= 0.05                              # flat: the nucleus is wider than the candidates
    logits[2, :40] = 9.0                           # forty equal tokens across the nucleus' end
    logits[3, :TOP_P_CANDIDATES + 200] = 6.0       # ties across the candidates' edge
    logits[4, 100:4000] = float("-inf")            # banned tokens
    logits[5, :3] = float("-inf")
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.8, 0.3, 0.99, 0.7])
    for top_k in (torch.zeros(8, dtype=torch.int64), torch.tensor([0, 50, 0, 2000, 10, 0, 4000, 1])):
        want, got = logits.clone(), logits.clone()
        apply_top_k_top_p(want, top_k, None)       # top-k alone, then the whole-row sort
        _top_p_sorted(want, top_p)
        apply_top_k_top_p(got, top_k, top_p)
        assert torch.equal(want.isneginf(), got.isneginf())
        assert torch.equal(want[~want.isneginf()], got[~got.isneginf()])


def test_rows_with_top_k_alone_in_a_top_p_batch_skip_the_top_p_stage(monkeypatch):
    """A row whose top_p is 1 keeps what top-k alone keeps, and no top-p work (a sort of its
    candidates or of the whole row) touches it, whatever the other rows ask."""
    import loom.sample.sampler as sampler

    vocab = 3000
    logits = random_logits(4, vocab, seed=5)
    logits[2] *= 0.05                              # flat: its nucleus takes the whole-row sort
    top_k = torch.tensor([50, 0, 40, 7])
    top_p = torch.tensor([1.0, 0.9, 0.9, 1.0])
    rows_seen = []
    real = sampler._apply_top_p
    monkeypatch.setattr(sampler, "_apply_top_p", lambda x, p: (rows_seen.append(len(x)), real(x, p)))
    got = logits.clone()
    apply_top_k_top_p(got, top_k, top_p)
    assert rows_seen == [2]                        # rows 1 and 2 only
    for r in range(4):
        want = logits[r:r + 1].clone()
        apply_top_k_top_p(want, top_k[r:r + 1], top_p[r:r + 1] if top_p[r] < 1 else None)
        assert torch.equal(want[0].isneginf(), got[r].isneginf())
    rows_seen.clear()
    apply_top_k_top_p(logits.clone(), top_k, torch.ones(4))
    assert rows_seen == []                         # no row asks top-p: the stage is skipped


# ---------------------------------------------------------------- the kernels' sample_rows

KERNEL_CASES = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=700, top_p=0.99, min_p=0.01),
    SamplingParams(temperature=4.0, top_p=0.98),     # a wide nucleus: the bucketed search
    SamplingParams(temperature=0.5, top_p=0.3),      # a nucleus of one or two tokens
]


def native_distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    batch = SamplingBatch.build(params)
    return Sampler(0, kernels=kernels.load()).distribution(logits.clone(), batch, torch.arange(len(params)))


def torch_distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs = Sampler.probs(logits.clone(), SamplingBatch.build(params), torch.arange(len(params)))
    return probs / probs.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("vocab", [1001, 49152])
@pytest.mark.parametrize("params", KERNEL_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_kernel_distribution_matches_torch(vocab, params):
    logits = random_logits(3, vocab, seed=vocab)
    logits[0, 7] = float("-inf")          # a banned token
    logits[1, : vocab // 2] = float("-inf")
    logits[2, 3] = float("nan")
    expected, got = torch_distribution(logits, [params] * 3), native_distribution(logits, [params] * 3)
    assert torch.equal(expected > 0, got > 0)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7)
    assert torch.allclose(got.double().sum(dim=1), torch.ones(3, dtype=torch.float64))


def test_kernel_keeps_torch_tie_order_at_the_nucleus_end():
    # four equal tokens across the cut: torch's stable ascending sort drops the lower ids first
    row = torch.full((1, 64), -30.0)
    row[0, 0] = 2.0
    row[0, [10, 20, 30, 40]] = 1.0
    params = [SamplingParams(temperature=1.0, top_p=0.75)]
    expected, got = torch_distribution(row, params), native_distribution(row, params)
    kept = set((got[0] > 0).nonzero().squeeze(1).tolist())
    assert kept == set((expected[0] > 0).nonzero().squeeze(1).tolist())
    assert 0 in kept and 1 < len(kept) < 5 and 40 in kept and 10 not in kept


def test_kernel_top_k_keeps_ties_with_the_kth():
    row = torch.zeros(1, 100)
    row[0, :5] = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0])
    got = native_distribution(row, [SamplingParams(temperature=1.0, top_k=3)])
    assert set((got[0] > 0).nonzero().squeeze(1).tolist()) == {0, 1, 2, 3, 4}


def test_kernel_draws_follow_the_distribution():
    draws = 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 1.5, 0.2] + [-40.0] * 9)   # 17: a vector and a tail
    params = [SamplingParams(temperature=0.9)] * draws
    out = Sampler(3, kernels=kernels.load())(row.expand(draws, -1).contiguous(), SamplingBatch.build(params))
    observed = torch.bincount(out.token_ids, minlength=17).double()[:8]
    expected = (row[:8].double() / 0.9).softmax(dim=0) * draws
    assert float(((observed - expected) ** 2 / expected).sum()) < CHI2_7_999


def test_kernel_logprob_rows_match_torch():
    logits = random_logits(3, 1001, seed=12)
    logits[0, 5] = float("-inf")
    logits[1, [3, 9]] = 50.0   # a tie at the top: the lower id first
    targets = torch.tensor([5, 9, 17])
    lse, ids, ranks = kernels.load().logprob_rows(logits, 4, targets)
    torch.testing.assert_close(lse, logits.logsumexp(dim=1))
    assert ids[1, :2].tolist() == [3, 9]
    assert torch.equal(ids[[0, 2]], logits[[0, 2]].topk(4).indices)
    assert ranks.tolist() == [int((logits[i] > logits[i, t]).sum()) + 1 for i, t in enumerate(targets.tolist())]
    assert ranks[1] == 1 and kernels.load().logprob_rows(logits, 0)[2].numel() == 0
