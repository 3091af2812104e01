"""GGUF reading: the tiny test models, every supported tensor type, and every way a file can be broken.

Also checks that the tiny models are valid for transformers, which other tests use as reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from loom.errors import ModelLoadError
from loom.loader.gguf import SUPPORTED_TYPES, GGUFFile
from loom.model.build import load_model

# Largest error allowed after a round trip through each type, as a fraction of the tensor's
# largest magnitude (each type's step size with some slack; a transposed or misread tensor
# misses these by far).
TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1 / 128, Q.Q8_0: 1 / 100, Q.Q6_K: 1 / 25,
    Q.Q5_0: 1 / 12, Q.Q5_1: 1 / 12, Q.Q5_K: 1 / 12, Q.Q4_0: 1 / 6, Q.Q4_1: 1 / 6, Q.Q4_K: 1 / 6,
}

LLAMA_BLOCK = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
GEMMA3_BLOCK = LLAMA_BLOCK + ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]


# -- the tiny models -----------------------------------------------------------------------------


def test_tiny_llama_layout(tiny_llama_path: Path):
    f = GGUFFile.open(tiny_llama_path)
    md = f.metadata
    assert f.architecture == "llama"
    assert (md["llama.block_count"], md["llama.embedding_length"], md["llama.feed_forward_length"]) == (2, 64, 128)
    assert (md["llama.attention.head_count"], md["llama.attention.head_count_kv"]) == (4, 2)
    assert md["llama.rope.dimension_count"] == 16 and md["llama.context_length"] == 512
    assert md["llama.rope.freq_base"] == 10000.0
    assert md["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    tokens = md["tokenizer.ggml.tokens"]
    assert md["llama.vocab_size"] == len(tokens) and len(tokens) % 8 == 0
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert list(md["tokenizer.ggml.token_type"][:4]) == [3, 3, 3, 1]
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    assert len(md["tokenizer.ggml.merges"]) >= 150

    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(2) for t in LLAMA_BLOCK}
    assert set(f.tensors) == expected  # tied: no output.weight
    assert f.tensors["token_embd.weight"].shape == (len(tokens), 64)
    assert f.tensors["blk.0.attn_k.weight"].shape == (32, 64)  # [out, in]: 2 kv heads x 16
    assert f.tensors["blk.1.ffn_down.weight"].shape == (64, 128)
    assert f.tensors["blk.0.attn_norm.weight"].qtype == Q.F32


def test_tiny_gemma3_layout(tiny_gemma3_path: Path):
    f = GGUFFile.open(tiny_gemma3_path)
    md = f.metadata
    assert f.architecture == "gemma3"
    assert md["gemma3.block_count"] == 6 and md["gemma3.attention.sliding_window"] == 8
    assert md["gemma3.attention.key_length"] == md["gemma3.attention.value_length"] == 32
    assert (md["gemma3.attention.head_count"], md["gemma3.attention.head_count_kv"]) == (2, 1)
    tokens = md["tokenizer.ggml.tokens"]
    assert md["tokenizer.ggml.model"] == "llama"
    assert tokens[:6] == ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert tokens[6] == "<0x00>" and tokens[6 + 255] == "<0xFF>"
    types, scores = md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"]
    assert set(types[:6]) == {3} and set(types[6:262]) == {6} and set(types[262:]) == {1}
    assert np.all(np.diff(scores[262:]) < 0)
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (2, 1)
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_space_prefix"] is False
    assert "tokenizer.chat_template" not in md

    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(6) for t in GEMMA3_BLOCK}
    assert set(f.tensors) == expected
    assert f.tensors["blk.0.attn_q.weight"].shape == (64, 64)
    assert f.tensors["blk.0.attn_k.weight"].shape == (32, 64)
    assert f.tensors["blk.0.attn_q_norm.weight"].shape == (32,)
    norm = f.dequantize("blk.3.post_ffw_norm.weight")
    assert 0.85 < norm.min() and norm.max() < 1.15  # stored as llama.cpp stores Gemma's 1 + w


def test_writer_is_deterministic(tmp_path: Path):
    a = tiny_gguf.write_tiny_llama(tmp_path / "a.gguf", seed=3)
    b = tiny_gguf.write_tiny_llama(tmp_path / "b.gguf", seed=3)
    c = tiny_gguf.write_tiny_llama(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_default_mix_covers_block_quants(tiny_llama_path: Path, tiny_gemma3_path: Path):
    used = {t.qtype for p in (tiny_llama_path, tiny_gemma3_path) for t in GGUFFile.open(p).tensors.values()}
    assert {Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0} <= used


# -- dequantization of every supported type ----------------------------------------------------


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_dequantize_matches_source_weights(tmp_path: Path, qtype: Q):
    # Rows of 256 so that K-quants apply; every tensor, norms included, is stored as `qtype`.
    source: dict[str, np.ndarray] = {}
    path = tiny_gguf.write_tiny_llama(tmp_path / f"{qtype.name}.gguf", n_layers=1, hidden=256, n_heads=4,
                                      n_kv_heads=2, ffn=256, tied=False, tensor_types={"*": qtype},
                                      weights_out=source)
    f = GGUFFile.open(path)
    assert {t.qtype for t in f.tensors.values()} == {qtype}
    assert set(source) == set(f.tensors)
    for name, want in source.items():
        got = f.dequantize(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= TOLERANCE[qtype], f"{name}: error {err:.4f} of max over {qtype.name} tolerance"
        if qtype not in (Q.F32, Q.F16):
            # Bit-exact against the gguf package's reference decoder on the same bytes.
            ref = gguf_dequantize(np.asarray(f.raw(name)).reshape(*want.shape[:-1], -1), qtype)
            np.testing.assert_array_equal(got, ref.reshape(want.shape))


def test_every_tensor_of_tiny_models_dequantizes(tiny_llama_path: Path, tiny_gemma3_path: Path, tmp_path: Path):
    for write in (tiny_gguf.write_tiny_llama, tiny_gguf.write_tiny_gemma3):
        source: dict[str, np.ndarray] = {}
        f = GGUFFile.open(write(tmp_path / f"{write.__name__}.gguf", weights_out=source))
        for name, info in f.tensors.items():
            err = np.abs(f.dequantize(name) - source[name]).max() / np.abs(source[name]).max()
            assert err <= TOLERANCE[info.qtype], (name, info.qtype.name, err)


def test_unwritable_type_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="block"):
        tiny_gguf.write_tiny_llama(tmp_path / "x.gguf", tensor_types={"ffn_down": "Q4_K"})  # rows of 128


# -- broken files --------------------------------------------------------------------------------

EXPECTED_PROBLEM = {
    "truncated": ["truncated"],
    "truncated_header": ["truncated"],
    "bad_magic": ["not a GGUF file", "magic"],
    "garbage": ["not a GGUF file"],
    "empty": ["too small", "0 bytes"],
    "unsupported_type": ["unsupported tensor type", "IQ2_XXS"],
}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def corrupt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = request.getfixturevalue(f"tiny_{request.param}_path")
    return tiny_gguf.corrupt_copies(src, tmp_path_factory.mktemp(f"corrupt_{request.param}"))


def _load_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:  # anything else (struct.error, ValueError...) fails the test
        GGUFFile.open(path)
    assert type(info.value) is ModelLoadError
    return info.value


@pytest.mark.parametrize("kind", sorted(EXPECTED_PROBLEM))
def test_corrupt_file_raises_model_load_error(corrupt: dict[str, Path], kind: str):
    e = _load_error(corrupt[kind])
    message = str(e)
    assert str(corrupt[kind]) in message and e.path == str(corrupt[kind])
    for part in EXPECTED_PROBLEM[kind]:
        assert part in message, f"{kind}: {message!r} lacks {part!r}"


def test_corrupt_copies_cover_all_kinds(corrupt: dict[str, Path]):
    assert set(corrupt) == set(EXPECTED_PROBLEM) | {"unknown_arch"}
    assert corrupt["empty"].stat().st_size == 0


def test_well_formed_variants_are_valid_gguf(corrupt: dict[str, Path]):
    # unknown_arch and unsupported_type are well-formed: only their content is unsupported.
    for kind in ("unknown_arch", "unsupported_type"):
        reader = GGUFReader(corrupt[kind])
        assert len(reader.tensors) > 0
    f = GGUFFile.open(corrupt["unknown_arch"])
    assert f.architecture == "mamba9"
    assert not any(k.startswith(("llama.", "gemma3.")) for k in f.metadata)
    assert any(k.startswith("mamba9.") for k in f.metadata)


def test_unknown_architecture_is_refused_by_model_loader(corrupt: dict[str, Path]):
    from loom.model.build import load_model

    with pytest.raises(ModelLoadError) as info:
        load_model(corrupt["unknown_arch"])
    assert type(info.value) is ModelLoadError
    message = str(info.value)
    assert "architecture" in message and "mamba9" in message and str(corrupt["unknown_arch"]) in message


def test_string_arrays_read_back_exactly(tmp_path: Path):
    """A vocabulary's strings come back as written: empty ones, non-ASCII ones, one holding a
    NUL (the bulk decoder splits on NUL and must fall back), and an array of one."""
    from gguf import GGUFWriter

    plain = ["", "a", "▁the", "日本語", "<0x0A>", "\n\t ", "x" * 300, "é" * 70]
    path = tmp_path / "strings.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.plain", plain * 50)
    w.add_array("test.nul", ["a", "b\x00c", "", "d"])
    w.add_array("test.one", ["only"])
    w.add_string("test.after", "tail")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    md = GGUFFile.open(path).metadata
    assert md["test.plain"] == plain * 50
    assert md["test.nul"] == ["a", "b\x00c", "", "d"]
    assert md["test.one"] == ["only"] and md["test.after"] == "tail"


def test_every_truncation_raises_model_load_error(tiny_gemma3_path: Path, tmp_path: Path):
    data = tiny_gemma3_path.read_bytes()
    cut_path = tmp_path / "cut.gguf"
    # Up to 32 bytes before the end, so the cut always lands before the last tensor's final byte.
    for cut in np.linspace(0, len(data) - 32, 60).astype(int):
        cut_path.write_bytes(data[:cut])
        e = _load_error(cut_path)
        assert str(cut_path) in str(e)


def test_header_bytes_overwritten_never_escape_as_other_errors(tiny_llama_path: Path, tmp_path: Path):
    """An overwritten header is refused with a ModelLoadError naming the file, or it is harmless:
    the bytes landed where any value is legal (a metadata value, a string's contents) and the
    tensor table is unchanged; a changed table is refused when the model is built from it."""
    data = bytearray(tiny_llama_path.read_bytes())
    header_end = tiny_gguf._Layout.read(tiny_llama_path, with_data=False).header_end
    table = {n: (i.shape, i.qtype, i.offset, i.nbytes) for n, i in GGUFFile.open(tiny_llama_path).tensors.items()}
    rng = np.random.default_rng(5)
    bad = tmp_path / "bad.gguf"
    refused = harmless = 0
    for pos in sorted(rng.choice(np.arange(4, header_end), 150, replace=False)):
        mutated = bytearray(data)
        mutated[pos:pos + 4] = b"\xff\xff\xff\x7f"
        bad.write_bytes(bytes(mutated))
        try:
            f = GGUFFile.open(bad)
        except ModelLoadError as e:
            assert type(e) is ModelLoadError and str(bad) in str(e)
            refused += 1
            continue
        if {n: (i.shape, i.qtype, i.offset, i.nbytes) for n, i in f.tensors.items()} == table:
            harmless += 1
            continue
        with pytest.raises(ModelLoadError) as info:   # a changed tensor table never builds a model
            load_model(bad)
        assert type(info.value) is ModelLoadError
        refused += 1
    assert refused + harmless == 150
    assert refused >= 75, f"only {refused} of 150 overwritten headers were refused"


def test_missing_path_raises_model_load_error(tmp_path: Path):
    missing = tmp_path / "nope.gguf"
    e = _load_error(missing)
    assert str(missing) in str(e) and "no such file" in str(e)
    e = _load_error(tmp_path)
    assert "directory" in str(e)


# -- the tiny models load in transformers (the reference for logits and tokenization) --------


def test_transformers_loads_tiny_llama(tiny_llama_path: Path):
    import torch

    model, tok = tiny_gguf.load_transformers(tiny_llama_path)
    f = GGUFFile.open(tiny_llama_path)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert cfg.vocab_size == len(f.metadata["tokenizer.ggml.tokens"]) and cfg.tie_word_embeddings
    # transformers holds the same dequantized weights (q/k are un-permuted from llama.cpp's layout).
    sd = model.state_dict()
    np.testing.assert_array_equal(sd["model.layers.1.mlp.down_proj.weight"].numpy(), f.dequantize("blk.1.ffn_down.weight"))
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"].numpy(), f.dequantize("token_embd.weight"))

    text = "Hello, world! The cat sat on the mat."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges apply; no BOS added
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.05


def test_transformers_loads_tiny_gemma3(tiny_gemma3_path: Path):
    import torch

    model, tok = tiny_gguf.load_transformers(tiny_gemma3_path)
    f = GGUFFile.open(tiny_gemma3_path)
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg.head_dim, cfg.sliding_window, cfg.query_pre_attn_scalar) == (32, 8, 32)
    sd = model.state_dict()
    # transformers subtracts the 1 that llama.cpp folded into Gemma's norm weights.
    np.testing.assert_allclose(sd["model.layers.0.input_layernorm.weight"].numpy() + 1,
                               f.dequantize("blk.0.attn_norm.weight"), rtol=0, atol=1e-6)

    text = "Hello, world! The cat sat on the mat."
    ids = tok(text).input_ids
    assert ids[0] == 2 and tok.decode(ids[1:]) == text  # BOS added
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [4, 5]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.05


def test_transformers_loads_spm_llama(tmp_path: Path):
    path = tiny_gguf.write_tiny_llama(tmp_path / "spm.gguf", vocab="spm")
    model, tok = tiny_gguf.load_transformers(path)
    ids = tok("The cat sat.").input_ids
    assert ids[0] == 1 and tok.convert_ids_to_tokens(ids[1:3]) == ["▁The", "▁cat"]
    assert model.config.vocab_size == len(GGUFFile.open(path).metadata["tokenizer.ggml.tokens"])
