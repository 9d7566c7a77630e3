"""The capture plan: which static shapes a step may be run at, decided at compile time.

From SGLang's own flags (`--cuda-graph-bs`, `--cuda-graph-max-bs`, `--disable-cuda-graph`,
`--disable-cuda-graph-padding`, `--piecewise-cuda-graph-tokens`,
`--piecewise-cuda-graph-max-tokens`, `--enable-piecewise-cuda-graph`,
`--enable-torch-compile`, `--torch-compile-max-bs`) the pass records in the graph
(`Graph.plan`, stored in the artefact, shown by `kiln inspect`):

- decode: how a decode step runs ("cuda_graph" on a CUDA target unless
  `--disable-cuda-graph`, "compiled" with `--enable-torch-compile`, else "eager") and its
  batch-size buckets, SGLang's list by default (padded up to the next bucket unless
  `--disable-cuda-graph-padding`, which makes every size up to the max a bucket);
- prefill: "piecewise" with `--enable-piecewise-cuda-graph` and its token buckets, else
  "eager";
- split_at: the attention nodes, where a piecewise capture cuts the graph (the pieces
  between them are static-shape once padded to a bucket); a piecewise prefill also names
  `eager_from`, the first node that reads the logits rows, from which it runs eagerly.

Defaults follow SGLang's server_args: without `--cuda-graph-max-bs` a CUDA target gets its
value for an 80-160 GB GPU (kiln compiles for `sm_90`, H100/H200: 256 below tp 4, 512 from
tp 4) and other targets the 160 SGLang uses when it cannot see a GPU; with
`--enable-torch-compile` only buckets up to `--torch-compile-max-bs` compile. Serving reads
the plan and never recomputes it (runtime/capture.py runs it).
"""

from __future__ import annotations

from typing import Any

from kiln.args import ArgError
from kiln.core.ir import Graph
from kiln.core.ops import ATTENTION_OPS
from kiln.passes.base import PassContext, PassResult

NO_GPU_MAX_BS = 160  # SGLang's cuda_graph_max_bs when it sees no GPU


def decode_batch_sizes(max_bs: int, padding: bool) -> list[int]:
    """SGLang's decode buckets up to `max_bs` (without speculative decoding)."""
    if not padding:
        return list(range(1, max_bs + 1))
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return [b for b in sizes if b <= max_bs]


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """SGLang's piecewise buckets of prefill tokens up to `max_tokens`."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def _token_list(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        sizes = [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        raise ArgError(
            f"--piecewise-cuda-graph-tokens: expected token counts like 4,8,16, got {text!r}"
        ) from None
    return sizes


def _positive(flag: str, sizes: list[int]) -> list[int]:
    if not sizes or any(s <= 0 for s in sizes):
        raise ArgError(f"{flag}: expected positive sizes, got {sizes}")
    return sorted(set(sizes))


def plan(flags: dict[str, Any], device: str, sm: str | None, tp: int) -> dict[str, Any]:
    """The plan's decode and prefill parts for these flags on this target."""
    bs = flags.get("cuda_graph_bs")
    max_bs = flags.get("cuda_graph_max_bs")
    if device != "cuda":
        piecewise = flags.get("enable_piecewise_cuda_graph") or None
        for name, value in (
            ("--cuda-graph-bs", bs),
            ("--cuda-graph-max-bs", max_bs),
            ("--enable-piecewise-cuda-graph", piecewise),
        ):
            if value is not None:
                raise ArgError(
                    f"{name}: a {device} target captures no CUDA graphs (compile with "
                    "--device cuda, or leave it unset)"
                )
    if bs:
        buckets = _positive("--cuda-graph-bs", list(bs))
    else:
        if max_bs is None:
            max_bs = (256 if tp < 4 else 512) if sm == "sm_90" else NO_GPU_MAX_BS
        if max_bs <= 0:
            raise ArgError(f"--cuda-graph-max-bs: expected a positive size, got {max_bs}")
        buckets = decode_batch_sizes(max_bs, not flags.get("disable_cuda_graph_padding"))
    decode: dict[str, Any]
    if flags.get("enable_torch_compile"):
        limit = flags.get("torch_compile_max_bs") or 32
        decode = {"mode": "compiled", "batch_sizes": [b for b in buckets if b <= limit]}
    elif device == "cuda" and not flags.get("disable_cuda_graph"):
        decode = {"mode": "cuda_graph", "batch_sizes": buckets}
    else:
        decode = {"mode": "eager", "batch_sizes": []}
    decode["padding"] = not flags.get("disable_cuda_graph_padding")
    prefill: dict[str, Any] = {"mode": "eager", "tokens": []}
    if flags.get("enable_piecewise_cuda_graph"):
        tokens = _token_list(flags.get("piecewise_cuda_graph_tokens"))
        if tokens is None:
            max_tokens = int(flags.get("piecewise_cuda_graph_max_tokens") or 4096)
            tokens = prefill_token_sizes(max_tokens)
        tokens = _positive("--piecewise-cuda-graph-tokens", tokens)
        prefill = {"mode": "piecewise", "tokens": tokens}
    return {"decode": decode, "prefill": prefill}


def capture_plan(graph: Graph, ctx: PassContext) -> PassResult:
    flags: dict[str, Any] | None = ctx.options.get("capture")
    if flags is None:
        return PassResult(graph, False)
    tp = (ctx.options.get("tp") or {}).get("size", 1)
    sm = ctx.target.isa if ctx.device == "cuda" else None
    graph.plan = {
        **plan(flags, ctx.device, sm, tp),
        "split_at": [n.name for n in graph.nodes if n.op in ATTENTION_OPS],
    }
    if graph.plan["prefill"]["mode"] == "piecewise":
        graph.plan["prefill"]["eager_from"] = logits_tail(graph)
    return PassResult(graph, True)


def logits_tail(graph: Graph) -> str:
    """The first node that reads the logits rows: from it on, a step's shapes follow how
    many sequences sample, which no token bucket fixes, so a piecewise prefill runs that
    tail eagerly."""
    rows = next(n for n in graph.nodes if n.op == "input" and n.attrs["name"] == "logits_indices")
    return next(n.name for n in graph.nodes if any(a is rows for a in n.args))
