"""One pass over the windows: per scored token its negative log-likelihood under the evaluated
source and, against a reference, the KL divergence KL(ref || eval), whether the two agree on
the most probable token, and the shift in the probability of the actual next token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from loom.errors import LoomError
from loom.eval.sources import BaseWriter, LogprobSource
from loom.eval.windows import Windows


@dataclass
class EvalResult:
    label: str
    reference: str | None
    nll: np.ndarray                              # [N] -log p(token) under the evaluated source
    ref_nll: np.ndarray | None = None            # [N] the same under the reference
    kld: np.ndarray | None = None                # [N] KL(reference || evaluated), nats
    same_top: np.ndarray | None = None           # [N] bool: both put the same token first
    dp: np.ndarray | None = None                 # [N] p_eval(token) - p_ref(token)
    info: dict = field(default_factory=dict)


def _paired(a: Iterator[torch.Tensor], b: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Two streams of row slices over the same positions, cut so that each pair has as many rows."""
    xa = xb = None
    while True:
        xa = xa if xa is not None and len(xa) else next(a, None)
        xb = xb if xb is not None and len(xb) else next(b, None)
        if xa is None or xb is None:
            return
        r = min(len(xa), len(xb))
        yield xa[:r], xb[:r]
        xa, xb = xa[r:], xb[r:]


def evaluate(windows: Windows, source: LogprobSource, reference: LogprobSource | None = None,
             save: BaseWriter | None = None,
             progress: Callable[[int], None] | None = None) -> EvalResult:
    """Scores every window with `source` (and `reference`, slice for slice); `save` receives the
    evaluated log-probabilities; `progress(k)` is called after window k."""
    if reference is not None and reference.vocab_size != source.vocab_size:
        raise LoomError(f"{source.label} has {source.vocab_size} tokens in its vocabulary, "
                        f"{reference.label} {reference.vocab_size}: they cannot be compared")
    nll, ref_nll, kld, same, dp = [], [], [], [], []
    for k, w in enumerate(windows.windows):
        targets = torch.tensor(w.targets, dtype=torch.int64)
        at = 0
        pairs = _paired(source.logprobs(w), reference.logprobs(w)) if reference is not None else \
            ((lp, None) for lp in source.logprobs(w))
        for lp, ref in pairs:                                           # [r, V] each
            r = lp.shape[0]
            t = targets[at:at + r, None]
            lp_t = lp.gather(1, t)[:, 0]
            nll.append(-lp_t)
            if save is not None:
                save.add(lp)
            if ref is not None:
                if ref.shape != lp.shape:
                    raise LoomError(f"{reference.label} has a vocabulary of {ref.shape[1]}, {source.label} "
                                    f"of {lp.shape[1]}")
                ref_t = ref.gather(1, t)[:, 0]
                ref_nll.append(-ref_t)
                p_ref = ref.exp()
                kld.append((p_ref * (ref - lp)).sum(dim=1).clamp(min=0.0))
                same.append(ref.argmax(dim=1) == lp.argmax(dim=1))
                dp.append(lp_t.exp() - ref_t.exp())
            at += r
        if at != len(w.targets):
            raise LoomError(f"{source.label} scored {at} of the {len(w.targets)} tokens of window {k}")
        if progress is not None:
            progress(k)
    cat = lambda xs: torch.cat(xs).double().numpy() if xs else None   # noqa: E731
    return EvalResult(source.label, reference.label if reference is not None else None, cat(nll),
                      cat(ref_nll), cat(kld), torch.cat(same).numpy() if same else None, cat(dp))
