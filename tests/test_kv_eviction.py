"""KV eviction (loom/kv/eviction): StreamingLLM and SnapKV under a token budget.

Policies and the block manager on their own, then engines over the tiny llama (block size 4),
the in-process server, and a real model running past its context window.
"""

from __future__ import annotations

import pytest
import torch

from loom.errors import InvalidRequestError
from loom.eviction_params import KVEvictionParams
from loom.kv.eviction import SnapKVEviction, StreamingEviction, kept_runs, make_policy, positions_tensor
from loom.kv.manager import KVCacheManager
from loom.model.kv_cache import KVCacheTensors, kv_keys
from loom.model.kv_dtypes.int8 import INT8
from loom.sampling_params import SamplingParams

STREAM = {"policy": "streaming", "budget": 32}


def greedy(max_tokens: int, eviction=None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_eviction=eviction, **kw)


def run(engine, prompt, params, watch=None) -> list[int]:
    """Token ids generated for one request; `watch(engine, rid)` after every step."""
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
        engine.kv.check_integrity()
        if watch is not None and rid in engine.scheduler.requests:
            watch(engine, rid)
    return list(out.outputs[0].token_ids)


# -- parameters -------------------------------------------------------------------------------------


def test_params_validate_and_name_the_fields():
    p = KVEvictionParams.create({"policy": "streaming", "sinks": 4, "window": 1020})
    assert p.budget == 1024
    s = KVEvictionParams.create({"policy": "snapkv", "budget": 512})
    assert (s.window, s.pool) == (32, 7)
    cases = [
        ({"policy": "streaming", "budget": 64, "sinks": 8, "window": 60},
         ["budget must be at least sinks + window", "(8 + 60)", "got 64"]),
        ({"policy": "h2o", "budget": 64}, ["streaming, snapkv, none", "'h2o'"]),
        ({"policy": "snapkv", "budget": 64, "bogus": 1}, ["'bogus'", "known"]),
        ({"policy": "snapkv", "budget": 64, "pool": 4}, ["pool must be odd"]),
        ({"policy": "streaming", "budget": 64, "pool": 3}, ["snapkv' only"]),
        ({"policy": "streaming"}, ["needs a budget"]),
        ({"budget": 64}, ["needs a 'policy'"]),
        ({"policy": "streaming", "budget": 0}, ["budget must be an integer >= 1"]),
    ]
    for value, words in cases:
        with pytest.raises(InvalidRequestError) as e:
            KVEvictionParams.create(value)
        assert all(w in str(e.value) for w in words), (value, str(e.value))
    with pytest.raises(InvalidRequestError, match="kv_eviction must be an object"):
        KVEvictionParams.create("streaming")


def test_params_refuse_features_eviction_cannot_serve():
    with pytest.raises(InvalidRequestError, match="kv_eviction cannot be combined with prompt_logprobs"):
        SamplingParams(kv_eviction=STREAM, prompt_logprobs=1)
    with pytest.raises(InvalidRequestError, match="kv_eviction cannot be combined with n > 1"):
        SamplingParams(kv_eviction=STREAM, n=2)
    # opting out goes with anything
    assert SamplingParams(kv_eviction={"policy": "none"}, n=2).kv_eviction.enabled is False


# -- policies ------------------------------------------------------------------------------------------


def test_streaming_frees_whole_blocks_after_the_sinks_oldest_first():
    pol = StreamingEviction(KVEvictionParams("streaming", budget=32, sinks=4))
    assert pol.blocks_to_drop(31, 1, 4) == []                 # fits
    assert pol.blocks_to_drop(32, 1, 4) == [1]                # one over: the oldest block after the sink block
    assert pol.blocks_to_drop(40, 8, 4) == [1, 2, 3, 4]       # 16 over
    assert pol.blocks_to_drop(12, 64, 4) == [1, 2]            # a long chunk: everything but sinks and the partial
    win = StreamingEviction(KVEvictionParams("streaming", budget=32, sinks=4, window=26))
    assert win.blocks_to_drop(33, 1, 4) == []                 # entries 7.. are the window: block 1 is not wholly before it
    assert win.blocks_to_drop(35, 1, 4) == [1]


