"""kiln_cpu's C kernels against the torch_native ones they replace, at serving shapes.

    python benchmarks/kernels_cpu.py                     # SmolLM2-135M shape, batch 16
    python benchmarks/kernels_cpu.py --batch 1 --kv-len 1000

Shapes come from the model config (hidden size, heads, head dim, MLP width); decode
attention gets `--batch` sequences of `--kv-len` cached tokens on pages scattered over a
pool of `--layers` layers, and each repeat reads the next layer so K/V come from memory,
as in a real step. Figures are min / median microseconds per call over `--repeats` calls;
attention also prints the K/V bytes it reads per call against the measured bandwidth.
Then every linear of one forward pass at each of `--gemm-rows` row counts: kiln_cpu's two
micro-kernels on panels (narrow, wide; the layout pass picks by rows), oneDNN on its own
prepacked weights (what torch's mkldnn path would run) and torch_native (MKL), against the
bandwidth floor of reading the weights once; then the same linears quantized (group 32) with
fp32 activations and with int8 ones (`--quantize-activations int8`). `--isa` picks the
kiln_cpu build (default: this host's level; avx2 runs the AVX2 build on an AVX-512 machine
too).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import SMOLLM2_135M, machine, read_bandwidth_gbs

from kiln.core.layout import pack_panels, pack_qpanels, panel_shape, panels_name
from kiln.core.opdef import with_attrs
from kiln.core.ops.attention import AttentionBatch, SeqSpan
from kiln.core.quant import FORMATS, quantize
from kiln.core.target import cpu_target
from kiln.kernels import catalog, native


def per_call_us(fn: Callable[[int], object], repeats: int) -> tuple[float, float]:
    fn(0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e6)
    return min(times), statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="a config.json (default: SmolLM2-135M shape)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv-len", type=int, default=170, help="cached tokens per sequence")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30, help="layers in the KV pool")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument(
        "--gemm-rows",
        default="1,2,4,8,16,32,64,128",
        help="row counts for the linear table ('' skips it)",
    )
    p.add_argument(
        "--quant-rows",
        default="1,16,128",
        help="row counts for the quantized linear table ('' skips it)",
    )
    p.add_argument("--isa", default="native", help="kiln_cpu build: native, x86-64, avx2, avx512")
    args = p.parse_args()

    toolchain = native.Toolchain.find()
    if toolchain is None:
        raise SystemExit(f"no C compiler ({native.compiler_command()}) to build kiln_cpu")
    target = cpu_target(args.isa)
    lib = native.load(native.build(target, toolchain))
    cfg = json.loads(args.config.read_text()) if args.config else SMOLLM2_135M
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or hidden // heads
    inter, b = cfg["intermediate_size"], args.batch
    torch.manual_seed(0)

    def op(name: str, backend: str) -> Callable[..., object]:
        kernel = catalog.get(name, backend)
        fn = functools.partial(kernel.fn, lib=lib) if kernel.native else kernel.fn
        return with_attrs(kernel.op, fn)

    x, res, w = torch.randn(b, hidden), torch.randn(b, hidden), torch.randn(hidden)
    gate_up = torch.randn(b, 2 * inter)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d)
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    cos_sin = op("rope_cos_sin", "torch_native")(torch.arange(b) + args.kv_len, inv)

    # Decode attention: every sequence's pages scattered over the pool, per layer.
    pages_per_seq = -(-(args.kv_len + 1) // args.page_size)
    num_pages = b * pages_per_seq * 2
    shape = (args.layers, kv_heads, num_pages * args.page_size, d)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    order = torch.randperm(num_pages)
    seqs = []
    for i in range(b):
        pages = order[i * pages_per_seq : (i + 1) * pages_per_seq]
        slots = (pages[:, None] * args.page_size + torch.arange(args.page_size)).reshape(-1)
        seqs.append(SeqSpan(i, 1, args.kv_len + 1, slots[: args.kv_len + 1], pages))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    attn_kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, scale=d**-0.5)

    def attention(backend: str) -> Callable[[int], object]:
        batch = AttentionBatch.build(k_cache, v_cache, seqs, args.page_size)
        fn = op("attention", backend)
        return lambda i: fn(batch, q, k, v, layer=i % args.layers, sliding_window=None, **attn_kw)

    cases: list[tuple[str, Callable[[str], Callable[[int], object]]]] = [
        (f"rmsnorm [{b}, {hidden}]", lambda be: lambda i: op("rmsnorm", be)(x, w, 1e-5)),
        (
            f"add_rmsnorm [{b}, {hidden}]",
            lambda be: lambda i: op("add_rmsnorm", be)(x, res, w, 1e-5),
        ),
        (f"silu_and_mul [{b}, {2 * inter}]", lambda be: lambda i: op("silu_and_mul", be)(gate_up)),
        (f"rope q [{b}, {heads}x{d}]", lambda be: lambda i: op("rope", be)(q, cos_sin, d)),
        (
            f"decode attention {b} seqs x {args.kv_len} tokens, page {args.page_size}",
            attention,
        ),
    ]
    print(machine(), f"kiln_cpu build: {target}")
    print("| kernel | torch_native us (min / median) | kiln_cpu us (min / median) | speed-up |")
    print("| --- | --- | --- | --- |")
    medians = {}
    for name, make in cases:
        ref = per_call_us(make("torch_native"), args.repeats)
        ours = per_call_us(make("kiln_cpu"), args.repeats)
        medians[name] = ours[1]
        print(
            f"| {name} | {ref[0]:.1f} / {ref[1]:.1f} | {ours[0]:.1f} / {ours[1]:.1f} "
            f"| {ref[1] / ours[1]:.2f}x |"
        )
    kv_bytes = 2 * b * (args.kv_len + 1) * kv_heads * d * 4
    gbs = read_bandwidth_gbs()
    attn_us = medians[cases[-1][0]]
    print(
        f"\ndecode attention reads {kv_bytes / 1e6:.1f} MB of K/V per call: "
        f"{kv_bytes / attn_us / 1e3:.1f} GB/s at the median, against {gbs:.1f} GB/s measured "
        f"read bandwidth ({kv_bytes / gbs / 1e3:.0f} us limit)"
    )
    if args.gemm_rows:
        gemms(cfg, [int(r) for r in args.gemm_rows.split(",")], gbs, op, target)
    if args.quant_rows:
        quant_gemms(cfg, [int(r) for r in args.quant_rows.split(",")], gbs, op, target)


def gemms(
    cfg: dict, row_counts: list[int], gbs: float, op: Callable[..., Any], target: Any
) -> None:
    """Every linear of one forward pass (distinct, cold weights, as the fused graph has
    them) at each row count, per backend."""
    shapes = _forward_shapes(cfg)
    weights = [torch.randn(n, k) for n, k in shapes]
    nbytes = sum(w.numel() for w in weights) * 4
    layout = panels_name(*panel_shape(target))
    packed = [pack_panels(w, layout) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    kiln = op("packed_linear", "kiln_cpu")
    ref = op("linear", "torch_native")
    runs: dict[str, Callable[[dict[int, torch.Tensor]], object]] = {
        "kiln_cpu narrow": lambda xs: [
            kiln(xs[w.shape[1]], p, out_features=w.shape[0], narrow_rows=[0, 1 << 30])
            for w, p in zip(weights, packed, strict=True)
        ],
        "kiln_cpu wide": lambda xs: [
            kiln(xs[w.shape[1]], p, out_features=w.shape[0], narrow_rows=[0, 0])
            for w, p in zip(weights, packed, strict=True)
        ],
        "onednn (prepacked)": lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], o, None, "none", [], "")
            for w, o in zip(weights, onednn, strict=True)
        ],
        "torch_native": lambda xs: [ref(xs[w.shape[1]], w) for w in weights],
    }
    backends = tuple(runs)
    floor = nbytes / gbs / 1e6
    print(
        f"\n{len(weights)} linears of one forward pass, {nbytes / 1e6:.0f} MB of weights "
        f"(bandwidth floor {floor:.1f} ms); ms per pass, min / median of 5 (the floor's "
        "fraction of each)"
    )
    print("| rows | " + " | ".join(backends) + " |")
    print("| --- |" + " --- |" * len(backends))
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        cells = []
        for backend in backends:
            best, median = per_call_us(lambda i, run=runs[backend], xs=xs: run(xs), 5)
            cells.append(_against_floor(best / 1e3, median / 1e3, floor))
        print(f"| {rows} | " + " | ".join(cells) + " |")


def _forward_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear of one forward pass as the fused graph has them."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    per_layer = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d)]
    per_layer += [(2 * inter, hidden), (hidden, inter)]
    return per_layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def quant_gemms(
    cfg: dict, row_counts: list[int], gbs: float, op: Callable[..., Any], target: Any
) -> None:
    """Every linear of one forward pass in the GGUF-like formats, group 32, with fp32
    activations (uint4, int8) and with int8 ones (uint4_a8, int8_a8:
    --quantize-activations int8), against the floor of reading their bytes once."""
    lanes = panel_shape(target)[0]
    shapes = _forward_shapes(cfg)
    kernel = op("quant_linear", "kiln_cpu")
    print(
        "\nquantized linears of one forward pass, group 32; ms per pass, min / median of 5 "
        "(the floor's fraction of each)"
    )
    print("| format | MB | floor ms | " + " | ".join(f"{r} rows" for r in row_counts) + " |")
    print("| --- | --- | --- |" + " --- |" * len(row_counts))
    for fmt in ("uint4", "uint4_a8", "int8", "int8_a8"):
        stored = []
        for n, k in shapes:
            codes, scales = quantize(torch.randn(n, k), fmt, 32)
            layout = f"{FORMATS[fmt].layout}panels{lanes}"
            stored.append((pack_qpanels(codes, layout), pack_qpanels(scales, f"spanels{lanes}")))
        nbytes = sum(c.numel() * c.element_size() + s.numel() * 4 for c, s in stored)
        floor = nbytes / gbs / 1e6
        cells = []
        for rows in row_counts:
            xs = {k: torch.randn(rows, k) for _, k in shapes}

            def run(_: int, xs: dict = xs, stored: list = stored, fmt: str = fmt) -> None:
                for (n, k), (c, s) in zip(shapes, stored, strict=True):
                    kernel(xs[k], c, s, format=fmt, group=32, out_features=n)

            best, median = per_call_us(run, 5)
            cells.append(_against_floor(best / 1e3, median / 1e3, floor))
        print(f"| {fmt} | {nbytes / 1e6:.0f} | {floor:.1f} | " + " | ".join(cells) + " |")


def _against_floor(best_ms: float, median_ms: float, floor_ms: float) -> str:
    """`best / median ms (the floor's fraction of each)`: how near the weight stream's
    bandwidth floor a pass runs (each linear's call from Python is in the time)."""
    return (
        f"{best_ms:.1f} / {median_ms:.1f} ({floor_ms / best_ms:.0%} / {floor_ms / median_ms:.0%})"
    )


if __name__ == "__main__":
    main()
