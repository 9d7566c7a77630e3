"""Verify: the graph lints, every compute node has a kernel, and feature sizes agree.

Feature sizes (the last dim of each activation) are propagated from the weights, so a
fusion that stacks the wrong weights or a bad split fails here, at compile time.
"""

from __future__ import annotations

from kiln.compiler.ir import Graph, Node
from kiln.passes.base import PassContext, PassResult
from kiln.passes.select_backends import STRUCTURAL


def verify(graph: Graph, ctx: PassContext) -> PassResult:
    graph.lint()
    for n in graph.nodes:
        if n.op not in STRUCTURAL and "backend" not in n.meta:
            raise ValueError(f"%{n.name}: no backend selected for {n.op}")
    _check_features(graph)
    return PassResult(graph, False)


def _check_features(graph: Graph) -> None:
    feat: dict[int, object] = {}

    def size(node: Node) -> object:
        return feat[id(node)]

    def expect(node: Node, what: str, got: object, want: object) -> None:
        if got != want:
            raise ValueError(f"%{node.name}: {node.op} {what} is {got}, expected {want}")

    for n in graph.nodes:
        a = n.args
        w = [graph.weight_of(x) for x in a]
        out: object = None
        if n.op == "param":
            spec = graph.weights[n.attrs["name"]]
            out = spec.shape[-1] if spec.shape else None
        elif n.op == "embedding":
            out = w[1].shape[1] if w[1] else None
        elif n.op == "linear":
            assert w[1] is not None
            expect(n, "input features", size(a[0]), w[1].shape[1])
            out = w[1].shape[0]
            if len(a) == 3:
                expect(n, "bias size", w[2].shape[0] if w[2] else None, out)
        elif n.op in ("rmsnorm", "add_rmsnorm"):
            x, weight = size(a[0]), w[-1]
            norm = n.attrs.get("group") or x
            expect(n, "weight size", weight.shape[0] if weight else None, norm)
            if n.op == "add_rmsnorm":
                expect(n, "residual features", size(a[1]), x)
                out = (x, x)
            else:
                out = x
        elif n.op in ("add", "mul"):
            expect(n, "right operand features", size(a[1]), size(a[0]))
            out = size(a[0])
        elif n.op == "silu_and_mul":
            out = int(size(a[0])) // 2  # type: ignore[call-overload]
        elif n.op == "split":
            expect(n, "split total", sum(n.attrs["sizes"]), size(a[0]))
            out = tuple(n.attrs["sizes"])
        elif n.op == "getitem":
            out = size(a[0])[n.attrs["index"]]  # type: ignore[index]
        elif n.op == "attention":
            at = n.attrs
            expect(n, "q features", size(a[0]), at["num_heads"] * at["head_dim"])
            expect(n, "k features", size(a[1]), at["num_kv_heads"] * at["head_dim"])
            expect(n, "v features", size(a[2]), at["num_kv_heads"] * at["head_dim"])
            out = size(a[0])
        elif n.op in ("rope", "silu", "index_select"):
            out = size(a[0])
        feat[id(n)] = out
