"""loom's model runtime against transformers, the reference implementation.

Layers:
  1. tiny random models (llama, gemma3 with a window of 8) in several quantization mixes:
     logits at every position equal transformers' within the tolerance (seconds);
  2. the shipped models on Spec-Bench text: logits of 1-, 7-, 100- and 1000-token prompts
     (Gemma's past its 512-token sliding window), the same prompt in 3 chunks through the
     paged cache, and 64 greedy tokens on 10 prompts per model.

Tolerance, everywhere: at each position, max |loom - reference| <= 1e-3 * max |reference|.
loom's float32 ("exact") mode currently reproduces transformers bit for bit; the tolerance
leaves room for a different but equally accurate summation order.
"""

from __future__ import annotations

import random

import hf_reference
import pytest
import tiny_gguf
import torch
from conftest import real_model_path, spec_bench_questions

from loom.llm import LLM
from loom.loader.gguf import GGUFFile
from loom.loader.tokenizer import Tokenizer
from loom.model.build import load_model
from loom.model.layers.attention import AttentionMetadata
from loom.model.runner import score
from loom.sampling_params import SamplingParams

REL_TOL = 1e-3
REAL_MODELS = ["smollm2-135m", "gemma3-270m"]
PROMPT_LENGTHS = [1, 7, 100, 1000]


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Per position: max_abs_diff <= REL_TOL * max|want|."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got - want).abs().amax(dim=-1)
    bound = REL_TOL * want.abs().amax(dim=-1)
    bad = (diff > bound).nonzero().flatten().tolist()
    assert not bad, (f"{what}: {len(bad)} of {want.shape[0]} positions exceed the tolerance; first at {bad[0]}: "
                     f"max diff {diff[bad[0]].item():.3g} > {bound[bad[0]].item():.3g}")


