"""llama-server's native endpoints (`POST /completion`, `GET /props`, llama.cpp's shape of
`/tokenize`) against a real `loom serve` of smollm2-135m: the answer fields llama.cpp's clients
read, a stream that joins to the answer without streaming, stop words and limits, token
probabilities, token-id prompts, response_fields, llama-server's field aliases, and knobs loom
lacks refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import real_model_path
from loom_server import LoomServer

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT = "The capital of France is"
SLOTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = LoomServer("llamacpp", real_model_path("smollm2-135m"),
                   ["--served-model-name", "smollm2-135m", "--threads", "1", "--num-blocks", "128",
                    "--max-num-seqs", str(SLOTS)],
                   tmp_path_factory.mktemp("llamacpp_logs"))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def complete(server: LoomServer, **body) -> dict:
    r = httpx.post(f"{server.url}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: LoomServer, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/completion", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]


def tokenize(server: LoomServer, **body) -> dict:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_completion_with_n_predict_answers_in_llama_servers_fields(server: LoomServer) -> None:
    out = complete(server, prompt=PROMPT, n_predict=6, temperature=0, return_tokens=True)
    assert out["content"].startswith(" Paris")
    assert out["stop"] is True and out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert out["tokens_predicted"] == len(out["tokens"]) == 6
    assert out["tokens_evaluated"] == len(tokenize(server, content=PROMPT, add_special=True)["tokens"])
    assert out["truncated"] is False and out["model"] == "smollm2-135m" and out["prompt"] == PROMPT
    assert out["generation_settings"]["n_predict"] == 6 and out["generation_settings"]["temperature"] == 0
    t = out["timings"]
    assert t["predicted_n"] == 6 and t["prompt_n"] + t["cache_n"] == out["tokens_evaluated"]
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    assert "completion_probabilities" not in out


def test_the_stream_joins_to_the_answer_without_streaming(server: LoomServer) -> None:
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "return_tokens": True}
    whole = complete(server, **body)
    events = stream(server, **body)
    *parts, last = events
    assert parts and all(e["stop"] is False and set(e) >= {"content", "tokens"} for e in parts)
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert [t for e in parts for t in e["tokens"]] == whole["tokens"]
    assert last["stop"] is True and last["content"] == ""
    assert last["stop_type"] == whole["stop_type"] and last["tokens_predicted"] == whole["tokens_predicted"]
    assert "timings" in last and "generation_settings" in last
    settings = last["generation_settings"]
    assert settings["adaptive_target"] == -1 and settings["adaptive_decay"] == 0.9, "llama.cpp's adaptive-p: off"


def test_response_fields_keep_the_fields_they_name(server: LoomServer) -> None:
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "prompt", "no/such"]
    whole = complete(server, prompt=PROMPT, n_predict=5, temperature=0)
    picked = complete(server, prompt=PROMPT, n_predict=5, temperature=0, response_fields=fields)
    assert picked == {"content": whole["content"], "generation_settings/n_predict": 5, "timings/predicted_n": 5,
                      "prompt": PROMPT}, "a path that is not there is left out"
    *parts, last = stream(server, prompt=PROMPT, n_predict=5, temperature=0, response_fields=["stop_type", "tokens"])
    assert last == {"stop_type": "limit", "tokens": []}, "streamed, the last event is picked"
    assert all(e["stop"] is False and "tokens_predicted" in e for e in parts), "the others are whole"


def test_a_stop_word_ends_the_completion_and_is_named(server: LoomServer) -> None:
    free = complete(server, prompt=PROMPT, n_predict=12, temperature=0)["content"]
    word = free.split()[2]   # a word the greedy output reaches after " Paris."
    out = complete(server, prompt=PROMPT, n_predict=12, temperature=0, stop=[word])
    assert out["stop_type"] == "word" and out["stopping_word"] == word
    assert out["content"] == free[:free.index(word)]
    last = stream(server, prompt=PROMPT, n_predict=12, temperature=0, stop=[word])[-1]
    assert last["stop_type"] == "word" and last["stopping_word"] == word


def test_n_probs_gives_completion_probabilities(server: LoomServer) -> None:
    out = complete(server, prompt=PROMPT, n_predict=4, temperature=0, n_probs=3, return_tokens=True)
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    assert "".join(p["token"] for p in probs) == out["content"]
    for p in probs:
        assert bytes(p["bytes"]).decode() == p["token"] and p["logprob"] <= 0
        top = p["top_logprobs"]
        assert len(top) == 3 and set(top[0]) == {"id", "token", "logprob", "bytes"}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == p["id"] and top[0]["logprob"] == p["logprob"]   # greedy: the most probable
    streamed = [p for e in stream(server, prompt=PROMPT, n_predict=4, temperature=0, n_probs=3)
                for p in e.get("completion_probabilities", [])]
    assert streamed == probs


def test_a_token_id_prompt_and_a_mixed_one(server: LoomServer) -> None:
    ids = tokenize(server, content=PROMPT, add_special=True)["tokens"]
    text = complete(server, prompt=PROMPT, n_predict=8, temperature=0)
    by_ids = complete(server, prompt=ids, n_predict=8, temperature=0)
    assert by_ids["content"] == text["content"] and by_ids["tokens_evaluated"] == len(ids)
    head, tail = PROMPT.split(" of ")
    mixed = complete(server, prompt=[*tokenize(server, content=head, add_special=True)["tokens"], " of " + tail],
                     n_predict=8, temperature=0)
    assert mixed["content"] == text["content"]


def test_a_grammar_and_n_predict_zero(server: LoomServer) -> None:
    out = complete(server, prompt="Is Paris in France? Answer:", grammar='root ::= " yes" | " no"', n_predict=8)
    assert out["content"] in (" yes", " no") and out["stop_type"] == "eos"
    scored = complete(server, prompt=PROMPT, n_predict=0)
    assert scored["content"] == "" and scored["tokens_predicted"] == 0 and scored["tokens_evaluated"] > 0


def test_llama_servers_aliases_name_their_fields(server: LoomServer) -> None:
    for alias in ("max_tokens", "max_completion_tokens"):
        out = complete(server, prompt=PROMPT, temperature=0, logprobs=2, **{alias: 3})
        assert out["tokens_predicted"] == 3 and out["generation_settings"]["n_predict"] == 3
        assert [len(p["top_logprobs"]) for p in out["completion_probabilities"]] == [2, 2, 2]
    assert complete(server, prompt=PROMPT, n_predict=2, max_tokens=2)["tokens_predicted"] == 2
    r = httpx.post(f"{server.url}/completion", json={"prompt": PROMPT, "n_predict": 4, "max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], "two values of one field"


def test_props(server: LoomServer) -> None:
    props = httpx.get(f"{server.url}/props", timeout=10).json()
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert props["default_generation_settings"]["n_ctx"] == card["max_model_len"]
    params = props["default_generation_settings"]["params"]
    assert params["n_predict"] == -1 and params["temperature"] == 0.8 and params["top_k"] == 40
    assert props["total_slots"] == SLOTS
    assert props["model_path"].endswith(".gguf") and props["model_alias"] == "smollm2-135m"
    assert "{%" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert (props["bos_token"], props["eos_token"]) == ("<|im_start|>", "<|im_end|>")   # the GGUF's, as llama-server's
    assert props["build_info"].startswith("loom ")


def test_samplers_as_letters_and_other_spellings(server: LoomServer) -> None:
    """`samplers` as llama.cpp takes it: a string of its letters, names in any case, kebab-case or
    undashed; a sampler left out is off (here temperature: greedy, whatever its value)."""
    greedy = complete(server, prompt="The sky is", n_predict=4, temperature=0)["content"]
    for samplers in ("ekmp", ["Top-K", "minp", "nucleus"]):
        answer = complete(server, prompt="The sky is", n_predict=4, temperature=5.0, samplers=samplers, top_k=1)
        assert answer["content"] == greedy, samplers
    taken = complete(server, prompt="The sky is", n_predict=1, samplers="etkmp")
    assert taken["generation_settings"]["samplers"][:2] == ["penalties", "temperature"]


def test_an_alias_beside_its_field_given_as_null(server: LoomServer) -> None:
    """n_predict: null beside max_tokens (or n_probs: null beside logprobs) reads the alias (a 500)."""
    answer = complete(server, prompt="The sky is", n_predict=None, max_tokens=3, temperature=0)
    assert answer["tokens_predicted"] == 3
    answer = complete(server, prompt="The sky is", n_probs=None, logprobs=2, n_predict=2, temperature=0)
    assert len(answer["completion_probabilities"][0]["top_logprobs"]) == 2


def test_apply_template_renders_what_a_chat_request_runs(server: LoomServer) -> None:
    """/apply-template's text is the prompt a chat request with these messages gets: tokenized,
    the ids /tokenize gives for the same messages; its /completion answer is the chat's."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = httpx.post(f"{server.url}/apply-template", json={"messages": messages}, timeout=30)
    assert rendered.status_code == 200, rendered.text
    prompt = rendered.json()["prompt"]
    assert "Be brief." in prompt and prompt.rstrip().endswith("assistant")
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert tokenize(server, content=prompt, add_special=False)["tokens"] == ids
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                                 "temperature": 0}, timeout=60).json()
    assert complete(server, prompt=ids, n_predict=8, temperature=0)["content"] == \
        chat["choices"][0]["message"]["content"]
    bad = httpx.post(f"{server.url}/apply-template", json={"messages": []}, timeout=30)
    assert bad.status_code == 400 and "messages" in bad.text


