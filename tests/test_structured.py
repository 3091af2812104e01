"""Structured output: grammar-constrained decoding in the engine and through the OpenAI API."""

from __future__ import annotations

from conftest import run_to_end

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from loom_server import LoomServer

from loom import LLM, SamplingParams
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams
from loom.server.tools import AutoStream, CallStream, ToolPlan, call_opening, call_schema, scan_calls

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}


run = run_to_end   # engine, prompts, params -> final outputs in prompt order


# -- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "non-empty list"),
    ({"json": 3}, "JSON Schema"),
    ({"jsonschema": {}}, "unknown structured_outputs key"),
])
def test_bad_constraints_are_refused_naming_the_field(bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(structured_outputs=bad)


def test_constraints_that_do_not_compile_are_refused_at_add_request(make_tiny):
    engine = make_tiny()
    with pytest.raises(InvalidRequestError, match=r"structured_outputs.regex does not compile"):
        engine.add_request("hi", SamplingParams(structured_outputs={"regex": "a(b"}))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs.grammar does not compile"):
        engine.add_request("hi", SamplingParams(structured_outputs={"grammar": "root ::= undefined_rule"}))
    # what xgrammar would compile loosely (an invalid object could come out as complete) is refused too
    for loose, word in (({"type": "number", "multipleOf": 0.5}, "multipleOf"),
                        ({"type": "string", "pattern": "[a-z]+", "minLength": 3}, "minLength"),
                        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
                        # a required name outside `properties`: xgrammar lets `{}` through or cannot write it
                        ({"type": "array", "items": {"host": {"type": "string"}, "required": ["host"]}}, "'host'"),
                        ({"type": "object", "properties": {"a": {"type": "number"}},
                          "anyOf": [{"required": ["a"]}]}, "'a'"),
                        ({"type": "object", "required": ["a"], "additionalProperties": True}, "'a'"),
                        # keywords xgrammar compiles without a word and does not enforce
                        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                        ({"type": "boolean", "not": {"const": True}}, "'not'"),
                        ({"type": "integer", "if": {"minimum": 5}, "then": {"const": 7}}, "'if'"),
                        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains"),
                        ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
                        ({"type": "object", "patternProperties": {"^x$": {"type": "integer"}}, "minProperties": 2},
                          "minProperties")):
        with pytest.raises(InvalidRequestError, match=f"structured_outputs.json does not compile: not enforceable "
                                                      f"exactly: .*{word}"):
            engine.add_request("hi", SamplingParams(structured_outputs={"json": loose}))
    engine.structured.compile(StructuredOutputsParams(json={"oneOf": [{"type": "integer"}, {"type": "string"}]}))
    engine.structured.compile(StructuredOutputsParams(json={   # keywords' names as property names
        "type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}}))
    engine.structured.compile(StructuredOutputsParams(json={   # `required` as a property's name, and in data
        "type": "object", "required": ["required"], "additionalProperties": False,
        "properties": {"required": {"type": "object", "default": {"required": ["x"]}}}}))
    with pytest.raises(InvalidRequestError, match="^structured_outputs cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
    forced = StructuredOutputsParams(json={"type": "object"}, source="tools")   # a forced tool call's grammar
    with pytest.raises(InvalidRequestError, match="^tool_choice cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(min_tokens=2).clone(structured_outputs=forced)
    with pytest.raises(InvalidRequestError, match="^response_format cannot"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True, source="response_format"),
                       ignore_eos=True)
    assert not engine.has_unfinished_requests()


# -- the engine (tiny random model: only the grammar makes its output well-formed) -----------------


def test_regex_and_choice_hold_for_greedy_and_sampled_rows_in_one_batch(make_tiny):
    engine = make_tiny()
    regex = StructuredOutputsParams(regex=r"[ab]{3}-\d{2}")
    choice = StructuredOutputsParams(choice=["left", "right", "straight on"])
    params = [SamplingParams(max_tokens=32, temperature=0, structured_outputs=regex),
              SamplingParams(max_tokens=32, temperature=1.0, seed=7, structured_outputs=regex),
              SamplingParams(max_tokens=32, temperature=0.8, seed=3, structured_outputs=choice),
              SamplingParams(max_tokens=12, temperature=0)]        # unconstrained, same batch
    outs = run(engine, ["one", "two", "three", "four"], params)
    for out in outs[:2]:
        assert re.fullmatch(r"[ab]{3}-\d{2}", out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].text in ("left", "right", "straight on")
    alone = run(make_tiny(), ["four"], [params[3]])[0]
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids   # the masks touch only their rows


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_of_a_constrained_request_are_the_models_own(make_tiny, temperature):
    """As for every other token control (allowed ids, bias, penalties), the logprobs are the
    model's distribution, not the grammar-masked one renormalised (vLLM's raw logprobs)."""
    grammar = StructuredOutputsParams(regex=r"[ab]{3}")
    asked = dict(max_tokens=1, temperature=temperature, seed=5, logprobs=5)
    [plain, constrained] = run(make_tiny(), ["one", "one"], [SamplingParams(**asked),
                                                            SamplingParams(**asked, structured_outputs=grammar)])
    def top(entry) -> dict[int, float]:
        return {t: lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= 5}

    got = constrained.outputs[0].logprobs[0]
    assert top(got) == pytest.approx(top(plain.outputs[0].logprobs[0]), abs=1e-5)
    [chosen] = constrained.outputs[0].token_ids
    assert constrained.outputs[0].text in "ab" and got[chosen].logprob > -1000


def test_choices_outside_the_basic_plane_come_out_whole(make_tiny):
    choices = ["\U0001F600 happy", "\U0001F622 sad"]
    params = [SamplingParams(max_tokens=16, temperature=t, seed=5, structured_outputs={"choice": choices})
              for t in (0, 1.0)]
    for out in run(make_tiny(), ["mood", "mood"], params):
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


def test_n_children_each_follow_the_grammar(make_tiny):
    engine = make_tiny()
    out = run(engine, ["pick"], [SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=11,
                                                structured_outputs={"choice": ["red", "green", "blue"]})])[0]
    assert len(out.outputs) == 4
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in out.outputs)


def test_max_tokens_inside_a_structure_ends_with_length_and_the_partial_text(make_tiny):
    engine = make_tiny()
    out = run(engine, ["x"], [SamplingParams(max_tokens=3, temperature=0,
                                             structured_outputs={"regex": r"\[(a, ){20}a\]"})])[0]
    assert out.outputs[0].finish_reason == "length"
    assert "[a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a]".startswith(out.outputs[0].text)


def test_preemption_with_recompute_keeps_the_grammar_state(make_tiny):
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"regex": r"(ab|ba){10}"})
    roomy = run(make_tiny(), ["p0", "p1", "p2"], [params] * 3)
    tight = make_tiny(num_blocks=14)   # 3 sequences of ~22 tokens in 4-token blocks: someone is preempted
    squeezed = run(tight, ["p0", "p1", "p2"], [params] * 3)
    assert tight.scheduler.stats.num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        assert a.outputs[0].text == b.outputs[0].text
        assert re.fullmatch(r"(ab|ba){10}", a.outputs[0].text)


def _spec_engine(tiny_parts, **spec):
    path, model, tok = tiny_parts
    return Engine(EngineConfig.create(str(path), block_size=4, num_blocks=512, speculative_config=spec or None),
                  model=model, tokenizer=tok)


def test_drafts_for_a_constrained_request_are_verified_against_its_grammar(tiny_parts):
    params = SamplingParams(max_tokens=24, temperature=0, structured_outputs={"regex": r"(xy|yx){6}"})
    prompt = "yxyxyxyxyxyxyxyx"   # prompt lookup proposes continuations the grammar may forbid
    spec = _spec_engine(tiny_parts, method="prompt_lookup", adaptive=False)
    a, b = run(_spec_engine(tiny_parts), [prompt], [params])[0], run(spec, [prompt], [params])[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert re.fullmatch(r"(xy|yx){6}", b.outputs[0].text)
    assert spec.spec.stats.num_draft_tokens > 0


SHORT = {"type": "object", "additionalProperties": False, "required": ["name", "city", "ok"],
         "properties": {"name": {"type": "string", "maxLength": 4}, "city": PERSON["properties"]["city"],
                        "ok": {"type": "boolean"}}}

# "~" has no merges in the tiny vocabulary: each forced "~" is the one token the grammar allows
FORCED = r"(xy|yx){2}~~~~~~~~(ab|ba)~~~~~~~~"


@pytest.mark.parametrize("adaptive", [False, True])
def test_jump_forward_output_is_plain_constrained_output(tiny_parts, adaptive):
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs={"regex": FORCED}),
              SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": SHORT}),
              SamplingParams(max_tokens=12, temperature=0)]          # unconstrained: never drafted for
    prompts = ["hello", "a person:", "one two"]
    plain = run(_spec_engine(tiny_parts), prompts, params)
    jump = _spec_engine(tiny_parts, method="grammar", adaptive=adaptive)
    forced = run(jump, prompts, params)
    for a, b in zip(plain, forced):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    stats = jump.spec.stats
    assert stats.num_accepted_tokens >= 8 and stats.num_drafts < stats.num_accepted_tokens
    assert re.fullmatch(FORCED, forced[0].outputs[0].text)
    assert forced[1].outputs[0].finish_reason == "stop", forced[1].outputs[0].text
    jsonschema.validate(json.loads(forced[1].outputs[0].text), SHORT)


