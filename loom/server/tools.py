"""Tool calling: tools into the prompt, a grammar that forces a call, calls parsed out of the text.

The calls a model makes are one JSON object, whatever the template:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}

* The tools reach the model through its chat template when the template reads a `tools`
  variable; otherwise (SmolLM2's template, for one) a system message lists them as JSON and
  states the format above (loom/loader/chat_messages.py, which `LLM.chat` shares). A model without any chat template (Gemma 3
  270M, a base model) cannot take chat requests at all: the chat endpoint answers 400.
* `tool_choice` "required" or a named function: the output is constrained by a JSON Schema of
  that object (each call's `arguments` by its function's `parameters`), so the call always
  parses; `parallel_tool_calls: false` allows exactly one call.
* "auto": unconstrained; an output that is such an object naming known tools becomes tool
  calls, anything else is the message's content. The object must open the output: `{`, then
  `"tool_calls"` as its first key, then `:` and `[` (JSON whitespace allowed before and between
  them; `call_opening`); text before it or another key first makes the whole output content.
  "none": the tools are not shown.
* Assistant messages with `tool_calls` and `tool` messages in the conversation are written back
  in the same JSON form (and the tool's result as the tool message's content; also
  loom/loader/chat_messages.py).
* Streaming a forced call (`CallStream`): as OpenAI streams calls, each call's id, type and name
  come in one delta as soon as its name is complete, then its arguments' text in fragments as
  the model writes them; the fragments of a call join into its arguments' JSON.
* Streaming under "auto" (`AutoStream`): while the text may still be the start of the calls
  object's opening it is held back (only that: leading whitespace and at most
  `{"tool_calls": [`); once it cannot be, everything so far and then each new piece goes out
  as `content`. Once the opening is complete the choice streams as `CallStream` does, and ends
  with finish_reason `tool_calls` when the final text parses as calls (`ToolPlan.message`).
  When it turns out not to be calls, the client gets the non-streamed answer: the whole text
  as `content` (and the non-streamed finish_reason, `stop` or `length`). A call that names an
  unknown tool, or whose arguments do not start as an object, shows it at once (the text so
  far goes out as content, the rest streams as content); otherwise the end shows it (the whole
  text in the last chunk). Call deltas sent before are then void: finish_reason `tool_calls`
  means the calls, anything else the content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from loom.loader.chat_messages import tool_list

_OPENING = ("{", '"tool_calls"', ":", "[")
_JSON_SPACE = " \t\n\r"

def tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools (validated models) as plain OpenAI-shaped dicts, as `LLM.chat` takes them."""
    return tool_list([t.model_dump(exclude_none=True) for t in tools])


_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})   # values that are JSON data, not schemas


