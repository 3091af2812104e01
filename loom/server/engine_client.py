"""What the HTTP front end talks to: an `EngineClient`, in this process or in an engine-core process.

The interface (what openai_api.py, choices and metrics use):

    generate(prompt, params, request_id, priority, fanout)  -> async stream of RequestOutputs
    abort(request_id)                                        # ends it, frees its KV blocks
    stats() -> EngineSample                                  # /metrics, /v1/loom/stats
    tokenizer, model_name, max_model_len, vocab_size, error  # error: why the engine is gone
    max_waiting                                              # the engine's waiting-queue bound (None: none)
    restarts                                                 # engines started anew after one died
    closing()                                                # the server got SIGINT/SIGTERM: an engine exit is expected
    start() / shutdown()                                     # with the app's lifespan

`ProcessEngineClient` (the default of `loom serve`):

    front end (this process)                       engine core (loom/server/engine_core.py)
    FastAPI, tokenization, SSE        AddRequest / AbortRequests / Shutdown ->   Engine.step() loop
    reader (loop callback) -> queues    <- StepOutputs (one per step)            detokenization
    watches the process sentinel                                                 stop strings

`InProcessEngineClient` (loom/server/in_process.py) wraps an `AsyncEngine` (engine thread in
this process): the `--no-engine-process` mode, Ray Serve replicas, and tests that build an app
around an engine. This module imports neither it nor the engine: the default front end runs
without torch.

When the engine process dies, every open stream gets `EngineDeadError` (a stream's error
event; a non-streamed request's 503) and a new engine process is started (at most `restarts`
times within RESTART_WINDOW_S): while it loads the model, new requests and /health get 503 with
Retry-After (the seconds the first one took to load); then serving goes on. Past that budget
the engine stays gone: 503 to everything, without Retry-After (`EngineGoneError`: only a
supervisor restarting the server brings it back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Protocol

import zmq

from loom import errors as loom_errors
from loom.config import EngineConfig
from loom.errors import EngineDeadError, EngineGoneError, EngineRestartingError, LoomError
from loom.loader.gguf import GGUFFile
from loom.loader.registry import resolve_model
from loom.loader.tokenizer import LONG_TEXT_CHARS, Tokenizer
from loom.outputs import RequestOutput, shaped, stream_outputs
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.server import wire
from loom.server.metrics import EngineSample

log = logging.getLogger("loom.server")

_POLLIN = int(zmq.POLLIN)   # a plain int: the flag enum's & costs a few microseconds

STARTUP_POLL_MS = 200
SHUTDOWN_GRACE_S = 5.0
DEFAULT_ENGINE_RESTARTS = 3     # engine processes started anew after one dies, within RESTART_WINDOW_S
RESTART_WINDOW_S = 600.0


def engine_process_context():
    """How engine processes start: forked from multiprocessing's fork server, a clean process
    (no thread pools, no sockets) that has imported the engine once (`loom serve` starts it early,
    see loom/cli.py). A plain fork of this process could inherit a used OpenMP pool, which a
    forked child cannot use; a spawned one imports torch and the engine anew, ~1.5 s, every time."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(ENGINE_PROCESS_MODULES)
    return ctx


# What the fork server imports before it forks an engine process: the engine (torch) and this
# module, which names the process's entry point. This process, the HTTP front end, never
# imports the first.
ENGINE_PROCESS_MODULES = ["loom.server.engine_core", __name__]


def _engine_process_main(*args) -> None:
    """The engine process's entry point, `engine_core.run_engine_core` (imported here, not at
    the top: in the fork server's children it is already loaded, and the front end stays
    without torch)."""
    from loom.server.engine_core import run_engine_core

    run_engine_core(*args)


_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in vars(loom_errors).values()
    if isinstance(cls, type) and issubclass(cls, LoomError)}


def _rebuild_error(kind: str, message: str) -> Exception:
    """The engine process's exception as the same class here (a LoomError keeps its HTTP status)."""
    cls = _ERRORS.get(kind)
    if cls is None:
        return RuntimeError(message)
    try:
        return cls(message)
    except TypeError:  # a constructor with other arguments: keep the message, lose the subclass
        return LoomError(message)


