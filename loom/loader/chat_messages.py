"""Chat messages in OpenAI's shapes, made into what a chat template reads: the server's chat
requests and `LLM.chat` alike.

* A message is a mapping with a string `role` and a `content` that is a string, a list of text
  parts (``{"type": "text", "text": ...}``, joined by newlines) or None (empty); its `name`
  is kept. Other part types (images, audio) are refused: loom's models read text.
* An assistant message's `tool_calls` (``[{"id", "type": "function", "function": {"name",
  "arguments"}}]``) are written back into its content as the one JSON object loom's tool calls
  are (``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, see loom/server/tools.py),
  unless the template reads `tools`: then the calls (arguments parsed) and a tool message's
  `tool_call_id` go to the template as they are, as vLLM passes them.
* Tools reach the model through its template when the template reads a `tools` variable;
  otherwise a system message lists them as JSON and states that form (`GENERIC_INSTRUCTIONS`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from loom.errors import InvalidRequestError

GENERIC_INSTRUCTIONS = (
    "You can call functions. To call one or more, answer with only a JSON object of the form "
    '{"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]} and nothing else. '
    "The functions:\n")


def template_reads_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the generic tool instructions in the system message (one is added first
    when the conversation has none)."""
    text = GENERIC_INSTRUCTIONS + json.dumps([t["function"] for t in tools], indent=1)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def history_message(role: str, content: str, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """The content an assistant message with `tool_calls` is written back with."""
    if role != "assistant" or not tool_calls:
        return content
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in _native_calls(tool_calls)]
    text = json.dumps({"tool_calls": calls})
    return f"{content}\n{text}" if content else text


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}: content parts must be text parts ({{'type': 'text', 'text': ...}}), "
                                          f"got {kind or type(part).__name__!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(f"{where}: content must be a string, a list of text parts or None, "
                              f"got {type(content).__name__}")


def _native_calls(tool_calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's calls for a template that renders them: OpenAI's shape, each call's
    arguments parsed into a mapping where they are JSON (as vLLM hands them to templates)."""
    out = []
    for c in tool_calls:
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError("an assistant message's tool_calls need a function with a name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):   # not JSON, or nested past the parser's depth: kept as text
                pass
        out.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def message_dict(m: Mapping[str, Any], where: str = "message", native_tools: bool = False) -> dict[str, Any]:
    """One message as the template reads it: {role, content[, name]}. With `native_tools` (a
    template that reads `tools`), an assistant's `tool_calls` and a tool message's
    `tool_call_id` go to the template as they are; otherwise the calls are written into the
    content in loom's form."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise InvalidRequestError(f"{where}: a message is a mapping with a string 'role'")
    content, calls = _content_text(m.get("content"), where), m.get("tool_calls")
    d: dict[str, Any] = {"role": m["role"], "content": content if native_tools else history_message(m["role"], content, calls)}
    if m.get("name") is not None:
        d["name"] = m["name"]
    if native_tools:
        if calls:
            d["tool_calls"] = _native_calls(calls)
        if m.get("tool_call_id") is not None:
            d["tool_call_id"] = m["tool_call_id"]
    return d


def message_dicts(messages: Sequence[Mapping[str, Any]], template: str | None = None) -> list[dict[str, Any]]:
    """The messages for `template` (the one that will render them: tool calls go to a template
    that reads `tools` as they are)."""
    native = template_reads_tools(template)
    return [message_dict(m, f"message {i}", native) for i, m in enumerate(messages)]


def tool_list(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped tools ({"type": "function", "function": {"name", ...}}), checked."""
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools[{i}]: a tool is {{'type': 'function', 'function': {{'name': ..., "
                                      "'description': ..., 'parameters': {...}}}}")
        # `strict` is the API's promise about the arguments, not something to show the model
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None and k != "strict"}})
    return out


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], template: str | None,
               variables: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages that show `tools` to the model: the template's own tool prompt where it has
    one (`variables` gets `tools`), else loom's generic one in the system message."""
    if not tools:
        return messages
    if template_reads_tools(template):
        variables["tools"] = tools
        return messages
    return with_tool_prompt(messages, tools)
