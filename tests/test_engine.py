"""Engine core: the scheduler on its own (fake runner outputs), then the whole engine.

Layers, cheapest first:
  1. Scheduler with hand-made RunnerOutputs: exact grants, block tables, preemption order,
     stop conditions and block accounting (milliseconds, no model).
  2. Engine on the tiny random llama: request validation, abort, priority, chunked prefill
     next to decodes, stop strings in the stream, sampling and logprobs (seconds).
  3. Engine on the real SmolLM2: batch invariance across block sizes, token budgets and
     arrival times; preemption and prefix caching with real text.
"""

from __future__ import annotations

import random

import pytest
from conftest import MODEL_DTYPES

from loom.config import CacheConfig, SchedulerConfig
from loom.contracts import NewRequestData, RunnerOutput, ScheduledSeq
from loom.engine.engine import Engine
from loom.engine.request import Request, RequestStatus
from loom.engine.scheduler import Scheduler
from loom.errors import InvalidRequestError
from loom.model.runner import score
from loom.sampling_params import SamplingParams

EOS = 2
GREEDY = dict(temperature=0.0, ignore_eos=True)


# =============================================================================================
# 1. Scheduler with a fake runner
# =============================================================================================


def make_scheduler(budget: int = 64, max_seqs: int | None = None, block_size: int = 4, num_blocks: int = 32,
                   max_model_len: int = 128, prefix_caching: bool = False) -> Scheduler:
    max_seqs = min(8, budget) if max_seqs is None else max_seqs
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
                     num_blocks, max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, first: int = 100,
                 prompt: list[int] | None = None, **params) -> Request:
    ids = list(prompt) if prompt is not None else list(range(first, first + prompt_len))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(rid, ids, sp, max_tokens, priority=priority, eos_token_ids=frozenset({EOS}))


class FakeRunner:
    """Samples a scripted token per request (default 7) for every sequence that asks for one."""

    def __init__(self, tokens: dict[str, list[int]] | None = None):
        self.tokens = {k: list(v) for k, v in (tokens or {}).items()}
        self.known: set[str] = set()

    def __call__(self, out) -> RunnerOutput:
        for rid in out.finished_req_ids:
            assert rid in self.known, f"runner told to drop unknown request {rid}"
            self.known.discard(rid)
        for new in out.new_requests:
            assert new.req_id not in self.known, f"request {new.req_id} announced twice"
            self.known.add(new.req_id)
        sampled = {}
        for seq in out.seqs:
            assert seq.req_id in self.known, f"request {seq.req_id} scheduled before it was announced"
            if seq.sample:
                script = self.tokens.get(seq.req_id)
                sampled[seq.req_id] = [script.pop(0) if script else 7]
        return RunnerOutput(sampled)


def step(s: Scheduler, runner: FakeRunner):
    out = s.schedule()
    s.update(out, runner(out))
    s.kv.check_integrity()
    return out


def grants(out) -> list[tuple[str, int]]:
    return [(q.req_id, len(q.token_ids)) for q in out.seqs]


def run_to_end(s: Scheduler, runner: FakeRunner, limit: int = 500) -> list:
    outs = []
    while s.has_unfinished():
        outs.append(step(s, runner))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def test_prompt_is_prefilled_in_chunks_then_decoded():
    s, runner = make_scheduler(budget=4), FakeRunner({"a": [11, 12]})
    a = make_request("a", 10, max_tokens=2)
    s.add(a)
    out = step(s, runner)
    assert out.seqs == [ScheduledSeq("a", [100, 101, 102, 103], 0, [0], False)]
    assert out.new_requests == [NewRequestData("a", list(range(100, 110)), a.params)]
    out = step(s, runner)
    assert out.seqs == [ScheduledSeq("a", [104, 105, 106, 107], 4, [0, 1], False)]
    assert out.new_requests == []
    out = step(s, runner)
    assert out.seqs == [ScheduledSeq("a", [108, 109], 8, [0, 1, 2], True)]
    assert a.output_token_ids == [11] and a.num_computed_tokens == 10 and a.status is RequestStatus.RUNNING
    out = step(s, runner)
    assert out.seqs == [ScheduledSeq("a", [11], 10, [0, 1, 2], True)]
    assert a.output_token_ids == [11, 12]
    assert a.status is RequestStatus.FINISHED_LENGTH and not s.has_unfinished()
    assert s.kv.num_free_blocks() == 32 and s.kv.block_table("a") == []
    out = s.schedule()
    assert out.seqs == [] and out.finished_req_ids == ["a"]
    assert s.schedule().finished_req_ids == []  # reported once
    assert s.stats.prompt_tokens == s.stats.prompt_tokens_computed == 10 and s.stats.generation_tokens == 2


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: the salt goes into the blocks' hashes, so a prompt cached under one
    salt (or none) is no hit for another, and is one for the same salt."""
    s, runner = make_scheduler(budget=64, prefix_caching=True), FakeRunner()
    shared = list(range(100, 116))   # two full blocks of 8
    cached = {}
    for rid, salt in (("plain", None), ("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"), ("plain2", None)):
        s.add(make_request(rid, 0, max_tokens=2, prompt=shared + [1], cache_salt=salt))
        step(s, runner)
        cached[rid] = s.requests[rid].num_cached_tokens
    assert cached == {"plain": 0, "a1": 0, "b1": 0, "a2": 16, "plain2": 16}
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_decodes_are_granted_before_prefill_chunks():
    s, runner = make_scheduler(budget=4), FakeRunner()
    s.add(make_request("a", 3, max_tokens=10))
    assert grants(step(s, runner)) == [("a", 3)]
    s.add(make_request("b", 9, max_tokens=1, first=200))
    per_step = [grants(step(s, runner)) for _ in range(4)]
    assert per_step == [[("a", 1), ("b", 3)], [("a", 1), ("b", 3)], [("a", 1), ("b", 3)], [("a", 1)]]
    assert s.requests["a"].num_output_tokens == 5


def test_budget_is_spent_in_arrival_order_and_a_prompt_may_start_with_a_partial_chunk():
    s, runner = make_scheduler(budget=8), FakeRunner()
    for i, rid in enumerate("abc"):
        s.add(make_request(rid, 5, max_tokens=1, first=100 * (i + 1)))
    out = step(s, runner)
    assert grants(out) == [("a", 5), ("b", 3)]
    assert [q.sample for q in out.seqs] == [True, False]
    assert s.requests.keys() == {"b", "c"}  # a finished (max_tokens=1)
    assert grants(step(s, runner)) == [("b", 2), ("c", 5)]
    assert not s.has_unfinished()


def test_max_num_seqs_limits_running_requests():
    s, runner = make_scheduler(budget=64, max_seqs=2), FakeRunner()
    for i, rid in enumerate("abc"):
        s.add(make_request(rid, 2, max_tokens=3, first=100 * (i + 1)))
    first = step(s, runner)
    assert grants(first) == [("a", 2), ("b", 2)] and first.num_waiting == 1   # c waits
    assert grants(step(s, runner)) == [("a", 1), ("b", 1)]
    assert grants(step(s, runner)) == [("a", 1), ("b", 1)]
    last = step(s, runner)
    assert grants(last) == [("c", 2)] and last.num_waiting == 0


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s, runner = make_scheduler(budget=64, max_seqs=1), FakeRunner()
    s.add(make_request("late-low", 2, max_tokens=1, priority=5))
    s.add(make_request("urgent", 2, max_tokens=1, priority=-1, first=200))
    s.add(make_request("normal-1", 2, max_tokens=1, priority=0, first=300))
    s.add(make_request("normal-2", 2, max_tokens=1, priority=0, first=400))
    order = [out.seqs[0].req_id for out in run_to_end(s, runner)]
    assert order == ["urgent", "normal-1", "normal-2", "late-low"]


def _three_full_requests(priorities=(0, 0, 0)):
    """6 blocks of 4: three 7-token prompts fill them all; each request's 9th token needs a new block."""
    s, runner = make_scheduler(budget=64, num_blocks=6), FakeRunner()
    reqs = [make_request(rid, 7, max_tokens=4, priority=p, first=100 * (i + 1))
            for i, (rid, p) in enumerate(zip("abc", priorities))]
    for r in reqs:
        s.add(r)
    assert sorted(grants(step(s, runner))) == [("a", 7), ("b", 7), ("c", 7)]
    assert sorted(grants(step(s, runner))) == [("a", 1), ("b", 1), ("c", 1)]  # position 7: still block 2 of each
    assert s.kv.num_free_blocks() == 0
    return s, runner, reqs


def test_preemption_takes_the_latest_arrival_first():
    s, runner, (a, b, c) = _three_full_requests()
    out = step(s, runner)
    assert out.preempted_req_ids == ["c"]
    assert grants(out) == [("a", 1), ("b", 1)]
    # c's two blocks went to a and b, freed last-block first
    assert [q.block_table for q in out.seqs] == [[0, 1, 5], [2, 3, 4]]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.stats.num_preemptions == 1 and s.waiting == [c] and s.kv.block_table("c") == []
    assert c.output_token_ids == [7, 7]  # kept: recomputed with the prompt later