def test_snapkv_keeps_the_attended_tokens_the_sinks_and_the_window():
    torch.manual_seed(0)
    L, w, Hkv, G, D = 40, 4, 2, 2, 8
    keys = torch.randn(L, Hkv, D) * 0.1
    hot = [9, 23]
    q = torch.zeros(w, Hkv * G, D)
    for h in hot:                       # every observed query points at the hot keys
        keys[h] = 3.0
    q[:] = 3.0
    pol = SnapKVEviction(KVEvictionParams("snapkv", budget=12, sinks=2, window=w, pool=1))
    keep = pol.select([(q, None)], lambda layer: keys, 1.0)
    assert len(keep) == 12 and keep == sorted(keep)
    assert keep[:2] == [0, 1] and keep[-w:] == list(range(L - w, L))
    assert set(hot) <= set(keep)
    assert pol.select([(q, None)], lambda layer: keys[:12], 1.0) is None   # within budget: keep all
    assert make_policy(KVEvictionParams("none")) is None


# -- the block manager -------------------------------------------------------------------------------


def test_kv_runs_follow_the_positions_of_the_kept_entries():
    runs = kept_runs((), 16, [0, 1, 2, 3])                 # blocks 1..3 of 16 entries dropped
    assert runs == ((0, 0), (4, 16))                        # the next entry goes at position 16
    assert positions_tensor(runs, 7).tolist() == [0, 1, 2, 3, 16, 17, 18]
    again = kept_runs(runs, 10, [0, 1, 2, 3, 6, 8])        # positions 18 and 20 kept, next is 22
    assert again == ((0, 0), (4, 18), (5, 20), (6, 22))
    assert positions_tensor(again, 8).tolist() == [0, 1, 2, 3, 18, 20, 22, 23]
    assert kept_runs((), 8, range(8)) == () and positions_tensor((), 3).tolist() == [0, 1, 2]


def test_drop_blocks_never_frees_a_block_another_sequence_holds():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 120))                       # 5 full blocks
    kv.allocate("a", prompt, 0, 20)
    hit = kv.find_prefix("b", prompt)
    assert len(hit.block_ids) == 4
    kv.allocate("b", prompt, hit.num_tokens, 4, prefix=hit)
    shared = kv.block_table("a")[:4]
    assert kv.block_table("b")[:4] == shared
    kv.drop_blocks("b", [1, 2])
    assert kv.block_table("b")[:2] == [shared[0], shared[3]]
    for b in shared:                                     # still held by "a", content and hash untouched
        assert kv.pool.refcount(b) >= 1 and kv.pool.block_hash(b) is not None
    kv.check_integrity()
    # blocks filled after an eviction hold KV over a cut context: never cached
    before = {kv.pool.block_hash(b) for b in kv.block_table("b")}
    kv.allocate("b", prompt + list(range(8)), 12, 8)
    assert {kv.pool.block_hash(b) for b in kv.block_table("b")[3:]} == {None}
    assert before - {None} <= {kv.pool.block_hash(b) for b in shared}
    kv.free("b")
    assert all(kv.pool.refcount(b) == 1 for b in shared)
    kv.check_integrity()


