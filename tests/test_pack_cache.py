"""The packed-weight cache (loom/model/pack_cache.py) and the embedding read from its stored rows.

Every test points LOOM_CACHE at a fresh directory and loads the tiny random-weight GGUF models
with loom's kernels ("quant" mode): the first load packs and writes the cache, the next one
must map it and pack nothing; a bad file is reported in one line and rebuilt, never used.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

import tiny_gguf
from loom import hugepages, kernels
from loom.loader.gguf import GGUFFile
from loom.model import pack_cache, weights
from loom.model.build import load_model
from loom.model.layers.embedding import QuantEmbedding
from loom.model.pack_cache import PackCache, read_pack_file
from loom.model.quant import pack_codes

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"loom kernels: {kernels.unavailable_reason()}")
pytestmark = needs_kernels

Q = tiny_gguf.Q


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOOM_PACK_CACHE", raising=False)
    monkeypatch.setattr(pack_cache, "_reported", set())
    return tmp_path / "cache"


@pytest.fixture(params=["llama", "gemma3"])
def tiny_path(request, tiny_llama_path, tiny_gemma3_path) -> Path:
    return tiny_llama_path if request.param == "llama" else tiny_gemma3_path


def _pack_file(cache: Path) -> Path:
    files = list((cache / "packed").glob("*.pack"))
    assert len(files) == 1, files
    return files[0]


def _packed_weights(model) -> list[torch.Tensor]:
    layers = [b for L in model.layers for b in (L.qkv, L.o, L.gate_up, L.down)]
    return [b.p.w for b in [model.lm_head, *layers]]


def _count_packing(monkeypatch) -> list[int]:
    """Counts the matrices packed, whole (pack_codes) or by row range (pack_rows)."""
    calls = [0]
    for name in ("pack_codes", "pack_rows"):
        real = getattr(weights, name)

        def counting(*args, real=real):
            calls[0] += 1
            return real(*args)
        monkeypatch.setattr(weights, name, counting)
    return calls


def _mapping(t: torch.Tensor) -> tuple[str | None, dict[str, str]]:
    """The mapping that holds tensor `t`'s data (Linux): its file (None for anonymous memory)
    and its /proc/self/smaps fields."""
    addr = t.data_ptr()
    found, fields = None, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and len(head) >= 5:   # a mapping's first line: range perms offset dev inode [path]
            if found is not None:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= addr < hi:
                found = head[5] if len(head) == 6 and head[5].startswith("/") else ""
                fields["range"] = head[0]
        elif found is not None and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    assert found is not None, "no mapping holds the tensor"
    return found or None, fields


def _in_one_huge_page_buffer(model) -> bool:
    """Every packed weight of `model` in one anonymous mapping advised as huge pages (`hg`)."""
    maps = [_mapping(w) for w in _packed_weights(model)]
    return (all(where is None and "hg" in f["VmFlags"].split() for where, f in maps)
            and len({f["range"] for _, f in maps}) == 1)


def _thp_possible() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def test_huge_page_buffer():
    buf = hugepages.buffer(5 << 20)
    assert buf.nbytes == 5 << 20 and buf.ctypes.data % hugepages.HUGE_PAGE == 0 and not buf.any()
    buf[:] = 7
    t = torch.from_numpy(buf)
    where, smaps = _mapping(t)
    assert where is None and int(smaps["Size"].split()[0]) >= 4 << 10 and "hg" in smaps["VmFlags"].split()
    if _thp_possible() and "THPeligible" in smaps:
        assert smaps["THPeligible"] == "1", smaps   # advised: the kernel may back it with 2 MB pages
    assert int(t.sum()) == 7 * (5 << 20)


def _file_pmd_bytes(data: np.ndarray) -> int:
    return hugepages.file_pmd_bytes(data.ctypes.data, data.nbytes)


def test_a_file_maps_in_huge_pages_where_the_kernel_can(tmp_path):
    """A file of a few huge pages, written and dropped from the page cache: mapped through the
    advised mapping, it is in 2 MB pages wherever the probe says this kernel maps files so (and
    map_file returns nothing where it does not); the mapping reads the file's bytes and is
    copy-on-write."""
    path = tmp_path / "weights.bin"
    body = np.random.default_rng(0).integers(0, 256, 3 * hugepages.HUGE_PAGE + 12345, dtype=np.uint8)
    path.write_bytes(body.tobytes())
    supported = hugepages.probe_file_pages(tmp_path)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".huge-pages-probe")]
    hugepages.drop_cached(path)
    data = hugepages.map_file(path)
    if data is None and supported:   # a 2 MB folio the page cache could not get just then: once more
        hugepages.drop_cached(path)
        data = hugepages.map_file(path)
    assert (data is not None) == supported
    if data is None:
        return   # this kernel maps no file here in 2 MB pages, and map_file says so
    assert np.array_equal(data, body)
    assert _file_pmd_bytes(data) >= 3 * hugepages.HUGE_PAGE * 0.9
    data[:4] = 0   # a private mapping: the file keeps its bytes
    assert path.read_bytes()[:4] == body[:4].tobytes()


def test_a_small_file_is_not_mapped(tmp_path):
    path = tmp_path / "small.bin"
    path.write_bytes(b"\x01" * (2 * hugepages.HUGE_PAGE - 1))
    assert hugepages.map_file(path) is None


def _fake_huge_mapping(monkeypatch, works: bool) -> dict[str, int]:
    """hugepages as on a kernel that maps files in 2 MB pages (works) or not, for the tiny
    models' cache files (under two real huge pages): map_file maps the whole file privately."""
    calls = {"map": 0, "drop": 0}
    monkeypatch.setattr(hugepages, "HUGE_PAGE", 4096)

    def map_file(path):
        calls["map"] += 1
        return np.memmap(path, dtype=np.uint8, mode="c") if works else None

    def drop_cached(path):
        calls["drop"] += 1

    monkeypatch.setattr(hugepages, "map_file", map_file)
    monkeypatch.setattr(hugepages, "drop_cached", drop_cached)
    monkeypatch.setattr(hugepages, "probe_file_pages", lambda directory: works)
    return calls