def test_jump_forward_with_sampling_keeps_to_the_grammar(tiny_parts):
    engine = _spec_engine(tiny_parts, method="grammar", adaptive=False)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs={"regex": FORCED})
              for s in range(4)]
    for out in run(engine, ["a", "b", "c", "d"], params):
        assert re.fullmatch(FORCED, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert engine.spec.stats.num_accepted_tokens >= 4 * 8


def test_tree_masks_follow_each_path_and_leave_the_matcher_where_it_was(make_tiny):
    engine = make_tiny()
    tok, so = engine.tokenizer, engine.structured
    a, b, x = (tok.encode(c, add_special_tokens=False)[0] for c in "abx")
    matcher = so.matcher(StructuredOutputsParams(regex="ab"))
    stop = sorted(tok.stop_token_ids)[0]
    # nodes: a (ok), b after a (ok), stop after a-b (completes), x after a (forbidden), b at the root (forbidden)
    tokens, parents = (a, b, stop, x, b), (-1, 0, 1, 0, -1)
    mask = so.backend.allocate_mask(len(tokens) + 1)
    matcher.fill_tree_masks(tokens, parents, mask)
    logits = torch.zeros(len(tokens) + 1, engine.model.cfg.vocab_size)
    so.backend.apply_mask(logits, mask)
    allowed = [set(torch.nonzero(~torch.isneginf(row)).flatten().tolist()) for row in logits]
    assert a in allowed[0] and b not in allowed[0]       # here: "a" starts "ab"
    assert b in allowed[1] and a not in allowed[1]       # after a
    assert allowed[2] <= set(tok.stop_token_ids)         # after a, b: only the end
    assert allowed[3] == allowed[2]                      # after the stop token: its parent's row
    assert allowed[4] == allowed[1] and allowed[5] == allowed[0]   # forbidden nodes: their parent's row
    assert matcher.accept(a) and not matcher.accept(x)   # the position did not move


class _NothingAllowed:
    """A matcher at a position its grammar cannot leave in this vocabulary: an empty mask."""

    def fill_mask(self, mask, row):
        mask[row] = 0


def test_mask_rows_masks_only_constrained_rows_and_names_those_that_admit_nothing(make_tiny):
    engine = make_tiny()
    tok, so = engine.tokenizer, engine.structured
    a = tok.encode("a", add_special_tokens=False)[0]
    matcher = so.matcher(StructuredOutputsParams(regex="a+"))
    logits = torch.zeros(3, engine.model.cfg.vocab_size)
    stuck = so.mask_rows(logits, [None, matcher, _NothingAllowed()])
    assert stuck == [2]
    assert not torch.isneginf(logits[0]).any()                          # unconstrained: untouched
    allowed = set(torch.nonzero(~torch.isneginf(logits[1])).flatten().tolist())
    assert a in allowed and len(allowed) < logits.shape[1]
    assert torch.isneginf(logits[2]).all()
    assert so.mask_rows(logits, [None, None, None]) == []


def test_batched_fill_writes_what_each_matcher_writes_and_the_reused_mask_forgets_the_last_step(make_tiny):
    engine = make_tiny()
    tok, so = engine.tokenizer, engine.structured
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    matchers = [so.matcher(StructuredOutputsParams(regex=r)) for r in ("a+", "b+", "(ab)+", "a+")]
    matchers[2].accept(a)                                     # rows at different positions
    one = so.backend.allocate_mask(4)
    for j, m in enumerate(matchers):
        m.fill_mask(one, j)
    batched = torch.zeros_like(one)
    so.backend.fill_masks(matchers[1:], batched, [1, 2, 3])
    so.backend.fill_masks(matchers[:1], batched, [0])
    assert torch.equal(batched, one)

    # step 1 all four rows constrained, step 2 rows 0 and 2 free: their old masks must not stay
    V = engine.model.cfg.vocab_size
    so.mask_rows(torch.zeros(4, V), matchers)
    logits = torch.zeros(4, V)
    assert so.mask_rows(logits, [None, matchers[1], None, matchers[3]]) == []
    assert not torch.isneginf(logits[0]).any() and not torch.isneginf(logits[2]).any()
    assert torch.isneginf(logits[1, a]) and not torch.isneginf(logits[1, b])
    assert torch.isneginf(logits[3, b]) and not torch.isneginf(logits[3, a])


# -- a real model: JSON that validates ---------------------------------------------------------------


@pytest.mark.real_model
def test_json_schema_outputs_validate_on_smollm2():
    llm = LLM("smollm2-135m")
    prompts = ["Describe a person as JSON:", "A traveller, in JSON:", "Here is a JSON record:"]
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": PERSON}),
              SamplingParams(max_tokens=80, temperature=0.9, seed=5, structured_outputs={"json": PERSON}),
              # greedy: a sampled free-form object from a 135M model often runs past max_tokens
              # (a digit run), and which seed closes its object changes with the kernels' last bits
              SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json_object": True})]
    outs = llm.generate(prompts, params)
    for out in outs[:2]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert outs[2].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[2].outputs[0].text), dict)


