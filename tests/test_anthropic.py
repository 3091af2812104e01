"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over HTTP against
one real `loom serve` process (smollm2-135m, with an API key), driven by the official
`anthropic` client: its answers agree with the chat completions they are made from, stream as
Anthropic's events, stop on stop sequences and max_tokens, call tools and read their results,
count the prompt as usage does, refuse what the server cannot do in Anthropic's error shape,
take the key as x-api-key, and abort a stream whose client leaves; and the requests of Claude
Code (its beta fields, a system message among the messages, the context-limit errors it parses
to retry) are answered as it expects."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import pytest
from conftest import real_model_path
from loom_server import LoomServer

from loom.server.anthropic import chat_request
from loom.server.anthropic_protocol import MessagesRequest

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "smollm2-135m"
KEY = "sk-ant-loom-test"
GREEDY = {"temperature": 0}   # the SDK's create() no longer takes temperature; the API still does
QUESTION = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = LoomServer("anthropic", real_model_path(MODEL),
                   ["--served-model-name", MODEL, "--threads", "1", "--num-blocks", "256", "--max-num-seqs", "4"],
                   tmp_path_factory.mktemp("anthropic_logs"), api_key=KEY)
    try:
        yield s.wait_ready()
        assert not s.logged_tracebacks(), s.logged_tracebacks()[0]
    finally:
        s.stop()


def client(server: LoomServer, **auth: str | None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, **(auth or {"api_key": KEY}), max_retries=0, timeout=120)


def events(server: LoomServer, body: dict) -> list[tuple[str, dict]]:
    """The raw events of a streamed message: (the `event:` line's name, the data)."""
    raw = httpx.post(f"{server.url}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY},
                     timeout=120).text
    out = []
    for block in filter(None, raw.split("\n\n")):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_a_message_is_the_chat_answer(server: LoomServer) -> None:
    m = client(server).messages.create(model=MODEL, max_tokens=24, messages=QUESTION, system="Answer briefly.",
                                       metadata={"user_id": "u-1"}, extra_body=GREEDY)
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers(), timeout=120, json={
        "model": MODEL, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."}, *QUESTION]}).json()
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    [block] = m.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"] and block.text
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_streamed_text_is_the_message(server: LoomServer) -> None:
    api = client(server)
    kwargs = dict(model=MODEL, max_tokens=20, messages=QUESTION, extra_body=GREEDY)
    done = api.messages.create(**kwargs)
    with api.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == done.content[0].text == final.content[0].text
    assert final.stop_reason == done.stop_reason and final.usage.output_tokens == done.usage.output_tokens
    seen = events(server, {**kwargs.pop("extra_body"), **kwargs})
    names = [name for name, _ in seen]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(name == data["type"] for name, data in seen), "every event named by its type"
    start, delta = seen[0][1]["message"], seen[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] == delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
    assert delta["delta"] == {"stop_reason": done.stop_reason, "stop_sequence": None}
    assert "".join(d["delta"]["text"] for n, d in seen if n == "content_block_delta") == text


def test_stop_sequences_and_max_tokens(server: LoomServer) -> None:
    api = client(server)
    stopped = api.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, stop_sequences=["5"],
                                  extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert stopped.content[0].text.startswith("1, 2") and "5" not in stopped.content[0].text
    with api.messages.stream(model=MODEL, max_tokens=40, messages=QUESTION, stop_sequences=["5"],
                             extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "5")
    assert streamed.content[0].text == stopped.content[0].text
    cut = api.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3 and cut.stop_sequence is None


def test_a_forced_tool_call_and_its_result(server: LoomServer) -> None:
    api = client(server)
    forced = dict(model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body=GREEDY)
    m = api.messages.create(messages=PARIS, **forced)
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str) and m.stop_reason == "tool_use"

    with api.messages.stream(messages=PARIS, **forced) as stream:
        fragments = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and json.loads("".join(fragments)) == call.input
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", call.input)]

    # cut short inside its arguments: the whole answer's input is what the SDK rebuilds from the stream
    trip = {"name": "book_trip", "description": "Book a trip", "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}
    short = dict(forced, tools=[trip], tool_choice={"type": "tool", "name": "book_trip"}, stop_sequences=['"days"'])
    whole = api.messages.create(messages=PARIS, **short)
    with api.messages.stream(messages=PARIS, **short) as stream:
        rebuilt = stream.get_final_message()
    assert whole.stop_reason == rebuilt.stop_reason == "stop_sequence"
    assert whole.content[0].input == rebuilt.content[0].input and set(whole.content[0].input) == {"city"}

    turn = {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                               "input": call.input}]}
    for result in ("Sunny, 24 C", [{"type": "text", "text": "Sunny, 24 C"}]):
        reply = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result},
                                             {"type": "text", "text": "Answer in one sentence."}]}
        answer = api.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER], messages=[*PARIS, turn, reply],
                                     extra_body=GREEDY)
        assert answer.content[0].type == "text" and answer.content[0].text
    failed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "timeout",
                                           "is_error": True}]}
    counted = [api.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=[*PARIS, turn, r]).input_tokens
               for r in (failed, {**failed, "content": [{**failed["content"][0], "is_error": False}]})]
    assert counted[0] > counted[1], "is_error reaches the prompt"


