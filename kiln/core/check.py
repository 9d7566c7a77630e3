"""Holding a graph to its ops' definitions: `lint` (structure) and `infer_types` (the type
of every value: feature size and element type, from the weights down).

Both sides run them. Passes run them after each change, so a fusion that stacks the wrong
weights or a bad split fails at compile time; the artefact loader runs them on every graph
it reads, so a tampered attribute (`num_heads`, `group`, a split size) is refused before a
kernel that trusts those numbers ever sees it (kiln's C kernels index memory with them).
"""

from __future__ import annotations

from typing import Any

from kiln.core.ir import Graph, IRError
from kiln.core.ops import OPS


def lint(graph: Graph) -> None:
    """Raise IRError on the first broken structural invariant."""
    seen: set[int] = set()
    names: set[str] = set()
    params: set[str] = set()
    nodes = graph.nodes
    for i, n in enumerate(nodes):
        definition = OPS.get(n.op)
        if definition is None:
            raise IRError(f"%{n.name}: unknown op {n.op!r}")
        if n.name in names:
            raise IRError(f"%{n.name}: duplicate node name")
        names.add(n.name)
        low, high = definition.min_args, definition.max_args
        if len(n.args) < low or (high is not None and len(n.args) > high):
            raise IRError(f"%{n.name}: {n.op} takes {low}..{high} args, got {len(n.args)}")
        missing = [a for a in definition.attr_names if a not in n.attrs]
        if missing:
            raise IRError(f"%{n.name}: {n.op} is missing attrs {missing}")
        for a in n.args:
            if id(a) not in seen:
                raise IRError(f"%{n.name}: uses %{a.name} before it is defined")
            if a.op == "output":
                raise IRError(f"%{n.name}: uses the output node")
            if OPS[a.op].outputs != 1 and n.op != "getitem":
                raise IRError(f"%{n.name}: uses multi-output %{a.name} without getitem")
        if n.op == "param":
            wname = n.attrs["name"]
            if wname not in graph.weights:
                raise IRError(f"%{n.name}: param {wname!r} has no weight spec")
            if wname in params:
                raise IRError(f"%{n.name}: second param node for {wname!r}")
            params.add(wname)
        if n.op == "output" and i != len(nodes) - 1:
            raise IRError(f"%{n.name}: output must be the last node")
        seen.add(id(n))
    if not nodes or nodes[-1].op != "output":
        raise IRError("graph has no output node")
    unused = set(graph.weights) - params
    if unused:
        raise IRError(f"weights without a param node: {sorted(unused)[:5]}")


def infer_types(graph: Graph) -> dict[str, Any]:
    """Every value's type (kiln/core/opdef.py TensorType, a tuple for several outputs) by
    node name; IRError naming the first node whose inputs do not fit its op."""
    types: dict[str, Any] = {}
    for n in graph.nodes:
        types[n.name] = OPS[n.op].infer(graph, n, [types[a.name] for a in n.args])
    return types


def check(graph: Graph) -> dict[str, Any]:
    """`lint` then `infer_types`."""
    lint(graph)
    return infer_types(graph)
