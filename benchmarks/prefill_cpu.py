"""Prefill through the native step against the Python executor, and the attention kernel's
two paths, on SmolLM2-135M-Instruct (issue 28, part 2).

    python benchmarks/prefill_cpu.py                       # F32 and Q4_1 +a8, 128-1536 tokens
    python benchmarks/prefill_cpu.py --precisions Q4_0 --tokens 128 --rounds 7

Steps: one engine per artefact (the GGUF file of each precision, as decode_cpu.py makes
them; "+a8": --quantize-activations int8). Each round times a one-token generation of a
random prompt of each length twice, with the native step running prefill steps and with
the Python executor running them (the same engine, `NativeStep.every_step` switched: the
decode steps stay native either way), alternating; median and spread of the rounds.

Attention: kiln_decode_attention on one layer of SmolLM2's shape (9 query heads over 3 KV
heads of 64, pages of 1, the rows of one causal prompt), with the rows in order (one run,
scored together: attend_runs) and reversed (the lengths fall, so no run: one row at a
time, the same arithmetic), against torch's SDPA (is_causal, K/V expanded to the query
heads). GFLOP/s count the causal half: 4 * heads * dim flops a (row, visible key).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import PRECISIONS, gguf_for, machine, spread

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_rates(lib: ctypes.CDLL, tokens: int, repeats: int) -> tuple[float, float, float]:
    """GFLOP/s of (rows scored together, one row at a time, torch SDPA) at `tokens`."""
    pool = [torch.randn(KV_HEADS, tokens + 1, DIM) for _ in range(2)]
    table = torch.randperm(tokens).view(1, -1)  # one page a token, scattered
    q = torch.randn(tokens, HEADS * DIM)
    out = torch.empty_like(q)
    flops = tokens * (tokens + 1) / 2 * HEADS * DIM * 4

    def kiln(order: torch.Tensor) -> Callable[[], object]:
        lens = (order + 1).contiguous()
        rows = torch.zeros(tokens, dtype=torch.int64)  # every row reads table 0
        qs = q[order].contiguous()
        args = (qs.data_ptr(), HEADS * DIM, pool[0].data_ptr(), pool[1].data_ptr(), tokens + 1,
                table.data_ptr(), tokens, lens.data_ptr(), rows.data_ptr(), out.data_ptr(),
                tokens, HEADS, KV_HEADS, DIM, 1, 0, DIM**-0.5, 0, 1.0, 0.0, None,
                torch.get_num_threads(), 0)  # fmt: skip
        held = (lens, rows, qs)  # the memory `args` points into lives as long as the call

        def call() -> None:
            if lib.kiln_decode_attention(*args) or not held:
                raise RuntimeError("kiln_decode_attention failed")

        return call

    qh = q.view(1, tokens, HEADS, DIM).transpose(1, 2)
    kh, vh = (p[:, :tokens].repeat_interleave(HEADS // KV_HEADS, 0)[None] for p in pool)
    together = best_of(kiln(torch.arange(tokens)), repeats)
    alone = best_of(kiln(torch.arange(tokens - 1, -1, -1)), repeats)
    sdpa = best_of(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), repeats)
    return flops / together / 1e9, flops / alone / 1e9, flops / sdpa / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", nargs="+", default=["F32", "Q4_1 +a8"])
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 1536])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--llama-quantize", type=Path, help="makes the GGUF files other than Q4_1")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch
    from kiln.runtime.native_step import NativeStep

    shipped = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-prefill-"))
    print(f"machine: {machine()}; {args.threads} threads, {args.rounds} alternating rounds\n")
    print("| precision | prompt tokens | native step tok/s | executor tok/s | native / executor |")
    print("| --- | --- | --- | --- | --- |")
    lib = None
    for label in args.precisions:
        precision, _, a8 = label.partition(" ")
        if precision not in PRECISIONS:
            raise SystemExit(f"--precisions: {precision} is not one of {', '.join(PRECISIONS)}")
        gguf = gguf_for(precision, shipped, work, args.llama_quantize)
        flags = {"quantize_activations": "int8"} if a8 == "+a8" else {}
        art = work / f"art-{len(os.listdir(work))}"
        compile_model(ServerArgs(model_path=str(gguf), **flags), art)
        engine = Engine(art, max_total_tokens=4096, max_running_requests=1)
        step = engine.runner.decode
        if not isinstance(step, NativeStep):
            raise SystemExit(f"{label}: the artefact's step was not lowered")
        lib = engine.art.lib
        for tokens in args.tokens:
            rng = random.Random(tokens)
            got: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds + 1):
                for native in (True, False):
                    step.every_step = native
                    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]  # no cache hit
                    start = time.perf_counter()
                    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
                    got[native].append(tokens / (time.perf_counter() - start))
            nat, ex = got[True][1:], got[False][1:]  # the first round warms up
            ratio = statistics.median(nat) / statistics.median(ex)
            print(f"| {label} | {tokens} | {spread(nat)} | {spread(ex)} | {ratio:.2f}x |")
        engine.shutdown()
    assert lib is not None
    print("\n| prompt tokens | rows together GFLOP/s | a row at a time | torch SDPA (causal) |")
    print("| --- | --- | --- | --- |")
    for tokens in args.tokens:
        together, alone, sdpa = attention_rates(lib, tokens, 2 * args.rounds)
        print(f"| {tokens} | {together:.0f} | {alone:.0f} | {sdpa:.0f} |")


if __name__ == "__main__":
    main()
