"""loom's compiled kernels and the quantized weight forms they read.

  * exact code forms of GGUF blocks decode to exactly what the gguf package decodes;
  * the packed GEMM equals a torch reference of the same arithmetic (int8 activations per
    32-group), with every fused pre-op and the residual add, for M = 1 .. 40;
  * rows do not depend on the batch they are computed in;
  * RoPE + cache store and decode attention equal the torch path;
  * a model in `auto` mode stays close to the exact mode, and falls back to torch without the kernels;
  * the variant built (AVX-512 or AVX2) is the first this CPU can run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_gguf
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from loom import kernels
from loom.kernels.cpu import cpu_flags
from loom.model.kv_cache import KVCacheTensors, cache_rows, store_rows
from loom.model.kv_dtypes import FORMATS, kv_format
from loom.model.layers.attention import AttentionMetadata, paged_attention, tree_attention_mask
from loom.model.layers.linear import PRE_GEGLU, PRE_NONE, PRE_RMSNORM, PRE_SWIGLU, QuantLinear, make_linear
from loom.model.layers.rope import RotaryEmbedding, apply_rope
from loom.model.quant import QuantCodes, exact_codes, pack_codes, pack_rows, zero_point
from loom.model.weights import LinearWeight

# Only a CPU without the instructions of any variant (AVX-512 VNNI, or AVX2 + FMA + F16C)
# excuses a kernel test; on one that has them, a failed build fails these tests
# (kernels.load() returns None) instead of skipping them.
_missing = {name: [f for f in flags if f not in cpu_flags()] for name, flags in kernels.REQUIRED_FLAGS.items()}
needs_kernels = pytest.mark.skipif(all(_missing.values()), reason="this CPU lacks " + " and ".join(
    f"{name} ({', '.join(m)})" for name, m in _missing.items()))


@needs_kernels
def test_the_built_variant_is_the_one_asked_for():
    """LOOM_KERNELS unset or auto: the CPU's first choice; avx2 / avx512: that one (make test
    runs this file once per variant the CPU supports)."""
    assert kernels.load() is not None, kernels.unavailable_reason()
    assert kernels.cpu_variant() in kernels.VARIANTS
    assert kernels.variant() == kernels.requested_variant()
    if os.environ.get("LOOM_KERNELS", "auto") in ("auto", "1", ""):
        assert kernels.variant() == kernels.cpu_variant()
    else:
        assert kernels.variant() == os.environ["LOOM_KERNELS"]


@needs_kernels
def test_a_build_is_imported_under_a_name_of_its_own():
    """Two builds of one variant (this tree's and another checkout's, as benchmarks/attn_batch.py
    and step_ab.py compare them) must load as two modules: Python keeps one module per name."""
    module = kernels.load()
    assert module.__name__ == f"loom_kernels_{kernels.variant()}_{kernels.build_key()}"


@needs_kernels
def test_a_build_killed_half_way_leaves_no_lock_that_holds_the_next_start(monkeypatch, tmp_path):
    """torch's build lock file, left by a build killed mid-compile, is stale under loom's own
    flock (which dies with its holder): the next load removes it and goes on."""
    import shutil

    variant = kernels.variant()
    built = kernels._build_dir(variant)
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    copy = kernels._build_dir(variant)
    shutil.copytree(built, copy)
    (copy / "lock").touch()
    module = kernels.build(variant)
    assert module.build_key == copy.name and not (copy / "lock").exists()


def test_loom_kernels_switch_names_the_choices_and_the_missing_flags(monkeypatch):
    avx2_only = frozenset({"avx2", "fma", "f16c"})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: avx2_only)
    monkeypatch.setenv("LOOM_KERNELS", "avx2")
    assert kernels.requested_variant() == "avx2"
    monkeypatch.setenv("LOOM_KERNELS", "auto")
    assert kernels.requested_variant() == "avx2"
    assert kernels.supported_variants() == ["avx2"]
    monkeypatch.setenv("LOOM_KERNELS", "avx512")
    with pytest.raises(kernels.KernelVariantError, match="lacks avx512f, avx512bw, avx512vl, avx512_vnni"):
        kernels.requested_variant()
    monkeypatch.setenv("LOOM_KERNELS", "sse2")
    with pytest.raises(kernels.KernelVariantError, match="one of auto, avx512, avxvnni, avx2, 0; got 'sse2'"):
        kernels.requested_variant()
    monkeypatch.setenv("LOOM_KERNELS", "0")
    assert kernels.requested_variant() is None
    # an AVX2 CPU with AVX-VNNI (Alder Lake and later Intel cores) prefers avxvnni and runs avx2
    monkeypatch.setattr(kernels, "cpu_flags", lambda: avx2_only | {"avx_vnni"})
    monkeypatch.setenv("LOOM_KERNELS", "auto")
    assert kernels.supported_variants() == ["avxvnni", "avx2"]
    assert kernels.requested_variant() == "avxvnni"
    assert "-mavxvnni" in kernels._cflags("avxvnni") and "-mno-avxvnni" in kernels._cflags("avx2")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_exact_codes_decode_like_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((48, 512)).astype(np.float32) * rng.uniform(0.01, 2.0, (48, 1)).astype(np.float32)
    raw = tiny_gguf.quantize(w, qtype)
    codes = exact_codes(raw, qtype, w.shape)
    assert codes is not None and codes.bits == (4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8)
    assert int(codes.q.max()) < 2 ** codes.bits
    ref = gguf_dequantize(raw, qtype).reshape(w.shape)
    np.testing.assert_allclose(codes.dequantize().numpy(), ref, rtol=1e-6, atol=1e-7)


def test_types_without_exact_codes_requantize_finely():
    w = torch.randn(40, 96)
    k6 = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    assert exact_codes(tiny_gguf.quantize(k6, Q.Q6_K), Q.Q6_K, k6.shape) is None
    codes = LinearWeight(w).codes()
    assert codes.bits == 8
    step = (w.view(40, 3, 32).amax(-1) - w.view(40, 3, 32).amin(-1)) / 255
    err = (codes.dequantize() - w).abs().view(40, 3, 32).amax(-1)
    assert bool((err <= step / 2 + 1e-6).all())


def _quantized_acts(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-group rounded to int8 steps of max|x| / 127 (the kernel's activations)."""
    # same float32 steps as the kernel: d = amax / 127, q = round_half_even(x * (1 / d))
    g = x.float().view(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv).double() * d.double()).view_as(x)


def _reference(codes: QuantCodes, x: torch.Tensor) -> torch.Tensor:
    # y = dequantized x @ dequantized W^T: the group sums of the b term are those of the quantized x
    return _quantized_acts(x).double() @ codes.dequantize().double().T


