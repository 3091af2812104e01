"""Tiny random-weight GGUF models for tests, written with `gguf.GGUFWriter` in well under a second.

Two architectures, laid out the way llama.cpp's converter writes them (key names, tensor names,
tokenizer metadata), so that loom and transformers both load them:

* `write_tiny_llama`: the `llama` architecture with a byte-level BPE vocabulary like SmolLM2's
  (or, with ``vocab="spm"``, a SentencePiece vocabulary like Llama 2's) and a ChatML template.
* `write_tiny_gemma3`: the `gemma3` architecture with a SentencePiece vocabulary like Gemma 3's.

Weights are drawn from a seeded generator, so the same arguments always give the same file. Pass
``weights_out={}`` to receive the float32 weights a file was written from (before quantization),
keyed by tensor name, in the PyTorch ``[out, in]`` orientation that `GGUFFile.dequantize` returns.

Q and K projections are random, so they are simply taken to be in the layout llama.cpp stores
(for llama: rows permuted for interleaved rotary pairs); transformers undoes that permutation on
load, so both sides compute the same function.

`corrupt_copies` derives broken variants of a file for error-path tests.

`gguf.quants.quantize` in gguf 0.19 cannot produce K-quants; the Q4_K, Q5_K and Q6_K encoders
here are simple (not llama.cpp's error-minimising search) but emit exactly the bit layout that
`gguf.quants.dequantize` and llama.cpp decode.
"""

from __future__ import annotations

import fnmatch
import mmap
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize as gguf_quantize

Q = GGMLQuantizationType

# Types a tiny file can hold, and the default rotation for 2-D weights. K-quants join the
# rotation only for weights whose rows are a multiple of 256 elements (their block size).
WRITABLE_TYPES = frozenset(
    Q[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)
DEFAULT_MIX = (Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0)
K_MIX = (Q.Q4_K, Q.Q6_K, Q.Q5_K)

# Token type codes of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Vocabularies are learned from this text. It holds no digits, so no merge involves a digit and
# digit handling cannot differ between pre-tokenizers that split numbers differently.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A small model can still tell a story, "
    "and the story it tells is often about the weather, the sea, or the people who live by it. "
    "Once upon a time there was a little house on a hill. In the house lived an old woman and "
    "her cat. Every morning the woman walked down to the market to buy bread, milk and apples. "
    "The cat stayed at home and watched the birds in the garden. One day the woman did not come "
    "back. The cat waited and waited, then went out to look for her. It was raining, and the "
    "road was long and cold. Hello, world! How are you today? I am fine, thank you. What is your "
    "name? My name is Loom, and I like to weave words into sentences. The people of the town "
    "were kind. They gave the cat some water and something to eat, and they helped it find the "
    "way. When the cat finally reached the market, it saw the woman talking with a friend. She "
    "was happy to see her cat, and they walked home together in the evening light. Learning to "
    "read and write takes time, but it opens the world. Children who read stories learn new "
    "words, new places and new ideas. Their teachers say that reading every day is the best "
    "habit of all. The river runs through the valley between green fields and dark forests. "
    "Fishermen wait on the bank while the water moves slowly toward the sea. Questions are "
    "good; answers are better; but the best thing is to keep asking. This is the end of the "
    "little text, and that is where our story stops."
)


# -- vocabularies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocab:
    """Tokenizer metadata for a GGUF file, in llama.cpp's key layout."""

    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos: int
    eos: int
    unk: int | None
    pad: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None

    def write(self, w: GGUFWriter) -> None:
        w.add_string("tokenizer.ggml.model", self.model)
        if self.pre is not None:
            w.add_string("tokenizer.ggml.pre", self.pre)
        w.add_array("tokenizer.ggml.tokens", self.tokens)
        if self.scores is not None:
            w.add_array("tokenizer.ggml.scores", [float(s) for s in self.scores])
        w.add_array("tokenizer.ggml.token_type", [int(t) for t in self.token_types])
        if self.merges is not None:
            w.add_array("tokenizer.ggml.merges", self.merges)
        w.add_uint32("tokenizer.ggml.bos_token_id", self.bos)
        w.add_uint32("tokenizer.ggml.eos_token_id", self.eos)
        if self.unk is not None:
            w.add_uint32("tokenizer.ggml.unknown_token_id", self.unk)
        if self.pad is not None:
            w.add_uint32("tokenizer.ggml.padding_token_id", self.pad)
        w.add_bool("tokenizer.ggml.add_bos_token", self.add_bos)
        w.add_bool("tokenizer.ggml.add_eos_token", False)
        w.add_bool("tokenizer.ggml.add_space_prefix", self.add_space_prefix)
        if self.chat_template is not None:
            w.add_string("tokenizer.chat_template", self.chat_template)


