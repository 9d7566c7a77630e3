#!/usr/bin/env bash
# GPU verification, for the day a GPU is lent (the `device` tool runs this from the repo
# root on an H100). Nothing here has run on a GPU yet.
#   1. install the gpu extra (Triton, FlashInfer) next to a CUDA build of torch, if the
#      machine can reach a package index (the device machines cannot: then it uses what
#      is installed and says what is missing);
#   2. the CUDA tests: CUDA-graph capture and replay against eager steps
#      (tests/runtime/test_cuda.py) and the Triton kernels compiled for the GPU instead of
#      interpreted (tests/kernels/test_triton.py with KILN_TRITON_DEVICE=cuda);
#   3. decode with and without CUDA graphs on the Llama-3-8B shape, dummy weights
#      (benchmarks/gpu_decode.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/kiln-gpu-check}
mkdir -p "$OUT"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device here ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))"
    exit 1
fi
"$PY" -m pip install -q -e ".[gpu,test]" 2>"$OUT/pip.log" \
    || echo "gpu_check: could not install the gpu/test extras (see $OUT/pip.log); using what is installed"
"$PY" - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for mod in ("triton", "flashinfer", "kiln"):
    try:
        print(mod, getattr(importlib.import_module(mod), "__version__", "ok"))
    except Exception as e:
        print(mod, "MISSING:", e)
PY
status=0
KILN_TRITON_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/runtime/test_cuda.py tests/kernels/test_triton.py 2>&1 | tee "$OUT/tests.log" || status=1
"$PY" benchmarks/gpu_decode.py --config llama-3-8b 2>&1 | tee "$OUT/decode.log" || status=1
exit $status
