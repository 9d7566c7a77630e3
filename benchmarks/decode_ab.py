"""Batch-1 decode and prefill of two kilns on the same file, alternating: did a change move
the speed?

    git worktree add /tmp/kiln-before <commit>
    pip install --no-deps --no-build-isolation --target /tmp/kiln-before-site /tmp/kiln-before
    python benchmarks/decode_ab.py --before /tmp/kiln-before-site --rounds 7

"before" is the kiln whose packages lie in the `--before` folder (put first on PYTHONPATH
of its processes); "after" is the kiln this script is run with. Each side compiles the real
model (SmolLM2-135M-Instruct, `python -m kiln.example --fetch smollm2`, its Q4_1 GGUF file)
with its own compiler into its own cache, and runs in its own process; rounds alternate
before, after, before, ... Decode tok/s excludes the prefill: (tokens - 1) over the time of
a long generation minus a one-token one; prefill tok/s is a 128-token prompt's tokens over
the time of its one-token generation. Each row prints the median (min-max) of the rounds
and after / before.

Rows: F32 (the file's blocks read as floats, `--dtype float32`), Q4_1 (kept as stored) and
Q4_1 +a8 (`--quantize-activations int8`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS: dict[str, dict[str, str]] = {
    "F32": {"dtype": "float32"},
    "Q4_1": {},
    "Q4_1 +a8": {"quantize_activations": "int8"},
}
PROMPT = list(range(1000, 1016))
LONG_PROMPT = list(range(2000, 2128))


def worker(flags: dict[str, str], threads: int) -> None:
    """One side: compile, load, then answer `[tokens]` lines with seconds until EOF."""
    import torch

    torch.set_num_threads(threads)
    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    art = compile_model(ServerArgs(model_path=str(fetch("smollm2")), **flags)).path
    engine = Engine(art, max_total_tokens=2048, max_running_requests=1, disable_radix_cache=True)
    print("ready", flush=True)
    for line in sys.stdin:
        new, prompt = int(line), PROMPT
        if new < 0:  # a prefill: the long prompt, one token
            new, prompt = 1, LONG_PROMPT
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=params)
        print(time.perf_counter() - t0, flush=True)


class Side:
    def __init__(self, site: str | None, flags: dict[str, str], threads: int, cache: Path):
        env = dict(os.environ, KILN_CACHE_DIR=str(cache))
        if site:
            env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(flags), "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.out, self.inp = self.proc.stdout, self.proc.stdin
        while (line := self.out.readline().strip()) != "ready":
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {self.proc.returncode}")

    def seconds(self, tokens: int) -> float:
        self.inp.write(f"{tokens}\n")
        self.inp.flush()
        return float(self.out.readline())

    def decode_rate(self, tokens: int) -> float:
        first = self.seconds(1)
        return (tokens - 1) / (self.seconds(tokens) - first)

    def prefill_rate(self) -> float:
        return len(LONG_PROMPT) / self.seconds(-1)

    def close(self) -> None:
        self.inp.close()
        self.proc.wait(timeout=60)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="folder holding the other kiln's packages")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker), args.threads)
        return
    if not args.before:
        p.error("--before FOLDER is required")
    work = Path(tempfile.mkdtemp(prefix="kiln-ab-"))
    print(
        "| row | decode before tok/s | decode after | after / before | "
        "prefill before tok/s | prefill after | after / before |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in args.rows:
        sides = {
            name: Side(site, ROWS[row], args.threads, work / name)
            for name, site in (("before", args.before), ("after", None))
        }
        got: dict[str, list[float]] = {name: [] for name in sides}
        pre: dict[str, list[float]] = {name: [] for name in sides}
        for side in sides.values():
            side.decode_rate(8)  # warm-up
            side.prefill_rate()
        for _ in range(args.rounds):
            for name, side in sides.items():
                got[name].append(side.decode_rate(args.tokens))
                pre[name].append(side.prefill_rate())
        for side in sides.values():
            side.close()
        cells = []
        for runs in (got, pre):
            ratio = statistics.median(runs["after"]) / statistics.median(runs["before"])
            cells += [spread(runs["before"]), spread(runs["after"]), f"{ratio:.2f}x"]
        print(f"| {row} | {' | '.join(cells)} |")
    print(
        f"\n{args.rounds} alternating rounds; decode: {args.tokens} tokens after a 16-token "
        f"prompt; prefill: {len(LONG_PROMPT)} tokens; {args.threads} threads; median (min-max)"
    )


if __name__ == "__main__":
    main()
