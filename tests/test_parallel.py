"""Parallel generation: fan-out sharing KV blocks, aggregators, early stopping, beam search, fork/join.

Layers, cheapest first:
  1. Scheduler.fork with a fake runner: exact refcounts and copy-on-write block copies.
  2. Aggregators and answer extractors on hand-made completions.
  3. The engine on the tiny random llama: prompts prefilled once, seeded children equal to
     runs alone with the derived seeds, best_of ranking, early stopping freeing blocks,
     mid-generation forks, fork/join threads.
  4. Beam search: width 1 is greedy, and transformers' beam search gives the same sequences and
     scores (stop ids chosen from the greedy text, so hypotheses really end on them).
  5. The OpenAI server in-process: n, best_of and the "loom" extension.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_gguf
import torch

from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.contracts import RunnerOutput
from loom.engine.engine import Engine
from loom.contracts import derive_seed
from loom.engine.request import Request, RequestStatus
from loom.engine.scheduler import Scheduler
from loom.errors import InvalidRequestError
from loom.llm import LLM
from loom.outputs import CompletionOutput, FinalOutputs
from loom.parallel.aggregators import (
    AggregateResult,
    BestOfN,
    FirstFinish,
    MajorityVote,
    ShortMAtK,
    WeightedMajorityVote,
    create_aggregator,
    create_extractor,
    sample_and_aggregate,
)
from loom.parallel.beam import BeamSearchParams
from loom.parallel.program import Program
from loom.sampling_params import SamplingParams

BS = 4  # block size of the engine tests: prompts of odd lengths end in a shared partial block


@pytest.fixture(scope="module")
def tiny_parts(tiny_llama_path: Path):
    """The tiny model and tokenizer, loaded once for every engine of this module."""
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer
    from loom.model.build import load_model

    f = GGUFFile.open(tiny_llama_path)
    return load_model(f), Tokenizer.from_gguf(f)


@pytest.fixture
def make_engine(tiny_llama_path: Path, tiny_parts):
    model, tok = tiny_parts

    def make(num_blocks: int = 256, **options) -> Engine:
        config = EngineConfig.create(str(tiny_llama_path), num_blocks=num_blocks, block_size=BS, threads=1,
                                     **options)
        return Engine(config, model=model, tokenizer=tok)

    return make


def drain(engine: Engine, check: bool = True) -> dict[str, object]:
    final, gather = {}, FinalOutputs()
    while engine.has_unfinished_requests():
        for out in gather.add_all(engine.step()):
            final[out.request_id] = out
        if check:
            engine.kv.check_integrity()
    return final


PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks of 4 and one partial block
SAMPLED = dict(temperature=1.0, ignore_eos=True)


# =============================================================================================
# 1. Scheduler.fork with a fake runner
# =============================================================================================


def test_scheduler_fork_shares_blocks_and_copies_the_partial_block_on_write():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 32, 128)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    parent = Request("p", list(range(100, 110)), params, 4)  # 10 tokens: blocks [4, 4, 2]
    parent.compute_limit = 9
    s.add(parent)
    plan = s.schedule()
    assert [len(q.token_ids) for q in plan.seqs] == [9] and not plan.seqs[0].sample
    s.update(plan, RunnerOutput({}))
    assert parent.num_computed_tokens == 9
    table = s.kv.block_table("p")
    kids = [Request(f"c{i}", list(parent.all_token_ids), params, 4) for i in range(3)]
    s.fork("p", kids)
    s.finish("p", RequestStatus.FINISHED_STOPPED)
    for block in table:
        assert s.kv.pool.refcount(block) == 3, "every child holds every block of the prompt"
    assert all(k.num_computed_tokens == 9 and k.status is RequestStatus.RUNNING for k in kids)
    s.kv.check_integrity()
    plan = s.schedule()
    assert [(q.req_id, len(q.token_ids), q.sample) for q in plan.seqs] == [(f"c{i}", 1, True) for i in range(3)]
    # the shared partial block is copied by two children; the last writer keeps the original
    assert [src for src, _ in plan.block_copies] == [table[2], table[2]]
    tables = [s.kv.block_table(f"c{i}") for i in range(3)]
    assert all(t[:2] == table[:2] for t in tables) and len({t[2] for t in tables}) == 3
    s.update(plan, RunnerOutput({f"c{i}": [7] for i in range(3)}))
    s.kv.check_integrity()


def test_scheduler_fork_rejects_foreign_tokens_and_used_ids():
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 16, 64)
    s.add(Request("p", [1, 2, 3, 4, 5], SamplingParams(), 4))
    s.update(plan := s.schedule(), RunnerOutput({"p": [9]}))
    assert plan.seqs and s.requests["p"].num_computed_tokens == 5
    with pytest.raises(ValueError, match="does not start"):
        s.fork("p", [Request("x", [1, 2, 9, 4, 5, 6], SamplingParams(), 4)])
    with pytest.raises(ValueError, match="in use"):
        s.fork("p", [Request("p", [1, 2, 3, 4, 5, 9], SamplingParams(), 4)])


# =============================================================================================
# 2. Aggregators on hand-made completions
# =============================================================================================


def child(i: int, text: str, n_tokens: int, logprob: float | None, reason: str | None = "stop") -> CompletionOutput:
    return CompletionOutput(i, text, list(range(n_tokens)), logprob, finish_reason=reason)


def test_extractors():
    gsm = create_extractor("gsm8k")
    assert gsm("so 3 + 4 = 7\n#### 1,234.0") == "1234"
    assert gsm("the answer is $72.") == "72"
    assert create_extractor("gsm8k", fallback_last_number=False)("it is 72") is None
    assert create_extractor("last_number")("from 3 to -4.50 dollars") == "-4.5"
    assert create_extractor("regex", pattern=r"ANSWER: (\w+)")("ANSWER: no ... ANSWER: yes") == "yes"
    choice = create_extractor("choice")
    assert choice("I think the answer is (c).") == "C"
    assert choice("Between A and B, B") == "B"
    assert choice("no letter here") is None
    with pytest.raises(InvalidRequestError, match="unknown answer extractor"):
        create_extractor("nope")


def test_best_of_majority_and_weighted_voting():
    kids = [child(0, "x #### 5", 10, -5.0), child(1, "y #### 7", 4, -3.0), child(2, "z #### 7", 20, -30.0),
            child(3, "w #### 5", 2, -0.1, reason="abort")]
    mean = BestOfN("mean").aggregate(kids)
    assert (mean.index, mean.scores) == (0, [-0.5, -0.75, -1.5, None])
    assert BestOfN("total").aggregate(kids).index == 1
    assert BestOfN(scorer=lambda c: len(c.text) + c.index).aggregate(kids).index == 2
    vote = MajorityVote("gsm8k").aggregate(kids)
    assert vote == AggregateResult(1, "7", [1.0, 1.0, 1.0, None], {"5": 1.0, "7": 2.0}), "aborted children never vote"
    # weights exp(mean logprob): 0.61, 0.47, 0.22; the last is below 0.5 * 0.61 and is pruned
    weighted = WeightedMajorityVote("gsm8k", prune_ratio=0.5).aggregate(kids)
    assert weighted.answer == "5" and weighted.scores[2] is None and set(weighted.votes) == {"5", "7"}
    assert WeightedMajorityVote("gsm8k", prune_ratio=0.0).aggregate(kids).answer == "7"
    tie = MajorityVote().aggregate([child(0, "1", 9, -1.0), child(1, "2", 3, -1.0)])
    assert tie.answer == "2", "ties go to the shorter child"
    assert MajorityVote().aggregate([child(0, "none", 3, -1.0)]) == AggregateResult(None, None, [None], {})


def test_early_stopping_aggregators_and_registry():
    running = CompletionOutput(9, "", [1, 2, 3])
    first = FirstFinish()
    assert not first.should_stop([running, child(1, "a", 5, None, reason="abort")])
    kids = [running, child(1, "#### 4", 6, None), child(2, "#### 3", 5, None, reason="length")]
    assert first.should_stop(kids) and first.aggregate(kids).index == 2, "fewest tokens finished first"
    m2 = ShortMAtK(m=2, extract="gsm8k")
    assert m2.should_stop(kids) and not m2.should_stop(kids[:2])
    late = kids + [child(3, "#### 4", 9, None)]
    result = m2.aggregate(late)
    assert result.votes == {"4": 1.0, "3": 1.0} and result.answer == "3", "the first m only; ties go to the shortest"
    assert ShortMAtK(m=5).should_stop(late[1:]), "m beyond k waits for all k"
    assert isinstance(create_aggregator("short_m_at_k", m=3, extract="gsm8k"), ShortMAtK)
    with pytest.raises(InvalidRequestError, match="unknown aggregator"):
        create_aggregator("vote-harder")
    with pytest.raises(InvalidRequestError, match="short_m_at_k"):
        create_aggregator("short_m_at_k", bogus=1)


# =============================================================================================
# 3. The engine on the tiny model
# =============================================================================================


def test_children_share_the_prompt_which_is_computed_once(make_engine):
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=5, seed=3, **SAMPLED))
    seen_shared = False
    gather, finals = FinalOutputs(), []
    while engine.has_unfinished_requests():
        finals += gather.add_all(engine.step())
        kids = [k for k in engine.scheduler.requests if k.startswith(f"{rid}/")]
        if len(kids) == 4 and not seen_shared:  # just forked: nothing written yet
            tables = [engine.kv.block_table(k) for k in kids]
            assert all(t == tables[0] for t in tables)
            assert [engine.kv.pool.refcount(b) for b in tables[0]] == [4] * len(tables[0])
            seen_shared = True
        engine.kv.check_integrity()
    assert seen_shared
    stats = engine.scheduler.stats
    assert stats.prompt_tokens_computed == len(PROMPT) - 1 + 4, "one prefill plus each child's last token"
    assert stats.prompt_tokens == 4 * len(PROMPT), "each choice counts its prompt, as vLLM's children do"
    [out] = finals
    assert out.request_id == rid and out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for c in out.outputs:
        assert len(c.token_ids) == 5 and c.text and c.finish_reason == "length"
        assert c.cumulative_logprob is not None and c.cumulative_logprob < 0 and c.logprobs is None
    assert engine.kv.usage() == 0


def test_seeded_children_match_requests_run_alone(make_engine):
    """Copy-on-write correctness: each child wrote into a copy of the shared partial block."""
    engine = make_engine()
    params = SamplingParams(n=4, max_tokens=8, seed=11, logprobs=1, **SAMPLED)
    group = LLM.from_engine(engine).generate({"prompt_token_ids": PROMPT}, params)[0]
    for c in group.outputs:
        alone = SamplingParams(max_tokens=8, seed=derive_seed(11, c.index), logprobs=1, **SAMPLED)
        single = LLM.from_engine(make_engine()).generate({"prompt_token_ids": PROMPT}, alone)[0].outputs[0]
        assert c.token_ids == single.token_ids
        assert c.cumulative_logprob == pytest.approx(single.cumulative_logprob, abs=1e-4)
        assert len(c.logprobs) == 8
    assert len({tuple(c.token_ids) for c in group.outputs}) == 4


def test_best_of_returns_the_most_probable_children(make_engine):
    params = dict(max_tokens=6, seed=5, **SAMPLED)
    every = LLM.from_engine(make_engine()).generate({"prompt_token_ids": PROMPT}, SamplingParams(n=5, **params))[0]
    best = LLM.from_engine(make_engine()).generate({"prompt_token_ids": PROMPT},
                                                   SamplingParams(n=2, best_of=5, **params))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]


def many_stops(engine: Engine) -> tuple[int, ...]:
    """Every third token id stops: seeded children then finish after different lengths."""
    return tuple(range(3, engine.model.cfg.vocab_size, 3))


@pytest.mark.parametrize("policy", [FirstFinish(), ShortMAtK(m=2, extract=lambda text: "same")])
def test_early_stopping_aborts_the_rest_and_frees_their_blocks(make_engine, policy):
    engine = make_engine()
    params = SamplingParams(n=6, max_tokens=40, seed=1, temperature=1.0, stop_token_ids=many_stops(engine))
    [result] = sample_and_aggregate(engine, [{"prompt_token_ids": PROMPT}], params, policy)
    reasons = [c.finish_reason for c in result.output.outputs]
    done = [c for c in result.output.outputs if c.finish_reason != "abort"]
    want = 1 if isinstance(policy, FirstFinish) else 2
    assert len(done) >= want and reasons.count("abort") >= 1, reasons
    assert max(len(c.token_ids) for c in done) <= min(len(c.token_ids) for c in result.output.outputs
                                                      if c.finish_reason == "abort")
    assert result.result.index is not None and reasons[result.result.index] != "abort"
    assert not engine.has_unfinished_requests() and engine.kv.usage() == 0
    engine.kv.check_integrity()


def test_abort_of_a_group_frees_every_child(make_engine):
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, **SAMPLED))
    for _ in range(4):
        engine.step()
    assert engine.kv.usage() > 0
    ended = engine.abort(rid)
    assert ended[-1].finished and not any(o.finished for o in ended[:-1])
    assert [(c.index, c.finish_reason) for o in ended for c in o.outputs] == [(i, "abort") for i in range(3)]
    assert engine.kv.usage() == 0 and not engine.has_unfinished_requests()
    other = engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=50, **SAMPLED))
    while other in engine.scheduler.requests:  # until it forked: only its children are scheduled
        engine.step()
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.add_request(PROMPT, SamplingParams(), request_id=other)
    engine.abort(other)
    assert engine.kv.usage() == 0


def test_fork_mid_generation_continues_from_everything_so_far(make_engine):
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    parent = engine.scheduler.requests[rid]
    so_far = list(parent.all_token_ids)
    kids = engine.fork(rid, 2, append_token_ids=[[40, 41], [50]])
    for kid, extra in zip(kids, ([40, 41], [50])):
        req = engine.scheduler.requests[kid]
        assert req.all_token_ids == so_far + extra and req.num_computed_tokens == parent.num_computed_tokens
    shared = engine.kv.block_table(kids[0])[:parent.num_computed_tokens // BS]
    assert all(engine.kv.pool.refcount(b) == 3 for b in shared)
    final = drain(engine)
    for kid, extra in zip(kids, ([40, 41], [50])):
        alone = LLM.from_engine(make_engine()).generate(
            {"prompt_token_ids": so_far + extra}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        assert final[kid].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.kv.usage() == 0


def test_fork_join_program(make_engine):
    engine = make_engine()
    prog = Program(engine)
    main = prog.start({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    main.run(max_new_tokens=3)
    assert main.paused and len(main.token_ids) == 3
    before = main.text
    req = engine.scheduler.requests[main.request_id]
    kids = main.spawn([" one", " two", " three"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert all(engine.kv.pool.refcount(b) == 4 for b in engine.kv.block_table(main.request_id)[:req.num_computed_tokens // BS])
    joined = main.join(kids, template="[{prefix}:{text}]", sep="")
    assert all(k.finished and len(k.token_ids) == 4 for k in kids)
    assert joined == "".join(f"[{k.prefix}:{k.text}]" for k in kids)
    text = main.wait()
    assert text.startswith(before + joined) and len(main.token_ids) == 30
    assert engine.kv.usage() == 0
    engine.kv.check_integrity()


# =============================================================================================
# 4. Beam search
# =============================================================================================


def test_beam_width_one_is_greedy(make_engine):
    llm = LLM.from_engine(make_engine())
    for prompt in (PROMPT, [5, 9, 200, 31]):
        greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=10, logprobs=0,
                                                                           ignore_eos=True))[0].outputs[0]
        beam = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(1, 10, ignore_eos=True))[0]
        assert beam.sequences[0].token_ids == greedy.token_ids
        assert beam.sequences[0].cumulative_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-4)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_path: Path):
    return tiny_gguf.load_transformers(tiny_llama_path)[0]


BEAM_CASES = [  # prompt, beam width, length penalty, early stopping
    ([16, 66, 328, 99, 313], 4, 1.0, False),
    ([97, 370, 66, 248, 110, 375, 34, 350, 14], 3, 0.7, True),
    (list(range(40, 60)), 4, 2.0, "never"),
    ([203, 105, 136, 186, 377, 243], 5, -1.0, False),
]


@pytest.mark.parametrize("prompt,width,length_penalty,early_stopping", BEAM_CASES)
def test_beam_search_matches_transformers(make_engine, hf_tiny, prompt, width, length_penalty, early_stopping):
    """Same sequences, in the same order, with the same scores. The stop id is a token of the
    greedy continuation, so hypotheses do end on it mid-search."""
    engine = make_engine()
    greedy = hf_tiny.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=1)
    stop = int(greedy[0, len(prompt) + 2])
    eos = sorted(engine.tokenizer.stop_token_ids | {stop})
    ours = LLM.from_engine(engine).beam_search(
        {"prompt_token_ids": prompt},
        BeamSearchParams(width, 14, length_penalty=length_penalty, early_stopping=early_stopping,
                         stop_token_ids=(stop,)))[0]
    hf = hf_tiny.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=14, length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=eos, pad_token_id=1, return_dict_in_generate=True, output_scores=True)
    theirs = []
    for seq, score, beams in zip(hf.sequences, hf.sequences_scores, hf.beam_indices):
        n = int((beams != -1).sum())
        theirs.append((seq[len(prompt):len(prompt) + n].tolist(), score.item()))
    assert [s.token_ids for s in ours.sequences] == [t for t, _ in theirs]
    for s, (_, score) in zip(ours.sequences, theirs):
        assert s.score == pytest.approx(score, rel=1e-5)
        assert s.finish_reason == ("stop" if s.token_ids[-1] in eos else "length")
    assert engine.kv.usage() == 0
    engine.kv.check_integrity()


def test_beams_share_blocks_and_diverse_groups_differ(make_engine):
    engine = make_engine()
    most_shared = 0
    step = engine.step

    def watched():
        nonlocal most_shared
        outs = step()
        most_shared = max(most_shared, max(engine.kv.pool.refcount(b) for b in range(engine.kv.pool.num_blocks)))
        return outs

    engine.step = watched
    llm = LLM.from_engine(engine)
    plain = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(4, 8, ignore_eos=True))[0]
    assert most_shared >= 2, "beams hold common prefix blocks together"
    same = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(4, 8, num_groups=2, ignore_eos=True))[0]
    by_group = [sorted(tuple(s.token_ids) for s in same.sequences if s.group == g) for g in (0, 1)]
    assert by_group[0] == by_group[1], "without a penalty the groups search alike"
    diverse = llm.beam_search({"prompt_token_ids": PROMPT},
                              BeamSearchParams(4, 8, num_groups=2, diversity_penalty=100.0, ignore_eos=True))[0]
    firsts = [{s.token_ids[0] for s in diverse.sequences if s.group == g} for g in (0, 1)]
    assert not firsts[0] & firsts[1], "a large penalty keeps group 1 off group 0's tokens"
    assert len(plain.sequences) == len(diverse.sequences) == 4
    assert engine.kv.usage() == 0
    with pytest.raises(InvalidRequestError, match="multiple of num_groups"):
        BeamSearchParams(3, 8, num_groups=2)
    with pytest.raises(InvalidRequestError, match="top"):
        llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(11, 4))


def test_beam_search_reads_as_vllm_s(make_engine):
    """vLLM's import path, names and options: `tokens` (prompt and output), `cum_logprob`,
    include_stop_str_in_output, use_tqdm; options past max_tokens by keyword (vLLM's third is
    ignore_eos, loom's fields differ), a temperature is refused."""
    import loom
    from loom.sampling_params import BeamSearchParams as FromParams

    assert FromParams is BeamSearchParams is loom.BeamSearchParams
    llm = LLM.from_engine(make_engine())
    out = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(2, 6), use_tqdm=True)[0]
    for seq in out.sequences:
        assert seq.tokens == PROMPT + seq.token_ids and seq.cum_logprob == seq.cumulative_logprob
    eos = llm.engine.tokenizer.eos_token_id
    with_eos = BeamSearchParams(2, 6, stop_token_ids=[PROMPT[-1]], include_stop_str_in_output=True)
    stopped = [s for s in llm.beam_search({"prompt_token_ids": PROMPT}, with_eos)[0].sequences
               if s.finish_reason == "stop"]
    for seq in stopped:
        assert seq.text == llm.engine.tokenizer.decode(seq.token_ids) and seq.token_ids[-1] in (eos, PROMPT[-1])
    with pytest.raises(TypeError):
        BeamSearchParams(2, 6, True)
    with pytest.raises(InvalidRequestError, match="temperature must be 0"):
        BeamSearchParams(2, 6, temperature=0.7)