def _learn_merges(words: Counter[tuple[str, ...]], n: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair first)."""
    words = Counter(words)
    merges: list[tuple[str, str]] = []
    for _ in range(n):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_GPT2_SPLIT = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def gpt2_vocab(n_merges: int = 197) -> Vocab:
    """SmolLM2-style byte-level BPE: 3 ChatML specials, the 256 byte symbols, learned merges.

    Ids: ``<|endoftext|>`` 0 (unk), ``<|im_start|>`` 1 (bos), ``<|im_end|>`` 2 (eos, pad), as in
    SmolLM2. The default merge count makes 456 tokens, a multiple of 8.
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    table = bytes_to_unicode()
    words = Counter(tuple(table[b] for b in piece.encode()) for piece in _GPT2_SPLIT.findall(_CORPUS))
    merges = _learn_merges(words, n_merges)
    tokens = specials + [table[b] for b in range(256)]
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            tokens.append(a + b)
            seen.add(a + b)
    types = [CONTROL] * len(specials) + [NORMAL] * (len(tokens) - len(specials))
    return Vocab(model="gpt2", pre="smollm", tokens=tokens, token_types=types, scores=None,
                 merges=[f"{a} {b}" for a, b in merges], bos=1, eos=2, unk=0, pad=2,
                 add_bos=False, add_space_prefix=False, chat_template=CHATML_TEMPLATE)


_SPM_SPLIT = re.compile(r"▁?[A-Za-z]+|▁?[^A-Za-z▁]+|▁+")


def _spm_tokens(specials: list[tuple[str, int]], n_pieces: int, space_prefix: bool
                ) -> tuple[list[str], list[int], list[float]]:
    """SentencePiece-style vocabulary: specials, ``<0x00>``..``<0xFF>``, then learned pieces.

    Pieces are merges in learning order with scores 0, -1, -2, ... (so score order and file order
    agree, as in Gemma files), followed by the single characters of the corpus.
    """
    text = ("▁" if space_prefix else "") + _CORPUS.replace(" ", "▁")
    chunks = _SPM_SPLIT.findall(text)
    chars = sorted({c for chunk in chunks for c in chunk})
    merges = _learn_merges(Counter(tuple(chunk) for chunk in chunks), n_pieces - len(chars))
    pieces: list[str] = []
    for a, b in merges:
        if a + b not in pieces:
            pieces.append(a + b)
    pieces += [c for c in chars if c not in pieces]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [k for _, k in specials] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [-1000.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def gemma3_vocab(n_pieces: int = 314) -> Vocab:
    """Gemma 3-style SentencePiece vocabulary (576 tokens by default); no chat template, as in
    the published Gemma 3 GGUF files. Ids: pad 0, eos 1, bos 2, unk 3, turn markers 4 and 5."""
    specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL),
                ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    tokens, types, scores = _spm_tokens(specials, n_pieces, space_prefix=False)
    return Vocab(model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
                 merges=None, bos=2, eos=1, unk=3, pad=0, add_bos=True, add_space_prefix=False,
                 chat_template=None)


def llama_spm_vocab(n_pieces: int = 317) -> Vocab:
    """Llama 2-style SentencePiece vocabulary (576 tokens by default): unk 0, bos 1, eos 2."""
    specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    tokens, types, scores = _spm_tokens(specials, n_pieces, space_prefix=True)
    return Vocab(model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
                 merges=None, bos=1, eos=2, unk=0, pad=None, add_bos=True, add_space_prefix=True,
                 chat_template=None)