def _random_codes(n: int, k: int, bits: int, seed: int, fp16_scales: bool, zero: int = 0) -> QuantCodes:
    """Random codes; zero > 0: offsets b = -zero a (a Q4_0 / Q8_0 matrix)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, k // 32, generator=g) * 0.05
    b = torch.randn(n, k // 32, generator=g) * 0.1
    if fp16_scales:
        a, b = a.half().float(), b.half().float()
    if zero:
        b = -zero * a
    return QuantCodes(torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g), a, b, bits)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_qgemm_matches_reference(bits, fp16_scales):
    kern = kernels.load()
    assert kern is not None, kernels.unavailable_reason()
    for n, k, m in [(16, 32, 1), (40, 64, 3), (200, 96, 8), (33, 128, 17), (576, 576, 40)]:
        codes = _random_codes(n, k, bits, seed=n + m, fp16_scales=fp16_scales)
        p = pack_codes(codes)
        assert p.scales16 == fp16_scales
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 * m + k))
        y = kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, p.zero)
        ref = _reference(codes, x)
        assert y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


@needs_kernels
@pytest.mark.parametrize("bits,zero", [(4, 8), (8, 16), (8, 128)])
def test_qgemm_integer_zero_points(bits, zero):
    """Q4_0 / Q5_0 / Q8_0 (b = -Z a in every group) take the integer zero-point path: the same
    products as the affine form, with the offset's cancellation done exactly."""
    kern = kernels.load()
    assert kern is not None, kernels.unavailable_reason()
    for n, k, m in [(16, 32, 1), (40, 64, 3), (200, 96, 8), (33, 128, 17), (576, 576, 40)]:
        g = torch.Generator().manual_seed(n + m)
        a = (torch.rand(n, k // 32, generator=g) * 0.05).half().float()
        hi = 2 * zero if bits == 8 and zero == 16 else 2 ** bits   # Q5_0's codes are 0..31
        codes = QuantCodes(torch.randint(0, hi, (n, k), dtype=torch.uint8, generator=g), a, -zero * a, bits)
        p = pack_codes(codes)
        assert p.zero == zero
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 * m + k))
        y = kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, zero)
        pa = pack_codes(codes, zero=0)   # the same matrix in the affine layout, every offset stored
        assert pa.zero == 0 and pa.w.numel() > p.w.numel()
        affine = kern.qgemm(x, pa.w, pa.n, pa.k, pa.bits, pa.scales16, PRE_NONE, None, 0.0, None, False, 0)
        ref = _reference(codes, x)
        # the AVX2 variant keeps full 8-bit codes (Q8_0) on the affine path (zero_path): its usual tolerance
        exact = bits == 4 or zero == 16 or kernels.variant() == "avx512"
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=(1e-5 if exact else 1e-4) * float(ref.abs().max()))
        torch.testing.assert_close(y, affine, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))
        # rows do not depend on the batch on this path either
        assert torch.equal(kern.qgemm(x[-1:], p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None,
                                      False, zero), y[-1:])


def test_zero_point_only_where_every_group_has_it():
    a = torch.rand(16, 2) * 0.05
    assert zero_point(QuantCodes(torch.zeros(16, 64, dtype=torch.uint8), a, -128 * a, 8)) == 128
    b = -128 * a
    b[3, 1] += 1e-3   # one group off: the general form
    assert zero_point(QuantCodes(torch.zeros(16, 64, dtype=torch.uint8), a, b, 8)) == 0
    assert zero_point(QuantCodes(torch.zeros(16, 64, dtype=torch.uint8), a, -8 * a, 4)) == 8
    assert zero_point(QuantCodes(torch.zeros(16, 64, dtype=torch.uint8), a, -128 * a, 4)) == 0   # not a 4-bit code
    # Q5_0's zero point 16 holds for codes 0..31 only (the AVX2 variant sums their products in int16)
    q = torch.full((16, 64), 31, dtype=torch.uint8)
    assert zero_point(QuantCodes(q, a, -16 * a, 8)) == 16
    q[5, 7] = 32
    assert zero_point(QuantCodes(q, a, -16 * a, 8)) == 0
    with pytest.raises(ValueError, match="needs codes below 32"):
        pack_codes(QuantCodes(q, a, -16 * a, 8), zero=16)


@pytest.mark.parametrize("bits,zero", [(4, 0), (4, 8), (8, 0), (8, 16), (8, 128)])
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_packing_by_row_range_is_packing_the_whole(bits, zero, fp16_scales):
    """pack_rows (a cold load's large matrices, a range of rows at a time) gives pack_codes'
    bytes and layout, with a last range that ends inside a 16-row block."""
    codes = _random_codes(200, 64, bits, seed=bits + zero, fp16_scales=fp16_scales, zero=zero)
    if zero == 16:
        codes.q &= 31   # Q5_0's codes

    def rows(c):
        return lambda r0, r1: QuantCodes(c.q[r0:r1], c.a[r0:r1], c.b[r0:r1], c.bits)
    for chunk in (16, 48, 256):
        want, got = pack_codes(codes), pack_rows(200, 64, rows(codes), chunk_rows=chunk)
        assert (got.n, got.k, got.bits, got.scales16, got.zero) == (want.n, want.k, want.bits, want.scales16, want.zero)
        assert got.zero == zero and got.scales16 == fp16_scales
        assert torch.equal(got.w, want.w)
    # the layout is the whole matrix's: one range without the zero point, or with a scale
    # float16 cannot hold, decides it for every range
    mixed = QuantCodes(codes.q.clone(), codes.a.clone(), codes.b.clone(), bits)
    mixed.b[150, 1] += 1e-3
    mixed.a[170, 0] = 0.1 + 1e-6
    asked = []

    def counted(r0, r1):
        asked.append(r0)
        return rows(mixed)(r0, r1)
    got = pack_rows(200, 64, counted, chunk_rows=48)
    if zero or fp16_scales:   # the fourth range does not fit the first's layout: it starts again
        assert asked == [0, 48, 96, 144] + [0, 48, 96, 144, 192] * 2
    else:
        assert asked == [0, 48, 96, 144, 192]
    assert got.zero == 0 and not got.scales16
    assert torch.equal(got.w, pack_codes(mixed).w)


def _q5_0_codes(n: int, k: int, seed: int) -> QuantCodes:
    g = torch.Generator().manual_seed(seed)
    a = (torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    return QuantCodes(torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g), a, -16 * a, 8)


