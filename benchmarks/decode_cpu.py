"""Batch-1 decode and prefill against llama.cpp's own `llama-bench`, on the real model, at
each precision.

    python benchmarks/decode_cpu.py --llama-bench PATH/llama-bench          # every row
    python benchmarks/decode_cpu.py --llama-bench ... --rounds 7 --rows Q4_1 "Q4_1 +a8"
    python benchmarks/decode_cpu.py --llama-bench AVX2_BUILD/llama-bench --target-isa avx2

The model is SmolLM2-135M-Instruct (`python -m kiln.example --fetch smollm2`, a Q4_1 GGUF
file). For each precision llama.cpp's own `llama-quantize` (found beside llama-bench) writes
the GGUF file (F32, Q8_0, Q4_0 and the K-quant mixes from the shipped Q4_1, which is used as
it is), and kiln compiles that same file, its blocks kept as stored, so both engines run
identical weights. Build both programs from the llama.cpp tree vendored in
llama-cpp-python's sdist (benchmarks/RESULTS.md has the commands).

Decode: kiln's engine (its own process) generates --decode-tokens after a --depth-token
prompt, its rate (tokens - 1) over the time from its first token to its last (the depth's
prefill left out, as llama-bench leaves it out);
llama-bench runs `-p 0 -n N -d DEPTH -t THREADS -r 1` (N tokens generated at that depth).
Prefill: kiln's time to the first token of a --prefill-tokens prompt; llama-bench `-p P -n 0`.
--target-isa compiles kiln's kernels and step for that x86-64 level (`kiln compile
--target-isa`); pair it with a llama.cpp built for the same level (for AVX2:
`-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF`) to
measure that level's code on a machine that has more (torch's own ops still pick their
level at run time). Rounds alternate kiln, llama-bench, kiln, ...; each figure is the
median of the rounds with the spread (min-max). The roofline is the measured read
bandwidth over the weight bytes one decode step reads (the artefact's weight file; for
llama.cpp its file). A second table puts each GGUF file's two kiln modes beside llama-bench
and takes kiln's faster one (llama.cpp itself quantizes the activations to 8 bits against
these blocks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench_common import (
    PRECISIONS,
    KilnProcess,
    gguf_for,
    llama_bench_rate,
    print_table,
    read_bandwidth_gbs,
    spread,
)

# Rows: label -> (llama.cpp's file, the file kiln compiles, kiln's compile flags). The GGUF
# rows run identical weights; the scheme rows quantize the F32 file with kiln's schemes and
# put them beside llama.cpp's format of the same width.
# "+a8": --quantize-activations int8, llama.cpp's own arithmetic on the same blocks.
A8 = {"quantize_activations": "int8"}
ROWS: dict[str, tuple[str, str, dict[str, str]]] = {
    **{p: (p, p, {}) for p in PRECISIONS},
    **{f"{p} +a8": (p, p, A8) for p in PRECISIONS if p != "F32"},
    "int8wo vs Q8_0": ("Q8_0", "F32", {"torchao_config": "int8wo"}),
    "w8a8_int8 vs Q8_0": ("Q8_0", "F32", {"quantization": "w8a8_int8"}),
    "int4wo-64 vs Q4_0": ("Q4_0", "F32", {"torchao_config": "int4wo-64"}),
}


# -- one round of each engine ------------------------------------------------------------


def kiln_round(
    kiln: KilnProcess, prompt: list[int], long_prompt: list[int], n: int
) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of one kiln round."""
    return kiln.decode_rate(prompt, n), len(long_prompt) / kiln.time(long_prompt, 1)


