"""Engine: requests in, incremental outputs out. One step = schedule, execute, update."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Sequence

import psutil
import torch

from loom.config import EngineConfig, physical_cores
from loom.engine.output import OutputState
from loom.engine.request import Request, RequestStatus
from loom.engine.scheduler import Scheduler
from loom.errors import InvalidRequestError
from loom.loader.gguf import GGUFFile
from loom.loader.registry import resolve_model
from loom.loader.tokenizer import Tokenizer
from loom.model.loader import load_model
from loom.model.runner import ModelRunner
from loom.outputs import RequestOutput
from loom.parallel.fanout import FanOut, FanOutOptions, fork_request
from loom.sampling_params import SamplingParams

log = logging.getLogger("loom")

DEFAULT_KV_SHARE = 0.25            # of available RAM, when kv_cache_memory is not given
DEFAULT_KV_CAP = 4 << 30           # ... but no more than this


class Engine:
    """`model` and `tokenizer`, when given, must come from the file `config.load.model` names
    (the model loaded with `config.load.linear_mode`); they are used instead of loading it again,
    so several engines (other cache or scheduler settings) can share one copy of the weights."""

    def __init__(self, config: EngineConfig, *, model=None, tokenizer: Tokenizer | None = None):
        self.config = config
        torch.set_num_threads(config.load.threads or physical_cores())
        t0 = time.perf_counter()
        path = resolve_model(config.load.model)
        if model is None or tokenizer is None:
            gguf = GGUFFile.open(path)
            tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_gguf(gguf)
            model = model if model is not None else load_model(gguf, linear=config.load.linear_mode)
        self.tokenizer = tokenizer
        self.model = model
        self.model_path = path
        self.model_name = config.load.model
        self.load_seconds = time.perf_counter() - t0
        cfg = self.model.cfg
        self.kv_dtype = self._kv_dtype()
        num_blocks = self._num_blocks()
        bs = config.cache.block_size
        self.max_model_len = min(config.scheduler.max_model_len or cfg.context_length, cfg.context_length,
                                 num_blocks * bs)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, bs, self.tokenizer.stop_token_ids, kv_dtype=self.kv_dtype,
                                  seed=config.seed)
        if config.speculative is not None:
            self._attach_speculation(num_blocks)
        self.outputs: dict[str, OutputState] = {}
        self.fanout = FanOut(self)  # n > 1 / best_of requests: children sharing KV (loom/parallel)
        self._ids = itertools.count()
        log.info("loaded %s in %.1fs: %d KV blocks of %d tokens", path.name, self.load_seconds, num_blocks, bs)

    def _kv_dtype(self) -> torch.dtype:
        """float16 where loom's kernels read the cache (half the memory traffic of attention);
        float32 in the exact mode, which must match the reference bit for bit."""
        choice = self.config.cache.kv_cache_dtype
        if choice == "auto":
            return torch.float16 if getattr(self.model, "kern", None) is not None else torch.float32
        return {"float32": torch.float32, "float16": torch.float16}[choice]

    def _attach_speculation(self, num_blocks: int) -> None:
        from loom.spec.decoder import SpecDecoder
        from loom.spec.drafters import DraftEnv

        spec = self.config.speculative
        env = DraftEnv(self.model, self.config.load.linear_mode, num_blocks, self.config.cache.block_size)
        self.runner.spec = SpecDecoder(spec, env)
        if spec.adaptive:
            self.runner.spec.calibrate(self.runner, self.config.scheduler.max_num_seqs)

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        per_token = ModelRunner.kv_bytes_per_token(self.model.cfg, self.kv_dtype)
        budget = cache.kv_cache_memory or min(int(psutil.virtual_memory().available * DEFAULT_KV_SHARE),
                                              DEFAULT_KV_CAP)
        return max(1, budget // (per_token * cache.block_size))

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
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if max(ids) >= self.model.cfg.vocab_size or min(ids) < 0:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.model.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt is {len(ids)} tokens, the context limit is {self.max_model_len} "
                                      f"(at least one token must be left to generate)")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if request_id is None:
            rid = str(next(self._ids))
            while rid in self.scheduler.requests:  # a caller's own id may look like ours
                rid = str(next(self._ids))
        else:
            rid = request_id
        if rid in self.scheduler.requests or rid in self.fanout:
            raise InvalidRequestError(f"request id '{rid}' is already in use")
        limit = self.config.scheduler.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        req = Request(rid, ids, params, max_tokens, prompt=text, priority=priority,
                      eos_token_ids=self.tokenizer.stop_token_ids)
        self.scheduler.add(req)
        if params.effective_best_of > 1 or fanout is not None:
            self.fanout.add(req, fanout)
        else:
            self.outputs[rid] = OutputState(req, self.tokenizer)
        return rid

    def fork(self, request_id: str, num_children: int,
             append_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None) -> list[str]:
        """New requests continuing `request_id` from all it holds so far, sharing its KV blocks,
        each followed by `append_token_ids`; returns their ids (see `loom.parallel.fanout.fork_request`)."""
        return fork_request(self, request_id, num_children, append_token_ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a string, a list of token ids or a dict, "
                                  f"got {type(prompt).__name__}")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request now and frees its KV blocks; returns its final output (finish_reason 'abort')."""
        if request_id in self.fanout:
            return self.fanout.abort(request_id)
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        state = self.outputs.pop(request_id, None)
        if req is None or state is None:
            return None
        return state.process()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        touched = self.scheduler.update(plan, result)
        return self.fanout.step(self._process_outputs(touched, result))

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


class QueueFullError(InvalidRequestError):
    """The bounded waiting queue is full; retry later."""