def test_compact_packs_kept_entries_into_fresh_blocks_and_writes_no_shared_block():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(200, 224))                       # 6 full blocks, all cached
    kv.allocate("a", prompt, 0, 24)
    hit = kv.find_prefix("b", prompt)
    kv.allocate("b", prompt, hit.num_tokens, 24 - hit.num_tokens, prefix=hit)
    old = kv.block_table("b")
    keep = [0, 1, 2, 3, 4, 6, 9, 13, 20, 21, 22, 23]
    moves = kv.compact("b", keep)
    new = kv.block_table("b")
    assert new[0] == old[0] and len(new) == 3            # the leading block kept whole stays in place
    held_by_a = set(kv.block_table("a"))
    assert not {dst // 4 for _, dst in moves} & held_by_a   # destinations are fresh blocks
    assert [src for src, _ in moves] == [old[x // 4] * 4 + x % 4 for x in keep[4:]]
    assert all(kv.pool.block_hash(b) is not None for b in held_by_a)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


# -- engines over the tiny llama -----------------------------------------------------------------------


def test_streaming_within_budget_changes_nothing(make_tiny):
    engine = make_tiny()
    prompt = list(range(5, 45))
    plain = run(engine, prompt, greedy(20))
    roomy = run(make_tiny(enable_prefix_caching=False), prompt, greedy(20, {"policy": "streaming", "budget": 128}))
    assert plain == roomy


@pytest.mark.parametrize("budget", [32, 30])      # whole blocks of 4, and not
def test_streaming_tokens_do_not_depend_on_how_the_prompt_is_chunked(make_tiny, budget):
    """Each prompt token sees the entries it would see computed one by one, whatever the step's
    token budget, a prefix-cache hit or another request in the batch: the output's logprobs
    (which read the whole evicted cache) agree to float32 rounding (the tiny model's float32
    weights run through torch, whose sums depend on the chunk's rows: 5e-7 here; a chunk that
    evicted before tokens it should not have moved them by 8e-3)."""
    prompt = list(range(5, 105))
    params = greedy(12, {"policy": "streaming", "budget": budget}, logprobs=0)

    def scored(engine) -> list[float]:
        rid = engine.add_request(prompt, params)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]

    want = scored(make_tiny(enable_prefix_caching=False, max_num_batched_tokens=64))
    for opts in ({"max_num_batched_tokens": 8}, {"max_num_batched_tokens": 7}, {"max_num_batched_tokens": 256}):
        assert scored(make_tiny(enable_prefix_caching=False, **opts)) == pytest.approx(want, abs=1e-5), opts
    warm = make_tiny()
    run(warm, prompt, greedy(2))                                     # the prompt's blocks cached
    assert scored(warm) == pytest.approx(want, abs=1e-5)
    busy = make_tiny(enable_prefix_caching=False, max_num_batched_tokens=48)
    busy.add_request(list(range(200, 260)), greedy(30))
    assert scored(busy) == pytest.approx(want, abs=1e-5)


def test_streaming_runs_past_the_context_with_bounded_kv(make_tiny):
    engine = make_tiny(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="context limit is 64"):
        engine.add_request(list(range(5, 85)), greedy(4))
    assert len(run(engine, list(range(5, 45)), greedy(100))) == 24             # without eviction: the context's room
    seen = []

    def watch(e, rid):
        seen.append(len(e.kv.block_table(rid)) * 4)

    tokens = run(engine, list(range(5, 85)), greedy(100, STREAM), watch)
    assert len(tokens) == 100                                   # 180 positions on a 64-token context
    assert max(seen[1:]) <= 32 and engine.kv.num_free_blocks() == 512


def test_positions_after_eviction_are_the_unevicted_positions(make_tiny, monkeypatch):
    engine = make_tiny(max_num_batched_tokens=16)
    calls: list[tuple[list[int], list[int]]] = []
    forward = engine.runner.model.forward

    def spy(ids, positions, meta, kv):
        calls.append((positions.tolist(), list(meta.context_lens)))
        return forward(ids, positions, meta, kv)

    monkeypatch.setattr(engine.runner.model, "forward", spy)
    prompt = list(range(7, 67))
    run(engine, prompt, greedy(30))
    plain, calls[:] = list(calls), []
    run(make_tiny(enable_prefix_caching=False, max_num_batched_tokens=16), prompt, greedy(30, STREAM))
    # RoPE positions: the true ones (past the budget the prompt goes a block at a time)
    assert [q for p, _ in calls for q in p] == [q for p, _ in plain for q in p]
    assert max(c for _, ctx in calls for c in ctx) <= 32 < max(c for _, ctx in plain for c in ctx)


def test_eviction_leaves_a_shared_prefix_to_its_other_holders(make_tiny):
    prompt = list(range(10, 70))
    alone = run(make_tiny(), prompt, greedy(24))
    engine = make_tiny()
    a = engine.add_request(prompt, greedy(24))
    engine.step()                                              # a's prompt is in blocks (and cached)
    b = engine.add_request(prompt + [3, 4], greedy(24, STREAM))
    shared = engine.kv.block_table(a)[:15]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        engine.kv.check_integrity()
        if a in engine.scheduler.requests:
            assert engine.kv.block_table(a)[:15] == shared
            assert all(engine.kv.pool.refcount(x) >= 1 for x in shared)
    assert engine.scheduler.requests == {} and outs[a] == alone and len(outs[b]) == 24


def test_snapkv_compresses_the_prompt_to_the_budget(make_tiny):
    engine = make_tiny()
    params = greedy(12, {"policy": "snapkv", "budget": 32, "window": 8})
    kv_lens = []
    tokens = run(engine, list(range(5, 105)), params,
                 lambda e, rid: kv_lens.append(e.scheduler.requests[rid].kv_len))
    assert len(tokens) == 12
    after = kv_lens[kv_lens.index(100) + 1:]                  # the prompt, then 32 kept + one token a step
    assert after == list(range(33, 33 + len(after))) and len(after) >= 9
    assert engine.kv.num_free_blocks() == 512
    # a prompt within the budget is left alone
    assert run(engine, list(range(5, 25)), params) == run(make_tiny(), list(range(5, 25)), greedy(12))


def test_a_preempted_snapkv_request_selects_at_its_prompts_end_again(make_tiny):
    """Preempted mid-answer, a SnapKV request computes its prompt again, selects from the same
    window at the prompt's end, then its output on the kept entries: the answer it would have
    given alone (it had observed the end of prompt + output instead, and selected other
    entries: a different greedy answer). (A selection that cannot be packed for want of free
    blocks is applied a step later instead: `Scheduler._evict`.)"""
    prompt = list(range(5, 105))
    params = greedy(24, {"policy": "snapkv", "budget": 32, "window": 8}, logprobs=0)

    def answer(engine, preempt_at: int | None):
        rid = engine.add_request(prompt, params)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
            req = engine.scheduler.requests.get(rid)
            if preempt_at is not None and req is not None and req.num_output_tokens == preempt_at:
                engine.scheduler._preempt(req)   # as a lack of blocks would, here with room to recompute
                preempt_at = None
            engine.kv.check_integrity()
        return list(out.outputs[0].token_ids), [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]

    alone_tokens, alone_lps = answer(make_tiny(enable_prefix_caching=False), None)
    for at in (1, 9):
        engine = make_tiny(enable_prefix_caching=False)
        tokens, lps = answer(engine, at)
        assert engine.scheduler.stats.num_preemptions == 1
        assert tokens == alone_tokens and lps == pytest.approx(alone_lps, abs=1e-5), at


def test_snapkv_scores_a_quantized_kv_cache_from_its_decoded_keys(make_tiny, tiny_parts):
    keys = torch.randn(10, 2, 16)
    cache = KVCacheTensors(tiny_parts[1].cfg, 10, "int8").layers
    cache[0][0][:] = INT8.encode(keys)
    got = kv_keys(cache, torch.arange(10), 16)(0)                 # [10, 2, 16] float32
    assert got.shape == keys.shape and (got - keys).abs().max() <= keys.abs().amax() / 100
    engine = make_tiny(kv_cache_dtype="int8")
    kv_lens = []
    tokens = run(engine, list(range(5, 105)), greedy(12, {"policy": "snapkv", "budget": 32, "window": 8}),
                 lambda e, rid: kv_lens.append(e.scheduler.requests[rid].kv_len))
    assert len(tokens) == 12
    after = kv_lens[kv_lens.index(100) + 1:]
    assert after == list(range(33, 33 + len(after))) and len(after) >= 9


def test_prefix_hits_are_cut_to_what_the_policy_could_hold(make_tiny):
    engine = make_tiny()
    prompt = list(range(5, 105))
    run(engine, prompt, greedy(2))                                   # caches 96 tokens of the prompt
    cached = {}
    for name, eviction in (("plain", None), ("streaming", STREAM),
                           ("snapkv", {"policy": "snapkv", "budget": 32, "window": 8})):
        rid = engine.add_request(prompt, greedy(2, eviction))
        engine.step()
        cached[name] = engine.scheduler.requests[rid].num_cached_tokens
        while engine.has_unfinished_requests():
            engine.step()
    # streaming: whole blocks below its budget of 32; snapkv: 100 - 8, whole blocks
    assert cached == {"plain": 96, "streaming": 28, "snapkv": 92}


def test_engine_default_and_bad_combinations(make_tiny):
    engine = make_tiny(kv_eviction=STREAM, max_model_len=64)
    assert len(run(engine, list(range(5, 85)), greedy(80))) == 80                # the default applies
    with pytest.raises(InvalidRequestError, match="context limit is 64"):           # opted out
        engine.add_request(list(range(5, 85)), greedy(4, {"policy": "none"}))
    with pytest.raises(InvalidRequestError, match="two KV blocks"):
        engine.add_request([5, 6], greedy(4, {"policy": "streaming", "budget": 4}))
    with pytest.raises(InvalidRequestError, match=r"budget must leave a block of the context limit \(64\).*got 63"):
        engine.add_request([5, 6], greedy(4, {"policy": "streaming", "budget": 63}))
    rid = engine.add_request(list(range(5, 20)), greedy(8, STREAM))
    with pytest.raises(InvalidRequestError, match="kv_eviction cannot be combined with forks"):
        engine.fork(rid, 2)
    with pytest.raises(InvalidRequestError, match="speculative decoding"):
        make_tiny(kv_eviction=STREAM, speculative_config={"method": "prompt_lookup"})
    spec = make_tiny(speculative_config={"method": "prompt_lookup"})
    with pytest.raises(InvalidRequestError, match="kv_eviction cannot be combined with speculative decoding"):
        spec.add_request([5, 6], greedy(4, STREAM))


# -- the server ---------------------------------------------------------------------------------------------


def test_server_accepts_kv_eviction_and_refuses_bad_values(make_tiny):
    from fastapi.testclient import TestClient

    from loom.engine.async_engine import AsyncEngine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    engine = make_tiny(max_model_len=64)
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(engine)), served_model_name="tiny")) as client:
        body = {"model": "tiny", "prompt": list(range(5, 85)), "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 400          # past the context
        ok = client.post("/v1/completions", json={**body, "kv_eviction": STREAM})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
        bad = [({"policy": "streaming", "budget": 16, "sinks": 8, "window": 12}, "sinks + window (8 + 12)"),
               ({"policy": "lru", "budget": 32}, "policy"),
               ({"policy": "streaming", "budget": 32, "extra": 1}, "extra")]
        for value, words in bad:
            r = client.post("/v1/completions", json={**body, "kv_eviction": value})
            assert r.status_code == 400 and words in r.text, r.text
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "kv_eviction": {"policy": "snapkv", "budget": 32}}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        echo = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "prompt_logprobs": 1, "kv_eviction": STREAM}
        r = client.post("/v1/completions", json=echo)
        assert r.status_code == 400 and "prompt_logprobs" in r.text and "kv_eviction" in r.text