@torch.inference_mode()
def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def chunked_logits(model, token_ids: list[int], chunks: list[int], block_size: int = 16, seed: int = 0):
    """Logits of every position, computing the prompt chunk by chunk over a paged cache whose
    blocks are scattered (a shuffled block table), as the engine does for chunked prefill."""
    cfg = model.cfg
    n = len(token_ids)
    assert sum(chunks) == n
    num_blocks = -(-n // block_size) + 3
    table = list(range(num_blocks))
    random.Random(seed).shuffle(table)
    table = torch.tensor(table[:-(-n // block_size)])
    caches = [(torch.zeros(num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()
    ids = torch.tensor(token_ids)
    out, start = [], 0
    for size in chunks:
        end = start + size
        meta = AttentionMetadata.build(slots[start:end], [size], [end], [slots[:end]])
        hidden = model.forward(ids[start:end], torch.arange(start, end), meta, caches)
        out.append(model.compute_logits(hidden))
        start = end
    return torch.cat(out)


# =============================================================================================
# 1. tiny models
# =============================================================================================

ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def mix(attn: str, ffn: str, embed: str) -> dict[str, str]:
    """tensor_types for tiny_gguf: one type for the attention matrices, one for the MLP's and
    one for the (tied) embedding; norms stay float32."""
    types = {f"*.{t}.weight": attn for t in ATTN} | {f"*.{t}.weight": ffn for t in FFN}
    return types | {"token_embd.weight": embed}


# Between them these cover every type tiny_gguf writes (the fixtures' default files add a
# per-matrix rotation of types); K-quants need rows that are multiples of 256.
QUANT_MIXES = {
    "f16+bf16": mix("F16", "BF16", "F32"),
    "q8_0+q5_0+q5_1": mix("Q8_0", "Q5_0", "Q5_1"),
    "q4_0+q4_1+q8_0": mix("Q4_0", "Q4_1", "Q8_0"),
}
K_MIX = mix("Q4_K", "Q5_K", "Q6_K")


def tiny_prompt(tok: Tokenizer, length: int) -> list[int]:
    """`length` tokens of Spec-Bench text (the tiny vocabularies spell it in many small pieces)."""
    ids = tok.encode(" ".join(spec_bench_questions()[0]["turns"]))[:length]
    assert len(ids) == length
    return ids


def _tiny_check(path, prompt_len: int = 60) -> None:
    f = GGUFFile.open(path)
    tok = Tokenizer.from_gguf(f)
    ids = tiny_prompt(tok, prompt_len)
    hf, _ = tiny_gguf.load_transformers(path)
    want = reference_logits(hf, ids)
    assert_logits_close(score(load_model(f), ids), want, path.name)


def test_tiny_llama_logits_match_transformers(tiny_llama_path):
    _tiny_check(tiny_llama_path)


def test_tiny_gemma3_logits_match_transformers_past_the_sliding_window(tiny_gemma3_path):
    _tiny_check(tiny_gemma3_path)  # 60 tokens against a window of 8


@pytest.mark.parametrize("quants", list(QUANT_MIXES))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_quant_mixes_match_transformers(tmp_path, arch, quants):
    write = tiny_gguf.write_tiny_llama if arch == "llama" else tiny_gguf.write_tiny_gemma3
    path = write(tmp_path / f"tiny-{arch}-{quants}.gguf", tensor_types=QUANT_MIXES[quants], seed=3)
    _assert_types(path, QUANT_MIXES[quants])
    _tiny_check(path, prompt_len=24)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_k_quant_mix_matches_transformers(tmp_path, arch):
    if arch == "llama":
        path = tiny_gguf.write_tiny_llama(tmp_path / "tiny-llama-k.gguf", hidden=256, ffn=512,
                                          tensor_types=K_MIX, seed=4)
    else:
        path = tiny_gguf.write_tiny_gemma3(tmp_path / "tiny-gemma3-k.gguf", hidden=256, ffn=512,
                                           head_dim=128, tensor_types=K_MIX, seed=4)
    _assert_types(path, K_MIX)
    _tiny_check(path, prompt_len=24)


def _assert_types(path, types: dict[str, str]) -> None:
    """The file really holds the asked types (a pattern that matched nothing would test nothing)."""
    import fnmatch

    f = GGUFFile.open(path)
    for pattern, qtype in types.items():
        names = [n for n in f.tensors if fnmatch.fnmatchcase(n, pattern)]
        assert names, f"{pattern} matches no tensor"
        assert {f.tensor_info(n).qtype.name for n in names} == {qtype}, pattern


def test_tiny_chunked_prefill_equals_single_pass(tiny_gemma3_path, tiny_llama_path):
    for path in (tiny_gemma3_path, tiny_llama_path):
        f = GGUFFile.open(path)
        model, tok = load_model(f), Tokenizer.from_gguf(f)
        ids = tiny_prompt(tok, 60)
        # chunk edges inside and across the 8-token window and the 4-slot blocks
        assert_logits_close(chunked_logits(model, ids, [5, 26, 29], block_size=4), score(model, ids), path.name)


# =============================================================================================
# 2. real models on Spec-Bench text
# =============================================================================================


def spec_bench_prompt(tok: Tokenizer, length: int, skip: int = 0) -> list[int]:
    """The first `length` tokens of the `skip`-th Spec-Bench turn that is at least that long."""
    found = 0
    for q in spec_bench_questions():
        for turn in q["turns"]:
            ids = tok.encode(turn)
            if len(ids) >= length:
                if found == skip:
                    return ids[:length]
                found += 1
    raise AssertionError(f"no Spec-Bench turn has {length} tokens")


# loom's single-pass logits of the longest prompt, kept for the chunked test
_long_logits: dict[str, torch.Tensor] = {}


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL_MODELS)
def test_logits_match_transformers(real_models, name):
    model, tok = real_models.loom(name)
    hf = real_models.hf(name)
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = spec_bench_prompt(tok, length, skip=3 * i)
        got = score(model, ids)
        assert_logits_close(got, reference_logits(hf, ids), f"{name}, {length} tokens")
        if length == max(PROMPT_LENGTHS):
            _long_logits[name] = got
    if name == "gemma3-270m":
        assert max(PROMPT_LENGTHS) >= 700 > model.cfg.sliding_window == 512


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL_MODELS)
def test_chunked_prefill_through_the_paged_cache_equals_single_pass(real_models, name):
    model, tok = real_models.loom(name)
    length = max(PROMPT_LENGTHS)
    ids = spec_bench_prompt(tok, length, skip=3 * PROMPT_LENGTHS.index(length))
    single = _long_logits.pop(name, None)
    if single is None:
        single = score(model, ids)
    # for Gemma the second and third chunks attend across the 512-token window edge
    assert_logits_close(chunked_logits(model, ids, [333, 410, length - 743]), single, name)


def greedy_prompts(tok: Tokenizer, n: int = 10, length: int = 32) -> list[list[int]]:
    """n Spec-Bench turns from different categories, each cut to `length` tokens (one shape, so
    transformers can run them as one unpadded batch)."""
    prompts, seen = [], set()
    for q in spec_bench_questions():
        if q["category"] in seen:
            continue
        ids = tok.encode(q["turns"][0])
        if len(ids) >= length:
            prompts.append(ids[:length])
            seen.add(q["category"])
        if len(prompts) == n:
            return prompts
    raise AssertionError("not enough Spec-Bench categories")


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL_MODELS)
def test_greedy_tokens_match_transformers(real_models, name):
    new_tokens = 64
    model, tok = real_models.loom(name)
    prompts = greedy_prompts(tok)
    llm = LLM.from_engine(real_models.engine(name))
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    # transformers' continuations, generated once per machine and versions (tests/hf_reference.py)
    ref = hf_reference.greedy(real_model_path(name), lambda: real_models.hf(name), prompts, new_tokens,
                              pad_token_id=tok.pad_token_id or 0)
    assert all(len(r) == new_tokens for r in ref) and all(len(g) == new_tokens for g in got)
    matches = sum(g == r for g, r in zip(got, ref))
    print(f"\n{name}: {matches}/{len(prompts)} greedy continuations of {new_tokens} tokens identical to transformers")
    first_diff = [next(i for i, (a, b) in enumerate(zip(g, r)) if a != b) for g, r in zip(got, ref) if g != r]
    assert matches == len(prompts), f"{name}: {matches}/{len(prompts)} match; diverging at tokens {first_diff}"