def test_tokenize_in_both_shapes(server: LoomServer) -> None:
    llama = tokenize(server, content=PROMPT)
    assert set(llama) == {"tokens"} and all(isinstance(t, int) for t in llama["tokens"])
    pieces = tokenize(server, content=PROMPT, with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == llama["tokens"] and "".join(p["piece"] for p in pieces) == PROMPT
    vllm = tokenize(server, prompt=PROMPT, add_special_tokens=False)
    assert vllm["tokens"] == llama["tokens"] and vllm["count"] == len(llama["tokens"])
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": llama["tokens"]}, timeout=30).json()
    assert back == {"prompt": PROMPT, "content": PROMPT}   # vLLM's field and llama-server's


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completion", {"prompt": "x", "typical_p": 0.5}, "typical_p"),
    ("/completion", {"prompt": "x", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "x", "dry_multiplier": 0.8}, "dry_multiplier"),
    ("/completion", {"prompt": "x", "adaptive_target": 0.5}, "adaptive_target"),
    ("/completion", {"prompt": "x", "n_cmpl": 2}, "n_cmpl"),
    ("/completion", {"prompt": "x", "samplers": ["top_k", "top_p", "min_p", "temperature"]}, "samplers"),
    ("/completion", {"prompt": "x", "samplers": "kypmxt"}, "samplers"),   # llama.cpp's default order, as letters
    ("/completion", {"prompt": "x", "repeat_penalty": 1.1, "repeat_last_n": 64}, "repeat_last_n"),
    ("/completion", {"prompt": ["one", "two"]}, "prompt"),
    ("/completion", {"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
])
def test_what_loom_cannot_do_is_refused_by_name(server: LoomServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