def test_preemption_takes_the_least_urgent_priority_first():
    s, runner, (a, b, c) = _three_full_requests(priorities=(3, 0, 0))
    out = step(s, runner)
    assert out.preempted_req_ids == ["a"]
    assert grants(out) == [("b", 1), ("c", 1)]


def test_request_preempts_itself_when_it_is_the_least_urgent():
    s, runner = make_scheduler(budget=64, num_blocks=4), FakeRunner()
    s.add(make_request("a", 7, max_tokens=8, priority=0))
    s.add(make_request("b", 7, max_tokens=8, priority=1, first=200))
    step(s, runner)
    step(s, runner)
    out = step(s, runner)  # a (more urgent) needs a 3rd block: b gives its blocks up
    assert out.preempted_req_ids == ["b"] and grants(out) == [("a", 1)]
    # a fills its blocks; b must wait for a to finish, then is recomputed with its output
    outs = run_to_end(s, runner)
    readmit = next(o for o in outs if any(q.req_id == "b" for q in o.seqs))
    b_seq = readmit.seqs[0]
    assert b_seq.req_id == "b" and b_seq.start_pos == 0 and b_seq.sample
    assert b_seq.token_ids == list(range(200, 207)) + [7, 7]
    assert readmit.new_requests == []  # the runner kept b's state
    assert s.stats.num_preemptions == 1
    assert s.kv.num_free_blocks() == 4


def test_preempted_request_is_not_readmitted_in_the_same_step():
    s, runner, (a, b, c) = _three_full_requests()
    out = step(s, runner)
    assert "c" in out.preempted_req_ids and all(q.req_id != "c" for q in out.seqs)


def test_preemption_keeps_every_request_and_frees_every_block():
    s, runner = make_scheduler(budget=16, num_blocks=8, max_seqs=8), FakeRunner()
    for i in range(8):
        s.add(make_request(f"r{i}", 5 + i % 3, max_tokens=6 + i % 4, first=50 * i))
    outs = run_to_end(s, runner)
    assert s.stats.num_preemptions > 0
    assert s.kv.num_free_blocks() == 8 and s.kv.usage() == 0.0
    assert s.stats.generation_tokens == sum(6 + i % 4 for i in range(8))
    assert sum(len(o.preempted_req_ids) for o in outs) == s.stats.num_preemptions


def test_abort_frees_blocks_and_tells_the_runner_once():
    s, runner = make_scheduler(budget=64), FakeRunner()
    s.add(make_request("a", 9, max_tokens=10))
    s.add(make_request("b", 3, max_tokens=10, first=200))
    step(s, runner)
    assert s.kv.num_free_blocks() == 32 - 3 - 1
    req = s.finish("a", RequestStatus.FINISHED_ABORTED)
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks() == 32 - 1 and s.running == [s.requests["b"]]
    out = step(s, runner)
    assert out.finished_req_ids == ["a"] and grants(out) == [("b", 1)]
    assert s.finish("a", RequestStatus.FINISHED_ABORTED) is None


def test_abort_of_a_waiting_request_is_not_sent_to_the_runner():
    s, runner = make_scheduler(budget=64, max_seqs=1), FakeRunner()
    s.add(make_request("a", 3, max_tokens=2))
    s.add(make_request("b", 3, max_tokens=2, first=200))
    step(s, runner)
    s.finish("b", RequestStatus.FINISHED_ABORTED)
    outs = run_to_end(s, runner)
    assert all(o.finished_req_ids == [] for o in outs)
    assert s.schedule().finished_req_ids == ["a"]
    assert s.kv.num_free_blocks() == 32


def test_abort_of_a_preempted_request_is_sent_to_the_runner():
    s, runner, (a, b, c) = _three_full_requests()
    step(s, runner)
    assert c.status is RequestStatus.PREEMPTED
    s.finish("c", RequestStatus.FINISHED_ABORTED)
    assert s.schedule().finished_req_ids == ["c"]


@pytest.mark.parametrize("params, script, want_tokens, want_status, want_reason", [
    (dict(), [5, EOS, 6], [5, EOS], RequestStatus.FINISHED_STOPPED, None),
    (dict(ignore_eos=True), [5, EOS, 6, 8], [5, EOS, 6, 8], RequestStatus.FINISHED_LENGTH, None),
    (dict(stop_token_ids=[6]), [5, 6, 8], [5, 6], RequestStatus.FINISHED_STOPPED, 6),
    (dict(min_tokens=3), [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], RequestStatus.FINISHED_STOPPED, None),
    (dict(), [5, 6, 8, 9, 10], [5, 6, 8, 9], RequestStatus.FINISHED_LENGTH, None),
])
def test_stop_conditions(params, script, want_tokens, want_status, want_reason):
    s, runner = make_scheduler(), FakeRunner({"a": script})
    a = make_request("a", 3, max_tokens=4, **params)
    s.add(a)
    run_to_end(s, runner)
    assert a.output_token_ids == want_tokens
    assert a.status is want_status and a.stop_reason == want_reason
    assert s.kv.num_free_blocks() == 32


def test_context_limit_ends_a_request_with_length():
    s, runner = make_scheduler(max_model_len=12), FakeRunner()
    a = make_request("a", 9, max_tokens=100)
    s.add(a)
    run_to_end(s, runner)
    assert a.num_tokens == 12 and a.num_output_tokens == 3 and a.status is RequestStatus.FINISHED_LENGTH


def test_prefix_hit_skips_cached_blocks_and_shares_them():
    s, runner = make_scheduler(budget=64, prefix_caching=True), FakeRunner()
    shared = list(range(100, 108))
    s.add(make_request("a", 0, max_tokens=2, prompt=shared + [1, 2]))
    step(s, runner)
    s.add(make_request("b", 0, max_tokens=2, prompt=shared + [3, 4, 5]))
    out = step(s, runner)
    b_seq = next(q for q in out.seqs if q.req_id == "b")
    assert b_seq == ScheduledSeq("b", [3, 4, 5], 8, [0, 1, 3], True)
    assert s.requests["b"].num_cached_tokens == 8
    assert s.kv.stats.prefix_cache_hits == 8
    assert s.stats.prompt_tokens_computed == 10 + 3 and s.stats.prompt_tokens == 10 + 11   # whole prompts
    run_to_end(s, runner)
    assert s.kv.num_free_blocks() == 32


def test_same_tokens_after_a_different_prefix_are_not_a_hit():
    s, runner = make_scheduler(budget=64, prefix_caching=True), FakeRunner()
    s.add(make_request("a", 0, max_tokens=1, prompt=[1, 2, 3, 4, 50, 51, 52, 53, 9]))
    step(s, runner)
    s.add(make_request("b", 0, max_tokens=1, prompt=[5, 6, 7, 8, 50, 51, 52, 53, 9]))
    out = step(s, runner)
    assert out.seqs[0].start_pos == 0 and s.kv.stats.prefix_cache_hits == 0


def test_prompt_of_whole_blocks_leaves_its_last_block_to_compute():
    s, runner = make_scheduler(budget=64, prefix_caching=True), FakeRunner()
    prompt = list(range(100, 108))
    s.add(make_request("a", 0, max_tokens=1, prompt=prompt))
    step(s, runner)  # a: blocks [0, 1], both cached; freed last first -> free queue ends 1, 0
    s.add(make_request("b", 0, max_tokens=1, prompt=prompt))
    out = step(s, runner)
    assert out.seqs == [ScheduledSeq("b", [104, 105, 106, 107], 4, [0, 2], True)]
    assert out.block_copies == []
    assert s.requests == {} and s.kv.num_free_blocks() == 32


def test_prompt_tokens_count_single_token_chunks():
    s, runner = make_scheduler(budget=4), FakeRunner()
    s.add(make_request("a", 5, max_tokens=1))
    run_to_end(s, runner)
    assert s.stats.prompt_tokens == s.stats.prompt_tokens_computed == 5


# =============================================================================================
# 2. Engine on the tiny random llama
# =============================================================================================


def drain(engine: Engine, check=None) -> tuple[dict[str, object], list[list]]:
    """Steps until idle; returns each request's final output and every step's outputs."""
    final, steps = {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(outs)
        for o in outs:
            if o.finished:
                assert o.request_id not in final, f"{o.request_id} finished twice"
                final[o.request_id] = o
        if check is not None:
            check(engine)
        assert len(steps) < 5000, "engine made no progress"
    return final, steps


def text_prompt(tok, n: int, skip: int = 0) -> list[int]:
    """n tokens of Spec-Bench text (the `skip`-th turn long enough)."""
    from conftest import spec_bench_questions

    found = 0
    for q in spec_bench_questions():
        for turn in q["turns"]:
            ids = tok.encode(turn)
            if len(ids) >= n:
                if found == skip:
                    return ids[:n]
                found += 1
    raise AssertionError(f"no Spec-Bench turn of {n} tokens")


def run_alone(make, prompt, params: SamplingParams, **options):
    engine = make(**options)
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="alone")
    final, _ = drain(engine)
    return final["alone"]