FORECAST = {"type": "object", "additionalProperties": False, "required": ["location", "unit", "days"],
           "properties": {"location": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_jump_forward_gives_the_plain_output_on_real_models(real_models, name):
    prompts = ["The weather request for Paris as JSON:", "Forecast query in JSON for Tokyo, 3 days:"]
    params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": FORECAST})] * 2
    plain = run(real_models.engine(name, num_blocks=64), prompts, params)
    engine = real_models.engine(name, num_blocks=64, speculative_config={"method": "grammar", "adaptive": False})
    jump = run(engine, prompts, params)
    for a, b in zip(plain, jump):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(b.outputs[0].text), FORECAST)
    # the keys, `": "`, the enum tails and the closing brace are forced: most of them come as drafts
    assert engine.spec.stats.num_accepted_tokens >= 10


# -- the OpenAI API ------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_response_format_json_schema_and_json_object(real: LoomServer) -> None:
    client = openai.OpenAI(base_url=real.base_url, api_key="none")
    messages = [{"role": "user", "content": "Invent a person and give their name, age and city."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, response_format=fmt,
                                          max_completion_tokens=80, temperature=0)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, response_format=fmt,
                                            max_completion_tokens=80, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    comp = client.completions.create(model="smollm2-135m", prompt="A JSON object:", max_tokens=60, temperature=0.8,
                                     seed=1, extra_body={"response_format": {"type": "json_object"}})
    assert comp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(comp.choices[0].text), dict)


def test_structured_outputs_field_on_both_endpoints(tiny: LoomServer) -> None:
    client = openai.OpenAI(base_url=tiny.base_url, api_key="none")
    comp = client.completions.create(model="tiny-llama", prompt="go", max_tokens=16, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"\d{4}"}})
    assert re.fullmatch(r"\d{4}", comp.choices[0].text)
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "?"}],
                                          max_completion_tokens=16, temperature=0.5, seed=2,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body, param, words", [
    ({"functions": [{"name": "f"}]}, "functions", "unknown field 'functions'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
    ({"typical_p": 0.9}, "typical_p", "unknown field 'typical_p'"),
    ({"logit_bias": {"x1": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "100"),
    ({"frobnicate": True}, "frobnicate", "does not implement it"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "structured_outputs.regex does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "number", "multipleOf": 0.5}}}}, "response_format.json_schema.schema", "does not compile"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_what_loom_cannot_honour_is_a_400_naming_it(tiny: LoomServer, body, param, words) -> None:
    r = httpx.post(f"{tiny.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_fields_that_cannot_change_the_output_are_accepted(tiny: LoomServer) -> None:
    r = httpx.post(f"{tiny.url}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False,
                         "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"}, timeout=30)
    assert r.status_code == 200, r.text


# -- tool calling ---------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather and the time in Paris and in Rome?"}]


def test_call_stream_sends_each_name_once_then_argument_fragments_that_join_to_the_arguments():
    calls = [{"name": "get_weather", "arguments": {"city": "Pa}ris \\\"x\\\"", "days": [1, {"a": {}}]}},
             {"name": "get_time", "arguments": {}}]
    text = json.dumps({"tool_calls": calls})
    stream, deltas = CallStream(), []
    for end in range(len(text) + 1):      # one character at a time, as a token might add
        deltas += stream.deltas(text[:end])
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in heads] == \
        [(0, "get_weather", ""), (1, "get_time", "")]
    assert len({d["id"] for d in heads}) == 2 and all(d["id"].startswith("call_") for d in heads)
    for i, call in enumerate(calls):
        joined = "".join(d["function"]["arguments"] for d in deltas if d["index"] == i and "id" not in d)
        assert json.loads(joined) == call["arguments"]
    assert deltas.index(heads[1]) > max(i for i, d in enumerate(deltas) if d["index"] == 0)   # in order
    assert scan_calls('{"tool_calls": [{"name": "get_w') == [[None, None, None]]   # no name yet, no delta


UNIT = {"type": "function", "function": {
    "name": "set_unit", "parameters": {"type": "object", "additionalProperties": False, "required": ["unit"],
                                       "properties": {"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]}}}}}


def test_a_forced_call_cut_short_is_the_same_streamed_or_not() -> None:
    """max_tokens (or a stop string) inside a forced call: the answer without streaming holds the
    calls begun, with their arguments as far as they got, as the stream's deltas join to."""
    plan = ToolPlan([WEATHER, TIME], "required", None, True)
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, finish = plan.message(text, "length")
    stream = CallStream()
    deltas = stream.deltas(text)
    assert content is None and finish == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", "".join(d["function"]["arguments"] for d in deltas))] == [("get_weather", '{"city": "Par')]
    assert plan.message('{"tool_calls": [{"na', "length") == (None, None, "length")
    # a stop string cuts it the same way: the calls begun, never loom's wrapper as content
    content, calls, finish = plan.message('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"', "stop")
    assert content is None and finish == "stop" and calls[0]["function"]["arguments"] == '{"city": "Paris"'


def test_forced_calls_stream_as_openai_streams_them_on_the_tiny_model(make_tiny) -> None:
    from fastapi.testclient import TestClient

    from loom.engine.async_engine import AsyncEngine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    with TestClient(build_app(InProcessEngineClient(AsyncEngine(make_tiny())), served_model_name="tiny")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "units?"}], tools=[UNIT],
                   tool_choice="required", parallel_tool_calls=False, max_completion_tokens=100, temperature=0)
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
        raw = http.post("/v1/chat/completions", json={**ask, "stream": True}).text
        call = whole.message.tool_calls[0]
        history = ask["messages"] + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]
        back = client.chat.completions.create(**{**ask, "messages": history, "tool_choice": "none",
                                                 "max_completion_tokens": 4})
        prompt = http.post("/tokenize", json={"model": "tiny", "messages": history}).json()["tokens"]
    assert back.choices[0].finish_reason in ("stop", "length") and back.choices[0].message.tool_calls is None
    assert '{"ok": true}' in make_tiny().tokenizer.decode(prompt)        # the tool's result reaches the model
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert whole.finish_reason == "tool_calls" and finish == ["tool_calls"], whole
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "set_unit" and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
    args = "".join(d.function.arguments for d in deltas)
    assert json.loads(args) == json.loads(whole.message.tool_calls[0].function.arguments)
    first = json.loads(next(line[6:] for line in raw.splitlines() if '"tool_calls"' in line))
    assert set(first["choices"][0]["delta"]["tool_calls"][0]) == {"index", "id", "type", "function"}


def _auto_steps(text: str, finish: str) -> tuple[list[str], list[dict], str | None]:
    """AutoStream over `text` growing one character at a time: (content pieces, call deltas, finish)."""
    stream, pieces, deltas, last = AutoStream(ToolPlan([WEATHER, TIME], "auto", None, True)), [], [], None
    for end in range(len(text) + 1):
        content, new, last = stream.step(text[:end], finish if end == len(text) else None)
        pieces += [content] if content else []
        deltas += new
    return pieces, deltas, last


CALLS = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "celsius"}},
                                   {"name": "get_time", "arguments": {"city": "Rome"}}]})


