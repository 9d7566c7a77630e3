"""kiln_cpu's C kernels against the torch_native ones they replace, at serving shapes.

    python benchmarks/kernels_cpu.py                     # SmolLM2-135M shape, batch 16
    python benchmarks/kernels_cpu.py --batch 1 --kv-len 1000

Shapes come from the model config (hidden size, heads, head dim, MLP width); decode
attention gets `--batch` sequences of `--kv-len` cached tokens on pages scattered over a
pool of `--layers` layers, and each repeat reads the next layer so K/V come from memory,
as in a real step. Figures are min / median microseconds per call over `--repeats` calls;
attention also prints the K/V bytes it reads per call against the measured bandwidth.
Then every linear of one forward pass per backend (kiln_cpu, onednn, torch_native) at each
of `--gemm-rows` row counts, against the bandwidth floor of reading the weights once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode_cpu import SMOLLM2_135M, machine, read_bandwidth_gbs

from kiln.kernels import registry
from kiln.kernels.attention import AttentionBatch, SeqSpan


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
    args = p.parse_args()

    from kiln.kernels import cpu

    if not cpu.available():
        raise SystemExit("kiln_cpu kernels could not be built here (see the warning above)")
    cfg = json.loads(args.config.read_text()) if args.config else SMOLLM2_135M
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or hidden // heads
    inter, b = cfg["intermediate_size"], args.batch
    torch.manual_seed(0)

    def op(name: str, backend: str) -> Callable[..., object]:
        return registry.get(name, backend).fn

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
    print(machine())
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
        gemms(cfg, [int(r) for r in args.gemm_rows.split(",")], gbs)


def gemms(cfg: dict, row_counts: list[int], gbs: float) -> None:
    """Every linear of one forward pass (distinct, cold weights, as the fused graph has
    them) at each row count, per backend."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    per_layer = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d)]
    per_layer += [(2 * inter, hidden), (hidden, inter)]
    shapes = per_layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]
    weights = [torch.randn(n, k) for n, k in shapes]
    nbytes = sum(w.numel() for w in weights) * 4
    backends = ("kiln_cpu", "onednn", "torch_native")
    print(
        f"\n{len(weights)} linears of one forward pass, {nbytes / 1e6:.0f} MB of weights "
        f"(bandwidth floor {nbytes / gbs / 1e6:.1f} ms); ms per pass, min / median of 5"
    )
    print("| rows | " + " | ".join(backends) + " |")
    print("| --- |" + " --- |" * len(backends))
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        cells = []
        for backend in backends:
            fn = registry.get("linear", backend).fn
            best, median = per_call_us(
                lambda i, fn=fn, xs=xs: [fn(xs[w.shape[1]], w) for w in weights], 5
            )
            cells.append(f"{best / 1e3:.1f} / {median / 1e3:.1f}")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
