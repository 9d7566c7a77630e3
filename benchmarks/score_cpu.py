"""What --multi-item-scoring-delimiter saves a /v1/score call on a CPU.

    python benchmarks/score_cpu.py
    python benchmarks/score_cpu.py --rounds 7 --query-words 400 --items 32

SmolLM2-135M-Instruct's shipped GGUF file served twice by `kiln serve` (one server at a
time on the machine), without and with the flag. Each round scores one query of
--query-words words against --items short items (a few words each, a different query
every call, so neither server's prefix cache holds it beforehand), and the rounds
alternate the two servers. Reported: the median (min-max) time of a call and the ratio.
No peer: SGLang's multi-item scoring runs on FlashInfer (GPUs), llama-server has no
/v1/score."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import HERE, print_table, read_bandwidth_gbs, spread
from serve_bench import Server, free_port

from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import fetch

LABELS = [" yes", " no"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="/v1/score calls a round a server")
    p.add_argument("--query-words", type=int, default=300)
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kiln-score-"))
    art = work / "art"
    compile_model(ServerArgs(model_path=str(fetch("smollm2"))), art)
    words = (HERE / "data" / "quality_text.txt").read_text().split()
    items = [" " + " ".join(words[7 * i : 7 * i + 4]) for i in range(args.items)]
    flags = {"per item": (), "query once": ("--multi-item-scoring-delimiter", "0")}
    times: dict[str, list[float]] = {name: [] for name in flags}
    tokens: dict[str, int] = {}
    offset = 0
    for r in range(args.rounds):
        order = list(flags) if r % 2 == 0 else list(flags)[::-1]
        for name in order:
            port = free_port()
            cmd = [sys.executable, "-m", "kiln", "serve", str(art), "--port", str(port)]
            srv = Server([*cmd, "--threads", str(args.threads), *flags[name]], port, work / "log")
            url = srv.url
            try:
                labels = [
                    httpx.post(
                        f"{url}/v1/tokenize", json={"prompt": t, "add_special_tokens": False}
                    ).json()["tokens"][0]
                    for t in LABELS
                ]
                for _ in range(args.calls):
                    offset += 1  # a query no call before had
                    query = " ".join(words[offset : offset + args.query_words])
                    body = {"query": query, "items": items, "label_token_ids": labels}
                    t0 = time.perf_counter()
                    out = httpx.post(f"{url}/v1/score", json=body, timeout=600)
                    times[name].append(time.perf_counter() - t0)
                    assert out.status_code == 200, out.text
                    tokens[name] = out.json()["usage"]["prompt_tokens"]
            finally:
                srv.stop()
    bw = read_bandwidth_gbs()
    base = statistics.median(times["per item"])
    rows = [
        f"| {name} | {spread([t * 1000 for t in ts])} | {tokens[name]} | "
        f"{base / statistics.median(ts):.2f}x |"
        for name, ts in times.items()
    ]
    title = (
        f"/v1/score, SmolLM2-135M-Instruct Q4_1: a {args.query_words}-word query, "
        f"{args.items} items, {args.calls} calls a round"
    )
    header = ["scoring", "ms a call", "prompt tokens", "speed-up"]
    print_table(title, bw, args.rounds, args.threads, header, rows)


if __name__ == "__main__":
    main()