def test_a_warm_load_maps_the_cache_file_where_it_maps_in_huge_pages(cache_dir, tiny_path, monkeypatch, caplog):
    monkeypatch.setenv("LOOM_HUGEPAGES", "1")
    cold = load_model(tiny_path, linear="quant")
    calls = _fake_huge_mapping(monkeypatch, works=True)
    packs = _count_packing(monkeypatch)
    warm = load_model(tiny_path, linear="quant")
    assert packs[0] == 0 and calls == {"map": 1, "drop": 0}
    path = _pack_file(cache_dir)
    for a, b in zip(_packed_weights(cold), _packed_weights(warm), strict=True):
        assert torch.equal(a, b) and _mapping(b)[0] == str(path)   # the file's pages, not a copy
    assert [w.data_ptr() for w in warm.stack.weights()] == [b.p.w.data_ptr() for L in warm.layers
                                                            for b in (L.qkv, L.o, L.gate_up, L.down)]
    assert (cache_dir / "packed" / f".huge-file-pages-{os.uname().release}").read_text() == "1\n"
    assert _warnings(caplog) == []


def test_where_files_do_not_map_in_huge_pages_a_load_copies_and_the_verdict_is_kept(
        cache_dir, tiny_llama_path, monkeypatch):
    monkeypatch.setenv("LOOM_HUGEPAGES", "1")
    load_model(tiny_llama_path, linear="quant")
    calls = _fake_huge_mapping(monkeypatch, works=False)
    monkeypatch.setattr(hugepages, "probe_file_pages", lambda directory: calls.__setitem__("probe", 1) or False)
    warm = load_model(tiny_llama_path, linear="quant")
    assert _in_one_huge_page_buffer(warm)
    assert calls == {"map": 0, "drop": 0, "probe": 1}, "the kernel cannot: no attempt, no second read"
    verdict = cache_dir / "packed" / f".huge-file-pages-{os.uname().release}"
    assert verdict.read_text() == "0\n"
    load_model(tiny_llama_path, linear="quant")
    assert calls["probe"] == 1, "probed once per kernel"


def test_cached_4k_pages_are_dropped_and_read_again_once_per_load(cache_dir, tiny_llama_path, monkeypatch):
    """Where the kernel maps files in 2 MB pages but this file's pages are cached in 4 KB folios
    (another process read it), they are dropped and mapped again; where they stay (another
    process maps them), the load copies."""
    monkeypatch.setenv("LOOM_HUGEPAGES", "1")
    load_model(tiny_llama_path, linear="quant")
    calls = _fake_huge_mapping(monkeypatch, works=True)
    results = iter([None, "map"])
    real = hugepages.map_file
    monkeypatch.setattr(hugepages, "map_file", lambda path: real(path) if next(results) else None)
    warm = load_model(tiny_llama_path, linear="quant")
    assert calls == {"map": 1, "drop": 1}
    assert all(_mapping(w)[0] == str(_pack_file(cache_dir)) for w in _packed_weights(warm))
    monkeypatch.setattr(hugepages, "map_file", lambda path: None)
    warm = load_model(tiny_llama_path, linear="quant")
    assert calls["drop"] == 2 and _in_one_huge_page_buffer(warm)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "loom" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("huge", [True, False], ids=["hugepages", "file-mapping"])
