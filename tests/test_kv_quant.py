"""Quantized KV caches (kv_cache_dtype int8 / int4) in the engine, on tiny random-weight models:

  * the formats encode and decode as documented, and their rows are as small as promised;
  * a sequence's greedy output does not depend on how its KV was produced: prefix-cache hits
    (quantized shared blocks), copy-on-write forks (n > 1), speculative rollback and
    preemption all give the output of the request run alone (the row kernel is invariant, and
    a row is quantized on its own, so nothing is ever requantized);
  * with and without loom's kernels (LOOM_KERNELS=0 takes the torch path);
  * key smoothing (a model with q/k norms stores k / s and reads q * s): the scores and RoPE are
    unchanged by it, it is on for the quantized formats only, and on a Gemma 3 whose k norm has
    outlier channels it halves the int4 cache's KL divergence;
  * bad input: an unknown kv_cache_dtype lists the choices, int4 on a head size it cannot hold says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_gguf
import torch

from loom.config import KV_CACHE_DTYPES, EngineConfig
from loom.engine.engine import Engine
from loom.errors import InvalidRequestError
from loom.loader.gguf import GGUFFile
from loom.loader.tokenizer import Tokenizer
from loom.model.build import load_model
from loom.model.kv_cache import KVCacheTensors
from loom import kernels
from loom.model.kv_dtypes import FORMATS, format_of, hadamard, key_smoothing, kv_format
from loom.model.layers.rope import RotaryEmbedding, apply_rope
from loom.model.runner import score_slices
from loom.outputs import FinalOutputs
from loom.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A tiny llama with head_dim 32 (int4 groups are 32 wide), loaded once."""
    path = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("kvq") / "tiny32.gguf", seed=4, n_heads=2,
                                      n_kv_heads=1)
    f = GGUFFile.open(path)
    return path, load_model(f), Tokenizer.from_gguf(f)


def make(parts, **options) -> Engine:
    path, model, tok = parts
    opts = dict(block_size=4, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16) | options
    return Engine(EngineConfig.create(str(path), **opts), model=model, tokenizer=tok)


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int = 12, **params) -> list[list[int]]:
    ids = [engine.add_request({"prompt_token_ids": p},
                              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params))
           for p in prompts]
    done, gather = {}, FinalOutputs()
    steps = 0
    while engine.has_unfinished_requests():
        for out in gather.add_all(engine.step()):
            done[out.request_id] = out
        steps += 1
        assert steps < 5000, "engine made no progress"
    return [[c.token_ids for c in done[i].outputs] for i in ids]


def test_the_registry_is_the_config_s_list_and_rows_are_small():
    assert set(FORMATS) | {"auto"} == set(KV_CACHE_DTYPES)
    f16 = kv_format("float16").row_bytes(64)
    assert f16 / kv_format("int8").row_bytes(64) >= 1.9
    assert f16 / kv_format("int4").row_bytes(64) >= 3.5


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_formats_round_trip_within_their_step(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g)
    x[:, :, 5] *= 20          # an outlier channel: the rotation spreads it over the row
    f = kv_format(fmt)
    rows = f.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, f.row_size(64))
    assert format_of(rows, 64) is f
    err = (f.decode(rows) - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(err.max()) < (0.01 if fmt == "int8" else 0.15)
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=0, atol=1e-5)   # its own inverse


def test_unknown_kv_cache_dtype_lists_the_choices(tiny_llama_path):
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, float32, float16, int8, int4"):
        EngineConfig.create(str(tiny_llama_path), kv_cache_dtype="q8_0")


def test_int4_needs_head_dims_of_whole_groups(tiny_llama_path):
    """The tiny llama's head_dim is 16: an int4 row is made of 32-wide groups."""
    with pytest.raises(InvalidRequestError, match="int4 needs a head_dim that is a multiple of 32; this model's is 16"):
        Engine(EngineConfig.create(str(tiny_llama_path), num_blocks=16, kv_cache_dtype="int4"))


def test_a_fixed_kv_budget_holds_more_blocks(parts):
    budget = 1 << 20
    blocks = {kv: make(parts, num_blocks=None, kv_cache_memory=budget, kv_cache_dtype=kv).runner.num_blocks
              for kv in ("float16", "int8", "int4")}
    assert blocks["int8"] >= 1.8 * blocks["float16"]       # head_dim 32: 34 bytes a row against 64
    assert blocks["int4"] >= 3.2 * blocks["float16"]       # 20 bytes a row