def test_invalid_requests_are_refused_at_add_request(make_tiny):
    engine = make_tiny()
    vocab = engine.model.cfg.vocab_size
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1.0)
    mutated = SamplingParams()
    mutated.temperature = -0.5  # assigned after construction: checked again by the engine
    bad = [
        ("hello", mutated, "temperature"),
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ([1] * engine.max_model_len, SamplingParams(), "context limit"),
        ([1, vocab], SamplingParams(), "token ids"),
        ([1, -1], SamplingParams(), "token ids"),
        (3.5, SamplingParams(), "prompt must be"),
        ({"text": "hi"}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": "hi"}, SamplingParams(), "prompt_token_ids must be a list"),
        ({"prompt_token_ids": [1, 2.5]}, SamplingParams(), "prompt_token_ids must be a list"),
        ({"prompt_token_ids": 7}, SamplingParams(), "prompt_token_ids must be a list"),
        ("hello", {"temperature": 0}, "SamplingParams"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params)
    with pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request("hello", SamplingParams(), priority="high")
    assert engine.add_request("hello", SamplingParams(max_tokens=2), request_id="x") == "x"
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("world", SamplingParams(), request_id="x")
    assert not engine.scheduler.waiting[1:], "a refused request was queued"
    final, _ = drain(engine)
    assert list(final) == ["x"]
    assert engine.add_request("again", SamplingParams(max_tokens=1), request_id="x") == "x"  # free once finished
    drain(engine)


def test_generated_ids_never_collide_with_callers_ids(make_tiny):
    engine = make_tiny()
    engine.add_request("a", SamplingParams(max_tokens=3), request_id="0")
    rid = engine.add_request("b", SamplingParams(max_tokens=3))
    assert rid != "0"
    final, _ = drain(engine)
    assert sorted(final) == sorted(["0", rid])


def test_llm_generate_adds_all_or_nothing(tiny_parts, make_tiny):
    from loom.llm import LLM

    llm = LLM.from_engine(make_tiny())
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="priorities"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    outs = llm.generate(["one", "two"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.prompt for o in outs] == ["one", "two"]
    assert llm.engine.kv.usage() == 0.0


@pytest.mark.parametrize("spec", [None, {"method": "auto"}])
def test_a_deleted_llm_frees_its_engine_and_model_at_once(tiny_llama_path, spec):
    """`del llm` frees the model's weights and the KV cache by reference counting, as soon as it
    runs: no cycle through the engine keeps them for the garbage collector (a notebook that
    loads a second model must not hold two)."""
    import gc
    import weakref

    from loom.llm import LLM

    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(tiny_llama_path), speculative_config=spec)
        llm.generate(["one two three one two", "four"], SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=1),
                     use_tqdm=False)
        engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.model)
        drafter = weakref.ref(llm.engine.runner.spec.drafter) if spec else lambda: None
        del llm
        assert engine() is None and model() is None and drafter() is None
    finally:
        gc.enable()


