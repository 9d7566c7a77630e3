"""Where a native decode step's time goes, kernel by kernel, and at what bandwidth.

    python benchmarks/step_profile.py ARTEFACT [--depth 128] [--steps 64] [--threads 2]

Runs kiln's engine on a compiled CPU artefact whose step is lowered (`kiln inspect`
says "... lowered to C"): a --depth-token prompt, then --steps greedy decode steps at
batch 1 with the step's clock readings on (runtime/native_step.py `profile`: one reading
before the first call and after each). Prints, per kind of call (op, weight format, shape),
the time a step spends in it, the bytes of weights it reads, and the bandwidth that makes,
against --bandwidth (GB/s; default: measured here by bench_common.read_bandwidth_gbs); then
the whole step, the time between steps (scheduler, sampler, step inputs: Python) and what a
token costs end to end.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_common import read_bandwidth_gbs

from kiln import Engine
from kiln.core.ir import Node
from kiln.runtime.native_step import NativeStep


def label(n: Node) -> str:
    a = n.attrs
    if n.op == "quant_linear":
        return f"quant_linear {a['format']} -> {a['out_features']}"
    if n.op == "packed_linear":
        return f"packed_linear -> {a['out_features']}"
    return n.op


def weight_bytes(engine: Engine, n: Node) -> int:
    """Bytes of weights one call of `n` reads (an embedding reads one row: not counted)."""
    if n.op.endswith("embedding"):
        return 0
    weights = engine.art.weights
    return sum(
        weights[a.attrs["name"]].numel() * weights[a.attrs["name"]].element_size()
        for a in n.args
        if a.op == "param"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artefact", type=Path)
    p.add_argument("--depth", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: measured)")
    ns = p.parse_args()

    torch.set_num_threads(ns.threads)
    bandwidth = ns.bandwidth or read_bandwidth_gbs()
    engine = Engine(ns.artefact)
    decode = engine.runner.decode
    if not isinstance(decode, NativeStep):
        raise SystemExit(f"{ns.artefact}: its decode step is not lowered (kiln inspect says why)")
    prompt = [(7 * i) % 1000 + 10 for i in range(ns.depth)]
    greedy = {"temperature": 0, "max_new_tokens": ns.steps, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params=greedy)  # warm

    ticks = decode.profile()
    spent = torch.zeros(len(ticks) - 1, dtype=torch.float64)
    bounds: list[tuple[int, int]] = []  # each step's first and last clock reading
    call = decode.fn

    def timed(args: object) -> int:
        rc = int(call(args))
        spent.add_(torch.diff(ticks).double())
        bounds.append((int(ticks[0]), int(ticks[-1])))
        return rc

    decode.fn = timed
    start = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params=greedy)
    wall = time.perf_counter() - start
    decode.fn = call
    decode.profile(False)
    steps = len(bounds)
    if steps < 2:
        raise SystemExit("no decode steps ran")

    nodes = engine.art.graph.nodes
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # calls, ns, bytes
    for c, node_index in enumerate(decode.call_nodes()):
        n = nodes[node_index]
        r = rows[label(n)]
        r[0] += 1
        r[1] += float(spent[c]) / steps
        first_call = decode.call_nodes().index(node_index) == c
        r[2] += weight_bytes(engine, n) if first_call else 0
    step_ns = sum(r[1] for r in rows.values())
    between = [b[0] - a[1] for a, b in itertools.pairwise(bounds)]
    between_ms = sorted(between)[len(between) // 2] / 1e6

    print(f"\n## Native decode step of {ns.artefact.name}, batch 1 after {ns.depth} tokens")
    print(f"{steps} steps, {ns.threads} threads; read bandwidth {bandwidth:.1f} GB/s\n")
    print("| calls | per step | ms a step | share | MB read | GB/s | of bandwidth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (count, ns_spent, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        gbs = nbytes / ns_spent if nbytes else 0.0
        print(
            f"| {name} | {count} | {ns_spent / 1e6:.3f} | {100 * ns_spent / step_ns:.1f}% | "
            f"{nbytes / 1e6:.1f} | {gbs:.1f} | {100 * gbs / bandwidth:.0f}% |"
            if nbytes
            else f"| {name} | {count} | {ns_spent / 1e6:.3f} | {100 * ns_spent / step_ns:.1f}% "
            "| - | - | - |"
        )
    total = sum(r[2] for r in rows.values())
    print(
        f"\nstep: {step_ns / 1e6:.3f} ms ({total / 1e6:.1f} MB of weights, "
        f"{total / step_ns:.1f} GB/s, {100 * total / step_ns / bandwidth:.0f}% of bandwidth); "
        f"between steps (engine, Python): {between_ms:.3f} ms; "
        f"end to end {1000 * wall / ns.steps:.3f} ms a token (prefill included)"
    )


if __name__ == "__main__":
    main()