def test_warm_load_reads_the_cache_and_packs_nothing(cache_dir, tiny_path, huge, monkeypatch, caplog):
    monkeypatch.setenv("LOOM_HUGEPAGES", "1" if huge else "0")
    packs = _count_packing(monkeypatch)
    cold = load_model(tiny_path, linear="quant")
    assert packs[0] > 0 and cold.kern is not None
    path = _pack_file(cache_dir)
    assert not list(path.parent.glob(".*.tmp")), "the temporary file is renamed, not left behind"
    packs[0] = 0
    warm = load_model(tiny_path, linear="quant")
    assert packs[0] == 0
    for a, b in zip(_packed_weights(cold), _packed_weights(warm), strict=True):
        assert torch.equal(a, b)
        # both hold the weights as the cache file's data (the cold load reads what it wrote):
        # in anonymous memory (a huge-page buffer: test_huge_page_buffer), or as the file's pages
        assert _mapping(a)[0] == _mapping(b)[0] == (None if huge else str(path))
    if huge:
        assert _in_one_huge_page_buffer(cold) and _in_one_huge_page_buffer(warm)
    for model in (cold, warm):   # the one-call stack reads the same matrices: no second copy lives on
        layers = [b.p.w for L in model.layers for b in (L.qkv, L.o, L.gate_up, L.down)]
        assert [w.data_ptr() for w in model.stack.weights()] == [w.data_ptr() for w in layers]
    assert _warnings(caplog) == []
    # the sha256 of the file is remembered: the next load does not read the whole file again
    assert list((cache_dir / "identity").glob("*.json"))


def test_stale_key_is_reported_and_rebuilt(cache_dir, tiny_llama_path, monkeypatch, caplog):
    load_model(tiny_llama_path, linear="quant")
    monkeypatch.setattr(pack_cache, "loom_version", lambda: "99.0")
    packs = _count_packing(monkeypatch)
    load_model(tiny_llama_path, linear="quant")
    assert packs[0] > 0
    [line] = _warnings(caplog)
    assert "is stale (loom " in line and "-> '99.0'" in line and "rebuilding it" in line
    f = GGUFFile.open(tiny_llama_path)
    assert read_pack_file(_pack_file(cache_dir), pack_cache.cache_key(f, kernels.variant()))   # the new key


def _damaged(cache_dir: Path, tiny_path: Path, monkeypatch, caplog, damage) -> str:
    """Loads once, damages the file, loads again: returns the one warning and checks the rebuild."""
    load_model(tiny_path, linear="quant")
    path = _pack_file(cache_dir)
    good = path.read_bytes()
    damage(path, bytearray(good))
    packs = _count_packing(monkeypatch)
    model = load_model(tiny_path, linear="quant")
    assert packs[0] > 0, "a damaged file is never used"
    assert path.read_bytes() == good, "the rebuilt file is the same as the first"
    assert model.kern is not None
    [line] = _warnings(caplog)
    assert str(path) in line and line.endswith("rebuilding it")
    return line


def test_truncated_file_is_rebuilt(cache_dir, tiny_llama_path, monkeypatch, caplog):
    line = _damaged(cache_dir, tiny_llama_path, monkeypatch, caplog,
                    lambda p, b: p.write_bytes(b[:len(b) - 1000]))
    assert "truncated" in line


def test_file_cut_inside_the_header_is_rebuilt(cache_dir, tiny_llama_path, monkeypatch, caplog):
    line = _damaged(cache_dir, tiny_llama_path, monkeypatch, caplog, lambda p, b: p.write_bytes(b[:40]))
    assert "truncated (40 bytes)" in line


def test_corrupt_index_is_rebuilt(cache_dir, tiny_llama_path, monkeypatch, caplog):
    def flip_index_byte(p, b):
        b[100] ^= 0x20
        p.write_bytes(bytes(b))
    line = _damaged(cache_dir, tiny_llama_path, monkeypatch, caplog, flip_index_byte)
    assert "is corrupt (index checksum mismatch)" in line


