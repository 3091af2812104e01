"""A token n-gram datastore for retrieval drafting (REST / RASD style): what followed a context's tail.

Two parts, searched longest n-gram first, the corpus before the recent outputs:

    corpus   the user's documents (a file or a directory of them), tokenized once at start-up;
             one sorted index per n in [min_n, max_n]: (hash of tokens[i:i+n], i), searched by
             binary search; documents are separated by -1 so no n-gram crosses two of them
    recent   the outputs of finished requests, the newest `recent_tokens` tokens; a dict from
             n-gram to its latest positions, rebuilt once as many tokens have left as it holds

    tokens  ... A B C | D E F ...          tail "A B C" matched -> continuation "D E F ..."

`continuations(tail, k)` returns up to CANDIDATES continuations of up to k tokens of the
longest n that matched anywhere, most recent first (a drafter merges them into a tree).

Memory. The corpus costs CORPUS_BYTES_PER_TOKEN per token and n (4 for the token, 12 per
index entry), the recent part RECENT_BYTES_PER_TOKEN per token and n (Python objects); their
sum must stay within `max_mb`, checked from the file sizes before tokenizing (at least one
token per MAX_BYTES_PER_TOKEN bytes of text) and exactly after. Lookups and additions hold
a lock: a server's engine thread adds outputs while requests are drafted.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np

from loom.errors import InvalidRequestError

CANDIDATES = 8                     # continuations per look-up
CORPUS_BYTES_PER_TOKEN = 12        # per n: a uint64 hash and an int32 position
TOKEN_BYTES = 4
RECENT_BYTES_PER_TOKEN = 256       # per n: a dict entry, its tuple key, a list slot (measured: ~250 at worst)
MAX_BYTES_PER_TOKEN = 16           # bytes of text per token at most, for the check before tokenizing
POSITIONS_PER_GRAM = 4             # recent part: latest positions kept per n-gram
_MUL = np.uint64(0x9E3779B97F4A7C15)


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] uint64: a hash of each window tokens[i:i+n]."""
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MUL + (tokens[j:len(tokens) - n + 1 + j].astype(np.uint64) + np.uint64(1))
    return h


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def _documents(path: Path) -> list[str]:
    """The texts of `path`: each file's, or in a .jsonl file each line's "text" field."""
    docs = []
    for f in _files(path):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"speculative_config datastore: cannot read {f}: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
        if f.suffix == ".jsonl":
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    try:
                        doc = json.loads(line)["text"]
                        if not isinstance(doc, str):
                            raise TypeError
                        docs.append(doc)
                    except (ValueError, KeyError, TypeError):
                        raise InvalidRequestError(f"speculative_config datastore: {f} line {i + 1} is not a JSON "
                                                  f"object with a \"text\" string") from None
        else:
            docs.append(text)
    return docs


