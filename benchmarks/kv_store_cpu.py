"""A long prompt's first token after a restart: from the prefix cache's disk tier
(--enable-hierarchical-cache --hicache-storage-backend file), against computing it.

    python benchmarks/kv_store_cpu.py --llama-server $LLAMA/build/bin/llama-server
    python benchmarks/kv_store_cpu.py --llama-server ... --prompt-words 1500 --rounds 5

SmolLM2-135M-Instruct's shipped GGUF file (Q4_1). Each round has a prompt of its own
(--prompt-words words of benchmarks/data/quality_text.txt from a new offset) and runs, in
an order that flips every round:
- kiln with the tier (a folder of this run's): started, asked the prompt (its pages kept),
  stopped, started again and asked again: the second answer's time is "restored";
- kiln without it: started, asked: "computed" (what any restart costs without the tier);
- llama-server (`-c` the prompt's room, `-t`/`-tb` --threads): started, asked, restarted,
  asked again: its prompt cache lives in the process, so the prompt is computed again.
A call is /v1/completions with max_tokens 1 (the time to the first token, prefill and one
sample). Reported: median (min-max) ms, ratios of the medians, and the tier's read rate
(its pages' bytes over the seconds `load` spent, from /get_server_info)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
from bench_common import HERE, print_table, read_bandwidth_gbs, shipped_artefact, spread
from serve_bench import Server, free_port

TIER = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file")


def ask(url: str, prompt: str) -> tuple[float, int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return took, int(r.json()["usage"]["prompt_tokens"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=1200)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    if not args.llama_server.is_file():
        sys.exit(f"--llama-server: no file {args.llama_server}")

    work, gguf, art = shipped_artefact("kiln-kv-store-")
    words = (HERE / "data" / "quality_text.txt").read_text().split()
    log = work / "log"
    threads = ["--threads", str(args.threads)]
    times: dict[str, list[float]] = {"restored": [], "computed": [], "llama-server": []}
    rates: list[float] = []
    tokens = 0

    def kiln(*flags: str) -> Server:
        port = free_port()
        cmd = [sys.executable, "-m", "kiln", "serve", str(art), "--port", str(port)]
        return Server([*cmd, *threads, *flags], port, log)

    def with_tier(prompt: str) -> None:
        folder = work / "pages"
        shutil.rmtree(folder, ignore_errors=True)
        extra = ("--hicache-storage-backend-extra-config", f'{{"storage_dir": "{folder}"}}')
        srv = kiln(*TIER, *extra)
        try:
            ask(srv.url, prompt)
        finally:
            srv.stop()
        srv = kiln(*TIER, *extra)
        try:
            took, _ = ask(srv.url, prompt)
            info = httpx.get(srv.url + "/get_server_info").json()["hicache_storage"]
        finally:
            srv.stop()
        times["restored"].append(took)
        if info["read_seconds"] > 0:
            rates.append(info["blocks_read"] * info["block_bytes"] / info["read_seconds"] / 1e9)

    def without(prompt: str) -> None:
        nonlocal tokens
        srv = kiln()
        try:
            took, tokens = ask(srv.url, prompt)
        finally:
            srv.stop()
        times["computed"].append(took)

    def llama(prompt: str) -> None:
        for _restart in range(2):
            port = free_port()
            cmd = [str(args.llama_server), "-m", str(gguf), "--port", str(port)]
            cmd += ["-c", str(4 * args.prompt_words + 256), "-t", str(args.threads)]
            cmd += ["-tb", str(args.threads), "--flash-attn", "off"]
            srv = Server(cmd, port, log)
            try:
                took, _ = ask(srv.url, prompt)
            finally:
                srv.stop()
        times["llama-server"].append(took)

    runs = [with_tier, without, llama]
    for r in range(args.rounds):
        prompt = " ".join(words[50 * r : 50 * r + args.prompt_words])
        for run in runs if r % 2 == 0 else runs[::-1]:
            run(prompt)
    restored = statistics.median(times["restored"])
    rows = [
        f"| {name} | {spread([t * 1000 for t in ts])} | {statistics.median(ts) / restored:.2f}x |"
        for name, ts in times.items()
    ]
    rate = f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})" if rates else "-"
    title = (
        f"Time to first token after a restart, a {tokens}-token prompt, SmolLM2-135M-Instruct "
        f"Q4_1; the tier read its pages at {rate} GB/s"
    )
    header = ["first token", "ms (median, min-max)", "against restored"]
    print_table(title, read_bandwidth_gbs(), args.rounds, args.threads, header, rows)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
