"""The capture plan: which static shapes a step may be run at, decided at compile time.

From SGLang's own flags (`--cuda-graph-bs`, `--cuda-graph-max-bs`, `--disable-cuda-graph`,
`--disable-cuda-graph-padding`, `--piecewise-cuda-graph-tokens`,
`--piecewise-cuda-graph-max-tokens`, `--enable-piecewise-cuda-graph`,
`--enable-torch-compile`, `--torch-compile-max-bs`) the pass records in the graph
(`Graph.plan`, stored in the artefact, shown by `kiln inspect`), as compiler/options.py
resolved them (every flag error is raised there):

- decode: how a decode step runs ("cuda_graph" on a CUDA target unless
  `--disable-cuda-graph`, "compiled" with `--enable-torch-compile`, else "eager") and its
  batch-size buckets, SGLang's list by default (padded up to the next bucket unless
  `--disable-cuda-graph-padding`, which makes every size up to the max a bucket);
- prefill: "piecewise" with `--enable-piecewise-cuda-graph` and its token buckets, else
  "eager";
- split_at: the attention nodes, where a piecewise capture cuts the graph (the pieces
  between them are static-shape once padded to a bucket), and for a piecewise prefill the
  nodes a CUDA graph cannot record (HOST_SYNC_OPS: the MoE's loop over its experts), which
  run between the pieces too; a piecewise prefill also names `eager_from`, the first node
  that reads the logits rows, from which it runs eagerly.

A CUDA target's decode graphs record the whole step, so a graph with a HOST_SYNC_OPS node
decodes eagerly instead, the reason kept in the plan (`graphs_refused`, shown by `kiln
inspect`) and logged at compile time.

Defaults follow SGLang's server_args: without `--cuda-graph-max-bs` a CUDA target gets its
value for an 80-160 GB GPU (kiln compiles for `sm_90`, H100/H200: 256 below tp 4, 512 from
tp 4) and other targets the 160 SGLang uses when it cannot see a GPU; with
`--enable-torch-compile` only buckets up to `--torch-compile-max-bs` compile. Serving reads
the plan and never recomputes it (runtime/capture.py runs it).
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.core.ir import Graph
from kiln.core.ops import ATTENTION_OPS, HOST_SYNC_OPS
from kiln.passes.options import CompileOptions, PassResult, compiler_pass

log = logging.getLogger("kiln.compile")


@compiler_pass("capture")
def capture_plan(graph: Graph, ctx: CompileOptions) -> PassResult:
    c = ctx.capture
    prefill: dict[str, Any] = {"mode": c.prefill, "tokens": list(c.tokens)}
    split = ATTENTION_OPS
    if c.prefill == "piecewise":
        prefill["eager_from"] = logits_tail(graph)
        split = (*ATTENTION_OPS, *HOST_SYNC_OPS)
    decode: dict[str, Any] = {
        "mode": c.decode,
        "batch_sizes": list(c.batch_sizes),
        "padding": c.padding,
    }
    host = next((n for n in graph.nodes if n.op in HOST_SYNC_OPS), None)
    if c.decode == "cuda_graph" and host is not None:
        why = (
            f"{host.op} (%{host.name}) reads its routing back to the host to loop over the "
            "experts, which a CUDA graph cannot record"
        )
        decode.update(mode="eager", batch_sizes=[], graphs_refused=why)
        log.info("decode runs without CUDA graphs: %s", why)
    graph.plan = {
        "decode": decode,
        "prefill": prefill,
        "split_at": [n.name for n in graph.nodes if n.op in split],
    }
    return PassResult(graph, True)


def logits_tail(graph: Graph) -> str:
    """The first node that reads the logits rows: from it on, a step's shapes follow how
    many sequences sample, which no token bucket fixes, so a piecewise prefill runs that
    tail eagerly."""
    rows = next(n for n in graph.nodes if n.op == "input" and n.attrs["name"] == "logits_indices")
    return next(n.name for n in graph.nodes if any(a is rows for a in n.args))