# -- a real model ------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_model_streams_past_its_context(real_models):
    engine = real_models.engine("smollm2-135m", dtype="auto", max_model_len=256, num_blocks=64,
                                max_num_batched_tokens=128)
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)       # > 256 tokens
    assert len(prompt) > 256
    params = greedy(64, {"policy": "streaming", "budget": 128, "sinks": 4})
    tokens = run(engine, prompt, params)
    assert len(tokens) == 64
    assert "fox" in tok.decode(tokens)           # it keeps the pattern going past position 256


# -- loom eval's scorer ------------------------------------------------------------------------------------


def test_eval_scorer_cuts_the_context_as_the_engine_does(tiny_parts):
    from loom.model.runner import score_slices
    from loom.model.score_evicted import score_evicted

    _, model, _ = tiny_parts
    toks = list(range(5, 205))
    full = torch.cat(list(score_slices(model, toks, 0)))
    roomy = make_policy(KVEvictionParams("streaming", budget=400))
    assert torch.allclose(torch.cat(list(score_evicted(model, toks, 0, roomy, 100))), full, atol=1e-5)
    for params in (KVEvictionParams("streaming", budget=64), KVEvictionParams("snapkv", budget=64, window=8)):
        cut = torch.cat(list(score_evicted(model, toks, 0, make_policy(params), 120)))
        assert cut.shape == full.shape
        assert torch.allclose(cut[:60], full[:60], atol=1e-5)          # nothing evicted yet
        assert not torch.allclose(cut[130:], full[130:], atol=1e-3)    # past the budget the context is cut
    tail = torch.cat(list(score_evicted(model, toks, 150, make_policy(KVEvictionParams("streaming", budget=64)), 0)))
    assert tail.shape[0] == 49


