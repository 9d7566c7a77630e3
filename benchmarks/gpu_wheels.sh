#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.sh on a machine that reaches no package index (the
# `device` tool's): kiln's own wheel plus the dependencies the device image lacks, for
# CPython 3.12 on x86-64 Linux, and the model configs gpu_decode.py reads. Run here, then
#   (on the GPU machine, .whl/ carried there) KILN_WHEELS=.whl GPU_CONFIG=.whl/qwen2.5-0.5b.json \
#       bash benchmarks/gpu_check.sh
# (.whl/ is in .gitignore, so it travels only when carried.)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" \
    gguf==0.19.0 dill==0.4.1 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
# pydantic, the server and the openai client of tests/serve/test_cuda_server.py, with what
# they need (resolved here: the image has neither fastapi, uvicorn nor openai).
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" \
    fastapi==0.165.0 uvicorn==0.54.0 openai==3.57.0 pydantic==2.14.4 pydantic_core==2.50.5
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" .
cp ../shared/model-configs/*.json "$DEST"/
ls "$DEST"
