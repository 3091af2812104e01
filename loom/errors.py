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


class TokenizerError(LoomError):
    """The tokenizer or chat template in a model file cannot serve the request."""


class InvalidRequestError(LoomError, ValueError):
    """A request's prompt or sampling parameters are invalid."""


class EngineDeadError(LoomError):
    """The engine (its process or thread) is gone: nothing can be served until it is restarted."""
