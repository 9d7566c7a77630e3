"""Compiled decode pieces (--enable-torch-compile) against today's executor, on the CPU.

    python benchmarks/capture_cpu.py                       # batch 1, 16, 64; 3 rounds
    python benchmarks/capture_cpu.py --batches 1 16 --rounds 5

The model is SmolLM2-135M-Instruct in fp32 (`python -m kiln.example --fetch smollm2`), the
file every engine reads the same. Three artefacts of it:

- eager, kiln: today's default, the executor over kiln's C kernels (packed linears,
  fused norms, paged decode attention);
- eager, torch: the same executor on torch's kernels only (`--attention-backend` left to
  kiln's C attention, no native linears), the code Inductor starts from;
- compiled: `--enable-torch-compile --torch-compile-max-bs 64`, Inductor's code for every
  piece between the attention ops at each decode bucket (compiled once; the Inductor cache
  makes later starts cheap), kiln's C attention between them.

For a batch of B requests of a 32-token prompt, decode step time is (time of generating
T + 1 tokens - time of generating 1) / T, and the engine's throughput B / step time (the
scheduler and the sampler included: what a server would see, minus HTTP). Each artefact
runs in its own process, rounds alternate between them; median (min-max) of the rounds.
The roofline is the measured read bandwidth over the bytes a step must read (the weights,
the lm_head being the tied embedding): the fastest a bandwidth-bound step could be.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import machine, read_bandwidth_gbs

CONFIGS: dict[str, dict[str, Any]] = {
    "eager, kiln kernels (default)": {},
    "eager, torch kernels": {"enable_torch_compile": True, "_eager": True},
    "compiled pieces": {"enable_torch_compile": True},
}


def _worker(art: str, eager: bool, conn: Any) -> None:
    from kiln import Engine

    engine = Engine(art, max_total_tokens=16384, max_running_requests=128)
    if eager:
        engine.runner.decode = None  # the same artefact through the plain executor
    prompt = list(range(1000, 1032))

    def run(batch: int, new: int) -> float:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        t = time.perf_counter()
        engine.generate(input_ids=[prompt] * batch, sampling_params=params)
        return time.perf_counter() - t

    conn.send("ready")
    while (msg := conn.recv()) is not None:
        conn.send(run(*msg))


class Proc:
    def __init__(self, art: Path, eager: bool) -> None:
        self.conn, child = mp.Pipe()
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=_worker, args=(str(art), eager, child), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    def step_ms(self, batch: int, tokens: int) -> float:
        self.conn.send((batch, 1))
        first = float(self.conn.recv())
        self.conn.send((batch, tokens + 1))
        full = float(self.conn.recv())
        return (full - first) / tokens * 1e3

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    gguf = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-capture-"))
    bw = read_bandwidth_gbs()
    procs: dict[str, Proc] = {}
    weight_bytes = 0
    for i, (name, flags) in enumerate(CONFIGS.items()):
        flags = dict(flags)
        eager = flags.pop("_eager", False)
        art = work / f"art-{i}"
        cap = {"torch_compile_max_bs": max(args.batches)} if flags else {}
        compile_model(ServerArgs(model_path=str(gguf), dtype="float32", **flags, **cap), art)
        weight_bytes = (art / "weights" / "rank0.safetensors").stat().st_size
        t = time.perf_counter()
        procs[name] = Proc(art, eager)
        print(f"{name}: started in {time.perf_counter() - t:.0f}s", flush=True)
    got: dict[tuple[str, int], list[float]] = {}
    for b in args.batches:
        for proc in procs.values():
            proc.step_ms(b, 2)  # warm-up
        for _ in range(args.rounds):
            for name, proc in procs.items():
                got.setdefault((name, b), []).append(proc.step_ms(b, args.tokens))
    for proc in procs.values():
        proc.close()

    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    print("\n## Decode step: compiled pieces against the executor, SmolLM2-135M fp32")
    print(machine())
    print(
        f"read bandwidth {bw:.1f} GB/s, {weight_bytes / 1e6:.0f} MB of weights per step: "
        f"roofline {floor_ms:.1f} ms/step; {args.rounds} alternating rounds of "
        f"{args.tokens} steps, median (min-max)\n"
    )
    names = list(CONFIGS)
    print(
        "| batch | "
        + " | ".join(f"{n} ms/step" for n in names)
        + " | compiled speed vs default | default tok/s | compiled tok/s | default at roofline |"
    )
    print("|" + " --- |" * (len(names) + 5))
    for b in args.batches:
        ms = [got[(n, b)] for n in names]
        default, compiled = statistics.median(ms[0]), statistics.median(ms[-1])
        print(
            f"| {b} | "
            + " | ".join(spread(m) for m in ms)
            + f" | {default / compiled:.2f}x | {b / default * 1e3:.0f} | "
            f"{b / compiled * 1e3:.0f} | {floor_ms / default:.0%} |"
        )


if __name__ == "__main__":
    main()
