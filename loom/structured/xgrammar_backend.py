"""The xgrammar backend: JSON Schema, regex, choice, EBNF (GBNF) grammars and structural tags,
compiled to a pushdown automaton whose token masks come from a precomputed per-state cache."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from loom import kernels
from loom.sampling_params import StructuredOutputsParams
from loom.structured.base import GrammarBackend, GrammarMatcher, VocabInfo, register


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(mask, row)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork())

    def jump_forward(self) -> str:
        return "" if self._m.is_terminated() else self._m.find_jump_forward_string()


# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: ": the compiler's words follow
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# and a failed internal check's words, "Check failed: (<C++ condition>) is false: ", before the message
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")


@contextmanager
def _native_stderr(sink: list[str]) -> Iterator[None]:
    """Collects the lines native code writes to file descriptor 2 meanwhile."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            sink.extend(f.read().decode(errors="replace").splitlines())


# keys whose values are JSON data, not schemas: a `required` inside them is no keyword
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _unenforced_required(schema: Any) -> str | None:
    """The first `required` name, at any depth, that is not among its own schema's `properties`.
    xgrammar never enforces one: with additional properties allowed it lets `{}` through, without
    them (its default) it cannot write the key at all, and on a schema without `type` and
    `properties` it accepts any value."""
    if isinstance(schema, list):
        return next((found for item in schema if (found := _unenforced_required(item)) is not None), None)
    if not isinstance(schema, dict):
        return None
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        names = props if isinstance(props, dict) else {}
        missing = next((r for r in required if isinstance(r, str) and r not in names), None)
        if missing is not None:
            return missing
    return next((found for key, value in schema.items() if key not in _DATA_KEYS
                 and (found := _unenforced_required(value)) is not None), None)


# keywords xgrammar compiles without a word and does not enforce (an output that breaks them
# passes its grammar): `uniqueItems: [1, 1]`, `not`, `if`/`then`/`else`, `contains`, the
# dependencies between properties
_IGNORED_KEYWORDS = ("not", "if", "contains", "minContains", "maxContains", "dependentRequired", "dependencies",
                     "dependentSchemas")
# keys whose values map names to schemas (a property called "not" is no keyword)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _unenforced_keyword(schema: Any) -> str | None:
    """The first keyword, at any depth, that xgrammar would compile and not enforce. Among them
    `minProperties` above 1 beside `patternProperties`: the grammar lets one key repeat
    (`{"x": 1, "x": 2}`), which is one property."""
    if isinstance(schema, list):
        return next((found for item in schema if (found := _unenforced_keyword(item)) is not None), None)
    if not isinstance(schema, dict):
        return None
    if schema.get("uniqueItems") is True:
        return "the keyword 'uniqueItems'"
    if (found := next((k for k in _IGNORED_KEYWORDS if k in schema), None)) is not None:
        return f"the keyword {found!r}"
    if "patternProperties" in schema and isinstance(schema.get("minProperties"), int) and schema["minProperties"] > 1:
        return "minProperties above 1 beside patternProperties (a key may repeat)"
    for key, value in schema.items():
        if key in _DATA_KEYS:
            continue
        values = value.values() if key in _SCHEMA_MAPS and isinstance(value, dict) else [value]
        if (found := next((f for v in values if (f := _unenforced_keyword(v)) is not None), None)) is not None:
            return found
    return None


def _schema_value(schema: str | dict) -> Any:
    """The schema as a value (None when its text is no JSON: xgrammar says why when it compiles)."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        return None


def _choice_grammar(choices: tuple[str, ...]) -> str:
    # the characters as they are: an escaped astral one (\ud83d\ude00) reads as two lone surrogates
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@register("xgrammar")
class XGrammarBackend(GrammarBackend):
    def __init__(self, vocab: VocabInfo):
        super().__init__(vocab)
        import xgrammar as xgr   # ~2 s to import: paid by the first constrained request, not at start-up

        self._xgr = xgr
        kind = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK}[vocab.kind]
        info = xgr.TokenizerInfo(list(vocab.tokens), kind, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_token_ids), add_prefix_space=False)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        # one thread: the rows are filled in one C++ loop; with more, xgrammar starts a new thread
        # pool on every call, which costs more than a step's rows take (10-20 us each)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Refuses what xgrammar would compile loosely (it says so only on stderr: `oneOf` read as
        `anyOf`, `multipleOf` on numbers, lengths beside a `pattern`, ...; and, silently, a
        `required` name that is not in `properties` and the keywords of `_unenforced_keyword`):
        a grammar looser than its schema lets invalid output through, claimed complete."""
        if spec.kind == "json":
            value = _schema_value(spec.json)
            if (what := _unenforced_keyword(value)) is not None:
                raise ValueError(f"not enforceable exactly: {what} is not supported")
            if (name := _unenforced_required(value)) is not None:
                raise ValueError(f"not enforceable exactly: required property {name!r} is not in the "
                                 "properties of its schema")
        lines: list[str] = []
        with _native_stderr(lines):
            compiled = self._compile(spec)
        loose = [_SOURCE_PREFIX.sub("", line).removeprefix("Warning: ") for line in lines if "Warning: " in line]
        other = [line for line in lines if "Warning: " not in line]
        if other:
            sys.stderr.write("\n".join(other) + "\n")
        if loose:
            raise ValueError(f"not enforceable exactly: {loose[0]}")
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c, kind, xgr = self._compiler, spec.kind, self._xgr
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return c.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(_choice_grammar(spec.choice))
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            tag = _schema_value(spec.structural_tag)
            if isinstance(tag, dict) and "structures" in tag:
                return c.compile_structural_tag(*self._legacy_tag(tag))
            return c.compile_structural_tag(spec.structural_tag if isinstance(spec.structural_tag, str)
                                            else json.dumps(spec.structural_tag))
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(_CHECK_FAILED.sub("", _SOURCE_PREFIX.sub("", first))) from None

    def _legacy_tag(self, tag: dict) -> tuple[list[Any], list[str]]:
        """The older structural tag form vLLM still takes, {"structures": [{begin, schema, end}],
        "triggers": [...]}, as xgrammar's items and triggers."""
        structures, triggers = tag.get("structures"), tag.get("triggers", [])
        if not isinstance(structures, list) or not all(isinstance(x, dict) and isinstance(x.get("begin"), str)
                                                       and isinstance(x.get("end"), str) for x in structures):
            raise ValueError("structures must be a list of {begin, schema, end} objects")
        if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
            raise ValueError("triggers must be a list of strings")
        items = [self._xgr.StructuralTagItem(begin=x["begin"], schema=json.dumps(x.get("schema", {})), end=x["end"])
                 for x in structures]
        return items, triggers

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_mask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab.vocab_size)

    def fill_masks(self, matchers: list[GrammarMatcher], mask: torch.Tensor, rows: list[int]) -> None:
        """xgrammar's matchers in one call (one C++ loop over the rows)."""
        if all(type(m) is XGrammarMatcher for m in matchers):
            self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], mask, rows)
        else:   # some other GrammarMatcher among them: row by row
            super().fill_masks(matchers, mask, rows)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> list[bool]:
        """loom's kernel where it can (float32 rows; a whole word of forbidden tokens is one
        run of vector stores; it tells which rows admit a token while it reads their words),
        else xgrammar's own; both give the same logits."""
        kern = kernels.load()
        if (kern is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
                and logits.shape[1] == self.vocab.vocab_size):
            return kern.apply_bitmask(logits, mask)      # list of bool, one per row
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab.vocab_size)
        return mask.numpy().any(axis=1).tolist()
