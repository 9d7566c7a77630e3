"""Weight layout: linears that kiln_cpu runs get their weights stored as panels.

On fp32 CPU targets with kiln's native kernels, every linear becomes `packed_linear` and its
weight is written into the artefact in the panel layout of the target's build
(compiler/layout.py), so serving memory-maps the weights and never repacks them. An
embedding that shares its table with a linear (tied lm_head) reads the same panels
(`packed_embedding`): one copy of the table, not two.

The pass also records the micro-kernel choice by row count: up to `small_rows` rows (decode
batches) the narrow tile, which streams each panel once; above, the wide tile (prefill),
which does fewer loads per multiply-add. Crossovers measured per level with every linear
shape of SmolLM2-135M, one thread (benchmarks/RESULTS.md):
  avx512: narrow wins to 16 rows, even at 32, wide from 64 (2.90 against 3.22 ms)
  avx2:   narrow wins to 8 rows, wide from 16 (1.39 against 1.45 ms)
The x86-64 baseline has no vector FMA; its linears stay on torch's runtime-dispatched GEMM.
"""

from __future__ import annotations

from kiln.compiler.ir import Graph, Node
from kiln.compiler.layout import panel_shape, panels_name
from kiln.passes.base import PassContext, PassResult

SMALL_ROWS = {"avx512": 32, "avx2": 8}
_READERS = {"linear": "packed_linear", "embedding": "packed_embedding"}


def packs(ctx: PassContext) -> bool:
    """Whether the target's linears run kiln_cpu on panels."""
    native = ctx.options.get("native_kernels", False)
    return (
        ctx.device == "cpu" and ctx.dtype == "float32" and native and ctx.target.isa in SMALL_ROWS
    )


def pack_weights(graph: Graph, ctx: PassContext) -> PassResult:
    if not packs(ctx):
        return PassResult(graph, False)
    layout = panels_name(*panel_shape(ctx.target))
    small_rows = SMALL_ROWS[ctx.target.isa]
    users = graph.users()
    changed = False
    for param in [n for n in graph.nodes if n.op == "param"]:
        spec = graph.weight_of(param)
        readers = users.get(param, [])
        if spec is None or spec.layout != "rows" or not _all_packable(param, readers):
            continue
        spec.layout = layout
        for n in readers:
            if n.op == "linear":
                n.attrs = {"out_features": spec.shape[0], "small_rows": small_rows}
            n.op = _READERS[n.op]
            n.meta.pop("backend", None)
        changed = True
    return PassResult(graph, changed)


def _all_packable(param: Node, readers: list[Node]) -> bool:
    """Every reader takes the weight as a linear's or an embedding's table, and at least
    one is a linear (an embedding alone keeps rows: panels only help the GEMM)."""
    ok = all(n.op in _READERS and n.args[1] is param and param not in n.args[2:] for n in readers)
    return ok and any(n.op == "linear" for n in readers)