# -- quantization --------------------------------------------------------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], -1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared part of Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.

    Returns (d, dmin) as float16, (sc, m) as uint8 [nb, 8] and q as uint8 [nb, 8, 32] in 0..levels.
    A value decodes as ``d*sc*q - dmin*m``.
    """
    sub = blocks.reshape(blocks.shape[0], 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - lo) / levels
    mins = -lo
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(mins, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12-byte scale/min field of Q4_K and Q5_K (inverse of gguf's Q4_K.get_scale_min)."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=-1).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2g and 2g+1 share 32 bytes: low nibbles hold 2g, high nibbles 2g+1."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _pack_nibbles(q)], axis=-1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [nb, 8, 32]: bit j of qh[k] is sub-block j's fifth bit
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, _pack_nibbles(q)], axis=-1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16 with int8 scales; a value decodes as ``d*sc*(q - 32)``, q in 0..63."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(nb, 256)
    low = (q & 0x0F).reshape(nb, 2, 2, 64)  # value h*128 + s*64 + k -> nibble s of ql[h*64 + k]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    top = (q >> 4).reshape(nb, 2, 4, 32)  # value h*128 + s*32 + k -> bits 2s..2s+1 of qh[h*32 + k]
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)


_K_ENCODERS = {Q.Q4_K: _quantize_q4_k, Q.Q5_K: _quantize_q5_k, Q.Q6_K: _quantize_q6_k}


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`x` (float32, rows last) encoded as `qtype`: float arrays for F32/F16, else uint8 bytes
    shaped ``[*x.shape[:-1], bytes_per_row]`` as `GGUFWriter.add_tensor(raw_dtype=...)` expects."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in _K_ENCODERS:
        block, size = GGML_QUANT_SIZES[qtype]
        rows = x.reshape(-1, x.shape[-1])
        blocks = _K_ENCODERS[qtype](rows.reshape(-1, block))
        return blocks.reshape(*x.shape[:-1], x.shape[-1] // block * size)
    return gguf_quantize(x, qtype)


# -- model files -------------------------------------------------------------------------------


TensorTypes = Mapping[str, "GGMLQuantizationType | str"]


def _pick_type(name: str, shape: tuple[int, ...], index: int, overrides: TensorTypes | None) -> GGMLQuantizationType:
    """An override's type if a pattern (glob or substring of the name) matches, first match wins;
    else F32 for 1-D tensors, Q8_0 for the embedding, and a rotation of types for 2-D weights."""
    for pattern, qtype in (overrides or {}).items():
        if fnmatch.fnmatchcase(name, pattern) or pattern in name:
            qtype = Q[qtype] if isinstance(qtype, str) else Q(qtype)
            if qtype not in WRITABLE_TYPES:
                raise ValueError(f"tiny_gguf cannot write {qtype.name} (writable: {sorted(t.name for t in WRITABLE_TYPES)})")
            block = GGML_QUANT_SIZES[qtype][0]
            if shape[-1] % block:
                raise ValueError(f"{name}: row length {shape[-1]} is not a multiple of the {qtype.name} block {block}")
            return qtype
    if len(shape) == 1:
        return Q.F32
    if shape[-1] % 32:
        return Q.F16
    if name == "token_embd.weight":
        return Q.Q8_0
    mix = DEFAULT_MIX + (K_MIX if shape[-1] % 256 == 0 else ())
    return mix[index % len(mix)]


class _Weights:
    """Seeded weight source: matrices ~ N(0, 0.02), norm weights ~ U(0.9, 1.1)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.items: list[tuple[str, np.ndarray]] = []

    def matrix(self, name: str, rows: int, cols: int) -> None:
        self.items.append((name, (self.rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)))

    def norm(self, name: str, n: int) -> None:
        self.items.append((name, self.rng.uniform(0.9, 1.1, n).astype(np.float32)))


