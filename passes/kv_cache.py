"""KV cache quantization: each attention node learns the scale its layer's K/V are stored
with in an fp8 pool (options["kv_cache"], from --kv-cache-dtype and
--quantization-param-path). A float pool leaves the graph as it is."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.core.ops import ATTENTION_OPS
from kiln.passes.base import PassContext, PassResult


def kv_cache(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.options.get("kv_cache")
    if not opts:
        return PassResult(graph, False)
    scales = opts["scales"]
    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            n.attrs["kv_scale"] = float(scales[n.attrs["layer"]])
    return PassResult(graph, True)