def test_five_bit_layout_holds_q5_0s_codes():
    """Q5_0's codes packed in five bits: the nibbles of the 4-bit layout, then a plane whose byte
    (row, j) holds in bit c the fifth bit of code(4c + j); the scales as in the byte layout."""
    codes = _q5_0_codes(40, 96, seed=3)
    p5, p8 = pack_codes(codes, five_bit=True), pack_codes(codes, five_bit=False)
    assert (p5.bits, p5.zero, p8.bits, p8.zero) == (5, 16, 8, 16)
    b5 = p5.w.view(-1, 3, 320 + 32)
    b8 = p8.w.view(-1, 3, 512 + 32)
    assert b5.shape[0] == b8.shape[0] == 3 and torch.equal(b5[..., 320:], b8[..., 512:])   # the scales
    q = torch.cat([codes.q, codes.q.new_zeros(8, 96)]).view(3, 16, 3, 32)   # block, row, group, k
    for blk, row, grp, kk in [(0, 0, 0, 0), (1, 5, 2, 13), (2, 7, 1, 31), (2, 15, 0, 22)]:
        c, j = divmod(kk, 4)
        nibble = b5[blk, grp, (c // 2) * 64 + row * 4 + j]
        low = int(nibble >> 4) if c % 2 else int(nibble & 15)
        fifth = (int(b5[blk, grp, 256 + row * 4 + j]) >> c) & 1
        assert low | fifth << 4 == int(q[blk, row, grp, kk])
        assert int(b8[blk, grp, c * 64 + row * 4 + j]) == int(q[blk, row, grp, kk])
    with pytest.raises(ValueError, match="needs codes below 32"):   # not Q5_0's codes
        bad = QuantCodes(codes.q | 32, codes.a, codes.b, 8)
        pack_codes(bad, zero=16, five_bit=True)
    assert pack_codes(_random_codes(32, 64, 8, seed=1, fp16_scales=True, zero=128), five_bit=True).bits == 8


@needs_kernels
def test_five_bit_codes_give_the_byte_layouts_outputs_bit_for_bit():
    """Both layouts of a Q5_0 matrix give the same outputs, bit for bit, at every batch: a tile or
    two of rows reads the five bits directly; more rows widen each run of columns to bytes first
    (the 8-bit tiles) - the same integer products either way. Pre-ops and the output layer too."""
    kern = kernels.load()
    for n, k, m in [(16, 32, 1), (40, 64, 3), (200, 640, 4), (200, 640, 5), (33, 128, 17), (576, 576, 40),
                    (1000, 640, 9)]:
        codes = _q5_0_codes(n, k, seed=n + m)
        p5, p8 = pack_codes(codes, five_bit=True), pack_codes(codes, five_bit=False)
        assert p5.w.numel() * 544 == p8.w.numel() * 352
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 * m + k)) * 2
        y5, y8 = (kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, 16)
                  for p in (p5, p8))
        assert torch.equal(y5, y8), (n, k, m)
        ref = _reference(codes, x)
        torch.testing.assert_close(y5.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        # each row alone: the batch changes nothing
        assert torch.equal(kern.qgemm(x[-1:], p5.w, n, k, 5, p5.scales16, PRE_NONE, None, 0.0, None, False, 16), y5[-1:])
        gu = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m))
        h5, h8 = (kern.qgemm(gu, p.w, p.n, p.k, p.bits, p.scales16, PRE_GEGLU, None, 0.0, y5.clone(), True, 16)
                  for p in (p5, p8))
        assert torch.equal(h5, h8)
        # the output layer's top logits again in float32 from the five bits
        l5, l8 = y5.clone(), y8.clone()
        for p, lg in ((p5, l5), (p8, l8)):
            kern.refine_logits(lg, x, p.w, p.n, p.k, p.bits, p.scales16, 16, 1e9, n, None)
        assert torch.equal(l5, l8)
    with pytest.raises(RuntimeError, match="16 for 5-bit ones"):
        kern.qgemm(x, p5.w, p5.n, p5.k, 5, p5.scales16, PRE_NONE, None, 0.0, None, False, 0)


