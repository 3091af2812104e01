"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer` (Gemma's vocabulary
as a `sentencepiece` model behind the same interface: `loom.loader.sentencepiece_backend`).

A GGUF file stores its vocabulary under llama.cpp's keys (``tokenizer.ggml.*``): the token
strings, a type per token, merges (byte-level BPE) or scores (SentencePiece), the special token
ids and usually a Jinja chat template. `Tokenizer.from_gguf` turns that into a fast tokenizer
whose ids agree with transformers' tokenizer for the same file (transformers' GGUF conversion
is the reference the tests check against):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from the file's merges, split by the
  regex that belongs to ``tokenizer.ggml.pre`` (GPT-2's own when the value has no entry).
* ``tokenizer.ggml.model == "llama"``: SentencePiece pieces as a BPE with byte fallback; the
  merges are the file's, or derived from the vocabulary best-scoring first. Llama-style files
  get a "▁" prefix on the first word; Gemma files get Gemma's layout: no prefix space, spaces
  spelled "▁" by a normalizer, merge order = file order. A Gemma file without merges loads
  as a SentencePiece model whose piece scores follow the file order, with the same ids: building
  its 515k merges for `tokenizers` took 1.0 s of a 1.3 s load, the model 0.05 s.

Where transformers and llama.cpp read a file differently (see the notes at
`PRE_TOKENIZER_SPLITS` and `_sentencepiece_backend`), loom follows transformers, except where
transformers departs from the model's own tokenizer (`DIGIT_FIRST`).

Control tokens (type 3), the named bos/eos/unk/pad tokens and user-defined tokens (type 4) are
matched whole wherever they occur in text; only the first two kinds count as special (dropped by
``decode(..., skip_special_tokens=True)``), user-defined ones decode as ordinary text.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never split a
UTF-8 character.
"""

from __future__ import annotations

import codecs
import gc
import hashlib
from contextlib import contextmanager
from functools import lru_cache
from operator import itemgetter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from loom.errors import ModelLoadError, TokenizerError
from loom.loader.cache import CacheWriteError, atomic_write, cache_root, file_sha256, loom_version, source_digest
from loom.loader.chat_template import ChatTemplate
from loom.loader.gguf import GGUFFile
from loom.loader.sentencepiece_backend import SentencePieceBackend, cached_gemma_backend

# Token type codes of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁": how SentencePiece vocabularies spell a space

# Texts longer than this are encoded through the backend's batch call, which releases the GIL
# (its single-text call holds it: 0.4 s for 600k characters, during which a server's event loop
# on another thread stood still); a caller may then run them on a worker thread.
LONG_TEXT_CHARS = 20_000

# Architectures whose 'llama' (SentencePiece) vocabulary follows Gemma's layout, as transformers
# treats them: no prefix space, spaces normalized to "▁", merges in file order.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})

# Pre-tokenizer splits per `tokenizer.ggml.pre`, for byte-level vocabularies. A value without an
# entry gets GPT-2's split (ByteLevel's built-in regex). The table follows transformers' GGUF
# conversion so that ids agree with it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "smollm" (SmolLM/SmolLM2): the model's own tokenizer.json isolates every digit before GPT-2's
# split (Digits(individual_digits) then ByteLevel), as llama.cpp does, so "\n\n1" is ["\n\n", "1"]
# and " ①" is [" ", "①"]. transformers' GGUF conversion has no entry for it and uses GPT-2's split
# alone (["\n", "\n", "1"]); loom follows the model's tokenizer here, which is what the model was
# trained on (a numbered list after a blank line, re-read in a later turn, keeps its ids).
DIGIT_FIRST = frozenset({"smollm"})
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# End-of-turn / end-of-generation tokens: generation stops at any of these present in the
# vocabulary, in addition to the file's eos (and eot/eom ids when it names them).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet):
    printable Latin-1 bytes stand for themselves, the other 68 take code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in byte_to_unicode().items()}


@contextmanager
def _collector_paused():
    """Python's cyclic collector off while a vocabulary's merges are built: half a million
    tuples for a 262k vocabulary, none in a cycle, and each collection pass would walk the ones made so far
    again (0.1 s of Gemma 3's load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def merges_by_score(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every split of a token into two pieces that are both in the vocabulary is a merge. Merges
    are ranked by the token's score (higher first), then by longer left piece, then longer right
    piece, then token position -- the ranking transformers uses, so both build the same BPE.
    """
    known = frozenset(tokens)
    # One flat comprehension: this runs over every cut of every token (~1.5M for Gemma's 262k).
    found = [(token[:cut], token[cut:], index) for index, token in enumerate(tokens)
             for cut in range(1, len(token)) if token[:cut] in known and token[cut:] in known]
    if not found:
        return []
    lefts, rights, owner = zip(*found)
    owner_arr = np.asarray(owner, dtype=np.int64)
    score = np.asarray(scores, dtype=np.float64)[owner_arr]
    len_left = np.fromiter(map(len, lefts), dtype=np.int64, count=len(lefts))
    len_right = np.fromiter(map(len, rights), dtype=np.int64, count=len(rights))
    # np.lexsort: the last key is the primary one.
    order = np.lexsort((owner_arr, -len_right, -len_left, -score))
    return [(lefts[i], rights[i]) for i in order.tolist()]


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template.

    Build with `Tokenizer.from_gguf`. `encode` adds BOS (when the model wants it) only with
    ``add_special_tokens=True``; text that spells a control or user-defined token (for example
    ``"<|im_start|>"``) encodes to that token's single id.
    """

    def __init__(self, backend: _Backend, *, name: str, vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None, unk_token_id: int | None,
                 add_bos: bool, add_eos: bool, stop_token_ids: frozenset[int],
                 special_token_ids: frozenset[int], chat_template: str | None,
                 named_tokens: dict[str, str] | None = None, raw_tokens: Sequence[str] = (),
                 vocab_kind: str = "byte_level"):
        self._backend = backend
        # The vocabulary as the file spells it, and how its pieces map to bytes: "byte_level"
        # (GPT-2 byte-to-unicode, 'Ġ' for a space) or "byte_fallback" (SentencePiece: '▁' for a
        # space, <0xNN> pieces for raw bytes). Grammar engines read these to build token masks.
        self.raw_tokens = list(raw_tokens)
        self.vocab_kind = vocab_kind
        self.name = name
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.stop_token_ids = stop_token_ids
        self.special_token_ids = special_token_ids
        self.chat_template = chat_template
        # Template variables: "bos_token", "eos_token", ... -> the token's text.
        self.named_tokens = dict(named_tokens or {})
        # A template that does not compile fails chat requests only, never plain prompts.
        self._template: ChatTemplate | None = None
        self._template_error: str | None = None
        self._other_templates: dict[str, ChatTemplate] = {}   # templates given per call
        if chat_template is not None:
            try:
                self._template = ChatTemplate(chat_template, name)
            except TokenizerError as e:
                self._template_error = str(e)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        """The tokenizer described by `f`'s ``tokenizer.*`` metadata.

        Raises `ModelLoadError` when the vocabulary is missing, inconsistent or of a kind loom
        does not support.
        """
        md = f.metadata
        kind = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(kind, str):
            raise ModelLoadError(f.path, "metadata has no 'tokenizer.ggml.model' (no tokenizer in the file)")
        # a GGUF array has one element type: the first element tells it
        if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
            raise ModelLoadError(f.path, "metadata has no usable 'tokenizer.ggml.tokens'")
        n = len(tokens)
        types = _int_array(f, "tokenizer.ggml.token_type", n)
        if types is None:
            types = np.full(n, NORMAL, dtype=np.int64)
        arch = str(md.get("general.architecture", ""))

        with _collector_paused():
            if kind == "gpt2":
                backend, spelled = _byte_level_backend(f, tokens)
            elif kind == "llama":
                layout = "gemma" if arch in _GEMMA_ARCHS else "phi3" if arch == "phi3" else "llama"
                backend, spelled = _sentencepiece_backend(f, tokens, types, layout)
            elif kind == "gemma4":
                backend, spelled = _sentencepiece_backend(f, tokens, types, "gemma4")
            else:
                raise ModelLoadError(f.path, f"unsupported tokenizer type {kind!r} (loom reads 'gpt2' byte-level "
                                             "BPE and 'llama' SentencePiece vocabularies)")

        def token_id(key: str) -> int | None:
            value = md.get(key)
            if value is None:
                return None
            value = int(value)
            if not 0 <= value < n:
                raise ModelLoadError(f.path, f"'{key}' is {value}, outside the vocabulary of {n} tokens")
            return value

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        unk, pad = token_id("tokenizer.ggml.unknown_token_id"), token_id("tokenizer.ggml.padding_token_id")

        special = _register_added_tokens(backend, tokens, spelled, types, [bos, eos, unk, pad],
                                         byte_level=kind == "gpt2")

        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise; a
        # byte-level one gets none by default. Gemma 4 files set the flag, but its reference
        # tokenizer adds no BOS (the chat template writes it); transformers follows the
        # reference, and so does loom.
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        if kind == "gemma4":
            add_bos = False
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))

        stops = {i for i in (eos, token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id"))
                 if i is not None}
        for text in END_OF_TURN_TOKENS:
            i = backend.token_to_id(text)
            if i is not None and i < n and int(types[i]) in (CONTROL, USER_DEFINED):
                stops.add(i)

        template = md.get("tokenizer.chat_template")
        name = Path(f.path).name  # users know a model by its file (or registry) name
        return cls(backend, name=str(name), vocab_size=n, bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=pad, unk_token_id=unk, add_bos=add_bos, add_eos=add_eos,
                   stop_token_ids=frozenset(stops), special_token_ids=frozenset(special),
                   chat_template=template if isinstance(template, str) and template else None,
                   named_tokens={f"{k}_token": tokens[i] for k, i in
                                 (("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)) if i is not None},
                   raw_tokens=tokens, vocab_kind="byte_level" if kind == "gpt2" else "byte_fallback")

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's flags say.
        Text that is not Unicode (a lone UTF-16 surrogate, as JSON's "\\ud800" can carry) raises
        `TokenizerError` saying where."""
        try:
            if isinstance(text, str) and len(text) > LONG_TEXT_CHARS:   # the batch call lets go of the GIL
                ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            else:
                ids = self._backend.encode(text, add_special_tokens=False).ids
        except (TypeError, RuntimeError, ValueError):
            raise _not_text(text) from None
        return self._frame(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (parallel inside the backend)."""
        try:
            out = [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        except (TypeError, RuntimeError, ValueError):
            raise next((_not_text(t) for t in texts if not _is_text(t)), TokenizerError("texts must be str")) from None
        return [self._frame(ids) for ids in out] if add_special_tokens else out

    def _frame(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.add_eos and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that do not form a complete UTF-8 character decode as U+FFFD.
        Ids past the end of the vocabulary are ignored; negative ids raise `TokenizerError`."""
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except OverflowError:
            raise TokenizerError(f"cannot decode negative token ids: {[i for i in ids if i < 0][:5]}") from None

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for: its text, or, for a token that is part of a UTF-8
        character (whose text alone is U+FFFD), the byte-level or <0xNN> piece's raw bytes."""
        text = self.decode([i])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.id_to_token(i) or ""
        if self.vocab_kind == "byte_level":
            table = _unicode_to_byte()
            if piece and all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return text.encode("utf-8")

    def token_to_id(self, tok: str) -> int | None:
        return self._backend.token_to_id(tok)

    def id_to_token(self, i: int) -> str | None:
        """The token's vocabulary spelling (byte-level symbols like "Ġ", or "▁" for spaces)."""
        return self._backend.id_to_token(i)

    # -- the parts of a transformers tokenizer that code written for vLLM's get_tokenizer() uses --
    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids", "attention_mask"} of a text or of each of a list of texts."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        ids_list = self.encode_batch(text, add_special_tokens)
        return {"input_ids": ids_list, "attention_mask": [[1] * len(ids) for ids in ids_list]}

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        return self.token_to_id(tokens) if isinstance(tokens, str) else [self.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Token spelling -> id, spelled as `id_to_token` spells them (Gemma's spaces as "▁")."""
        if not self.raw_tokens:
            return self._backend.get_vocab()
        return {self._backend.id_to_token(i) or t: i for i, t in enumerate(self.raw_tokens)}

    bos_token = property(lambda self: self.named_tokens.get("bos_token"), doc="The BOS token's text, or None.")
    eos_token = property(lambda self: self.named_tokens.get("eos_token"), doc="The EOS token's text, or None.")
    pad_token = property(lambda self: self.named_tokens.get("pad_token"), doc="The pad token's text, or None.")
    unk_token = property(lambda self: self.named_tokens.get("unk_token"), doc="The unknown token's text, or None.")

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_token_ids | {i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id,
                                                             self.unk_token_id) if i is not None})

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            continue_final_message: bool = False, *, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The ids of a conversation rendered by the model's own template (or by `chat_template`,
        a Jinja template of the same kind), as `encode_chat` gives them; with ``tokenize=False``
        its text. The defaults are transformers' (ids, no generation prompt): code written for
        vLLM's `LLM.get_tokenizer()` gets what it gets there.

        `kwargs` become template variables (``tools``, ``documents``, ``enable_thinking``, ...);
        transformers' options that shape a tensor output (``return_dict``, ``padding``, ...) are
        refused. continue_final_message: the text ends where the final message's text ends (its
        end of turn cut off), so that the model continues that message, as transformers does;
        not with add_generation_prompt.
        Raises `TokenizerError` if the model has no template or the template rejects the input.
        """
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt, continue_final_message,
                                    chat_template=chat_template, **kwargs)
        if unsupported := sorted(set(kwargs) & _HF_OUTPUT_OPTIONS):
            raise TokenizerError(f"apply_chat_template does not take {', '.join(unsupported)}: it returns the "
                                 "prompt's ids, or its text with tokenize=False")
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizerError("continue_final_message continues the final message: it cannot be combined "
                                     "with add_generation_prompt (set add_generation_prompt to false)")
            tagged, final = _tag_final_message(messages)
            return _cut_at_tag(self.apply_chat_template(tagged, False, tokenize=False, chat_template=chat_template,
                                                        **kwargs), final)
        return self._chat_template(chat_template).render(messages, add_generation_prompt=add_generation_prompt,
                                                         special_tokens=self.named_tokens, **kwargs)

    def set_chat_template(self, source: str) -> None:
        """Replaces the model's chat template (`loom serve --chat-template`); TokenizerError when
        the template does not compile."""
        template = ChatTemplate(source, self.name, given_as="the chat template set in place of the model's "
                                                           "(--chat-template)")
        self.chat_template, self._template, self._template_error = source, template, None

    def _chat_template(self, source: str | None) -> ChatTemplate:
        """The model's compiled template, or `source` compiled (kept for the next call)."""
        if source is not None:
            if source not in self._other_templates:
                if len(self._other_templates) >= 8:
                    self._other_templates.clear()
                self._other_templates[source] = ChatTemplate(source, self.name, given_as="the chat_template given")
            return self._other_templates[source]
        if self._template_error is not None:
            raise TokenizerError(self._template_error)
        if self._template is None:
            raise TokenizerError(f"model {self.name!r} has no chat template (its GGUF file carries no "
                                 "'tokenizer.chat_template'); send a plain text prompt instead of chat messages")
        return self._template

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Ids of the rendered conversation; BOS is added only if the model wants one and the
        template did not already write it."""
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, tokenize=False, **kwargs)
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


def _is_text(text: Any) -> bool:
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_text(text: Any) -> TokenizerError:
    """The error for an input the backend refused: not a str, or a str with a lone surrogate."""
    if not isinstance(text, str):
        return TokenizerError(f"text must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return TokenizerError(f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} "
                              "(UTF-16 surrogates must come in pairs)")
    return TokenizerError("the tokenizer cannot encode this text")


# transformers' apply_chat_template options for a tensor or dict output, which loom's does not give
_HF_OUTPUT_OPTIONS = frozenset({"return_dict", "return_tensors", "padding", "truncation", "max_length",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})

# Marks where the final message's text ends in a rendering that must leave it open (transformers' tag).
_OPEN_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> tuple[list[dict], str]:
    """A copy of `messages` whose final message's text (its content, or its last text part) ends
    in `_OPEN_TAG`, and that text."""
    last = dict(messages[-1]) if messages and isinstance(messages[-1], dict) else None
    content = None if last is None else last.get("content")
    if isinstance(content, str):
        last["content"] = content + _OPEN_TAG
        return messages[:-1] + [last], content
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                last["content"] = content[:i] + [{**part, "text": part["text"] + _OPEN_TAG}] + content[i + 1:]
                return messages[:-1] + [last], part["text"]
    raise TokenizerError("continue_final_message needs a final message with text to continue")


def _cut_at_tag(text: str, final: str) -> str:
    """The rendering `text` cut where the tagged final message ends (its trailing spaces kept
    where the template keeps them)."""
    tag = _OPEN_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TokenizerError("continue_final_message: the chat template does not write the final message's text "
                             "as given, so it cannot be left open")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_OPEN_TAG)] == _OPEN_TAG else text[:at].rstrip()


# -- building the backend ------------------------------------------------------------------------
def _int_array(f: GGUFFile, key: str, n: int) -> np.ndarray | None:
    value = f.metadata.get(key)
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.ndim != 1 or len(arr) != n or not np.issubdtype(arr.dtype, np.number):
        raise ModelLoadError(f.path, f"'{key}' should hold one number per token ({n}), "
                                     f"found {arr.dtype} array of shape {arr.shape}")
    return arr


def _byte_level_backend(f: GGUFFile, tokens: list[str]) -> tuple[_Backend, list[str]]:
    """Byte-level BPE; returns the backend and each token's spelling in it."""
    merges = f.metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not merges:
        raise ModelLoadError(f.path, "byte-level BPE vocabulary without 'tokenizer.ggml.merges'")
    table = byte_to_unicode()
    alphabet = set(table.values())
    # Tokens are stored in the byte alphabet; one that is not (a mislabeled added token) is
    # respelled byte by byte, as transformers does, and stays an ordinary vocabulary entry.
    # (one check over all tokens first: a quarter of the time of one per token)
    spelled = tokens if set("".join(tokens)) <= alphabet else \
        [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = dict(zip(spelled, range(len(spelled))))
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        model = BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                    end_of_word_suffix="", fuse_unk=False)
    except Exception as e:  # the Rust side rejects merges of unknown tokens, malformed pairs
        raise ModelLoadError(f.path, f"inconsistent BPE merges: {e}") from None
    backend = _Backend(model)
    pre = str(f.metadata.get("tokenizer.ggml.pre", ""))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if pre in DIGIT_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _sentencepiece_backend(f: GGUFFile, tokens: list[str], types: np.ndarray,
                           layout: str) -> tuple[_Backend | SentencePieceBackend, list[str]]:
    """SentencePiece pieces as a BPE with byte fallback (``<0xNN>`` tokens); Gemma's vocabulary
    without merges on the sentencepiece library instead (`loom.loader.sentencepiece_backend`).

    `layout` is how the model turns text into pieces and back (as transformers does it):
    ``"llama"`` prepends "▁" to the first word and strips it when decoding; ``"phi3"`` does
    the same with a normalizer; ``"gemma"`` and ``"gemma4"`` add no prefix and only spell
    spaces as "▁".
    """
    md = f.metadata
    n = len(tokens)
    spelled = list(tokens)
    if layout == "gemma":
        # Gemma stores its multi-space tokens with real spaces, but text reaches the model with
        # spaces already turned into "▁"; spell them that way so they can match.
        spelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    file_merges = md.get("tokenizer.ggml.merges")
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk_id = int(unk_id) if unk_id is not None and 0 <= int(unk_id) < n else None
    if isinstance(file_merges, list) and file_merges:
        merges = [tuple(m.split(" ")) for m in file_merges]
    elif layout == "gemma":
        # Gemma's scores do not follow its merge order; the order of tokens in the file does.
        whole = [a == b for a, b in zip(tokens, spelled)]
        backend = cached_gemma_backend(f.path, spelled, types, whole, unk_id)
        if backend is not None:
            return backend, spelled
        merges = _cached_merges(f, spelled, -np.arange(n, dtype=np.float64), layout)
    else:
        scores = md.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != n:
            raise ModelLoadError(f.path, "SentencePiece vocabulary with neither merges nor one "
                                         "'tokenizer.ggml.scores' entry per token")
        merges = _cached_merges(f, spelled, np.asarray(scores, dtype=np.float64), layout)
    unk = tokens[unk_id] if layout in ("gemma", "gemma4") and unk_id is not None else None
    try:
        model = BPE(vocab=dict(zip(spelled, range(n))), merges=merges, dropout=None, unk_token=unk,
                    fuse_unk=True, byte_fallback=True)
    except Exception as e:  # the Rust side rejects merges of unknown tokens, malformed pairs
        raise ModelLoadError(f.path, f"inconsistent SentencePiece merges: {e}") from None
    backend = _Backend(model)
    pieces_to_text = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if layout in ("gemma", "gemma4"):
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        backend.decoder = decoders.Sequence(pieces_to_text)
        return backend, spelled
    # transformers prepends "▁" to the first word whatever 'tokenizer.ggml.add_space_prefix'
    # says (llama.cpp honours the flag); loom follows transformers. Files that set it to false
    # are Gemma's, handled above.
    if layout == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE),
                                                   normalizers.Replace(" ", SPIECE_SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="first",
                                                         split=False)
    backend.decoder = decoders.Sequence([*pieces_to_text, decoders.Strip(content=" ", left=1, right=0)])
    return backend, spelled


def _cached_merges(f: GGUFFile, spelled: list[str], scores: np.ndarray, layout: str) -> list[tuple[str, str]]:
    """`merges_by_score`, kept in the cache as token id pairs: deriving them takes seconds for a
    262k vocabulary, reading them back milliseconds. Keyed by the file's content, the layout and
    this code; an unreadable or inconsistent file is recomputed (and a failed write ignored)."""
    key = source_digest(__file__) + layout + loom_version()
    name = f"{file_sha256(f.path)[:24]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.merges.npy"
    path, n = cache_root() / "tokenizers" / name, len(spelled)
    try:
        pairs = np.load(path, allow_pickle=False)
        if pairs.ndim == 2 and pairs.shape[1] == 2 and (not pairs.size or 0 <= pairs.min() <= pairs.max() < n):
            left, right = pairs[:, 0].tolist(), pairs[:, 1].tolist()
            if len(left) < 2:
                return [(spelled[a], spelled[b]) for a, b in zip(left, right)]
            return list(zip(itemgetter(*left)(spelled), itemgetter(*right)(spelled)))   # C loops: 515k pairs
    except (OSError, ValueError, EOFError):
        pass
    merges = merges_by_score(spelled, scores)
    ids = dict(zip(spelled, range(n)))
    pairs = np.array([(ids[a], ids[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    try:
        atomic_write(path, lambda out: np.save(out, pairs, allow_pickle=False))
    except CacheWriteError:
        pass   # derived again at the next load
    return merges


def _register_added_tokens(backend: _Backend, tokens: list[str], spelled: list[str], types: np.ndarray,
                           named: list[int | None], byte_level: bool) -> set[int]:
    """Make control, named and user-defined tokens match whole in text; return the special ids.

    Control tokens and the named bos/eos/unk/pad tokens become special (skippable when
    decoding); user-defined tokens are matched whole but decode as text. A token whose stored
    spelling had to be changed (a byte-level control token written outside the byte alphabet,
    a Gemma run of spaces) stays an ordinary vocabulary entry, as in transformers.
    """
    alphabet = set(byte_to_unicode().values()) if byte_level else None

    def whole(i: int) -> bool:
        return tokens[i] == spelled[i] and (alphabet is None or set(tokens[i]) <= alphabet)

    special_ids = [i for i in np.flatnonzero(types == CONTROL).tolist() if whole(i)]
    listed = set(special_ids)
    special_ids += [i for i in dict.fromkeys(named) if i is not None and i not in listed and whole(i)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    listed = set(special_ids)
    user = [i for i in np.flatnonzero(types == USER_DEFINED).tolist() if i not in listed and tokens[i] == spelled[i]]
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    return set(special_ids)


class IncrementalDetokenizer:
    """Streaming decode of generated ids: each `add` returns only the text the new ids add.

    A delta never ends inside a UTF-8 character: ids after the last point where the text is
    whole (no trailing U+FFFD) are held back until a later id completes the character. Each
    call decodes only a short window -- from where the previous delta's ids began -- so its
    cost depends on the new and held ids, not on the length of the sequence.

    The deltas (plus `flush`) concatenate to the text the generated ids add after the prompt,
    ``decode(prompt + ids)[len(decode(prompt)):]``, which is ``decode(ids)`` for byte-level and
    Gemma vocabularies. The prompt's last few ids give the first delta its context (a
    SentencePiece word piece right after the prompt keeps its leading space).

    Ids that never complete a character (invalid UTF-8 from the model) are released with
    U+FFFD once `MAX_HELD` of them wait.
    """

    # Prompt ids kept as context for the first delta.
    PROMPT_CONTEXT = 5
    # How many ids may wait for a character to complete. A character has at most 4 bytes and
    # real vocabularies complete one within a few ids; a longer wait means invalid bytes.
    MAX_HELD = 16
    # The window's consumed head is dropped from the backing list once it is this long.
    _TRIM = 1024

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._chunks: list[str] = []
        context = [int(t) for t in list(prompt_ids)[-self.PROMPT_CONTEXT:]]
        # `_ids` backs the decode window: context, then generated ids (head trimmed).
        # `_ids[_prefix:_read]` was emitted by the last delta; `_ids[_read:]` is held back, and
        # every cut up to `_checked` is known to end inside a character.
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._checked = self._read

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text (possibly empty)."""
        new = [int(t) for t in token_ids]
        if not new:
            return ""
        self.token_ids.extend(new)
        self._ids.extend(new)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release whatever is still held back (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _decode(self, end: int) -> str:
        return self.tokenizer.decode(self._ids[self._prefix:end], self.skip_special_tokens)

    def _stable_end(self, end: int) -> int:
        """Where held ids released as invalid bytes are cut: before the ids of a character's
        start that a later id may still complete (at most 3 bytes at the end), so that the text
        released stays the text of the whole sequence."""
        data = [self.tokenizer.token_bytes(i) for i in self._ids[self._read:end]]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(data), final=False)
        open_bytes, cut = len(decoder.getstate()[0]), end
        while open_bytes > 0 and cut > self._read:
            cut -= 1
            open_bytes -= len(data[cut - self._read])
        return cut

    def _advance(self, final: bool) -> str:
        end = len(self._ids)
        if self._read == end:
            return ""
        window = self._decode(end)
        if not final and window.endswith("\ufffd"):
            # Emit up to the last new id after which the text is whole, if there is one.
            for cut in range(end - 1, self._checked, -1):
                text = self._decode(cut)
                if not text.endswith("\ufffd"):
                    window, end = text, cut
                    break
            else:
                self._checked = end
                if end - self._read < self.MAX_HELD:
                    return ""
                end = self._stable_end(end)
                if end == self._read:
                    return ""
                window = self._decode(end)
        delta = window[len(self._decode(self._read)):]
        self._prefix, self._read = self._read, end
        self._checked = end
        if self._prefix >= self._TRIM:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._checked -= self._prefix
            self._prefix = 0
        if delta:
            self._chunks.append(delta)
        return delta