def _write(path: str | Path, arch: str, kv: list[tuple[str, int | float]], vocab: Vocab, weights: _Weights,
           tensor_types: TensorTypes | None, weights_out: dict[str, np.ndarray] | None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    w.add_string("general.name", f"tiny-{arch}")
    w.add_uint32("general.quantization_version", 2)
    for key, value in kv:
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    vocab.write(w)
    n_matrices = 0
    for name, x in weights.items:
        qtype = _pick_type(name, x.shape, n_matrices, tensor_types)
        n_matrices += x.ndim == 2
        data = quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        if weights_out is not None:
            weights_out[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path: str | Path, *, seed: int = 0, vocab: str = "gpt2", n_layers: int = 2,
                     hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128,
                     context: int = 512, tensor_types: TensorTypes | None = None, tied: bool = True,
                     rope_base: float = 10000.0, weights_out: dict[str, np.ndarray] | None = None) -> Path:
    """Write a tiny `llama` model to `path` and return the path.

    `vocab` is ``"gpt2"`` (SmolLM2-like byte-level BPE with ChatML) or ``"spm"`` (Llama 2-like
    SentencePiece). `tied` leaves out ``output.weight`` so the embedding doubles as the output
    projection. `tensor_types` maps name patterns (globs or substrings) to GGML types.
    """
    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError("hidden must divide by n_heads, and n_heads by n_kv_heads")
    tok = {"gpt2": gpt2_vocab, "spm": llama_spm_vocab}[vocab]()
    head_dim = hidden // n_heads
    kv = [
        ("llama.block_count", n_layers),
        ("llama.context_length", context),
        ("llama.embedding_length", hidden),
        ("llama.feed_forward_length", ffn),
        ("llama.attention.head_count", n_heads),
        ("llama.attention.head_count_kv", n_kv_heads),
        ("llama.rope.freq_base", float(rope_base)),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5),
        ("llama.rope.dimension_count", head_dim),
        ("llama.vocab_size", len(tok.tokens)),
    ]
    ws = _Weights(seed)
    ws.matrix("token_embd.weight", len(tok.tokens), hidden)
    for i in range(n_layers):
        ws.norm(f"blk.{i}.attn_norm.weight", hidden)
        ws.matrix(f"blk.{i}.attn_q.weight", n_heads * head_dim, hidden)
        ws.matrix(f"blk.{i}.attn_k.weight", n_kv_heads * head_dim, hidden)
        ws.matrix(f"blk.{i}.attn_v.weight", n_kv_heads * head_dim, hidden)
        ws.matrix(f"blk.{i}.attn_output.weight", hidden, n_heads * head_dim)
        ws.norm(f"blk.{i}.ffn_norm.weight", hidden)
        ws.matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        ws.matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        ws.matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    ws.norm("output_norm.weight", hidden)
    if not tied:
        ws.matrix("output.weight", len(tok.tokens), hidden)
    return _write(path, "llama", kv, tok, ws, tensor_types, weights_out)


