"""Engine: requests in, incremental outputs out. One step = schedule, execute, update."""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import psutil
import torch

from loom.config import EngineConfig, physical_cores
from loom.contracts import FanOutOptions, derive_seed
from loom.engine.allocator import tune_malloc
from loom.engine.detokenize import OutputState
from loom.engine.groups import ChildSpec, RequestGroups, child_request, per_child_appends
from loom.engine.request import Request, RequestStatus, check_token_ids, token_controls
from loom.engine.scheduler import Scheduler
from loom.errors import ContextLengthError, InvalidRequestError, QueueFullError
from loom.kv.eviction import make_policy
from loom.loader.cache import file_sha256
from loom.loader.gguf import GGUFFile
from loom.loader.registry import resolve_model
from loom.loader.tokenizer import Tokenizer
from loom.model.build import load_model
from loom.model.kv_dtypes import KVFormat, kv_format
from loom.model.runner import ModelRunner
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.speculative.decoder import SpecDecoder
from loom.speculative.drafters import DraftEnv
from loom.structured import StructuredOutputs

log = logging.getLogger("loom")

DEFAULT_KV_SHARE = 0.25            # of available RAM, when kv_cache_memory is not given
DEFAULT_KV_CAP = 4 << 30           # ... but no more than this


def kv_cache_format(choice: str, model) -> KVFormat:
    """The KV cache's format for CacheConfig.kv_cache_dtype `choice` (loom/model/kv_dtypes):
    "auto" is float16 where loom's kernels read the cache (half the memory traffic of
    attention), float32 in the exact mode, which must match the reference bit for bit."""
    return kv_format(choice, kernels=getattr(model, "kern", None) is not None, head_dim=model.cfg.head_dim)


def _integer(value) -> bool:
    """An int (a numpy or torch integer too), never a bool or float."""
    return not isinstance(value, bool) and hasattr(value, "__index__")


def _load(gguf: GGUFFile, linear: str, model, tokenizer: Tokenizer | None):
    """The model and the tokenizer of `gguf` (those not given), the tokenizer built on a thread of
    its own: a warm load spends most of its time reading the packed weights into memory (no GIL
    held) and the tokenizer's is Python (Gemma 3's 262k pieces and special tokens: ~0.27 s), so the
    two overlap."""
    if tokenizer is not None or model is not None:
        tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_gguf(gguf)
        return (model if model is not None else load_model(gguf, linear=linear)), tokenizer
    with ThreadPoolExecutor(1, thread_name_prefix="loom-tokenizer") as pool:
        pending = pool.submit(Tokenizer.from_gguf, gguf)
        model = load_model(gguf, linear=linear)
        return model, pending.result()


# The keys of a prompt dict (vLLM's TextPrompt / TokensPrompt, as loom implements them).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})

