"""Horizontal fusion of linears that read the same input: one GEMM over stacked weights.

Shared by `fuse_qkv` and `fuse_gate_up`. Weight bytes are not touched here: the fused
weight's `source` recipe says how the artefact writer concatenates the originals.
"""

from __future__ import annotations

from kiln.core.ir import Graph, Node, WeightSpec


def fusable(graph: Graph, linears: list[Node]) -> bool:
    """Same input, weights and biases are params of one dtype and in-features."""
    if any(n.op != "linear" for n in linears):
        return False
    x = linears[0].args[0]
    has_bias = len(linears[0].args) == 3
    specs: list[WeightSpec] = []
    for n in linears:
        if n.args[0] is not x or (len(n.args) == 3) != has_bias:
            return False
        for a in n.args[1:]:
            spec = graph.weight_of(a)
            if spec is None:
                return False
            specs.append(spec)
    weights = specs[:: 2 if has_bias else 1]
    return len({(w.dtype, w.shape[1]) for w in weights}) == 1


def fused_name(weight_name: str, new_module: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight' -> 'model.layers.0.self_attn.qkv_proj.weight'."""
    parts = weight_name.split(".")
    if len(parts) < 2:  # a name with no module path: put the fused module in front
        return f"{new_module}.{weight_name}"
    parts[-2] = new_module
    return ".".join(parts)


def _stack(graph: Graph, params: list[Node], name: str, before: Node) -> Node:
    specs = [graph.weights[p.attrs["name"]] for p in params]
    rows = sum(s.shape[0] for s in specs)
    graph.weights[name] = WeightSpec(
        (rows, *specs[0].shape[1:]),
        specs[0].dtype,
        {"concat": [s.source for s in specs], "dim": 0},
    )
    return graph.param(name, before=before)


def fuse_linears(graph: Graph, linears: list[Node], module: str) -> Node:
    """Replace `linears` by one linear over the stacked weights; returns the fused node.

    Consumers of each original linear are rewired to a `getitem` of a `split`.
    """
    first = min(linears, key=graph.nodes.index)
    x = first.args[0]
    weights = [n.args[1] for n in linears]
    args = [x, _stack(graph, weights, fused_name(weights[0].attrs["name"], module), first)]
    if len(linears[0].args) == 3:
        biases = [n.args[2] for n in linears]
        args.append(_stack(graph, biases, fused_name(biases[0].attrs["name"], module), first))
    fused = graph.add("linear", args, before=first)
    sizes = [graph.weights[w.attrs["name"]].shape[0] for w in weights]
    parts = graph.add("split", [fused], {"sizes": sizes}, before=first)
    pieces = [graph.add("getitem", [parts], {"index": i}, before=first) for i in range(len(sizes))]
    for old, piece in zip(linears, pieces, strict=True):
        graph.replace_all_uses(old, piece)
        graph.remove(old)
    return fused