def _moved_refs(schema: Any, prefix: str) -> Any:
    """`schema` with its local references ("#/$defs/Unit", "#") pointing at the same places once
    the schema sits at JSON pointer `prefix` of a larger one."""
    if isinstance(schema, list):
        return [_moved_refs(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + prefix + value[1:]
        else:
            out[key] = value if key in _DATA_KEYS else _moved_refs(value, prefix)
    return out


def call_schema(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON Schema an output must follow to be tool calls (of function `only`, if given).
    Each function's `parameters` become its call's `arguments` (an object whatever they say
    of the type), their local references moved with them."""
    funcs = [f for f in (t["function"] for t in tools) if only is None or f["name"] == only]
    calls = []
    for i, f in enumerate(funcs):
        at = "/properties/tool_calls/items" + (f"/anyOf/{i}" if len(funcs) > 1 else "") + "/properties/arguments"
        arguments = {"type": "object", **_moved_refs(f.get("parameters") or {}, at)}
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": f["name"]}, "arguments": arguments}})
    items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
            "properties": {"tool_calls": array}}


def call_opening(text: str) -> int | None:
    """The length of the calls object's opening `{"tool_calls": [` at the start of `text`
    (JSON whitespace allowed before and between its parts); 0 while the text may still grow
    into it; None when it cannot.

        '  {"tool_c' -> 0     '{ "tool_calls" :[{' -> 17     'Sure, {"tool_calls"' -> None
    """
    i = 0
    for part in _OPENING:
        while i < len(text) and text[i] in _JSON_SPACE:
            i += 1
        have = text[i:i + len(part)]
        if not part.startswith(have):
            return None
        if len(have) < len(part):
            return 0
        i += len(part)
    return i


def parse_calls(text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` an output holds, or None when it is not tool calls."""
    if not call_opening(text):
        return None
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    names = {t["function"]["name"] for t in tools}
    calls = value.get("tool_calls") if isinstance(value, dict) else None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
            return None
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return out


class ToolPlan:
    """What a chat request's `tools` / `tool_choice` / `parallel_tool_calls` ask for."""

    def __init__(self, tools: list[dict[str, Any]], choice: str, named: str | None, parallel: bool):
        self.tools, self.choice, self.named, self.parallel = tools, choice, named, parallel

    @property
    def active(self) -> bool:
        """The tools are shown and the output may be calls."""
        return bool(self.tools) and self.choice != "none"

    def forced_schema(self) -> dict[str, Any] | None:
        if not self.active or self.choice == "auto":
            return None
        return call_schema(self.tools, self.named, self.parallel)

    def message(self, text: str, finish: str | None) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished choice; without parallel calls,
        the first call only (as vLLM filters them: under "auto" no grammar holds the model to one)."""
        if self.active and finish == "stop":
            calls = parse_calls(text, self.tools)
            if calls is not None:
                return None, calls if self.parallel else calls[:1], "tool_calls"
        if self.streams_calls and finish in ("length", "stop"):   # cut mid-call (max_tokens, a stop string
            return None, self.partial_calls(text), finish            # or id): the calls as they streamed
        return text, None, finish

    def partial_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The calls a forced output cut short had begun (their arguments as far as they got),
        joined from the deltas a stream of it sends; None before a name is complete."""
        stream, calls = CallStream(None if self.parallel else 1), {}
        for delta in stream.deltas(text):
            if "id" in delta:
                calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                         "function": {"name": delta["function"]["name"], "arguments": ""}}
            else:
                calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
        return list(calls.values()) or None

    @property
    def streams_calls(self) -> bool:
        """The output is sure to be calls (the grammar forces them): stream them as they come."""
        return self.active and self.choice != "auto"


def scan_calls(text: str) -> list[list]:
    """The calls in the (partial) text of a `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`
    object: [name (None until its string closes), start of the arguments' text (None until it
    begins), its end (None until it closes)] each.

        {"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu
        -> [["f", 43, 51], ["g", None, None]]       (text[43:51] == '{"a": 1}')
    """
    calls: list[list] = []
    depth, in_str, esc, start, key, value_next = 0, False, False, 0, None, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 3:       # a key or a value of a call's object
                    if not value_next:
                        key = json.loads(text[start:i + 1])
                    elif key == "name":
                        calls[-1][0], value_next = json.loads(text[start:i + 1]), False
            continue
        if depth == 3 and value_next and key == "arguments" and calls[-1][1] is None and not ch.isspace():
            calls[-1][1] = i
        if ch == '"':
            in_str, start = True, i
        elif ch in "{[":
            depth += 1
            if depth == 3:
                calls.append([None, None, None])
                key, value_next = None, False
        elif ch in "}]":
            depth -= 1
            if depth == 3 and key == "arguments" and calls[-1][1] is not None and calls[-1][2] is None:
                calls[-1][2], value_next = i + 1, False
        elif depth == 3 and ch in ":,":
            value_next = ch == ":"
    return calls


class CallStream:
    """One streamed choice's tool-call deltas, from its growing text."""

    def __init__(self, limit: int | None = None):
        self.ids: list[str] = []
        self.sent: list[int] = []      # characters of each call's arguments sent
        self.limit = limit             # calls streamed at most (the rest are left out)

    def deltas(self, text: str, scanned: list[list] | None = None) -> list[dict[str, Any]]:
        """The deltas the text adds since the last call: {"index", "id", "type", "function":
        {"name", "arguments": ""}} when a call's name is complete, then {"index", "function":
        {"arguments": fragment}}. `scanned`: `scan_calls(text)`, when the caller has it."""
        out: list[dict[str, Any]] = []
        for i, (name, a0, a1) in enumerate(scan_calls(text) if scanned is None else scanned):
            if name is None or (self.limit is not None and i >= self.limit):
                break
            if i == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if a0 is None:
                continue
            frag = text[a0 + self.sent[i]:len(text) if a1 is None else a1]
            if frag:
                out.append({"index": i, "function": {"arguments": frag}})
                self.sent[i] += len(frag)
        return out


class AutoStream:
    """One streamed choice under tool_choice "auto", from its growing text: the content to send
    and the call deltas (the rules are in the module docstring). `mode`: "held" while the text
    may still open the calls object, then "calls" or "content"."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.names = {t["function"]["name"] for t in plan.tools}
        self.mode = "held"
        self.calls = CallStream(None if plan.parallel else 1)
        self.sent = 0     # characters of the text sent as content

    def step(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content, call deltas, finish_reason) that the text adds since the last step;
        `finish` is the choice's finish_reason once it has ended, else None."""
        scanned = self._decide(text)
        if finish is not None:
            return self._end(text, finish)
        if self.mode == "calls":
            return "", self.calls.deltas(text, scanned), None
        return (self._rest(text) if self.mode == "content" else ""), [], None

    def _decide(self, text: str) -> list[list] | None:
        """Moves on from "held" when the text decides; leaves "calls" for "content" when a call
        names an unknown tool or its arguments are not an object. Returns the scanned calls."""
        if self.mode == "held":
            opened = call_opening(text)
            if opened is None:
                self.mode = "content"
            elif opened:
                self.mode = "calls"
        if self.mode != "calls":
            return None
        try:
            scanned = scan_calls(text)
        except ValueError:       # a key that is no JSON string
            scanned = None
        if scanned is None or any((name is not None and name not in self.names)
                                  or (a0 is not None and text[a0] != "{") for name, a0, _ in scanned):
            self.mode = "content"
        return scanned

    def _end(self, text: str, finish: str) -> tuple[str, list[dict[str, Any]], str | None]:
        """The last step: the remaining call deltas and `tool_calls` when the text is calls,
        else the rest of the text as content and the choice's own finish_reason."""
        calls = self.plan.message(text, finish)[1]
        if calls is not None and self.mode == "calls":
            return "", self.calls.deltas(text), "tool_calls"
        self.mode = "content"
        return self._rest(text), [], finish

    def _rest(self, text: str) -> str:
        piece, self.sent = text[self.sent:], len(text)
        return piece
