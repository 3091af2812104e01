"""Tokenizer built from GGUF metadata: agreement with transformers, streaming decode, chat templates.

The reference for ids and text is transformers' tokenizer built from the same GGUF file. Real
models are checked on every Spec-Bench prompt plus a hand-made corpus of hard cases; the tiny
generated files cover the vocabulary kinds (byte-level BPE, Gemma and Llama SentencePiece) in
a fraction of a second.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import real_model_path
from loom.errors import TokenizerError
from loom.loader.chat_template import ChatTemplate
from loom.loader.gguf import GGUFFile
from loom.loader.tokenizer import IncrementalDetokenizer, Tokenizer, byte_to_unicode

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"

REPLACEMENT = "\ufffd"


def _spec_bench_turns() -> list[str]:
    if not SPEC_BENCH.is_file():
        pytest.fail(f"shared test data is missing: {SPEC_BENCH}", pytrace=False)
    turns: list[str] = []
    for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines():
        if line.strip():
            turns.extend(json.loads(line)["turns"])
    return turns


# Characters that byte-level BPE (and Gemma's byte fallback) must cut into several tokens.
RARE_UNICODE = "Rare: 𓀀𓀁𓂀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🫠🫶🏽 👨‍👩‍👧‍👦 🇯🇵🇺🇸 ꙮ 龘龘 𠜎𠜱 e\u0301\u0302 z\u0335\u0336 ༀ ᚠᛇᚻ"

HARD_CASES = [
    "",
    " ",
    "a",
    # unicode: CJK, emoji (modifiers, ZWJ sequences, flags), combining marks, RTL, Indic, Thai
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀😃😄 👍🏿 👩🏽‍💻 ❤️‍🔥 🏳️‍🌈 🇩🇪🇫🇷 🤗",
    "Combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0352\u0353 cafe\u0301 vs café",
    "RTL: שלום עולם, مرحبا بالعالم! \u200f(עברית)\u200e mixed with English",
    "हिन्दी भाषा, தமிழ், ภาษาไทย ไม่มีช่องว่าง, ελληνικά, русский текст",
    "Zero width:\u200b\u200c\u200d\ufeff NBSP:\u00a0\u202f end",
    RARE_UNICODE,
    # code
    'def fib(n: int) -> int:\n    """Fibonacci."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2.5e-3, null, true], "nested": {"a": "b\\u00e9"}}',
    "<div class=\"x\">&nbsp;<b>bold</b></div>\n<!-- comment -->",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares\r\n",
    # whitespace: runs of spaces, tabs, newlines, CRLF, before digits and letters
    "a" + " " * 40 + "b",
    "\t\t\tindented\n\t\t\t\tmore\n",
    "\n\n\n\nparagraphs\n\n\n\n\n\n",
    "  1. first\n  2. second\n\n10. tenth\n\n\n3",
    "trailing spaces   \nline\r\n\r\nwindows\r\n",
    " leading space",
    "   ",
    "\t \t \n \n",
    "numbers 1234567890 3.14159 1,000,000 0x1F -42 ½ ² ³ ①",
    "contractions: I'm, you're, it's, we've, they'll, she'd, DON'T",
    # special tokens spelled in text
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> and <|endoftext|> inline<pad>",
    "<|im_start|<|im_end <start_of_turn <|endoftext|",
    "Text then <|im_end|><|im_end|>twice",
    "control chars \x00\x01\x1b[0m\x7f",
    "▁already▁metaspace▁",
    # Gemma's user-defined tokens (HTML tags, "[multimodal]") and spelled byte / unknown pieces
    "<table><tr><td>cell</td></tr></table> <b>bold</b><i></i> [multimodal]<h1>x</h1>",
    "<unk> <0x0A> <0xFF> <start_of_turn<end_of_turn> <start_of_image>",
    "x" + " " * 70 + "y" + " " * 31 + "z" + " " * 33,
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _spec_bench_turns() + HARD_CASES


# -- the models and their references -----------------------------------------------------------


