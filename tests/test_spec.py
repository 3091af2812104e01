"""Speculative decoding (loom/spec).

  1. Pieces without a model: tree masks, greedy verification, prompt lookup, the
     controller's choice from measured costs, config errors (milliseconds).
  2. Lossless sampling: chi-square tests of recursive rejection sampling against the target
     distribution of a tiny random model, for a chain and a tree (seconds).
  3. Engine on the tiny llama: rollback under preemption and prefix caching keeps the
     block pool consistent; stop strings and max_tokens cut multi-token steps exactly.
  4. Real model, exact mode: for every drafter, greedy outputs with speculation equal the
     outputs without it, token for token, on Spec-Bench prompts of every category, batched
     and alone, with drafted and accepted counts above zero.
"""

from __future__ import annotations

import json

import random

import pytest
import torch
from conftest import MODEL_DTYPES, run_to_end

from loom.config import EngineConfig
from loom.contracts import DraftTree
from loom.engine.engine import Engine
from loom.errors import InvalidRequestError
from loom.model.layers.attention import tree_attention_mask
from loom.sampling_params import SamplingParams
from loom.speculative.controller import CostModel, SpecController
from loom.speculative.verify import verify_greedy, verify_path

METHODS = ["prompt_lookup", "token_recycling", "lookahead", "draft_model", "retrieval", "auto"]


def method_config(method: str, **extra) -> dict:
    cfg = {"method": method, "adaptive": False} | extra
    if method == "draft_model":
        cfg.setdefault("num_layers", 1)
    return cfg


# =============================================================================================
# 1. Pieces
# =============================================================================================


def test_tree_depths_paths_and_mask():
    tree = DraftTree((10, 11, 12, 13, 14), (-1, -1, 0, 1, 2))
    assert tree.depths == [1, 1, 2, 2, 3]
    assert tree.path(4) == [0, 2, 4]
    assert tree.cut(3) == DraftTree((10, 11, 12), (-1, -1, 0))
    mask = tree_attention_mask(2, tree.parents).int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0, 0],
                    [1, 1, 0, 1, 0, 0, 0],
                    [1, 1, 1, 0, 1, 0, 0],
                    [1, 1, 0, 1, 0, 1, 0],
                    [1, 1, 1, 0, 1, 0, 1]]
    with pytest.raises(ValueError):
        DraftTree((1, 1), (-1, -1))      # siblings must differ
    with pytest.raises(ValueError):
        DraftTree((1, 2), (1, -1))       # parents come first


def test_greedy_verification_follows_the_argmax_path():
    tree = DraftTree((10, 11, 12, 13), (-1, -1, 1, 1))
    # rows: root, node0..3; argmax after root is 11 (node 1), after node 1 is 13 (node 3), then 7
    argmax = [11, 99, 13, 99, 7]
    v = verify_greedy(tree, argmax)
    assert v.accepted_nodes == [1, 3] and v.tokens == [11, 13, 7]
    v = verify_greedy(tree, [5, 0, 0, 0, 0])
    assert v.accepted_nodes == [] and v.tokens == [5]


def test_verification_takes_the_output_layers_argmax_where_it_is_known_and_valid():
    from types import SimpleNamespace

    from loom.contracts import SpecHost
    from loom.speculative.decoder import SpecDecoder

    tree = DraftTree((10, 11), (-1, 0))
    logits = torch.full((3, 16), -1.0)
    logits[0, 10], logits[1, 11], logits[2, 5] = 1.0, 1.0, 1.0       # the logits' own path: 10, 11, then 5
    greedy = SimpleNamespace(params=SimpleNamespace(is_greedy=True))

    def host(masked: bool) -> SpecHost:
        return SpecHost(sample=None, draw=None, request=lambda rid: greedy, commit=None, move_kv=None,
                        constrain=(lambda rid, t, lg: [False] * 3) if masked else
                        (lambda rid, t, lg: None))

    verdict = SpecDecoder._verify(None, host(False), "r", tree, logits, torch.tensor([10, 11, 7]))
    assert verdict.tokens == [10, 11, 7]                       # the known argmax (here unlike the logits) is used
    verdict = SpecDecoder._verify(None, host(False), "r", tree, logits, torch.tensor([10, -1, 7]))
    assert verdict.tokens == [10, 11, 5]                       # one row unknown: the logits decide
    verdict = SpecDecoder._verify(None, host(True), "r", tree, logits, torch.tensor([10, 11, 7]))
    assert verdict.tokens == [10, 11, 5]                       # a grammar's mask changes the argmax: not used


def test_a_closed_batch_drafts_only_for_the_requests_furthest_behind():
    from loom.speculative.decoder import behind

    # tokens left: a and c are furthest behind (the median is 7.5); d, which has 3 left, ends first
    assert behind(["a", "b", "c", "d"], [8, 5, 8, 3], [10, 5, 10, 3]) == (["a", "c"], [8, 8])
    assert behind(["a", "b"], [4, 4], [9, 9]) == (["a", "b"], [4, 4])       # level: all of them


def test_an_idle_plain_batch_feeds_the_drafter_nothing():
    from types import SimpleNamespace

    from loom.speculative.decoder import OBSERVE_PLAIN_BATCH, SpecDecoder

    dec = SpecDecoder.__new__(SpecDecoder)
    dec.drafter, dec._turn = SimpleNamespace(observe_topk=2), 0
    dec.controller = ctl = SpecController(8, depth=lambda k: k)
    plain = [SimpleNamespace(draft_parents=()) for _ in range(4)]
    logits = torch.randn(4, 16)
    rows = dec._observed(plain, True, logits, 4)
    assert sum(r is not None for r in rows) == OBSERVE_PLAIN_BATCH          # a plain batch: a few rows in turn
    assert any(rows[i] is not None and rows[i].tolist() == logits[i].topk(2).indices.tolist() for i in (1, 2))
    ctl.cost.observe(4, 0, 0.010)
    ctl.cost.observe(4, 32, 0.100)             # drafts do not pay at this batch: the next plans skip the search
    assert ctl.plan(["a", "b", "c", "d"], 4, [8] * 4, 0.0) == [0] * 4 and ctl.idle(4)
    assert dec._observed(plain, True, logits, 4) is None                  # idle: no top-k at all
    assert len(dec._observed(plain, False, logits, 4)) == 4                # a draft verified: every row
    assert not ctl.idle(2) and dec._observed(plain[:2], True, logits[:2], 2) is not None