def write_tiny_gemma3(path: str | Path, *, seed: int = 0, n_layers: int = 6, hidden: int = 64,
                      n_heads: int = 2, n_kv_heads: int = 1, head_dim: int = 32, ffn: int = 128,
                      sliding_window: int = 8, context: int = 512, tensor_types: TensorTypes | None = None,
                      rope_base: float = 1_000_000.0, weights_out: dict[str, np.ndarray] | None = None) -> Path:
    """Write a tiny `gemma3` model to `path` and return the path.

    Every sixth layer is global (llama.cpp and transformers both fix that pattern for Gemma 3),
    so the default 6 layers are 5 sliding-window layers then 1 global one. Norm weights are
    stored around 1.0, as llama.cpp's converter stores Gemma's ``1 + w``. The embedding is tied.

    transformers reads no attention scale from the file and defaults ``query_pre_attn_scalar``
    to 256, while llama.cpp scales by ``1/sqrt(head_dim)``; see `load_transformers`.
    """
    if n_heads % n_kv_heads:
        raise ValueError("n_heads must divide by n_kv_heads")
    tok = gemma3_vocab()
    kv = [
        ("gemma3.context_length", context),
        ("gemma3.embedding_length", hidden),
        ("gemma3.block_count", n_layers),
        ("gemma3.feed_forward_length", ffn),
        ("gemma3.attention.head_count", n_heads),
        ("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
        ("gemma3.attention.key_length", head_dim),
        ("gemma3.attention.value_length", head_dim),
        ("gemma3.rope.freq_base", float(rope_base)),
        ("gemma3.attention.sliding_window", sliding_window),
        ("gemma3.attention.head_count_kv", n_kv_heads),
    ]
    ws = _Weights(seed)
    ws.matrix("token_embd.weight", len(tok.tokens), hidden)
    for i in range(n_layers):
        ws.norm(f"blk.{i}.attn_norm.weight", hidden)
        ws.matrix(f"blk.{i}.attn_q.weight", n_heads * head_dim, hidden)
        ws.matrix(f"blk.{i}.attn_k.weight", n_kv_heads * head_dim, hidden)
        ws.matrix(f"blk.{i}.attn_v.weight", n_kv_heads * head_dim, hidden)
        ws.norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        ws.norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        ws.matrix(f"blk.{i}.attn_output.weight", hidden, n_heads * head_dim)
        ws.norm(f"blk.{i}.post_attention_norm.weight", hidden)
        ws.norm(f"blk.{i}.ffn_norm.weight", hidden)
        ws.matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        ws.matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        ws.matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
        ws.norm(f"blk.{i}.post_ffw_norm.weight", hidden)
    ws.norm("output_norm.weight", hidden)
    return _write(path, "gemma3", kv, tok, ws, tensor_types, weights_out)


def load_transformers(path: str | Path):
    """``(model, tokenizer)`` from transformers for a tiny file, configured to compute what
    llama.cpp computes: for gemma3 the attention scale is ``1/sqrt(head_dim)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    overrides: dict[str, object] = {}
    header = _Layout.read(path, with_data=False)
    if header.string("general.architecture") == "gemma3":
        overrides["query_pre_attn_scalar"] = header.integer("gemma3.attention.key_length")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32", **overrides)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


# -- corrupt variants --------------------------------------------------------------------------

_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


@dataclass
class _TensorRecord:
    name: str
    dims: list[int]  # GGUF order: innermost first
    qtype: int
    data: bytes


@dataclass
class _Layout:
    """A GGUF file split into its parts: raw metadata values and tensor records."""

    version: int
    kv: list[tuple[str, bytes]]  # key -> raw bytes of (value type u32 + value)
    tensors: list[_TensorRecord]
    alignment: int
    kv_end: int  # byte after the last metadata value
    header_end: int  # byte after the last tensor info
    data_start: int

    @classmethod
    def read(cls, path: str | Path, with_data: bool = True) -> "_Layout":
        """Parse the file at `path`; without `with_data` the tensor records hold no bytes."""
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return cls.parse(buf, with_data)

    @classmethod
    def parse(cls, buf: bytes | mmap.mmap, with_data: bool = True) -> "_Layout":
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            out = buf[pos:pos + n]
            pos += n
            return out

        def skip_value(vtype: int) -> None:
            nonlocal pos
            if vtype in _SCALAR_SIZE:
                pos += _SCALAR_SIZE[vtype]
            elif vtype == _STRING:
                (n,) = struct.unpack("<Q", take(8))
                pos += n
            elif vtype == _ARRAY:
                itype, count = struct.unpack("<IQ", take(12))
                for _ in range(count):
                    skip_value(itype)
            else:
                raise ValueError(f"unknown GGUF value type {vtype}")

        def string() -> str:
            (n,) = struct.unpack("<Q", take(8))
            return take(n).decode()

        if take(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", take(20))
        kv = []
        for _ in range(n_kv):
            key = string()
            start = pos
            skip_value(struct.unpack("<I", take(4))[0])
            kv.append((key, buf[start:pos]))
        kv_end = pos
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack("<I", take(4))
            dims = list(struct.unpack(f"<{n_dims}Q", take(8 * n_dims)))
            qtype, offset = struct.unpack("<IQ", take(12))
            infos.append((name, dims, qtype, offset))
        layout = cls(version, kv, [], 32, kv_end, pos, 0)
        if "general.alignment" in dict(kv):
            layout.alignment = layout.integer("general.alignment")
        layout.data_start = -(-pos // layout.alignment) * layout.alignment
        for name, dims, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[Q(qtype)]
            nbytes = int(np.prod(dims)) // block * size
            start = layout.data_start + offset
            data = buf[start:start + nbytes] if with_data else b""
            layout.tensors.append(_TensorRecord(name, dims, qtype, data))
        return layout

    def _raw(self, key: str) -> bytes:
        return dict(self.kv)[key]

    def string(self, key: str) -> str:
        raw = self._raw(key)
        return raw[12:].decode()

    def integer(self, key: str) -> int:
        raw = self._raw(key)
        vtype = struct.unpack("<I", raw[:4])[0]
        fmt = {0: "<B", 2: "<H", 4: "<I", 10: "<Q", 5: "<i", 11: "<q"}[vtype]
        return struct.unpack(fmt, raw[4:])[0]

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)))
        for key, raw in self.kv:
            out += _gguf_str(key) + raw
        data, offset = bytearray(), 0
        for t in self.tensors:
            out += _gguf_str(t.name) + struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
            out += struct.pack("<IQ", t.qtype, offset)
            padded = -(-len(t.data) // self.alignment) * self.alignment
            data += t.data + bytes(padded - len(t.data))
            offset += padded
        out += bytes(-len(out) % self.alignment)
        return bytes(out + data)


def corrupt_copies(src: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Broken variants of the GGUF file `src`, written to `out_dir`, by kind:

    ``truncated`` (cut in the middle of the tensor data), ``truncated_header`` (cut inside the
    metadata), ``bad_magic``, ``garbage`` (random bytes), ``empty``, ``unknown_arch`` (a valid
    file whose architecture is ``mamba9``, its ``<arch>.*`` keys renamed to match) and
    ``unsupported_type`` (a valid file in which one tensor is stored as IQ2_XXS).
    """
    src, out_dir = Path(src), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = src.read_bytes()
    layout = _Layout.parse(buf)
    kv_start = 24  # magic, version, tensor count, metadata count
    stem = src.stem
    variants: dict[str, bytes] = {
        "truncated": buf[:layout.data_start + (len(buf) - layout.data_start) // 2],
        "truncated_header": buf[:(kv_start + layout.kv_end) // 2],
        "bad_magic": b"GGML" + buf[4:],
        "garbage": np.random.default_rng(1234).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "empty": b"",
    }

    arch = layout.string("general.architecture")
    renamed = _Layout(**{**layout.__dict__, "kv": [], "tensors": list(layout.tensors)})
    for key, raw in layout.kv:
        if key == "general.architecture":
            raw = struct.pack("<I", _STRING) + _gguf_str("mamba9")
        elif key.startswith(arch + "."):
            key = "mamba9." + key[len(arch) + 1:]
        renamed.kv.append((key, raw))
    variants["unknown_arch"] = renamed.to_bytes()

    # Re-store the largest tensor whose element count fits IQ2_XXS blocks as [256, n/256] IQ2_XXS.
    block, size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    fits = [t for t in layout.tensors if int(np.prod(t.dims)) % block == 0]
    victim = max(fits, key=lambda t: int(np.prod(t.dims)))
    n = int(np.prod(victim.dims))
    replaced = _TensorRecord(victim.name, [block, n // block], int(Q.IQ2_XXS),
                             np.random.default_rng(99).integers(0, 256, n // block * size, dtype=np.uint8).tobytes())
    iq = _Layout(**{**layout.__dict__, "tensors": [replaced if t is victim else t for t in layout.tensors]})
    variants["unsupported_type"] = iq.to_bytes()

    paths = {}
    for kind, data in variants.items():
        p = out_dir / f"{stem}.{kind}.gguf"
        p.write_bytes(data)
        paths[kind] = p
    return paths