# transformers' reference tokenizers. `AutoTokenizer.from_pretrained(dir, gguf_file=name)` resolves
# these files to exactly these classes (same backend tokenizer, same special tokens), but first
# parses the whole file's metadata with gguf's pure-Python reader: ~6 s for SmolLM2 and ~25 s for
# Gemma's 262k-token vocabulary. Loading the classes directly keeps this file fast; the tiny-file
# test below goes through AutoTokenizer itself.


def _byte_level_reference(path: Path) -> Any:
    """transformers' tokenizer of the file, split as the model's own tokenizer.json splits:
    SmolLM2's isolates every digit first (Digits, then ByteLevel), as llama.cpp does;
    transformers' GGUF conversion leaves that step out (see loom's DIGIT_FIRST)."""
    from tokenizers import pre_tokenizers
    from transformers import TokenizersBackend

    ref = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=True)])
    return ref


def _gemma_reference(path: Path) -> Any:
    from transformers import GemmaTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    assert TOKENIZER_MAPPING_NAMES["gemma3"] == "GemmaTokenizer", "AutoTokenizer's class for gemma3 changed"
    return GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


class Pair:
    """A real model's loom tokenizer and (loaded on first use) its transformers reference."""

    def __init__(self, name: str):
        self.name = name
        self.path = real_model_path(name)
        self.loom = Tokenizer.from_gguf(GGUFFile.open(self.path))
        self._ref: Any = None

    @property
    def ref(self) -> Any:
        if self._ref is None:
            self._ref = REFERENCES[self.name](self.path)
        return self._ref


REFERENCES = {"smollm2-135m": _byte_level_reference, "gemma3-270m": _gemma_reference}


@pytest.fixture(scope="module")
def pairs() -> Callable[[str], Pair]:
    """Each real model's pair, built once for the whole module."""
    built: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in built:
            built[name] = Pair(name)
        return built[name]

    return get


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.real_model) for n in REFERENCES])
def real(request: pytest.FixtureRequest, pairs: Callable[[str], Pair]) -> Pair:
    return pairs(request.param)


@pytest.fixture(scope="module")
def smollm_pair(pairs: Callable[[str], Pair]) -> Pair:
    return pairs("smollm2-135m")


@pytest.fixture(scope="module")
def smollm(smollm_pair: Pair) -> Tokenizer:
    return smollm_pair.loom


@pytest.fixture(scope="module")
def gemma(pairs: Callable[[str], Pair]) -> Tokenizer:
    return pairs("gemma3-270m").loom


def _first_difference(texts: list[str], got: list[list[int]], want: list[list[int]], pair: Pair) -> str:
    for text, a, b in zip(texts, got, want):
        if a != b:
            k = next(i for i in range(max(len(a), len(b))) if i >= min(len(a), len(b)) or a[i] != b[i])
            return (f"{pair.name}: {sum(x != y for x, y in zip(got, want))} texts differ; first: {text[:120]!r}\n"
                    f"  loom         {a[max(0, k - 3):k + 6]} {[pair.loom.id_to_token(i) for i in a[max(0, k - 3):k + 6]]}\n"
                    f"  transformers {b[max(0, k - 3):k + 6]} {pair.ref.convert_ids_to_tokens(b[max(0, k - 3):k + 6])}")
    return ""


# -- (a) agreement with transformers -------------------------------------------------------------


