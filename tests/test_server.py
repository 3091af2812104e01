"""The OpenAI-compatible server, tested over HTTP against real `loom serve` processes.

The official `openai` client drives the happy paths; httpx drives error bodies, overload,
disconnects and metrics; schemathesis fuzzes every operation of /openapi.json. Servers come
from the session `server_pool` (see conftest.py): ``real`` (smollm2-135m), ``tiny`` and
``strict`` (API key, one running and one waiting request, no chat template).
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from loom_server import LoomServer, metric, scrape, wait_for

from loom.server.openai_api import chat_chunk_dict
from loom.server.protocol import ChatCompletionChunk, CompletionStreamResponse
from loom.server.sse import PlainChunks, event

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: LoomServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_completion(real: LoomServer):
    """The greedy 8-token completion of PROMPT on the real model (shared by several tests)."""
    return client(real).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0)


# -- real model: completions, chat, streaming, stop ------------------------------------------------------


def test_completion_and_stream_agree(real: LoomServer, greedy_completion) -> None:
    done = greedy_completion
    assert done.id.startswith("cmpl-") and done.object == "text_completion" and done.model == "smollm2-135m"
    [choice] = done.choices
    assert choice.index == 0 and choice.text.strip() and choice.finish_reason in ("length", "stop")
    assert 1 <= done.usage.completion_tokens <= 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert "Paris" in choice.text

    chunks = list(client(real).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8,
                                                  temperature=0, stream=True))
    assert len(chunks) >= 2, "the answer should arrive in several chunks"
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_and_stream_agree(real: LoomServer) -> None:
    api = client(real)
    done = api.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=8, temperature=0)
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    [choice] = done.choices
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("length", "stop")

    chunks = list(api.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == done.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == done.usage.prompt_tokens


def _model_event(line: str, usage: bool = False) -> str:
    """A streamed chunk's event as the endpoint's chunk model writes it (the generic path)."""
    data = json.loads(line.removeprefix("data: "))
    if data["object"] == "chat.completion.chunk":
        data = chat_chunk_dict(ChatCompletionChunk.model_validate(data))
    else:
        data = CompletionStreamResponse.model_validate(data).model_dump()
    if not usage:
        data.pop("usage")
    return event(data)


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("text", [" Paris", "", 'q"uo\\te\n\t', "é中😀\u2028", "\x00\x1f"])
def test_plain_chunks_are_the_models_events(text: str, usage: bool) -> None:
    fixed = {"created": 7, "model": "smollm2-135m/ü"}
    chat = PlainChunks({"id": "chatcmpl-1", "object": "chat.completion.chunk", **fixed}, "delta", usage).event(2, text)
    assert chat == _model_event(chat.removesuffix("\n\n"), usage)
    data = json.loads(chat.removeprefix("data: "))
    assert data["choices"] == [
        {"index": 2, "delta": {"content": text}, "logprobs": None, "finish_reason": None, "stop_reason": None}]
    assert ("usage" in data) == usage and data.get("usage") is None
    plain = PlainChunks({"id": "cmpl-1", "object": "text_completion", **fixed}, "text", usage).event(0, text)
    assert plain == _model_event(plain.removesuffix("\n\n"), usage)
    assert json.loads(plain.removeprefix("data: "))["choices"][0]["text"] == text


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": QUESTION})])
def test_streamed_events_are_the_models_events(real: LoomServer, path: str, body: dict, usage: bool) -> None:
    """Every event of a plain stream (text only: the template path) has the characters the
    chunk models give it, the first (role) and last (finish, usage) chunks included."""
    if usage:
        body = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{real.url}{path}", timeout=60,
                      json={"model": "smollm2-135m", "max_tokens": 8, "temperature": 0, "stream": True, **body}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 4
    for line in lines[:-1]:
        assert line + "\n\n" == _model_event(line, usage)
    assert ('"usage":{' in lines[-2]) == usage


def test_stop_string_cuts_the_text(real: LoomServer, greedy_completion) -> None:
    text = greedy_completion.choices[0].text
    cut = len(text) // 2
    stop = text[cut:cut + 2]
    assert len(stop) == 2
    done = client(real).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0,
                                           stop=[stop])
    [choice] = done.choices
    assert choice.text == text[:text.find(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


# -- tiny model: n, seeds, logprobs, batches, echo ------------------------------------------------------


def test_n_choices_with_seeds(tiny: LoomServer) -> None:
    api = client(tiny)
    kwargs = dict(model="tiny-llama", prompt="hello world", max_tokens=8, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    two = api.completions.create(n=2, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text, "each seeded choice gets its own seed"
    assert two.usage.completion_tokens == 16
    again = api.completions.create(n=2, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    one = api.completions.create(n=1, **kwargs)
    assert one.choices[0].text == two.choices[0].text, "choice 0 keeps the request seed"


def test_seed_reproducible_in_chat(tiny: LoomServer) -> None:
    api = client(tiny)

    def answer(seed: int) -> str:
        return api.chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=12, temperature=1.0,
                                           seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    assert answer(11) == answer(11)
    assert answer(11) != answer(12)


def test_completion_logprobs_layout(tiny: LoomServer) -> None:
    done = client(tiny).completions.create(model="tiny-llama", prompt="hello world", max_tokens=5, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    offset = 0
    for token, logprob, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert start == offset
        offset += len(token)
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values())), "greedy picks the most probable token"


def test_token_controls_on_both_endpoints(tiny: LoomServer) -> None:
    c = client(tiny)

    def text_of(ids: list[int]) -> str:
        return httpx.post(f"{tiny.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    forced = c.completions.create(model="tiny-llama", prompt="hello world", max_tokens=4, temperature=0,
                                  logit_bias={"42": 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == text_of([42] * 4)
    assert all(lp < -0.5 for lp in forced.choices[0].logprobs.token_logprobs)   # the model's own logprobs
    chat = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=1.5, seed=2,
                                     extra_body={"allowed_token_ids": [42, 43], "ignore_eos": True})
    pieces = "|".join(re.escape(text_of([t])) for t in (42, 43))
    assert re.fullmatch(f"(?:{pieces}){{6}}", chat.choices[0].message.content), chat.choices[0].message.content


def test_chat_template_options_and_prompts_without_special_tokens(tiny: LoomServer) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]

    def tokens(body: dict) -> list[int]:
        r = httpx.post(f"{tiny.url}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    opened = tokens({"messages": chat, "add_generation_prompt": False, "continue_final_message": True})
    closed = tokens({"messages": chat, "add_generation_prompt": False})
    assert closed[:len(opened)] == opened and len(closed) > len(opened)
    done = httpx.post(f"{tiny.url}/v1/chat/completions", timeout=30, json={
        "messages": chat, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
        "temperature": 0, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert done.status_code == 200 and done.json()["usage"]["prompt_tokens"] == len(opened), done.text
    for body, param, words in [({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
                               ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages")]:
        r = httpx.post(f"{tiny.url}/v1/chat/completions", json={"messages": chat, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text
    with_bos = tokens({"prompt": "hello world"})
    without = tokens({"prompt": "hello world", "add_special_tokens": False})
    for flag, want in ((True, with_bos), (False, without)):
        r = httpx.post(f"{tiny.url}/v1/completions", timeout=30, json={
            "prompt": "hello world", "max_tokens": 1, "add_special_tokens": flag})
        assert r.json()["usage"]["prompt_tokens"] == len(want), r.text


def test_truncate_prompt_tokens(tiny: LoomServer) -> None:
    long = "hello " * 1200
    r = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": long, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "context" in r.text
    for k, want in ((3, 3), (-1, None)):
        r = httpx.post(f"{tiny.url}/v1/completions", timeout=30,
                       json={"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": k})
        assert r.status_code == 200, r.text
        if want is not None:
            assert r.json()["usage"]["prompt_tokens"] == want
    scored = {"prompt": "one two three four five six seven", "max_tokens": 0, "echo": True, "logprobs": 0,
              "truncate_prompt_tokens": 3}
    for stream in (False, True):   # the echo is the text of the tokens kept, which the offsets index
        if stream:
            with httpx.stream("POST", f"{tiny.url}/v1/completions", json={**scored, "stream": True}, timeout=30) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
            offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
        else:
            choice = httpx.post(f"{tiny.url}/v1/completions", json=scored, timeout=30).json()["choices"][0]
            text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        assert len(tokens) == 3 and "".join(tokens) == text and "seven".endswith(text), (text, tokens)
        assert [text[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens
    for stream in (False, True):   # -1 leaves max_tokens' room (not a 400); chat counts and returns the ids kept
        body = {"messages": [{"role": "user", "content": long}], "max_tokens": 5, "truncate_prompt_tokens": -1,
                "return_token_ids": True, "stream": stream, "ignore_eos": True}
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            with httpx.stream("POST", f"{tiny.url}/v1/chat/completions", json=body, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            usages = {c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")}
            assert usages == {len(chunks[0]["prompt_token_ids"])} and chunks[-1]["usage"]["completion_tokens"] == 5
        else:
            answer = httpx.post(f"{tiny.url}/v1/chat/completions", json=body, timeout=60).json()
            assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
            assert answer["usage"]["prompt_tokens"] + 5 == httpx.get(f"{tiny.url}/v1/models").json()["data"][0][
                "max_model_len"]
    r = httpx.post(f"{tiny.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"], r.text


def test_tokens_as_token_ids(tiny: LoomServer) -> None:
    body = {"prompt": "hello world", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    named = httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    ided = httpx.post(f"{tiny.url}/v1/completions", json=body | {"return_tokens_as_token_ids": True},
                      timeout=30).json()["choices"][0]
    assert ided["text"] == named["text"]
    assert ided["logprobs"]["text_offset"] == named["logprobs"]["text_offset"]
    assert ided["logprobs"]["token_logprobs"] == named["logprobs"]["token_logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in ided["logprobs"]["tokens"]]
    prompt = httpx.post(f"{tiny.url}/tokenize", json={"prompt": "hello world"}, timeout=30).json()["tokens"]
    assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + 4
    text = httpx.post(f"{tiny.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == named["text"]
    for top in ided["logprobs"]["top_logprobs"][1:]:
        assert all(k.startswith("token_id:") for k in top)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True}
    for stream in (False, True):
        r = httpx.post(f"{tiny.url}/v1/chat/completions", json=chat | {"stream": stream}, timeout=30)
        names = ([e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]] if not stream else
                 [e["token"] for line in r.text.splitlines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"] if c.get("logprobs")
                  for e in c["logprobs"]["content"]])
        assert len(names) == 3 and all(n.startswith("token_id:") for n in names), names


def test_chat_logprobs_layout(tiny: LoomServer) -> None:
    done = client(tiny).chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 4
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stream_logprobs_match_non_stream(tiny: LoomServer) -> None:
    api = client(tiny)
    kwargs = dict(model="tiny-llama", prompt="hello world", max_tokens=6, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = api.completions.create(**kwargs).choices[0].logprobs
    chunks = list(api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(tiny: LoomServer) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries its
    choice's usage so far, and the last chunk the whole request's, on both endpoints."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "tiny-llama", "prompt": "hello world", "max_tokens": 5, "n": 2, "ignore_eos": True,
            "stream": True, "stream_options": options}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    per_choice = [c for c in chunks if c["choices"]]
    assert per_choice and all(c["usage"]["prompt_tokens"] == per_choice[0]["usage"]["prompt_tokens"] > 0
                              for c in per_choice)
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in per_choice if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 5, counts
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True, "stream_options": options}
    with httpx.stream("POST", f"{tiny.url}/v1/chat/completions", json=chat, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["usage"]][-1] == 3
    role = chunks[0]   # the role chunk carries the prompt's usage and nothing generated, as vLLM's
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0
    plain = dict(body, stream_options={"continuous_usage_stats": True})   # without include_usage: no usage
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=plain, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" not in c for c in chunks)


def test_prompt_forms_batches_and_echo(tiny: LoomServer) -> None:
    api = client(tiny)
    batch = api.completions.create(model="tiny-llama", prompt=["one two", "three four"], n=2, max_tokens=3,
                                   temperature=0, echo=True)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert all(c.text.startswith("one two") for c in batch.choices[:2])
    assert all(c.text.startswith("three four") for c in batch.choices[2:])
    ids = [1, 50, 60, 70]
    by_ids = api.completions.create(model="tiny-llama", prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    lists = api.completions.create(model="tiny-llama", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 6
    assert lists.choices[0].text == by_ids.choices[0].text


def test_null_is_an_omitted_field(tiny: LoomServer) -> None:
    """The OpenAI client sends null for an argument given as None: it means the default, and an
    unknown field sent as null asks for nothing."""
    chat = httpx.post(f"{tiny.url}{CHAT}", timeout=30, json={
        "messages": QUESTION, "max_tokens": 2, "n": None, "stream": None, "logprobs": None, "modalities": None,
        "stream_options": None, "tool_choice": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    done = client(tiny).completions.create(model="tiny-llama", prompt="hello", max_tokens=2, n=None, echo=None,
                                           extra_body={"suffix": None})
    assert len(done.choices) == 1 and done.choices[0].text
    bad = httpx.post(f"{tiny.url}{COMPLETIONS}", json={"prompt": None}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_a_scored_prompt_counts_no_completion_tokens(tiny: LoomServer) -> None:
    """max_tokens 0 with echo scores the prompt (lm-eval's loglikelihood): nothing generated is
    returned, so none is counted, streamed or not."""
    body = {"model": "tiny-llama", "prompt": "hello world", "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = httpx.post(f"{tiny.url}{COMPLETIONS}", json=body, timeout=30).json()
    assert whole["choices"][0]["text"] == "hello world" and whole["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", f"{tiny.url}{COMPLETIONS}", timeout=30, json={
            **body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert all(c["usage"]["completion_tokens"] == 0 for c in chunks if c.get("usage"))


def test_echo_offsets_are_places_in_the_returned_text(strict: LoomServer) -> None:
    """With echo and logprobs every text_offset is where its token's text starts in the returned
    text: the BOS the tokenizer adds to a text prompt is not in that text and takes no
    characters, and the continuation starts right after the prompt, streamed or not."""
    wait_for(lambda: _idle(strict), what="an idle server")
    body = {"prompt": "hello world", "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0,
            "ignore_eos": True}
    for stream in (False, True):
        if stream:
            with httpx.stream("POST", f"{strict.url}{COMPLETIONS}", json={**body, "stream": True},
                              headers=strict.headers(), timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
            offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
        else:
            lp = httpx.post(f"{strict.url}{COMPLETIONS}", json=body, headers=strict.headers(),
                            timeout=60).json()["choices"][0]["logprobs"]
            tokens, offsets = lp["tokens"], lp["text_offset"]
        assert tokens[0] == "<s>" and offsets[:2] == [0, 0], (tokens, offsets)
        assert offsets == sorted(offsets) and offsets[-3] == len("hello world"), (tokens, offsets)
    # an empty prompt, as OpenAI and llama-server take it: this model starts with BOS, continued from it alone
    empty = httpx.post(f"{strict.url}{COMPLETIONS}", json={**body, "prompt": ""}, headers=strict.headers(), timeout=60)
    assert empty.status_code == 200 and empty.json()["usage"]["prompt_tokens"] == 1, empty.text


def test_logprobs_of_tokens_inside_a_character_carry_their_own_bytes(real: LoomServer) -> None:
    """Japanese text comes as tokens that split characters: each is named as OpenAI names it
    (bytes:\\x..), its bytes join into the answer's text, the k alternatives of a position keep
    k names, and every text offset is a place in the returned text, streamed or not."""
    prompt = "日本語で自己紹介してください。私の名前は"
    chat = client(real).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Translate to Japanese: I love cats."}],
        max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert any(t.token.startswith("bytes:") for t in content), "the answer should split a character"
    # (the budget may end inside a character: its bytes are then the text's last, replaced, one)
    joined = bytes(b for t in content for b in t.bytes).decode("utf-8", errors="ignore")
    assert joined == chat.choices[0].message.content.rstrip("\ufffd")
    assert all(len(t.top_logprobs) == 2 for t in content)

    kwargs = dict(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, logprobs=5, echo=True)
    done = client(real).completions.create(**kwargs).choices[0]
    lp = done.logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(done.text)
    generated = lp.tokens[-12:]
    assert any(t.startswith("bytes:") for t in generated)
    assert all(len(top) == 5 or (len(top) == 6 and token not in list(top)[:5])
               for token, top in zip(generated, lp.top_logprobs[-12:]))
    assert all(top[token] == pytest.approx(value) for token, top, value in
               zip(generated, lp.top_logprobs[-12:], lp.token_logprobs[-12:]))
    chunks = list(client(real).completions.create(stream=True, **kwargs))
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_streamed_offsets_match_the_whole_answer_when_a_stop_string_holds_text_back(tiny: LoomServer) -> None:
    kwargs = dict(model="tiny-llama", prompt="hello world", max_tokens=8, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    free = client(tiny).completions.create(**kwargs).choices[0].logprobs.tokens
    stop = "".join(free[2:4])   # the third token's text is held back while it may begin the stop string
    whole = client(tiny).completions.create(stop=[stop], **kwargs).choices[0].logprobs
    chunks = list(client(tiny).completions.create(stream=True, stop=[stop], **kwargs))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.text_offset and len(offsets) >= 3


def test_models_health_version_stats(tiny: LoomServer) -> None:
    models = client(tiny).models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert client(tiny).models.retrieve("tiny-llama").id == "tiny-llama"
    assert httpx.get(f"{tiny.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny.url}/version").json()["version"]
    stats = httpx.get(f"{tiny.url}/v1/loom/stats").json()
    assert stats["model"] == "tiny-llama" and stats["max_model_len"] == 512
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage"} <= stats.keys()


def test_playground_page_is_served(tiny: LoomServer) -> None:
    page = httpx.get(f"{tiny.url}/")
    assert page.status_code == 200 and "loom playground" in page.text
    script = httpx.get(f"{tiny.url}/static/playground.js")
    assert script.status_code == 200 and "getReader" in script.text


# -- bad input ---------------------------------------------------------------------------------------

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    # (id, path, raw body, status, param, words in the message)
    ("malformed-json", COMPLETIONS, b'{"prompt": "hi", ', 400, None, "malformed JSON"),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, None, "JSON object"),
    ("beam-search", COMPLETIONS, b'{"prompt": "hi", "use_beam_search": true}', 400, "use_beam_search", "LLM.beam_search"),
    ("guided-backend", COMPLETIONS, b'{"prompt": "hi", "guided_regex": "a", "guided_decoding_backend": "outlines"}',
     400, None, "xgrammar"),
    ("guided-and-structured", COMPLETIONS,
     b'{"prompt": "hi", "guided_regex": "a", "structured_outputs": {"regex": "b"}}', 400, None, "not several"),
    ("nested-too-deep", COMPLETIONS, b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None,
     "nests arrays and objects deeper"),
    ("not-utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "not UTF-8 JSON"),
    ("missing-prompt", COMPLETIONS, b"{}", 400, "prompt", "required"),
    ("string-for-int", COMPLETIONS, b'{"prompt": "hi", "max_tokens": "4"}', 400, "max_tokens", "integer"),
    ("float-for-int", COMPLETIONS, b'{"prompt": "hi", "n": 1.5}', 400, "n", "integer"),
    ("negative-temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": -1}', 400, "temperature", "0"),
    ("zero-top-p", COMPLETIONS, b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "0"),
    ("too-many-logprobs", COMPLETIONS, b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs", "20"),
    ("empty-stop", COMPLETIONS, b'{"prompt": "hi", "stop": [""]}', 400, "stop.0", "at least 1"),
    ("min-tokens-above-max", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "min_tokens": 5}', 400,
     "min_tokens", "max_tokens"),
    ("max-tokens-above-cap", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 17}', 400, "max_tokens", "16"),
    ("empty-prompt", COMPLETIONS, b'{"prompt": ""}', 400, "prompt", "prompt is empty"),
    ("token-out-of-vocab", COMPLETIONS, b'{"prompt": [1, 99999999]}', 400, "prompt", "token ids"),
    ("logit-bias-key", COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"-3": 1}}', 400, "logit_bias", "token ids"),
    ("logit-bias-out-of-vocab", COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"99999999": 1}}', 400,
     "logit_bias", "outside the vocabulary"),
    ("allowed-ids-empty", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": []}', 400,
     "allowed_token_ids", "at least 1"),
    ("bad-words-empty-word", COMPLETIONS, b'{"prompt": "hi", "bad_words": [""]}', 400, "bad_words.0", "at least 1"),
    ("prompt-too-long", COMPLETIONS, json.dumps({"prompt": "hello " * 1200}).encode(), 400, "prompt", "context"),
    ("chat-prompt-too-long", CHAT, json.dumps({"messages": [{"role": "user", "content": "hello " * 1200}]}).encode(),
     400, "messages", "context"),
    ("kv-eviction-budget", COMPLETIONS, b'{"prompt": "hi", "kv_eviction": {"policy": "streaming", "budget": 4}}',
     400, "kv_eviction.budget", "two KV blocks"),
    ("kv-eviction-pool", COMPLETIONS, b'{"prompt": "hi", "kv_eviction": {"policy": "streaming", "budget": 64, "pool": 3}}',
     400, "kv_eviction.pool", "snapkv"),
    ("kv-eviction-with-n", COMPLETIONS, b'{"prompt": "hi", "n": 2, "kv_eviction": {"policy": "streaming", "budget": 64}}',
     400, "kv_eviction", "n > 1"),
    ("stream-options-without-stream", COMPLETIONS, b'{"prompt": "hi", "stream_options": {"include_usage": true}}',
     400, "stream_options", "stream: true"),
    ("unknown-model", COMPLETIONS, b'{"prompt": "hi", "model": "gpt-9"}', 404, "model", "does not exist"),
    ("empty-messages", CHAT, b'{"messages": []}', 400, "messages", "at least 1"),
    ("bad-role", CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role", "user"),
    ("image-part", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     400, "messages.0.content.0", "text only"),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}', 400, "messages",
     "lone surrogate"),
    ("lone-surrogate-tokenize", "/tokenize", b'{"prompt": "x\\ud800y"}', 400, "prompt", "lone surrogate"),
    ("audio-modality", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}',
     400, "modalities.1", "'text'"),
    ("top-logprobs-alone", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs", "logprobs"),
    # past 64 bits or past what a step can afford: refused before the engine (a 500, or a failed step)
    ("token-id-past-64-bits", COMPLETIONS, b'{"prompt": [1, 18446744073709551616]}', 400, "prompt.0", "less than"),
    ("stop-id-past-64-bits", COMPLETIONS, b'{"prompt": "hi", "stop_token_ids": [9223372036854775808]}', 400,
     "stop_token_ids.0", "less than"),
    ("logit-bias-key-of-5000-digits", COMPLETIONS, json.dumps({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}).encode(),
     400, "logit_bias", "token ids"),
    ("template-kwargs-tokenize", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template_kwargs": {"tokenize": false}}', 400, "chat_template_kwargs", "tokenize"),
    ("too-many-bad-words", COMPLETIONS, json.dumps({"prompt": "hi", "bad_words": ["x"] * 257}).encode(), 400,
     "bad_words", "256"),
]


@pytest.mark.parametrize("path, body, status, param, words", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error(tiny: LoomServer, path: str, body: bytes, status: int, param: str | None,
                                        words: str) -> None:
    response = httpx.post(f"{tiny.url}{path}", content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_oversized_body_is_413(tiny: LoomServer) -> None:
    response = httpx.post(f"{tiny.url}{COMPLETIONS}", content=b'{"prompt": "' + b"x" * (3 << 20) + b'"}',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_head_ping_and_the_model_card(tiny: LoomServer) -> None:
    """HEAD on a GET route answers as the GET without a body (uptime probes); /ping is /health
    under vLLM's other name; the model card has vLLM's fields; the log says where it serves."""
    assert f"serving tiny-llama on {tiny.url} (the playground at /" in tiny.log_text()
    for path in ("/health", "/v1/models", "/metrics", "/"):
        head, get = httpx.head(f"{tiny.url}{path}"), httpx.get(f"{tiny.url}{path}")
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{tiny.url}/v1/completions").status_code == 405
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{tiny.url}/ping").json() == httpx.get(f"{tiny.url}/health").json()
    card = httpx.get(f"{tiny.url}/v1/models").json()["data"][0]
    assert card["parent"] is None and card["root"] and card["permission"][0]["object"] == "model_permission"


def test_vllm_request_fields_and_older_names(tiny: LoomServer) -> None:
    """vLLM's request_id names the answer (an X-Request-Id header first), and two requests may
    share one; guided_* are structured_outputs' older names; no-op fields of vLLM and
    llama-server at values that change nothing are accepted."""
    body = {"prompt": "hi", "max_tokens": 2, "request_id": "mine"}
    answers = [httpx.post(f"{tiny.url}{COMPLETIONS}", json=body, timeout=60).json() for _ in range(2)]
    assert [a["id"] for a in answers] == ["cmpl-mine", "cmpl-mine"]
    chat = httpx.post(f"{tiny.url}{CHAT}", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      headers={"X-Request-Id": "from-header"}, timeout=60).json()
    assert chat["id"] == "chatcmpl-from-header"
    choice = httpx.post(f"{tiny.url}{COMPLETIONS}", json={"prompt": "pick", "guided_choice": ["left", "right"],
                                                        "guided_decoding_backend": "xgrammar"}, timeout=60).json()
    assert choice["choices"][0]["text"] in ("left", "right")
    noop = {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "spaces_between_special_tokens": True,
            "cache_prompt": True}
    assert httpx.post(f"{tiny.url}{COMPLETIONS}", json=noop, timeout=60).status_code == 200

    def cached(salt: str) -> int:   # vLLM's cache_salt: cached KV is shared only under the same salt
        body = {"prompt": "salted prompt " * 20, "max_tokens": 1, "cache_salt": salt}
        usage = httpx.post(f"{tiny.url}{COMPLETIONS}", json=body, timeout=60).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    assert [cached("tenant-a"), cached("tenant-b"), cached("tenant-a")][:2] == [0, 0] and cached("tenant-a") > 0


def test_return_token_ids_streamed_or_not(tiny: LoomServer) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's; streamed, the prompt's in the
    first chunk and each chunk's new ids, which join to the answer's."""
    for path, body in ((COMPLETIONS, {"prompt": "count to ten:"}),
                       (CHAT, {"messages": [{"role": "user", "content": "count to ten"}]})):
        body = {**body, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        whole = httpx.post(f"{tiny.url}{path}", json=body, timeout=60).json()
        choice = whole["choices"][0]
        prompt_ids = choice["prompt_token_ids"] if path == COMPLETIONS else whole["prompt_token_ids"]
        assert len(choice["token_ids"]) == 8 and len(prompt_ids) == whole["usage"]["prompt_tokens"]
        with httpx.stream("POST", f"{tiny.url}{path}", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        firsts = [c["choices"][0].get("prompt_token_ids") if path == COMPLETIONS else c.get("prompt_token_ids")
                  for c in chunks]
        assert firsts[0] == prompt_ids and not any(firsts[1:])
        assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == choice["token_ids"]
    plain = httpx.post(f"{tiny.url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 2}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_answers_carry_a_request_id(tiny: LoomServer) -> None:
    raw = client(tiny).completions.with_raw_response.create(model="tiny-llama", prompt="hi", max_tokens=2)
    assert raw.headers["x-request-id"].startswith("req_") and raw.request_id == raw.headers["x-request-id"]
    mine = httpx.get(f"{tiny.url}/v1/nope", headers={"X-Request-Id": "abc-123"})
    assert mine.status_code == 404 and mine.headers["x-request-id"] == "abc-123"
    with httpx.stream("POST", f"{tiny.url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                      timeout=30) as r:
        assert r.headers["x-request-id"].startswith("req_")


def test_unknown_route_and_client_errors(tiny: LoomServer) -> None:
    response = httpx.get(f"{tiny.url}/v1/nope")
    assert response.status_code == 404 and response.json()["error"]["message"].startswith("Invalid URL (GET /v1/nope)")
    assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/embeddings\)"):
        client(tiny).embeddings.create(model="tiny-llama", input="hi")
    for path, body in ((COMPLETIONS, {"prompt": "hello " * 1200}), ("/v1/responses", {"input": "hello " * 1200})):
        error = httpx.post(f"{tiny.url}{path}", json=body, timeout=30).json()["error"]
        assert error["code"] == "context_length_exceeded" and "maximum context length" in error["message"]
        assert error["param"] == ("prompt" if path == COMPLETIONS else "input")
    with pytest.raises(openai.NotFoundError) as e:
        client(tiny).completions.create(model="gpt-9", prompt="hi")
    assert e.value.code == "model_not_found"
    # a max_tokens the request gives past the prompt's room is refused in vLLM's words; unset, it runs to the end
    limit = httpx.get(f"{tiny.url}/v1/models").json()["data"][0]["max_model_len"]
    ids = (httpx.post(f"{tiny.url}/tokenize", json={"prompt": "hello world"}).json()["tokens"] * limit)[:limit - 5]
    room = 5

    def chat_tokens(words: int) -> int:
        messages = [{"role": "user", "content": "hi " * words}]
        return httpx.post(f"{tiny.url}/tokenize", json={"messages": messages}).json()["count"]

    low, high = 1, limit   # the most words whose chat prompt leaves more than 5 tokens of room
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if chat_tokens(mid) < limit - 5 else (low, mid)
    words = low
    for path, body, param in ((COMPLETIONS, {"prompt": ids, "max_tokens": room + 1}, "max_tokens"),
                              (CHAT, {"messages": [{"role": "user", "content": "hi " * words}],
                                      "max_completion_tokens": 10}, "max_tokens"),
                              ("/v1/responses", {"input": "hi " * words, "max_output_tokens": 16},
                               "max_output_tokens")):
        error = httpx.post(f"{tiny.url}{path}", json=body, timeout=30).json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert error["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large")
        assert f"maximum context length is {limit} tokens" in error["message"]
    fits = httpx.post(f"{tiny.url}{COMPLETIONS}", json={"prompt": ids, "max_tokens": room, "ignore_eos": True},
                      timeout=60).json()["choices"][0]
    assert fits["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError):
        client(tiny).completions.create(model="tiny-llama", prompt="hi", temperature=-1)


def test_model_without_chat_template_is_400(strict: LoomServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(strict).chat.completions.create(model="tiny-spm", messages=QUESTION, max_tokens=2)
    assert "no chat template" in e.value.message
    assert e.value.code == "chat_template_error"


def test_api_key_guards_v1_only(strict: LoomServer) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    missing = httpx.post(f"{strict.url}{COMPLETIONS}", json=body)
    wrong = httpx.post(f"{strict.url}{COMPLETIONS}", json=body, headers={"Authorization": "Bearer nope"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{strict.url}/v1/models").status_code == 401
    ok = httpx.post(f"{strict.url}{COMPLETIONS}", json=body, headers=strict.headers(), timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{strict.url}/health").status_code == 200
    assert httpx.get(f"{strict.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client(strict).models.list().data] == ["tiny-spm"]
    # the key is checked before the body is read, on the tokenizer routes too; HEAD and /ping are open
    bad_body = httpx.post(f"{strict.url}{COMPLETIONS}", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert bad_body.status_code == 401 and bad_body.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{strict.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{strict.url}/tokenize", json={"prompt": "hi"}, headers=strict.headers()).status_code == 200
    # llama-server's routes and Anthropic's header for the key
    assert httpx.post(f"{strict.url}/completion", json={"prompt": "hi", "n_predict": 1}).status_code == 401
    assert httpx.get(f"{strict.url}/props").status_code == 401
    assert httpx.post(f"{strict.url}/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}
                      ).status_code == 401
    assert httpx.get(f"{strict.url}/props", headers={"x-api-key": strict.api_key}).status_code == 200
    assert httpx.head(f"{strict.url}/health").status_code == httpx.get(f"{strict.url}/ping").status_code == 200


# -- load, disconnects, metrics ----------------------------------------------------------------------


def _idle(server: LoomServer) -> bool:
    s = scrape(server)
    return (metric(s, "vllm:num_requests_running") == 0 and metric(s, "vllm:num_requests_waiting") == 0
            and metric(s, "vllm:kv_cache_usage_perc") == 0)


def test_full_queue_is_429_and_server_keeps_serving(strict: LoomServer) -> None:
    """With one request running and one waiting (each ~1 s of generation), more are refused
    with 429 while the server keeps answering; the two accepted ones complete."""
    wait_for(lambda: _idle(strict), what="an idle server")
    body = {"prompt": "hello", "max_tokens": 600, "ignore_eos": True}

    async def until(name: str, value: float) -> None:
        for _ in range(200):
            if metric(await asyncio.to_thread(scrape, strict), name) == value:
                return
            await asyncio.sleep(0.02)
        pytest.fail(f"{name} never reached {value}")

    async def scenario():
        async with httpx.AsyncClient(base_url=strict.url, headers=strict.headers(), timeout=120) as http:
            running = asyncio.create_task(http.post(COMPLETIONS, json=body))
            await until("vllm:num_requests_running", 1)
            waiting = asyncio.create_task(http.post(COMPLETIONS, json=body))
            await until("vllm:num_requests_waiting", 1)
            refused = await asyncio.gather(*[http.post(COMPLETIONS, json=body) for _ in range(4)])
            health = await http.get("/health")
            with pytest.raises(openai.RateLimitError) as e:
                await asyncio.to_thread(client(strict).completions.create, model="tiny-spm", prompt="hi",
                                        max_tokens=1)
            assert e.value.code == "queue_full"
            return [await running, await waiting], refused, health

    accepted, refused, health = asyncio.run(scenario())
    assert health.status_code == 200
    for r in refused:
        assert r.status_code == 429
        assert r.headers["Retry-After"].isdigit()
        assert r.json()["error"]["code"] == "queue_full"
    for r in accepted:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 600
    later = client(strict).completions.create(model="tiny-spm", prompt="hello", max_tokens=4)
    assert later.choices[0].finish_reason in ("length", "stop")


def test_a_batch_larger_than_the_waiting_queue_is_a_400(strict: LoomServer) -> None:
    """A batch waits at once: one larger than --max-waiting would get 429 however long the client
    waited, so it is refused as it is, naming the limit."""
    r = httpx.post(f"{strict.url}{COMPLETIONS}", json={"prompt": ["a", "b"], "max_tokens": 1},
                   headers=strict.headers(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "--max-waiting" in r.text


def test_disconnect_mid_stream_frees_blocks(strict: LoomServer) -> None:
    wait_for(lambda: _idle(strict), what="an idle server")
    aborted = metric(scrape(strict), "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=strict.url, headers=strict.headers(), timeout=60) as http:
        with http.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(8)]
            assert any(line.startswith("data: {") for line in received)
            s = scrape(strict)
            assert metric(s, "vllm:num_requests_running") == 1
            assert metric(s, "vllm:kv_cache_usage_perc") > 0
    # leaving the blocks closed the connection mid-stream
    wait_for(lambda: _idle(strict), timeout=10, what="the aborted stream's blocks to be freed")
    assert metric(scrape(strict), "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(strict: LoomServer) -> None:
    wait_for(lambda: _idle(strict), what="an idle server")
    aborted = metric(scrape(strict), "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{strict.url}{COMPLETIONS}", json={"prompt": "hello", "max_tokens": 3000, "ignore_eos": True},
                   headers=strict.headers(), timeout=1.0)
    wait_for(lambda: _idle(strict), timeout=10, what="the abandoned request's blocks to be freed")
    assert metric(scrape(strict), "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_metrics_use_vllm_names(tiny: LoomServer) -> None:
    client(tiny).completions.create(model="tiny-llama", prompt="metrics please", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    s = scrape(tiny)
    label = {"model_name": "tiny-llama"}
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):
        assert metric(s, gauge, **label) >= 0
    for counter in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total"):
        assert metric(s, counter, **label) > 0
    assert metric(s, "vllm:prefix_cache_hits_total", **label) >= 0
    assert metric(s, "vllm:num_preemptions_total", **label) >= 0
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert metric(s, f"{histogram}_count", **label) >= 1
        assert metric(s, f"{histogram}_bucket", le="+Inf", **label) >= 1
    assert metric(s, "vllm:request_success_total", finished_reason="length", **label) >= 1
    assert metric(s, "vllm:inter_token_latency_seconds_sum", **label) > 0
    for histogram in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                      "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                      "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert metric(s, f"{histogram}_count", **label) >= 1, histogram
    assert metric(s, "vllm:request_generation_tokens_bucket", le="5.0", **label) >= 1     # 4 tokens
    assert metric(s, "process_resident_memory_bytes") > 0 and metric(s, "vllm:iteration_tokens_total_count", **label) > 0
    # vLLM's cache settings gauge: the engine process's block count and format, as labels
    assert metric(s, "vllm:cache_config_info", block_size="16", cache_dtype="float16", num_cpu_blocks="0",
                  enable_prefix_caching="True", **label) == 1
    blocks = [k for k in s if k.startswith("vllm:cache_config_info{")][0]
    assert int(blocks.split('num_gpu_blocks="')[1].split('"')[0]) > 0


def test_request_metrics_move_by_what_each_request_did(tiny: LoomServer) -> None:
    """vLLM's per-request series: n, max_tokens and the most tokens a choice generated once per
    prompt; each choice's mean time per output token; a best_of answer's tokens, which arrive
    at once, still give their inter-token gaps; the steps' token histogram counts every step."""
    label = {"model_name": "tiny-llama"}
    names = ("vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
             "vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
             "vllm:iteration_tokens_total")

    def counts() -> dict[str, tuple[float, float]]:
        s = scrape(tiny)
        return {n: (metric(s, f"{n}_count", **label), metric(s, f"{n}_sum", **label)) for n in names}

    before = counts()
    body = {"model": "tiny-llama", "prompt": "count me", "max_tokens": 4, "ignore_eos": True, "n": 2}
    assert httpx.post(f"{tiny.url}{COMPLETIONS}", json=body, timeout=60).status_code == 200
    after = counts()
    delta = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert delta["vllm:request_params_n"] == (1, 2) and delta["vllm:request_params_max_tokens"] == (1, 4)
    assert delta["vllm:request_max_num_generation_tokens"] == (1, 4)
    assert delta["vllm:request_time_per_output_token_seconds"][0] == 2
    assert delta["vllm:inter_token_latency_seconds"][0] == 2 * 3 and delta["vllm:iteration_tokens_total"][0] >= 4
    best = {"model": "tiny-llama", "prompt": "pick me", "max_tokens": 5, "ignore_eos": True, "best_of": 3}
    assert httpx.post(f"{tiny.url}{COMPLETIONS}", json=best, timeout=60).status_code == 200
    itl = counts()["vllm:inter_token_latency_seconds"][0] - after["vllm:inter_token_latency_seconds"][0]
    assert itl == 4


# -- the schema -------------------------------------------------------------------------------------


def test_openapi_documents_every_endpoint(tiny: LoomServer) -> None:
    spec = httpx.get(f"{tiny.url}/openapi.json").json()
    expected = {("/v1/completions", "post"): "CompletionResponse",
                ("/v1/chat/completions", "post"): "ChatCompletionResponse",
                ("/v1/models", "get"): "ModelList", ("/v1/models/{model_id}", "get"): "ModelCard",
                ("/v1/loom/stats", "get"): "StatsResponse", ("/health", "get"): "HealthResponse",
                ("/version", "get"): "VersionResponse"}
    for (path, method), model in expected.items():
        ok = spec["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{model}"}, (path, ok)
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "429"} <= responses.keys() and "422" not in responses
        assert "text/event-stream" in responses["200"]["content"]
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert {"CompletionStreamResponse", "ChatCompletionChunk"} <= spec["components"]["schemas"].keys()


def test_schemathesis_finds_no_server_errors(tiny: LoomServer, tmp_path) -> None:
    """Every operation of /openapi.json with 30 schema-valid and 30 schema-violating requests:
    no 5xx, and every answer matches the documented status codes, content types and schemas
    (streamed events included)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.configuration import set_hypothesis_home_dir
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    set_hypothesis_home_dir(tmp_path)  # hypothesis's caches stay out of the working tree
    schema = schemathesis.openapi.from_url(f"{tiny.url}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures: list[str] = []
    runs = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=30, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                response = case.call(base_url=tiny.url, timeout=60)
                case.validate_response(response, checks=checks)

            try:
                run()
                runs += 1
            except Unsatisfiable:
                assert mode is schemathesis.GenerationMode.NEGATIVE  # an operation with no input to break
            except Exception as e:  # noqa: BLE001 - collect every operation's failure, report together
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {e}")
    set_hypothesis_home_dir(None)
    assert runs >= 11, "every operation once, and the four with inputs also with invalid ones"
    assert not failures, "\n\n".join(failures)


# -- last: the logs ---------------------------------------------------------------------------------


def test_servers_logged_no_tracebacks(server_pool) -> None:
    """Everything above (bad input, overload, disconnects, fuzzing) left no traceback in any log."""
    for server in server_pool.servers.values():
        assert server.process.poll() is None, f"server {server.name} died"
        assert not server.logged_tracebacks(), f"{server.name}:\n{server.logged_tracebacks()[0]}"


def test_tokenizer_endpoints(tiny: LoomServer) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer uses them)."""
    info = httpx.get(f"{tiny.url}/tokenizer_info").json()
    assert info["eos_token"] and info["vocab_size"] > 0 and info["model_max_length"] > 0
    r = httpx.post(f"{tiny.url}/tokenize", json={"prompt": "the cat sat", "add_special_tokens": False,
                                                  "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0
    assert httpx.post(f"{tiny.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "the cat sat",
                                                                                      "content": "the cat sat"}
    chat = httpx.post(f"{tiny.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"] - 3
    # with tools: the prompt a chat request with those tools gets, as its usage counts it
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "what time is it?"}]
    with_tools = httpx.post(f"{tiny.url}/tokenize", json={"messages": messages, "tools": [tool]}).json()
    asked = httpx.post(f"{tiny.url}/v1/chat/completions", json={"messages": messages, "tools": [tool], "max_tokens": 1},
                       timeout=60).json()
    assert with_tools["count"] == asked["usage"]["prompt_tokens"] > chat["count"]
    for body, param in [({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                        ({}, "prompt"), ({"prompt": "a", "model": "other"}, "model"),
                        ({"prompt": "a", "bogus": 1}, "bogus"), ({"messages": []}, "messages"),
                        ({"prompt": "a", "tools": [tool]}, "tools")]:
        resp = httpx.post(f"{tiny.url}/tokenize", json=body)
        assert resp.status_code in (400, 404) and param in resp.text, body
    bad = httpx.post(f"{tiny.url}/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "vocabulary" in bad.text


def test_a_chat_template_given_to_the_server_replaces_the_model_s(tiny_llama_path, tmp_path) -> None:
    """vLLM's --chat-template: a file or the template itself; a bad one is one line before the
    model loads."""
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from loom.cli import _chat_template, app
    from loom.config import EngineConfig
    from loom.engine.async_engine import AsyncEngine
    from loom.engine.engine import Engine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    engine = Engine(EngineConfig.create(str(tiny_llama_path), num_blocks=64, threads=1))
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(engine)),
                              chat_template=_chat_template(str(template)))) as http:
        ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert http.get("/tokenizer_info").json()["chat_template"] == template.read_text()
    assert engine.tokenizer.decode(ids).endswith("user: hi\nassistant:")
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")
    for bad, message in (("{% for %}", "error: --chat-template does not parse"),
                         (str(tmp_path / "missing.jinja"), "no such file"), (str(empty), "the template is empty")):
        result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--chat-template", bad])
        assert result.exit_code == 1 and message in result.stderr, result.stderr