def _variant_outputs(variants, bits, zero):
    """qgemm's outputs from each variant's build, per shape and layout (Q5_0 in bytes and in five bits)."""
    built = [kernels.build(v) for v in variants]
    for n, k, m in [(40, 64, 1), (200, 640, 8), (576, 576, 33)]:
        g = torch.Generator().manual_seed(n + m)
        a = (torch.rand(n, k // 32, generator=g) * 0.05).half().float()
        # zero 0: affine codes (Q4_1's, Q8's with an offset of their own per group)
        b = -zero * a if zero else (torch.rand(n, k // 32, generator=g) - 0.5).half().float()
        codes = QuantCodes(torch.randint(0, 2 * zero if zero else 2 ** bits, (n, k), dtype=torch.uint8, generator=g), a, b, bits)
        x = torch.randn(m, k, generator=g) * 3
        for five_bit in ((False, True) if zero == 16 else (False,)):
            p = pack_codes(codes, five_bit=five_bit)
            assert p.zero == zero
            yield [kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, p.zero)
                   for kern in built]


@pytest.mark.skipif(len(kernels.supported_variants()) < 2, reason="needs a CPU that runs two variants")
@pytest.mark.parametrize("bits,zero", [(4, 8), (8, 16)])
def test_variants_agree_bitwise_on_integer_zero_points(bits, zero):
    """Q4_0 and Q5_0 take the integer zero-point path on every variant: their integer dot
    products are exact and the float steps after them the same, so the outputs agree bit for bit."""
    for y in _variant_outputs(kernels.supported_variants(), bits, zero):
        assert all(torch.equal(y[0], other) for other in y[1:])


@pytest.mark.skipif(not {"avx512", "avxvnni"} <= set(kernels.supported_variants()),
                    reason="needs a CPU with AVX-512 VNNI and AVX-VNNI")
@pytest.mark.parametrize("bits,zero", [(4, 8), (8, 16), (8, 128), (4, 0), (8, 0)])
def test_avxvnni_agrees_with_avx512_bitwise(bits, zero):
    """The avxvnni build's dot products are the AVX-512 variant's on 256 bits, Q8_0's zero point
    and the affine codes included (the avx2 build keeps full 8-bit codes on its affine path)."""
    for y in _variant_outputs(["avx512", "avxvnni"], bits, zero):
        assert torch.equal(y[0], y[1])


def _amx_case_outputs() -> list[torch.Tensor]:
    """qgemm's outputs over 8-bit layouts (Q8_0's zero point, Q5_0's in bytes and in five bits,
    affine) and 4-bit ones (Q4_0's zero point, affine) at 1-40 rows (from 16 rows on, 32 for 4-bit
    codes, tiles of 16 rows on AMX where it runs, the rest on VNNI in 8-row tiles: at 30 rows one
    of them starts half-way through a 16-row panel), over 19 groups (four at a time on AMX, then
    three)."""
    kern, ys = kernels.load(), []
    for bits, zero, five_bit in [(8, 128, False), (8, 16, False), (8, 16, True), (8, 0, False), (4, 8, False),
                                 (4, 0, False)]:
        codes = _random_codes(300, 608, bits, seed=bits + zero, fp16_scales=True, zero=zero)
        if zero == 16:   # Q5_0's codes: 0..31
            codes = QuantCodes(codes.q % 32, codes.a, codes.b, bits)
        p = pack_codes(codes, five_bit=five_bit)
        for m in (1, 8, 16, 24, 30, 40):
            x = torch.randn(m, 608, generator=torch.Generator().manual_seed(m)) * 2
            ys.append(kern.qgemm(x, p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, p.zero))
    return ys


@needs_kernels
@pytest.mark.skipif("amx_int8" not in cpu_flags() or kernels.variant() != "avx512",
                    reason="needs the AVX-512 variant on a CPU with AMX-INT8")
def test_amx_tiles_give_the_vnni_tiles_bits(tmp_path):
    """Tiles of 8 activation rows take their integer dot products from AMX where the CPU has it;
    the sums are the same integers, scaled the same way, so every output equals the VNNI tiles'
    (LOOM_AMX=0, in a process of its own) bit for bit."""
    assert kernels.load().amx_tiles()
    out = tmp_path / "vnni.pt"
    code = ("import sys, torch; sys.path.insert(0, 'tests'); import test_kernels as t; from loom import kernels; "
            f"assert not kernels.load().amx_tiles(); torch.save(t._amx_case_outputs(), {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "LOOM_AMX": "0"},
                   cwd=Path(__file__).resolve().parent.parent)
    for amx, vnni in zip(_amx_case_outputs(), torch.load(out), strict=True):
        assert torch.equal(amx, vnni)


@needs_kernels
def test_qgemm_rejects_a_zero_point_the_width_cannot_have():
    kern = kernels.load()
    p = pack_codes(_random_codes(16, 32, 4, seed=0, fp16_scales=True))
    with pytest.raises(RuntimeError, match="zero must be"):
        kern.qgemm(torch.randn(1, 32), p.w, p.n, p.k, p.bits, p.scales16, PRE_NONE, None, 0.0, None, False, 128)


@needs_kernels
def test_qgemm_fused_pre_ops_and_residual():
    codes = _random_codes(96, 64, 4, seed=1, fp16_scales=True)
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    torch.manual_seed(0)
    x, gu, h = torch.randn(5, 64), torch.randn(5, 128), torch.randn(5, 96)
    norm = torch.rand(64) + 0.5
    cases = [
        (x, PRE_RMSNORM, norm, F.rms_norm(x, (64,), norm, 1e-6)),
        (gu, PRE_SWIGLU, None, F.silu(gu[:, :64]) * gu[:, 64:]),
        (gu, PRE_GEGLU, None, F.gelu(gu[:, :64], approximate="tanh") * gu[:, 64:]),
    ]
    for inp, pre, w, pre_ref in cases:
        y = lin(inp, pre, w, 1e-6)
        # the fused pre-op may differ from torch's in the last bit, which can move one activation by
        # one int8 step: allow that much (a * 15 * step), far below any real error
        step = float(pre_ref.abs().max()) / 127
        atol = 1e-3 + float(codes.a.max()) * 15 * step
        torch.testing.assert_close(y.double(), _reference(codes, pre_ref), rtol=1e-4, atol=atol)
    out = h.clone()
    lin(x, out=out, accumulate=True)
    torch.testing.assert_close(out, h + lin(x), rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("bits,zero", [(4, 0), (8, 0), (8, 128)])
def test_qgemm_rows_do_not_depend_on_the_batch(bits, zero):
    """A row's outputs have the same bits in any batch: on the AVX2 variant a lone row's 8-bit
    dot products move the codes' signs onto the activation, a tile of several rows widens the
    codes to 16 bits; both sums are exact. A call of at most 4 rows streams the weights, and there
    (on a CPU without AVX-512) the AVX2 tiles take both halves of a block at a time, summing each
    output's groups in the same order (300 outputs: the last block's second half has 4 of 8 rows)."""
    codes = _random_codes(300, 192, bits, seed=7, fp16_scales=True, zero=zero)
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    x = torch.randn(37, 192, generator=torch.Generator().manual_seed(3))
    whole = lin(x)
    for rows in ([0], [5, 6], [5, 6, 7], [1, 2, 3, 4], list(range(9, 20)), [36]):
        assert torch.equal(lin(x[rows]), whole[rows])


@needs_kernels
def test_qgemm_refinement_and_topk_do_not_depend_on_the_threads():
    """The GEMM's block columns, the refinement's rows and top-k's rows are taken in chunks by
    whichever thread is free; on 1 to 4 threads (more threads than cores: a thread loses its
    core mid-range and the others take its chunks) every result has the same bits."""
    codes = _random_codes(4099, 256, 8, seed=11, fp16_scales=True, zero=128)
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    kern = kernels.load()
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(4))

    def run() -> tuple[torch.Tensor, ...]:
        y = lin(x)
        am = torch.empty(33, dtype=torch.int64)
        refined = lin.refine_top(x, y.clone(), 8.0, 64, am)
        am_top = torch.empty(33, dtype=torch.int64)
        top = lin.top_logits(x, 8.0, 64, am_top)
        return y, refined, am, kern.topk_rows(refined, 20), lin(x[:1]), lin(x[:8]), top, am_top

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
        for t in (2, 3, 4):
            torch.set_num_threads(t)
            for _ in range(3):
                for a, b in zip(single, run()):
                    assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("vocab", [49152, 100])
def test_apply_bitmask_forbids_exactly_the_clear_bits(vocab):
    """The structured-output mask: words of zeros, of ones and mixed, a vocabulary that ends
    inside a word; the same as unpacking the bits in torch."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(5)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    mask[0] = 0                                    # a grammar that admits nothing here
    mask[1] = -1                                   # anything
    mask[2, : words // 2] = 0                      # half the words closed
    mask[3, ::3] = -1
    logits = torch.randn(5, vocab, generator=g)
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
    want = logits.masked_fill(~bits, float("-inf"))
    got = logits.clone()
    admits = kern.apply_bitmask(got, mask)
    assert torch.equal(got, want)
    assert admits == bits.any(dim=1).tolist() and admits[0] is False   # row 0: no token
    tail = torch.zeros(1, words, dtype=torch.int32)
    tail[0, -1] = -1 << (vocab % 32) if vocab % 32 else 0        # bits past the vocabulary only
    assert kern.apply_bitmask(logits[:1].clone(), tail) == [False]
    assert torch.isneginf(got[0]).all() and torch.equal(got[1], logits[1])
    with pytest.raises(RuntimeError, match="mask must be an int32"):
        kern.apply_bitmask(logits, mask[:, :1].contiguous())


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [True, False])
@pytest.mark.parametrize("zero_point", [False, True])
def test_refine_top_computes_the_largest_logits_exactly(bits, fp16_scales, zero_point):
    """The output layer's refinement: the `cap` largest logits of each row within `margin` of its
    maximum become the float32 product of the stored weights (to float32 rounding), every other
    logit keeps the GEMM's value; a row's result does not depend on the batch. With a zero point
    (Gemma 3's Q8_0 output matrix) the blocks hold no offsets, and the refinement takes them as -Z a."""
    n, k = 1003, 192                                   # a last block of 11 rows
    zero = {4: 8, 8: 128}[bits] if zero_point else 0
    codes = _random_codes(n, k, bits, seed=11, fp16_scales=fp16_scales, zero=zero)
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    assert lin.p.zero == zero
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, k, generator=g)
    x[3] *= 8.0                                        # a peaked row: few logits near the top
    exact = x.double() @ codes.dequantize().double().T  # [6, n]
    gemm = lin(x)
    for margin, cap in [(8.0, 64), (0.5, 1000), (100.0, 5)]:
        got = lin.refine_top(x, gemm.clone(), margin, cap)
        for r in range(x.shape[0]):
            near = (gemm[r] > gemm[r].max() - margin).nonzero().flatten()
            order = sorted(near.tolist(), key=lambda t: (-gemm[r, t].item(), t))[:cap]
            changed = torch.zeros(n, dtype=torch.bool)
            changed[order] = True
            assert torch.equal(got[r, ~changed], gemm[r, ~changed])
            torch.testing.assert_close(got[r, changed].double(), exact[r, changed], rtol=1e-5, atol=1e-4)
            assert (got[r, changed].double() - exact[r, changed]).abs().max() < \
                (gemm[r, changed].double() - exact[r, changed]).abs().max() or len(order) == 0
        part = lin.refine_top(x[2:4].contiguous(), gemm[2:4].clone(), margin, cap)
        assert torch.equal(part, got[2:4])
    with pytest.raises(RuntimeError, match="must be >= 0"):
        lin.refine_top(x, gemm.clone(), -1.0, 4)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_refine_top_reports_the_argmax_it_decides(bits):
    """The refinement's argmax (a greedy step's token without another pass over the vocabulary):
    where given (>= 0) it is torch's argmax of the refined row, ties to the lower index; at the
    output layer's setting every row has one; -1 where the refinement cannot decide (no candidate
    refined, or its best fell below a logit it left alone)."""
    n, k = 1003, 192
    codes = _random_codes(n, k, bits, seed=5, fp16_scales=True)
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(9))
    x[3] *= 8.0
    gemm = lin(x)
    for margin, cap in [(8.0, 64), (0.5, 1000), (100.0, 5), (100.0, 1), (0.0, 64), (8.0, 0)]:
        am = torch.empty(8, dtype=torch.int64)
        got = lin.refine_top(x, gemm.clone(), margin, cap, am)
        for r in range(8):
            if am[r] >= 0:
                assert am[r].item() == got[r].argmax().item()
        if (margin, cap) == (8.0, 64):   # the output layer's setting: the refinement decides every row
            assert bool((am >= 0).all()), am
        if cap == 0 or margin == 0:
            assert bool((am == -1).all())
    # equal top values: the lower index, as torch's argmax
    y = gemm.clone()
    am = torch.empty(8, dtype=torch.int64)
    refined = lin.refine_top(x, y, 8.0, 64, am)
    top = refined[0].argmax().item()
    w = QuantLinear(LinearWeight(codes.dequantize()[[top, top]], QuantCodes(codes.q[[top, top]], codes.a[[top, top]],
                                                                                  codes.b[[top, top]], bits)))
    twin = w(x)
    am2 = torch.empty(8, dtype=torch.int64)
    out2 = w.refine_top(x, twin, 8.0, 64, am2)
    assert torch.equal(out2[:, 0], out2[:, 1]) and bool((am2 == 0).all())
    with pytest.raises(RuntimeError, match="argmax must be"):
        lin.refine_top(x, gemm.clone(), 8.0, 64, torch.empty(3, dtype=torch.int64))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)   # the same bits, NaN included


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [True, False])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("n", [3001, 2048])
def test_top_logits_are_the_gemm_then_its_refinement(bits, fp16_scales, zero_point, n):
    """The output layer in one call (the GEMM's tiles gather the refinement's candidates): the
    same logits, bit for bit, as the GEMM followed by refine_top, on 1 to 33 rows and 1 to 4
    threads; with the candidates a row's threads must prune (a flat row: thousands within the
    margin), a cap of one, no margin, equal top values, and rows with NaN or infinite logits (a
    NaN or infinite scale). The argmax, where given (>= 0), is the refined row's (ties: the lower
    index); at the output layer's setting it is given wherever refine_top gives it. The logits
    are stored past the caches where a vector is aligned: rows of 2048 (every vector) and of
    3001 (some) take both stores."""
    k = 192
    zero = {4: 8, 8: 128}[bits] if zero_point else 0
    codes = _random_codes(n, k, bits, seed=13, fp16_scales=fp16_scales, zero=zero)
    top = 1234
    for q in (top + 1, top + 2):            # equal top candidates: the same codes and scales
        codes.q[q], codes.a[q], codes.b[q] = codes.q[top], codes.a[top], codes.b[top]
    lin = QuantLinear(LinearWeight(codes.dequantize(), codes))
    g = torch.Generator().manual_seed(21)
    x = torch.randn(33, k, generator=g)
    x[3] *= 8.0                               # peaked
    x[4] *= 0.01                              # flat: every logit within the margin
    x[5] = 0.0
    cases = [(8.0, 64), (0.5, 1000), (100.0, 5), (100.0, 1), (0.0, 64), (8.0, 1)]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            for rows in (slice(0, 1), slice(2, 5), slice(0, 8), slice(0, 33)):
                xr = x[rows].contiguous()
                for margin, cap in cases:
                    want_am, got_am = (torch.empty(xr.shape[0], dtype=torch.int64) for _ in range(2))
                    want = lin.refine_top(xr, lin(xr), margin, cap, want_am)
                    got = lin.top_logits(xr, margin, cap, got_am)
                    _same(got, want)
                    for r in range(xr.shape[0]):
                        if got_am[r] >= 0:
                            assert got_am[r].item() == want[r].argmax().item(), (t, rows, margin, cap, r)
                    if (margin, cap) == (8.0, 64):
                        assert torch.equal(got_am, want_am), (t, rows)
                    _same_without_logits(lin, xr, margin, cap, want, got_am)
    finally:
        torch.set_num_threads(threads)
    for bad in (float("nan"), float("inf")):   # one output row's logits NaN, or +-inf, in every row
        odd = QuantCodes(codes.q, codes.a.clone(), codes.b.clone(), bits)
        odd.a[77, 2] = bad
        if zero:
            odd.b[77, 2] = -zero * bad
        lin_odd = QuantLinear(LinearWeight(odd.dequantize(), odd))
        want_am, got_am = (torch.empty(8, dtype=torch.int64) for _ in range(2))
        want = lin_odd.refine_top(x[:8], lin_odd(x[:8]), 8.0, 64, want_am)
        _same(lin_odd.top_logits(x[:8], 8.0, 64, got_am), want)
        assert torch.equal(got_am, want_am), bad
        _same_without_logits(lin_odd, x[:8], 8.0, 64, want, got_am, nan_rows=bad != bad)
    with pytest.raises(RuntimeError, match="cap >= 1"):
        lin.top_logits(x, 8.0, 0)
    with pytest.raises(RuntimeError, match="argmax must be"):
        lin.top_logits(x, 8.0, 64, torch.empty(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="needs the argmax"):
        lin.top_logits(x, 8.0, 64, None, logits=False)


def _same_without_logits(lin, x, margin, cap, want, want_am, nan_rows=False) -> None:
    """top_logits(logits=False): where the kernel leaves the logits unstored (AVX-512) it returns
    None and each row's argmax as the stored call gives it: the refined logits' argmax, or -1
    (always for a row with a NaN logit). Which rows get -1 away from the output layer's setting
    depends on how the threads split the columns (a thread's prune, see refine_tracked), so
    there only the argmax given is checked. Elsewhere the call is the stored one."""
    am = torch.full((x.shape[0],), -7, dtype=torch.int64)
    got = lin.top_logits(x, margin, cap, am, logits=False)
    if got is not None:
        assert kernels.variant() != "avx512"
        _same(got, want)
        assert torch.equal(am, want_am)
    elif nan_rows:
        assert bool((am == -1).all())
    else:
        assert kernels.variant() == "avx512"
        for r in range(x.shape[0]):
            assert am[r] == -1 or am[r].item() == want[r].argmax().item(), (margin, cap, r)
        if (margin, cap) == (8.0, 64):
            assert torch.equal(am, want_am)


@needs_kernels
@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_topk_indices_are_torch_topk(vocab):
    """The kernel's top-k (drafters' observations): torch.topk's indices in its order on rows
    without ties, flat and peaked rows, k up to 64; of equal values the lower index first; -inf
    and NaN entries only after every other."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1] *= 30.0                                   # peaked
    logits[2] = torch.arange(vocab, dtype=torch.float32) / vocab    # rising: every step beats the last
    logits[3] = -torch.arange(vocab, dtype=torch.float32)           # falling
    for k in (1, 8, 37, 64):
        k = min(k, vocab)
        got = kernels.topk_indices(logits, k)
        assert got.dtype == torch.int64 and got.shape == (6, k)
        assert torch.equal(got, logits.topk(k, dim=1).indices)
        assert torch.equal(kernels.topk_indices(logits[2:5], k), got[2:5])
    ties = torch.zeros(1, vocab)
    ties[0, 5] = 1.0
    assert kernels.topk_indices(ties, 4).tolist() == [[5, 0, 1, 2]]
    masked = torch.full((1, vocab), float("-inf"))
    masked[0, [3, 9]] = torch.tensor([0.5, 2.0])
    masked[0, 0] = float("nan")
    assert kernels.topk_indices(masked, 4).tolist() == [[9, 3, 0, 1]]


@needs_kernels
def test_qgemm_rejects_bad_shapes():
    lin = QuantLinear(LinearWeight(torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match="wrong width"):
        lin(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="float32"):
        lin(torch.randn(2, 64).double())


@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("D", [32, 64, 256])   # 64/128/256 have register-resident paths
def test_rope_store_and_decode_attention_match_torch(window, fmt, D):
    """The kernels store k/v in every cache format as the torch path encodes them, and read
    them back as the torch path decodes them."""
    kern = kernels.load()
    torch.manual_seed(0)
    H, Hkv = 6, 2
    f = kv_format(fmt)
    rope = RotaryEmbedding(D, 10000.0, 128)
    ctx = [1, 9, 23, 40]
    slots_per_seq = [torch.randperm(64)[:c] + 64 * i for i, c in enumerate(ctx)]
    kc, vc = f.encode(torch.randn(256, Hkv, D)), f.encode(torch.randn(256, Hkv, D))
    qkv = torch.randn(len(ctx), (H + 2 * Hkv) * D)
    positions = torch.tensor([c - 1 for c in ctx])
    slot_mapping = torch.stack([s[-1] for s in slots_per_seq])
    meta = AttentionMetadata.build(slot_mapping, [1] * len(ctx), ctx, slots_per_seq)
    q_norm, k_norm = torch.rand(D) + 0.5, torch.rand(D) + 0.5

    # torch path
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    cos, sin = rope.tables(positions, torch.float32)
    q = apply_rope(F.rms_norm(q.reshape(-1, H, D), (D,), q_norm, 1e-6), cos, sin)
    k = apply_rope(F.rms_norm(k.reshape(-1, Hkv, D), (D,), k_norm, 1e-6), cos, sin)
    ref = paged_attention(q, k, v.reshape(-1, Hkv, D), kc_ref, vc_ref, meta, 0.2, window)

    # kernels
    kern.rope_store(qkv, positions, rope.cos, rope.sin, kc, vc, slot_mapping, H, Hkv, q_norm, k_norm, 1e-6,
                    f.kernel_id)
    # a float32 ulp of the kernel's norm and RoPE can flip a float16 rounding or a code
    tol = {"float32": 1e-5, "float16": 1e-3, "int8": 0.05, "int4": 0.7}[fmt]
    torch.testing.assert_close(f.decode(kc), f.decode(kc_ref), rtol=0, atol=tol)
    assert torch.equal(vc, vc_ref)   # v is stored as it came: the very same bytes
    qk = qkv.view(-1, H + 2 * Hkv, D)
    out = paged_attention(qk[:, :H], qk[:, H:H + Hkv], qk[:, H + Hkv:], kc, vc, meta, 0.2, window,
                          stored=True, kern=kern)
    if f.kernel_id:   # quantized: the torch path over the kernel's own cache (the same codes)
        ref = paged_attention(q, k, v.reshape(-1, Hkv, D), kc, vc, meta, 0.2, window, stored=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _block_major(rows: torch.Tensor, bs: int) -> torch.Tensor:
    """A cache [slots, Hkv, row] as the paged layout [blocks, Hkv, bs, row] of the same rows."""
    n, hkv, rb = rows.shape
    return rows.view(n // bs, bs, hkv, rb).transpose(1, 2).contiguous()


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bs", [16, 8, 12])   # 12: a block size that is no power of two
def test_a_block_major_cache_gives_the_slot_major_caches_bits(fmt, bs):
    """The paged layout, each kv head's rows of a block contiguous, holds and yields exactly what
    a cache with one row per (slot, kv head) does: rope_store writes the same bytes at the same
    slots, attention reads the same rows into the same bits, and the slot helpers agree."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(1)
    H, Hkv, D = 6, 3, 64
    f = kv_format(fmt)
    n = 20 * bs
    kc3, vc3 = f.encode(torch.randn(n, Hkv, D, generator=g)), f.encode(torch.randn(n, Hkv, D, generator=g))
    kc4, vc4 = _block_major(kc3, bs), _block_major(vc3, bs)
    every = torch.arange(n)
    assert torch.equal(cache_rows(kc4, every), kc3) and torch.equal(cache_rows(kc3, every), kc3)
    ctx = [1, 9, 23, 40, 3 * bs + 1]
    slots = [torch.randperm(n, generator=g)[:c] for c in ctx]
    slot_mapping = torch.stack([s[-1] for s in slots])
    qkv = torch.randn(len(ctx), (H + 2 * Hkv) * D, generator=g)
    rope = RotaryEmbedding(D, 10000.0, 128)
    positions = torch.tensor([c - 1 for c in ctx])
    qkv3, qkv4 = qkv.clone(), qkv.clone()
    kern.rope_store(qkv3, positions, rope.cos, rope.sin, kc3, vc3, slot_mapping, H, Hkv, None, None, 1e-6, f.kernel_id)
    kern.rope_store(qkv4, positions, rope.cos, rope.sin, kc4, vc4, slot_mapping, H, Hkv, None, None, 1e-6, f.kernel_id)
    assert torch.equal(cache_rows(kc4, every), kc3) and torch.equal(cache_rows(vc4, every), vc3)
    meta = AttentionMetadata.build(slot_mapping, [1] * len(ctx), ctx, slots)
    rows = meta.kernel_rows()
    outs = [kern.attn_decode(qkv3, k, v, rows.slots, rows.ctx, H, Hkv, 0.125, 0, rows.groups, rows.shared,
                             f.kernel_id, None) for k, v in ((kc3, vc3), (kc4, vc4))]
    assert torch.equal(outs[0], outs[1])
    # the torch path reads the paged layout through the same helper
    qk = qkv3.view(-1, H + 2 * Hkv, D)
    ref = paged_attention(qk[:, :H], qk[:, H:H + Hkv], qk[:, H + Hkv:], kc4, vc4, meta, 0.125, None, stored=True)
    torch.testing.assert_close(outs[1], ref, rtol=1e-4, atol=1e-5)
    # store_rows writes where cache_rows reads
    new = f.encode(torch.randn(5, Hkv, D, generator=g))
    at = torch.tensor([0, bs - 1, bs, 7 * bs + 3, n - 1])
    store_rows(kc4, at, new)
    store_rows(kc3, at, new)
    assert torch.equal(cache_rows(kc4, at), new) and torch.equal(cache_rows(kc4, every), kc3)


def test_the_cache_tensors_move_slots_and_copy_blocks_in_the_paged_layout():
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=16)
    kv = KVCacheTensors(cfg, 64, torch.float32, block_size=16)
    assert kv.layers[0][0].shape == (4, 3, 16, 16)
    for k, v in kv.layers:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    before = [(cache_rows(k, torch.arange(64)).clone(), cache_rows(v, torch.arange(64)).clone()) for k, v in kv.layers]
    kv.move_slots(torch.tensor([1, 17, 40]), torch.tensor([63, 2, 30]))
    kv.copy_blocks([(0, 3)], 16)
    for (k, v), (k0, v0) in zip(kv.layers, before):
        want = k0.clone()
        want[[63, 2, 30]] = k0[[1, 17, 40]]
        want[48:64] = want[0:16]
        assert torch.equal(cache_rows(k, torch.arange(64)), want)
    with pytest.raises(ValueError, match="blocks of 8 slots"):
        kv.copy_blocks([(0, 1)], 8)
    with pytest.raises(ValueError, match="no whole number of blocks"):
        KVCacheTensors(cfg, 60, torch.float32, block_size=16)