def test_metadata_matches_transformers(real: Pair) -> None:
    tok, ref = real.loom, real.ref
    assert tok.vocab_size == len(ref)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                      ref.pad_token_id)
    assert tok.add_bos == bool(ref.add_bos_token) == (real.name == "gemma3-270m")
    ref_special = {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert tok.special_token_ids == ref_special
    for i in [0, 1, 2, 3, 100, 107, 138, 1000, 30000, tok.vocab_size - 1]:
        assert tok.id_to_token(i) == ref.convert_ids_to_tokens(i)
        assert tok.token_to_id(ref.convert_ids_to_tokens(i)) == i
    assert tok.token_to_id("no such token here") is None


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(real: Pair, corpus: list[str], add_special_tokens: bool) -> None:
    got = real.loom.encode_batch(corpus, add_special_tokens=add_special_tokens)
    want = real.ref(corpus, add_special_tokens=add_special_tokens)["input_ids"]
    assert got == want, _first_difference(corpus, got, want, real)
    # the one-at-a-time path agrees with the batch path
    assert [real.loom.encode(t, add_special_tokens=add_special_tokens) for t in HARD_CASES] == got[-len(HARD_CASES):]


def test_special_tokens_encode_whole(real: Pair) -> None:
    tok = real.loom
    for text in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>"):
        i = tok.token_to_id(text)
        if i is not None:
            assert tok.encode(f"x{text}y", add_special_tokens=False)[1:2] == [i], text
            assert tok.encode(text, add_special_tokens=False) == [i]


def test_decode_matches_transformers(real: Pair, corpus: list[str]) -> None:
    ids = real.ref(corpus)["input_ids"]
    for skip in (False, True):
        got = [real.loom.decode(x, skip_special_tokens=skip) for x in ids]
        want = real.ref.batch_decode(ids, skip_special_tokens=skip)
        bad = [(t, g, w) for t, g, w in zip(corpus, got, want) if g != w]
        assert not bad, f"{real.name}, skip_special_tokens={skip}: {len(bad)} differ; first {bad[0]!r}"


def test_decode_round_trips(real: Pair, corpus: list[str]) -> None:
    tok = real.loom
    # A SentencePiece vocabulary spells spaces "▁", so a literal "▁" in text decodes as a space.
    texts = [t for t in corpus if "\u2581" not in t] if real.name == "gemma3-270m" else corpus
    bad = [t for t in texts if tok.decode(tok.encode(t, add_special_tokens=False)) != t]
    assert not bad, f"{real.name}: {len(bad)} texts do not round-trip; first {bad[0][:200]!r}"
    if real.name == "gemma3-270m":
        assert tok.decode(tok.encode("a\u2581b", add_special_tokens=False)) == "a b"
    bos = tok.encode("hello")
    assert bos[:1] == ([tok.bos_token_id] if tok.add_bos else bos[:1])
    assert tok.decode(bos, skip_special_tokens=True) == "hello"


# -- (b) incremental detokenization -----------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], sizes: Callable[[], int], prompt: list[int] | None = None,
            skip: bool = True) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt or (), skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        n = sizes()
        deltas.append(det.add(ids[i:i + n]))
        i += n
    deltas.append(det.flush())
    assert det.token_ids == ids
    assert det.text == "".join(deltas)
    return deltas


def _check_stream(tok: Tokenizer, texts: list[str], sizes: Callable[[], int], skip: bool = True) -> None:
    for text, ids in zip(texts, tok.encode_batch(texts)):
        full = tok.decode(ids, skip_special_tokens=skip)
        deltas = _stream(tok, ids, sizes, skip=skip)
        assert "".join(deltas) == full, f"stream differs from full decode for {text[:100]!r}"
        if REPLACEMENT not in full:
            broken = [d for d in deltas if REPLACEMENT in d]
            assert not broken, f"a delta split a character: {broken[:3]!r} in {text[:100]!r}"


@pytest.mark.real_model
def test_stream_splits_characters_into_tokens(smollm: Tokenizer, gemma: Tokenizer) -> None:
    # The streaming tests below are only meaningful if some tokens carry part of a character.
    for tok in (smollm, gemma):
        ids = tok.encode(RARE_UNICODE, add_special_tokens=False)
        assert sum(REPLACEMENT in tok.decode([i]) for i in ids) >= 4


def test_stream_one_token_at_a_time(real: Pair, corpus: list[str]) -> None:
    _check_stream(real.loom, corpus, lambda: 1)


def test_stream_random_chunks(real: Pair, corpus: list[str]) -> None:
    rng = random.Random(1234)
    _check_stream(real.loom, corpus, lambda: rng.randint(1, 7))
    _check_stream(real.loom, HARD_CASES, lambda: rng.randint(1, 3), skip=False)


def test_stream_after_prompt(real: Pair, corpus: list[str]) -> None:
    tok = real.loom
    rng = random.Random(99)
    for text in corpus[:200] + HARD_CASES:
        ids = tok.encode(text)
        cut = rng.randint(0, len(ids))
        prompt = tok.decode(ids[:cut], skip_special_tokens=True)
        if prompt.endswith(REPLACEMENT):
            continue  # the prompt ends inside a character: no clean boundary to continue from
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(prompt)
        deltas = _stream(tok, ids[cut:], lambda: rng.randint(1, 4), prompt=ids[:cut])
        assert "".join(deltas) == whole[len(prompt):], text[:100]