def test_count_tokens_is_the_usage_of_the_same_request(server: LoomServer) -> None:
    api = client(server)
    prompt = dict(model=MODEL, system=[{"type": "text", "text": "You forecast weather.",
                                        "cache_control": {"type": "ephemeral"}}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Is it cold in Oslo today?"}]}],
                  tools=[WEATHER])
    counted = api.messages.count_tokens(**prompt).input_tokens
    m = api.messages.create(max_tokens=2, extra_body=GREEDY, **prompt)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    no_tools = api.messages.count_tokens(**{**prompt, "tool_choice": {"type": "none"}}).input_tokens
    assert no_tools < counted, "tool_choice none shows the model no tools"


def test_thinking_is_the_templates_switch(server: LoomServer) -> None:
    api = client(server)
    m = api.messages.create(model=MODEL, max_tokens=1100, messages=QUESTION, extra_body=GREEDY,
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["text"], "a model that writes no thinking gets no thinking block"
    with pytest.raises(anthropic.BadRequestError) as e:
        api.messages.create(model=MODEL, max_tokens=100, messages=QUESTION,
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert "budget_tokens" in e.value.body["error"]["message"]


def _refused(call, status: int, kind: str, *words: str) -> None:
    with pytest.raises(anthropic.APIStatusError) as e:
        call()
    assert e.value.status_code == status
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert all(w in body["error"]["message"] for w in words), body


def test_refusals_in_anthropics_shape(server: LoomServer) -> None:
    api = client(server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]),
        400, "invalid_request_error", "'image'")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body={"top_a": 1}),
             400, "invalid_request_error", "top_a")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, tools=[
        {"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error", "web_search_20250305")
    _refused(lambda: api.messages.create(model="claude-opus-4-1", max_tokens=5, messages=QUESTION),
             404, "not_found_error", "model: claude-opus-4-1")   # Claude Code's --fallback-model reads "model:"
    raw = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": QUESTION},
                     headers={"x-api-key": KEY}, timeout=30)
    assert raw.status_code == 400 and raw.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}