@needs_kernels
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_rows_match_torch_for_mixed_batches(window, fmt):
    """Decodes, a causal chunk, a draft tree and a long prefill in one batch: the row kernel
    computes what the torch path computes."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 6, 2, 64
    # (new tokens, context incl. them, tree parents or None)
    shapes = [(1, 17, None), (5, 30, None), (6, 26, (-1, 0, 0, 1, 3)), (1, 1, None), (45, 60, None),
              (3, 3, None)]   # the tree: one committed token, then 5 nodes
    kv_slots, masks, query_lens, ctx_lens = [], [], [], []
    for i, (n, c, parents) in enumerate(shapes):
        kv_slots.append(torch.randperm(80, generator=g)[:c] + 80 * i)
        query_lens.append(n)
        ctx_lens.append(c)
        masks.append(tree_attention_mask(1, parents) if parents else None)
    slot_mapping = torch.cat([s[-n:] for s, n in zip(kv_slots, query_lens)])
    meta = AttentionMetadata.build(slot_mapping, query_lens, ctx_lens, kv_slots, masks)
    T = sum(query_lens)
    f = kv_format(fmt)
    kc = f.encode(torch.randn(80 * len(shapes), Hkv, D, generator=g))
    vc = f.encode(torch.randn(80 * len(shapes), Hkv, D, generator=g))
    q = torch.randn(T, H, D, generator=g)
    k, v = f.decode(kc[slot_mapping]), f.decode(vc[slot_mapping])
    ref = paged_attention(q, k, v, kc, vc, AttentionMetadata.build(slot_mapping, query_lens, ctx_lens, kv_slots,
                                                                  masks), 0.125, window, stored=True)
    rows = meta.kernel_rows()
    assert rows.rest == []                       # the 45-token chunk too: two groups of rows
    assert rows.groups.numel() - 1 == len(shapes) + 1
    out = paged_attention(q, k, v, kc, vc, meta, 0.125, window, stored=True, kern=kern)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # every sequence through rows: the kernel reads q straight from the batch
    small = [0, 1, 2, 3, 5]
    sub = AttentionMetadata.build(torch.cat([slot_mapping[meta.query_starts[s]:meta.query_starts[s] + query_lens[s]]
                                             for s in small]), [query_lens[s] for s in small],
                                  [ctx_lens[s] for s in small], [kv_slots[s] for s in small], [masks[s] for s in small])
    idx = torch.cat([torch.arange(meta.query_starts[s], meta.query_starts[s] + query_lens[s]) for s in small])
    assert sub.kernel_rows().tokens is None and not sub.kernel_rows().rest
    out_sub = paged_attention(q[idx], k[idx], v[idx], kc, vc, sub, 0.125, window, stored=True, kern=kern)
    torch.testing.assert_close(out_sub, ref.view(T, -1)[idx], rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", [None, 6, 300])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_attention_rows_are_bitwise_invariant(window, fmt):
    """A position's attention output has the same bits however it is batched: in one long
    prefill chunk, in a chunk after a cached prefix, as a decode row, or as a node of a draft
    chain being verified (so neither the prefix cache, nor chunking, nor speculation changes a
    result), and on any number of threads; for every cache format, over contexts split into
    several parts (SPLIT = 256 keys) and under both schedules of the parts."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(1)
    H, Hkv, D, C = 6, 2, 64, 1200   # the whole chunk's partial results exceed PARTIALS_MAX: the other schedule
    f = kv_format(fmt)
    kc = f.encode(torch.randn(C + 8, Hkv, D, generator=g))
    vc = f.encode(torch.randn(C + 8, Hkv, D, generator=g))
    slots = torch.randperm(C + 8, generator=g)[:C]
    q = torch.randn(C, H * D, generator=g)

    def attend(n: int, ctx: int, mask=None) -> torch.Tensor:   # the last n of the first ctx positions
        meta = AttentionMetadata.build(slots[ctx - n:ctx], [n], [ctx], [slots[:ctx]], [mask] if mask is not None else None)
        rows = meta.kernel_rows()
        assert not rows.rest
        return kern.attn_decode(q[ctx - n:ctx].contiguous(), kc, vc, rows.slots, rows.ctx, H, Hkv, 0.125,
                                window or 0, rows.groups, rows.shared, f.kernel_id)

    whole = attend(C, C)                                              # one prefill chunk
    tail = torch.cat([attend(37, 37), attend(300, 337), attend(C - 337, C)])   # cached prefixes, then the rest
    decodes = torch.cat([attend(1, p + 1) for p in range(C)])        # one position at a time
    chain = attend(9, C, tree_attention_mask(1, tuple(range(-1, 7))))  # committed token + 8 draft nodes
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.cat([attend(1, p + 1) for p in range(C - 20, C)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, tail)
    assert torch.equal(whole, decodes)
    assert torch.equal(whole[-9:], chain)
    assert torch.equal(whole[-20:], single)


@needs_kernels
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("fmt, D", [(f, D) for f in FORMATS for D in (16, 64, 96, 256) if D % kv_format(f).group == 0])
def test_attention_split_across_keys_matches_torch_at_long_context(window, fmt, D):
    """Contexts of several parts (decodes at 257 and 1000 keys, a 40-token chunk after 560):
    the parts combined equal one softmax over the whole context (torch, on the decoded cache)."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(3)
    H, Hkv = 4, 2
    f = kv_format(fmt)
    query_lens, ctx_lens = [1, 40, 1], [257, 600, 1000]
    kv_slots = [torch.randperm(1000, generator=g)[:c] + 1000 * i for i, c in enumerate(ctx_lens)]
    kc = f.encode(torch.randn(3000, Hkv, D, generator=g))
    vc = f.encode(torch.randn(3000, Hkv, D, generator=g))
    slot_mapping = torch.cat([s[-n:] for s, n in zip(kv_slots, query_lens)])
    q = torch.randn(sum(query_lens), H, D, generator=g)
    k, v = f.decode(kc[slot_mapping]), f.decode(vc[slot_mapping])
    meta = lambda: AttentionMetadata.build(slot_mapping, query_lens, ctx_lens, kv_slots)   # noqa: E731
    ref = paged_attention(q, k, v, kc, vc, meta(), D ** -0.5, window, stored=True)
    out = paged_attention(q, k, v, kc, vc, meta(), D ** -0.5, window, stored=True, kern=kern)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-5)


def _window_reference(q, k, v, q_pos, k_pos, scale, window):
    """Float64 attention of queries q [R, H, D] at positions q_pos [R] over keys k, v [L, Hkv, D]
    at positions k_pos [L]: a query sees the keys with p - window < position <= p."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)   # [L, H, D]
    s = torch.einsum("rhd,lhd->rhl", q.double(), kk) * scale
    visible = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)      # [R, L]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", s.softmax(-1), vv).float().flatten(1)                 # [R, H*D]


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sliding_window_is_applied_by_position_after_eviction(fmt):
    """Key lists with evicted entries (gaps in their positions): a window layer's query at
    position p sees exactly the kept keys with p - W < position <= p, on the kernel and the
    torch paths, over lists of several parts (SPLIT = 256 keys); a sequence with nothing
    evicted in the same batch keeps the last-W-entries rule, with the same bits as without
    positions."""
    kern = kernels.load()
    g = torch.Generator().manual_seed(4)
    H, Hkv, D, W = 4, 2, 64, 350
    scattered = torch.cat([torch.sort(torch.randperm(1499, generator=g)[:499]).values, torch.tensor([1499])])
    # (new tokens, positions of the kept entries or None: entry i at position i, context length)
    seqs = [(40, torch.cat([torch.arange(64), torch.arange(400, 420), torch.arange(700, 1000)]), 384),  # 2 groups
            (1, scattered, 500),                                     # a SnapKV-like selection, decoding
            (3, None, 600),                                          # nothing evicted
            (1, None, 50),
            (1, torch.cat([torch.arange(16), torch.arange(2000, 2100)]), 116)]   # sinks out of the window
    f = kv_format(fmt)
    kc = f.encode(torch.randn(5 * 600, Hkv, D, generator=g))
    vc = f.encode(torch.randn(5 * 600, Hkv, D, generator=g))
    kv_slots = [torch.randperm(600, generator=g)[:c] + 600 * i for i, (_, _, c) in enumerate(seqs)]
    query_lens = [n for n, _, _ in seqs]
    positions = [pos for _, pos, _ in seqs]
    slot_mapping = torch.cat([s[-n:] for s, n in zip(kv_slots, query_lens)])
    q = torch.randn(sum(query_lens), H, D, generator=g)
    k, v = f.decode(kc[slot_mapping]), f.decode(vc[slot_mapping])

    def meta(pos=positions):
        return AttentionMetadata.build(slot_mapping, query_lens, [c for _, _, c in seqs], kv_slots, None, pos)

    want, at = [], 0
    for (n, pos, c), sl in zip(seqs, kv_slots):
        pos = torch.arange(c) if pos is None else pos
        want.append(_window_reference(q[at:at + n], f.decode(kc[sl]), f.decode(vc[sl]), pos[c - n:], pos, 0.125, W))
        at += n
    want = torch.cat(want)
    torch.testing.assert_close(paged_attention(q, k, v, kc, vc, meta(), 0.125, W, stored=True), want,
                               rtol=1e-4, atol=2e-5)
    out = paged_attention(q, k, v, kc, vc, meta(), 0.125, W, stored=True, kern=kern)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
    m = meta()
    assert int(m.kernel_rows().first_keys(m, W)[40]) == int((scattered <= 1499 - W).sum())   # the decode row
    plain = paged_attention(q, k, v, kc, vc, meta(None), 0.125, W, stored=True, kern=kern)
    assert torch.equal(out[41:45], plain[41:45])      # the sequences with nothing evicted: the same bits
    assert not torch.allclose(out[:41], plain[:41], atol=1e-3)   # the last W entries reach the sinks


