"""Repacking GGUF quantized blocks into loom's quantized weight forms.

Every form is per 32-element group affine: w = a * q + b, q an unsigned code.

    Q4_0:  w = d * (q - 8)            -> 4-bit, a = d,      b = -8 d
    Q4_1:  w = d * q + m              -> 4-bit, a = d,      b = m
    Q4_K:  w = d*sc * q - dmin*mn     -> 4-bit, a = d*sc,   b = -dmin*mn   (per 32-group of a 256 super-block)
    Q5_0:  w = d * (q - 16)           -> 8-bit codes 0..31, a = d, b = -16 d
    Q5_1:  w = d * q + m              -> 8-bit codes 0..31, a = d, b = m
    Q8_0:  w = d * s, s in -128..127  -> 8-bit codes s + 128, a = d, b = -128 d

These are exact. The kernels' layout (PackedCodes) holds 4-bit codes in nibbles and 8-bit ones
in bytes; Q5_0's 8-bit codes (0..31, zero point 16) in five bits unless the caller asks for bytes:
their low four bits as nibbles, then a plane of their fifth bits. A decode step reads its weights
from memory, and Gemma 3's layers, most of them Q5_0, are 89 MB a step in bytes and 72 MB in five
bits: one-stream steps ran 1.09-1.13x on the AVX2 variant (Zen 2), 1.05-1.07x on the AVX-512 one
and 1.03-1.08x on avxvnni (Xeon), eight streams 0.985-0.996x, 1.01-1.05x and 1.01-1.02x
(docs/benchmarks.md, "Q5_0 in five bits" and "An Intel Xeon with AMX"). Other types (Q6_K, Q5_K, F16, ...) are requantized from their float32
values to 8-bit codes per group (min/max affine), far finer than the source's own step.
torch's int4 kernel (the fallback path) wants `(q - 8) * scale + zero`: scale = a, zero = b + 8 a.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import Q4_K


GROUP = 32
ROWS = 16  # output rows per block of the packed kernel layout


@dataclass
class QuantCodes:
    """q: [N, K] uint8 codes (< 2**bits); a, b: [N, K / 32] float32; w = a * q + b per group."""

    q: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    bits: int

    def permute_rows(self, order: torch.Tensor) -> "QuantCodes":
        return QuantCodes(self.q[order], self.a[order], self.b[order], self.bits)

    @staticmethod
    def cat(parts: list["QuantCodes"]) -> "QuantCodes":
        """Row-stacked; mixed widths are stored as 8-bit (a 4-bit code is a valid 8-bit one)."""
        return QuantCodes(torch.cat([p.q for p in parts]), torch.cat([p.a for p in parts]),
                          torch.cat([p.b for p in parts]), max(p.bits for p in parts))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // GROUP, GROUP) * self.a[..., None] + self.b[..., None]
        return w.view(n, k)

    def int4_scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of torch's int4 form (4-bit codes only)."""
        assert self.bits == 4
        return self.a, self.b + 8 * self.a

    @staticmethod
    def requantize(w: torch.Tensor) -> "QuantCodes":
        """8-bit codes of a float [N, K] matrix, per 32-group min/max (K a multiple of 32)."""
        n, k = w.shape
        g = w.float().view(n, k // GROUP, GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        a = (hi - lo) / 255.0
        safe = torch.where(a > 0, a, torch.ones_like(a))
        q = torch.round((g - lo[..., None]) / safe[..., None]).clamp(0, 255).to(torch.uint8)
        return QuantCodes(q.view(n, k).contiguous(), a.contiguous(), lo.contiguous(), 8)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian 32-bit mask) -> [..., 32] bits, element j = bit j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


EXACT_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q8_0)


def has_exact_codes(qtype: QT) -> bool:
    """Whether `exact_codes` gives the stored type's codes (else it returns None)."""
    return qtype in EXACT_TYPES