def test_probes_are_spaced_by_what_one_node_costs():
    from loom.speculative.controller import PROBE_EVERY

    def probes(cost_of_one: float, steps: int = 2000) -> tuple[float, int]:
        ctl = SpecController(8, depth=lambda k: k)
        ctl.cost.observe(8, 0, 0.008)
        ctl.cost.observe(8, 1, cost_of_one)
        ctl.cost.observe(8, 64, 0.100)         # real drafts never pay here
        ids = [f"s{i}" for i in range(8)]
        for _ in range(10):
            for rid in ids:
                ctl.record(rid, 0, 4)
        return ctl.probe_every(8), sum(sum(ctl.plan(ids, 8, [8] * 8, 0.0)) for _ in range(steps))

    # one node for a row's share of the step (1 ms of 8): a probe per sequence every PROBE_EVERY x 8 steps
    every, n = probes(0.0085)
    assert every == PROBE_EVERY * 8 and n == 8 * (2000 // every)
    # one node that costs 4 rows' shares (a tile of its own): probes 4x further apart
    every, n = probes(0.012)
    assert every == pytest.approx(4 * PROBE_EVERY * 8) and n == 8 * int(2000 // every)


def test_sequences_that_came_together_probe_in_turn_one_a_step():
    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(6, 0, 0.006)
    ctl.cost.observe(6, 1, 0.0061)
    ctl.cost.observe(6, 48, 0.100)             # real drafts never pay here
    ids = [f"s{i}" for i in range(6)]
    for rid in ids:
        ctl.record(rid, 0, 4)

    def step() -> list[int]:
        if not ctl.idle(6):
            return ctl.plan(ids, 6, [8] * 6, 0.0)
        due = ctl.idle_step(6, ids)
        return [int(rid in due) for rid in ids]

    steps = [step() for _ in range(3 * int(ctl.probe_every(6)) + 10)]
    assert max(sum(sizes) for sizes in steps) == 1            # never two probes in one step
    probed = [rid for sizes in steps for rid, k in zip(ids, sizes) if k]
    assert len(probed) >= 2 * len(ids) and set(probed) == set(ids)
    first = [i for i, sizes in enumerate(steps) if any(sizes)][:6]
    assert first == list(range(first[0], first[0] + 6))       # due together: on consecutive steps


def auto_decoder(batch: int, req_ids: str):
    """A SpecDecoder of method `auto` without a model, whose costs at `batch` sequences make a
    node cost 10% of a step and whose requests' 4-gram copies were accepted, guesses not."""
    from types import SimpleNamespace

    from loom.config import SpeculativeConfig
    from loom.speculative.decoder import SpecDecoder
    from loom.speculative.drafters import DraftEnv

    dec = SpecDecoder(SpeculativeConfig("auto"), DraftEnv(SimpleNamespace(cfg=SimpleNamespace(vocab_size=64)),
                                                          "auto", 16, 16))
    ctl = dec.controller
    ctl.cost.observe(batch, 0, 0.010)
    ctl.cost.observe(batch, 8, 0.018)
    for rid in req_ids:
        for _ in range(10):
            ctl.record(rid, 8, 8, "prompt_lookup:4")     # copies from 4-gram matches are accepted
            ctl.record(rid, 0, 8, "token_recycling")     # guesses are not
    return dec, ctl


def test_a_batch_plan_no_named_source_would_make_pay_is_settled_without_proposing():
    from types import SimpleNamespace

    from loom.contracts import ScheduledSeq

    dec, ctl = auto_decoder(4, "abcd")
    states = {rid: SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i], output_token_ids=[],
                                   params=SamplingParams(temperature=0.0, max_tokens=64), matcher=None)
              for i, rid in enumerate("abcd")}
    host = SimpleNamespace(request=states.__getitem__)
    seqs = [ScheduledSeq(rid, [10 + i], 10, [0], True) for i, rid in enumerate("abcd")]
    dec.drafter.subs[1].adj[10:14, 0] = 11                               # Token Recycling has a guess after each
    proposed = []
    propose = dec.drafter.propose
    dec.drafter.propose = lambda reqs: proposed.append(len(reqs)) or propose(reqs)
    assert dec._screened(host, seqs, 4, 1) == {} and proposed == []    # guesses alone: declined, nothing proposed
    assert ctl.idle(4)                                                  # counted as a plan that drafted nothing
    ctl.wake(4)
    states["c"].output_token_ids = [3, 4, 5, 6]                         # "3 4 5 6" occurred in c's prompt
    seqs[2] = ScheduledSeq("c", [6], 13, [0], True)
    assert dec._screened(host, seqs, 4, 1) is None                      # a 4-gram match would pay: plan in full
    drafts = dec._propose(host, seqs, 4, 1)
    assert list(drafts) == ["c"] and drafts["c"].source == "prompt_lookup:4" and proposed == [4]


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by a backwards scan: up to k tokens that followed the latest earlier match
    of the longest tail n-gram (what NgramIndex must answer)."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        tail = tokens[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_copies_what_followed_the_latest_longest_match():
    from loom.speculative.drafters.prompt_lookup import NgramIndex

    toks = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert NgramIndex(1, 3).find(toks, 3) == ([4, 5, 6], 3)     # latest occurrence of (1, 2, 3)
    assert lookup(toks, 3, 1, 3) == [4, 5, 6]                   # the scan the index is checked against
    assert NgramIndex(1, 3).find([1, 2, 3, 4], 2) == ([], 0)
    assert lookup([1, 2, 3, 4], 2, 1, 3) == []


def test_the_ngram_index_finds_what_the_scan_finds_as_the_context_grows():
    from loom.speculative.drafters.prompt_lookup import NgramIndex

    rng = random.Random(0)
    for _ in range(200):
        toks = [rng.randrange(rng.choice([3, 5, 20])) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(1, 4)
        for n in range(1, len(toks) + 1):
            if rng.random() < 0.5 or n == len(toks):     # proposals a step or several apart
                found, size = index.find(toks[:n], 5)
                assert found == lookup(toks[:n], 5, 1, 4)
                assert (size > 0) == bool(found)
        other = [t + 1 for t in toks]                    # not the list it indexed grown: indexed afresh
        assert index.find(other, 5)[0] == lookup(other, 5, 1, 4)


def test_prompt_lookup_names_its_match_length_as_the_tree_source():
    from types import SimpleNamespace

    from loom.speculative.drafters import DraftRequest
    from loom.speculative.drafters.prompt_lookup import PromptLookupDrafter

    d = PromptLookupDrafter(SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4), None)
    long_, short, none = d.propose([DraftRequest("a", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 3),
                                    DraftRequest("b", [7, 8, 9, 7], 3), DraftRequest("c", [1, 2, 3], 3)])
    assert long_ == DraftTree.chain([5, 6, 1], "prompt_lookup:4") and long_.cut(2).source == "prompt_lookup:4"
    assert short.tokens == (8, 9, 7) and short.source == "prompt_lookup:1" and none is None


