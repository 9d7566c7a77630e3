"""What --enable-fp32-lm-head costs a bfloat16 model on a CPU.

    python benchmarks/fp32_lm_head_cpu.py
    python benchmarks/fp32_lm_head_cpu.py --rounds 7 --decode-tokens 64

SmolLM2-135M-Instruct's shipped GGUF file compiled with `--dtype bfloat16`, with and
without the flag, each in its own engine in this process (prefix cache off). Rounds
alternate the two: greedy generation of --decode-tokens after a --depth-token prompt
(tokens over the whole request, prefill included). No peer: llama.cpp has no such switch
(its logits are float32 whatever the weights)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import print_table, read_bandwidth_gbs, spread

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import fetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    model = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-fp32-head-"))
    engines = {}
    for flag in (False, True):
        cargs = ServerArgs(model_path=str(model), dtype="bfloat16", enable_fp32_lm_head=flag)
        art = compile_model(cargs, work / f"art-{flag}").path
        engines[flag] = Engine(art, max_total_tokens=4096, disable_radix_cache=True)
    prompt = list(range(1000, 1000 + args.depth))
    params = {"temperature": 0, "max_new_tokens": args.decode_tokens, "ignore_eos": True}
    for engine in engines.values():  # warm-up
        engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 4})
    rates: dict[bool, list[float]] = {flag: [] for flag in engines}
    bw = read_bandwidth_gbs()
    for _ in range(args.rounds):
        for flag, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params=params)
            rates[flag].append(args.decode_tokens / (time.perf_counter() - t0))
    base = statistics.median(rates[False])
    rows = [
        f"| {'float32' if flag else 'bfloat16'} | {spread(r)} | "
        f"{statistics.median(r) / base:.2f}x |"
        for flag, r in rates.items()
    ]
    title = (
        f"--enable-fp32-lm-head on SmolLM2-135M-Instruct in bfloat16: {args.decode_tokens} "
        f"tokens after {args.depth}"
    )
    print_table(title, bw, args.rounds, args.threads, ["logits", "tok/s", "vs bf16"], rows)


if __name__ == "__main__":
    main()