def test_sliding_window_model_evicts_too(tiny_gemma3_path):
    """Gemma 3 (sliding-window layers): a roomy budget changes nothing, a tight one runs on."""
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    def make(**options):
        return Engine(EngineConfig.create(str(tiny_gemma3_path), block_size=4, num_blocks=256,
                                          max_num_batched_tokens=16, max_num_seqs=4, **options))

    prompt = list(range(5, 60))
    plain = run(make(), prompt, greedy(24))
    assert run(make(enable_prefix_caching=False), prompt, greedy(24, {"policy": "streaming", "budget": 256})) == plain
    engine = make(max_model_len=48)
    assert len(run(engine, prompt, greedy(40, {"policy": "streaming", "budget": 24}))) == 40
    assert len(run(engine, prompt[:40], greedy(6, {"policy": "snapkv", "budget": 24, "window": 4}))) == 6


# -- sliding windows by position after eviction (Gemma 3) --------------------------------------------------


def _by_position(visible: torch.Tensor, window: int) -> torch.Tensor:
    """[T, T]: the visible keys of each query p with position > p - window."""
    pos = torch.arange(visible.shape[0])
    return visible & (pos[None, :] > pos[:, None] - window)


def _last_entries(visible: torch.Tensor, window: int) -> torch.Tensor:
    """[T, T]: the last `window` visible keys of each query (the rule before positions were known)."""
    return visible & (visible.flip(1).cumsum(1).flip(1) <= window)


