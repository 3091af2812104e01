"""The engine-core process: owns the model and runs the step loop; the HTTP front end is elsewhere.

`run_engine_core` is the process's entry point (started by `ProcessEngineClient`). It loads
the engine, says `Ready` (or `Failed`), then loops:

    inputs  = every message waiting (blocking only while idle)   # add / abort / shutdown
    outputs = engine.step()                                      # schedule, execute, update
    send one StepOutputs: the step's outputs (as deltas), admission errors, the engine's counters

so the front end receives one message per step, whatever the batch size. The process
ignores SIGINT (the front end owns the terminal and stops it with `Shutdown`), and dies with
the front end, whichever process forked it (a thread waits on the front end's pidfd and sends
this process SIGTERM when it exits, as PR_SET_PDEATHSIG would for a parent): no orphans.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import signal
import sys
import threading
import time

import zmq

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.errors import LoomError
from loom.server import wire
from loom.server.metrics import read_engine_sample

log = logging.getLogger("loom.engine_core")

IDLE_POLL_MS = 500
_POLLIN = int(zmq.POLLIN)   # a plain int: the flag enum's & costs a few microseconds
FRONT_CHECK_S = 0.5


class EngineCore:
    """The step loop over two ZMQ sockets (see the module docstring)."""

    def __init__(self, engine: Engine, inputs: zmq.Socket, outputs: zmq.Socket):
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.decoder = wire.input_decoder()
        self.encoder = wire.output_encoder()
        self.deltas = wire.DeltaEncoder()
        self.running = True

    def run(self) -> None:
        while self.running:
            pending_out: list = []
            errors: list[wire.RequestError] = []
            busy = self.engine.has_unfinished_requests()
            if not busy and not self.inputs.poll(IDLE_POLL_MS):
                continue
            self._drain(pending_out, errors)
            if self.running and self.engine.has_unfinished_requests():
                try:
                    pending_out.extend(self.engine.step())
                except BaseException as e:  # a bug: the front end fails every stream instead of hanging
                    self._send(wire.Dead(f"engine step failed: {e!r}"))
                    raise
            if pending_out or errors or not busy:
                self._send(wire.StepOutputs([self.deltas.encode(o) for o in pending_out], errors,
                                            read_engine_sample(self.engine)))

    def _drain(self, pending_out: list, errors: list[wire.RequestError]) -> None:
        """Handles every input message waiting now, without blocking. The socket's event flags
        say whether one is waiting: a non-blocking receive on an empty socket raises zmq.Again,
        whose construction cost ~2% of a decode step's time here (py-spy, 8 streams)."""
        while self.inputs.getsockopt(zmq.EVENTS) & _POLLIN:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(frame.buffer)
            except Exception:  # noqa: BLE001 - a malformed message must not stop the engine
                log.exception("undecodable input message dropped")
                continue
            if isinstance(msg, wire.AddRequest):
                self._add(msg, errors)
            elif isinstance(msg, wire.AbortRequests):
                for rid in msg.request_ids:
                    pending_out.extend(self.engine.abort(rid))
            else:
                self.running = False
                return

    def _add(self, msg: wire.AddRequest, errors: list[wire.RequestError]) -> None:
        try:
            fanout = pickle.loads(msg.fanout) if msg.fanout is not None else None
            self.engine.add_request(msg.prompt, pickle.loads(msg.params), msg.request_id, msg.priority, fanout=fanout)
        except LoomError as e:
            errors.append(wire.RequestError(msg.request_id, type(e).__name__, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug in admission fails this request, not the engine
            log.exception("add_request failed")
            errors.append(wire.RequestError(msg.request_id, "RuntimeError", f"engine refused the request: {e!r}"))

    def _send(self, msg) -> None:
        self.outputs.send(self.encoder.encode(msg), copy=False)


def _die_with(front_pid: int, ipc_dir: str | None = None) -> None:
    """SIGTERM to this process when `front_pid` exits (the engine process is forked from
    multiprocessing's fork server, so the front end is not its parent and PR_SET_PDEATHSIG, which
    follows the parent, does not apply), after removing `ipc_dir`, the sockets' directory the
    front end would have removed. Where pidfds are missing (not Linux 5.3+) the thread checks the
    process every FRONT_CHECK_S instead."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(front_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(front_pid):
                time.sleep(FRONT_CHECK_S)
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    if not _alive(front_pid):
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="loom-front-end-watch", daemon=True).start()


def _ipc_dir(address: str) -> str | None:
    """The directory of an ipc:// socket the front end made for this engine (loom-engine-*)."""
    path = address.removeprefix("ipc://") if address.startswith("ipc://") else None
    parent = os.path.dirname(path) if path else None
    return parent if parent and os.path.basename(parent).startswith("loom-engine-") else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)   # PermissionError: it exists, under another user
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str = "info",
                    front_pid: int | None = None) -> None:
    """Entry point of the engine-core process (see the module docstring); `front_pid`: the
    front end's process (default: the parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(front_pid if front_pid is not None else os.getppid(), _ipc_dir(input_addr))
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context(1)
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_addr)
    encoder = wire.output_encoder()
    try:
        engine = Engine(config)
    except LoomError as e:   # both sockets closed before the context ends (an open one holds term() forever)
        outputs.send(encoder.encode(wire.Failed(type(e).__name__, str(e))))
        _close(ctx, inputs, outputs)
        sys.exit(1)
    except BaseException:
        _close(ctx, inputs, outputs)
        raise
    outputs.send(encoder.encode(wire.Ready(str(engine.model_name), int(engine.max_model_len),
                                           int(engine.model.cfg.vocab_size), read_engine_sample(engine),
                                           dict(engine.cache_info))))
    try:
        EngineCore(engine, inputs, outputs).run()
    finally:
        _close(ctx, inputs, outputs)


def _close(ctx: zmq.Context, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
    """Inputs dropped, outputs sent (within their linger), then the context ended."""
    inputs.close(linger=0)
    outputs.close()
    ctx.term()
