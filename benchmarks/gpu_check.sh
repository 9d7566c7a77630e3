#!/usr/bin/env bash
# GPU verification, run by the `device` tool from the repo root on an H100 (see
# benchmarks/RESULTS.md, "GPU", for what it found):
#   1. install kiln: from wheels in $KILN_WHEELS (the device machines reach no package
#      index: build kiln's wheel and download the dependencies their image lacks, as
#      benchmarks/gpu_wheels.sh does), else `pip install -e ".[gpu,test]"`;
#   2. the CUDA tests: CUDA-graph capture and replay against eager steps and against the
#      CPU (tests/runtime/test_cuda.py), `kiln serve` of a CUDA artefact over loopback to
#      the openai client (tests/serve/test_cuda_server.py) and the Triton kernels compiled
#      for the GPU instead of interpreted (tests/kernels/test_triton.py with
#      KILN_TRITON_DEVICE=cuda);
#   3. decode with and without CUDA graphs on a real shape with dummy weights
#      (benchmarks/gpu_decode.py; $GPU_CONFIG, default qwen2.5-0.5b, a config.json path or
#      a name in ../shared/model-configs; $DECODE_ARGS adds gpu_decode.py's options, e.g.
#      "--deterministic" for --enable-deterministic-inference's cost).
# Each step has its own time limit, so one that hangs cannot take the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/kiln-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device here ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))"
    exit 1
fi
if [ -n "${KILN_WHEELS:-}" ]; then
    # Installed beside the image's packages, not over them; -P below keeps the checkout's
    # own kiln/ folder (the flat layout, not an installed package) off sys.path.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kiln-site \
        "$KILN_WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/kiln-site
    # and for the processes the tests start (`python -m kiln serve`)
    export PYTHONSAFEPATH=1
else
    "$PY" -m pip install -q -e ".[gpu,test]" 2>"$OUT/pip.log" \
        || echo "gpu_check: could not install the gpu/test extras (see $OUT/pip.log); using what is installed"
fi
"$PY" -P - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for mod in ("triton", "flashinfer", "transformers", "kiln"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "ok"), getattr(m, "__file__", ""))
    except Exception as e:
        print(mod, "MISSING:", e)
PY
status=0
KILN_TRITON_DEVICE=cuda timeout "${TEST_LIMIT:-240}" "$PY" -P -m pytest -q -p no:cacheprovider \
    --durations=8 tests/runtime/test_cuda.py tests/serve/test_cuda_server.py \
    tests/kernels/test_triton.py 2>&1 \
    | tee "$OUT/tests.log" || status=1
timeout "${DECODE_LIMIT:-180}" "$PY" -P benchmarks/gpu_decode.py \
    --config "${GPU_CONFIG:-qwen2.5-0.5b}" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" || status=1
exit $status