def test_stream_holds_partial_character_until_flush(real: Pair) -> None:
    tok = real.loom
    ids = tok.encode("𓀀", add_special_tokens=False)  # a 4-byte character no vocabulary holds whole
    assert len(ids) > 1 and REPLACEMENT in tok.decode(ids[:-1])
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:-1]) == ""
    assert det.flush() == tok.decode(ids[:-1])
    det = IncrementalDetokenizer(tok)
    assert [det.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["𓀀"]
    assert det.flush() == ""


def test_stream_cost_does_not_grow_with_length(smollm: Tokenizer) -> None:
    # Every call decodes a short window, however long the sequence already is.
    sizes: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            sizes.append(len(ids))
            return smollm.decode(ids, skip_special_tokens)

    ids = smollm.encode((RARE_UNICODE + " some plain words in between. ") * 200, add_special_tokens=False)
    assert len(ids) > 5000
    det = IncrementalDetokenizer(Counting(), prompt_ids=ids[:50])  # type: ignore[arg-type]
    for i in ids:
        det.add([i])
    det.flush()
    assert det.text == smollm.decode(ids)
    assert max(sizes) <= IncrementalDetokenizer.MAX_HELD


def test_stream_releases_invalid_bytes(smollm: Tokenizer) -> None:
    # A lone continuation byte never completes a character: it is released, not held forever.
    lone = smollm.token_to_id(smollm.id_to_token(smollm.encode("é", add_special_tokens=False)[0])[-1:])
    assert lone is not None
    ids = [lone] * 20 + smollm.encode(" ok", add_special_tokens=False)
    det = IncrementalDetokenizer(smollm)
    deltas = [det.add([i]) for i in ids] + [det.flush()]
    assert "".join(deltas) == smollm.decode(ids)
    assert any(deltas[: IncrementalDetokenizer.MAX_HELD + 1])


@pytest.mark.parametrize("leading", [15, 16, 17, 40])
def test_released_invalid_bytes_keep_a_characters_start(smollm: Tokenizer, gemma: Tokenizer, leading: int) -> None:
    """Lead bytes that never complete a character, then one that does: the release after
    MAX_HELD ids keeps the last start held, so the emoji is not lost."""
    for tok in (smollm, gemma):
        byte = ({b: tok.token_to_id(ch) for b, ch in byte_to_unicode().items()} if tok.vocab_kind == "byte_level"
                else {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)})
        ids = [byte[0xF0]] * leading + [byte[0x9F], byte[0x98], byte[0x80]] + tok.encode(" ok", add_special_tokens=False)
        det = IncrementalDetokenizer(tok)
        deltas = [det.add([i]) for i in ids] + [det.flush()]
        assert "".join(deltas) == tok.decode(ids) and "😀" in tok.decode(ids)


# -- (c) chat templates ------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本 🤗"}],
]


@pytest.mark.real_model
def test_smollm_digits_split_as_llama_cpp_splits_them(smollm: Tokenizer) -> None:
    """llama.cpp's ids for SmolLM2 (llama-cpp-python 0.3.36, vocab_only): a digit after a run of
    whitespace or a space before another numeral is a token of its own."""
    assert smollm.encode("1. First\n\n2. Second", add_special_tokens=False) == [33, 30, 3508, 1116, 34, 30, 5665]
    assert smollm.encode("x = [\n    1,\n    2,\n]", add_special_tokens=False) == \
        [104, 446, 933, 2367, 33, 28, 2367, 34, 28, 198, 77]
    assert smollm.encode(" ①", add_special_tokens=False) == [216, 173, 235, 250]