@pytest.mark.parametrize("text, finish, calls_sent", [
    ("Sure: " + CALLS, "stop", False),                     # text first: content from its first character
    ('{"tools": 1}', "stop", False),                        # another key: content once `{"tools"` is seen
    (CALLS.replace("get_time", "get_date"), "stop", True),  # an unknown tool: content from its name on
    (CALLS + " done", "stop", True),                        # text after the object: content at the end
    (CALLS[:60], "length", True),                           # max_tokens cut the calls short
    (CALLS.replace('{"city": "Rome"}', '"Rome"'), "stop", True),   # arguments that are no object
    ("  \n ", "stop", False),                               # only whitespace, held to the end
])
def test_auto_stream_gives_the_non_streamed_content_when_the_text_is_not_calls(text, finish, calls_sent):
    plan = ToolPlan([WEATHER, TIME], "auto", None, True)
    pieces, deltas, last = _auto_steps(text, finish)
    assert plan.message(text, finish) == (text, None, finish)
    assert "".join(pieces) == text and last == finish
    assert bool(deltas) == calls_sent
    if not calls_sent and text.strip():
        assert len(pieces) > 1        # streamed, not held to the end


def test_auto_stream_holds_back_only_what_may_open_the_calls_then_streams_them():
    pieces, deltas, last = _auto_steps(" \n" + CALLS, "stop")
    content, calls, finish = ToolPlan([WEATHER, TIME], "auto", None, True).message(" \n" + CALLS, "stop")
    assert pieces == [] and last == finish == "tool_calls" and content is None
    heads = [d for d in deltas if "id" in d]
    assert [d["function"]["name"] for d in heads] == [c["function"]["name"] for c in calls]
    for i, call in enumerate(calls):
        joined = "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
        assert json.loads(joined) == json.loads(call["function"]["arguments"])
    assert [call_opening(t) for t in ("", " {", '{"tool_calls"', '{ "tool_calls" :[{', 'x{', '{"tool_calls": {')] \
        == [0, 0, 0, 17, None, None]