class Datastore:
    def __init__(self, min_n: int, max_n: int, max_mb: float, recent_tokens: int):
        self.min_n, self.max_n, self.max_mb = min_n, max_n, max_mb
        self.recent_tokens = recent_tokens
        self.corpus = np.full(1, -1, dtype=np.int32)
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}      # n -> (sorted hashes, positions)
        self.recent: OrderedDict[int, tuple[int, ...]] = OrderedDict()   # id -> tokens of finished outputs
        self.recent_size = 0
        self._stale = 0                # tokens of outputs that left since the dict was last rebuilt
        self.grams: dict[tuple[int, ...], list[int]] = {}   # n-gram -> latest (output id << 32 | end offset)
        self._next_id = 0
        self._lock = threading.Lock()
        self._check(self._recent_bytes())

    # -- memory ---------------------------------------------------------------------------
    @property
    def _sizes(self) -> int:
        return self.max_n - self.min_n + 1

    def _recent_bytes(self) -> int:
        """The dict holds the live outputs' n-grams and at most as many of outputs that left."""
        return 2 * self.recent_tokens * RECENT_BYTES_PER_TOKEN * self._sizes

    def _corpus_bytes(self, tokens: int) -> int:
        return tokens * (TOKEN_BYTES + CORPUS_BYTES_PER_TOKEN * self._sizes)

    def _check(self, nbytes: int, what: str = "") -> None:
        if nbytes > self.max_mb * 2 ** 20:
            raise InvalidRequestError(
                f"speculative_config datastore{what} needs {nbytes / 2 ** 20:.3g} MB, over the limit of "
                f"datastore_max_mb={self.max_mb:g} MB (raise it, or give a smaller corpus or datastore_recent_tokens)")

    # -- the corpus ---------------------------------------------------------------------------
    def load(self, path: str, encode: Callable[[str], list[int]]) -> None:
        """Tokenizes the documents at `path` and indexes them; raises InvalidRequestError (one
        line) for a missing or unreadable path or a corpus over the memory limit."""
        p = Path(path).expanduser()
        if not p.exists():
            raise InvalidRequestError(f"speculative_config datastore: no such file or directory: {path}")
        files = _files(p)
        if not files:
            raise InvalidRequestError(f"speculative_config datastore: no files under {path}")
        size = sum(f.stat().st_size for f in files)
        self._check(self._corpus_bytes(size // MAX_BYTES_PER_TOKEN) + self._recent_bytes(), f" {path}")
        parts = []
        for doc in _documents(p):
            parts += [np.asarray(encode(doc), dtype=np.int32), np.full(1, -1, dtype=np.int32)]
        tokens = np.concatenate([np.full(1, -1, dtype=np.int32)] + parts)
        self._check(self._corpus_bytes(len(tokens)) + self._recent_bytes(), f" {path} ({len(tokens)} tokens)")
        index = {}
        for n in range(self.min_n, self.max_n + 1):
            if len(tokens) <= n:
                continue
            h = _hashes(tokens, n)
            order = np.argsort(h, kind="stable").astype(np.int32)     # equal hashes: ascending position
            index[n] = (h[order], order)
        with self._lock:
            self.corpus, self.index = tokens, index

    def _corpus_matches(self, tail: tuple[int, ...], k: int) -> list[list[int]]:
        n = len(tail)
        if n not in self.index:
            return []
        hashes, pos = self.index[n]
        key = _hashes(np.asarray(tail, dtype=np.int32), n)[0]
        lo, hi = np.searchsorted(hashes, key, "left"), np.searchsorted(hashes, key, "right")
        out = []
        for i in pos[max(lo, hi - 4 * CANDIDATES):hi][::-1].tolist():    # latest first
            if tuple(self.corpus[i:i + n].tolist()) != tail:             # a hash collision
                continue
            cont = self.corpus[i + n:i + n + k].tolist()
            cont = cont[:cont.index(-1)] if -1 in cont else cont
            if cont:
                out.append(cont)
                if len(out) == CANDIDATES:
                    break
        return out

    # -- recent outputs -------------------------------------------------------------------------
    def add(self, tokens: list[int]) -> None:
        """Remembers a finished request's output (its newest `recent_tokens` tokens at most)."""
        if self.recent_tokens <= 0 or len(tokens) <= self.min_n:
            return
        toks = tuple(tokens[-self.recent_tokens:])
        with self._lock:
            rid, self._next_id = self._next_id, self._next_id + 1
            self.recent[rid] = toks
            self.recent_size += len(toks)
            self._index_recent(rid, toks)
            while self.recent_size > self.recent_tokens:
                _, old = self.recent.popitem(last=False)
                self.recent_size -= len(old)
                self._stale += len(old)
            if self._stale > self.recent_tokens:   # the dict's entries of outputs that left: rebuild
                self.grams.clear()
                self._stale = 0
                for r, t in self.recent.items():
                    self._index_recent(r, t)

    def _index_recent(self, rid: int, toks: tuple[int, ...]) -> None:
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(toks)):                # a continuation must follow
                q = self.grams.setdefault(toks[end - n:end], [])
                q.append(rid << 32 | end)
                if len(q) > POSITIONS_PER_GRAM:
                    del q[0]

    def _recent_matches(self, tail: tuple[int, ...], k: int) -> list[list[int]]:
        hits = self.grams.get(tail)
        if not hits:
            return []
        out = []
        for hit in reversed(hits):
            rid, end = hit >> 32, hit & 0xFFFFFFFF
            if rid in self.recent:
                out.append(list(self.recent[rid][end:end + k]))
        return out

    # -- look-up ------------------------------------------------------------------------------
    def continuations(self, context: list[int], k: int) -> list[list[int]]:
        """Up to CANDIDATES continuations (each of up to k tokens) of the longest tail n-gram of
        `context` found in the datastore; [] when none is."""
        with self._lock:
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                tail = tuple(context[-n:])
                found = (self._corpus_matches(tail, k) + self._recent_matches(tail, k))[:CANDIDATES]
                if found:
                    return found
        return []
