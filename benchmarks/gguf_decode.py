"""Batch-1 decode on GGUF files as people download them, kiln against llama.cpp's own
`llama-bench` on the same file, in the same run.

    python benchmarks/gguf_decode.py --llama-bench PATH/llama-bench [--rounds 5] [--a8] [FILES...]

FILES default to the Gemma 3 270M Q4_K_M file (`python -m kiln.example --fetch gemma3`)
and SmolLM2-135M-Instruct requantized by llama.cpp's own `llama-quantize` (found beside
llama-bench) to Q4_K_M, Q5_K_M and Q6_K. Build both programs from the llama.cpp tree
vendored in llama-cpp-python's sdist (benchmarks/RESULTS.md has the commands).

With --a8 each file gets a second kiln row compiled with `--quantize-activations int8`
(activations rounded to int8 per weight group and summed in int32, as llama.cpp does with
these blocks), measured in the same alternating rounds.

Per file, rounds alternate kiln, llama-bench, kiln, ...: kiln's engine (its own process,
`--threads` threads) decodes 64 tokens after a 128-token prompt, its rate (tokens - 1) over
the time of that generation minus a one-token one; llama-bench runs `-p 0 -n 64 -d 128 -t
THREADS -r 1` (64 tokens generated at a depth of 128). Figures are medians with the spread
(min-max). The roofline is the measured read bandwidth over the bytes a decode step reads:
kiln's artefact weights, llama.cpp's file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench_common import machine, read_bandwidth_gbs

MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K")


def _kiln_worker(art: str, threads: int, conn: Any) -> None:
    import time

    import torch

    torch.set_num_threads(threads)
    from kiln import Engine

    engine = Engine(art, max_total_tokens=2048, max_running_requests=1, disable_radix_cache=True)
    prompt = list(range(1000, 1128))
    while (new := conn.recv()) is not None:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        t0 = time.perf_counter()
        engine.generate(input_ids=[prompt], sampling_params=params)
        conn.send(time.perf_counter() - t0)


class Kiln:
    def __init__(self, art: Path, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_kiln_worker, args=(str(art), threads, child))
        self.proc.start()

    def decode_rate(self, n: int = 64) -> float:
        self.conn.send(1)
        first = float(self.conn.recv())
        self.conn.send(n)
        full = float(self.conn.recv())
        return (n - 1) / (full - first)

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)


def llama_bench_rate(bench: Path, gguf: Path, threads: int) -> float:
    cmd = [str(bench), "-m", str(gguf), "-p", "0", "-n", "64", "-d", "128", "-t", str(threads)]
    out = subprocess.run([*cmd, "-r", "1", "-o", "json"], check=True, capture_output=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def files(bench: Path, work: Path) -> list[Path]:
    from kiln.example import fetch

    quantize = bench.parent / "llama-quantize"
    out = [fetch("gemma3")]
    shipped = fetch("smollm2")
    for mix in MIXES:
        path = work / f"smollm2-{mix}.gguf"
        if not path.exists():
            cmd = [str(quantize), "--allow-requantize", str(shipped), str(path), mix, "2"]
            subprocess.run(cmd, check=True, capture_output=True)
        out.append(path)
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--llama-bench", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--a8", action="store_true", help="also kiln with --quantize-activations int8")
    args = p.parse_args()

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    work = Path(tempfile.mkdtemp(prefix="kiln-gguf-decode-"))
    bw = read_bandwidth_gbs()
    rows = []
    for gguf in args.files or files(args.llama_bench, work):
        kilns = {"": {}, " +a8": {"quantize_activations": "int8"}} if args.a8 else {"": {}}
        runs: dict[str, Kiln] = {}
        step_bytes: dict[str, int] = {}
        floats: dict[str, int] = {}
        for tag, flags in kilns.items():
            art = work / f"art-{gguf.stem}{tag.strip()}"
            compile_model(ServerArgs(model_path=str(gguf), **flags), art)
            step_bytes[tag] = (art / "weights" / "rank0.safetensors").stat().st_size
            graph = json.loads((art / "graph.json").read_text())
            floats[tag] = sum(n["op"] in ("linear", "packed_linear") for n in graph["nodes"])
            runs[tag] = Kiln(art, args.threads)
            runs[tag].decode_rate(8)  # warm-up
        got: dict[str, list[float]] = {tag: [] for tag in runs} | {"llama": []}
        for _ in range(args.rounds):
            for tag, kiln in runs.items():
                got[tag].append(kiln.decode_rate())
            got["llama"].append(llama_bench_rate(args.llama_bench, gguf, args.threads))
        for kiln in runs.values():
            kiln.close()
        ll = statistics.median(got["llama"])
        size = gguf.stat().st_size
        for tag in runs:
            k = statistics.median(got[tag])
            rows.append(
                f"| {gguf.stem}{tag} | {step_bytes[tag] / 1e6:.0f} / {size / 1e6:.0f} | "
                f"{floats[tag]} | {spread(got[tag])} | {spread(got['llama'])} | {k / ll:.2f}x | "
                f"{k * step_bytes[tag] / (bw * 1e9):.0%} / {ll * size / (bw * 1e9):.0%} |"
            )
    print("\n## Batch-1 decode at a 128-token depth on GGUF K-quant files, kiln vs llama-bench")
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {args.rounds} alternating rounds, median "
        f"(min-max); {args.threads} threads each\n"
    )
    print(
        "| file | MB read per step (kiln / llama.cpp) | matrices kiln runs as floats | "
        "kiln tok/s | llama-bench tok/s | ratio | roofline (kiln / llama.cpp) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
