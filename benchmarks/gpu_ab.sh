#!/usr/bin/env bash
# Two builds of kiln on one GPU, alternating rounds of benchmarks/gpu_decode.py with the
# same arguments: the base build's wheel in $BASE (a folder with kiln's wheel), the
# checkout's from $KILN_WHEELS (with the dependencies, as benchmarks/gpu_wheels.sh makes).
#   here:   bash benchmarks/gpu_wheels.sh
#           git worktree add /tmp/kiln-base <commit>
#           (cd /tmp/kiln-base && pip wheel -q --no-deps --no-build-isolation -w "$OLDPWD/.whl/base" .)
#   there:  KILN_WHEELS=.whl BASE=.whl/base ROUNDS=2 bash benchmarks/gpu_ab.sh \
#               --config .whl/qwen2.5-0.5b.json --graphs-only --batches 1 64
# The benchmark scripts are the checkout's for both builds; only the kiln package differs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
deps=$(ls "$KILN_WHEELS"/*.whl | grep -v '/kiln-')
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kiln-ab-new \
    "$KILN_WHEELS"/*.whl || exit 1
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kiln-ab-base \
    $deps "$BASE"/kiln-*.whl || exit 1
status=0
for round in $(seq "${ROUNDS:-2}"); do
    for side in base new; do
        echo "== round $round: $side"
        PYTHONPATH=/tmp/kiln-ab-$side PYTHONSAFEPATH=1 timeout "${RUN_LIMIT:-150}" \
            "$PY" -P benchmarks/gpu_decode.py "$@" 2>&1 | grep -E '^\||started' || status=1
    done
done
exit $status