class Engine:
    """`model` and `tokenizer`, when given, must come from the file `config.load.model` names
    (the model loaded with `config.load.linear_mode`); they are used instead of loading it again,
    so several engines (other cache or scheduler settings) can share one copy of the weights."""

    def __init__(self, config: EngineConfig, *, model=None, tokenizer: Tokenizer | None = None):
        self.config = config
        tune_malloc()
        torch.set_num_threads(config.load.threads or physical_cores())
        t0 = time.perf_counter()
        path = resolve_model(config.load.model)
        if model is None or tokenizer is None:
            model, tokenizer = _load(GGUFFile.open(path), config.load.linear_mode, model, tokenizer)
        self.tokenizer = tokenizer
        self.model = model
        self.model_path = path
        self.model_name = config.load.model
        self.load_seconds = time.perf_counter() - t0
        self.kv_dtype = self._kv_dtype()
        num_blocks = self._num_blocks()
        bs = config.cache.block_size
        self.max_model_len = self._context_limit(num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len)
        self.spec = self._speculative_decoder(num_blocks)
        self._prediction_unused_said = False   # the log said once that predictions go unused here
        if config.cache.kv_eviction is not None:
            if self.spec is not None:
                raise InvalidRequestError("kv_eviction cannot be combined with speculative decoding "
                                          "(speculative_config): choose one")
            self._check_budget(config.cache.kv_eviction)
        self.structured = StructuredOutputs(self.tokenizer, self.model.cfg.vocab_size)
        self.runner = ModelRunner(self.model, num_blocks, bs, self.tokenizer.stop_token_ids, kv_dtype=self.kv_dtype,
                                  seed=config.seed, spec=self.spec, structured=self.structured)
        if self.spec is not None and config.speculative.adaptive:
            if self.spec.calibrate(self.runner.timed_forward, config.scheduler.max_num_seqs, self._cost_identity()):
                self.runner.kv.release()   # the timed passes read blocks nothing wrote (KVCacheTensors.release)
        self.outputs: dict[str, OutputState] = {}
        self.groups = RequestGroups(self)  # n > 1 / best_of requests: children sharing KV (engine/groups.py)
        self._ids = itertools.count()
        kv_bytes = num_blocks * bs * ModelRunner.kv_bytes_per_token(self.model.cfg, self.kv_dtype)
        # vLLM's cache_config_info labels (its "gpu" blocks are the device's: here the KV cache in RAM)
        self.cache_info = {"block_size": str(bs), "cache_dtype": self.kv_dtype.name,
                           "enable_prefix_caching": str(config.cache.enable_prefix_caching),
                           "num_gpu_blocks": str(num_blocks), "num_cpu_blocks": "0",
                           "kv_cache_memory_bytes": str(kv_bytes)}
        # the cache's pages become resident as blocks are first used: RSS grows toward this over time
        log.info("loaded %s in %.1fs: %d KV blocks of %d tokens (%d tokens, %.2f GB of %s KV cache, paged in as "
                 "first used)", path.name, self.load_seconds, num_blocks, bs, num_blocks * bs, kv_bytes / 1e9,
                 self.kv_dtype.name)

    def _kv_dtype(self) -> KVFormat:
        return kv_cache_format(self.config.cache.kv_cache_dtype, self.model)

    def _speculative_decoder(self, num_blocks: int) -> SpecDecoder | None:
        spec = self.config.speculative
        if spec is None:
            return None
        return SpecDecoder(spec, DraftEnv(self.model, self.config.load.linear_mode, num_blocks,
                                          self.config.cache.block_size, self.tokenizer))

    def _cost_identity(self) -> dict:
        """What the speculative cost model's cached calibration depends on besides the machine."""
        return {"model": file_sha256(self.model_path), "linear": self.config.load.linear_mode,
                "kv_dtype": str(self.kv_dtype), "block_size": self.config.cache.block_size}

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        per_token = ModelRunner.kv_bytes_per_token(self.model.cfg, self.kv_dtype)
        budget = cache.kv_cache_memory or min(int(psutil.virtual_memory().available * DEFAULT_KV_SHARE),
                                              DEFAULT_KV_CAP)
        block = per_token * cache.block_size
        if cache.kv_cache_memory is not None and budget < block:
            raise InvalidRequestError(f"kv_cache_memory must hold at least one KV block: {budget} bytes, one block of "
                                      f"{cache.block_size} tokens takes {block} bytes here")
        return max(1, budget // block)

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int] | dict | None, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    fanout: FanOutOptions | None = None) -> str:
        """Queues a request; raises InvalidRequestError for a bad prompt or parameters.

        With n > 1 or best_of > n (or `fanout` options) the request fans out into children
        that share its prompt's KV blocks; its outputs hold one completion per child."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        # A validated private copy: fields assigned after construction are checked too, and the
        # caller changing its object later cannot change a running request.
        params = params.clone()
        if params.structured_outputs is not None:   # compiled (and cached) now: a bad one is refused here
            self.structured.compile(params.structured_outputs)
        if params.restricts_tokens:
            params = token_controls(params, self.tokenizer, self.model.cfg.vocab_size)
        if params.prediction is not None or params.prediction_token_ids is not None:
            params = self._with_prediction(params)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        priority = int(priority)   # numpy's integers too
        params = self._with_eviction(params, fanout)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:   # vLLM's prompt-dict form
            params = params.clone(cache_salt=prompt["cache_salt"])
        eviction = make_policy(params.kv_eviction)
        past_context = eviction is not None and not eviction.observes
        text, ids = self._tokenize(prompt)
        keep = params.prompt_keep(self.max_model_len)
        if keep is not None and ids:
            if len(ids) > keep:
                ids = ids[-keep:]
                text = self.tokenizer.decode(ids)   # the outputs' prompt: the text of the ids kept
        check_token_ids(ids, self.model.cfg.vocab_size, None if past_context else self.max_model_len, "prompt")
        if past_context:   # a StreamingLLM request runs as long as asked; by default a context's worth
            max_tokens = self.max_model_len if params.max_tokens is None else params.max_tokens
        else:
            room = self.max_model_len - len(ids)
            if params.strict_max_tokens and params.max_tokens is not None and params.max_tokens > room:
                raise ContextLengthError(   # vLLM's server's words, which clients parse to retry with less
                    f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's "
                    f"maximum context length is {self.max_model_len} tokens and your request has {len(ids)} "
                    f"input tokens ({params.max_tokens} > {self.max_model_len} - {len(ids)}).")
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if request_id is None:
            rid = str(next(self._ids))
            while rid in self.scheduler.requests:  # a caller's own id may look like ours
                rid = str(next(self._ids))
        else:
            rid = request_id
        if rid in self.scheduler.requests or rid in self.groups:
            raise InvalidRequestError(f"request id '{rid}' is already in use")
        limit = self.config.scheduler.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        req = Request(rid, ids, params, max_tokens, prompt=text, priority=priority,
                      eos_token_ids=self.tokenizer.stop_token_ids, eviction=eviction)
        self.scheduler.add(req)
        if params.effective_best_of > 1 or fanout is not None:
            self.groups.add(req, fanout)
        else:
            self.outputs[rid] = OutputState(req, self.tokenizer)
        return rid

    def _context_limit(self, num_blocks: int) -> int:
        """The context limit: the configured one (at most the model's context), else the model's,
        cut to the tokens the KV cache's blocks hold. A configured limit that the model or
        the cache cannot give is refused (as vLLM refuses it); a model's context cut by the
        cache is said once at start-up."""
        trained, asked = self.model.cfg.context_length, self.config.scheduler.max_model_len
        held = num_blocks * self.config.cache.block_size
        if asked is not None and asked > trained:
            raise InvalidRequestError(f"max_model_len {asked} is longer than the model's context of {trained} tokens")
        if held >= (asked or trained):
            return asked or trained
        where = f"the KV cache's {num_blocks} blocks hold {held} tokens"
        if asked is not None:
            raise InvalidRequestError(f"max_model_len {asked} does not fit: {where} (give the cache more blocks "
                                      f"or memory, or a smaller max_model_len)")
        log.warning("%s: the context limit is %d tokens, not the model's %d", where, held, trained)
        return held

    def _with_prediction(self, params: SamplingParams) -> SamplingParams:
        """`params` with its prediction tokenized. A prediction is a hint for speed (the output is the
        same without it): without speculative decoding it is dropped, once said in the log."""
        if self.spec is None:
            if not self._prediction_unused_said:
                self._prediction_unused_said = True
                log.warning("a request's prediction is ignored: it speeds decoding up by drafting from it, which "
                            "needs speculative decoding (--speculative-config '{\"method\": \"auto\"}')")
            return params.clone(prediction=None, prediction_token_ids=None)
        ids = params.prediction_token_ids
        if ids is None:
            ids = self.tokenizer.encode(params.prediction, add_special_tokens=False)
            if not ids:
                raise InvalidRequestError("prediction tokenizes to nothing")
        check_token_ids(list(ids), self.model.cfg.vocab_size, None, "prediction")
        if len(ids) > self.max_model_len:   # an output cannot be longer; its n-gram index stays bounded
            raise InvalidRequestError(f"prediction is {len(ids)} tokens, longer than the context limit of "
                                      f"{self.max_model_len}")
        return params.clone(prediction_token_ids=ids)

    def _with_eviction(self, params: SamplingParams, fanout) -> SamplingParams:
        """`params` with the KV eviction the request gets: its own, else the engine's default
        where the request can take it; checked against what the engine serves."""
        own = params.kv_eviction
        default = self.config.cache.kv_eviction
        if own is None:
            fits = (default is not None and params.prompt_logprobs is None and params.effective_best_of == 1
                    and fanout is None and self.spec is None)
            return params.clone(kv_eviction=default) if fits else params
        if not own.enabled:
            return params.clone(kv_eviction=None)
        if self.spec is not None:
            raise InvalidRequestError(f"kv_eviction cannot be combined with speculative decoding "
                                      f"(this engine runs speculative_config method {self.config.speculative.method!r})")
        if fanout is not None:
            raise InvalidRequestError("kv_eviction cannot be combined with fan-out (n > 1, best_of, beam search)")
        self._check_budget(own)
        return params

    def _check_budget(self, own) -> None:
        bs, limit = self.config.cache.block_size, self.max_model_len
        if own.budget < 2 * bs:
            raise InvalidRequestError(f"kv_eviction budget must be at least two KV blocks ({2 * bs} tokens at "
                                      f"block_size {bs}): eviction frees whole blocks; got {own.budget}")
        if own.budget > limit - bs:
            raise InvalidRequestError(f"kv_eviction budget must leave a block of the context limit ({limit}) "
                                      f"free: it is the most KV one sequence may hold; got {own.budget}")

    # -- the fork primitive (loom.parallel builds beams and fork/join programs on it) -----
    def spawn(self, parent_id: str, specs: Sequence[ChildSpec]) -> list[str]:
        """Forks `parent_id` into one child request per spec; the children share the KV of the
        parent's computed tokens and produce their own outputs from `step()`. The parent is
        left as it was (finish, pause or keep it running as you need)."""
        parent = self._live(parent_id, "cannot fork request")
        if parent.eviction is not None:
            raise InvalidRequestError(f"cannot fork request '{parent_id}': kv_eviction cannot be combined with forks "
                                      f"(beam search, fork/join)")
        ids = [s.request_id for s in specs]
        if any(i in self.scheduler.requests or i in self.groups for i in ids) or len(set(ids)) != len(ids):
            raise InvalidRequestError(f"child request ids must be new and distinct, got {ids}")
        children = [child_request(parent, spec, self.model.cfg.vocab_size, self.max_model_len) for spec in specs]
        self.scheduler.fork(parent_id, children)
        for child, spec in zip(children, specs):
            self.outputs[child.request_id] = OutputState(child, self.tokenizer, index=spec.index)
        return ids

    def fork(self, request_id: str, num_children: int,
             append_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
             params: SamplingParams | None = None) -> list[str]:
        """`num_children` new requests that continue `request_id` from everything it holds so far
        (its prompt, its output, a sampled token not yet computed), each followed by
        `append_token_ids` (one list for all, or one list per child); returns their ids. Child i
        (from 1) samples with `derive_seed(seed, i)` of the parent's (or `params`') seed; the
        parent keeps running."""
        parent = self._live(request_id, "cannot fork request")
        if isinstance(num_children, bool) or not isinstance(num_children, int) or num_children < 1:
            raise InvalidRequestError(f"num_children must be an integer >= 1, got {num_children!r}")
        appends = per_child_appends(append_token_ids, num_children)
        base = (params or parent.params).clone(n=1, best_of=None)
        specs = [ChildSpec(self.fresh_id(f"{request_id}.{i}"), base.clone(seed=derive_seed(base.seed, i)),
                           tuple(appends[i - 1]))
                 for i in range(1, num_children + 1)]
        return self.spawn(request_id, specs)

    def pause(self, request_id: str) -> None:
        """Stops `request_id` where it is (its KV stays; nothing more is computed or sampled)
        until `resume`. A token it sampled but has not computed yet stays pending."""
        req = self._live(request_id)
        req.compute_limit = req.num_computed_tokens

    def limit_drafts(self, request_id: str, max_new: int | None) -> None:
        """Speculative steps of `request_id` add at most `max_new` more output tokens in all (0:
        it drafts nothing; None: no limit), so a driver that stops it after so many tokens, or
        at a text, stops it where a step of one token would (a step committing several tokens
        would run past)."""
        req = self._live(request_id)
        req.output_limit = None if max_new is None else req.num_output_tokens + max(0, int(max_new))

    def resume(self, request_id: str, append_token_ids: Sequence[int] = ()) -> None:
        """Lets a paused request run again, after appending `append_token_ids` to its output as
        forced tokens (a join's result). Forced tokens count toward max_tokens and are not
        checked for stop tokens; repetition penalties of the runner do not see them."""
        req = self._live(request_id)
        tokens = [int(t) for t in append_token_ids]
        if tokens:
            check_token_ids(req.all_token_ids + tokens, self.model.cfg.vocab_size,
                            None if req.runs_past_context else self.max_model_len,
                            f"request '{request_id}' with its appended tokens")
        for t in tokens:
            req.append_token(t)
        req.compute_limit = None

    def fresh_id(self, base: str) -> str:
        """`base`, primed until no request or group holds it."""
        rid = base
        while rid in self.scheduler.requests or rid in self.groups:
            rid += "'"
        return rid

    def _live(self, request_id: str, doing: str = "request") -> Request:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise InvalidRequestError(f"{doing} '{request_id}': it is not running or waiting"
                                      if doing != "request" else f"request '{request_id}' is not running or waiting")
        return req

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text, ids) of a prompt: a string, token ids, or a dict of vLLM's prompt forms."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if unknown := sorted(set(prompt) - PROMPT_KEYS):   # never dropped unread (an image, say)
                raise InvalidRequestError(f"a prompt dict takes {', '.join(sorted(PROMPT_KEYS))}; loom does not "
                                          f"implement {', '.join(map(repr, unknown))}" + (" (it serves text models)" if any(
                                              k.startswith("multi_modal") for k in unknown) else ""))
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) or not all(map(_integer, ids)):
                    raise InvalidRequestError(f"prompt_token_ids must be a list of token ids (integers), "
                                              f"got {ids!r:.60}")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a string, a list of token ids or a dict, "
                                  f"got {type(prompt).__name__}")

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block (vLLM's), so the next prompts are computed in full;
        False, changing nothing, while a request holds blocks."""
        return self.kv.pool.reset_prefix_cache()

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Ends a request now and frees its KV blocks; returns its last outputs (finish_reason
        'abort'): one, or one per choice it ended for an n > 1 request; none for an unknown id."""
        if request_id in self.groups:
            return self.groups.abort(request_id)
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        state = self.outputs.pop(request_id, None)
        if req is None or state is None:
            return []
        return [state.process()]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        for rid, entries in result.prompt_logprobs.items():
            if rid in self.outputs:
                self.outputs[rid].add_prompt_logprobs(entries)
            else:   # the parent of n > 1 choices
                self.groups.add_prompt_logprobs(rid, entries)
        touched = self.scheduler.update(plan, result)
        return self.groups.step(self._process_outputs(touched, result))

    def _process_outputs(self, touched: list[Request], result) -> list[RequestOutput]:
        outs = []
        for req in touched:
            state = self.outputs[req.request_id]
            if req.request_id in result.logprobs:
                state.add_logprobs(result.logprobs[req.request_id], result.sampled[req.request_id])
            out = state.process()
            if state.stopped_by_string and req.request_id in self.scheduler.requests:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if out.finished:
                del self.outputs[req.request_id]
            outs.append(out)
        return outs

    # -- introspection -------------------------------------------------------------------
    @property
    def kv(self):
        return self.scheduler.kv