def test_llm_takes_what_vllm_callers_pass(make_tiny):
    """vLLM-shaped calls: lora_request=None, a callable use_tqdm (called as vLLM calls tqdm), a
    generator of prompts, numpy numbers, get_default_sampling_params; refused by name: a LoRA
    adapter, a dict for sampling_params, an unknown prompt-dict key, pooling methods; a chat
    template error is a ValueError."""
    import numpy as np

    from loom.errors import TokenizerError
    from loom.llm import LLM

    llm = LLM.from_engine(make_tiny())
    calls = []

    class Bar:
        def __init__(self, total, desc):
            calls.append(("new", total, desc))

        def update(self, n):
            calls.append(("update", n))

        def close(self):
            calls.append(("close",))

    params = SamplingParams(max_tokens=np.int64(2), temperature=np.float32(0.0))
    outs = llm.generate((p for p in ["a", "b"]), params, use_tqdm=Bar, lora_request=None)
    assert len(outs) == 2 and calls == [("new", 2, "Processed prompts"), ("update", 1), ("update", 1), ("close",)]
    assert llm.get_default_sampling_params().max_tokens == 16
    for call, words in ((lambda: llm.generate("a", params, lora_request=object()), "LoRA"),
                        (lambda: llm.generate("a", {"max_tokens": 3}), "got a dict"),
                        (lambda: llm.generate(["a", "b"], [params, None]), "holding NoneType"),
                        (lambda: llm.generate(5, params), "got int"),
                        (lambda: llm.generate({"prompt": "a", "multi_modal_data": {}}, params), "multi_modal_data")):
        with pytest.raises(InvalidRequestError, match=words):
            call()
    with pytest.raises(NotImplementedError, match="generative models only"):
        llm.embed(["a"])
    with pytest.raises(ValueError):   # TokenizerError is one, as transformers' template errors are
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template="{% if %}")
    assert issubclass(TokenizerError, ValueError)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_llm_generate_aborts_its_requests_on_any_exception(make_tiny, monkeypatch, error):
    """Ctrl-C (or any error) inside generate leaves nothing running: the next call runs only
    its own requests, as a fresh engine would."""
    from loom.llm import LLM

    llm = LLM.from_engine(make_tiny())
    step, steps, failed = llm.engine.step, [], []

    def failing_step():    # the fourth step of the first call fails
        steps.append(1)
        if len(steps) == 4 and not failed:
            failed.append(error)
            raise error("stopped")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(error):
        llm.generate(["one", "two"], SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage() == 0.0
    steps.clear()
    params = SamplingParams(max_tokens=3, **GREEDY)
    [out] = llm.generate("three", params, use_tqdm=False)
    assert len(steps) <= 3    # a prefill and two decodes, no leftover work
    fresh = LLM.from_engine(make_tiny()).generate("three", params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_llm_chat_takes_openai_messages_as_the_server_does(make_tiny):
    """Text parts and None content, an assistant's tool_calls, tools without a template that reads
    them, another template: rendered as the server renders them (loom/loader/chat_messages.py)."""
    from loom.llm import LLM
    from loom.loader.chat_messages import GENERIC_INSTRUCTIONS

    llm = LLM.from_engine(make_tiny())
    tok = llm.engine.tokenizer
    one = SamplingParams(max_tokens=1)
    plain = llm.chat([{"role": "user", "content": "hello there"}], one, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
                      {"role": "assistant", "content": None}], one, use_tqdm=False, add_generation_prompt=False)[0]
    assert parts.prompt == "<|im_start|>user\nhello\nthere<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    assert plain.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "hello there"}])

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    [out] = llm.chat([{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], one, use_tqdm=False, tools=tools)
    assert out.prompt.startswith("<|im_start|>system\n" + GENERIC_INSTRUCTIONS) and '"get_weather"' in out.prompt
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in out.prompt

    [out] = llm.chat([{"role": "user", "content": "hi"}], one, use_tqdm=False,
                     chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert out.prompt == "[hi]"
    native = ("{{ tools | map(attribute='function.name') | join(',') }}{% for m in messages %}[{{ m['content'] }}"
              "{% for c in m.tool_calls or [] %} {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
              "{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}]{% endfor %}")
    [out] = llm.chat([{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], one, use_tqdm=False,
                     tools=tools, chat_template=native)
    assert out.prompt == "get_weather[weather?][ get_weather(Paris)][sunny call_1]"
    with pytest.raises(InvalidRequestError, match="conversation"):
        llm.chat([], one, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], one, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="tools"):
        llm.chat([{"role": "user", "content": "hi"}], one, use_tqdm=False, tools=[{"type": "function"}])


def test_tokenizer_chat_template_tokenize_and_hf_helpers(tiny_parts):
    from loom.errors import TokenizerError

    tok = tiny_parts[2]
    chat = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == tok.encode_chat(chat)   # ids by default
    assert isinstance(tok.apply_chat_template(chat, tokenize=False), str)
    with pytest.raises(TokenizerError, match="return_dict"):
        tok.apply_chat_template(chat, return_dict=True)
    ids = tok.encode("hello there", add_special_tokens=False)
    assert tok(["hello there"], add_special_tokens=False)["input_ids"] == [ids]
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    assert tok.batch_decode([ids]) == [tok.decode(ids)] and len(tok) == tok.vocab_size
    assert tok.get_vocab()[tok.convert_ids_to_tokens(ids[0])] == ids[0]
    assert tok.eos_token_id in tok.all_special_ids


@pytest.mark.parametrize("option, value", [("seed", "1"), ("seed", 1.5), ("max_model_len", "128"),
                                           ("max_num_seqs", 2.0), ("num_blocks", "3"), ("enable_prefix_caching", "no"),
                                           ("kv_cache_memory", 0.5)])
def test_engine_options_of_the_wrong_type_are_refused_by_name(option, value):
    from loom.config import EngineConfig

    with pytest.raises(InvalidRequestError, match=f"^{option} must be"):
        EngineConfig.create("model.gguf", **{option: value})


def test_a_kv_cache_memory_that_holds_no_block_is_refused(make_tiny):
    with pytest.raises(InvalidRequestError, match="kv_cache_memory must hold at least one KV block: 100 bytes"):
        make_tiny(num_blocks=None, kv_cache_memory=100)


def test_llm_generate_refuses_a_bare_list_of_ids(make_tiny):
    from loom.llm import LLM

    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        LLM.from_engine(make_tiny()).generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False)


def test_llm_progress_bar_leaves_stdout_alone(make_tiny, capfd):
    """The progress bar (8+ prompts) draws on stderr, as vLLM's tqdm: redirected stdout holds
    only what the program prints."""
    from loom.llm import LLM, PROGRESS_MIN_PROMPTS

    llm = LLM.from_engine(make_tiny())
    outs = llm.generate([f"prompt {i}" for i in range(PROGRESS_MIN_PROMPTS)], SamplingParams(max_tokens=2))
    assert len(outs) == PROGRESS_MIN_PROMPTS
    assert capfd.readouterr().out == ""


def test_a_context_limit_the_model_or_cache_cannot_give_is_refused(make_tiny, caplog):
    """As vLLM: max_model_len past the model's context, or past what the KV cache holds, is an
    error at start-up; the model's own context cut by a small cache is said once."""
    context = make_tiny().model.cfg.context_length
    with pytest.raises(InvalidRequestError, match=f"longer than the model's context of {context}"):
        make_tiny(max_model_len=context + 1)
    with pytest.raises(InvalidRequestError, match="does not fit: the KV cache's 8 blocks hold 32 tokens"):
        make_tiny(num_blocks=8, max_model_len=64)
    with caplog.at_level("WARNING", logger="loom"):
        assert make_tiny(num_blocks=8).max_model_len == 32
    assert f"the context limit is 32 tokens, not the model's {context}" in caplog.text
    assert make_tiny(max_model_len=48).max_model_len == 48


def test_prompt_near_the_context_limit_is_cut_by_length(make_tiny):
    engine = make_tiny()
    n = engine.max_model_len - 5
    engine.add_request([3 + i % 400 for i in range(n)], SamplingParams(max_tokens=100, **GREEDY), request_id="r")
    final, _ = drain(engine)
    out = final["r"].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_abort_returns_abort_and_frees_blocks(make_tiny):
    engine = make_tiny()
    sp = SamplingParams(max_tokens=40, **GREEDY)
    for i in range(3):
        engine.add_request(text_prompt(engine.tokenizer, 30, skip=i), sp, request_id=f"r{i}")
    for _ in range(4):
        engine.step()
        engine.kv.check_integrity()
    held = engine.kv.num_free_blocks()
    [out] = engine.abort("r1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 4  # one from the prefill step, one per decode step
    assert engine.kv.num_free_blocks() > held
    engine.kv.check_integrity()
    assert engine.abort("r1") == [] and engine.abort("nope") == []
    final, steps = drain(engine, check=lambda e: e.kv.check_integrity())
    assert sorted(final) == ["r0", "r2"]
    assert all(o.request_id != "r1" for outs in steps for o in outs)
    assert engine.kv.usage() == 0.0 and engine.kv.num_free_blocks() == 512
    assert engine.runner.states == {} or set(engine.runner.states) <= {"r0", "r2"}


def test_abort_of_a_waiting_request(make_tiny):
    engine = make_tiny(max_num_seqs=1)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    engine.add_request("first", sp, request_id="a")
    engine.add_request("second", sp, request_id="b")
    engine.step()
    [out] = engine.abort("b")
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    final, _ = drain(engine)
    assert list(final) == ["a"] and engine.kv.usage() == 0.0


def test_more_urgent_later_request_runs_first_with_one_slot(make_tiny):
    engine = make_tiny(max_num_seqs=1)
    sp = SamplingParams(max_tokens=6, **GREEDY)
    engine.add_request("the early one", sp, request_id="early", priority=1)
    engine.add_request("the later one", sp, request_id="later", priority=0)
    engine.add_request("the latest one", sp, request_id="latest", priority=-3)
    _, steps = drain(engine)
    order = []
    for outs in steps:
        assert len(outs) == 1  # one slot: one request per step
        if not order or order[-1] != outs[0].request_id:
            order.append(outs[0].request_id)
    assert order == ["latest", "later", "early"]


def test_chunked_prefill_never_stalls_running_decodes(make_tiny):
    engine = make_tiny(max_num_batched_tokens=16)
    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording_schedule
    sp = SamplingParams(max_tokens=60, **GREEDY)
    short = [f"s{i}" for i in range(3)]
    for i, rid in enumerate(short):
        engine.add_request(text_prompt(engine.tokenizer, 4, skip=i), sp, request_id=rid, priority=1)
    engine.step()
    # decodes go first even when the prompt being prefilled is more urgent
    engine.add_request(text_prompt(engine.tokenizer, 150, skip=5), SamplingParams(max_tokens=2, **GREEDY),
                       request_id="long", priority=0)
    prefill_steps = 0
    while engine.scheduler.requests["long"].num_output_tokens == 0:
        outs = engine.step()
        plan = plans[-1]
        by_id = {q.req_id: q for q in plan.seqs}
        assert plan.num_tokens <= 16
        for rid in short:
            assert len(by_id[rid].token_ids) == 1 and by_id[rid].sample, f"{rid} stalled"
        assert len(by_id["long"].token_ids) == min(13, 150 - by_id["long"].start_pos)  # the rest of the budget
        assert {o.request_id for o in outs if o.outputs[0].delta_token_ids} >= set(short)
        prefill_steps += 1
    assert prefill_steps == -(-150 // 13)
    drain(engine)


def test_seeded_request_samples_the_same_whatever_shares_the_batch(make_tiny):
    tok = make_tiny().tokenizer
    prompt = text_prompt(tok, 12)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=60, seed=1234, max_tokens=24, ignore_eos=True)
    alone = run_alone(make_tiny, prompt, sp).outputs[0].token_ids

    engine = make_tiny(max_num_batched_tokens=32)
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=5, max_tokens=12),
              SamplingParams(temperature=1.3, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=40),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=20),
              SamplingParams(temperature=0.8, min_p=0.05, seed=99, max_tokens=25)]
    for i, p in enumerate(others[:3]):
        engine.add_request(text_prompt(tok, 20 + 7 * i, skip=i + 1), p, request_id=f"o{i}")
    engine.step()
    engine.add_request({"prompt_token_ids": prompt}, sp, request_id="seeded")
    engine.step()
    for i, p in enumerate(others[3:], start=3):
        engine.add_request(text_prompt(tok, 9 + i, skip=i + 1), p, request_id=f"o{i}")
    final, _ = drain(engine)
    assert final["seeded"].outputs[0].token_ids == alone
    assert len(set(alone)) > 5  # really sampled


def _seeded_tokens(make, tok, seed: int, n: int = 40) -> tuple[list[int], SamplingParams]:
    sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True)
    return run_alone(make, text_prompt(tok, 10), sp).outputs[0].token_ids, sp


def _ascii_boundary(tok, ids: list[int]) -> tuple[int, str, int]:
    """(k, stop, pos): a stop string made of the last 2 characters of token k and the first 2
    of token k+1, whose first occurrence in the text is at that boundary (pos = its start)."""
    pieces = [tok.decode([t]) for t in ids]
    text = "".join(pieces)
    for k in range(2, len(ids) - 3):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= 2 and (a + b).isascii() and (a + b).isprintable():
            stop = a[-2:] + b[:2]
            pos = len("".join(pieces[:k + 1])) - 2
            if text.find(stop) == pos:
                return k, stop, pos
    raise AssertionError("no usable token boundary")


def test_stop_string_across_tokens_is_never_streamed_partially(make_tiny):
    tok = make_tiny().tokenizer
    base, sp = _seeded_tokens(make_tiny, tok, seed=7)
    full_text = tok.decode(base)
    k, stop, pos = _ascii_boundary(tok, base)
    for include in (False, True):
        engine = make_tiny()
        engine.add_request({"prompt_token_ids": text_prompt(tok, 10)},
                           sp.clone(stop=["never seen here", stop], include_stop_str_in_output=include),
                           request_id="r")
        final, steps = drain(engine)
        deltas = [o.outputs[0].delta_text for outs in steps for o in outs]
        out = final["r"].outputs[0]
        want = full_text[:pos + (len(stop) if include else 0)]
        assert "".join(deltas) == out.text == want
        emitted = ""
        for d in deltas:  # a prefix of the stop string is held back until decided
            emitted += d
            assert not (len(emitted) > pos and not include), "stop string emitted partially"
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == base[:k + 2]
        assert engine.kv.usage() == 0.0


