"""Offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loom.config import EngineConfig
from loom.contracts import iteration_buckets
from loom.engine.engine import Engine
from loom.errors import InvalidRequestError
from loom.loader.chat_messages import message_dicts, tool_list, with_tools
from loom.outputs import FinalOutputs, RequestOutput
from loom.parallel.beam import run_beam_search
from loom.sampling_params import BeamSearchParams, SamplingParams

PROGRESS_MIN_PROMPTS = 8  # shorter batches finish before a bar is worth drawing
_GENERATION_ONLY = ("LLM.{} is vLLM's API for pooling (embedding, classification, reward) models; loom runs "
                    "generative models only")


@dataclass
class Metric:
    """One series of `LLM.get_metrics` (vLLM's `vllm.v1.metrics.reader` shapes): its name as
    /metrics gives it (counters without ``_total``) and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters by position (speculative decoding's accepted tokens per draft depth)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """Cumulative bucket counts by upper bound (as strings, "+Inf" last), their count and sum."""

    count: int
    sum: float
    buckets: dict[str, int]


def _no_lora(lora_request) -> None:
    """vLLM's lora_request: None is fine (code passes it always); an adapter is refused by name."""
    if lora_request is not None:
        raise InvalidRequestError("lora_request: loom does not serve LoRA adapters (merge one into the GGUF file)")


class LLM:
    """Runs prompts through the continuous-batching engine; outputs come back in input order.

    Keyword options are those of the engine config: dtype, threads, block_size,
    kv_cache_memory, num_blocks, enable_prefix_caching, max_num_batched_tokens,
    max_num_seqs, max_model_len, seed, speculative_config (a dict: see loom.config).
    """

    def __init__(self, model: str = "smollm2-135m", **options):
        self.engine = Engine(EngineConfig.create(model, **options))

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """An LLM over an existing engine (shares its model, cache and requests)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, under /metrics' names (vLLM's `get_metrics`):
        requests running and waiting, KV cache usage, preemptions, prompt and generated tokens,
        prefix-cache queries and hits, tokens per step, and speculative decoding's counts."""
        engine, labels = self.engine, {"model_name": str(self.engine.model_name), "engine": "0"}
        s, kv = engine.scheduler.stats, engine.kv
        out: list[Metric] = [
            Gauge("vllm:num_requests_running", labels, len(engine.scheduler.running)),
            Gauge("vllm:num_requests_waiting", labels, len(engine.scheduler.waiting)),
            Gauge("vllm:kv_cache_usage_perc", labels, float(kv.usage())),
            Counter("vllm:num_preemptions", labels, s.num_preemptions),
            Counter("vllm:prompt_tokens", labels, s.prompt_tokens),
            Counter("vllm:generation_tokens", labels, s.generation_tokens),
            Counter("vllm:prefix_cache_queries", labels, kv.stats.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", labels, kv.stats.prefix_cache_hits),
            Histogram("vllm:iteration_tokens_total", labels, sum(s.iteration_tokens), s.iteration_tokens_sum,
                      dict(iteration_buckets(s.iteration_tokens)))]
        if engine.spec is not None:
            st = engine.spec.stats
            out += [Counter("vllm:spec_decode_num_drafts", labels, st.num_drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", labels, st.num_draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", labels, st.num_accepted_tokens),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(st.accepted_per_pos))]
        return out

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache (vLLM's): the next prompts are computed in full (e.g. to time
        prefill again); what speculative drafters learned is kept. False while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without its own gets (vLLM's; GGUF files carry no
        generation config, so these are SamplingParams' defaults)."""
        return SamplingParams()

    def generate(self, prompts: str | Sequence | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None, *, lora_request=None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """`use_tqdm`: a progress bar (on stderr) for 8 prompts or more; a callable is called as
        vLLM calls it, as tqdm's constructor (``total``, ``desc``), for a bar of the caller's."""
        _no_lora(lora_request)
        if tokenization_kwargs:
            raise InvalidRequestError(f"tokenization_kwargs {sorted(tokenization_kwargs)} are not supported: "
                                      "loom tokenizes as the model's GGUF file says (truncate_prompt_tokens and "
                                      "add_special_tokens are SamplingParams / server fields)")
        if prompt_token_ids is not None:
            prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if prompts is None:
            raise InvalidRequestError("generate() needs prompts or prompt_token_ids")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, Sequence)):
            prompts = list(prompts)   # a generator of prompts
        if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
            raise InvalidRequestError(f"prompts must be a string, a prompt dict or a list of them, got "
                                      f"{type(prompts).__name__}")
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise InvalidRequestError("prompts is a list of integers, which would be one prompt per integer: give "
                                      "token ids as {'prompt_token_ids': [...]}, [[...]] or prompt_token_ids=[[...]]")
        params = self._params_list(sampling_params, len(prompts))
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp, pr in zip(prompts, params, priority):
                ids.append(self.engine.add_request(p, sp, priority=pr))
        except BaseException:
            for rid in ids:  # all or nothing: no half-added batch is left in the engine
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request=None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, rendered with the model's chat
        template (or `chat_template`, a Jinja template), as the server renders a chat request.

        Messages take OpenAI's shapes (content a string, text parts or None; an assistant's
        `tool_calls`); `tools` (OpenAI's function tools) are shown to the model through the
        template where it reads them, else in the system message (loom/loader/chat_messages.py);
        the calls in the output are the caller's to parse, as with vLLM's `LLM.chat`.
        continue_final_message: the final message is left open and the model continues it (with
        add_generation_prompt=False); chat_template_kwargs: more template variables."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                                      f"{chat_template_content_format!r}")
        if not messages:
            raise InvalidRequestError("chat() needs a conversation: a list of messages, or a list of such lists")
        convs = [messages] if isinstance(messages[0], Mapping) else messages
        tok = self.engine.tokenizer
        tool_defs = tool_list(tools or [])
        prompts = []
        for i, conv in enumerate(convs):
            if not isinstance(conv, Sequence) or isinstance(conv, str) or not conv:
                raise InvalidRequestError(f"conversation {i} must be a non-empty list of messages")
            variables, template = dict(chat_template_kwargs or {}), chat_template or tok.chat_template
            msgs = with_tools(message_dicts(conv, template), tool_defs, template, variables)
            how = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template, **variables)
            text = tok.apply_chat_template(msgs, tokenize=False, **how)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode_chat(msgs, **how)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: str | Sequence, params: BeamSearchParams, use_tqdm: bool = False, *,
                    lora_request=None) -> list:
        """Beam search (or diverse beam search) per prompt with `BeamSearchParams` (vLLM's
        `from vllm.sampling_params import BeamSearchParams` reads `from loom.sampling_params ...`);
        returns one `BeamSearchOutput` per prompt, in order, its sequences best first."""
        _no_lora(lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        with _progress(use_tqdm, len(prompts)) as advance:
            return run_beam_search(self.engine, prompts, params, on_done=advance)

    # vLLM's pooling and scoring methods: loom runs generative models only
    def encode(self, *args, **kwargs):
        raise NotImplementedError(_GENERATION_ONLY.format("encode"))

    def embed(self, *args, **kwargs):
        raise NotImplementedError(_GENERATION_ONLY.format("embed"))

    def score(self, *args, **kwargs):
        raise NotImplementedError(_GENERATION_ONLY.format("score") + "; to score a text's tokens, use "
                                  "SamplingParams(prompt_logprobs=0)")

    def classify(self, *args, **kwargs):
        raise NotImplementedError(_GENERATION_ONLY.format("classify"))

    def reward(self, *args, **kwargs):
        raise NotImplementedError(_GENERATION_ONLY.format("reward"))

    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if isinstance(sp, Mapping):
            raise InvalidRequestError("sampling_params must be SamplingParams or a list of them, got a dict: "
                                      "write SamplingParams(**params)")
        if isinstance(sp, (str, bytes)) or not isinstance(sp, Iterable):
            raise InvalidRequestError(f"sampling_params must be SamplingParams or a list of them, got "
                                      f"{type(sp).__name__}")
        sp = list(sp)
        if len(sp) != n:
            raise InvalidRequestError(f"got {len(sp)} sampling params for {n} prompts")
        for p in sp:
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"sampling_params must be SamplingParams or a list of them, got a list "
                                          f"holding {type(p).__name__}")
        return sp

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until the call's requests are done. On any exception (Ctrl-C
        included) it aborts them first: left in the engine, they would run to the end inside
        the next call."""
        try:
            return self._wait_for(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise

    def _wait_for(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        gather = FinalOutputs()
        with _progress(use_tqdm, len(ids)) as advance:
            while self.engine.has_unfinished_requests():
                for out in gather.add_all(self.engine.step()):
                    final[out.request_id] = out
                    advance()
        return [final[i] for i in ids]


@contextmanager
def _progress(use_tqdm: bool | Callable, total: int) -> Iterator[Callable[[], None]]:
    """Yields the function to call per prompt done. A progress bar of them on stderr, as vLLM's
    tqdm (stdout stays the program's own output when redirected), for `total` >= 8 where
    `use_tqdm` is true; where it is a callable, the bar it makes, as vLLM calls it (tqdm's
    constructor: ``use_tqdm(total=..., desc=...)``, then ``update(1)`` and ``close()``)."""
    if callable(use_tqdm):
        bar = use_tqdm(total=total, desc="Processed prompts")
        try:
            yield lambda: bar.update(1)
        finally:
            bar.close()
        return
    show = bool(use_tqdm) and total >= PROGRESS_MIN_PROMPTS
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=not show, transient=True) as bar:
        task = bar.add_task("gen", total=total)
        yield lambda: bar.advance(task)
