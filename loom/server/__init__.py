"""The OpenAI-compatible HTTP server: `build_app(engine_client, ...)` and `run_server(...)`."""

from loom.server.openai_api import build_app
from loom.server.serve import run_server

__all__ = ["build_app", "run_server"]