def test_stop_token_ids_and_max_tokens(make_tiny):
    tok = make_tiny().tokenizer
    base, sp = _seeded_tokens(make_tiny, tok, seed=11)
    k = next(i for i in range(4, len(base)) if base[i] not in base[:i])
    out = run_alone(make_tiny, text_prompt(tok, 10), sp.clone(stop_token_ids=[base[k]])).outputs[0]
    assert out.token_ids == base[:k + 1] and out.finish_reason == "stop" and out.stop_reason == base[k]
    out = run_alone(make_tiny, text_prompt(tok, 10), sp.clone(max_tokens=k)).outputs[0]
    assert out.token_ids == base[:k] and out.finish_reason == "length" and out.stop_reason is None


def _first_eos(make_tiny) -> tuple[list[int], SamplingParams, list[int], int]:
    """(prompt, params, tokens, k): a seeded request whose tokens (with ignore_eos) hold an end
    token at index k, with no end token before it."""
    engine = make_tiny()
    tok = engine.tokenizer
    eos = tok.stop_token_ids
    # near-uniform sampling over the tiny vocabulary: some seed soon draws an end token
    prompt = text_prompt(tok, 10)
    sps = [SamplingParams(temperature=3.0, seed=s, max_tokens=64, ignore_eos=True) for s in range(16)]
    for s, sp in enumerate(sps):
        engine.add_request({"prompt_token_ids": prompt}, sp, request_id=str(s))
    final, _ = drain(engine)
    seed, k = next((s, i) for s in range(16) for i, t in enumerate(final[str(s)].outputs[0].token_ids) if t in eos)
    base = final[str(seed)].outputs[0].token_ids
    assert len(base) == 64 and final[str(seed)].outputs[0].finish_reason == "length"
    return prompt, sps[seed], base, k


def test_eos_stops_unless_ignored(make_tiny):
    prompt, sp, base, k = _first_eos(make_tiny)
    out = run_alone(make_tiny, prompt, sp.clone(ignore_eos=False)).outputs[0]
    assert out.token_ids == base[:k + 1] and out.finish_reason == "stop" and out.stop_reason is None


def _text_and_deltas(make_tiny, prompt: list[int], params: SamplingParams):
    """The final output of one request and the concatenation of its streamed deltas."""
    engine = make_tiny()
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="r")
    final, steps = drain(engine)
    return final["r"].outputs[0], "".join(o.outputs[0].delta_text for outs in steps for o in outs)


def test_the_eos_token_adds_no_text_even_with_special_tokens_kept(make_tiny):
    """vLLM v1: the end token stays in token_ids, but its text ("<|im_end|>" when special tokens
    are kept) is in neither the text nor a delta, unless include_stop_str_in_output."""
    prompt, sp, base, k = _first_eos(make_tiny)
    tok = make_tiny().tokenizer
    eos_text = tok.decode([base[k]], False)
    assert eos_text
    for include in (False, True):
        params = sp.clone(ignore_eos=False, skip_special_tokens=False, include_stop_str_in_output=include)
        out, streamed = _text_and_deltas(make_tiny, prompt, params)
        want = tok.decode(base[:k + 1] if include else base[:k], False)
        assert out.token_ids == base[:k + 1] and out.finish_reason == "stop"
        assert out.text == streamed == want
        assert out.text.endswith(eos_text) == include


def test_a_stop_token_adds_no_text_unless_include_stop_str(make_tiny):
    tok = make_tiny().tokenizer
    base, sp = _seeded_tokens(make_tiny, tok, seed=11)
    k = next(i for i in range(4, len(base)) if base[i] not in base[:i] and tok.decode([base[i]]).strip())
    for include in (False, True):
        params = sp.clone(stop_token_ids=[base[k]], include_stop_str_in_output=include)
        out, streamed = _text_and_deltas(make_tiny, text_prompt(tok, 10), params)
        assert out.token_ids == base[:k + 1] and out.stop_reason == base[k]
        assert out.text == streamed == tok.decode(base[:k + 1] if include else base[:k])


def test_min_tokens_holds_back_stop_strings(make_tiny):
    """A stop string ends the output only at a match that ends after the first min_tokens
    tokens' text (vLLM checks stop strings from the min_tokens + 1-th token on)."""
    tok = make_tiny().tokenizer
    base, sp = _seeded_tokens(make_tiny, tok, seed=7)
    m = 8
    head, rest = tok.decode(base[:m]), tok.decode(base)[len(tok.decode(base[:m])):]
    stop = next(ch for ch in head if ch.isascii() and ch.isalnum() and ch in rest)
    early, _ = _text_and_deltas(make_tiny, text_prompt(tok, 10), sp.clone(stop=[stop]))
    assert len(early.token_ids) <= m        # without min_tokens: the match inside the head ends it
    out, streamed = _text_and_deltas(make_tiny, text_prompt(tok, 10), sp.clone(stop=[stop], min_tokens=m))
    end = len(head) + rest.index(stop)
    t = next(i for i in range(m + 1, len(base) + 1) if len(tok.decode(base[:i])) > end)
    assert out.stop_reason == stop and out.finish_reason == "stop"
    assert out.token_ids == base[:t] and len(out.token_ids) > m
    assert out.text == streamed == tok.decode(base)[:end]


def test_greedy_steps_that_keep_no_logits_decode_as_steps_that_keep_them(tiny_parts, monkeypatch):
    """A step whose rows are all plain greedy asks the output layer for the argmax alone; on
    AVX-512 kernels it then stores no logits (compute_logits returns None). The tokens are those
    of steps that keep the logits, in a batch beside a sampled request (whose steps keep them)
    and where the kernel leaves a row undecided (-1: the output layer computes the logits)."""
    from conftest import spy_logits

    from loom import kernels
    from loom.config import EngineConfig
    from loom.model.build import load_model
    from loom.model.layers.linear import QuantLinear

    path, _, tok = tiny_parts
    model = load_model(path, linear="auto")   # the default mode: loom's kernels where available
    prompts = [text_prompt(tok, n, skip=i) for i, n in enumerate((5, 9, 14))]
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)

    def run(extra: bool) -> tuple[dict[str, list[int]], list]:
        engine = Engine(EngineConfig.create(str(path), block_size=4, num_blocks=512), model=model, tokenizer=tok)
        calls = spy_logits(monkeypatch, engine)
        for i, p in enumerate(prompts):
            engine.add_request({"prompt_token_ids": p}, greedy, request_id=str(i))
        if extra:
            engine.add_request({"prompt_token_ids": prompts[0]}, sampled, request_id="s")
        final, _ = drain(engine)
        return {k: v.outputs[0].token_ids for k, v in final.items()}, calls

    base, calls = run(extra=False)
    assert all(only for only, _ in calls)
    unstored = kernels.variant() == "avx512" and isinstance(model.lm_head, QuantLinear)
    assert any(none for _, none in calls) == unstored
    mixed, calls = run(extra=True)
    assert {k: mixed[k] for k in base} == base and not calls[0][0] and calls[-1][0]

    top = QuantLinear.top_logits

    def undecided(self, x, margin, cap, argmax=None, logits=True):
        out = top(self, x, margin, cap, argmax, logits)
        if not logits:
            argmax[0] = -1   # as for a row with a NaN logit
        return out

    monkeypatch.setattr(QuantLinear, "top_logits", undecided)
    again, calls = run(extra=False)
    assert again == base and not any(none for _, none in calls)
    monkeypatch.setattr("loom.model.runner._ReqState.argmax_only", property(lambda self: False))
    kept, calls = run(extra=False)
    assert kept == base and not any(only for only, _ in calls)


def test_logit_bias_forces_a_token_and_leaves_the_logprobs_the_models(make_tiny):
    tok = make_tiny().tokenizer
    prompt = text_prompt(tok, 10)
    base = run_alone(make_tiny, prompt, SamplingParams(max_tokens=6, logprobs=0, **GREEDY)).outputs[0]
    target = next(t for t in range(5, 400) if t not in base.token_ids)
    out = run_alone(make_tiny, prompt, SamplingParams(max_tokens=6, logprobs=0, logit_bias={target: 100.0},
                                                      **GREEDY)).outputs[0]
    assert out.token_ids == [target] * 6
    first = out.logprobs[0][target].logprob
    assert first < base.logprobs[0][base.token_ids[0]].logprob    # the model's own, not the biased one
    banned = run_alone(make_tiny, prompt, SamplingParams(max_tokens=6, logit_bias={base.token_ids[0]: -100},
                                                         **GREEDY)).outputs[0]
    assert banned.token_ids[0] != base.token_ids[0]


def test_allowed_token_ids_bound_sampled_and_greedy_output(make_tiny):
    tok = make_tiny().tokenizer
    allowed = [11, 40, 95, 230]
    outs = [run_alone(make_tiny, text_prompt(tok, 10), SamplingParams(
        temperature=t, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)).outputs[0]
        for t in (0.0, 1.5)]
    for out in outs:
        assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 24
    assert len(set(outs[1].token_ids)) > 1


