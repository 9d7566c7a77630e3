#!/usr/bin/env bash
# kiln end to end on a fresh machine: install, make the example checkpoint, compile it,
# serve it, ask it one chat question, stop the server.  PORT=30000 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${PORT:-30000}"

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0   # pinned: an unpinned torch pulls a CUDA build
python -m pip install -q -e .

python -m kiln.example examples/tiny-llama              # random weights, trained tokenizer
kiln compile --model-path examples/tiny-llama --dtype float32 -o art/
kiln compile --model-path examples/tiny-llama --dtype float32 -o art/   # cache hit

kiln serve art/ --port "$port" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 "$server" || { echo "kiln serve exited" >&2; exit 1; }
  sleep 1
done
curl -sf "localhost:$port/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "tiny-llama",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 24
}'
echo
