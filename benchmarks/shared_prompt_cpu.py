"""What computing a shared prompt once saves on a CPU: /v1/score's items after one query
(--multi-item-scoring-delimiter), and n samples of one prompt.

    python benchmarks/shared_prompt_cpu.py
    python benchmarks/shared_prompt_cpu.py --rounds 7 --prompt-words 400 --items 32 --n 8

SmolLM2-135M-Instruct's shipped GGUF file served by `kiln serve`, one server at a time on
the machine, rounds alternating the two servers of each case:
- score: without and with --multi-item-scoring-delimiter; a call scores one query of
  --prompt-words words against --items items of four words;
- n: `--disable-radix-cache` (each sample computes the prompt, as every sample of one call
  did before the prompt was prefilled ahead: one batch shares nothing) and the default
  (the prompt prefilled once, the samples from its cached K/V); a call asks /v1/completions
  for --n samples of --max-tokens tokens after a --prompt-words prompt.
Every call's prompt is new (a different offset into the text), so no cache holds it
beforehand. Reported: the median (min-max) time of a call, and the ratio. No peer:
SGLang's multi-item scoring runs on FlashInfer (GPUs); llama-server has no /v1/score, and
its n samples are n sequences in slots."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from bench_common import HERE, print_table, read_bandwidth_gbs, shipped_artefact, spread
from serve_bench import Server, free_port

CASES = {
    "score": {"per item": (), "query once": ("--multi-item-scoring-delimiter", "0")},
    "n": {"each sample": ("--disable-radix-cache",), "prompt once": ()},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="calls a round a server")
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    work, _, art = shipped_artefact("kiln-shared-")
    words = (HERE / "data" / "quality_text.txt").read_text().split()
    items = [" " + " ".join(words[7 * i : 7 * i + 4]) for i in range(args.items)]
    offset = 0

    def prompt() -> str:
        nonlocal offset
        offset += 1  # a prompt no call before had
        return " ".join(words[offset : offset + args.prompt_words])

    def score(url: str) -> Callable[[], dict[str, Any]]:
        labels = [tokenize(url, t) for t in (" yes", " no")]
        return lambda: {"query": prompt(), "items": items, "label_token_ids": labels}

    def sample(url: str) -> Callable[[], dict[str, Any]]:
        body = {"model": "m", "max_tokens": args.max_tokens, "n": args.n, "temperature": 1.0}
        return lambda: {**body, "prompt": prompt(), "seed": offset}

    routes = {"score": ("/v1/score", score), "n": ("/v1/completions", sample)}
    for case in args.cases:
        route, make_body = routes[case]
        flags = CASES[case]
        times: dict[str, list[float]] = {name: [] for name in flags}
        tokens: dict[str, int] = {}
        for r in range(args.rounds):
            for name in list(flags) if r % 2 == 0 else list(flags)[::-1]:
                port = free_port()
                cmd = [sys.executable, "-m", "kiln", "serve", str(art), "--port", str(port)]
                cmd += ["--threads", str(args.threads), *flags[name]]
                srv = Server(cmd, port, work / "log")
                try:
                    body = make_body(srv.url)
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        out = httpx.post(srv.url + route, json=body(), timeout=600)
                        times[name].append(time.perf_counter() - t0)
                        assert out.status_code == 200, out.text
                        tokens[name] = out.json()["usage"]["prompt_tokens"]
                finally:
                    srv.stop()
        base = statistics.median(times[next(iter(flags))])
        rows = [
            f"| {name} | {' '.join(flags[name]) or '(default)'} | "
            f"{spread([t * 1000 for t in ts])} | {tokens[name]} | "
            f"{base / statistics.median(ts):.2f}x |"
            for name, ts in times.items()
        ]
        what = (
            f"/v1/score of {args.items} items"
            if case == "score"
            else f"/v1/completions n={args.n}, {args.max_tokens} tokens each"
        )
        title = (
            f"{what} after a {args.prompt_words}-word prompt, SmolLM2-135M-Instruct Q4_1, "
            f"{args.calls} calls a round"
        )
        header = ["prompt computed", "kiln serve flags", "ms a call", "prompt tokens", "speed-up"]
        print_table(title, read_bandwidth_gbs(), args.rounds, args.threads, header, rows)


def tokenize(url: str, text: str) -> int:
    body = {"prompt": text, "add_special_tokens": False}
    return int(httpx.post(url + "/v1/tokenize", json=body).json()["tokens"][0])


if __name__ == "__main__":
    main()
