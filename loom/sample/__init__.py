"""Next-token sampling: `Sampler` turns a step's logits into tokens and logprobs."""

from loom.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_allowed,
    apply_banned,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    request_generator,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_allowed",
    "apply_banned",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "request_generator",
]
