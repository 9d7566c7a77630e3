"""What a decode step of m rows costs: a verify step of speculative decoding is one.

    python benchmarks/verify_rows.py ARTEFACT [--rows 1 2 3 4 8 12 16] [--depth 128] [--runs 20]

Runs the artefact's decode step (the native step on a CPU artefact that lowers it, else the
executor) on m rows of one sequence, as a verify step feeds them (runtime/speculative.py):
row j at position depth + j attending to depth + j + 1 cached tokens. Prints, per row count,
the median and range of --runs timed steps (after one untimed) and the ratio to one row: how
much a drafted token costs to check, which decides how many drafts pay.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_common import machine

from kiln import Engine
from kiln.runtime.step import StepInputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artefact", type=Path)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12, 16])
    p.add_argument("--depth", type=int, default=128)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(args.artefact, max_total_tokens=4 * (args.depth + max(args.rows)))
    runner = engine.runner
    pool = runner.pool
    pages = pool.allocate(pool.pages_for(args.depth + max(args.rows)))
    print(f"## verify_rows: {args.artefact}, {type(runner.decode).__name__}")
    print(machine())
    print(f"a sequence of {args.depth} cached tokens; median (min-max) of {args.runs} steps\n")
    print("| rows | step ms | x one row |")
    print("| --- | --- | --- |")
    one = None
    for m in args.rows:
        d = args.depth
        step = StepInputs(
            [1] * m,
            [d + j for j in range(m)],
            list(range(m)),
            [1] * m,
            [d + j + 1 for j in range(m)],
            [len(pages)] * m,
            pages * m,
        )
        runner.run(step)
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            runner.run(step)
            times.append((time.perf_counter() - t) * 1e3)
        med = statistics.median(times)
        one = one or med
        print(f"| {m} | {med:.2f} ({min(times):.2f}-{max(times):.2f}) | {med / one:.2f} |")
    pool.free(pages)


if __name__ == "__main__":
    main()
