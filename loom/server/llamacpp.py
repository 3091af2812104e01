"""llama-server's native endpoints over the completions path: ``POST /completion``, ``POST /apply-template``,
``GET /props``, and llama.cpp's shape of ``POST /tokenize``.

A ``/completion`` request becomes one engine request, run as ``/v1/completions`` runs one (the
same admission, errors, disconnect handling and server stop): its settings are mapped onto
`SamplingParams` (`repeat_penalty` is loom's repetition penalty, `grammar` and `json_schema`
a structured-output constraint, `n_probs` logprobs), and the engine's outputs are written as
llama-server writes them: ``content``, ``stop_type`` (eos, limit, word), ``stopping_word``,
``tokens_predicted`` / ``tokens_evaluated`` / ``tokens_cached``, ``timings`` and, with
`n_probs`, ``completion_probabilities``. Streamed, each event is ``data: {...}`` with the new
text as ``content`` and ``stop: false``; the last has ``stop: true`` and the summary fields
(no ``[DONE]`` follows, as with llama-server). `response_fields` keeps only the fields it names
in the answer (streamed, in the last event), as llama-server's does.

Rules where loom and llama.cpp differ:

* loom's sampler runs penalties, temperature, top_k, min_p, top_p, in that order (vLLM's);
  `samplers` (names in llama.cpp's spellings, or its letters as one string) is honoured where it
  orders the samplers that are on the same way (a sampler it leaves out is off), and is a 400
  otherwise: llama.cpp's own default order, temperature last, is one while temperature and
  top_p or min_p are on;
* the penalties' window (`repeat_last_n`) is loom's: -1 (the default here) runs
  `repeat_penalty` over the prompt and the output and the presence and frequency penalties
  over the output; 0 turns them off, as in llama.cpp; another window is a 400 while a penalty
  is on;
* llama.cpp's other samplers (typical_p, Mirostat, DRY, XTC, dynamic temperature, top-n-sigma,
  adaptive-p) are accepted only at their off values, and every other knob loom lacks is a 400 naming it;
* one prompt per request: a list of prompts (llama.cpp's batch form) is a 400;
* the context is never shifted: generation stops at its end (`truncated: true`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import loom
from loom.errors import InvalidRequestError, TokenizerError
from loom.loader.registry import REGISTRY, cached_path
from loom.outputs import Logprob, RequestOutput
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.server.choices import ChoiceGroup, fan_out
from loom.server.engine_client import off_loop
from loom.server.errors import ApiError, ClientDisconnected, stream_error
from loom.server.llamacpp_protocol import (
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    LOOM_CHAIN,
    SAMPLER_NAMES,
    DefaultSettings,
    LlamaCompletionRequest,
    LlamaCompletionResponse,
    LlamaTokenizeRequest,
    LlamaTokenizeResponse,
    PropsResponse,
    Timings,
    TokenPiece,
    TokenProb,
    TokenProbs,
    generation_settings,
)
from loom.server.logprobs import finite
from loom.server.sse import event
from loom.server.tools import ToolPlan, tool_dicts

log = logging.getLogger("loom.server")

# llama.cpp samplers loom lacks: (field, the value or test that means off, what it is)
_OFF_KNOBS = (
    ("typical_p", lambda v: v >= 1, "1 (off): loom has no locally typical sampling"),
    ("dynatemp_range", lambda v: v <= 0, "0 (off): loom has no dynamic temperature"),
    ("mirostat", lambda v: v == 0, "0 (off): loom has no Mirostat sampling"),
    ("dry_multiplier", lambda v: v == 0, "0 (off): loom has no DRY penalty"),
    ("xtc_probability", lambda v: v <= 0, "0 (off): loom has no XTC sampling"),
    ("top_n_sigma", lambda v: v <= 0, "-1 (off): loom has no top-n-sigma sampling"),
    ("adaptive_target", lambda v: v < 0, "negative (off): loom has no adaptive-p sampling"),
    ("min_keep", lambda v: v == 0, "0: loom's samplers keep no minimum of tokens"),
    ("n_indent", lambda v: v == 0, "0: loom has no indentation stop"),
    ("t_max_predict_ms", lambda v: v == 0, "0: loom has no time limit on generation"),
    ("id_slot", lambda v: v == -1, "-1: loom has no slots to choose"),
    ("post_sampling_probs", lambda v: not v, "false: n_probs are the model's own logprobs"),
    ("timings_per_token", lambda v: not v, "false: timings come with the last event"),
    ("return_progress", lambda v: not v, "false: loom does not report prompt progress"),
    ("lora", lambda v: not v, "empty: loom serves no LoRA adapters"),
)
# llama.cpp's seeds that ask for a random one: -1, and LLAMA_DEFAULT_SEED (what -1 reads as in uint32)
RANDOM_SEEDS = (-1, 0xFFFFFFFF)
# SamplingParams' names of the fields a /completion request names otherwise
_PARAMS = {"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict", "logprobs": "n_probs"}
_CANONICAL_NAMES = sorted(set(SAMPLER_NAMES.values()))
# pairs of samplers whose order changes the result (`samplers`): the first runs first in loom
_ORDERED = [("penalties", s) for s in ("temperature", "top_k", "min_p", "top_p")] + [
    ("temperature", "min_p"), ("temperature", "top_p"), ("min_p", "top_p"), ("top_k", "top_p")]


def _refuse_off_knobs(body: LlamaCompletionRequest) -> None:
    for name, off, wanted in _OFF_KNOBS:
        if not off(getattr(body, name)):
            raise ApiError(400, f"{name} must be {wanted}, got {getattr(body, name)!r}", param=name,
                           code="unsupported")


def _penalties(body: LlamaCompletionRequest) -> tuple[float, float, float]:
    """(repetition, presence, frequency) penalties under `repeat_last_n` (see the module rules)."""
    given = (body.repeat_penalty, body.presence_penalty, body.frequency_penalty)
    if body.repeat_last_n == 0:
        return 1.0, 0.0, 0.0
    if body.repeat_last_n != -1 and given != (1.0, 0.0, 0.0):
        raise ApiError(400, f"repeat_last_n must be -1 (repeat_penalty over the prompt and the output, presence "
                       f"and frequency penalties over the output) or 0 (penalties off) while a penalty is on: "
                       f"loom's penalties have no window, got {body.repeat_last_n}", param="repeat_last_n",
                       code="unsupported")
    return given


def _active(body: LlamaCompletionRequest, penalties: tuple[float, float, float]) -> dict[str, bool]:
    """Which of loom's samplers change the distribution with the request's values."""
    t = body.temperature
    return {"penalties": penalties != (1.0, 0.0, 0.0), "temperature": t > 0 and t != 1, "top_k": body.top_k > 0,
            "min_p": body.min_p > 0, "top_p": body.top_p < 1}


def _chain(body: LlamaCompletionRequest, active: dict[str, bool]) -> set[str]:
    """The samplers `samplers` leaves out (off), once its order is checked against loom's."""
    names: list[str] = []
    for given in body.samplers:
        name = SAMPLER_NAMES.get(given.lower()) if isinstance(given, str) else None
        if name is None:
            raise ApiError(400, f"samplers: unknown sampler {given!r} (llama.cpp's: {', '.join(_CANONICAL_NAMES)})",
                           param="samplers", code="invalid_value")
        if name in names:
            raise ApiError(400, f"samplers names {given!r} twice: loom runs each sampler once", param="samplers",
                           code="unsupported")
        names.append(name)
    off = {s for s in LOOM_CHAIN if s not in names and s != "penalties"}   # penalties left out: first, as before
    on = [s for s in names if s in active and active[s]]
    if body.temperature <= 0 and "temperature" in names:   # greedy: the order of the others changes nothing
        return off
    for first, then in _ORDERED:
        if first in on and then in on and on.index(first) > on.index(then):
            raise ApiError(400, f"samplers runs {then} before {first}; loom's sampler runs {', '.join(LOOM_CHAIN)} in "
                           f"that order: reorder them, or turn one of the two off", param="samplers",
                           code="unsupported")
    return off


