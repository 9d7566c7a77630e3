"""KV cache quantization: each attention node learns the scale its layer's K/V are stored
with in an fp8 pool (options["kv_cache"], from --kv-cache-dtype and
--quantization-param-path). A float pool leaves the graph as it is."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.core.ops import ATTENTION_OPS
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass("kv_cache")
def kv_cache(graph: Graph, ctx: CompileOptions) -> PassResult:
    if ctx.kv_cache is None:
        return PassResult(graph, False)
    scales = ctx.kv_cache.scales
    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            n.attrs["kv_scale"] = float(scales[n.attrs["layer"]])
    return PassResult(graph, True)