class EngineClient(Protocol):
    """What the front end needs of an engine (see the module docstring)."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    cache_info: dict[str, str]      # the KV cache's settings (vLLM's cache_config_info labels)
    max_waiting: int | None
    max_num_seqs: int               # sequences the engine runs at once
    error: BaseException | None
    restarts: int                   # engines started anew after one died

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 priority: int = 0, fanout=None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def closing(self) -> None: ...

    def stats(self) -> EngineSample: ...


class ProcessEngineClient:
    """The engine in its own process, over ZMQ (see the module docstring).

    The constructor starts the process and returns once the model is loaded (raising the
    engine's LoomError if it cannot load); `start()` (inside the server's event loop) starts
    reading its outputs. An engine process that dies while serving is replaced (`restarts` times
    within RESTART_WINDOW_S at most; 0: never): its requests end with EngineDeadError, requests
    arriving while the new one loads get EngineRestartingError (503 with Retry-After), and the
    counters of /metrics start again from zero (a counter reset) with the new process."""

    def __init__(self, config: EngineConfig, log_level: str = "info", restarts: int = DEFAULT_ENGINE_RESTARTS):
        self._args = (config, log_level)
        self.max_waiting, self.max_num_seqs = config.scheduler.max_waiting, config.scheduler.max_num_seqs
        self._max_restarts = restarts
        self._restart_times: list[float] = []
        self.restarts = 0                   # engine processes started after the first
        self._zmq = zmq.Context(1)
        self._encoder = wire.input_encoder()
        self._decoder = wire.output_decoder()
        self._queues: dict[str, asyncio.Queue] = {}
        self._reading: int | None = None    # the output socket's descriptor while the loop watches it
        self._restarting: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()       # the process being replaced vs. shutdown() from another thread
        self._stopping = False
        self._closing = False               # the server was told to stop (the signal may reach the engine too)
        self._loading = False               # an engine process is loading the model (no messages read yet)
        self.error: BaseException | None = None
        self._pidfd: int | None = None      # names the engine process for good (its sentinel is the fork server's)
        started = time.monotonic()
        self._spawn()
        try:  # the tokenizer loads here while the engine process loads the model
            self.tokenizer = Tokenizer.from_gguf(GGUFFile.open(resolve_model(config.load.model)))
            ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._load_seconds = time.monotonic() - started
        self.model_name, self.max_model_len, self.vocab_size = ready.model_name, ready.max_model_len, ready.vocab_size
        self.cache_info = ready.cache_info
        self._stats = ready.stats

    def _spawn(self) -> None:
        """New sockets (at new addresses: nothing meant for a dead process reaches its successor)
        and an engine process that connects to them."""
        with self._lock:
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            self._dir = tempfile.mkdtemp(prefix="loom-engine-")
            input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
            # requests go out through a plain socket (sent without blocking, from any thread),
            # outputs come in through another, read by the loop when its descriptor signals
            self._input = zmq.Context.instance().socket(zmq.PUSH)
            self._input.setsockopt(zmq.LINGER, 0)
            self._input.setsockopt(zmq.SNDHWM, 0)  # a burst of requests during a long step queues, never fails
            self._input.bind(input_addr)
            self._output = self._zmq.socket(zmq.PULL)
            self._output.setsockopt(zmq.LINGER, 0)
            self._output.bind(output_addr)
            self._deltas = wire.DeltaDecoder()
        config, log_level = self._args
        process = engine_process_context().Process(
            target=_engine_process_main, name="loom-engine-core", daemon=True,
            args=(config, input_addr, output_addr, log_level, os.getpid()))
        process.start()   # asks the fork server: not under the lock, which shutdown() takes
        with self._lock:
            self.process = process
            self._pidfd = _pidfd(process.pid)
            stopping = self._stopping
        if stopping:   # shutdown() came while it started and stopped the one before: this one too
            process.kill()
            process.join()
            raise EngineDeadError("the server is shutting down")

    def _wait_ready(self) -> wire.Ready:
        self._loading = True
        try:
            return self._wait_for_ready()
        finally:
            self._loading = False

    def _wait_for_ready(self) -> wire.Ready:
        while True:
            if self._output.poll(STARTUP_POLL_MS):
                msg = self._decoder.decode(self._output.recv())
                if isinstance(msg, wire.Ready):
                    return msg
                self._close_sockets()
                self.process.join(SHUTDOWN_GRACE_S)   # it exits at once after a Failed
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join()
                if isinstance(msg, wire.Failed):
                    raise _rebuild_error(msg.kind, msg.message)
                raise LoomError(f"engine process failed while loading: {msg}")
            if not self.process.is_alive():
                self._close_sockets()
                raise LoomError(f"engine process exited with status {self.process.exitcode} while loading "
                                f"the model (see the log above)")

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._reading is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._watch_outputs()
        self._loop.add_reader(self.process.sentinel, self._on_exit)

    def closing(self) -> None:
        """The server got SIGINT/SIGTERM and is stopping. A signal sent to the whole process
        group (systemd's default, `kill -- -PGID`) reaches the engine process too, which may end
        before shutdown() asks it to: that exit is then the expected one, not a failure to
        report or an engine to replace."""
        self._closing = True

    def shutdown(self) -> None:
        """Stops the engine process (politely, then by signal) and removes its sockets; the
        reader task ends with the sockets. Safe to call twice and from another thread."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self._restarting is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._restarting.cancel)
        if self.process.is_alive() and not self._loading:   # one still loading reads no message: signal it
            try:
                self._input.send(self._encoder.encode(wire.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(SHUTDOWN_GRACE_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(SHUTDOWN_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        _kill(self._pidfd)   # (an engine process the fork server's end left running, too)
        self._pidfd = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        """Closes the sockets on the event loop's thread when it runs (asyncio sockets belong to it)."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop(loop):
            loop.call_soon_threadsafe(self._close_now)
        else:
            self._close_now()

    def _close_now(self) -> None:
        if self._input.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
            if self._reading is not None:
                self._loop.remove_reader(self._reading)
        self._reading = None
        self._input.close(0)
        self._output.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests ----------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, fanout=None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises its admission error (InvalidRequestError,
        QueueFullError, ...) at the first iteration, EngineDeadError if the engine is gone."""
        self._check_alive()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if isinstance(prompt, str):  # tokenized here, off the engine's core
            prompt = {"prompt": prompt, "prompt_token_ids": await off_loop(len(prompt), self.tokenizer.encode, prompt)}
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self._send(wire.AddRequest(rid, prompt, pickle.dumps(params if params is not None else SamplingParams()),
                                       priority, pickle.dumps(fanout) if fanout is not None else None))
            kind = params.output_kind if params is not None else RequestOutputKind.CUMULATIVE
            async with aclosing(stream_outputs(queue, lambda: self.abort(rid))) as outs:
                async for out in shaped(outs, kind is RequestOutputKind.DELTA, kind is RequestOutputKind.FINAL_ONLY):
                    yield out
        finally:
            self._queues.pop(rid, None)
            self._deltas.forget(rid)

    def abort(self, request_id: str) -> None:
        if self.error is None and not self._stopping:
            try:
                self._send(wire.AbortRequests([request_id]))
            except EngineDeadError:
                pass

    def stats(self) -> EngineSample:
        return self._stats

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if self._stopping:
            raise EngineDeadError("the server is shutting down")

    def _send(self, msg) -> None:
        try:
            self._input.send(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"the engine process does not take requests: {e}") from None

    # -- outputs -----------------------------------------------------------------------
    def _watch_outputs(self) -> None:
        """Has the loop read the output socket whenever its descriptor signals. A ZMQ socket's
        descriptor signals a change, not each message: every signal drains all that is waiting,
        and one drain runs now for what came before the watch began. (pyzmq's asyncio sockets did
        the same through futures and flag enums: ~15% of the front end's CPU at 8 streams.)"""
        assert self._loop is not None
        self._reading = self._output.getsockopt(zmq.FD)
        self._loop.add_reader(self._reading, self._drain_outputs)
        self._loop.call_soon(self._drain_outputs)

    def _drain_outputs(self) -> None:
        socket = self._output
        try:
            while socket.getsockopt(zmq.EVENTS) & _POLLIN:
                frame = socket.recv(zmq.NOBLOCK, copy=False)
                try:
                    msg = self._decoder.decode(frame.buffer)
                except Exception:  # noqa: BLE001 - one bad message must not stop the outputs
                    log.exception("undecodable message from the engine process dropped")
                    continue
                self._on_message(msg)
        except zmq.ZMQError:   # the socket was closed (shutdown, or a restart replaced it)
            return

    def _on_message(self, msg) -> None:
        queues = self._queues
        if isinstance(msg, wire.StepOutputs):
            for delta in msg.outputs:
                queue = queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(self._deltas.decode(delta))
            for err in msg.errors:
                queue = queues.get(err.request_id)
                if queue is not None:
                    queue.put_nowait(_rebuild_error(err.kind, err.message))
            self._stats = msg.stats
        elif isinstance(msg, wire.Dead):
            self._fail(EngineDeadError(f"the engine process failed: {msg.message}"))

    def _on_exit(self) -> None:
        """The engine process ended (its sentinel became readable): its requests fail, and a new
        one is started where the restart budget allows."""
        assert self._loop is not None
        self._loop.remove_reader(self.process.sentinel)
        if self._stopping:
            return
        # the sentinel is the fork server's pipe: it also closes when the fork server dies, the
        # engine process still running, reparented. That one is stopped before it is replaced.
        _kill(self._pidfd)
        self._pidfd = None
        self.process.join(0.1)
        code = self.process.exitcode
        if self._closing:
            log.info("the engine process (pid %s) stopped with the server (status %s)", self.process.pid, code)
            self._fail(EngineDeadError("the server is stopping"))
            return
        log.error("the engine process (pid %s) exited with status %s", self.process.pid, code)
        base = str(self.error) if self.error is not None else f"the engine process exited (status {code})"
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S]
        n = len(self._restart_times)
        if n >= self._max_restarts:   # gone for good: its requests' 503s carry no Retry-After
            self._fail(EngineGoneError(
                f"{base}; not restarted: " +
                (f"it was restarted {n} time{'s' if n != 1 else ''} in the last {RESTART_WINDOW_S / 60:.0f} "
                 f"minutes (loom serve --engine-restarts)" if self._max_restarts else
                 "restarts are off (loom serve --engine-restarts 0)")))
            return
        retry_after = max(1, math.ceil(self._load_seconds))   # a new process is about to load
        self._fail(self.error if self.error is not None else EngineRestartingError(base, retry_after=retry_after))
        self._restart_times.append(now)
        self.error = EngineRestartingError(
            f"the engine process exited (status {code}); a new one is loading the model", retry_after=retry_after)
        self._restarting = self._loop.create_task(self._restart(), name="loom-engine-restart")

    async def _restart(self) -> None:
        """Replaces the dead engine process: new sockets, a new process, its Ready awaited on a
        thread (the event loop keeps answering 503s meanwhile)."""
        assert self._loop is not None
        self._close_now()
        try:
            ready = await asyncio.to_thread(self._spawn_and_wait)
        except asyncio.CancelledError:   # shutdown() while the new process loads
            return
        except Exception as e:  # noqa: BLE001 - the server stays up and says why
            if not self._stopping:
                log.error("could not restart the engine process: %s", e)
                self.error = EngineGoneError(f"the engine process exited and could not be restarted: {e}")
            return
        if self._stopping:
            return
        self._stats = ready.stats
        self.restarts += 1
        self._watch_outputs()
        self._loop.add_reader(self.process.sentinel, self._on_exit)
        self.error = None
        log.warning("engine process restarted (pid %s)", self.process.pid)

    def _spawn_and_wait(self) -> wire.Ready:
        self._spawn()
        return self._wait_ready()

    def _fail(self, error: BaseException) -> None:
        """Every request's stream ends with `error`; the load gauges read zero (nothing runs)."""
        self.error = error
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._stats = dataclasses.replace(self._stats, num_running=0, num_waiting=0, kv_usage=0.0)


async def off_loop(size: int, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, on a worker thread where its text is long (`size` characters past
    LONG_TEXT_CHARS, which the tokenizer encodes without holding the GIL): a megabyte prompt
    takes seconds to tokenize, and meanwhile the event loop serves every other stream and
    /health. Short texts run here (a thread costs more than they do)."""
    if size > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _pidfd(pid: int) -> int | None:
    """A descriptor that names process `pid` for good (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _kill(pidfd: int | None) -> None:
    """SIGKILL to the process `pidfd` names, if it still runs; the descriptor is closed."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, OSError):
        pass
    finally:
        os.close(pidfd)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def engine_client(config: EngineConfig, *, engine_process: bool = True, log_level: str = "info",
                  engine_restarts: int = DEFAULT_ENGINE_RESTARTS):
    """The client `loom serve` uses: the engine in its own process (default; restarted up to
    `engine_restarts` times within RESTART_WINDOW_S when it dies) or in this one. Only the second
    imports the engine (torch) into this process: the front end of the default starts in half the
    time without it."""
    if engine_process:
        return ProcessEngineClient(config, log_level=log_level, restarts=engine_restarts)
    from loom.server.in_process import in_process_client

    return in_process_client(config)


