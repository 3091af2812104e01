"""Drafters, one module each, registered by name in `DRAFTERS` (see base.py)."""

from loom.speculative.drafters import (  # noqa: F401 (register)
    auto, draft_model, grammar, lookahead, prediction, prompt_lookup, retrieval, token_recycling)
from loom.speculative.drafters.base import DRAFTERS, DraftEnv, Drafter, DraftRequest, Observation, register

__all__ = ["DRAFTERS", "DraftEnv", "DraftRequest", "Drafter", "Observation", "register"]
