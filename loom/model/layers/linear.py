"""Linear backends: the one interface every projection goes through.

A backend is built once from a `LinearWeight` and called on activations [M, in] ->
[M, out] (float32 in, float32 out). Fused projections (QKV, gate/up) are one backend over
row-stacked weights, split by the caller.

    exact     dense float32 (MKL): the reference mode, bit-identical to transformers
    bf16      dense bfloat16 (oneDNN): compute-bound shapes, on CPUs with native bf16
    quant     loom's kernels (loom/kernels): the GGUF codes themselves (4-bit, or 8-bit
              where the type needs it) times int8-quantized activations, integer dot products
              (AVX-512 VNNI or AVX2);
              one kernel for every M, with RMSNorm / SwiGLU / GeGLU and the residual add fused
    int4      torch's group-wise int4 kernel over exact 4-bit codes (bf16 activations)
    int8      torch's per-channel int8 kernel (bf16 activations)
    auto      quant where loom's kernels run on this CPU; otherwise int4/int8 while M is
              small (memory-bound) and a dense GEMM above, bf16 only with native bf16

Backends are registered by name in LINEAR_MODES; `make_linear(weight, mode)` builds one.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from loom import kernels
from loom.kernels.cpu import has_native_bf16
from loom.model.quant import GROUP, QuantCodes
from loom.model.weights import LinearWeight

# Rows (tokens) above which a dense GEMM beats torch's weight-only kernels (fallback path).
AUTO_MAX_SMALL_M = 16

# Activation pre-ops fused into QuantLinear (values shared with loom_kernels.cpp).
PRE_NONE, PRE_RMSNORM, PRE_SWIGLU, PRE_GEGLU = 0, 1, 2, 3


class LinearBackend(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """y = x @ W^T with W stored densely in `dtype`."""

    def __init__(self, weight: LinearWeight | torch.Tensor, dtype: torch.dtype = torch.float32):
        w = weight.dense if isinstance(weight, LinearWeight) else weight
        self.weight = w.to(dtype).contiguous()  # [out, in]
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class Int4Linear:
    """torch's group-wise (32) int4 kernel: w = (q - 8) * scale + zero. Its float32-activation
    path is a slow reference loop, so activations go in as bfloat16."""

    def __init__(self, codes: QuantCodes):
        n, k = codes.q.shape
        self.out_features, self.in_features = n, k
        scale, zero = codes.int4_scale_zero()
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros).float()


class Int8Linear:
    """Per-output-channel int8 weights (w ~ q * scale), bfloat16 activations (torch's fast path)."""

    def __init__(self, weight: LinearWeight | torch.Tensor):
        w = weight.dense if isinstance(weight, LinearWeight) else weight
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale).float()


class QuantLinear:
    """loom's integer kernel over the weight's codes. Besides y = x @ W^T it fuses a pre-op on x
    (RMSNorm with `norm`, or SwiGLU / GeGLU of x = [gate | up]) and `out += y`."""

    fused = True

    def __init__(self, weight: LinearWeight):
        self.kern = kernels.load()
        if self.kern is None:
            raise RuntimeError(f"loom kernels unavailable: {kernels.unavailable_reason()}")
        self.p = weight.packed()
        self.out_features, self.in_features = self.p.n, self.p.k

    def __call__(self, x: torch.Tensor, pre: int = PRE_NONE, norm: torch.Tensor | None = None,
                 eps: float = 0.0, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        p = self.p
        return self.kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, pre, norm, eps, out, accumulate, p.zero)

    def refine_top(self, x: torch.Tensor, y: torch.Tensor, margin: float, cap: int,
                   argmax: torch.Tensor | None = None) -> torch.Tensor:
        """y = self(x) [M, out]: the entries within `margin` of each row's maximum (the `cap`
        largest) computed again in float32 from the same codes, in place (the output layer's).
        argmax [M] int64, if given: each row's argmax afterwards where the refinement decides it
        (its best value above every entry it left alone), else -1."""
        p = self.p
        self.kern.refine_logits(y, x, p.w, p.n, p.k, p.bits, p.scales16, p.zero, margin, cap, argmax)
        return y

    def top_logits(self, x: torch.Tensor, margin: float, cap: int, argmax: torch.Tensor | None = None,
                   logits: bool = True) -> torch.Tensor | None:
        """refine_top(x, self(x), margin, cap, argmax) in one kernel call (cap >= 1): on AVX-512 the
        GEMM's tiles gather each row's candidates while its logits are in registers, so the rows
        are not read back from memory twice. The same logits, bit for bit; an argmax it gives is
        the refined row's, as refine_top's (it may leave to the caller a row where a thread cut
        its candidates within the margin and refine_top decided).

        logits=False (argmax required): the caller wants only the argmax. On AVX-512 the logits
        are then never stored and None is returned, the argmax as with them except that a row
        with a NaN logit gets -1 as well; elsewhere the logits come as usual."""
        p = self.p
        y = self.kern.qgemm_top(x, p.w, p.n, p.k, p.bits, p.scales16, p.zero, margin, cap, None, argmax, logits)
        return None if y.shape[1] != p.n else y