# =============================================================================================
# 5. The OpenAI server, in-process
# =============================================================================================


@pytest.fixture
def api(make_engine):
    from fastapi.testclient import TestClient

    from loom.engine.async_engine import AsyncEngine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    engine = make_engine()
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(engine)), served_model_name="tiny")) as client:
        yield client, engine


def test_server_n_best_of_and_loom_extension(api):
    client, engine = api
    base = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 1.0, "seed": 4,
            "ignore_eos": True}
    four = client.post("/v1/completions", json={**base, "n": 4}).json()
    assert [c["index"] for c in four["choices"]] == [0, 1, 2, 3] and "loom" not in four
    assert four["usage"]["completion_tokens"] == 24
    best = client.post("/v1/completions", json={**base, "n": 2, "best_of": 4}).json()
    assert len(best["choices"]) == 2
    assert client.post("/v1/completions", json={**base, "n": 2, "best_of": 4, "stream": True}).status_code == 400
    body = {**base, "n": 4, "loom": {"aggregate": "majority", "extract": "regex", "pattern": r"(\w+)$",
                                     "return_children": True}}
    voted = client.post("/v1/completions", json=body).json()
    [result] = voted["loom"]["results"]
    assert len(voted["choices"]) == 1 and len(result["children"]) == 4
    assert voted["choices"][0]["text"] == result["children"][result["chosen_index"]]["text"]
    assert result["votes"][result["answer"]] == max(result["votes"].values())
    stops = list(range(3, engine.model.cfg.vocab_size, 3))
    early = {**base, "max_tokens": 40, "seed": 1, "ignore_eos": False, "stop_token_ids": stops[:16], "n": 6,
             "loom": {"aggregate": "best_of", "early_stop": {"policy": "first_finish"}, "return_children": True}}
    first = client.post("/v1/completions", json=early).json()
    reasons = [c["finish_reason"] for c in first["loom"]["results"][0]["children"]]
    assert "abort" in reasons and first["choices"][0]["finish_reason"] != "abort"
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "n": 3,
        "loom": {"aggregate": "best_of", "score": "total"}}).json()
    assert len(chat["choices"]) == 1 and len(chat["loom"]["results"][0]["scores"]) == 3
    stream = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "stream": True,
        "loom": {"aggregate": "majority"}})
    assert stream.status_code == 400
    for loom, field in (({"aggregate": "majority", "pattern": "x"}, "loom.pattern"),
                        ({"aggregate": "best_of", "prune_ratio": 0.3}, "loom.prune_ratio"),
                        ({"early_stop": {"policy": "first_finish", "m": 2}}, "loom.early_stop.m"),
                        ({"early_stop": {"policy": "short_m_at_k", "m": 10}}, "loom.early_stop.m"),
                        ({"return_children": True}, "loom.return_children"),
                        ({"aggregate": "best_of", "extract": "gsm8k"}, "loom.extract")):
        unused = client.post("/v1/completions", json={**base, "n": 4, "loom": loom})
        assert unused.status_code == 400 and unused.json()["error"]["param"] == field, (loom, unused.text)
    assert engine.kv.usage() == 0
