"""OpenAI's Responses API (`POST /v1/responses`) over HTTP against real `loom serve` processes,
driven by the official `openai` client: its answers parse as the client's own types, agree with
the chat completions they are made from, stream as the typed events OpenAI sends, continue
stored conversations, call function tools, and refuse what the server cannot do by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from loom_server import LoomServer
from openai.types.responses import Response

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(server: LoomServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0, timeout=120)


def test_a_response_is_the_chat_answer(real: LoomServer) -> None:
    api = client(real)
    r = api.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                             max_output_tokens=24, temperature=0, metadata={"run": "1"})
    chat = api.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    assert (r.incomplete_details is not None) == (finished == "length")
    assert r.instructions == "Answer briefly." and r.metadata == {"run": "1"} and r.max_output_tokens == 24
    assert api.responses.retrieve(r.id).output_text == r.output_text

    cut = api.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"


def test_streamed_events_build_the_same_response(real: LoomServer) -> None:
    api = client(real)
    kwargs = dict(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    done = api.responses.create(**kwargs)
    events = list(api.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{done.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == done.output_text
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in done.output[0].content[0].logprobs]
    final = events[-1].response
    assert final.output_text == done.output_text and final.usage.output_tokens == done.usage.output_tokens
    assert [len(lp.top_logprobs) for lp in final.output[0].content[0].logprobs] == [2] * done.usage.output_tokens
    assert api.responses.retrieve(final.id).output_text == done.output_text

    raw = httpx.post(f"{real.url}/v1/responses", json={**kwargs, "stream": True}, timeout=60).text
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("event: ") and "\ndata: {" in b for b in blocks), "every event named, no [DONE]"
    assert blocks[0].split("\n")[0] == "event: response.created"


def test_previous_response_id_continues_the_conversation(real: LoomServer) -> None:
    api = client(real)
    first = api.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                 max_output_tokens=8, temperature=0)
    second = api.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    chat = api.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content   # the instructions are not carried over
    assert second.usage.input_tokens == chat.usage.prompt_tokens

    # the items sent back instead (as the Agents SDK does) make the same prompt
    again = api.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, *[o.model_dump() for o in first.output],
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}])
    assert again.output_text == second.output_text

    items = api.responses.input_items.list(again.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"] and not items.has_more
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert items.data[1].id == first.output[0].id and items.data[2].content[0].text == "What is my name?"
    newest = api.responses.input_items.list(again.id, limit=1)
    assert [i.id for i in newest.data] == [items.data[2].id] and newest.has_more
    assert [i.id for i in api.responses.input_items.list(again.id, limit=1, after=newest.data[0].id).data] == \
        [items.data[1].id]
    with pytest.raises(openai.BadRequestError, match="background"):
        api.responses.cancel(again.id)

    unstored = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)


def test_function_calls_and_their_outputs(real: LoomServer) -> None:
    api = client(real)
    asked = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                 max_output_tokens=60, temperature=0)
    r = api.responses.create(**asked)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    assert all(c.name == "get_weather" and "city" in json.loads(c.arguments) and c.id.startswith("fc_")
               for c in calls)

    events = list(api.responses.create(stream=True, **asked))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in calls)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(c.name, c.arguments) for c in calls]
    assert [o.type for o in events[-1].response.output] == ["function_call"] * len(calls)

    named = api.responses.create(**{**asked, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output] == ["get_weather"]

    answer = api.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": "sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > r.usage.input_tokens


def test_text_format_constrains_the_output(real: LoomServer) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}},
              "required": ["color"], "additionalProperties": False}
    r = client(real).responses.create(model=MODEL, input="Pick a color.", max_output_tokens=40, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert r.status == "completed" and json.loads(r.output_text)["color"] in ("red", "green")
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0", "text only"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "message.output_text.logprobs"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "of type 'reasoning'"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id", "not found"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice",
     "not in tools"),
    ({"input": "x", "n": 2}, "n", "does not implement"),
    ({"input": ""}, "input", "at least 1"),
])
def test_what_cannot_be_done_is_refused_by_name(real: LoomServer, body: dict, param: str, says: str) -> None:
    r = httpx.post(f"{real.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_the_servers_token_cap_is_named_as_max_output_tokens(tiny: LoomServer) -> None:
    r = httpx.post(f"{tiny.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 17}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert r.json()["error"]["message"].startswith("max_output_tokens must be <= 16")


def test_a_client_check_without_a_chat_template(strict: LoomServer) -> None:
    """The key is needed, and a model without a chat template says what to use instead."""
    r = httpx.post(f"{strict.url}/v1/responses", json={"input": "Hi"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{strict.url}/v1/responses", json={"input": "Hi"}, timeout=30,
                   headers={"Authorization": f"Bearer {strict.api_key}"})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "input"


def test_responses_parse_as_the_clients_types(real: LoomServer) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "tools": [WEATHER]}
    raw = httpx.post(f"{real.url}/v1/responses", json=body, timeout=60).json()
    # loom counts the prompt tokens its prefix cache served; OpenAI's newer explicit cache writes
    # (cache_write_tokens, required by this client's type) have no counterpart here
    raw["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    assert Response.model_validate(raw).id == raw["id"]
    assert set(raw) >= {"id", "object", "created_at", "status", "output", "usage", "tools", "tool_choice",
                        "parallel_tool_calls", "text", "model"}


def test_the_store_keeps_compact_json_within_its_byte_budget() -> None:
    """Stored responses round-trip exactly (response, conversation, input items) and are held
    as JSON within a byte budget as well as a count: the oldest go first, the newest stays."""
    from loom.server.responses import ResponseStore
    from loom.server.responses_protocol import (IncompleteDetails, InputMessageOut, OutputMessage, OutputText,
                                                ResponseObject)

    def response(i: int, text: str) -> ResponseObject:
        return ResponseObject(id=f"resp_{i}", created_at=1, model="m", status="incomplete", parallel_tool_calls=True,
                              store=True, temperature=1.0, top_p=1.0, tool_choice="auto", tools=[],
                              text={"format": {"type": "text"}}, metadata={},
                              incomplete_details=IncompleteDetails(reason="max_output_tokens"),
                              output=[OutputMessage(id=f"msg_{i}", status="incomplete",
                                                    content=[OutputText(text=text)])])

    items = [InputMessageOut(id="msg_in", role="user", content=[{"type": "input_text", "text": "hi"}])]
    store = ResponseStore(size=10, max_bytes=20_000)
    first = response(0, "a" * 100)
    store.put(first, [{"role": "user", "content": "hi"}], items)
    assert store.get("resp_0") == first and store.conversation("resp_0") == [{"role": "user", "content": "hi"}]
    assert store.input_items("resp_0", None, 10, "asc").data == items
    for i in range(1, 6):   # ~5-6 KB each: the budget holds the newest three
        store.put(response(i, "b" * 5000), [], items)
    assert list(store._entries) == ["resp_3", "resp_4", "resp_5"] and store.bytes <= 20_000
    store.put(response(9, "c" * 50_000), [], items)   # larger than the budget alone: the newest stays
    assert list(store._entries) == ["resp_9"] and store.get("resp_9").output[0].content[0].text == "c" * 50_000
    store.delete("resp_9")
    assert store.bytes == 0