def test_the_key_as_x_api_key_or_bearer(server: LoomServer) -> None:
    _refused(lambda: client(server, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=QUESTION),
             401, "authentication_error", "x-api-key")
    _refused(lambda: client(server, api_key="wrong").messages.count_tokens(model=MODEL, messages=QUESTION),
             401, "authentication_error")
    assert client(server, auth_token=KEY, api_key=None).messages.create(
        model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens == 2
    # the OpenAI routes take the same header (their 401 keeps OpenAI's shape)
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models").json()["error"]["type"] == "authentication_error"


def test_a_client_that_leaves_aborts_its_stream(server: LoomServer) -> None:
    body = {"model": MODEL, "max_tokens": 2000, "stream": True, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Write a very long story about a loom."}]}
    stats = lambda: httpx.get(f"{server.url}/v1/loom/stats", headers=server.headers()).json()  # noqa: E731
    before = stats()["generation_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = iter(r.iter_lines())
        assert next(lines) == "event: message_start"
        assert sum(line == "event: content_block_delta" for line, _ in zip(lines, range(30))) > 5
    deadline = time.monotonic() + 10
    while stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = stats()
    assert after["num_requests_running"] == 0 and after["generation_tokens"] - before < 200


# The shape of Claude Code's requests (2.1.x, as it sent them to loom): beta query string and
# headers, a billing text block and cache_control with scope and ttl in `system`, metadata.user_id
# as a JSON string, adaptive thinking, a clear_thinking context edit, effort, and a system
# message among the messages (the mid-conversation-system beta).
CLAUDE_CODE_HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "x-app": "cli",
                       "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                         "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
                                         "mid-conversation-system-2026-04-07,effort-2025-11-24"}
CLAUDE_CODE_BODY = {
    "model": MODEL, "max_tokens": 16, "stream": True, "temperature": 0,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
               {"type": "text", "text": "You are a coding agent.",
                "cache_control": {"type": "ephemeral", "scope": "global", "ttl": "1h"}}],
    "messages": [{"role": "user", "content": [
                     {"type": "text", "text": "<system-reminder>Today is Monday.</system-reminder>"},
                     {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
                 {"role": "system", "content": "Available agent types: none."}],
    "tools": [{"name": "Bash", "description": "Runs a shell command",
               "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                                "properties": {"command": {"type": "string"}}, "required": ["command"],
                                "additionalProperties": False}}],
    "metadata": {"user_id": json.dumps({"device_id": "0f16", "account_uuid": "", "session_id": "8a4a"})},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}


def test_claude_codes_request_shape(server: LoomServer) -> None:
    raw = httpx.post(f"{server.url}/v1/messages?beta=true", json=CLAUDE_CODE_BODY, headers=CLAUDE_CODE_HEADERS,
                     timeout=120)
    assert raw.status_code == 200, raw.text
    names = [b.split("\n")[0] for b in filter(None, raw.text.split("\n\n"))]
    assert names[:2] == ["event: message_start", "event: ping"] and names[-1] == "event: message_stop"
    prompt = {k: CLAUDE_CODE_BODY[k] for k in ("model", "system", "messages", "tools", "thinking",
                                               "context_management")}
    count = lambda body: httpx.post(f"{server.url}/v1/messages/count_tokens?beta=true", json=body,  # noqa: E731
                                    headers=CLAUDE_CODE_HEADERS, timeout=30).json()["input_tokens"]
    counted = count(prompt)
    start = json.loads(raw.text.split("\n\n")[0].split("\n")[1][len("data: "):])
    assert start["message"]["usage"]["input_tokens"] == counted
    assert count({**prompt, "messages": prompt["messages"][:1]}) < counted, "the system message reaches the prompt"
    assert count({**prompt, "thinking": {"type": "enabled", "budget_tokens": 1024}}) == counted
    switch = {kind: chat_request(MessagesRequest.model_validate({**CLAUDE_CODE_BODY, "thinking": {"type": kind}}))
              .chat_template_kwargs for kind in ("adaptive", "disabled")}
    assert switch == {"adaptive": {"enable_thinking": True}, "disabled": {"enable_thinking": False}}
    assert count({**prompt, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {
        "type": "thinking_turns", "value": 1}}]}}) == counted


def test_context_limits_in_anthropics_words(server: LoomServer) -> None:
    """Claude Code parses these two messages: it retries with a max_tokens that fits, or compacts."""
    api = client(server)
    context = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"][0]["max_model_len"]
    counted = api.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=context, messages=QUESTION), 400,
             "invalid_request_error", f"input length and `max_tokens` exceed context limit: {counted} + {context} > "
                                      f"{context}, decrease input length or `max_tokens`")
    long = [{"role": "user", "content": "loom " * (context + 100)}]
    with pytest.raises(anthropic.BadRequestError) as e:
        api.messages.create(model=MODEL, max_tokens=5, messages=long)
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {context - 1} maximum", e.value.body["error"]["message"])


def test_output_config_format_is_a_json_schema(server: LoomServer) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    m = client(server).messages.create(model=MODEL, max_tokens=30, messages=PARIS, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "high"}})
    assert json.loads(m.content[0].text)["answer"] in ("yes", "no")


def test_what_claude_code_may_send_that_loom_refuses(server: LoomServer) -> None:
    api = client(server)
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body={
        "output_config": {"effort": "low"}}), 400, "invalid_request_error", "effort", "'low'")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body={
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}), 400, "invalid_request_error",
        "clear_tool_uses_20250919")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=[*QUESTION, {"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]), 400, "invalid_request_error",
        "tool_result blocks cannot be in system messages")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body={
        "thinking": {"type": "sometimes"}}), 400, "invalid_request_error", "thinking")


def test_a_forced_tool_call_with_an_output_format_is_refused_in_this_apis_words(server: LoomServer) -> None:
    """tool_choice any with output_config.format: a 400 naming this API's fields (it named the
    chat route's "required" and response_format)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    _refused(lambda: client(server).messages.create(model=MODEL, max_tokens=5, messages=QUESTION, tools=[WEATHER],
                                                    tool_choice={"type": "any"}, extra_body={
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}), 400, "invalid_request_error",
        "tool_choice 'any' (a forced tool call) cannot be combined with output_config.format")


def test_empty_text_blocks_and_repeated_tool_names_are_refused(server: LoomServer) -> None:
    """As Anthropic's API refuses them (a call to a name two tools share could be either)."""
    api = client(server)
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
        {"type": "text", "text": ""}]}]), 400, "invalid_request_error", "messages")
    _refused(lambda: api.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, tools=[WEATHER, WEATHER]),
             400, "invalid_request_error", "tool names must be unique: 'get_weather'")
