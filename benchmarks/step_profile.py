"""Where a native decode (or prefill) step's time goes, kernel by kernel, and at what
bandwidth (or FLOP rate).

    python benchmarks/step_profile.py ARTEFACT [--depth 128] [--steps 64] [--threads 2]
    python benchmarks/step_profile.py ARTEFACT --prefill 128 [--steps 8]

Runs kiln's engine on a compiled CPU artefact whose step is lowered (`kiln inspect`
says "... lowered to C"): a --depth-token prompt, then --steps greedy decode steps at
batch 1 with the step's clock readings on (runtime/native_step.py `profile`: one reading
before the first call and after each). Prints, per kind of call (op, weight format, shape),
the time a step spends in it, the bytes of weights it reads, and the bandwidth that makes,
against --bandwidth (GB/s; default: measured here by bench_common.read_bandwidth_gbs); then
the whole step, the time between steps (scheduler, sampler, step inputs: Python) and what a
token costs end to end.

--prefill P: the step of a P-token prompt instead (prefix cache off, --steps prompts), each
linear's rate in GFLOP/s (2 x rows x in x out a call; the lm_head runs the sampled row
only), against --peak GFLOP/s if given.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from bench_common import read_bandwidth_gbs

from kiln import Engine
from kiln.core.ir import Node
from kiln.runtime.native_step import NativeStep
from kiln.runtime.profiler import call_label


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


def linear_macs(engine: Engine, n: Node) -> int:
    """Multiply-adds a row of a linear call makes (out x in of its weight), else 0."""
    if not n.op.endswith("_linear"):
        return 0
    spec = engine.art.graph.weights[n.args[1].attrs["name"]]
    return int(spec.shape[0]) * int(spec.shape[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artefact", type=Path)
    p.add_argument("--depth", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="default: 64 decode steps, 8 prompts")
    p.add_argument("--prefill", type=int, default=0, help="profile the step of a P-token prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: measured)")
    p.add_argument("--peak", type=float, default=None, help="GFLOP/s of the cores, if known")
    ns = p.parse_args()
    steps_wanted = ns.steps or (8 if ns.prefill else 64)

    torch.set_num_threads(ns.threads)
    bandwidth = ns.bandwidth or read_bandwidth_gbs()
    engine = Engine(ns.artefact, **({"disable_radix_cache": True} if ns.prefill else {}))
    decode = engine.runner.decode
    if not isinstance(decode, NativeStep):
        raise SystemExit(f"{ns.artefact}: its decode step is not lowered (kiln inspect says why)")
    if ns.prefill:
        prompt = [(7 * i) % 1000 + 10 for i in range(ns.prefill)]
        params = {"temperature": 0, "max_new_tokens": 1}
        runs, rows_wanted = steps_wanted, ns.prefill
    else:
        prompt = [(7 * i) % 1000 + 10 for i in range(ns.depth)]
        params = {"temperature": 0, "max_new_tokens": steps_wanted, "ignore_eos": True}
        runs, rows_wanted = 1, 1
    engine.generate(input_ids=prompt, sampling_params=params)  # warm

    ticks = decode.profile()
    readings: list[np.ndarray] = []  # each profiled step's clock readings
    call = decode.fn

    def timed(args: object) -> int:
        rc = int(call(args))
        if decode.args.rows == rows_wanted:  # not the decode run's prompt step
            readings.append(ticks.copy())  # one cheap op: the time between steps is measured
        return rc

    decode.fn = timed
    start = time.perf_counter()
    for _ in range(runs):
        engine.generate(input_ids=prompt, sampling_params=params)
    wall = time.perf_counter() - start
    decode.fn = call
    decode.profile(False)
    steps = len(readings)
    if steps < (1 if ns.prefill else 2):
        raise SystemExit("no steps of that kind ran")

    spent = np.diff(np.stack(readings), axis=1).sum(axis=0)
    bounds = [(int(r[0]), int(r[-1])) for r in readings]
    nodes = engine.art.graph.nodes
    # calls, ns, bytes of weights, multiply-adds (a step's)
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    seen: set[int] = set()  # nodes called before: their weights are counted once
    for c, node_index in enumerate(decode.call_nodes()):
        n = nodes[node_index]
        r = table[call_label(engine.art, n)]
        r[0] += 1
        r[1] += float(spent[c]) / steps
        r[2] += weight_bytes(engine, n) if node_index not in seen else 0
        seen.add(node_index)
        # a prompt step's rows, but the lm_head's: the sampled row only
        rows = 1 if n.attrs.get("out_features") == decode.vocab else rows_wanted
        r[3] += rows * linear_macs(engine, n)
    step_ns = sum(r[1] for r in table.values())
    if ns.prefill:
        print_prefill(ns, table, step_ns, steps, wall)
        return
    between = [b[0] - a[1] for a, b in itertools.pairwise(bounds)]
    between_ms = sorted(between)[len(between) // 2] / 1e6

    print(f"\n## Native decode step of {ns.artefact.name}, batch 1 after {ns.depth} tokens")
    print(f"{steps} steps, {ns.threads} threads; read bandwidth {bandwidth:.1f} GB/s\n")
    print("| calls | per step | ms a step | share | MB read | GB/s | of bandwidth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (count, ns_spent, nbytes, _) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        gbs = nbytes / ns_spent if nbytes else 0.0
        print(
            f"| {name} | {count} | {ns_spent / 1e6:.3f} | {100 * ns_spent / step_ns:.1f}% | "
            f"{nbytes / 1e6:.1f} | {gbs:.1f} | {100 * gbs / bandwidth:.0f}% |"
            if nbytes
            else f"| {name} | {count} | {ns_spent / 1e6:.3f} | {100 * ns_spent / step_ns:.1f}% "
            "| - | - | - |"
        )
    total = sum(r[2] for r in table.values())
    print(
        f"\nstep: {step_ns / 1e6:.3f} ms ({total / 1e6:.1f} MB of weights, "
        f"{total / step_ns:.1f} GB/s, {100 * total / step_ns / bandwidth:.0f}% of bandwidth); "
        f"between steps (engine, Python): {between_ms:.3f} ms; "
        f"end to end {1000 * wall / steps_wanted:.3f} ms a token (prefill included)"
    )


def print_prefill(
    ns: argparse.Namespace, table: dict[str, list[float]], step_ns: float, steps: int, wall: float
) -> None:
    print(f"\n## Native prefill step of {ns.artefact.name}, a {ns.prefill}-token prompt")
    peak = f", cores' peak {ns.peak:.0f} GFLOP/s" if ns.peak else ""
    print(f"{steps} prompts, {ns.threads} threads{peak}\n")
    print("| calls | per step | ms a step | share | GFLOP/s | of peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (count, ns_spent, _, macs) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        rate = 2 * macs / ns_spent if macs else 0.0
        share = f"{100 * ns_spent / step_ns:.1f}%"
        of_peak = f"{100 * rate / ns.peak:.0f}%" if ns.peak and macs else "-"
        print(
            f"| {name} | {count} | {ns_spent / 1e6:.3f} | {share} | "
            f"{f'{rate:.1f}' if macs else '-'} | {of_peak} |"
        )
    macs = sum(r[3] for r in table.values())
    print(
        f"\nstep: {step_ns / 1e6:.2f} ms ({ns.prefill / step_ns * 1e9:.0f} tok/s; linears "
        f"{2 * macs / 1e9:.2f} GFLOP); end to end {1000 * wall / steps:.2f} ms a prompt "
        "(sampling and Python included)"
    )


if __name__ == "__main__":
    main()
