#!/usr/bin/env bash
# KL divergence of loom's default mode (both kernel variants) and of llama.cpp from loom's float32
# reference, on both shipped models, over the same Shakespeare windows.
# Usage: benchmarks/fidelity.sh [CHUNKS] [OUT_DIR]     (run from the repository root)
set -euo pipefail
CHUNKS=${1:-16}
OUT=${2:-/tmp/loom-fidelity}
TEXT=../shared/data/text/shakespeare.txt
LOOM=.venv/bin/loom
mkdir -p "$OUT"
for model in smollm2-135m gemma3-270m; do
  base="$OUT/$model-base"
  $LOOM eval $model --file $TEXT --chunks $CHUNKS --dtype float32 --save-base "$base" --json "$OUT/$model-float32.json"
  $LOOM eval $model --file $TEXT --chunks $CHUNKS --base "$base" --json "$OUT/$model-auto-avx512.json" --plot "$OUT/$model-auto-avx512.png"
  LOOM_KERNELS=avx2 $LOOM eval $model --file $TEXT --chunks $CHUNKS --base "$base" --json "$OUT/$model-auto-avx2.json"
  $LOOM eval $model --file $TEXT --chunks $CHUNKS --engine llama.cpp --base "$base" --json "$OUT/$model-llamacpp.json"
  rm -rf "$base"
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| model | engine | mean KLD | 99% KLD | max KLD | same top token | PPL | PPL ratio |")
print("|---|---|---|---|---|---|---|---|")
for model in ("smollm2-135m", "gemma3-270m"):
    for tag, name in (("auto-avx512", "loom default, AVX-512"), ("auto-avx2", "loom default, AVX2"),
                      ("llamacpp", "llama.cpp")):
        s = json.loads((out / f"{model}-{tag}.json").read_text())
        print(f"| {model} | {name} | {s['kld_mean']:.5f} ± {s['kld_stderr']:.5f} | {s['kld_quantiles']['99']:.4f} | "
              f"{s['kld_max']:.3f} | {s['same_top_pct']:.2f}% | {s['ppl']:.3f} | {s['ppl_ratio']:.4f} |")
    s = json.loads((out / f"{model}-float32.json").read_text())
    print(f"| {model} | loom float32 (reference) | 0 | 0 | 0 | 100% | {s['ppl']:.3f} | 1 |")
PY
