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
the time from its first token to its last; llama-bench runs `-p 0 -n 64 -d 128 -t
THREADS -r 1` (64 tokens generated at a depth of 128). Figures are medians with the spread
(min-max). The roofline is the measured read bandwidth over the bytes a decode step reads:
kiln's artefact weights, llama.cpp's file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_common import (
    KilnProcess,
    gguf_for,
    llama_bench_rate,
    print_table,
    read_bandwidth_gbs,
    spread,
)

MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K")
PROMPT = list(range(1000, 1128))  # kiln decodes 64 tokens after these 128
DECODE = ("-p", "0", "-n", "64", "-d", "128")  # llama-bench: the same


def files(bench: Path, work: Path) -> list[Path]:
    """The Gemma 3 Q4_K_M file, then SmolLM2 in each of MIXES (llama-quantize beside
    `bench`)."""
    from kiln.example import fetch

    quantizer = bench.parent / "llama-quantize"
    shipped = fetch("smollm2")
    return [fetch("gemma3"), *(gguf_for(mix, shipped, work, quantizer) for mix in MIXES)]


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
        runs: dict[str, KilnProcess] = {}
        step_bytes: dict[str, int] = {}
        floats: dict[str, int] = {}
        for tag, flags in kilns.items():
            art = work / f"art-{gguf.stem}{tag.strip()}"
            compile_model(ServerArgs(model_path=str(gguf), **flags), art)
            step_bytes[tag] = (art / "weights" / "rank0.safetensors").stat().st_size
            graph = json.loads((art / "graph.json").read_text())
            floats[tag] = sum(n["op"] in ("linear", "packed_linear") for n in graph["nodes"])
            runs[tag] = KilnProcess(art, args.threads)
            runs[tag].decode_rate(PROMPT, 8)  # warm-up
        got: dict[str, list[float]] = {tag: [] for tag in runs} | {"llama": []}
        for _ in range(args.rounds):
            for tag, kiln in runs.items():
                got[tag].append(kiln.decode_rate(PROMPT, 64))
            got["llama"].append(llama_bench_rate(args.llama_bench, gguf, args.threads, *DECODE))
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
    print_table(
        "Batch-1 decode at a 128-token depth on GGUF K-quant files, kiln vs llama-bench",
        bw,
        args.rounds,
        args.threads,
        [
            "file",
            "MB read per step (kiln / llama.cpp)",
            "matrices kiln runs as floats",
            "kiln tok/s",
            "llama-bench tok/s",
            "ratio",
            "roofline (kiln / llama.cpp)",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