def _gemma3_reference(model, ids: list[int], visible: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, V] of the tiny gemma3 over one sequence computed in one pass, the query
    at position p seeing the keys visible[p] in the global layers and local[p] in the
    sliding-window ones. A key's K/V depends only on its own row, so one pass with the rows an
    engine's steps saw computes what the step-by-step run computes."""
    from loom.model.layers.norm import rms_norm
    from loom.model.layers.rope import apply_rope

    cfg, eps = model.cfg, model.cfg.rms_norm_eps
    T, H, Hkv, Dh = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    h = model.embed[torch.tensor(ids)] * model.embed_scale                                 # [T, D]
    for layer in model.layers:
        cos, sin = (model.rope_local if layer.sliding else model.rope_global).tables(pos, torch.float32)
        q, k, v = layer.qkv(rms_norm(h, layer.attn_norm, eps)).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q = apply_rope(rms_norm(q.view(T, H, Dh), layer.q_norm, eps), cos, sin).transpose(0, 1)    # [H, T, Dh]
        k = apply_rope(rms_norm(k.view(T, Hkv, Dh), layer.k_norm, eps), cos, sin).transpose(0, 1)  # [Hkv, T, Dh]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.view(T, Hkv, Dh).transpose(0, 1), attn_mask=local if layer.sliding else visible,
            scale=cfg.attn_scale, enable_gqa=True)                                         # [H, T, Dh]
        h = h + rms_norm(layer.o(o.transpose(0, 1).reshape(T, H * Dh)), layer.post_attn_norm, eps)
        gate, up = layer.gate_up(rms_norm(h, layer.ffn_norm, eps)).chunk(2, dim=-1)
        h = h + rms_norm(layer.down(torch.nn.functional.gelu(gate, approximate="tanh") * up), layer.post_ffn_norm, eps)
    return model.compute_logits(rms_norm(h, model.norm, eps))


class _Recorder:
    """Spies on a model: the positions each forward pass computed with the positions of the KV
    entries it saw (the visibility of the reference), and the logits the engine sampled from."""

    def __init__(self, model, monkeypatch):
        self.visible = torch.zeros(512, 512, dtype=torch.bool)
        self.logits: list[tuple[int, torch.Tensor]] = []
        self.evicted_steps = 0
        forward, logits = model.forward, model.compute_logits

        def spy_forward(ids, positions, meta, kv):
            keys = meta.positions_of(0)
            self.evicted_steps += keys is not None
            keys = torch.arange(meta.context_lens[0]) if keys is None else keys
            for p in positions.tolist():
                self.visible[p, keys[keys <= p]] = True
            self.last = positions[-1].item()
            return forward(ids, positions, meta, kv)

        def spy_logits(hidden, argmax=None, argmax_only=False):
            out = logits(hidden, argmax)   # the logits, always: the spy reads them
            self.logits.append((self.last, out[-1]))
            return out

        monkeypatch.setattr(model, "forward", spy_forward)
        monkeypatch.setattr(model, "compute_logits", spy_logits)


