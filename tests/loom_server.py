"""Real `loom serve` subprocesses for the server tests, and helpers to read their metrics.

A `LoomServer` runs ``python -m loom serve MODEL`` on a free loopback port with its output in
a log file. `ServerPool` launches several at once (model loading overlaps) and hands each out
when its /health answers. A server that exits or does not become healthy fails the test
with the tail of its log; `logged_tracebacks` lets a test assert the log stayed clean.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loom.bench.server_peers import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 120.0


class LoomServer:
    def __init__(self, name: str, model: str | Path, args: list[str], log_dir: Path,
                 api_key: str | None = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"{name}.log"
        command = [sys.executable, "-m", "loom", "serve", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                       os.environ.get("PYTHONPATH")]))}
        env.pop("LOOM_API_KEY", None)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=REPO_ROOT)
        self._ready = False

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url."""
        return f"{self.url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _fail(self, why: str) -> None:
        tail = "\n".join(self.log_text().splitlines()[-40:])
        pytest.fail(f"server {self.name!r} {why}; last log lines:\n{tail}", pytrace=False)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "LoomServer":
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"exited with status {self.process.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self._fail(f"was not healthy after {timeout:.0f}s")
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()

    def logged_tracebacks(self) -> list[str]:
        text = self.log_text()
        return [m.group(0) for m in re.finditer(r"Traceback \(most recent call last\):[\s\S]{0,2000}", text)]


class ServerPool:
    """Servers launched together; `get(name)` waits for that one to be healthy."""

    def __init__(self) -> None:
        self.servers: dict[str, LoomServer] = {}

    def launch(self, server: LoomServer) -> None:
        self.servers[server.name] = server

    def get(self, name: str) -> LoomServer:
        return self.servers[name].wait_ready()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


# -- /metrics ---------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(server: LoomServer) -> dict[str, float]:
    """The /metrics samples as {"name{labels}": value} (labels as exposed, in order)."""
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    response.raise_for_status()
    samples = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels`."""
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    raise KeyError(f"no sample {name} {labels} in {sorted(samples)[:50]}")


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    """Polls `predicate` until it returns a truthy value; fails the test after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})", pytrace=False)