@needs_kernels
def test_attention_first_keys_are_checked():
    kern = kernels.load()
    kc = vc = torch.zeros(8, 1, 16, dtype=torch.float16)
    q, slots, ctx = torch.zeros(2, 16), torch.zeros(2, 8, dtype=torch.int64), torch.tensor([3, 8])
    with pytest.raises(RuntimeError, match=r"first\[1\] = 8 is outside the row's keys 0 .. 7"):
        kern.attn_decode(q, kc, vc, slots, ctx, 1, 1, 0.25, 4, None, None, 0, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="one int64 per row"):
        kern.attn_decode(q, kc, vc, slots, ctx, 1, 1, 0.25, 4, None, None, 0, torch.tensor([0]))


@needs_kernels
def test_add_rmsnorm():
    h, y, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    want = h + F.rms_norm(y, (64,), w, 1e-6)
    kernels.load().add_rmsnorm(h, y, w, 1e-6)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)


def _logits(path: Path, mode: str, ids: list[int]) -> torch.Tensor:
    from loom.model.build import load_model
    from loom.model.runner import score

    return score(load_model(path, linear=mode), ids)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_auto_mode_stays_close_to_exact(tmp_path: Path, arch):
    from loom.model.build import load_model

    write = tiny_gguf.write_tiny_llama if arch == "llama" else tiny_gguf.write_tiny_gemma3
    path = write(tmp_path / f"{arch}.gguf", seed=5)   # a mix of F32, F16 and block types
    assert load_model(path, linear="auto").kern is not None       # the fused forward is taken
    ids = list(range(3, 60))
    exact, auto = _logits(path, "exact", ids), _logits(path, "auto", ids)
    # int8 activations: random tiny models (Gemma's many norms especially) amplify the rounding
    assert float((auto - exact).abs().max()) <= 0.1 * float(exact.abs().max())
    assert float((auto.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.85


def test_auto_mode_falls_back_to_torch_without_kernels(tmp_path: Path, monkeypatch):
    from loom.model.build import load_model

    monkeypatch.setattr(kernels, "_tried", True)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_reason", "disabled for this test")
    path = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", seed=2)
    model = load_model(path, linear="auto")
    assert model.kern is None
    assert not isinstance(make_linear(torch.randn(32, 64), "auto"), QuantLinear)
    ids = list(range(3, 40))
    exact, auto = _logits(path, "exact", ids), _logits(path, "auto", ids)
    assert float((auto - exact).abs().max()) <= 0.05 * float(exact.abs().max())


def _stack_outputs(model, tok, path: Path, case: str) -> tuple[list, int]:
    """Greedy outputs (token ids, top-5 logprobs) of three prompts, and the steps whose layers ran
    in one kernel call (DecodeStack)."""
    from loom.config import EngineConfig
    from loom.engine.engine import Engine
    from loom.llm import LLM
    from loom.sampling_params import SamplingParams

    opts = dict(block_size=4, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=4)
    if case == "int8 cache":
        opts["kv_cache_dtype"] = "int8"
    if case == "drafts":
        opts["speculative_config"] = {"method": "prompt_lookup", "num_speculative_tokens": 3, "adaptive": False}
    engine = Engine(EngineConfig.create(str(path), **opts), model=model, tokenizer=tok)
    taken = []
    if model.stack is not None:
        run = model.stack.run
        model.stack.run = lambda *a: taken.append(run(*a)) or taken[-1]
    eviction = {"policy": "streaming", "budget": 16, "sinks": 2} if case == "eviction" else None
    prompts = [[5, 6, 7, 8] * 5, list(range(3, 40)), [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_eviction=eviction,
                            logprobs=None if case == "drafts" else 5)
    outs = LLM.from_engine(engine).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if model.stack is not None:
        del model.stack.run
    rows = [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
            for c in (o.outputs[0] for o in outs)]
    return rows, sum(taken)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("case", ["decode", "int8 cache", "drafts", "eviction"])
def test_decode_stack_gives_the_python_loops_outputs(tmp_path: Path, arch, case):
    """The layers of a decode step in one kernel call (loom/model/layers/stack.py) make the Python
    loop's kernel calls with its arguments in its order: the same logits, bit for bit, for both
    architectures (Gemma 3's sliding-window and global layers, q/k norms, post norms), with a
    quantized cache (its smoothed q/k norms), draft chains verified as kernel rows, and evicted
    entries (the windowed layers' first keys)."""
    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import Tokenizer
    from loom.model.build import load_model

    write = tiny_gguf.write_tiny_llama if arch == "llama" else tiny_gguf.write_tiny_gemma3
    path = write(tmp_path / f"{arch}.gguf", seed=3)
    f = GGUFFile.open(path)
    model, tok = load_model(f, linear="auto"), Tokenizer.from_gguf(f)
    assert model.stack is not None
    fast, steps = _stack_outputs(model, tok, path, case)
    assert steps >= 8                   # the decode steps took it
    stack, model.stack = model.stack, None
    slow, _ = _stack_outputs(model, tok, path, case)
    model.stack = stack
    assert fast == slow