def test_smollm_chat_template(smollm: Tokenizer) -> None:
    assert smollm.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert smollm.apply_chat_template(CHATS[1], tokenize=False) == (   # transformers' defaults: no generation prompt
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n")
    assert smollm.apply_chat_template(CHATS[1]) == smollm.encode_chat(CHATS[1], add_generation_prompt=False)
    ids = smollm.encode_chat(CHATS[0])
    assert ids[0] == smollm.token_to_id("<|im_start|>") and ids.count(smollm.token_to_id("<|im_end|>")) == 2


@pytest.mark.real_model
def test_chat_template_matches_transformers(smollm_pair: Pair) -> None:
    tok, ref = smollm_pair.loom, smollm_pair.ref
    for chat in CHATS:
        for gen in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(chat) == list(ref.apply_chat_template(chat, return_dict=False))   # defaults
            want_ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert tok.encode_chat(chat, add_generation_prompt=gen) == list(want_ids)
        opened = chat + [{"role": "assistant", "content": "Sure, here it is: "}]
        assert tok.apply_chat_template(opened, add_generation_prompt=False, continue_final_message=True,
                                       tokenize=False) == (
            ref.apply_chat_template(opened, tokenize=False, add_generation_prompt=False, continue_final_message=True))


def test_continue_final_message_refusals(tiny_parts) -> None:
    tok = tiny_parts[2]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    assert tok.apply_chat_template(chat, continue_final_message=True, tokenize=False).endswith("The answer")
    with pytest.raises(TokenizerError, match="add_generation_prompt"):
        tok.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TokenizerError, match="final message with text"):
        tok.encode_chat(chat[:1] + [{"role": "assistant", "content": None}], add_generation_prompt=False,
                        continue_final_message=True)


@pytest.mark.real_model
def test_gemma_has_no_chat_template(gemma: Tokenizer) -> None:
    assert gemma.chat_template is None
    with pytest.raises(TokenizerError, match="has no chat template"):
        gemma.apply_chat_template(CHATS[0])
    with pytest.raises(TokenizerError, match=re.escape("model 'gemma-3-270m-q4_k_m.gguf' has no chat template")):
        gemma.encode_chat(CHATS[0])


def test_chat_template_globals_and_errors() -> None:
    tpl = ChatTemplate(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m.content | tojson }};{% endfor %}[{{ strftime_now('%Y') }}]{{ eos_token }}"
        "{% generation %}gen{% endgeneration %}{% if add_generation_prompt %}>{% endif %}", model="toy")
    msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "dropped"}]
    out = tpl.render(msgs, special_tokens={"bos_token": "<s>"})
    assert out == f'<s>"héllo <b>";"x";[{time.strftime("%Y")}]gen>'
    with pytest.raises(TokenizerError, match="System role not supported"):
        tpl.render([{"role": "system", "content": "s"}])
    with pytest.raises(TokenizerError, match="unsafe"):
        ChatTemplate("{% set _ = messages.append(1) %}").render(msgs)
    with pytest.raises(TokenizerError, match="not allowed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(msgs)
    with pytest.raises(TokenizerError, match="does not parse"):
        ChatTemplate("{% if %}")


def test_broken_template_fails_only_chat_requests() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    tok = Tokenizer(Backend(WordLevel({"a": 0}, unk_token="a")), name="toy.gguf", vocab_size=1, bos_token_id=None,
                    eos_token_id=0, pad_token_id=None, unk_token_id=None, add_bos=False, add_eos=False,
                    stop_token_ids=frozenset({0}), special_token_ids=frozenset(), chat_template="{% if %}")
    assert tok.encode("a") == [0]
    with pytest.raises(TokenizerError, match="'toy.gguf' has a chat template that does not parse"):
        tok.apply_chat_template(CHATS[0])
    with pytest.raises(TokenizerError, match="negative"):
        tok.decode([0, -1])


# -- (d) stop tokens ---------------------------------------------------------------------------


@pytest.mark.real_model
def test_stop_token_ids(smollm: Tokenizer, gemma: Tokenizer) -> None:
    assert smollm.token_to_id("<|im_end|>") in smollm.stop_token_ids
    assert smollm.eos_token_id in smollm.stop_token_ids
    assert gemma.token_to_id("<end_of_turn>") == 106 and 106 in gemma.stop_token_ids
    assert gemma.eos_token_id == 1 and 1 in gemma.stop_token_ids
    assert gemma.token_to_id("<start_of_turn>") not in gemma.stop_token_ids
    assert smollm.stop_token_ids <= smollm.special_token_ids and gemma.stop_token_ids <= gemma.special_token_ids


# -- tiny generated files: each vocabulary kind against transformers ----------------------------

TINY_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " Once upon a time,  there was\ta little house.\n\nHello, world!",
    "<|im_start|>user\nHi<|im_end|>\n<start_of_turn>model\n<end_of_turn>",
    "Unknown: 日本語 🤗 é 123",
    "   leading and trailing   ",
    "",
]