def test_bad_words_never_complete_and_the_rest_is_unchanged(make_tiny):
    tok = make_tiny().tokenizer
    prompt = text_prompt(tok, 10)
    base, sp = _seeded_tokens(make_tiny, tok, seed=11)     # one uniform a step: the same draws up to k
    k = next(i for i in range(3, len(base)) if base[i] != base[i - 1])
    pair = [base[k - 1], base[k]]
    ids = run_alone(make_tiny, prompt, sp.clone(bad_words_token_ids=[pair])).outputs[0].token_ids
    assert ids[:k] == base[:k] and ids[k] != base[k]
    assert not any(ids[i:i + 2] == pair for i in range(len(ids) - 1))
    # a word given as text: banned as it tokenizes alone and after a space
    word = tok.decode(base[k:k + 1]).strip()
    sp = SamplingParams(temperature=1.5, seed=4, max_tokens=40, ignore_eos=True, bad_words=[word])
    engine = make_tiny()
    engine.add_request({"prompt_token_ids": prompt}, sp, request_id="w")
    seqs = engine.scheduler.requests["w"].params.bad_words_token_ids
    assert tuple(tok.encode(word, add_special_tokens=False)) in seqs
    final, _ = drain(engine)
    ids = final["w"].outputs[0].token_ids
    for seq in seqs:
        assert not any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids))), seq


def test_token_controls_outside_the_vocabulary_or_leaving_nothing_are_refused(make_tiny):
    engine = make_tiny()
    vocab, tok = engine.model.cfg.vocab_size, engine.tokenizer
    eos = sorted(tok.stop_token_ids)
    word = next(w for w in "abcdefghijklmnopqrstuvwxyz" if len(tok.encode(w, add_special_tokens=False)) == 1)
    single = tok.encode(word, add_special_tokens=False)
    bad = [
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias holds token ids outside the vocabulary"),
        (SamplingParams(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids holds token ids outside"),
        (SamplingParams(bad_words_token_ids=[[vocab]]), "bad_words holds token ids outside"),
        (SamplingParams(allowed_token_ids=eos, min_tokens=2), "leaves no token to sample"),
        (SamplingParams(allowed_token_ids=single, bad_words=[word]), "leaves no token to sample"),
    ]
    for params, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("hello", params)
    assert not engine.scheduler.waiting
    engine.add_request("hello", SamplingParams(allowed_token_ids=eos, max_tokens=2), request_id="ok")
    final, _ = drain(engine)
    assert final["ok"].outputs[0].token_ids[0] in eos


def test_allowed_ids_the_grammar_forbids_end_the_request_with_a_reason(make_tiny):
    tok = make_tiny().tokenizer
    allowed = tok.encode("zzz", add_special_tokens=False)[:1]
    params = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=allowed,
                            structured_outputs={"choice": ["left", "right"]})
    out = run_alone(make_tiny, text_prompt(tok, 10), params)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert out.outputs[0].stop_reason == "no allowed token is left to sample"


def test_token_controls_decode_the_same_with_speculation_on(make_tiny):
    tok = make_tiny().tokenizer
    prompt = text_prompt(tok, 10) * 3    # repeats: prompt lookup would draft
    base = run_alone(make_tiny, prompt, SamplingParams(max_tokens=12, **GREEDY)).outputs[0].token_ids
    params = [SamplingParams(max_tokens=12, logit_bias={base[2]: -100}, **GREEDY),
              SamplingParams(max_tokens=12, bad_words_token_ids=[base[3:5]], **GREEDY),
              SamplingParams(max_tokens=12, allowed_token_ids=base[:6], **GREEDY)]
    for sp in params:
        plain = run_alone(make_tiny, prompt, sp).outputs[0].token_ids
        spec = run_alone(make_tiny, prompt, sp, speculative_config={"method": "prompt_lookup"}).outputs[0].token_ids
        assert plain == spec


def test_truncate_prompt_tokens_keeps_the_prompts_tail(make_tiny):
    tok = make_tiny().tokenizer
    prompt = text_prompt(tok, 30)
    tail = run_alone(make_tiny, prompt[-12:], SamplingParams(max_tokens=5, **GREEDY))
    cut = run_alone(make_tiny, prompt, SamplingParams(max_tokens=5, truncate_prompt_tokens=12, **GREEDY))
    assert cut.prompt_token_ids == prompt[-12:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    engine = make_tiny()
    whole = run_alone(make_tiny, prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=100, **GREEDY))
    assert whole.prompt_token_ids == prompt
    long = [5 + i % 300 for i in range(engine.max_model_len + 50)]
    out = run_alone(make_tiny, long, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1, **GREEDY))
    assert out.prompt_token_ids == long[-(engine.max_model_len - 4):] and len(out.outputs[0].token_ids) == 4   # room kept
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_logprobs_match_a_full_softmax_of_the_model(make_tiny, tiny_parts):
    _, model, tok = tiny_parts
    engine = make_tiny()
    prompts = [text_prompt(tok, 9), text_prompt(tok, 23, skip=2)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=3, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
    engine.add_request("no logprobs here", SamplingParams(max_tokens=4), request_id="plain")
    final, _ = drain(engine)
    assert final["plain"].outputs[0].logprobs is None
    for i, (p, sp) in enumerate(zip(prompts, params)):
        out = final[str(i)].outputs[0]
        ref = score(model, p + out.token_ids[:-1])[len(p) - 1:].log_softmax(dim=-1)    # [6, V]
        assert len(out.logprobs) == len(out.token_ids) == 6
        total = 0.0
        for row, tok_id, entry in zip(ref, out.token_ids, out.logprobs):
            assert entry[tok_id].logprob == pytest.approx(row[tok_id].item(), abs=1e-4)
            total += entry[tok_id].logprob
            top = row.topk(sp.logprobs)
            # the sampled token has its rank wherever it is (as in vLLM): 1 + the tokens above it
            assert entry[tok_id].rank == int((row > row[tok_id]).sum()) + 1
            alternatives = sorted((lp for lp in entry.values() if lp.rank <= sp.logprobs), key=lambda lp: lp.rank)
            assert [lp.rank for lp in alternatives] == list(range(1, sp.logprobs + 1))
            ranked_ids = [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= sp.logprobs]
            assert ranked_ids == top.indices.tolist()
            values = [lp.logprob for lp in alternatives]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx(top.values.tolist(), abs=1e-4)
            if sp.temperature == 0.0:
                assert entry[tok_id].rank == 1
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def _conversations(tok, bs: int) -> list[list[int]]:
    """Prompts that do and do not share prefixes with each other."""
    system = text_prompt(tok, 5 * bs + 2, skip=0)
    block = text_prompt(tok, bs, skip=9)          # one block of tokens ...
    other_a, other_b = text_prompt(tok, 2 * bs, skip=4), text_prompt(tok, 2 * bs, skip=6)
    return [
        system + text_prompt(tok, 7, skip=1),
        system + text_prompt(tok, 13, skip=2),
        system[:3 * bs] + text_prompt(tok, 5, skip=3),   # shares 3 of the system prompt's blocks
        system + text_prompt(tok, 7, skip=1),            # identical to the first
        system[:4 * bs],                                  # whole blocks only, all cached
        other_a + block + text_prompt(tok, 3, skip=7),   # ... after different preceding tokens:
        other_b + block + text_prompt(tok, 3, skip=7),   # same block content, no cache hit
        text_prompt(tok, 19, skip=8),
    ]


def test_prefix_cached_conversations_produce_what_they_produce_alone(make_tiny):
    bs = 4
    tok = make_tiny().tokenizer
    prompts = _conversations(tok, bs)
    params = [SamplingParams(temperature=0.3, seed=100 + i, max_tokens=10 + i, logprobs=0, ignore_eos=True)
              for i in range(len(prompts))]
    alone = [run_alone(make_tiny, p, sp, enable_prefix_caching=False).outputs[0]
             for p, sp in zip(prompts, params)]

    engine = make_tiny(block_size=bs, max_num_batched_tokens=32)
    final = {}
    for wave in ([0, 5, 7], [1, 2, 6], [3, 4]):
        for i in wave:
            engine.add_request({"prompt_token_ids": prompts[i]}, params[i], request_id=str(i))
        outs = engine.step()
        final.update({o.request_id: o for o in outs if o.finished})
        engine.kv.check_integrity()
    more, _ = drain(engine, check=lambda e: e.kv.check_integrity())
    final.update(more)
    for i, want in enumerate(alone):
        got = final[str(i)].outputs[0]
        assert got.token_ids == want.token_ids, f"conversation {i}"
        lp = [next(iter(d.values())).logprob for d in got.logprobs]
        assert lp == pytest.approx([next(iter(d.values())).logprob for d in want.logprobs], abs=1e-5)
    cached = {i: final[str(i)].num_cached_tokens for i in range(len(prompts))}
    assert cached[0] == 0 and cached[5] == 0 and cached[7] == 0
    assert cached[1] == 5 * bs and cached[2] == 3 * bs
    assert cached[3] == (len(prompts[3]) - 1) // bs * bs  # all but the last token, in whole blocks
    assert cached[4] == 3 * bs  # the last block is computed again for its logits
    assert cached[6] == 0       # same tokens as a cached block, different tokens before them
    assert engine.kv.stats.prefix_cache_hits >= sum(cached.values())
    assert engine.kv.usage() == 0.0


def test_stream_with_stop_strings_matches_a_reference_on_random_text(tiny_parts):
    """OutputState alone, fed one token at a time: the deltas always add up to the text before the
    first stop string to complete after the first min_tokens tokens' text (plus it, with
    include_stop_str_in_output), never more."""
    from loom.engine.detokenize import OutputState

    _, _, tok = tiny_parts
    words = [i for i in range(tok.vocab_size)
             if i not in tok.special_token_ids and tok.decode([i]).isascii() and tok.decode([i])]
    rng = random.Random(5)
    for _ in range(400):
        ids = [rng.choice(words) for _ in range(rng.randint(1, 12))]
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)] if rng.random() < 0.7 else rng.choice(["ab", "c", " a"]))
        include = rng.random() < 0.5
        min_tokens = rng.randint(0, len(ids)) if rng.random() < 0.5 else 0
        req = Request("r", [5], SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(ids),
                                               min_tokens=min_tokens), len(ids))
        state, streamed = OutputState(req, tok), ""
        for t, tid in enumerate(ids):
            req.append_token(tid)
            if t == len(ids) - 1:
                req.status = RequestStatus.FINISHED_LENGTH
            out = state.process()
            streamed += out.outputs[0].delta_text
            if out.finished:
                break
        want, reason = text, None
        after = len(tok.decode(ids[:min_tokens]))    # a match must end past the first min_tokens tokens' text
        for t in range(min_tokens, len(ids)):
            prefix = tok.decode(ids[:t + 1])
            hits = [(i, s) for s in stops if (i := prefix.find(s, max(0, after - len(s) + 1))) >= 0]
            if hits:
                i, s = min(hits)
                want, reason = prefix[:i + (len(s) if include else 0)], s
                break
        assert out.finished
        assert (streamed, out.outputs[0].text, out.outputs[0].stop_reason) == (want, want, reason), (ids, stops)


