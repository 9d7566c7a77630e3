"""What --enable-deterministic-inference costs and what it changes, on the real model.

    python benchmarks/deterministic_cpu.py                       # Q8_0 +a8 and Q4_K_M
    python benchmarks/deterministic_cpu.py --rows "Q4_K_M +a8" F32 --rounds 5

For each row, the same GGUF file (written by llama.cpp's `llama-quantize`, found with
--llama-quantize, else llama-cpp-python's binding; as decode_cpu.py writes them) is compiled
with and without the flag, each in its own engine in this process (prefix cache off, so
each round computes its prompt). Rounds alternate the two: prefill of a --prefill-tokens
prompt (tokens over the time to its first token), then batch-1 decode of --decode-tokens
after a 128-token prompt (the tokens after the first over the time from the first to the
last: a generation of n tokens minus one of 1). Then, for each engine, the largest change
of a 200-token prompt's greedy logprobs between running alone and beside four other
prompts of other lengths (0 means bitwise the same)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench_common import PRECISIONS, gguf_for, print_table, read_bandwidth_gbs, spread

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import fetch

ROWS = [*PRECISIONS, *(f"{p} +a8" for p in PRECISIONS if p != "F32")]


def drift(engine: Engine) -> float:
    """The largest |logprob change| of one prompt's greedy tokens, alone against in a batch."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompt = list(range(5, 205))
    others = [list(range(7, 7 + n)) for n in (3, 40, 90, 150)]

    def logprobs(prompts: list[list[int]]) -> list[float]:
        out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [lp for lp, _, _ in out[-1]["meta_info"]["output_token_logprobs"]]

    alone, mixed = logprobs([prompt]), logprobs([*others, prompt])
    return max(abs(a - b) for a, b in zip(alone, mixed, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=["Q8_0 +a8", "Q4_K_M"], choices=ROWS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--llama-quantize", type=Path, default=None)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kiln-det-"))
    shipped = fetch("smollm2")
    bw = read_bandwidth_gbs()
    long_prompt = list(range(1000, 1000 + args.prefill_tokens))
    short = list(range(1000, 1128))
    table, threads = [], 0
    for row in args.rows:
        precision = row.removesuffix(" +a8")
        flags = {"quantize_activations": "int8"} if row.endswith("+a8") else {}
        gguf = gguf_for(precision, shipped, work, args.llama_quantize)
        engines = {}
        for det in (False, True):
            art = work / f"{precision}-{len(flags)}-{det}"
            spec = ServerArgs(model_path=str(gguf), enable_deterministic_inference=det, **flags)
            compile_model(spec, art)
            engines[det] = Engine(art, max_total_tokens=4096, disable_radix_cache=True)
            threads = engines[det].threads
        rates: dict[bool, dict[str, list[float]]] = {d: {"p": [], "d": []} for d in engines}
        greedy = {"temperature": 0, "ignore_eos": True}
        for _ in range(args.rounds):
            for det, e in engines.items():
                t0 = time.perf_counter()
                e.generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 1})
                rates[det]["p"].append(len(long_prompt) / (time.perf_counter() - t0))
                n = args.decode_tokens + 1
                t0 = time.perf_counter()
                e.generate(input_ids=short, sampling_params={**greedy, "max_new_tokens": n})
                t1 = time.perf_counter()
                e.generate(input_ids=short, sampling_params={**greedy, "max_new_tokens": 1})
                t2 = time.perf_counter()
                rates[det]["d"].append(args.decode_tokens / ((t1 - t0) - (t2 - t1)))
        loose, det = rates[False], rates[True]
        table.append(
            f"| {row} | {spread(loose['p'])} | {spread(det['p'])} | {spread(loose['d'])} | "
            f"{spread(det['d'])} | {drift(engines[False]):.2g} | {drift(engines[True]):.2g} |"
        )
    print_table(
        "--enable-deterministic-inference: its cost, and a prompt's logprob change alone / "
        "in a batch",
        bw,
        args.rounds,
        threads,
        [
            "file",
            f"prefill {args.prefill_tokens} tok/s",
            "deterministic",
            "decode tok/s",
            "deterministic",
            "logprob change",
            "deterministic",
        ],
        table,
    )


if __name__ == "__main__":
    main()
