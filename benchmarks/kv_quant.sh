#!/usr/bin/env bash
# Quantized KV caches: KL divergence of loom's int8 / int4 KV from loom with float16 KV, beside
# llama.cpp's q8_0 / q4_0 KV from llama.cpp with f16 KV (flash attention on in all three), on both
# shipped models, over the same Shakespeare windows.
# Usage: benchmarks/kv_quant.sh [CHUNKS] [OUT_DIR]     (run from the repository root)
set -euo pipefail
CHUNKS=${1:-16}
OUT=${2:-/tmp/loom-kv-quant}
TEXT=../shared/data/text/shakespeare.txt
LOOM=${LOOM:-.venv/bin/loom}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for model in smollm2-135m gemma3-270m; do
  $LOOM eval $model --file $TEXT --chunks $CHUNKS --kv-cache-dtype float16 --save-base "$OUT/$model-loom-base" \
    --json "$OUT/$model-loom-float16.json"
  for kv in int8 int4; do
    $LOOM eval $model --file $TEXT --chunks $CHUNKS --kv-cache-dtype $kv --base "$OUT/$model-loom-base" \
      --json "$OUT/$model-loom-$kv.json"
  done
  $LOOM eval $model --file $TEXT --chunks $CHUNKS --engine llama.cpp --kv-cache-dtype f16 \
    --save-base "$OUT/$model-llama-base" --json "$OUT/$model-llama-f16.json"
  for kv in q8_0 q4_0; do
    $LOOM eval $model --file $TEXT --chunks $CHUNKS --engine llama.cpp --kv-cache-dtype $kv \
      --base "$OUT/$model-llama-base" --json "$OUT/$model-llama-$kv.json"
  done
  rm -rf "$OUT/$model-loom-base" "$OUT/$model-llama-base"
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| model | engine | KV cache | mean KLD vs its float16 KV | 99% KLD | same top token | PPL | PPL ratio |")
print("|---|---|---|---|---|---|---|---|")
for model in ("smollm2-135m", "gemma3-270m"):
    for engine, kvs in (("loom", ("int8", "int4")), ("llama", ("q8_0", "q4_0"))):
        for kv in kvs:
            s = json.loads((out / f"{model}-{engine}-{kv}.json").read_text())
            print(f"| {model} | {'loom' if engine == 'loom' else 'llama.cpp'} | {kv} | {s['kld_mean']:.5f} ± "
                  f"{s['kld_stderr']:.5f} | {s['kld_quantiles']['99']:.4f} | {s['same_top_pct']:.2f}% | "
                  f"{s['ppl']:.3f} | {s['ppl_ratio']:.4f} |")
PY