# =============================================================================================
# 3. Engine on the real SmolLM2
# =============================================================================================

SMOL = "smollm2-135m"


class Workload:
    """64 greedy requests on Spec-Bench text: prompt lengths from 1 to ~2,000 tokens (most under
    90, two long), max_tokens from 1 to 48, split into three arrival waves. The outputs each request
    produces alone are computed once per session (one engine, one request at a time)."""

    LONG = (400, 1900)

    def __init__(self, real_models):
        from conftest import spec_bench_questions

        self.real_models = real_models
        _, tok = real_models.loom(SMOL)
        rng = random.Random(2024)
        questions = spec_bench_questions()
        short = [ids for ids in tok.encode_batch([q["turns"][0] for q in questions]) if 8 <= len(ids) <= 90]
        rng.shuffle(short)
        long_text = tok.encode("\n\n".join(t for q in questions if q["category"] == "summarization"
                                           for t in q["turns"][:1]))
        prompts = [short[0][:1], short[1][:2], short[2][:5]] + short[3:3 + 64 - 3 - len(self.LONG)]
        prompts += [long_text[i * 97:i * 97 + n] for i, n in enumerate(self.LONG)]
        # mostly short completions, a few long ones: the alone runs decode one token per step
        max_tokens = [rng.choice([1, 2, 3, 4, 6, 8, 12]) for _ in prompts]
        for i, n in zip(rng.sample(range(3, len(prompts) - len(self.LONG)), 3), (24, 36, 48)):
            max_tokens[i] = n
        for i in range(len(prompts) - len(self.LONG), len(prompts)):
            max_tokens[i] = rng.randint(1, 4)  # long contexts in decode are the costly part
        order = list(range(len(prompts)))
        rng.shuffle(order)
        self.prompts = [prompts[i] for i in order]
        self.max_tokens = [max_tokens[i] for i in order]
        self.waves = [list(range(0, 24)), list(range(24, 44)), list(range(44, 64))]
        self._alone: dict[tuple[int, str], list[int]] = {}

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens[i], ignore_eos=True)

    def alone(self, i: int, dtype: str = "float32") -> list[int]:
        if (i, dtype) not in self._alone:
            engine = self.real_models.engine(SMOL, dtype, block_size=16, max_num_batched_tokens=2048, num_blocks=256)
            engine.add_request({"prompt_token_ids": self.prompts[i]}, self.params(i), request_id="alone")
            final, _ = drain(engine)
            self._alone[i, dtype] = final["alone"].outputs[0].token_ids
        return self._alone[i, dtype]


@pytest.fixture(scope="module")
def workload(real_models) -> Workload:
    return Workload(real_models)


@pytest.mark.real_model
def test_workload_shape(workload):
    lengths = sorted(len(p) for p in workload.prompts)
    assert len(lengths) == 64 and lengths[0] == 1 and lengths[-1] == 1900
    assert sum(n <= 90 for n in lengths) == 64 - len(Workload.LONG)
    assert min(workload.max_tokens) == 1 and max(workload.max_tokens) == 48


# Both modes (MODEL_DTYPES): float32 (exact) and the default (loom's kernels: int8 activations,
# float16 KV cache), where a difference in the last bit would be amplified by the activation
# quantization.


# The exact mode runs the two ends (small blocks and chunks, large ones); the middle one adds
# ~25 s of float32 steps on a slow machine and nothing the default mode's run of it does not.
def _batch_case(block_size: int, budget: int, dtype):
    """pytest.param(block_size, budget, dtype) keeping MODEL_DTYPES' marks."""
    if isinstance(dtype, str):
        return pytest.param(block_size, budget, dtype)
    return pytest.param(block_size, budget, *dtype.values, marks=dtype.marks)


BATCH_CASES = ([_batch_case(8, 64, d) for d in MODEL_DTYPES] + [_batch_case(16, 256, "auto")]
               + [_batch_case(32, 2048, d) for d in MODEL_DTYPES])


