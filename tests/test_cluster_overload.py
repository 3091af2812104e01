"""`loom serve --replicas` under more load than it holds, on a live local Ray: every replica's queue
full -> 429 with Retry-After to the client; Ray Serve autoscaling (`--min-replicas`,
`--max-replicas`, `--target-ongoing-requests`) starting a second replica under sustained load.

One cluster: one replica at first, at most two (an upscale delay of 2 s), one sequence running and
one waiting per replica.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loom_server import LoomServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tight_cluster(tiny_llama_path, tmp_path_factory):
    server = LoomServer("tight_cluster", tiny_llama_path,
                        ["--replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
                         "--target-ongoing-requests", "1", "--autoscaling-config", '{"upscale_delay_s": 2}',
                         "--threads", "1", "--max-num-seqs", "1",
                         "--max-waiting", "1", "--no-access-log"],
                        tmp_path_factory.mktemp("tight_cluster_logs"))
    try:
        yield server.wait_ready(timeout=180)
    finally:
        server.stop()


def _replica_count(server: LoomServer) -> int:
    return len(httpx.get(f"{server.url}/v1/loom/replicas", timeout=10).json()["replicas"])


def test_a_full_cluster_answers_429_with_retry_after(tight_cluster):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "keep going " * 4, "max_tokens": 400, "ignore_eos": True}
            return await asyncio.gather(*[client.post(f"{tight_cluster.url}/v1/completions", json=body)
                                          for _ in range(8)])

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "waiting queue is full" in error["message"], error
    done = next(r for r in responses if r.status_code == 200).json()
    assert done["usage"]["completion_tokens"] == 400


def test_sustained_load_scales_out_to_the_maximum(tight_cluster):
    """Two requests always in flight against a target of one per replica: Ray Serve's
    autoscaler starts the second replica (after its upscale delay, 2 s here), and it serves."""
    assert _replica_count(tight_cluster) == 1
    deadline = time.monotonic() + 150

    async def keep_busy(client: httpx.AsyncClient, stop: asyncio.Event) -> set[str]:
        served = set()
        while not stop.is_set() and time.monotonic() < deadline:
            r = await client.post(f"{tight_cluster.url}/v1/completions",
                                  json={"prompt": "busy " * 4, "max_tokens": 480, "ignore_eos": True})
            if r.status_code == 200:
                served.add(r.headers["x-loom-replica"])
            else:
                await asyncio.sleep(0.2)
        return served

    async def run() -> tuple[int, set[str]]:
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            workers = [asyncio.create_task(keep_busy(client, stop)) for _ in range(3)]
            count = 1
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                count = len((await client.get(f"{tight_cluster.url}/v1/loom/replicas")).json()["replicas"])
                if count == 2:
                    await asyncio.sleep(5.0)     # let the new replica take requests
                    break
            stop.set()
            served = set().union(*await asyncio.gather(*workers))
        return count, served

    count, served = asyncio.run(run())
    assert count == 2, "the autoscaler did not start a second replica within 150 s"
    assert len(served) == 2, served
    assert httpx.get(f"{tight_cluster.url}/health", timeout=10).json() == {"status": "ok", "replicas": 2}