@pytest.mark.parametrize("kind", ["gpt2", "spm", "gemma3"])
def test_tiny_vocabularies_match_transformers(kind: str, tmp_path: Path, tiny_llama_path: Path,
                                              tiny_gemma3_path: Path) -> None:
    import tiny_gguf
    from transformers import AutoTokenizer

    path = {"gpt2": tiny_llama_path, "gemma3": tiny_gemma3_path}.get(kind)
    if path is None:
        path = tiny_gguf.write_tiny_llama(tmp_path / "tiny-spm.gguf", vocab="spm")
    tok = Tokenizer.from_gguf(GGUFFile.open(path))
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok.encode_batch(TINY_TEXTS) == ref(TINY_TEXTS)["input_ids"]
    for ids in ref(TINY_TEXTS)["input_ids"]:
        for skip in (False, True):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    _check_stream(tok, TINY_TEXTS, lambda: 1)


def test_gemma_vocabulary_sentencepiece_refuses_is_built_as_bpe(tiny_gemma3_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A Gemma vocabulary without its 256 byte pieces cannot be a SentencePiece model with byte
    fallback: it loads as the `tokenizers` BPE instead, with the same ids for text it covers."""
    import numpy as np
    import tiny_gguf
    from tokenizers import Tokenizer as Bpe

    f = GGUFFile.open(tiny_gemma3_path)
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "first"))
    sp = Tokenizer.from_gguf(f)
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "second"))   # the same file: no cached proto
    md = dict(f.metadata)
    types = np.asarray(md["tokenizer.ggml.token_type"]).copy()
    types[types == 6] = 1                                      # BYTE -> NORMAL
    md["tokenizer.ggml.token_type"] = types
    f.metadata = md
    bpe = Tokenizer.from_gguf(f)
    assert isinstance(bpe._backend, Bpe) and not isinstance(sp._backend, Bpe)
    texts = [tiny_gguf._CORPUS[i:i + 120] for i in range(0, 1200, 120)] + ["<start_of_turn>user\nhi<end_of_turn>"]
    assert bpe.encode_batch(texts) == sp.encode_batch(texts)
    assert [bpe.decode(ids) for ids in sp.encode_batch(texts)] == [sp.decode(ids) for ids in sp.encode_batch(texts)]


@pytest.mark.parametrize("words", [
    ["<a>", "<ab>", "<abc>", "<start_of_turn>", "<start>", "[multimodal]"],
    ["<a>", "<ab>", "<abc>", "<" + "x" * 3000 + ">"],                 # one long token: a literal run
    ["<a>", "<ab>", "<abc>"] + ["<" + "y" * k + ">" for k in range(1, 700)],   # too deep for a trie
])
def test_special_tokens_are_found_leftmost_longest(words: list[str]) -> None:
    from loom.loader.sentencepiece_backend import _special_regex

    pattern = _special_regex(words)
    text = "q<a><ab><abc><abcd> <start_of_turn><start>[multimodal]<" + "x" * 3000 + "><yyy>" + "y>"
    i, want = 0, []
    while i < len(text):   # the longest word at each position, scanning on after it
        hit = max((w for w in words if text.startswith(w, i)), key=len, default=None)
        if hit:
            want.append((i, hit))
        i += len(hit) if hit else 1
    assert [(m.start(), m.group()) for m in pattern.finditer(text)] == want


def test_unsupported_vocabulary_is_a_clear_error(tmp_path: Path) -> None:
    from loom.errors import ModelLoadError

    f = GGUFFile.__new__(GGUFFile)
    f.path, f.metadata = tmp_path / "x.gguf", {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelLoadError, match="unsupported tokenizer type 'bert'"):
        Tokenizer.from_gguf(f)
    f.metadata = {"general.architecture": "llama"}
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf(f)