def test_controller_keeps_a_rate_per_draft_source_and_plans_by_the_source_at_hand():
    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(1, 0, 0.010)
    ctl.cost.observe(1, 8, 0.018)            # eight nodes cost 80% more
    for _ in range(10):
        ctl.record("a", 8, 8, "prompt_lookup:4")     # long copies: every node accepted
        ctl.record("a", 0, 8, "token_recycling")     # guesses: none
    assert ctl.rate("a", "prompt_lookup:4") > 0.9 and ctl.rate("a", "token_recycling") < 0.1
    assert ctl.plan(["a"], 1, [8], 0.0, sources=["prompt_lookup:4"]) == [8]
    assert ctl.plan(["a"], 1, [8], 0.0, sources=["token_recycling"]) == [0] and ctl.idle(1)
    # the plans skip their search now, but a fresh 4-gram match would pay: it wakes them
    assert ctl.pays(["a"], ["prompt_lookup:4"], 1, 0.0) and not ctl.pays(["a"], ["token_recycling"], 1, 0.0)
    assert not ctl.pays(["a"], [None], 1, 0.0)
    # a new request starts from its source's average over the others
    assert ctl.rate("b", "prompt_lookup:4") > 0.9 and ctl.rate("b", "token_recycling") < 0.3
    # a source never seen: the average over every source's drafts, between the two
    assert ctl.rate("b", "token_recycling") < ctl.rate("b", "retrieval") < ctl.rate("b", "prompt_lookup:4")


def test_auto_takes_the_proposal_whose_source_the_controller_rates_highest():
    from types import SimpleNamespace

    from loom.speculative.drafters import DraftRequest
    from loom.speculative.drafters.auto import AutoDrafter

    cfg = SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4, recycling_top_k=2, datastore=None)
    auto = AutoDrafter(cfg, SimpleNamespace(target=SimpleNamespace(cfg=SimpleNamespace(vocab_size=16))))
    auto.subs[1].adj[4] = [9, 8]                       # Token Recycling's guess after token 4
    rates = {"prompt_lookup:4": 0.9, "prompt_lookup:1": 0.2, "token_recycling": 0.4}
    auto.use_rates(lambda rid, src: rates[src])
    four = DraftRequest("a", [1, 2, 3, 4, 5, 1, 2, 3, 4], 3)            # its tail's 4-gram occurred
    one = DraftRequest("b", [7, 4, 6, 4], 3)                           # only "4" occurred
    long_, short = auto.propose([four, one])
    assert long_.source == "prompt_lookup:4" and long_.tokens == (5, 1, 2)
    assert short.source == "token_recycling" and short.tokens[0] == 9
    assert auto.hints([four, one]) == ["prompt_lookup:4", "prompt_lookup:1"]


def test_a_fresh_prompt_lookup_match_wakes_a_lone_sequence_whose_plans_skip_their_search():
    from types import SimpleNamespace

    from loom.contracts import ScheduledSeq

    dec, ctl = auto_decoder(1, "a")
    state = SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], output_token_ids=[],
                            params=SamplingParams(temperature=0.0, max_tokens=64), matcher=None)
    host = SimpleNamespace(request=lambda rid: state)
    seq = [ScheduledSeq("a", [10], 10, [0], True)]
    dec.drafter.subs[1].adj[10] = [11] + [-1] * 7    # Token Recycling guesses 11 after 10
    assert dec._propose(host, seq, 1) == {}         # only its guess: no draft, and the plans skip
    assert ctl.idle(1)
    state.output_token_ids = [11, 12, 3, 4, 5, 6]   # the tail "3 4 5 6" occurred in the prompt
    drafts = dec._propose(host, seq, 1)
    assert drafts["a"].source == "prompt_lookup:4" and drafts["a"].tokens[:4] == (7, 8, 9, 10)
    assert not ctl.idle(1)


def test_a_lone_sequence_asks_for_no_hints_while_no_match_length_could_pay():
    from types import SimpleNamespace

    from loom.contracts import ScheduledSeq

    dec, ctl = auto_decoder(1, "a")
    for n in (1, 2, 3, 4):                          # lately, every match length's copies were rejected
        for _ in range(40):
            ctl.record("a", 0, 8, f"prompt_lookup:{n}")
    state = SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], output_token_ids=[],
                            params=SamplingParams(temperature=0.0, max_tokens=64), matcher=None)
    host = SimpleNamespace(request=lambda rid: state)
    seq = [ScheduledSeq("a", [10], 10, [0], True)]
    asked = []
    hints = dec.drafter.hints
    dec.drafter.hints = lambda reqs: asked.append(len(reqs)) or hints(reqs)
    assert dec._propose(host, seq, 1) == {} and ctl.idle(1)
    state.output_token_ids = [11, 12, 3, 4, 5, 6]   # a 4-gram match, at a rate that does not pay
    assert dec._propose(host, seq, 1) == {} and asked == []
    for _ in range(10):
        ctl.record("a", 8, 8, "prompt_lookup:4")    # now 4-gram copies are accepted
    drafts = dec._propose(host, seq, 1)             # the hints are asked for again, and the match wakes the plan
    assert asked == [1] and drafts["a"].source == "prompt_lookup:4"


def test_controller_prices_a_tree_by_the_depth_its_nodes_reach():
    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(1, 0, 0.010)
    ctl.cost.observe(1, 8, 0.014)
    for _ in range(10):
        ctl.record("a", 2, 4)
    chain = ctl.plan(["a"], 1, [8], 0.0, sources=[None], depths=[[1, 2, 3, 4, 5, 6, 7, 8]])
    flat = ctl.plan(["a"], 1, [8], 0.0, sources=[None], depths=[[1] * 8])   # eight siblings: one depth
    assert chain[0] > 1 and flat[0] <= 1


def test_controller_drafts_when_it_pays_and_not_when_it_does_not():
    ctl = SpecController(8, depth=lambda k: k)
    # verifying extra tokens is almost free: drafts pay
    for b in (1, 8):
        ctl.cost.observe(b, 0, 0.010 * b)
        ctl.cost.observe(b, 8 * b, 0.011 * b)
    for _ in range(10):
        ctl.record("a", 4, 4)
    assert ctl.plan(["a"], 1, [8], 0.0)[0] > 0
    # every extra token costs as much as a whole step and acceptance is low: no drafts
    slow = SpecController(8, depth=lambda k: k)
    slow.cost.observe(1, 0, 0.010)
    slow.cost.observe(1, 8, 0.090)
    for _ in range(10):
        slow.record("a", 0, 4)
    assert slow.plan(["a"], 1, [8], 0.0) == [0]
    # a slow drafter never pays either
    assert ctl.plan(["a"], 1, [8], 1.0) == [0]


def test_invalid_speculative_configs_are_refused(tiny_llama_path):
    for bad in ({"method": "medusa"}, {"num_speculative_tokens": 4}, {"method": "prompt_lookup", "k": 3},
                {"method": "prompt_lookup", "num_speculative_tokens": 0},
                {"method": "lookahead", "num_layers": 2}, "prompt_lookup"):
        with pytest.raises(InvalidRequestError):
            EngineConfig.create(str(tiny_llama_path), speculative_config=bad)
    with pytest.raises(InvalidRequestError, match="num_layers"):
        Engine(EngineConfig.create(str(tiny_llama_path), num_blocks=64,
                                   speculative_config={"method": "draft_model", "num_layers": 99}))