class AdaptiveLinear:
    """Fallback of `auto`: torch's weight-only kernels for small M (bandwidth-bound), a dense GEMM above."""

    def __init__(self, weight: LinearWeight, max_small_m: int = AUTO_MAX_SMALL_M):
        self.small = Int4Linear(weight.int4) if weight.int4 is not None else Int8Linear(weight)
        self.large = DenseLinear(weight, torch.bfloat16 if has_native_bf16() else torch.float32)
        self.max_small_m = max_small_m
        self.out_features, self.in_features = self.large.out_features, self.large.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.max_small_m else self.large(x)


# The output layer's top logits in float32 (QuantLinear.refine_top): those within this many nats
# of a row's maximum, at most this many of them. The int8 rounding of the activations is the
# largest error the default mode adds to the output layer (docs/benchmarks.md, "Fidelity").
TOP_LOGITS_MARGIN, TOP_LOGITS_CAP = 8.0, 64


def output_logits(head: LinearBackend, hidden: torch.Tensor, argmax: torch.Tensor | None = None,
                  argmax_only: bool = False) -> torch.Tensor | None:
    """hidden [N, D] -> float32 logits [N, V]; on loom's kernels the rows' top logits are
    computed again in float32 (an exact product of the stored weights), from the packed codes
    the GEMM has just read: a tied embedding table's own rows would be faster to read (one
    contiguous row each) but map pages of the GGUF that nothing else touches, up to 50 MB of
    Gemma 3's resident set (docs/benchmarks.md, "Peak RSS: the GGUF pages the refinement mapped").

    argmax [N] int64, if given, is filled with each row's argmax of the returned logits where the
    refinement already knows it (ties: the lower id, as `argmax_rows`), else -1: a greedy step
    then skips its own pass over the vocabulary.

    argmax_only (argmax given): the caller reads nothing but the argmax (a step of plain greedy
    rows). Where the kernel can leave the logits unstored (AVX-512: a 32-row Gemma 3 step writes
    33.5 MB of them) None is returned and every row's argmax is known; a row it cannot decide
    without them makes the call compute the logits as usual."""
    if TOP_LOGITS_CAP and isinstance(head, QuantLinear) and hidden.dtype == torch.float32:
        hidden = hidden.contiguous()
        if argmax_only and argmax is not None:
            logits = head.top_logits(hidden, TOP_LOGITS_MARGIN, TOP_LOGITS_CAP, argmax, logits=False)
            if logits is not None or bool((argmax >= 0).all()):
                return logits
        return head.top_logits(hidden, TOP_LOGITS_MARGIN, TOP_LOGITS_CAP, argmax)
    logits = head(hidden).float()
    if argmax is not None:
        argmax.fill_(-1)
    return logits


LINEAR_MODES: dict[str, Callable[[LinearWeight], LinearBackend]] = {
    "exact": lambda w: DenseLinear(w, torch.float32),
    "bf16": lambda w: DenseLinear(w, torch.bfloat16),
    "int4": lambda w: Int4Linear(w.int4) if w.int4 is not None else Int8Linear(w),
    "int8": Int8Linear,
    "quant": QuantLinear,
    "auto": lambda w: QuantLinear(w) if kernels.available() and w.shape[1] % GROUP == 0 else AdaptiveLinear(w),
}


def fused_kernels(backends: list[LinearBackend], head_dim: int, hidden: int):
    """loom's kernel module when every projection runs on it and the shapes suit its fused
    ops (a model then takes its fused forward), else None."""
    if all(getattr(b, "fused", False) for b in backends) and head_dim % 16 == 0 and hidden % 16 == 0:
        return kernels.load()
    return None


def make_linear(weight: LinearWeight | torch.Tensor, mode: str = "exact") -> LinearBackend:
    if mode not in LINEAR_MODES:
        raise ValueError(f"unknown linear mode '{mode}' (known: {', '.join(LINEAR_MODES)})")
    if isinstance(weight, torch.Tensor):
        weight = LinearWeight(weight)
    return LINEAR_MODES[mode](weight)
