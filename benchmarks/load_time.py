"""Load time and peak RSS of one engine start, in a fresh process: library import, then the
engine's load (wall and CPU time of this process), then a 256-token prompt and 16 generated
tokens; peak RSS is the process's high-water mark at the end.

Run twice to see a cold load (packs and writes the packed-weight cache) and a warm one (maps
it); `--cold` deletes this model's cache files first.

Run from the repository root: .venv/bin/python benchmarks/load_time.py [MODEL] [--threads N] [--cold]
"""

from __future__ import annotations

import argparse
import resource
import time

t_start, c_start = time.perf_counter(), time.process_time()

from loom.config import EngineConfig  # noqa: E402  (timed: the import is part of what is measured)
from loom.engine.engine import Engine  # noqa: E402
from loom.loader.cache import cache_root, file_sha256  # noqa: E402
from loom.loader.registry import resolve_model  # noqa: E402
from loom.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="delete this model's packed-weight cache first")
    args = ap.parse_args()
    t_import, c_import = time.perf_counter(), time.process_time()
    if args.cold:
        for f in (cache_root() / "packed").glob(f"{file_sha256(resolve_model(args.model))[:24]}-*.pack"):
            f.unlink()
    t0, c0 = time.perf_counter(), time.process_time()
    engine = Engine(EngineConfig.create(args.model, num_blocks=64, threads=args.threads, enable_prefix_caching=False))
    t1, c1 = time.perf_counter(), time.process_time()
    engine.add_request({"prompt_token_ids": list(range(100, 356))},
                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model}: import {t_import - t_start:.2f} s (cpu {c_import - c_start:.2f})  "
          f"load {t1 - t0:.2f} s (cpu {c1 - c0:.2f})  peak RSS {peak:.0f} MB")


if __name__ == "__main__":
    main()