@pytest.fixture
def tiny_client(make_tiny):
    from fastapi.testclient import TestClient

    from loom.engine.async_engine import AsyncEngine
    from loom.server.in_process import InProcessEngineClient
    from loom.server.openai_api import build_app

    with TestClient(build_app(InProcessEngineClient(AsyncEngine(make_tiny())), served_model_name="tiny")) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def _literal(text: str) -> str:
    """A regex matching exactly `text` (xgrammar's regex takes no escaped space, as re.escape writes)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _auto_pair(client, text: str, **ask) -> tuple[list, list]:
    """The non-streamed and streamed answers of the tiny model under tool_choice auto, its output
    forced to `text` by a regex: (choices, chunk choices)."""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "units?"}], tools=[UNIT], temperature=0,
               max_completion_tokens=100, logprobs=True,
               extra_body={"structured_outputs": {"regex": _literal(text)}}) | ask
    whole = client.chat.completions.create(**ask).choices
    return whole, [c for ch in client.chat.completions.create(**ask, stream=True) for c in ch.choices]


def test_auto_tool_choice_streams_plain_text_as_content_deltas(tiny_client) -> None:
    text = "Kelvin, said the model, is the unit."
    whole, chunks = _auto_pair(tiny_client, text)
    pieces = [c.delta.content for c in chunks if c.delta.content]
    assert whole[0].message.content == text and whole[0].finish_reason == "stop"
    assert len(pieces) > 1 and "".join(pieces) == text
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"
    assert _streamed_tokens(chunks) == [t.token for t in whole[0].logprobs.content]   # logprobs ride along


def _streamed_tokens(chunks: list) -> list[str]:
    return [t.token for c in chunks if c.logprobs for t in c.logprobs.content]


def test_auto_tool_choice_streams_calls_as_deltas_for_each_of_n_choices(tiny_client) -> None:
    text = json.dumps({"tool_calls": [{"name": "set_unit", "arguments": {"unit": "kelvin"}}]})
    whole, chunks = _auto_pair(tiny_client, text, n=2)
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        deltas = [d for c in mine for d in (c.delta.tool_calls or [])]
        assert whole[i].finish_reason == "tool_calls" and whole[i].message.content is None
        assert [c.finish_reason for c in mine if c.finish_reason] == ["tool_calls"]
        assert not any(c.delta.content for c in mine)
        assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
        assert deltas[0].function.name == whole[i].message.tool_calls[0].function.name == "set_unit"
        assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
        args = "".join(d.function.arguments for d in deltas)
        assert json.loads(args) == json.loads(whole[i].message.tool_calls[0].function.arguments)
        assert _streamed_tokens(mine) == [t.token for t in whole[i].logprobs.content]   # logprobs ride along


def test_forced_calls_stream_their_logprobs_and_a_named_function_is_called_once(tiny_client) -> None:
    ask = dict(model="tiny", messages=[{"role": "user", "content": "units?"}], tools=[UNIT], temperature=0,
               tool_choice={"type": "function", "function": {"name": "set_unit"}}, max_completion_tokens=100,
               logprobs=True, top_logprobs=2)
    whole = tiny_client.chat.completions.create(**ask).choices[0]
    chunks = [c for ch in tiny_client.chat.completions.create(**ask, stream=True) for c in ch.choices]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    assert _streamed_tokens(chunks) == [t.token for t in whole.logprobs.content] and whole.logprobs.content


@pytest.mark.parametrize("parallel", [False, True])
def test_auto_tool_choice_without_parallel_calls_gives_the_first_call_only(tiny_client, parallel) -> None:
    text = json.dumps({"tool_calls": [{"name": "set_unit", "arguments": {"unit": "kelvin"}},
                                      {"name": "set_unit", "arguments": {}}]})
    whole, chunks = _auto_pair(tiny_client, text, parallel_tool_calls=parallel)
    calls = whole[0].message.tool_calls
    assert whole[0].finish_reason == "tool_calls" and len(calls) == (2 if parallel else 1)
    assert json.loads(calls[0].function.arguments) == {"unit": "kelvin"}
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert {d.index for d in deltas} == ({0, 1} if parallel else {0})
    assert json.loads("".join(d.function.arguments for d in deltas if d.index == 0)) == {"unit": "kelvin"}


def test_tool_parameters_with_local_references_and_of_other_types(tiny_client) -> None:
    unit = {"$defs": {"U": {"enum": ["c", "k"]}}, "properties": {"u": {"$ref": "#/$defs/U"}}, "required": ["u"]}
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": unit}}]
    ask = dict(model="tiny", messages=[{"role": "user", "content": "units?"}], tools=tools, temperature=0,
               tool_choice="required", parallel_tool_calls=False, max_completion_tokens=100)
    whole = tiny_client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert all(json.loads(c.function.arguments)["u"] in ("c", "k") for c in whole.message.tool_calls)
    two = call_schema(tools + [{"type": "function", "function": {"name": "get_unit", "parameters": unit}}], None, True)
    assert two["properties"]["tool_calls"]["items"]["anyOf"][1]["properties"]["arguments"]["properties"]["u"] == {
        "$ref": "#/properties/tool_calls/items/anyOf/1/properties/arguments/$defs/U"}
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]
    with pytest.raises(openai.BadRequestError, match="type 'object'") as e:
        tiny_client.chat.completions.create(**{**ask, "tools": bad})
    assert "tools" in e.value.body["param"] and "parameters" in e.value.body["param"]


def test_structural_tags_in_both_forms_and_as_a_response_format(tiny_client, make_tiny) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    legacy = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]}
    engine = make_tiny()
    engine.structured.compile(StructuredOutputsParams(structural_tag=legacy))
    with pytest.raises(InvalidRequestError, match="structures must be a list of"):
        engine.add_request("hi", SamplingParams(structured_outputs={"structural_tag": {"structures": [{"begin": 1}]}}))
    with pytest.raises(InvalidRequestError) as e:     # xgrammar's own words, without its C++ check
        engine.add_request("hi", SamplingParams(structured_outputs={"structural_tag": {"type": "structural_tag"}}))
    assert "Check failed" not in str(e.value)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8, temperature=0)
    for fmt in ({"type": "structural_tag", **legacy},
                {"type": "structural_tag", "format": {"type": "const_string", "value": "fixed"}}):
        out = tiny_client.chat.completions.create(**ask, response_format=fmt).choices[0]
        assert out.finish_reason in ("stop", "length")
    assert tiny_client.chat.completions.create(**ask, response_format={
        "type": "structural_tag", "format": {"type": "const_string", "value": "fixed"}}).choices[0].message.content == "fixed"
    with pytest.raises(openai.BadRequestError, match="needs a format"):
        tiny_client.chat.completions.create(**ask, response_format={"type": "structural_tag"})


def test_a_named_tool_choice_allows_one_call_unless_parallel_calls_are_asked_for() -> None:
    from loom.server.openai_api import _tool_plan
    from loom.server.protocol import ChatCompletionRequest

    def plan(**body):
        return _tool_plan(ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME], **body}))

    named = {"type": "function", "function": {"name": "get_time"}}
    assert not plan(tool_choice=named).parallel and plan(tool_choice=named, parallel_tool_calls=True).parallel
    assert plan(tool_choice="required").parallel and not plan(tool_choice="required", parallel_tool_calls=False).parallel
    one = plan(tool_choice=named).forced_schema()
    assert one != plan(tool_choice=named, parallel_tool_calls=True).forced_schema()


@pytest.mark.parametrize("text, max_tokens, finish, calls_sent", [
    ('{"tool_calls": [{"name": "set_units", "arguments": {"unit": "kelvin"}}]}', 100, "stop", False),   # unknown
    ('{"tool_calls": [{"name": "set_unit", "arguments": {"unit": "kelvin"}}]} done', 100, "stop", True),
    ('{"tool_calls": [{"name": "set_unit", "arguments": {"unit": "kelvin"}}]}', -4, "length", True),  # 4 short
])
def test_auto_tool_choice_text_that_opens_calls_but_is_not_calls_streams_as_content(
        tiny_client, text, max_tokens, finish, calls_sent) -> None:
    if max_tokens < 0:   # cut inside the arguments: the whole output's length, less a few tokens
        full = tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "units?"}],
                                                   tools=[UNIT], temperature=0, max_completion_tokens=100,
                                                   extra_body={"structured_outputs": {"regex": _literal(text)}})
        max_tokens += full.usage.completion_tokens
    whole, chunks = _auto_pair(tiny_client, text, max_completion_tokens=max_tokens)
    content = "".join(c.delta.content or "" for c in chunks)
    assert any(c.delta.tool_calls for c in chunks) == calls_sent     # sent before the end showed: void
    assert whole[0].message.tool_calls is None and whole[0].finish_reason == finish
    assert content == whole[0].message.content and text.startswith(content)
    assert [c.finish_reason for c in chunks if c.finish_reason] == [finish]
    assert _streamed_tokens(chunks) == [t.token for t in whole[0].logprobs.content]


@pytest.mark.real_model
def test_required_and_named_tool_choice_always_give_calls_that_validate(real: LoomServer) -> None:
    client = openai.OpenAI(base_url=real.base_url, api_key="none")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice, parallel in (("required", True), ({"type": "function", "function": {"name": "get_time"}}, False)):
        r = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=choice, parallel_tool_calls=parallel,
                                           max_completion_tokens=120, temperature=0)
        c = r.choices[0]
        if parallel and c.finish_reason == "length":   # a 135M model may list calls until max_tokens:
            assert c.message.content is None and c.message.tool_calls   # the calls begun, as they streamed
            assert all(call.function.name in schemas for call in c.message.tool_calls)
            continue
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls and (parallel or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if not isinstance(choice, str):
                assert call.function.name == "get_time"


@pytest.mark.real_model
def test_streamed_tool_calls_arrive_as_deltas_and_results_go_back(real: LoomServer) -> None:
    client = openai.OpenAI(base_url=real.base_url, api_key="none")
    stream = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER], stream=True,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_completion_tokens=120, temperature=0)
    deltas, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and deltas
    first = deltas[0]
    assert first.id and first.function.name == "get_weather"
    args = json.loads("".join(d.function.arguments or "" for d in deltas if d.index == 0))
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": first.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": first.id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="smollm2-135m", messages=history, tools=[WEATHER], tool_choice="none",
                                       max_completion_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    auto = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER],
                                          max_completion_tokens=60, temperature=0)
    c = auto.choices[0]
    assert (c.finish_reason == "tool_calls") == (c.message.tool_calls is not None)