# =============================================================================================
# 2. Lossless sampling
# =============================================================================================


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts against probs (cells of expected count < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum(0, keepdim=True).double()])
    exp = torch.cat([expected[big].double(), expected[~big].sum(0, keepdim=True).double()])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_path):
    """Target distributions of the tiny random model: rows after a context and after each
    of a few continuations, at temperature 0.7 and top-k 6 (a handful of likely tokens)."""
    from loom.loader.gguf import GGUFFile
    from loom.model.build import load_model
    from loom.model.runner import score
    from loom.sample.sampler import Sampler, SamplingBatch

    model = load_model(GGUFFile.open(tiny_llama_path))
    params = SamplingParams(temperature=0.7, top_k=6)

    def dist(ids):
        logits = score(model, ids)[-1:].clone()
        return Sampler.probs(logits, SamplingBatch.build([params]), torch.arange(1))[0]

    return dist


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_verification_keeps_the_target_distribution(tiny_target, shape):
    ctx = [5, 17, 42, 8]
    p0 = tiny_target(ctx)
    ranked = p0.argsort(descending=True).tolist()
    a, b = ranked[0], ranked[1]                       # likely first tokens
    pa = tiny_target(ctx + [a])
    pb = tiny_target(ctx + [b])
    second = pa.argsort(descending=True).tolist()[1]
    if shape == "chain":
        tree = DraftTree.chain([a, second])
        rows = torch.stack([p0, pa, tiny_target(ctx + [a, second])])
    else:   # root -> a -> second, root -> b
        tree = DraftTree((a, b, second), (-1, -1, 0))
        rows = torch.stack([p0, pa, pb, tiny_target(ctx + [a, second])])
    gen = torch.Generator().manual_seed(1234)
    n = 6000
    first = torch.zeros_like(p0)
    after_a = torch.zeros_like(p0)
    accepted = 0
    def pick(r: int) -> int:
        return int(torch.multinomial(rows[r], 1, generator=gen))

    for _ in range(n):
        v = verify_path(tree, pick)
        accepted += len(v.accepted_nodes)
        first[v.tokens[0]] += 1
        if v.tokens[0] == a:
            after_a[v.tokens[1]] += 1
    assert accepted > 0
    assert chi_square_p(first, p0) > 1e-3, "first token does not follow the target"
    assert chi_square_p(after_a, pa) > 1e-3, "second token after the first draft does not follow the target"


# =============================================================================================
# 3. Engine on the tiny llama
# =============================================================================================


def tiny_engine(tiny_parts, spec=None, **options) -> Engine:
    path, model, tok = tiny_parts
    opts = dict(block_size=4, num_blocks=512, max_num_batched_tokens=64, max_num_seqs=16) | options
    return Engine(EngineConfig.create(str(path), speculative_config=spec, **opts), model=model, tokenizer=tok)


def run(engine: Engine, prompts, params, check=False) -> list:
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        if check:
            engine.kv.check_integrity()
    return [final[i].outputs[0] for i in ids]


REPEATING = [[3, 4, 5, 6, 7, 8, 9, 10] * 4, [20, 21, 22, 23, 24] * 5 + [20, 21], list(range(30, 70))]


@pytest.mark.parametrize("method", ["lookahead", "token_recycling", "draft_model"])
def test_rollback_under_preemption_and_prefix_caching_keeps_the_pool_consistent(tiny_parts, method):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = REPEATING + [REPEATING[0][:20] + [99, 98]]    # shares cached blocks with the first
    want = [o.token_ids for o in run(tiny_engine(tiny_parts), prompts, params)]
    engine = tiny_engine(tiny_parts, method_config(method), num_blocks=40)
    got = run(engine, prompts, params, check=True)
    stats = engine.runner.spec.stats
    assert engine.scheduler.stats.num_preemptions > 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert [o.token_ids for o in got] == want
    assert engine.kv.usage() == 0.0 and engine.kv.num_free_blocks() == 40


def test_plain_steps_of_a_speculating_engine_ask_for_the_argmax_alone(tiny_parts, monkeypatch):
    """With speculation on, a step of plain greedy rows that verifies no draft and feeds the
    drafter nothing (prompt lookup learns from no logits) asks the output layer for the argmax
    alone, as a step without speculation does (on AVX-512 kernels no logits are kept); steps
    that verify drafts keep them. The tokens are plain decoding's."""
    from conftest import spy_logits

    from loom import kernels
    from loom.model.build import load_model
    from loom.model.layers.linear import QuantLinear

    path, _, tok = tiny_parts
    model = load_model(path, linear="auto")

    def make(spec):
        return Engine(EngineConfig.create(str(path), speculative_config=spec, block_size=4, num_blocks=512,
                                          max_num_batched_tokens=64, max_num_seqs=16), model=model, tokenizer=tok)

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in run(make(None), REPEATING, params)]
    engine = make(method_config("prompt_lookup"))
    calls = spy_logits(monkeypatch, engine)
    assert [o.token_ids for o in run(engine, REPEATING, params)] == want
    assert engine.runner.spec.stats.num_draft_tokens > 0
    assert any(only for only, _ in calls) and not all(only for only, _ in calls)
    unstored = kernels.variant() == "avx512" and isinstance(model.lm_head, QuantLinear)
    assert any(none for _, none in calls) == unstored


def test_stop_strings_and_max_tokens_cut_multi_token_steps_exactly(tiny_parts):
    tok = tiny_parts[2]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run(tiny_engine(tiny_parts), REPEATING, base)
    # a stop string that the plain run completes in the middle of its output
    stops = [tok.decode(o.token_ids[9:11]) for o in plain]
    for i, prompt in enumerate(REPEATING):
        for mt in (5, 24):
            p = base.clone(max_tokens=mt, stop=[stops[i]] if stops[i].strip() else [])
            want = run(tiny_engine(tiny_parts), [prompt], p)[0]
            got = run(tiny_engine(tiny_parts, method_config("prompt_lookup")), [prompt], p)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_sampled_outputs_follow_the_target_distribution_in_the_engine(tiny_parts):
    """Seeded three-token completions: chi-square of the spec run's (first, second) token
    pairs (the second one verified against a draft) against the pooled frequencies."""
    prompt = REPEATING[0]
    firsts = {}
    for spec in (None, method_config("token_recycling", num_speculative_tokens=3)):
        engine = tiny_engine(tiny_parts, spec, max_num_seqs=200, max_num_batched_tokens=1024)
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s)
                  for s in range(200)]
        ids = [engine.add_request({"prompt_token_ids": prompt}, p) for p in params]
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o for o in engine.step() if o.finished})
        firsts[spec is None] = [tuple(final[i].outputs[0].token_ids[:2]) for i in ids]
        if spec is not None:
            assert engine.runner.spec.stats.num_accepted_tokens > 0
    cells = sorted(set(firsts[True]) | set(firsts[False]))
    plain = torch.tensor([firsts[True].count(c) for c in cells], dtype=torch.float64)
    spec = torch.tensor([firsts[False].count(c) for c in cells], dtype=torch.float64)
    # two-sample test: the spec counts against the pooled frequencies
    pooled = (plain + spec) / (plain + spec).sum()
    assert chi_square_p(spec, pooled) > 1e-3


