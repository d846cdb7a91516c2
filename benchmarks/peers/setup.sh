#!/usr/bin/env bash
# Gets and builds the two peer CPU implementations of the KDA recurrence that
# `python -m torch_kda bench --peers DIR` compares torch-kda with (docs/benchmarks.md):
#
#   - llama.cpp's ggml op GGML_OP_GATED_DELTA_NET, from the source that the PyPI sdist of
#     llama-cpp-python ships (vendor/llama.cpp), built with -DGGML_NATIVE=ON, plus our own small
#     driver (ggml_gdn_driver.c) that times ggml_graph_compute of a one-op graph;
#   - ExecuTorch's llama::gated_delta_rule, from the PyPI executorch wheel installed with --no-deps
#     into its own virtual environment with torch (its op library links against that torch).
#
# Not part of `make test`: it downloads ~100 MB and compiles for a few minutes.
#
# Usage: benchmarks/peers/setup.sh [DIR]        (DIR default: build/peers)
# Environment: PYTHON (interpreter for the ExecuTorch venv, default python3), TORCH_VERSION
# (default 2.13.0; pinned: an unpinned torch would pull a multi-GB CUDA build), JOBS (default 2),
# SKIP_EXECUTORCH=1 / SKIP_GGML=1 to build only one peer, LLAMA_SRC=path to use an unpacked
# llama.cpp tree instead of downloading the sdist.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-build/peers}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON_VERSION=0.3.36
EXECUTORCH_VERSION=1.5.1

if [ "${SKIP_GGML:-0}" != 1 ]; then
  SRC="${LLAMA_SRC:-}"
  if [ -z "$SRC" ]; then
    SDIST="$DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [ ! -f "$SDIST" ]; then
      echo "== downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (ships llama.cpp)"
      "$PYTHON" -m pip download --no-binary :all: --no-deps -d "$DIR" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    fi
    SRC="$DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    [ -d "$SRC" ] || tar -xzf "$SDIST" -C "$DIR"
  fi
  echo "== configuring llama.cpp (ggml only is built) in $DIR/ggml-build"
  # `cmake -S ggml` alone fails in this sdist (no ggml.pc.in): configure the top level, build ggml.
  cmake -S "$SRC" -B "$DIR/ggml-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$DIR/ggml-configure.log"
  cmake --build "$DIR/ggml-build" -j "$JOBS" --target ggml ggml-cpu ggml-base
  LIBDIR="$(dirname "$(find "$DIR/ggml-build" -name 'libggml-cpu.so' | head -1)")"
  echo "== building the driver $DIR/libkda_ggml_gdn.so"
  cc -O2 -std=c11 -shared -fPIC -I"$SRC/ggml/include" "$HERE/ggml_gdn_driver.c" \
    -L"$LIBDIR" -lggml -lggml-cpu -lggml-base -Wl,-rpath,"$LIBDIR" -o "$DIR/libkda_ggml_gdn.so"
fi

if [ "${SKIP_EXECUTORCH:-0}" != 1 ]; then
  VENV="$DIR/et-venv"
  echo "== ExecuTorch $EXECUTORCH_VERSION in $VENV (torch $TORCH_VERSION)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" numpy
  "$VENV/bin/python" -m pip install -q --no-deps "executorch==$EXECUTORCH_VERSION"
  "$VENV/bin/python" - <<'EOF'
import os, torch, executorch
lib = os.path.join(list(executorch.__path__)[0], "extension", "llm", "custom_ops", "libcustom_ops_aot_lib.so")
torch.ops.load_library(lib)
print("loaded", torch.ops.llama.gated_delta_rule.default._schema)
EOF
fi
echo "== done: python -m torch_kda bench --peers $DIR"