def test_bad_magic_is_rebuilt(cache_dir, tiny_llama_path, monkeypatch, caplog):
    line = _damaged(cache_dir, tiny_llama_path, monkeypatch, caplog, lambda p, b: p.write_bytes(b"NOTAPACK" + b[8:]))
    assert "bad magic bytes" in line


def test_corrupt_data_is_rebuilt(cache_dir, tiny_gemma3_path, monkeypatch, caplog):
    def zero_first_entry(p, b):
        start = len(b) - int.from_bytes(b[24:32], "little")      # the data area ends the file
        b[start:start + 64] = bytes(64)
        p.write_bytes(bytes(b))
    line = _damaged(cache_dir, tiny_gemma3_path, monkeypatch, caplog, zero_first_entry)
    assert "is corrupt (entry" in line and "fails its data checksum" in line


def test_corrupt_bytes_between_the_sampled_ends_are_found_once_per_file(cache_dir, tiny_gemma3_path, monkeypatch,
                                                                          caplog):
    """The sampled checksums see an entry's first and last 256 bytes; a file not yet checked as
    it is (here: rewritten, so a new mtime) has every byte of every entry checked."""
    import json
    import struct

    def flip_a_middle_byte(p, b):
        _, _, _, index_len, data_len, _ = struct.unpack("<8sIIQQ32s", bytes(b[:64]))
        entries = json.loads(bytes(b[64:64 + index_len]))["entries"]
        e = max(entries.values(), key=lambda e: e["nbytes"])
        assert e["nbytes"] > 1024
        b[len(b) - data_len + e["offset"] + e["nbytes"] // 2] ^= 0x01
        p.write_bytes(bytes(b))
    line = _damaged(cache_dir, tiny_gemma3_path, monkeypatch, caplog, flip_a_middle_byte)
    assert "is corrupt (entry" in line and "fails its data checksum" in line


def test_unwritable_cache_directory_runs_without_it_and_says_so_once(cache_dir, tiny_llama_path, caplog):
    cache_dir.mkdir(parents=True)
    (cache_dir / "packed").write_text("a file where the cache directory should be")
    first = load_model(tiny_llama_path, linear="quant")
    second = load_model(tiny_llama_path, linear="quant")
    assert first.kern is not None and second.kern is not None
    assert _in_one_huge_page_buffer(first) and _in_one_huge_page_buffer(second)   # gathered as a warm load holds them
    [line] = _warnings(caplog)
    assert line.startswith("packed-weight cache unavailable (cannot write") and "loom runs without it" in line


def test_full_disk_leaves_no_partial_file(cache_dir, tiny_llama_path, monkeypatch, caplog):
    def disk_full(out, key, entries):
        out.write(b"LOOMPACK" + bytes(1000))
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pack_cache, "write_pack_file", disk_full)
    model = load_model(tiny_llama_path, linear="quant")
    assert model.kern is not None
    assert list((cache_dir / "packed").iterdir()) == []
    [line] = _warnings(caplog)
    assert "No space left on device" in line


def test_concurrent_loaders_leave_one_valid_file(cache_dir, tiny_gemma3_path, caplog):
    errors: list[BaseException] = []

    def load():
        try:
            load_model(tiny_gemma3_path, linear="quant")
        except BaseException as e:   # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    path = _pack_file(cache_dir)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    f = GGUFFile.open(tiny_gemma3_path)
    assert read_pack_file(path, pack_cache.cache_key(f, kernels.variant()))
    assert _warnings(caplog) == []


def test_cache_off_by_environment(cache_dir, tiny_llama_path, monkeypatch):
    monkeypatch.setenv("LOOM_PACK_CACHE", "0")
    model = load_model(tiny_llama_path, linear="quant")
    assert model.kern is not None and _in_one_huge_page_buffer(model)
    assert not (cache_dir / "packed").exists()


def test_exact_mode_does_not_touch_the_cache(cache_dir, tiny_llama_path):
    load_model(tiny_llama_path, linear="exact")
    assert not (cache_dir / "packed").exists()


def test_cache_holds_every_projection(cache_dir, tiny_llama_path):
    model = load_model(tiny_llama_path, linear="quant")
    f = GGUFFile.open(tiny_llama_path)
    cache = PackCache.open(f, kernels.variant())
    assert len(cache.entries) == 1 + 4 * len(model.layers)
    assert "blk.0.attn_q.weight@unpermute4+blk.0.attn_k.weight@unpermute2+blk.0.attn_v.weight" in cache.entries


