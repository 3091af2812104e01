#!/usr/bin/env bash
# guidellm (PyPI, an external load generator) against a running `loom serve`, as a check from
# outside loom's own `loom bench --server`: concurrent streams of 256-token synthetic prompts and
# 64 output tokens (loom-256-64.json; 8 and 32 streams, 30 s each).
#
#   benchmarks/guidellm/run.sh URL MODEL [OUT_JSON]
#   e.g. benchmarks/guidellm/run.sh http://127.0.0.1:8000 smollm2-135m /tmp/guidellm.json
#
# guidellm lives in its own venv (GUIDELLM_VENV, default <loom cache>/peers/guidellm-venv; made
# here on first use, with the CPU torch first so pip does not pull a CUDA build). It counts
# tokens with a Hugging Face tokenizer: the model's, exported from the GGUF by
# loom.bench.hf_export (the same export vLLM's peer loads).
set -euo pipefail
URL=${1:?usage: run.sh URL MODEL [OUT_JSON]}
MODEL=${2:?usage: run.sh URL MODEL [OUT_JSON]}
OUT=${3:-guidellm.json}
HERE="$(cd "$(dirname "$0")" && pwd)"
PY=${PY:-.venv/bin/python}
CACHE="${LOOM_CACHE:-$HOME/.cache/loom}"
VENV="${GUIDELLM_VENV:-$CACHE/peers/guidellm-venv}"
if [ ! -x "$VENV/bin/guidellm" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q guidellm==0.8.1
fi
TOKENIZER="$("$PY" -c "
from loom.bench.hf_export import export_hf
from loom.loader.registry import resolve_model
print(export_hf(resolve_model('$MODEL')))" | tail -1)"
"$VENV/bin/guidellm" run --scenario "$HERE/loom-256-64.json" \
  --backend "kind=openai_http,target=$URL,model=$MODEL" --tokenizer "kind=hf_auto,model=$TOKENIZER" \
  --disable-console-interactive --output "kind=json,path=$OUT"
