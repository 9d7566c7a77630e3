"""Serving throughput and latency: N concurrent clients against `kiln serve`, and the same
workload through transformers one request at a time (the peer), in the same run.

    python benchmarks/serve_bench.py                       # SmolLM2-135M shape, fp32
    python benchmarks/serve_bench.py --concurrency 16 --num-requests 64 --output-len 64

Prompts are random token ids of a fixed length; every request generates exactly
--output-len tokens (ignore_eos). Requests stream through SGLang's native /generate
(token ids in, output ids per step out), so TTFT and inter-token latency are measured at
the client from token arrival times.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_cpu import SMOLLM2_135M


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def start_server(
    art: Path, port: int, concurrency: int, extra: list[str]
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "kiln",
        "serve",
        str(art),
        "--port",
        str(port),
        "--max-running-requests",
        str(concurrency),
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kiln serve did not start")


async def one_request(client: httpx.AsyncClient, ids: list[int], out_len: int) -> dict:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0},
    }
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n = len(json.loads(line[6:])["output_ids"])
                arrivals.append((time.perf_counter() - t0, n))
    ttft = arrivals[0][0]
    itl = []
    for (t_prev, n_prev), (t, n) in itertools.pairwise(arrivals):
        itl += [(t - t_prev) / (n - n_prev)] * (n - n_prev) if n > n_prev else []
    return {"ttft": ttft, "itl": itl, "e2e": arrivals[-1][0], "tokens": arrivals[-1][1]}


async def run_kiln(url: str, prompts: list[list[int]], out_len: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def limited(ids: list[int]) -> dict:
            async with sem:
                return await one_request(client, ids, out_len)

        await one_request(client, prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def run_transformers(cfg: dict, prompts: list[list[int]], out_len: int) -> float:
    """Output tokens per second, one request at a time (transformers has no server)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    kw = {
        "do_sample": False,
        "max_new_tokens": out_len,
        "min_new_tokens": out_len,
        "pad_token_id": 0,
    }
    with torch.inference_mode():
        model.generate(
            torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        t0 = time.perf_counter()
        for ids in prompts:
            model.generate(torch.tensor([ids]), **kw)
        wall = time.perf_counter() - t0
    return len(prompts) * out_len / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="a config.json (default: SmolLM2-135M shape)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--peer-requests",
        type=int,
        default=4,
        help="requests the (sequential) peer runs; its rate is per token",
    )
    p.add_argument("--server-args", default="", help="extra `kiln serve` flags")
    p.add_argument("--page-size", type=int, default=1, help="compile-time KV page size")
    args = p.parse_args()

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    cfg = json.loads(args.config.read_text()) if args.config else SMOLLM2_135M
    work = Path(tempfile.mkdtemp(prefix="kiln-serve-bench-"))
    (work / "ckpt").mkdir()
    (work / "ckpt" / "config.json").write_text(json.dumps(cfg))
    compile_model(
        ServerArgs(
            model_path=str(work / "ckpt"),
            load_format="dummy",
            dtype="float32",
            page_size=args.page_size,
        ),
        work / "art",
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, cfg["vocab_size"], (args.input_len,), generator=g).tolist()
        for _ in range(args.num_requests)
    ]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(work / "art", port, args.concurrency, args.server_args.split())
    try:
        kiln = asyncio.run(
            run_kiln(f"http://127.0.0.1:{port}", prompts, args.output_len, args.concurrency)
        )
    finally:
        server.terminate()
        server.wait(30)
    peer_tps = run_transformers(cfg, prompts[: args.peer_requests], args.output_len)

    res = kiln["results"]
    out_tokens = sum(r["tokens"] for r in res)
    tps = out_tokens / kiln["wall"]
    ttft = [r["ttft"] * 1000 for r in res]
    itl = [x * 1000 for r in res for x in r["itl"]]
    print(
        f"\n## serve_bench: {args.num_requests} requests, concurrency {args.concurrency}, "
        f"input {args.input_len}, output {args.output_len} tokens, fp32; "
        f"page size {args.page_size}; server flags: {args.server_args or '(none)'}"
    )
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; date {date.today()}\n"
    )
    print("| metric | kiln serve | transformers (one at a time) |")
    print("| --- | --- | --- |")
    print(
        f"| request throughput (req/s) | {len(res) / kiln['wall']:.2f} | "
        f"{peer_tps / args.output_len:.2f} |"
    )
    print(f"| output throughput (tok/s) | {tps:.1f} | {peer_tps:.1f} |")
    print(
        f"| TTFT p50 / p90 / p99 (ms) | {percentile(ttft, 0.5):.0f} / {percentile(ttft, 0.9):.0f}"
        f" / {percentile(ttft, 0.99):.0f} | |"
    )
    print(
        f"| ITL p50 / p90 / p99 (ms) | {percentile(itl, 0.5):.1f} / {percentile(itl, 0.9):.1f} / "
        f"{percentile(itl, 0.99):.1f} | {1000 / peer_tps:.1f} (mean) |"
    )
    print(
        f"\nkiln output throughput is {tps / peer_tps:.2f}x transformers'. "
        f"median e2e {statistics.median(r['e2e'] for r in res):.2f}s"
    )


if __name__ == "__main__":
    main()