def _resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps, as _mapping reads it)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:   # a mapping's first line
            inside = len(head) == 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def test_a_packed_matrix_leaves_its_stored_pages_out_of_the_resident_set(tmp_path):
    """A cold load reads each stored matrix once, by row range, and drops its file pages from the
    resident set after copying out its codes: they need not stay beside the packed copy."""
    import gguf

    rng = np.random.default_rng(0)
    table = rng.standard_normal((1024, 512)).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("m.weight", tiny_gguf.quantize(table, Q.Q8_0), raw_shape=(1024, 512 // 32 * 34), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile.open(path)
    w = weights.GGUFWeights(f).linear("m.weight", (1024, 512))
    before = _resident_bytes(path)
    packed = w.packed()   # no cache: packed by row range from the file
    assert _resident_bytes(path) - before < f.tensor_info("m.weight").nbytes // 4
    assert packed.zero == 128 and packed.n == 1024
    raw = f.raw("m.weight")
    assert torch.equal(packed.w, pack_codes(weights.exact_codes(np.asarray(raw), Q.Q8_0, (1024, 512))).w)
    assert int(raw.sum()) > 0 and _resident_bytes(path) - before >= raw.nbytes // 2   # read again, it is there again
    f.release(raw)
    assert _resident_bytes(path) - before < raw.nbytes // 4


# -- the embedding, gathered from its stored rows ---------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q6_K],
                         ids=lambda t: t.name)
def test_embedding_rows_equal_the_dequantized_table(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    table = rng.standard_normal((40, 256)).astype(np.float32)
    raw = tiny_gguf.quantize(table, qtype)
    path = tmp_path / "table.bin"
    path.write_bytes(b"x" * 77 + raw.tobytes())       # an offset that is not page-aligned
    emb = QuantEmbedding(path, 77, qtype, (40, 256))
    ref = gguf_dequantize(raw, qtype).reshape(40, 256).astype(np.float32)
    ids = torch.tensor([[3, 0, 39], [3, 17, 5]])
    out = emb[ids]
    assert out.shape == (2, 3, 256) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), ref[ids.numpy()])


# -- the tokenizer's derived merges ------------------------------------------------------------------------


def test_derived_merges_are_cached_and_a_bad_file_is_derived_again(cache_dir, tmp_path):
    import tiny_gguf
    from loom.loader.tokenizer import Tokenizer

    f = GGUFFile.open(tiny_gguf.write_tiny_llama(tmp_path / "tiny-spm.gguf", vocab="spm"))   # scores, no merges
    cold = Tokenizer.from_gguf(f)
    [path] = (cache_dir / "tokenizers").glob("*.merges.npy")
    assert np.load(path).shape[1] == 2
    warm = Tokenizer.from_gguf(f)
    assert warm._backend.to_str() == cold._backend.to_str()
    path.write_bytes(b"not an array")
    again = Tokenizer.from_gguf(f)
    assert again._backend.to_str() == cold._backend.to_str()
    assert np.load(path).shape[1] == 2, "the bad file is replaced"


def test_gemma_vocabulary_proto_is_cached_and_a_bad_file_is_built_again(cache_dir, tiny_gemma3_path):
    from loom.loader.tokenizer import Tokenizer

    f = GGUFFile.open(tiny_gemma3_path)
    texts = ["Hello world", "a" + " " * 20 + "b", "<start_of_turn>user\nhi<end_of_turn>", "日本語 🤗"]
    cold = Tokenizer.from_gguf(f)
    want = [cold.encode(t) for t in texts]
    [path] = (cache_dir / "tokenizers").glob("*.spm")
    proto = path.read_bytes()
    assert Tokenizer.from_gguf(f).encode_batch(texts) == want
    for bad in (b"not a proto", proto[: len(proto) // 2]):
        path.write_bytes(bad)
        assert Tokenizer.from_gguf(f).encode_batch(texts) == want
        assert path.read_bytes() == proto, "the bad file is replaced"


def test_gemma_vocabulary_loads_with_an_unwritable_cache(cache_dir, tiny_gemma3_path):
    from loom.loader.tokenizer import Tokenizer

    cache_dir.mkdir(parents=True)
    (cache_dir / "tokenizers").write_text("a file where the cache directory should be")
    for _ in range(2):
        tok = Tokenizer.from_gguf(GGUFFile.open(tiny_gemma3_path))
        assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
