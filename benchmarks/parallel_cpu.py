"""Tensor parallelism on this CPU: tp=1 against tp=2, batch-1 decode and 128-token prefill,
and what one gloo all-reduce costs (the price tp pays twice a layer).

    python benchmarks/parallel_cpu.py [--config qwen2.5-0.5b] [--rounds 3]

The model is a shape from ../shared/model-configs with dummy weights (kiln compile
`--load-format dummy`; the speed of a step does not depend on the values), fp32. Each engine
runs in its own process (tp=2 adds its rank 1 process), rounds alternate tp=1 and tp=2, and
each figure is the median of the rounds with the spread. Expect no speed-up on a 2-core
machine: both ranks share the same two cores and the same memory bandwidth that one
process already saturates, and each layer adds two all-reduces.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import machine
from decode_cpu import Engine, measure, spread

CONFIGS = Path(__file__).resolve().parent.parent.parent / "shared" / "model-configs"


def _allreduce_worker(rank: int, port: int, numel: int, n: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    x = torch.ones(numel)
    for _ in range(20):
        dist.all_reduce(x)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def allreduce_us(numel: int, n: int = 500) -> float:
    """Median time of one gloo all-reduce of `numel` fp32 values between two processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, numel, n, out)) for r in range(2)]
    for p in procs:
        p.start()
    t = float(out.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
    return t * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen2.5-0.5b", help="a name in ../shared/model-configs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    import json

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    cfg_path = CONFIGS / f"{args.config}.json"
    cfg = json.loads(cfg_path.read_text())
    work = Path(tempfile.mkdtemp(prefix="kiln-parallel-"))
    ckpt = work / args.config
    ckpt.mkdir()
    shutil.copy(cfg_path, ckpt / "config.json")
    arts = {}
    for tp in (1, 2):
        arts[tp] = work / f"tp{tp}"
        flags = {"load_format": "dummy", "dtype": "float32", "tp_size": tp}
        compile_model(ServerArgs(model_path=str(ckpt), **flags), arts[tp])

    print(machine())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    ar = allreduce_us(hidden)
    print(
        f"gloo all-reduce of one token's hidden state ({hidden} fp32): {ar:.0f} us median; "
        f"x 2 a layer x {layers} layers = {2 * layers * ar / 1e3:.2f} ms a decode step"
    )
    prompt = list(range(100, 116))
    long_prompt = list(range(200, 200 + args.prefill_tokens))
    decode: dict[int, list[float]] = {1: [], 2: []}
    prefill: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for tp in (1, 2):
            engine = Engine("kiln", arts[tp], args.threads)
            try:
                d, pf = measure(engine, prompt, long_prompt, args.decode_tokens)
            finally:
                engine.close()
            decode[tp].append(d)
            prefill[tp].append(pf)
            print(f"round {r + 1} tp={tp}: decode {d:.1f} tok/s, prefill {pf:.0f} tok/s")
    print(f"\n{args.config}, fp32, {args.threads} threads in all, {args.rounds} rounds")
    print("| tp | decode tok/s | prefill tok/s |\n|---|---|---|")
    for tp in (1, 2):
        print(f"| {tp} | {spread(decode[tp])} | {spread(prefill[tp])} |")
    ratio_d = statistics.median(decode[2]) / statistics.median(decode[1])
    ratio_p = statistics.median(prefill[2]) / statistics.median(prefill[1])
    print(f"tp=2 / tp=1: decode {ratio_d:.2f}x, prefill {ratio_p:.2f}x")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
