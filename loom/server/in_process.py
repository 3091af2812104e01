"""`InProcessEngineClient`: the engine thread of an `AsyncEngine` in this process, behind the
engine-client interface (loom/server/engine_client.py): `loom serve --no-engine-process`, a
Ray Serve replica, and tests that build an app around an engine.

Its own module, so that the HTTP front end of the default (the engine in its own process)
never imports the engine and torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from loom.config import EngineConfig
from loom.engine.async_engine import AsyncEngine
from loom.loader.tokenizer import LONG_TEXT_CHARS
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.server.engine_client import off_loop
from loom.server.metrics import EngineSample, read_engine_sample


class InProcessEngineClient:
    """The engine thread of an `AsyncEngine` in this process, behind the client interface."""

    def __init__(self, ae: AsyncEngine):
        self.ae = ae
        self.tokenizer = ae.tokenizer
        self.model_name = str(ae.engine.model_name)
        self.max_model_len = int(ae.engine.max_model_len)
        self.vocab_size = int(ae.engine.model.cfg.vocab_size)
        self.cache_info = dict(ae.engine.cache_info)
        self.max_waiting = ae.engine.config.scheduler.max_waiting
        self.max_num_seqs = ae.engine.config.scheduler.max_num_seqs
        self.restarts = 0   # the engine thread is never replaced

    @property
    def error(self) -> BaseException | None:
        return self.ae.error

    def start(self) -> None:
        self.ae.start()

    def shutdown(self) -> None:
        self.ae.shutdown()

    def closing(self) -> None:
        """Nothing to expect: the engine thread stops with shutdown()."""

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, fanout=None) -> AsyncIterator[RequestOutput]:
        if isinstance(prompt, str) and len(prompt) > LONG_TEXT_CHARS:   # tokenized off the event loop
            prompt = {"prompt": prompt, "prompt_token_ids": await off_loop(len(prompt), self.tokenizer.encode, prompt)}
        async with aclosing(self.ae.generate(prompt, params, request_id, priority, fanout=fanout)) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        self.ae.abort(request_id)

    def stats(self) -> EngineSample:
        return self.ae.snapshot(read_engine_sample)


def in_process_client(config: EngineConfig) -> InProcessEngineClient:
    return InProcessEngineClient(AsyncEngine.from_config(config))