def _logit_bias(value: list[list[Any]] | dict[str, float] | None) -> dict[int, float] | None:
    """llama.cpp's logit_bias ([[id, bias], ...] or {"id": bias}) as {id: bias}; text keys and
    false (a ban) are refused."""
    pairs = list(value.items()) if isinstance(value, dict) else [tuple(p) for p in value or []]
    out: dict[int, float] = {}
    for pair in pairs:
        key, bias = pair if len(pair) == 2 else (None, None)
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:   # 19 digits: int64
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ApiError(400, f"logit_bias entries must be [token id, bias] with a token id (text is not "
                           f"supported), got {list(pair)!r}", param="logit_bias", code="invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(400, f"logit_bias biases must be numbers in [-100, 100] (false is not supported: -100 "
                           f"all but bans a token), got {bias!r}", param="logit_bias", code="invalid_value")
        out[key] = float(bias)
    return out or None


def _constraint(body: LlamaCompletionRequest) -> StructuredOutputsParams | None:
    if body.grammar is not None and body.json_schema is not None:
        raise ApiError(400, "give grammar or json_schema, not both", param="json_schema", code="invalid_value")
    if body.grammar:
        return StructuredOutputsParams(grammar=body.grammar, source="grammar")
    if body.json_schema is not None:
        return StructuredOutputsParams(json=body.json_schema, source="json_schema")
    return None


def sampling_params(body: LlamaCompletionRequest, max_tokens: int | None) -> SamplingParams:
    """The request's SamplingParams (after its llama.cpp-only knobs are checked)."""
    _refuse_off_knobs(body)
    repetition, presence, frequency = _penalties(body)
    off = _chain(body, _active(body, (repetition, presence, frequency)))
    try:
        return SamplingParams(
            temperature=1.0 if "temperature" in off else max(body.temperature, 0.0),
            top_k=0 if "top_k" in off else max(body.top_k, 0),
            top_p=1.0 if "top_p" in off else min(body.top_p, 1.0),
            min_p=0.0 if "min_p" in off else body.min_p,
            repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
            seed=None if body.seed in RANDOM_SEEDS else body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
            max_tokens=max_tokens, logprobs=body.n_probs or None, structured_outputs=_constraint(body),
            logit_bias=_logit_bias(body.logit_bias))
    except InvalidRequestError as e:   # named as this request names it
        message = str(e)
        field = next((f for f in _PARAMS if message.startswith(f)), None)
        if field is not None:
            message = _PARAMS[field] + message[len(field):]
        param = message.split(" ", 1)[0]
        raise ApiError(400, message, param=param if param.isidentifier() else None, code="invalid_value") from None


def _stop_type(out: RequestOutput) -> tuple[str, str]:
    """(stop_type, stopping_word) of a finished output."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        return "limit", ""
    if c.finish_reason == "stop":
        return ("word", c.stop_reason) if isinstance(c.stop_reason, str) else ("eos", "")
    return "none", ""


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second); 0 where nothing was timed."""
    return (ms / n if n else 0.0), (n * 1e3 / ms if ms > 0 else 0.0)


def timings(out: RequestOutput, predicted: int) -> Timings:
    """The prompt phase runs from the request's first scheduling to its first token, the
    generation from there to its last token."""
    m, cached = out.metrics, out.num_cached_tokens
    prompt_ms = predicted_ms = 0.0
    if m is not None and m.first_token_time is not None:
        prompt_ms = (m.first_token_time - (m.first_scheduled_time or m.arrival_time)) * 1e3
        predicted_ms = ((m.last_token_time or m.first_token_time) - m.first_token_time) * 1e3
    prompt_n = len(out.prompt_token_ids) - cached
    (p_tok, p_sec), (g_tok, g_sec) = _rate(prompt_n, prompt_ms), _rate(predicted, predicted_ms)
    return Timings(cache_n=cached, prompt_n=prompt_n, prompt_ms=prompt_ms, prompt_per_token_ms=p_tok,
                   prompt_per_second=p_sec, predicted_n=predicted, predicted_ms=predicted_ms,
                   predicted_per_token_ms=g_tok, predicted_per_second=g_sec)


class LlamaCppServing:
    """Answers llama-server's endpoints through `serving` (an `OpenAIServing`)."""

    def __init__(self, serving):
        self.serving = serving
        self.ae = serving.ae

    async def apply_template(self, body: ApplyTemplateRequest) -> ApplyTemplateResponse:
        self.serving.check_model(body.model)
        plan = ToolPlan(tool_dicts(body.tools or []), "auto", None, True)
        return ApplyTemplateResponse(**await self.serving._chat_prompt(body, plan, tokenize=False))

    # -- /completion ------------------------------------------------------------------------------
    async def completion(self, body: LlamaCompletionRequest, request: Request):
        s = self.serving
        s.check_model(body.model)
        score_only = body.n_predict == 0   # the prompt is evaluated; the one token generated is not returned
        explicit = body.n_predict > 0
        max_tokens = s.max_tokens(1 if score_only else (body.n_predict if explicit else None), "n_predict", explicit)
        params = sampling_params(body, max_tokens)
        prompt = await self._prompt(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = fan_out(self.ae, [prompt], params, 1, rid, 0, s.metrics.tracker)
        if body.stream:
            return await s.open_stream(group, request, self._events(group, body, score_only))
        [out] = await s.collect(group, request)
        answer = self._final(out, body, score_only, streamed=False)
        return JSONResponse(pick_fields(body.response_fields, _dump(answer))) if body.response_fields else answer

    async def _prompt(self, prompt: str | list) -> str | list[int]:
        """One prompt: text as is (the engine tokenizes it), token ids, or both mixed (each text
        part tokenized here, with the model's BOS only where the first part is text)."""
        if isinstance(prompt, str):
            return prompt
        if any(isinstance(p, list) for p in prompt) or (prompt and all(isinstance(p, str) for p in prompt)):
            raise ApiError(400, "prompt is a list of prompts (strings only, or lists): loom's /completion takes one "
                           "prompt (a string, token ids, or both mixed); send one request per prompt",
                           param="prompt", code="unsupported")
        ids: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, int):
                ids.append(part)
                continue
            try:
                ids += await off_loop(len(part), self.ae.tokenizer.encode, part, add_special_tokens=i == 0)
            except TokenizerError as e:
                raise ApiError(400, str(e), param="prompt", code="invalid_value") from None
        return ids

    def _probs(self, out: RequestOutput, start: int, k: int) -> list[TokenProbs] | None:
        """completion_probabilities of the output's tokens from `start` on (None without n_probs)."""
        c = out.outputs[0]
        if not k or c.logprobs is None:
            return None
        return [self._token_probs(t, entry, k) for t, entry in zip(c.token_ids[start:], c.logprobs[start:])]

    def _token_probs(self, token_id: int, entry: dict[int, Logprob], k: int) -> TokenProbs:
        spelling = self.serving.spelling
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda p: p[1].rank)[:k]
        top = [TokenProb(id=t, token=spelling.bytes_of(t).decode("utf-8", "replace"), logprob=finite(lp.logprob),
                         bytes=list(spelling.bytes_of(t))) for t, lp in ranked]
        chosen = entry.get(token_id)
        raw = spelling.bytes_of(token_id)
        return TokenProbs(id=token_id, token=raw.decode("utf-8", "replace"), bytes=list(raw), top_logprobs=top,
                          logprob=finite(chosen.logprob) if chosen is not None else -9999.0)

    def _final(self, out: RequestOutput, body: LlamaCompletionRequest, score_only: bool,
               streamed: bool) -> LlamaCompletionResponse:
        """The answer (or, streamed, the last event: no text, the summary)."""
        c = out.outputs[0]
        ids: Sequence[int] = [] if score_only else c.token_ids
        text = "" if score_only else c.text
        stop_type, word = ("limit", "") if score_only else _stop_type(out)
        prompt_n = len(out.prompt_token_ids)
        return LlamaCompletionResponse(
            content="" if streamed else text, tokens=list(ids) if body.return_tokens and not streamed else [],
            stop=True, model=self.serving.model, tokens_predicted=len(ids), tokens_evaluated=prompt_n,
            generation_settings=generation_settings(body),
            prompt=out.prompt if out.prompt is not None else self.ae.tokenizer.decode(out.prompt_token_ids),
            has_new_line="\n" in text, stop_type=stop_type, stopping_word=word,
            truncated=stop_type == "limit" and prompt_n + len(ids) >= self.ae.max_model_len,
            tokens_cached=out.num_cached_tokens, timings=timings(out, len(ids)),
            completion_probabilities=None if streamed or score_only else self._probs(out, 0, body.n_probs))

    async def _events(self, group: ChoiceGroup, body: LlamaCompletionRequest, score_only: bool) -> AsyncIterator[str]:
        """The stream: an event per output that adds tokens, then the summary event."""
        sent = 0
        try:
            async for _, out in group:
                c = out.outputs[0]
                if not score_only and (c.delta_text or len(c.token_ids) > sent):
                    chunk = LlamaCompletionResponse(content=c.delta_text, tokens=list(c.token_ids[sent:]), stop=False,
                                                    tokens_predicted=len(c.token_ids),
                                                    tokens_evaluated=len(out.prompt_token_ids),
                                                    completion_probabilities=self._probs(out, sent, body.n_probs))
                    sent = len(c.token_ids)
                    yield event(chunk.model_dump(exclude_none=True))
                if out.finished:
                    last = _dump(self._final(out, body, score_only, streamed=True))
                    yield event(pick_fields(body.response_fields, last) if body.response_fields else last)
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield event({"error": stream_error(e)})
        finally:
            group.close()

    # -- /props ------------------------------------------------------------------------------
    def props(self) -> PropsResponse:
        params = generation_settings(LlamaCompletionRequest(prompt=""))
        return PropsResponse(
            default_generation_settings=DefaultSettings(n_ctx=self.ae.max_model_len, params=params),
            total_slots=self.ae.max_num_seqs, model_path=str(model_path(self.ae.model_name)),
            model_alias=self.serving.model, chat_template=self.ae.tokenizer.chat_template or "",
            modalities={"vision": False, "video": False, "audio": False}, bos_token=self.ae.tokenizer.bos_token or "",
            eos_token=self.ae.tokenizer.eos_token or "", build_info=f"loom {loom.__version__}")