@pytest.mark.parametrize("method", ["token_recycling", "prompt_lookup", "auto"])
def test_a_seeded_sampled_request_gives_the_same_tokens_with_speculation_on_and_off(tiny_parts, method):
    """Verification draws a row's token as the plain step would, one draw per token committed,
    so however many tokens are drafted (the controller's choice, from timings) a seed's output
    is plain decoding's."""
    prompts = [REPEATING[0], REPEATING[1]]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=24, ignore_eos=True, seed=s)
              for s, (t, k, p) in enumerate([(1.0, 3, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.8, 0, 1.0)])]
    def outputs(engine: Engine) -> list[list[int]]:
        ids = [engine.add_request({"prompt_token_ids": prompt}, p) for prompt in prompts for p in params]
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o for o in engine.step() if o.finished})
        return [final[i].outputs[0].token_ids for i in ids]

    plain = outputs(tiny_engine(tiny_parts))
    engine = tiny_engine(tiny_parts, method_config(method))
    assert outputs(engine) == plain
    assert engine.runner.spec.stats.num_accepted_tokens > 0


def sampled_pairs(engine: Engine, prompt: list[int], n: int = 200) -> list[tuple[int, int]]:
    """The first two tokens of n seeded three-token completions of `prompt`."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    ids = [engine.add_request({"prompt_token_ids": prompt}, p) for p in params]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [tuple(final[i].outputs[0].token_ids[:2]) for i in ids]


@pytest.mark.parametrize("adaptive", [False, True])
def test_retrieval_drafts_and_the_draft_budget_keep_the_target_distribution(tiny_parts, tmp_path, adaptive):
    """Retrieval drafts from a corpus holding the prompt and its greedy continuation, with a
    fixed draft size and with the controller's per-step budget: the chi-square of the (first,
    second) token pairs against the pooled frequencies of a run without speculation."""
    _, _, tok = tiny_parts
    prompt = REPEATING[1]
    greedy_out = run(tiny_engine(tiny_parts), [prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                                      ignore_eos=True))[0].token_ids
    (tmp_path / "corpus.txt").write_text(tok.decode(list(prompt) + list(greedy_out)))
    plain = sampled_pairs(tiny_engine(tiny_parts, max_num_seqs=200, max_num_batched_tokens=1024), prompt)
    spec = {"method": "retrieval", "adaptive": adaptive, "num_speculative_tokens": 3,
            "datastore": str(tmp_path / "corpus.txt")}
    engine = tiny_engine(tiny_parts, spec, max_num_seqs=200, max_num_batched_tokens=1024)
    if adaptive:   # a cost model where drafts pay (a shared machine's timings could say otherwise)
        cost = engine.runner.spec.controller.cost = CostModel()
        for b in (1, 8, 64, 256):
            cost.calibrate(b, 0, 1.0)
            cost.calibrate(b, 3 * b, 1.0 + 0.001 * b)
    drafted = sampled_pairs(engine, prompt)
    assert engine.runner.spec.stats.num_accepted_tokens > 0
    cells = sorted(set(plain) | set(drafted))
    a = torch.tensor([plain.count(c) for c in cells], dtype=torch.float64)
    b = torch.tensor([drafted.count(c) for c in cells], dtype=torch.float64)
    assert chi_square_p(b, (a + b) / (a + b).sum()) > 1e-3


def test_retrieval_drafts_from_earlier_requests_outputs(tiny_parts):
    """Without a corpus, a request repeating an earlier one drafts from its output, exactly."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = tiny_engine(tiny_parts, method_config("retrieval"))
    first = run(engine, [REPEATING[2]], params)[0].token_ids
    before = engine.runner.spec.stats.num_accepted_tokens
    assert run(engine, [REPEATING[2]], params)[0].token_ids == first
    assert engine.runner.spec.stats.num_accepted_tokens - before >= 16


def test_spec_metrics_are_exported_with_vllm_names(tiny_parts):
    from loom.server.metrics import ServerMetrics, read_engine_sample

    engine = tiny_engine(tiny_parts, method_config("prompt_lookup"))
    run(engine, REPEATING[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))

    class Snap:  # an engine client's stats() and restarts
        restarts = 0

        def stats(self):
            return read_engine_sample(engine)

    text = ServerMetrics(Snap(), "tiny").exposition().decode()
    stats = engine.runner.spec.stats
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(stats.num_drafts)}' in text
    assert "vllm:spec_decode_num_draft_tokens_total" in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(stats.num_accepted_tokens)}' \
        in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    assert stats.num_accepted_tokens > 0 and stats.accepted_per_pos[0] > 0


def test_adaptive_controller_calibrates_and_stays_exact(tiny_parts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in run(tiny_engine(tiny_parts), REPEATING, params)]
    engine = tiny_engine(tiny_parts, {"method": "auto"}, max_num_seqs=4)
    assert engine.runner.spec.controller.cost.rows        # calibrated at start-up
    assert [o.token_ids for o in run(engine, REPEATING, params)] == want


def test_the_kv_cache_is_handed_back_only_after_timed_passes(tiny_parts, monkeypatch):
    """A start whose costs come from the cache leaves its KV pages alone: handing back pages that
    a freed cache had already backed would cost a page fault at each first write."""
    from loom.model.kv_cache import KVCacheTensors

    released = []
    monkeypatch.setattr(KVCacheTensors, "release", lambda self: released.append(self))
    tiny_engine(tiny_parts, {"method": "auto"}, max_num_seqs=4)    # times the grid unless cached already
    released.clear()
    tiny_engine(tiny_parts, {"method": "auto"}, max_num_seqs=4)    # reads it from the cache
    assert released == []
    monkeypatch.setenv("LOOM_COST_CACHE", "0")
    engine = tiny_engine(tiny_parts, {"method": "auto"}, max_num_seqs=4)
    assert released == [engine.runner.kv]