def llama_round(args: argparse.Namespace, gguf: Path, prefill: int, n: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of one llama-bench round: n tokens at --depth, then a
    `prefill`-token prompt (by --llama-bench-prefill where given)."""
    ub = ["-ub", str(args.llama_decode_ubatch)] if args.llama_decode_ubatch else []
    depth = ["-d", str(args.depth)]
    decode = llama_bench_rate(
        args.llama_bench, gguf, args.threads, "-p", "0", "-n", str(n), *depth, *ub
    )
    pre = args.llama_bench_prefill or args.llama_bench
    return decode, llama_bench_rate(pre, gguf, args.threads, "-p", str(prefill), "-n", "0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", type=Path, required=True, help="llama-bench binary")
    p.add_argument(
        "--llama-bench-prefill",
        type=Path,
        help="another llama-bench for the prefill rounds (default: --llama-bench): where a "
        "machine lists AMX but faults on its tile instructions (a VM), llama.cpp's native "
        "build decodes one row through its AMX buffer's VNNI kernels, 2x its build without "
        "AMX, and cannot run a batch; a build without AMX is its best prefill there",
    )
    p.add_argument(
        "--llama-decode-ubatch",
        type=int,
        help="llama-bench -ub for the decode rounds: 1 computes the depth's prompt a token a "
        "step (that build's batched kernels fault), the timed tokens are one a step anyway",
    )
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=128, help="context before the decoded tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--target-isa", default="native", help="kiln compile --target-isa")
    args = p.parse_args()

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    shipped = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-decode-"))
    prompt = list(range(1000, 1000 + args.depth))
    long_prompt = list(range(2000, 2000 + args.prefill_tokens))
    bw = read_bandwidth_gbs()
    rows = []
    medians: dict[str, tuple[float, list[float]]] = {}
    files: dict[str, Path] = {}
    for row in args.rows:
        peer, mine, flags = ROWS[row]
        for precision in (peer, mine):
            if precision not in files:
                quantizer = args.llama_bench.parent / "llama-quantize"
                files[precision] = gguf_for(precision, shipped, work, quantizer)
        gguf = files[peer]
        art = work / f"art-{len(rows)}"
        spec = ServerArgs(model_path=str(files[mine]), target_isa=args.target_isa, **flags)
        compile_model(spec, art)
        step_bytes = (art / "weights" / "rank0.safetensors").stat().st_size
        kiln = KilnProcess(art, args.threads)
        got: dict[str, list[tuple[float, float]]] = {"kiln": [], "llama.cpp": []}
        kiln_round(kiln, prompt, long_prompt, 8)  # warm-up
        for _ in range(args.rounds):
            got["kiln"].append(kiln_round(kiln, prompt, long_prompt, args.decode_tokens))
            got["llama.cpp"].append(
                llama_round(args, gguf, args.prefill_tokens, args.decode_tokens)
            )
        kiln.close()
        limit = bw * 1e9 / step_bytes
        peer_limit = bw * 1e9 / gguf.stat().st_size
        kd = [d for d, _ in got["kiln"]]
        ld = [d for d, _ in got["llama.cpp"]]
        kp = [q for _, q in got["kiln"]]
        lp = [q for _, q in got["llama.cpp"]]
        if peer == mine:
            medians[row] = (statistics.median(kd), ld)
        rows.append(
            f"| {row} | {step_bytes / 1e6:.0f} / {gguf.stat().st_size / 1e6:.0f} | "
            f"{spread(kd)} | {spread(ld)} | "
            f"{statistics.median(kd) / statistics.median(ld):.2f}x | "
            f"{statistics.median(kd) / limit:.0%} / {statistics.median(ld) / peer_limit:.0%} | "
            f"{spread(kp)} | {spread(lp)} | "
            f"{statistics.median(kp) / statistics.median(lp):.2f}x |"
        )

    print_table(
        f"Batch-1 decode at a {args.depth}-token depth and {args.prefill_tokens}-token "
        f"prefill, SmolLM2-135M-Instruct, kiln (--target-isa {args.target_isa}) against "
        f"llama-bench ({args.llama_bench}"
        + (f", decode -ub {args.llama_decode_ubatch}" if args.llama_decode_ubatch else "")
        + (f"; prefill {args.llama_bench_prefill}" if args.llama_bench_prefill else "")
        + ")",
        bw,
        args.rounds,
        args.threads,
        [
            "kiln (vs llama.cpp)",
            "MB read per step (kiln / llama.cpp)",
            "kiln decode tok/s",
            "llama-bench decode tok/s",
            "decode ratio",
            "roofline (kiln / llama.cpp)",
            "kiln prefill tok/s",
            "llama-bench prefill tok/s",
            "prefill ratio",
        ],
        rows,
    )
    summary = best_of_modes(medians)
    if summary:
        print(
            "\nEach GGUF file at kiln's faster activation mode (fp32, or int8 where an"
            ' "+a8" row ran), decode tok/s; llama-bench: the median of every round run on'
            " that file\n"
        )
        header = ["file", "kiln, fp32 activations", "kiln, int8 activations", "llama-bench"]
        print("| " + " | ".join([*header, "best ratio"]) + " |")
        print("|" + " --- |" * (len(header) + 1))
        print("\n".join(summary))


def best_of_modes(medians: dict[str, tuple[float, list[float]]]) -> list[str]:
    """The issue-28 table: a row per GGUF file that ran, kiln's decode median with fp32 and
    with int8 activations ("-" where that row did not run), llama-bench's median over the
    rounds of every row on that file, and kiln's better mode over it."""
    out = []
    for precision in PRECISIONS:
        names = (precision, f"{precision} +a8")
        runs = [medians[r] for r in names if r in medians]
        if not runs:
            continue
        peer = statistics.median([x for _, ld in runs for x in ld])
        cells = [f"{medians[r][0]:.1f}" if r in medians else "-" for r in names]
        best = max(d for d, _ in runs)
        out.append(f"| {precision} | {' | '.join(cells)} | {peer:.1f} | {best / peer:.2f}x |")
    return out


if __name__ == "__main__":
    main()
