"""Running the API with uvicorn: start the engine first, then listen.

By default the engine runs in its own process (`loom/server/engine_core.py`) and this process
is the HTTP front end; `engine_process=False` keeps the engine on a thread of this process.
The socket is bound first (a port in use or a host that does not resolve is one line at once),
then the model is loaded, so a bad model path fails the command with its `LoomError` message
instead of a half-started server; uvicorn serves once it is loaded, and the address is logged
then. SIGINT/SIGTERM stop uvicorn, whose shutdown stops the engine process. An engine process
that dies while serving is replaced (`engine_restarts`, see ProcessEngineClient).
"""

from __future__ import annotations

import logging
import socket

import uvicorn

from loom.config import EngineConfig
from loom.errors import LoomError
from loom.server.engine_client import DEFAULT_ENGINE_RESTARTS, engine_client
from loom.server.limits import Cors
from loom.server.openai_api import DEFAULT_MAX_BODY_BYTES, build_app

log = logging.getLogger("loom.serve")


class _Server(uvicorn.Server):
    """uvicorn that ends open streams as soon as SIGINT/SIGTERM arrives (an error event and
    [DONE]), instead of letting them hold the graceful shutdown until it cancels them."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:   # uvicorn logs its address only for sockets it binds itself
            host, port = sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("serving %s on http://%s:%d (the playground at /, the OpenAI API under /v1)",
                     self.config.app.state.serving.model, shown, port)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        state = self.config.app.state
        serving = getattr(state, "serving", None)
        if serving is not None:
            serving.ae.closing()
        loop = getattr(state, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(state.serving.stop_streams)


def run_server(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_tokens_limit: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info",
               access_log: bool = True, engine_process: bool = True, cors: Cors | None = Cors(),
               engine_restarts: int = DEFAULT_ENGINE_RESTARTS, chat_template: str | None = None) -> None:
    """Loads the model of `config` and serves it until interrupted (Ctrl-C / SIGTERM)."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock = listen(host, port)   # before the model loads: a port in use is one line at once
    try:
        client = engine_client(config, engine_process=engine_process, log_level=log_level,
                               engine_restarts=engine_restarts)
        try:
            app = build_app(client, api_key=api_key, served_model_name=served_model_name,
                            max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes, cors=cors,
                            chat_template=chat_template)
            server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            access_log=access_log, timeout_graceful_shutdown=5))
            server.run(sockets=[sock])
        finally:
            client.shutdown()
    finally:
        sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (as uvicorn binds it); LoomError when it cannot
    be. It listens at once: with SO_REUSEADDR a second server could bind the same port while
    the first loads its model (bound, not yet listening), and then fail to listen silently.
    Connections made during the load wait in the backlog until the server answers."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
    except (OSError, socket.gaierror) as e:
        raise LoomError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