@pytest.fixture(scope="module")
def tiny_gemma3_w16(tmp_path_factory):
    """A tiny gemma3 (5 window layers + 1 global) with a 16-token window and its tokenizer."""
    import tiny_gguf

    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer

    path = tiny_gguf.write_tiny_gemma3(tmp_path_factory.mktemp("g16") / "g16.gguf", sliding_window=16, seed=3)
    return path, Tokenizer.from_gguf(GGUFFile.open(path))


@pytest.mark.parametrize("dtype", ["float32", "auto"])    # the torch path; loom's kernels (float16 KV)
@pytest.mark.parametrize("eviction", [{"policy": "streaming", "budget": 16},
                                      {"policy": "snapkv", "budget": 12, "window": 4}], ids=["streaming", "snapkv"])
def test_window_layers_see_the_kept_entries_within_their_window(tiny_gemma3_w16, monkeypatch, dtype, eviction):
    """With evicted entries, a sliding-window layer attends to the kept keys within W positions
    of the query, not to the last W kept entries (which here reach the sinks or the selected
    old tokens): the logits the engine samples from equal a one-pass reference with exactly
    those keys visible, step by step."""
    from loom.config import EngineConfig
    from loom.engine.engine import Engine
    from loom.model.build import load_model

    path, tok = tiny_gemma3_w16
    model = load_model(path, linear="exact" if dtype == "float32" else "auto")
    assert (model.kern is None) == (dtype == "float32")
    rec = _Recorder(model, monkeypatch)
    engine = Engine(EngineConfig.create(str(path), dtype=dtype, block_size=4, num_blocks=256, max_num_batched_tokens=16,
                                        max_num_seqs=4, enable_prefix_caching=False), model=model, tokenizer=tok)
    prompt = list(range(5, 85))
    tokens = run(engine, prompt, greedy(30, eviction))
    assert len(tokens) == 30 and rec.evicted_steps >= 29        # every step after the cut
    T = len(prompt) + len(tokens) - 1
    visible, rows = rec.visible[:T, :T], [p for p, _ in rec.logits]
    got = torch.stack([row for _, row in rec.logits])
    want = _gemma3_reference(model, prompt + tokens[:-1], visible, _by_position(visible, 16))[rows]
    # the rule before: the last W kept entries, which reach the sinks or the selected old tokens
    before = _gemma3_reference(model, prompt + tokens[:-1], visible, _last_entries(visible, 16))[rows]
    err, err_before = float((got - want).abs().max()), float((got - before).abs().max())
    tol = 1e-5 if dtype == "float32" else 0.05      # auto: int8 activations, float16 KV
    assert err <= tol * float(want.abs().max()) and err_before > 10 * err


@pytest.mark.parametrize("params", [KVEvictionParams("streaming", budget=16),
                                    KVEvictionParams("snapkv", budget=12, window=4)], ids=["streaming", "snapkv"])
def test_eval_scorer_windows_by_position_as_the_engine_does(tiny_gemma3_w16, monkeypatch, params):
    """`loom eval --kv-eviction` on a sliding-window model: every scored token's log-probabilities
    equal the one-pass reference with the keys its chunk kept, windowed by position."""
    from loom.model.build import load_model
    from loom.model.score_evicted import score_evicted

    model = load_model(tiny_gemma3_w16[0], linear="exact")
    rec = _Recorder(model, monkeypatch)
    toks = list(range(5, 125))
    got = torch.cat(list(score_evicted(model, toks, 0, make_policy(params), 80)))     # [T - 1, V]
    T = len(toks)
    visible = rec.visible[:T, :T]
    assert rec.evicted_steps > 0 and not torch.equal(_by_position(visible, 16), _last_entries(visible, 16))
    want = _gemma3_reference(model, toks, visible, _by_position(visible, 16)).log_softmax(dim=-1)[:T - 1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_prefix_cache_counts_each_prompt_once_under_pressure(make_tiny):
    """A request waiting for blocks looks its prompt up every step, and a preempted one again
    when readmitted: the counters take each prompt once, at its first admission (they read
    17,849 queried tokens for two 150-token prompts)."""
    engine = make_tiny(num_blocks=24, max_num_batched_tokens=16)
    prompts = [list(range(5, 55)), list(range(100, 150))]
    for p in prompts:
        engine.add_request(p, greedy(40))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.stats.num_preemptions >= 1
    assert (engine.kv.stats.prefix_cache_queries, engine.kv.stats.prefix_cache_hits) == (100, 0)
