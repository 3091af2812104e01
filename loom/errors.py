"""Exceptions a user of loom can cause, each with a message that names the problem.

Everything loom raises on purpose derives from `LoomError`, so callers (the CLI, the
server) can turn it into a clear message or an HTTP 4xx without catching bugs too.
"""


class LoomError(Exception):
    """Base class of every error loom raises for bad input or environment."""


class ModelLoadError(LoomError):
    """A model file is missing, unreadable, corrupt or of an unsupported kind."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"cannot load model file '{self.path}': {problem}")


class RegistryError(LoomError):
    """A model name is unknown or its package could not be fetched."""


class TokenizerError(LoomError, ValueError):
    """The tokenizer or chat template in a model file cannot serve the request (a ValueError, as
    transformers' and vLLM's tokenizers raise for it)."""


class InvalidRequestError(LoomError, ValueError):
    """A request's prompt or sampling parameters are invalid."""


class ContextLengthError(InvalidRequestError):
    """A prompt that leaves no room to generate within the context (OpenAI's
    context_length_exceeded)."""


class QueueFullError(InvalidRequestError):
    """The bounded waiting queue is full; retry later."""


class EngineDeadError(LoomError):
    """The engine (its process or thread) is gone: nothing can be served until it is restarted."""


class EngineGoneError(EngineDeadError):
    """The engine process died and no new one will start (loom serve --engine-restarts used up,
    or off, or a restart failed): only restarting the server brings it back, so a 503 carries
    no Retry-After."""


class EngineRestartingError(EngineDeadError):
    """The engine process died and a new one is loading the model: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def check_option_keys(name: str, value: dict, known: list[str], required: str, choices) -> None:
    """InvalidRequestError for an options object `name` (e.g. speculative_config) with keys not
    in `known`, or without its `required` key (one of `choices`)."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidRequestError(f"unknown {name} key(s) {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    if required not in value:
        raise InvalidRequestError(f"{name} needs a '{required}' (one of {', '.join(choices)})")