@pytest.mark.real_model
@pytest.mark.parametrize("block_size, budget, dtype", BATCH_CASES)
def test_batched_greedy_outputs_equal_each_request_alone(real_models, workload, block_size, budget, dtype):
    engine = real_models.engine(SMOL, dtype, block_size=block_size, max_num_batched_tokens=budget,
                                num_blocks=12288 // block_size)
    final = {}
    for wave in workload.waves:
        for i in wave:
            engine.add_request({"prompt_token_ids": workload.prompts[i]}, workload.params(i), request_id=str(i))
        for _ in range(3):
            final.update({o.request_id: o for o in engine.step() if o.finished})
            engine.kv.check_integrity()
    more, _ = drain(engine, check=lambda e: e.kv.check_integrity())
    final.update(more)
    got = [final[str(i)].outputs[0].token_ids for i in range(64)]
    differ = [i for i in range(64) if got[i] != workload.alone(i, dtype)]
    print(f"\n{dtype}, block_size={block_size}, budget={budget}: {64 - len(differ)}/64 identical to alone")
    assert not differ, f"requests {differ} differ from their outputs alone"
    assert all(len(g) == n for g, n in zip(got, workload.max_tokens))
    assert engine.kv.usage() == 0.0


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_preemption_recomputes_to_the_same_outputs(real_models, workload, dtype):
    picks = [i for i in range(64) if 20 <= len(workload.prompts[i]) <= 90 and workload.max_tokens[i] >= 12][:8]
    assert len(picks) == 8
    bs = 16
    need = sorted(-(-(len(workload.prompts[i]) + workload.max_tokens[i]) // bs) for i in picks)
    num_blocks = sum(need[-3:])  # room for about three of the eight at full length
    engine = real_models.engine(SMOL, dtype, block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=512)
    for i in picks:
        engine.add_request({"prompt_token_ids": workload.prompts[i]}, workload.params(i), request_id=str(i))
    final, _ = drain(engine, check=lambda e: e.kv.check_integrity())
    assert engine.scheduler.stats.num_preemptions > 0
    for i in picks:
        assert final[str(i)].outputs[0].token_ids == workload.alone(i, dtype), f"request {i}"
    assert engine.kv.num_free_blocks() == num_blocks and engine.kv.usage() == 0.0


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_prefix_cache_serves_a_shared_system_prompt(real_models, dtype):
    from conftest import spec_bench_questions

    _, tok = real_models.loom(SMOL)
    rag = next(q for q in spec_bench_questions() if q["category"] == "rag")["turns"][0]
    system = tok.decode(tok.encode(rag)[:400])
    questions = ["What is the main topic?", "Summarize it in one sentence.", "Name one person mentioned."]
    prompts = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(engine, waves):
        final = {}
        for wave in waves:
            for i in wave:
                engine.add_request({"prompt_token_ids": prompts[i]}, sp, request_id=str(i))
            final.update(drain(engine)[0])
        return final

    cached_engine = real_models.engine(SMOL, dtype, block_size=16, num_blocks=256)
    with_cache = run(cached_engine, [[0], [1, 2]])
    plain_engine = real_models.engine(SMOL, dtype, block_size=16, num_blocks=256, enable_prefix_caching=False)
    without = run(plain_engine, [[0, 1, 2]])
    shared = next(j for j, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    assert shared > 400
    assert with_cache["0"].num_cached_tokens == 0
    for i in (1, 2):
        assert with_cache[str(i)].num_cached_tokens == shared // 16 * 16
        assert without[str(i)].num_cached_tokens == 0
    assert cached_engine.kv.stats.prefix_cache_hits == 2 * (shared // 16 * 16)
    assert plain_engine.kv.stats.prefix_cache_hits == 0
    for i in range(3):
        assert with_cache[str(i)].outputs[0].token_ids == without[str(i)].outputs[0].token_ids, f"conversation {i}"



def test_detokenize_false_gives_token_ids_only(make_tiny):
    """vLLM's detokenize=False: no text, logprobs without decoded tokens; stop strings need the text."""
    from loom.llm import LLM

    llm = LLM.from_engine(make_tiny())
    params = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    [plain] = llm.generate("hello there", SamplingParams(**params), use_tqdm=False)
    [bare] = llm.generate("hello there", SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids and bare.outputs[0].text == ""
    assert all(lp.decoded_token is None for d in bare.outputs[0].logprobs for lp in d.values())
    assert all(lp.decoded_token is None for d in bare.prompt_logprobs[1:] for lp in d.values())
    assert plain.outputs[0].text and plain.outputs[0].logprobs[0][plain.outputs[0].token_ids[0]].decoded_token
    with pytest.raises(InvalidRequestError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_async_engine_forgets_every_finished_request(make_tiny):
    """AsyncEngine (loom serve --no-engine-process, the cluster's replicas) keeps a queue per
    request only while it runs: finished ones (n = 1 and n > 1), aborted ones and ones whose
    reader stopped early all leave nothing behind (6.5 KB a finished request piled up)."""
    import asyncio

    from loom.engine.async_engine import AsyncEngine

    ae = AsyncEngine(make_tiny())

    async def run() -> None:
        async def drain(params: SamplingParams) -> None:
            outs = [out async for out in ae.generate("hello there", params)]
            assert outs[-1].finished

        async def first_only() -> None:
            async for _ in ae.generate("hello", SamplingParams(max_tokens=30, ignore_eos=True)):
                break

        await asyncio.gather(*(drain(SamplingParams(max_tokens=4, n=n, temperature=0.8, seed=n)) for n in (1, 1, 3)),
                             first_only())

    try:
        asyncio.run(run())
        assert ae._queues == {} and not ae.engine.has_unfinished_requests()
    finally:
        ae.shutdown()


def test_vllm_sampling_fields_output_kind_and_numpy_scalars(make_tiny):
    """vLLM's remaining SamplingParams fields: output_kind shapes AsyncEngine's stream (DELTA
    pieces join to the CUMULATIVE text, FINAL_ONLY is one output with every choice);
    guided_decoding is structured_outputs' earlier name; logits_processors and extra_args are
    refused by name; numpy booleans and priorities are taken as Python's."""
    import asyncio

    import numpy as np

    from loom.engine.async_engine import AsyncEngine
    from loom.sampling_params import GuidedDecodingParams, RequestOutputKind

    ae = AsyncEngine(make_tiny())

    async def collect(kind, n=1):
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, n=n, output_kind=kind,
                                logprobs=1)
        return [out async for out in ae.generate("hello there", params)]

    try:
        cumulative = asyncio.run(collect(RequestOutputKind.CUMULATIVE))
        delta = asyncio.run(collect("delta"))
        final = asyncio.run(collect(RequestOutputKind.FINAL_ONLY, n=2))
    finally:
        ae.shutdown()
    whole = cumulative[-1].outputs[0]
    assert len(delta) == len(cumulative) > 1 and delta[-1].finished
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
    assert sum(len(o.outputs[0].logprobs) for o in delta) == len(whole.logprobs) == 6
    assert len(final) == 1 and final[0].finished and [c.index for c in final[0].outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 for c in final[0].outputs)

    so = GuidedDecodingParams(choice=["yes", "no"])
    assert SamplingParams(guided_decoding=so).structured_outputs == so
    assert SamplingParams(guided_decoding={"regex": "a+"}).structured_outputs.regex == "a+"
    for kwargs, words in (({"guided_decoding": so, "structured_outputs": so}, "not both"),
                          ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
                          ({"extra_args": {"k": 1}}, "extra_args"),
                          ({"output_kind": "streaming"}, "output_kind")):
        with pytest.raises(InvalidRequestError, match=words):
            SamplingParams(**kwargs)
    assert SamplingParams(extra_args={}, logits_processors=[]).extra_args == {}
    flag = np.float32(1.0) > 0
    params = SamplingParams(ignore_eos=flag, max_tokens=2)
    assert params.ignore_eos is True
    engine = make_tiny()
    rid = engine.add_request("hello", params, priority=np.int64(3))
    assert engine.scheduler.waiting[0].priority == 3 and type(engine.scheduler.waiting[0].priority) is int
    engine.abort(rid)


def test_reset_prefix_cache_makes_the_next_prompt_compute_in_full(make_tiny):
    """LLM.reset_prefix_cache (vLLM's): a repeated prompt hits the cache, and after a reset it is
    computed again from its first token; refused while a request holds blocks."""
    from loom.llm import LLM

    llm = LLM.from_engine(make_tiny())
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    params = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    rid = llm.engine.add_request(prompt, params)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort(rid)
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate(prompt, params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.kv.pool.check_integrity()


def test_llm_get_metrics_names_the_engine_counters_as_vllm(make_tiny):
    """LLM.get_metrics (vLLM's reader shapes): the counters move with the work done, under
    /metrics' names; the step histogram's buckets are cumulative."""
    from loom.llm import LLM, Counter, Gauge, Histogram

    llm = LLM.from_engine(make_tiny())
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    llm.generate([prompt, prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert isinstance(metrics["vllm:num_requests_running"], Gauge) and metrics["vllm:num_requests_running"].value == 0
    generated = metrics["vllm:generation_tokens"]
    assert isinstance(generated, Counter) and generated.value == 6 and generated.labels["engine"] == "0"
    assert metrics["vllm:prompt_tokens"].value > 0 and metrics["vllm:prefix_cache_queries"].value > 0
    steps = metrics["vllm:iteration_tokens_total"]
    assert isinstance(steps, Histogram) and steps.count >= 3 and steps.buckets["+Inf"] == steps.count
    assert list(steps.buckets.values()) == sorted(steps.buckets.values())
    assert "vllm:spec_decode_num_drafts" not in metrics   # speculation off


def test_integers_past_64_bits_fail_their_request_or_mean_no_limit(make_tiny):
    """Integers past what a 64-bit tensor holds (a client's 1e20) never reach the step: top_k
    that large keeps every token; the others are refused or are limits the context cuts. The
    engine answers the next request as before (a huge top_k had failed the step)."""
    engine = make_tiny()
    huge = 10 ** 20
    assert SamplingParams(top_k=huge).top_k == 2**31 - 1
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for fields in ({"top_k": huge, "temperature": 0.7, "seed": 1}, {"max_tokens": huge}, {"min_tokens": huge,
                   "max_tokens": None}, {"truncate_prompt_tokens": huge},
                   {"stop_token_ids": [2**63, 2**64 + 5], "min_tokens": 2}):   # past the vocabulary: never banned
        try:
            params = SamplingParams(**{"max_tokens": 3, "ignore_eos": True, **fields})
        except InvalidRequestError:
            continue
        rid = engine.add_request("hello there", params)
        for _ in range(8):
            engine.step()
        engine.abort(rid)
    for priority in (huge, -huge):
        rid = engine.add_request("hello there", plain, priority=priority)
        engine.abort(rid)
    rid = engine.add_request("hello there", plain)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and len(done[0].outputs[0].token_ids) == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the thread re-raises
def test_a_failed_engine_thread_refuses_new_requests_at_once(make_tiny, monkeypatch):
    """AsyncEngine (loom serve --no-engine-process): once a step fails, the streams in flight end
    with EngineGoneError (a 503, not a 500) and a new request is refused at once (it waited
    forever for a thread that was gone)."""
    import asyncio

    from loom.engine.async_engine import AsyncEngine
    from loom.errors import EngineGoneError

    ae = AsyncEngine(make_tiny())

    def broken():
        raise RuntimeError("a bug in the step")

    monkeypatch.setattr(ae.engine, "step", broken)

    async def drain():
        return [o async for o in ae.generate("hello", SamplingParams(max_tokens=2))]

    try:
        with pytest.raises(EngineGoneError, match="engine step failed"):
            asyncio.run(drain())
        ae._thread.join(timeout=10)
        with pytest.raises(EngineGoneError, match="restart the server"):
            asyncio.run(asyncio.wait_for(drain(), timeout=10))
    finally:
        ae.shutdown()
