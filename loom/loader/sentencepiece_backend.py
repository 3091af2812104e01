"""Gemma's vocabulary on the `sentencepiece` library, behind the interface of a `tokenizers.Tokenizer`.

A Gemma GGUF holds a SentencePiece BPE vocabulary as pieces and scores, without merges. Built as
a `tokenizers` BPE it needs its merges derived and then indexed: for Gemma 3's 262,144 pieces
(514,906 merges) that took 1.0 s of a 1.3 s warm model load, where llama.cpp loads the whole
model in 0.65 s. SentencePiece merges by piece score at encoding time, so the same vocabulary
loads as a model proto in ~50 ms (the proto is kept in loom's cache, keyed by the file).

The proto is built so that its ids agree with the `tokenizers` BPE loom builds for other
SentencePiece files (and so with transformers' tokenizer, the tests' reference):

* Scores: the file order (piece i scores -i). Gemma's stored scores do not follow its merge order.
* Pieces: as the vocabulary spells them. Gemma's runs of spaces, stored with real spaces, are
  spelled with "▁" and are ordinary pieces (transformers keeps them in its BPE vocabulary, not
  as added tokens), so a run of 40 spaces merges as BPE merges it, not longest-first.
* Types: control tokens stay CONTROL (never produced from text by SentencePiece itself: the
  backend finds them in the text first, as `tokenizers` finds its added tokens), user-defined
  tokens USER_DEFINED (matched whole), byte pieces BYTE (byte fallback), the unknown token
  UNKNOWN; the rest NORMAL.
* No normalization: the text's spaces become "▁" and nothing else changes (no prefix space).

Special tokens (registered with `add_special_tokens`) are matched leftmost-longest in text and
decode to their own text unless skipped.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

from loom.loader.cache import CacheWriteError, atomic_write, cache_root, file_sha256, loom_version, source_digest

# llama.cpp's token types (tokenizer.ggml.token_type) that keep their kind in the proto
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6
_PIECE = spm_pb2.ModelProto.SentencePiece


@dataclass(frozen=True)
class Encoding:
    """What `tokenizers.Tokenizer.encode` returns, as far as loom reads it."""
    ids: list[int]


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of `words`, longest first at each position, as a trie of groups:
    thousands of special tokens then cost one branch per character, not one try per token."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = []
        for ch, child in sorted(node.items()):
            if not ch:
                continue
            run = re.escape(ch)
            while len(child) == 1 and "" not in child:   # a chain without a branch: one literal
                (ch, child), = child.items()
                run += re.escape(ch)
            branches.append(run + emit(child))
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if "" in node else body   # greedy: the longer word first
    return emit(trie)


def _special_regex(words: Sequence[str]) -> re.Pattern:
    """`_trie_pattern`'s regex; where the trie nests too deep for Python's regex compiler, the
    plain alternation, longest words first (the same matches, one try per word)."""
    try:
        return re.compile(_trie_pattern(words))
    except (RecursionError, re.error, OverflowError):
        return re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))


class SentencePieceBackend:
    """The subset of `tokenizers.Tokenizer` that `loom.loader.tokenizer.Tokenizer` uses."""

    def __init__(self, proto: bytes, vocab_size: int):
        self._sp = SentencePieceProcessor(model_proto=proto)
        self._n = vocab_size
        self._special_text: dict[int, str] = {}
        self._split: re.Pattern | None = None

    # -- added tokens ----------------------------------------------------------------------------
    def add_special_tokens(self, tokens: Sequence) -> int:
        """Special tokens (`tokenizers.AddedToken`s of pieces in the vocabulary): found whole in
        text before SentencePiece sees it, dropped by ``decode(..., skip_special_tokens=True)``."""
        for t in tokens:
            i = self.token_to_id(t.content)
            if i is not None:
                self._special_text[i] = t.content
        words = sorted(set(self._special_text.values()))
        self._split = _special_regex(words) if words else None
        return len(tokens)

    def add_tokens(self, tokens: Sequence) -> int:
        """User-defined tokens: the proto marks them, and SentencePiece matches them whole."""
        return len(tokens)

    # -- text <-> ids ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        if self._split is None:
            return Encoding(self._sp.encode(text))
        ids, at = [], 0
        for m in self._split.finditer(text):
            if m.start() > at:
                ids += self._sp.encode(text[at:m.start()])
            ids.append(self._sp.piece_to_id(m.group()))
            at = m.end()
        if at < len(text):
            ids += self._sp.encode(text[at:])
        return Encoding(ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids past the vocabulary are ignored; a negative id raises OverflowError (as the
        `tokenizers` backend does)."""
        ids = list(ids)
        if not ids:
            return ""
        if min(ids) < 0:
            raise OverflowError(f"negative token id {min(ids)}")
        if max(ids) >= self._n:
            ids = [i for i in ids if i < self._n]
        special = self._special_text
        if special.keys().isdisjoint(ids):   # the common case: one call into the library
            return self._sp.decode(ids)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            text = special.get(i)
            if text is None:
                run.append(i)
                continue
            if run:
                out.append(self._sp.decode(run))
                run = []
            if not skip_special_tokens:
                out.append(text)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if 0 <= i < self._n and self._sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        return self._sp.id_to_piece(i) if 0 <= i < self._n else None


def gemma_proto(spelled: Sequence[str], types: np.ndarray, whole: Sequence[bool], unk_id: int | None) -> bytes:
    """The model proto of a Gemma vocabulary (see the module doc): `spelled` as the backend
    spells the pieces, `types` the file's token types, `whole[i]` whether piece i is stored as
    spelled (a control or user-defined piece that had to be respelled is an ordinary one)."""
    m = spm_pb2.ModelProto()
    m.trainer_spec.model_type = spm_pb2.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = -1 if unk_id is None else unk_id
    m.trainer_spec.bos_id = m.trainer_spec.eos_id = m.trainer_spec.pad_id = -1   # loom frames the ids itself
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    kinds = {_CONTROL: _PIECE.CONTROL, _USER_DEFINED: _PIECE.USER_DEFINED, _BYTE: _PIECE.BYTE}
    add = m.pieces.add
    for i, (piece, t, ok) in enumerate(zip(spelled, types.tolist(), whole)):
        kind = _PIECE.UNKNOWN if i == unk_id else kinds.get(t, _PIECE.NORMAL) if ok else _PIECE.NORMAL
        add(piece=piece, score=float(-i), type=kind)
    return m.SerializeToString()


def cached_gemma_backend(path, spelled: Sequence[str], types: np.ndarray, whole: Sequence[bool],
                         unk_id: int | None) -> SentencePieceBackend | None:
    """The backend from the proto in loom's cache (keyed by the file's content and this code),
    built and cached when missing; a cached proto that does not load is built again. None where
    the library refuses the vocabulary (no 256 byte pieces for its byte fallback, a piece spelled
    twice): the caller builds the `tokenizers` BPE instead."""
    key = source_digest(__file__) + loom_version()
    name = f"{file_sha256(path)[:24]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.spm"
    target = cache_root() / "tokenizers" / name
    try:
        backend = SentencePieceBackend(target.read_bytes(), len(spelled))
        if backend._sp.get_piece_size() == len(spelled):
            return backend
    except (OSError, RuntimeError):
        pass
    proto = gemma_proto(spelled, types, whole, unk_id)
    try:
        backend = SentencePieceBackend(proto, len(spelled))
    except RuntimeError:
        return None
    try:
        atomic_write(target, lambda out: out.write(proto))
    except CacheWriteError:
        pass   # built again at the next load
    return backend