def _dump(answer: LlamaCompletionResponse) -> dict[str, Any]:
    """An answer as the route writes it (no null fields)."""
    return answer.model_dump(mode="json", exclude_none=True)


def pick_fields(paths: Sequence[str], answer: dict[str, Any]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path's value under the path itself ("a/b" is b of
    the object a); a path that is not there is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def llama_tokenize(tok, body: LlamaTokenizeRequest) -> LlamaTokenizeResponse:
    """llama-server's /tokenize with tokenizer `tok`: {"tokens": ids}, or {id, piece} per token."""
    if not body.parse_special:
        raise ApiError(400, "parse_special must be true: loom's tokenizer always reads special tokens in the "
                       "text as special", param="parse_special", code="unsupported")
    try:
        ids = await off_loop(len(body.content), tok.encode, body.content, add_special_tokens=body.add_special)
    except TokenizerError as e:
        raise ApiError(400, str(e), param="content", code="invalid_value") from None
    if not body.with_pieces:
        return LlamaTokenizeResponse(tokens=ids)
    return LlamaTokenizeResponse(tokens=[TokenPiece(id=i, piece=_piece(tok.token_bytes(i))) for i in ids])


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 (as llama-server gives them)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def model_path(name: str) -> Path:
    """The served file: a path as given, or a registry model's file in the cache."""
    path = Path(name).expanduser()
    return cached_path(name) if not path.is_file() and name in REGISTRY else path


def llamacpp_router(serving: LlamaCppServing, dependencies: list, errors: dict) -> APIRouter:
    """llama-server's /completion, /apply-template and /props at the root."""
    router = APIRouter(dependencies=dependencies)

    @router.post("/completion", response_model=LlamaCompletionResponse, response_model_exclude_none=True,
                 responses=errors)
    async def completion(body: LlamaCompletionRequest, request: Request):
        """llama-server's native completion: one prompt, llama.cpp's settings and answer fields."""
        return await serving.completion(body, request)

    @router.post("/apply-template", response_model=ApplyTemplateResponse, responses=errors)
    async def apply_template(body: ApplyTemplateRequest) -> ApplyTemplateResponse:
        """llama-server's chat template rendering: the prompt text a chat request's messages become."""
        return await serving.apply_template(body)

    @router.get("/props", response_model=PropsResponse)
    async def props() -> PropsResponse:
        """llama-server's server properties: default settings, context, slots, model, template."""
        return serving.props()

    return router
