"""`loom bench`: loom and its peers measured in one run, on the same GGUF file and thread count.

Layout:

* `settings`: what to measure (`BenchSettings`) and the token ids to measure it with (`Workload`).
* `prompts`: builds the workload from Spec-Bench prompts with the model's own tokenizer.
* `peers`: one adapter per engine (loom, transformers, llama.cpp) behind the `Peer` interface.
* `suites`: the measurements (decode, prefill, concurrency), chosen by `BenchSettings.suites`;
  later suites (speculative decoding for ``--spec``, parallel sampling for ``--parallel``) are
  registered in `suites.ALL_SUITES`. ``--server URL`` will be one more peer kind (an HTTP client
  adapter) in `peers.PEER_KINDS`.
* `worker`: ``python -m loom.bench.worker ENGINE JOB`` runs every suite for one engine in its
  own process, so peak RSS belongs to that engine alone.
* `harness`: starts one worker per engine, drives the progress bar, collects a `BenchReport`.
* `report`, `plots`: the rich table, the JSON file and the PNG charts.

Nothing here imports torch at module level: the llama.cpp worker must not pay for it.
"""