def _prompts(tok, n: int) -> list[list[int]]:
    words = "the cat sat on a mat while seven dogs ran past the old red barn and sang".split()
    return [tok.encode(" ".join(words[i % 5:] + words[:i % 5]) * 2)[:20 + 3 * i] for i in range(n)]


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_outputs_do_not_depend_on_how_the_kv_was_made(parts, fmt, kernels_on, monkeypatch):
    if not kernels_on:   # the pure-torch path: the model's kernels off for this test
        monkeypatch.setattr(parts[1], "kern", None)
    tok = parts[2]
    prompts = _prompts(tok, 4)
    alone = [greedy(make(parts, kv_cache_dtype=fmt, enable_prefix_caching=False), [p])[0][0] for p in prompts]

    # prefix caching: the same prompts again, after themselves, hit quantized shared blocks
    engine = make(parts, kv_cache_dtype=fmt)
    assert engine.kv_dtype.name == fmt
    greedy(engine, prompts)
    again = [o[0] for o in greedy(engine, prompts)]
    assert engine.scheduler.kv.stats.prefix_cache_hits > 0
    assert again == alone
    # copy-on-write forks: n = 3 greedy children share the prompt's blocks
    forks = greedy(make(parts, kv_cache_dtype=fmt), [prompts[1]], n=3)[0]
    assert forks == [alone[1]] * 3
    # speculative decoding: drafts verified and rolled back
    spec = make(parts, kv_cache_dtype=fmt, speculative_config={"method": "prompt_lookup"})
    assert [o[0] for o in greedy(spec, prompts)] == alone
    # preemption: too few blocks for all four at once, so some are recomputed
    small = make(parts, kv_cache_dtype=fmt, num_blocks=20, enable_prefix_caching=False)
    assert [o[0] for o in greedy(small, prompts)] == alone
    assert small.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_kv_stays_close_to_float32(parts, fmt):
    """Log-probabilities over a private cache of each format, against a float32 cache."""
    model = parts[1]
    ids = list(range(3, 90))
    ref = torch.cat(list(score_slices(model, ids, 0, torch.float32, chunk=32)))
    got = torch.cat(list(score_slices(model, ids, 0, kv_format(fmt), chunk=32)))
    kld = (ref.exp() * (ref - got)).sum(-1).mean()
    assert float(kld) < (1e-4 if fmt == "int8" else 1e-2)
    cache = KVCacheTensors(model.cfg, 8, fmt)
    assert cache.layers[0][0].dtype == torch.uint8 and cache.format.name == fmt


def test_key_smoothing_keeps_every_score_and_commutes_with_rope():
    g = torch.Generator().manual_seed(1)
    D = 32
    q_norm, k_norm = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    k_norm[[3, 19]] = 30.0      # an outlier key channel pair, as Gemma 3's k norms have
    k_norm[[5, 21]] = 0.0       # and a dead one
    s = key_smoothing(q_norm, k_norm)
    assert s.shape == (D,) and bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert torch.equal(s[:D // 2], s[D // 2:])                  # one factor per RoPE pair (j, j + D/2)
    assert float(s[3]) > 4 * float(s.median()) and float(s[5]) < float(s.median())
    cos, sin = RotaryEmbedding(D, 10_000.0, 64).tables(torch.arange(40), torch.float32)
    x = torch.randn(40, 2, D, generator=g)
    torch.testing.assert_close(apply_rope(x * s, cos, sin), apply_rope(x, cos, sin) * s)
    q, k = torch.randn(7, D, generator=g), torch.randn(9, D, generator=g)
    torch.testing.assert_close((q * s) @ (k / s).T, q @ k.T)


@pytest.fixture(scope="module")
def outlier_gemma(tmp_path_factory):
    """A tiny Gemma 3 (head_dim 32) whose k norms scale two RoPE pairs 30x, on loom's kernels
    where this CPU has them."""
    path = tiny_gguf.write_tiny_gemma3(tmp_path_factory.mktemp("kvq") / "gemma32.gguf", seed=3, n_layers=2,
                                       sliding_window=64)
    f = GGUFFile.open(path)
    model = load_model(f, linear="quant" if kernels.available() else "exact")
    for layer in model.layers:
        layer.k_norm = layer.k_norm.clone()
        layer.k_norm[[3, 19, 7, 23]] *= 30.0
        layer.__post_init__()        # the smoothed norms again, from the new weights
    return path, model, Tokenizer.from_gguf(f)


def _kld_vs_float32(model, fmt: str) -> float:
    ids = list(range(3, 90))
    ref = torch.cat(list(score_slices(model, ids, 0, torch.float32, chunk=32)))
    got = torch.cat(list(score_slices(model, ids, 0, kv_format(fmt), chunk=32)))
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.mark.parametrize("kernels_on", [True, False])
def test_key_smoothing_halves_the_int4_error_of_outlier_keys(outlier_gemma, kernels_on, monkeypatch):
    model = outlier_gemma[1]
    if not kernels_on:
        monkeypatch.setattr(model, "kern", None)
    layer = model.layers[0]
    assert layer.qk_norms(kv_format("float16")) == (layer.q_norm, layer.k_norm)   # float caches: plain
    assert layer.qk_norms(kv_format("int4"))[1] is layer.k_norm_kv
    smoothed = _kld_vs_float32(model, "int4")
    for L in model.layers:   # the same cache without the smoothing
        monkeypatch.setattr(L, "q_norm_kv", L.q_norm)
        monkeypatch.setattr(L, "k_norm_kv", L.k_norm)
    plain = _kld_vs_float32(model, "int4")
    assert smoothed < 0.7 * plain and smoothed < 5e-3


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_smoothed_gemma_outputs_do_not_depend_on_how_the_kv_was_made(outlier_gemma, fmt):
    prompts = _prompts(outlier_gemma[2], 3)
    alone = [greedy(make(outlier_gemma, kv_cache_dtype=fmt, enable_prefix_caching=False), [p])[0][0]
             for p in prompts]
    engine = make(outlier_gemma, kv_cache_dtype=fmt)
    greedy(engine, prompts)
    assert [o[0] for o in greedy(engine, prompts)] == alone and engine.scheduler.kv.stats.prefix_cache_hits > 0
    assert greedy(make(outlier_gemma, kv_cache_dtype=fmt), [prompts[1]], n=3)[0] == [alone[1]] * 3
    small = make(outlier_gemma, kv_cache_dtype=fmt, num_blocks=16, enable_prefix_caching=False)
    assert [o[0] for o in greedy(small, prompts)] == alone and small.scheduler.stats.num_preemptions > 0
