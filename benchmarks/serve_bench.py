"""Serving throughput and latency: N concurrent clients against `kiln serve`, and the same
workload through transformers one request at a time (the peer), in the same run.

    python benchmarks/serve_bench.py                       # SmolLM2-135M shape, fp32
    python benchmarks/serve_bench.py --concurrency 16 --num-requests 64 --output-len 64

Prompts are random token ids of a fixed length; every request generates exactly
--output-len tokens (ignore_eos). Requests stream through SGLang's native /generate
(token ids in, output ids per step out), so TTFT and inter-token latency are measured at
the client from token arrival times. kiln and the peer alternate for --repeats rounds with
fresh prompts each round; the peer runs in a child process; reported: best / median per
side and the ratio of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import SMOLLM2_135M, decode_weight_bytes, machine, read_bandwidth_gbs


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


def measure_peer(cfg: dict, prompts: list[list[int]], out_len: int) -> float:
    """transformers' output tok/s over `prompts`, one request at a time (it has no server).

    Run in a child process: a live transformers model in the client process measurably
    slowed the kiln server running beside it (its thread pool competes for the cores)."""
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
            torch.tensor([prompts[0][:8]]), **{**kw, "max_new_tokens": 2, "min_new_tokens": 2}
        )
        t0 = time.perf_counter()
        for ids in prompts:
            model.generate(torch.tensor([ids]), **kw)
        return len(prompts) * out_len / (time.perf_counter() - t0)


def peer_in_child(cfg: dict, prompts: list[list[int]], out_len: int) -> float:
    job = json.dumps({"cfg": cfg, "prompts": prompts, "out_len": out_len})
    out = subprocess.run(
        [sys.executable, __file__, "--peer-job"],
        input=job,
        text=True,
        capture_output=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:] == ["--peer-job"]:
        job = json.loads(sys.stdin.read())
        print(measure_peer(job["cfg"], job["prompts"], job["out_len"]))
        return
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
    p.add_argument("--repeats", type=int, default=3, help="alternating kiln / peer rounds")
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

    def prompt_set(seed: int, n: int) -> list[list[int]]:
        # A fresh set per repeat: the prefix cache must not serve a repeat's prompts.
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randint(3, cfg["vocab_size"], (args.input_len,), generator=g).tolist()
            for _ in range(n)
        ]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(work / "art", port, args.concurrency, args.server_args.split())
    kiln_tps, peer_tps, runs = [], [], []
    try:
        # kiln and the peer alternate, so a noisy minute hits both.
        for r in range(args.repeats):
            prompts = prompt_set(r, args.num_requests)
            run = asyncio.run(
                run_kiln(f"http://127.0.0.1:{port}", prompts, args.output_len, args.concurrency)
            )
            runs.append(run)
            kiln_tps.append(sum(x["tokens"] for x in run["results"]) / run["wall"])
            peer_tps.append(
                peer_in_child(cfg, prompt_set(1000 + r, args.peer_requests), args.output_len)
            )
    finally:
        server.terminate()
        server.wait(30)

    res = [x for run in runs for x in run["results"]]
    ttft = [x["ttft"] * 1000 for x in res]
    itl = [t * 1000 for x in res for t in x["itl"]]
    k_med, p_med = statistics.median(kiln_tps), statistics.median(peer_tps)
    print(
        f"\n## serve_bench: {args.num_requests} requests x {args.repeats} repeats, "
        f"concurrency {args.concurrency}, input {args.input_len}, output {args.output_len} "
        f"tokens, fp32; page size {args.page_size}; server flags: "
        f"{args.server_args or '(none)'}"
    )
    print(machine() + "\n")
    print("| metric | kiln serve (best / median) | transformers, one at a time (best / median) |")
    print("| --- | --- | --- |")
    print(
        f"| output throughput (tok/s) | {max(kiln_tps):.1f} / {k_med:.1f} | "
        f"{max(peer_tps):.1f} / {p_med:.1f} |"
    )
    print(
        f"| request throughput (req/s) | {k_med / args.output_len:.2f} (median) | "
        f"{p_med / args.output_len:.2f} (median) |"
    )
    print(
        f"| TTFT p50 / p90 / p99 (ms) | {percentile(ttft, 0.5):.0f} / "
        f"{percentile(ttft, 0.9):.0f} / {percentile(ttft, 0.99):.0f} | |"
    )
    print(
        f"| ITL p50 / p90 / p99 (ms) | {percentile(itl, 0.5):.1f} / "
        f"{percentile(itl, 0.9):.1f} / {percentile(itl, 0.99):.1f} | "
        f"{1000 / p_med:.1f} (mean) |"
    )
    ratios = ", ".join(
        f"{k:.1f}/{p:.1f} = {k / p:.2f}x" for k, p in zip(kiln_tps, peer_tps, strict=True)
    )
    print(
        f"\nkiln output throughput is {k_med / p_med:.2f}x transformers' (ratio of medians; "
        f"per repeat: {ratios})."
    )
    # The memory floor of one decode step at full batch: every weight once, plus the K/V
    # of every sequence at mid-generation.
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * d * 4
    step = (
        decode_weight_bytes(cfg, 4)
        + args.concurrency * (args.input_len + args.output_len // 2) * kv_token
    )
    bw = read_bandwidth_gbs()
    floor_ms = step / bw / 1e6
    print(
        f"A batch-{args.concurrency} decode step reads at least {step / 1e6:.0f} MB; at the "
        f"measured {bw:.1f} GB/s that takes {floor_ms:.1f} ms, so ITL p50 is at "
        f"{floor_ms / percentile(itl, 0.5):.0%} of the memory-bandwidth limit."
    )


if __name__ == "__main__":
    main()