def exact_codes(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> QuantCodes | None:
    """The exact code form of a [N, K] tensor stored as `qtype`, or None if it has none."""
    n, k = shape
    if qtype == QT.Q4_0:
        b = raw.reshape(n, k // 32, 18)
        d = _f16(b[..., :2])
        q, a, off, bits = _nibbles(b[..., 2:]), d, -8 * d, 4
    elif qtype == QT.Q4_1:
        b = raw.reshape(n, k // 32, 20)
        q, a, off, bits = _nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]), 4
    elif qtype == QT.Q4_K:
        nb = n * (k // 256)
        b = raw.reshape(nb, 144)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)          # [nb, 1]
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)      # [nb, 1]
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])                           # [nb, 8] each
        # 4 chunks of 32 bytes; low nibbles -> sub-block 2j, high nibbles -> sub-block 2j+1
        qs = b[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k // 32, 32)
        a = (d * sc.astype(np.float32)).reshape(n, k // 32)
        off = -(dmin * mn.astype(np.float32)).reshape(n, k // 32)
        bits = 4
    elif qtype == QT.Q5_0:
        b = raw.reshape(n, k // 32, 22)
        d = _f16(b[..., :2])
        q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
        a, off, bits = d, -16 * d, 8
    elif qtype == QT.Q5_1:
        b = raw.reshape(n, k // 32, 24)
        q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
        a, off, bits = _f16(b[..., :2]), _f16(b[..., 2:4]), 8
    elif qtype == QT.Q8_0:
        b = raw.reshape(n, k // 32, 34)
        d = _f16(b[..., :2])
        q = b[..., 2:] ^ np.uint8(0x80)                                   # s + 128 for s in -128..127
        a, off, bits = d, -128 * d, 8
    else:
        return None
    return QuantCodes(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)),
                      torch.from_numpy(np.ascontiguousarray(off, dtype=np.float32)), bits)


# Q4_0; Q5_0, Q8_0: the kernels' integer zero points per width. A zero point Z also bounds the
# codes below 2 Z (Q5_0's are 0..31), which the AVX2 variant's integer path relies on.
ZERO_POINTS = {4: (8,), 8: (16, 128)}


@dataclass
class PackedCodes:
    """The kernel layout (see loom/kernels/csrc): one uint8 stream of blocks, each 16 output
    rows x one group: [codes][a x 16][b x 16], a/b float16 when that is exact, else float32.
    bits: 4, 5 (Q5_0's codes: 256 bytes of their low nibbles, 64 of their fifth bits) or 8.
    zero: Z where every group's offset is b = -Z a (an integer zero point, which the kernels
    subtract in integer arithmetic; the blocks then hold no b: [codes][a x 16]), else 0."""

    w: torch.Tensor
    n: int
    k: int
    bits: int
    scales16: bool
    zero: int = 0


def zero_point(c: QuantCodes) -> int:
    """The integer zero point Z of `c` (b = -Z a in every group, exactly, and codes below 2 Z), or 0."""
    return next(iter(_zero_points(c)), 0)


def _zero_points(c: QuantCodes) -> tuple[int, ...]:
    """Every zero point of c's width that holds for `c`, in ZERO_POINTS' order."""
    return tuple(z for z in ZERO_POINTS[c.bits] if torch.equal(c.b, c.a * -z) and _codes_below(c, 2 * z))


def _codes_below(c: QuantCodes, bound: int) -> bool:
    return bound >= 2 ** c.bits or int(c.q.max()) < bound


def _packed_bits(bits: int, zero: int, five_bit: bool) -> int:
    """The layout's code width: Q5_0's 8-bit codes (zero point 16: below 32) in five bits if asked."""
    return 5 if five_bit and bits == 8 and zero == 16 else bits


def pack_codes(c: QuantCodes, chunk_blocks: int = 512, zero: int | None = None,
               five_bit: bool = True) -> PackedCodes:
    """The kernel layout of `c`, built `chunk_blocks` row blocks at a time into one output (a
    262k-row matrix never has a second full-size copy in flight). zero: the layout's zero point,
    by default `zero_point(c)`; 0 keeps every offset (the affine layout of any matrix).
    five_bit: 8-bit codes with zero point 16 (Q5_0's) packed in five bits, else in bytes."""
    n, k = c.q.shape
    zero = zero_point(c) if zero is None else zero
    if zero and not torch.equal(c.b, c.a * -zero):
        raise ValueError(f"zero point {zero} does not hold for every group")
    if zero and not _codes_below(c, 2 * zero):
        raise ValueError(f"zero point {zero} needs codes below {2 * zero}")
    stored = (c.a,) if zero else (c.a, c.b)   # b = -zero a is not stored
    layout = _Layout(_packed_bits(c.bits, zero, five_bit), zero, torch.float16 if all(_fits_half(t) for t in stored) else torch.float32)
    w = layout.empty(n, k)
    for r0 in range(0, n, chunk_blocks * ROWS):
        r1 = min(r0 + chunk_blocks * ROWS, n)
        layout.pack(w, r0, r1, QuantCodes(c.q[r0:r1], c.a[r0:r1], c.b[r0:r1], c.bits))
    return PackedCodes(w, n, k, layout.bits, layout.dt == torch.float16, zero)


def pack_rows(n: int, k: int, rows: Callable[[int, int], QuantCodes], chunk_rows: int = ROWS * 512,
              five_bit: bool = True) -> PackedCodes:
    """`pack_codes` of an [n, k] matrix whose codes come by row range (`rows(r0, r1)`: the codes
    of rows r0 .. r1 - 1), so that no full-size copy of its codes is ever made. The first range
    chooses the layout (zero point, float16 scales); should a later range not fit it, the layout
    is chosen over every range and the packing starts again. The result equals pack_codes of the
    whole matrix's codes."""
    assert chunk_rows % ROWS == 0
    spans = [(r0, min(r0 + chunk_rows, n)) for r0 in range(0, n, chunk_rows)]
    layout = w = None
    for r0, r1 in spans:
        c = rows(r0, r1)
        if layout is None:
            layout = _Layout.of(c, five_bit)
            w = layout.empty(n, k)
        elif not layout.fits(c):
            layout = _Layout.over((rows(*span) for span in spans), five_bit)
            w = layout.empty(n, k)
            for s0, s1 in spans:
                layout.pack(w, s0, s1, rows(s0, s1))
            break
        layout.pack(w, r0, r1, c)
    return PackedCodes(w, n, k, layout.bits, layout.dt == torch.float16, layout.zero)


@dataclass(frozen=True)
class _Layout:
    """pack_codes' choices for a matrix: the code width, the zero point, the scales' type."""

    bits: int
    zero: int
    dt: torch.dtype

    @staticmethod
    def over(parts, five_bit: bool = False) -> "_Layout":
        bits, zeros, a16, b16 = None, None, True, True
        for c in parts:
            if bits is not None and c.bits != bits:
                raise ValueError(f"row ranges of {bits}-bit and {c.bits}-bit codes in one matrix")
            bits, z = c.bits, _zero_points(c)
            zeros = z if zeros is None else tuple(x for x in zeros if x in z)
            a16, b16 = a16 and _fits_half(c.a), b16 and _fits_half(c.b)
        zero = next(iter(zeros), 0)
        return _Layout(_packed_bits(bits, zero, five_bit), zero, torch.float16 if a16 and (zero or b16) else torch.float32)

    @staticmethod
    def of(c: QuantCodes, five_bit: bool = False) -> "_Layout":
        return _Layout.over([c], five_bit)

    def fits(self, c: QuantCodes) -> bool:
        """Whether rows `c` can be packed in this layout as pack_codes would pack them."""
        return ((c.bits == self.bits or (self.bits, c.bits) == (5, 8))   # five bits: 8-bit codes below 32
                and (not self.zero or self.zero in _zero_points(c))
                and (self.dt == torch.float32 or all(_fits_half(t) for t in self.stored(c))))

    def stored(self, c: QuantCodes) -> list[torch.Tensor]:
        return [c.a] if self.zero else [c.a, c.b]

    @property
    def code_bytes(self) -> int:
        return ROWS * GROUP * self.bits // 8

    def empty(self, n: int, k: int) -> torch.Tensor:
        block = self.code_bytes + (1 if self.zero else 2) * ROWS * self.dt.itemsize
        return torch.empty(-(-n // ROWS), k // GROUP, block, dtype=torch.uint8)

    def pack(self, w: torch.Tensor, r0: int, r1: int, c: QuantCodes) -> None:
        """Rows r0 .. r1 - 1 (codes `c`) into `w`; r0 a multiple of ROWS."""
        _pack_blocks(w[r0 // ROWS:-(-r1 // ROWS)], c.q, self.stored(c), self.bits, self.code_bytes, self.dt)


def _fits_half(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)


def _pack_blocks(out: torch.Tensor, q: torch.Tensor, scales: list[torch.Tensor], bits: int, code_bytes: int,
                 dt: torch.dtype) -> None:
    """Rows of whole 16-row blocks (the last one zero-padded) into `out` [blocks, groups, bytes];
    scales: a, then b unless the layout has a zero point."""
    n, k = q.shape
    g = k // GROUP
    pad = (-n) % ROWS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scales = [torch.cat([t, t.new_zeros(pad, g)]) for t in scales]
    nb = q.shape[0] // ROWS
    if bits in (4, 5):
        # k within a group = 8 c + 4 h + j: byte (c, row, j) = code(8c + j) | code(8c + 4 + j) << 4
        low = q & 0x0F
        v = low.view(nb, ROWS, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)      # nb, g, c, row, j, h
        out[..., :256].view(nb, g, 4, ROWS, 4).copy_(v[..., 0] | (v[..., 1] << 4))
        if bits == 5:   # the plane: byte (row, j), bit c = the fifth bit of code(4c + j)
            fifth = ((q >> 4) & 1).view(nb, ROWS, g, 8, 4).permute(0, 2, 1, 4, 3)   # nb, g, row, j, c
            weights = torch.tensor([1 << c for c in range(8)], dtype=torch.uint8)
            out[..., 256:320].view(nb, g, ROWS, 4).copy_((fifth * weights).sum(-1, dtype=torch.uint8))
    else:   # bytes (c, row, j) = code(4c + j) of the row: 4-byte runs, moved as int32
        runs = q.contiguous().view(torch.int32).view(nb, ROWS, g, 8).permute(0, 2, 3, 1)   # nb, g, c, row
        out[..., :code_bytes].view(torch.int32).view(nb, g, 8, ROWS).copy_(runs)
    step = ROWS * dt.itemsize
    for i, t in enumerate(scales):
        start = code_bytes + i * step
        out[..., start:start + step].view(dt).copy_(t.view(nb, ROWS, g).permute(0, 2, 1))
