"""loom itself, driven through `Engine.add_request` / `Engine.step` as `LLM.generate` does.

Prefix caching is off (the prefill prompt and the concurrency prompts must be computed, not
served from cache, as in the other engines) and the KV cache holds exactly the bench's capacity,
so peak RSS is comparable with llama.cpp's context sized the same way. The engine's modules
(torch among them) are imported with this module, before the timed load, as the llama.cpp peer
imports llama_cpp; `loom bench` times a whole `loom serve` start separately.
"""

from __future__ import annotations

from typing import Sequence

from loom.bench.peers.base import Peer, RunTiming, now, request_timing
from loom.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from loom.engine.engine import Engine
from loom.sampling_params import SamplingParams

BLOCK_SIZE = 16


class LoomPeer(Peer):
    def load(self) -> None:
        dtype = self.options.get("dtype", LoadConfig().dtype)
        kv = self.options.get("kv_cache_dtype", CacheConfig().kv_cache_dtype)
        max_seqs = max(SchedulerConfig().max_num_seqs, self.capacity.max_seqs)
        config = EngineConfig.create(str(self.model_path), dtype=dtype, threads=self.threads,
                                     enable_prefix_caching=False, block_size=BLOCK_SIZE, kv_cache_dtype=kv,
                                     num_blocks=self.capacity.blocks(BLOCK_SIZE) + 1, max_num_seqs=max_seqs)
        self.engine = Engine(config)
        kv = self.engine.kv_dtype.name
        self.info.update(dtype=dtype, kv_cache_dtype=kv, model_load_seconds=self.engine.load_seconds,
                         prefix_caching=False, kv_blocks=config.cache.num_blocks, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
        self.notes.append(f"dtype {dtype}, KV cache {kv}, prefix caching off, KV cache sized to the workload")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.engine
        start = now()
        ids = [engine.add_request({"prompt_token_ids": list(p)}, params) for p in prompts]
        finished, times = {}, {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            stamp = now()
            for out in outs:
                times.setdefault(out.request_id, []).extend([stamp] * len(out.outputs[0].delta_token_ids))
                if out.finished:
                    finished[out.request_id] = out
        wall = now() - start
        timings = []
        for rid in ids:
            out = finished[rid]
            m = out.metrics
            if m is None or m.first_token_time is None or m.last_token_time is None:
                raise RuntimeError(f"request {rid} finished without token timestamps")
            # from the run's common start, as the other peers time them: decode_throughput compares
            # token times across requests (each from its own arrival, a step's tokens fell apart)
            timings.append(request_timing(start, m.first_token_time, m.last_token_time,
                                          len(out.outputs[0].token_ids), times[rid]))
        return RunTiming(wall, timings)
