"""Rendering a model's Jinja chat template into a prompt string.

Chat templates ship inside model files and are untrusted code, so they run in Jinja's
immutable sandbox: a template can read the messages it is given and build a string, but cannot
reach Python internals, mutate its inputs or touch the file system.

The environment follows the conventions templates are written against (those of transformers'
``apply_chat_template``), so a template renders here exactly as it does there:

* ``trim_blocks`` and ``lstrip_blocks`` on, and the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``);
* ``tojson`` leaves non-ASCII text and HTML characters unescaped;
* globals ``raise_exception(msg)``, ``strftime_now(fmt)``, ``namespace(...)`` and ``dict(...)``;
* a ``{% generation %}...{% endgeneration %}`` block renders its body unchanged;
* variables ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special
  token strings (``bos_token``, ``eos_token``, ...) and any extra keyword arguments.

Every failure (syntax error, ``raise_exception`` from the template, a sandbox violation)
surfaces as one `TokenizerError` naming the model and the problem.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loom.errors import TokenizerError


class _TemplateRaised(Exception):
    """A template called ``raise_exception``; its message is meant for the user."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}`` marks the assistant's part of a turn; loom needs no mask, so the
    block renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (they lead to Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _make_dict
    return env


class ChatTemplate:
    """A compiled chat template. `model` names the model in error messages; `given_as` names a
    template given in place of the model's instead (``--chat-template``, a request's).

    Compilation happens once, here; a template that does not parse raises `TokenizerError`.
    """

    def __init__(self, source: str, model: str = "model", given_as: str | None = None):
        self.source = source
        self.model = model
        self.origin = given_as or f"model {model!r} chat template"
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            if given_as is not None:
                raise TokenizerError(f"{given_as} does not parse: {e}") from None
            raise TokenizerError(f"model {model!r} has a chat template that does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               special_tokens: Mapping[str, str] | None = None, **variables: Any) -> str:
        """The prompt text for `messages`.

        `special_tokens` maps names like ``bos_token`` to token strings; only names present are
        defined in the template (an absent one is Jinja-undefined and renders empty).
        `variables` (``tools``, ``documents``, ``enable_thinking``, ...) are passed through.
        """
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise TokenizerError("chat messages must be a list of objects with 'role' and 'content'")
        context: dict[str, Any] = dict(special_tokens or {})
        context.update(variables)
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise TokenizerError(f"{self.origin} rejected the messages: {e}") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.origin} failed to render: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TokenizerError(f"{self.origin} failed to render: {type(e).__name__}: {e}") from None