def _inner_pages(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` on the memory pages wholly inside it."""
    import mmap

    start = t.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE - start
    last = (start + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE - start
    return t.view(-1).view(torch.uint8)[first:max(first, last)]


def test_calibration_leaves_the_kv_cache_as_never_written(tiny_parts, monkeypatch):
    """The calibration's passes write draft entries into free blocks and read blocks nothing
    wrote; the engine hands those pages back (KVCacheTensors.release): they read as zeros, as
    a cache no request has used."""
    monkeypatch.setenv("LOOM_COST_CACHE", "0")   # timed now, not read from a cache
    engine = tiny_engine(tiny_parts, {"method": "auto"}, max_num_seqs=4)
    inner = [_inner_pages(t) for kv in engine.runner.kv.layers for t in kv]
    assert sum(p.numel() for p in inner) > 0
    assert all(not p.any() for p in inner)
    for k, v in engine.runner.kv.layers:     # written, then handed back
        k.fill_(1.0)
        v.fill_(1.0)
    engine.runner.kv.release()
    assert all(not p.any() for kv in engine.runner.kv.layers for p in map(_inner_pages, kv))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in run(tiny_engine(tiny_parts), REPEATING, params)]
    assert [o.token_ids for o in run(engine, REPEATING, params)] == want


# =============================================================================================
# 4. Real model, exact mode
# =============================================================================================

SMOL = "smollm2-135m"
PROMPT_TOKENS = 24
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def category_prompts(real_models):
    """f(dtype): one Spec-Bench prompt per category, cut to PROMPT_TOKENS, and its plain greedy
    output in that mode (computed once per mode)."""
    from conftest import spec_bench_questions

    _, tok = real_models.loom(SMOL)
    seen = {}
    for q in spec_bench_questions():
        seen.setdefault(q["category"], tok.encode(q["turns"][0])[:PROMPT_TOKENS])
    prompts = list(seen.values())
    wants = {}

    def get(dtype: str):
        if dtype not in wants:
            engine = real_models.engine(SMOL, dtype, block_size=16, num_blocks=256, max_num_batched_tokens=2048)
            wants[dtype] = [o.token_ids for o in run(engine, prompts, greedy())]
        return prompts, wants[dtype]

    return get


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_outputs_with_speculation_equal_outputs_without(real_models, category_prompts, method, dtype,
                                                               tmp_path):
    prompts, want = category_prompts(dtype)
    assert len(prompts) >= 13
    spec = method_config(method, num_speculative_tokens=3)
    if method == "draft_model":
        spec["num_layers"] = 4
    if method == "retrieval":   # a corpus that holds every other category's prompt and answer
        _, tok = real_models.loom(SMOL)
        (tmp_path / "corpus.txt").write_text("\n".join(tok.decode(p + w) for p, w in list(zip(prompts, want))[::2]))
        spec["datastore"] = str(tmp_path / "corpus.txt")
    batched = real_models.engine(SMOL, dtype, block_size=16, num_blocks=256, max_num_batched_tokens=2048,
                                 speculative_config=spec)
    got = [o.token_ids for o in run(batched, prompts, greedy(), check=True)]
    assert got == want
    stats = batched.runner.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    for i in (0,):   # alone
        alone = real_models.engine(SMOL, dtype, block_size=16, num_blocks=64, speculative_config=spec)
        assert run(alone, [prompts[i]], greedy())[0].token_ids == want[i]
        assert alone.runner.spec.stats.num_draft_tokens > 0


@pytest.mark.real_model
def test_greedy_outputs_with_predictions_equal_outputs_without(real_models, category_prompts):
    """Each request predicts its own answer with a span in the middle rewritten: drafts follow
    the prediction, leave it at the rewrite, find it again after, and change no token."""
    prompts, want = category_prompts("auto")
    _, tok = real_models.loom(SMOL)
    engine = real_models.engine(SMOL, "auto", block_size=16, num_blocks=256, max_num_batched_tokens=2048,
                                speculative_config={"method": "auto"})
    ids = []
    for p, w in zip(prompts, want):
        third = len(w) // 3
        prediction = tok.decode(w[:third]) + " something else entirely " + tok.decode(w[2 * third:])
        ids.append(engine.add_request({"prompt_token_ids": p}, greedy().clone(prediction=prediction)))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[i].outputs[0].token_ids for i in ids] == want
    assert sum(final[i].metrics.num_accepted_draft_tokens for i in ids) > 0
    # one stream whose whole answer is predicted: most of it comes from drafts
    long = greedy().clone(max_tokens=48)
    answer = run_alone_with(real_models.engine(SMOL, "auto", block_size=16, num_blocks=64), prompts[0], long)
    alone = real_models.engine(SMOL, "auto", block_size=16, num_blocks=64, speculative_config={"method": "auto"})
    out = run_alone_with(alone, prompts[0], long.clone(prediction=tok.decode(answer.token_ids)))
    assert out.token_ids == answer.token_ids
    assert out.metrics.num_accepted_draft_tokens >= 24, out.metrics


def run_alone_with(engine: Engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                return type("Out", (), {"token_ids": o.outputs[0].token_ids, "metrics": o.metrics})


def test_cost_model_never_estimates_zero_or_below_the_plain_pass():
    from loom.speculative.controller import CostModel

    cost = CostModel()
    cost.observe(1, 0, 0.010)
    cost.observe(1, 4, 0.009)   # noise: a draft step measured faster than a plain one
    cost.observe(1, 8, 0.002)
    for extra in (0, 1, 8, 16, 64):
        assert cost.cost(1, extra) >= 0.010
    assert cost.cost(3, 32) > 0


def test_cost_model_prices_one_node_at_its_calibrated_point_not_the_next_segment_extended():
    """The first node of a batch costs more than each further one: from the segment between 8
    and 16 nodes alone, one node among 8 sequences would cost nothing (the curve would fall below
    the plain pass there); the calibration's X = 1 point prices it."""
    from loom.speculative.controller import CostModel

    cost = CostModel()
    for extra, seconds in ((0, 0.010), (8, 0.012), (16, 0.016)):
        cost.calibrate(8, extra, seconds)
    assert cost.cost(8, 1) == cost.cost(8, 0)      # the segment (8, 16) extended down to one node
    cost = CostModel()
    for extra, seconds in ((0, 0.010), (1, 0.0115), (8, 0.012), (16, 0.016)):
        cost.calibrate(8, extra, seconds)
    assert cost.cost(8, 1) == pytest.approx(0.0115)
    assert cost.cost(8, 4) == pytest.approx(0.0115 + 0.0005 * 3 / 7)
    ctl = SpecController(4, lambda k: k)
    ctl.cost = cost
    ids = [f"s{i}" for i in range(8)]
    assert ctl.plan(ids, 8, [0] * 7 + [1], 0.0) == [0] * 8   # one node that half the drafts pass: not worth 15%


def test_cost_model_keeps_the_calibrated_price_of_drafts_when_its_plain_average_drifts():
    """A slow moment inflates the learned plain-step cost; a draft then must not look free."""
    from loom.speculative.controller import CostModel

    cost = CostModel()
    cost.calibrate(8, 0, 0.015)
    cost.calibrate(8, 8, 0.025)              # a draft token costs 1/12 of the plain step each
    for _ in range(20):
        cost.observe(8, 0, 0.022)            # the machine slowed down while decoding plainly
    cost.observe(8, 1, 0.021)                # one step with a draft, measured at another moment
    assert cost.cost(8, 1) > cost.cost(8, 0)
    assert cost.cost(8, 8) >= cost.cost(8, 0) * 0.025 / 0.015 * 0.999


def test_cost_model_prices_drafts_at_the_batch_context_length():
    """Draft rows attend over their whole context: a calibration at a short context alone
    would underprice them in a long one (and drafting would then lose)."""
    from loom.speculative.controller import CostModel

    cost = CostModel()
    for ctx, plain, drafted in ((64, 0.015, 0.020), (1024, 0.020, 0.040)):
        cost.calibrate(8, 0, plain, ctx)
        cost.calibrate(8, 8, drafted, ctx)
    for _ in range(20):
        cost.observe(8, 0, 0.018)
    short, long_, mid = (cost.cost(8, 8, c) / cost.cost(8, 0, c) for c in (64, 1024, 544))
    assert short == pytest.approx(0.020 / 0.015)
    assert long_ == pytest.approx(0.040 / 0.020)
    assert mid == pytest.approx(0.030 / 0.0175)
    assert cost.cost(8, 8, 2048) / cost.cost(8, 0, 2048) > long_     # extended past the longest


def test_controller_drafts_in_a_short_context_and_not_in_a_long_one_where_drafts_cost_more():
    ctl = SpecController(8, depth=lambda k: k)
    # a draft row costs 1/40 of a plain row's share of the step at 64 tokens, 70% of it at 1024
    for ctx, plain, drafted in ((64, 0.010, 0.012), (1024, 0.012, 0.080)):
        ctl.cost.calibrate(8, 0, plain, ctx)
        ctl.cost.calibrate(8, 64, drafted, ctx)
    for _ in range(10):
        ctl.record("s0", 1, 4)               # half of the drafts accepted
    ids = [f"s{i}" for i in range(8)]
    assert sum(ctl.plan(ids, 8, [8] * 8, 0.0, context=64)) > 0
    assert ctl.plan(ids, 8, [8] * 8, 0.0, context=1024) == [0] * 8


def test_controller_counts_the_work_each_drafting_sequence_adds_outside_the_forward_pass():
    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(1, 0, 0.010)
    ctl.cost.observe(1, 8, 0.012)
    for _ in range(10):
        ctl.record("a", 1, 4)                # a modest acceptance rate
    assert ctl.plan(["a"], 1, [8], 0.0, seq_overhead=0.0)[0] > 0
    assert ctl.plan(["a"], 1, [8], 0.0, seq_overhead=0.020) == [0]


def test_controller_skips_the_search_for_a_few_steps_after_one_that_found_no_draft_worth_it():
    from loom.speculative.controller import IDLE_REPLAN

    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(8, 0, 0.020)
    ctl.cost.observe(8, 64, 0.200)          # drafts cost as much as whole steps: no drafts
    for _ in range(10):
        ctl.record("a", 4, 4)
    ids = [f"s{i}" for i in range(8)]
    assert ctl.plan(ids, 8, [8] * 8, 0.0) == [0] * 8
    for _ in range(30):
        ctl.cost.observe(8, 64, 0.021)      # drafts became almost free
    for _ in range(IDLE_REPLAN - 1):
        assert ctl.plan(ids, 8, [8] * 8, 0.0) == [0] * 8
    assert sum(ctl.plan(ids, 8, [8] * 8, 0.0)) > 0


def test_the_draft_budget_goes_to_the_rows_most_accepted_and_shrinks_to_zero_when_compute_bound():
    """TETRIS-style budgeting: a roofline cost (memory-bound: extra tokens free up to ~8 in a
    step; compute-bound past it), rows with high and low acceptance."""
    ctl = SpecController(8, depth=lambda k: k)
    for b in (1, 2, 4, 8, 16):
        for x in (0, b, 2 * b, 4 * b, 8 * b):
            ctl.cost.calibrate(b, x, max(0.010, 0.0012 * (b + x)))
    for _ in range(20):
        for i in range(16):
            ctl.record(f"s{i}", 4 if i % 2 == 0 else 0, 4)     # even rows accepted, odd ones not
    totals = {}
    for b in (1, 2, 4, 8, 16):
        ids = [f"s{i}" for i in range(b)]
        sizes = ctl.plan(ids, b, [8] * b, 0.0)
        totals[b] = sum(sizes)
        assert all(sizes[i] >= sizes[i + 1] for i in range(0, b - 1, 2))   # accepted rows first
    assert totals[1] > 0 and totals[2] > 0
    assert totals[16] == 0
    assert all(totals[a] >= totals[b] for a, b in ((1, 4), (4, 8), (8, 16)))


def test_the_search_backs_off_further_while_its_plans_keep_drafting_nothing():
    from loom.speculative.controller import IDLE_MAX, IDLE_REPLAN

    ctl = SpecController(8, depth=lambda k: k)
    ctl.cost.observe(1, 0, 0.010)
    ctl.cost.observe(1, 8, 0.100)           # drafts cost as much as whole steps: no drafts
    full_plans, skipped, calls = [], 0, 0
    searched = ctl._idle_plans               # plans left to skip, per batch size
    while calls < 200:
        before = searched.get(1, 0)
        assert ctl.plan(["a"], 1, [8], 0.0)[0] <= 1      # a one-node probe every PROBE_EVERY steps
        calls += 1
        if before == 0:
            full_plans.append(calls)
    gaps = [b - a for a, b in zip(full_plans, full_plans[1:])]
    assert gaps[:4] == [IDLE_REPLAN, 2 * IDLE_REPLAN, 4 * IDLE_REPLAN, IDLE_MAX]
    assert set(gaps[4:]) == {IDLE_MAX}
    for _ in range(30):
        ctl.cost.observe(1, 8, 0.0101)      # drafts became almost free: found within IDLE_MAX steps
    assert any(sum(ctl.plan(["a"], 1, [8], 0.0)) > 1 for _ in range(IDLE_MAX))


# =============================================================================================
# Predicted outputs
# =============================================================================================


def test_prediction_index_follows_the_output_forward():
    from loom.speculative.drafters.prediction import _Index

    pred = (5, 6, 7, 8, 5, 6, 9, 10)
    index = _Index(pred, 1, 3)
    assert index.follow([], 3, 1, 3) == [5, 6, 7]               # nothing written yet: the start
    assert index.follow([5, 6, 7], 2, 1, 3) == [8, 5]
    assert index.follow([5, 6, 7, 8, 5, 6], 3, 1, 3) == [9, 10]  # the later "5 6": past the cursor
    assert index.follow([1, 2], 2, 1, 3) == []                   # no tail n-gram in the prediction
    again = _Index(pred, 1, 3)
    assert again.follow([42, 6], 2, 1, 3) == [7, 8]               # left the prediction, back at "6"


def test_a_prediction_drafts_without_changing_the_greedy_output(tiny_parts):
    _, _, tok = tiny_parts
    prompt = [tok.encode("the cat sat on the mat and then the cat")]
    plain = run(tiny_engine(tiny_parts), prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    truth = tok.decode(plain.token_ids)
    half = tok.decode(plain.token_ids[:8]) + " and something else " + tok.decode(plain.token_ids[12:])
    for method in ("prediction", "auto", "prompt_lookup"):
        for prediction, most in ((truth, True), (half, False), ("unrelated words here", False)):
            engine = tiny_engine(tiny_parts, {"method": method, "adaptive": False})
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prediction=prediction)
            rid = engine.add_request({"prompt_token_ids": prompt[0]}, params)
            out = None
            while engine.has_unfinished_requests():
                out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
            assert out.outputs[0].token_ids == plain.token_ids, (method, prediction)
            m = out.metrics
            assert 0 <= m.num_accepted_draft_tokens <= m.num_draft_tokens
            if most:   # the prediction is the answer: most of it is accepted
                assert m.num_accepted_draft_tokens >= 12, (method, m)
            engine.kv.check_integrity()


def test_a_prediction_is_a_hint_without_speculation_and_refused_with_what_is_not_drafted(tiny_parts, caplog):
    engine = tiny_engine(tiny_parts)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with caplog.at_level("WARNING", logger="loom"):
        hinted = run_to_end(engine, ["hello", "hello"], [greedy.clone(prediction="hello world"), greedy])
    assert hinted[0].outputs[0].token_ids == hinted[1].outputs[0].token_ids   # the output is the same
    assert sum("prediction is ignored" in r.message for r in caplog.records) == 1
    for bad, field in (({"logprobs": 2}, "logprobs"), ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence"),
                       ({"logit_bias": {3: 1.0}}, "logit_bias")):
        with pytest.raises(InvalidRequestError, match=f"prediction cannot be combined with {field}"):
            SamplingParams(prediction="x", **bad)
    with pytest.raises(InvalidRequestError, match="prediction must be"):
        SamplingParams(prediction="")
    engine = tiny_engine(tiny_parts, {"method": "auto"})
    with pytest.raises(InvalidRequestError, match="prediction token ids"):
        engine.add_request("hello", SamplingParams(prediction_token_ids=[engine.model.cfg.vocab_size]))
    with pytest.raises(InvalidRequestError, match="longer than the context limit"):
        engine.add_request("hello", SamplingParams(prediction_token_ids=[5] * (engine.max_model_len + 1)))


def test_prediction_on_the_server_reports_its_accepted_and_rejected_tokens(tiny_parts):
    from fastapi.testclient import TestClient

    from loom.engine.async_engine import AsyncEngine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    body = {"prompt": "the cat sat on the mat", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(tiny_engine(tiny_parts))), served_model_name="tiny")) as http:
        plain = http.post("/v1/completions", json=body).json()
        assert "completion_tokens_details" not in plain["usage"]
        hinted = http.post("/v1/completions", json=body | {"prediction": {"type": "content", "content": "x"}})
        assert hinted.status_code == 200 and hinted.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        assert hinted.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    spec = tiny_engine(tiny_parts, {"method": "auto", "adaptive": False})
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(spec)), served_model_name="tiny")) as http:
        text = plain["choices"][0]["text"]
        done = http.post("/v1/completions", json=body | {"prediction": {"type": "content", "content": text}}).json()
        assert done["choices"][0]["text"] == text
        details = done["usage"]["completion_tokens_details"]
        # OpenAI's counts: the prediction's tokens found in the completion, and the others
        n_pred = len(http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"])
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == n_pred
        assert details["accepted_prediction_tokens"] >= n_pred - 2      # the same text (a token may split)
        wrong = http.post("/v1/completions", json=body | {"prediction": {"type": "content", "content": "zebra"}}).json()
        n_wrong = len(http.post("/tokenize", json={"prompt": "zebra", "add_special_tokens": False}).json()["tokens"])
        assert wrong["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] + \
            wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == n_wrong
        cut = http.post("/v1/completions", json=body | {"max_tokens": 3,
                                                        "prediction": {"type": "content", "content": text}}).json()
        assert cut["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] <= 3
        parts = {"type": "content", "content": [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]}
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_completion_tokens": 4, "prediction": parts,
                                                       "stream": True, "stream_options": {"include_usage": True}})
        usage = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")][-1]["usage"]
        assert set(usage["completion_tokens_details"]) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}
        bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "prediction": {"type": "text", "content": "x"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("prediction")


def test_a_small_kv_cache_keeps_the_contexts_it_can_hold():
    from loom.speculative.calibration import Grid

    small = Grid.fitting(context_length=8192, max_num_seqs=16, max_drafts=8, num_blocks=64, block_size=16)
    assert small.contexts == (64,) and small.batches == (1, 2, 4, 8) and small.points()
    full = Grid.fitting(context_length=8192, max_num_seqs=16, max_drafts=8, num_blocks=2048, block_size=16)
    assert full.contexts == (64, 1024) and full.batches == (1, 2, 4, 8, 16)
    assert not Grid.fitting(context_length=8192, max_num_seqs=16, max_drafts=8, num_blocks=4, block_size=16).points()


def test_a_predicted_request_has_its_own_starting_rate_and_wakes_an_idle_batch():
    from loom.speculative.controller import PREDICTION_RATE

    ctl = SpecController(4, lambda k: k)
    for _ in range(6):
        ctl.record("plain", 0, 2)           # drafts that never pay: the average falls
    low = ctl.rate("new")
    ctl.predicted("pred")
    assert ctl.rate("pred") == pytest.approx(PREDICTION_RATE) and low < 0.2
    for _ in range(6):
        ctl.record("pred", 4, 4)            # its own steps: they leave the average alone
    assert ctl.rate("new") == pytest.approx(low) and ctl.rate("pred") > PREDICTION_RATE
    ctl._idle_plans[8] = 5
    assert ctl.idle(8)
    ctl.wake(8)
    assert not ctl.idle(8)


def test_a_program_thread_stops_where_one_token_steps_would(tiny_parts):
    """Thread.run(max_new_tokens=...) and run(until=...) under speculation stop at the token a
    step of one token stops at, though a verified step may commit many: drafts are cut to the
    tokens left (max_new_tokens), and none are made while a text is awaited (until)."""
    from loom.parallel.program import Program

    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
    base = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    whole = run(tiny_engine(tiny_parts), [prompt["prompt_token_ids"]], base)[0]
    until = whole.text[len(tiny_parts[2].decode(whole.token_ids[:9])):len(tiny_parts[2].decode(whole.token_ids[:11]))]
    assert until
    threads = []
    for engine, params in ((tiny_engine(tiny_parts), base),     # every draft accepted: the prediction is the output
                           (tiny_engine(tiny_parts, {"method": "prediction", "adaptive": False}),
                            base.clone(prediction=whole.text))):
        t = Program(engine).start(prompt, params).run(max_new_tokens=4)
        first = list(t.token_ids)
        t.run(until=until)
        threads.append((first, list(t.token_ids)))
    assert threads[0] == threads[1] and len(threads[0][0]) == 4
    assert threads[0][1] == whole.token_ids[:len(threads[0][1])]
