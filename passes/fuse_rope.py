"""Rotary fusion: split(qkv) -> rope(q), rope(k) becomes one `rope_qkv(qkv)`.

The fused q/k/v projection's rows are [q | k | v]; q and k heads sit side by side, so one
rotary call covers both, and v is a view. A decode step saves two kernel calls per layer
(the split and the second rope). Models with a per-head norm between the split and the
rope (Qwen3's q/k norm) keep their ops.
"""

from __future__ import annotations

from kiln.compiler.ir import Graph, Node
from kiln.passes.base import PassContext, PassResult


def fuse_rope(graph: Graph, ctx: PassContext) -> PassResult:
    users = graph.users()
    changed = False
    for split in [n for n in graph.nodes if n.op == "split" and len(n.attrs["sizes"]) == 3]:
        pieces = _pieces(split, users)
        if pieces is None:
            continue
        ropes = [users[pieces[i]][0] for i in (0, 1)]
        cos_sin, head_dim = ropes[0].args[1], ropes[0].attrs["head_dim"]
        # Before the first of the ropes and v's readers: after the projection and the tables.
        at = min([*ropes, *users.get(pieces[2], [])], key=graph.nodes.index)
        fused = graph.add(
            "rope_qkv",
            [split.args[0], cos_sin],
            {"head_dim": head_dim, "sizes": list(split.attrs["sizes"])},
            before=at,
        )
        outs = [graph.add("getitem", [fused], {"index": i}, before=at) for i in range(3)]
        graph.replace_all_uses(ropes[0], outs[0])
        graph.replace_all_uses(ropes[1], outs[1])
        graph.replace_all_uses(pieces[2], outs[2])
        for old in (*ropes, *pieces, split):
            graph.remove(old)
        changed = True
    return PassResult(graph, changed)


def _pieces(split: Node, users: dict[Node, list[Node]]) -> list[Node] | None:
    """The split's three getitems, if q and k each go to one rope only, with the same
    tables and head size."""
    got = {n.attrs["index"]: n for n in users.get(split, []) if n.op == "getitem"}
    if sorted(got) != [0, 1, 2] or len(users.get(split, [])) != 3:
        return None
    pieces = [got[i] for i in range(3)]
    ropes = []
    for p in pieces[:2]:
        readers = users.get(p, [])
        if len(readers) != 1 or readers[0].op != "rope" or readers[0].args[0] is not p:
            return None
        ropes.append(readers[0])
    same = ropes[0].args[1] is ropes[1].args[1]
    if not same or ropes[0].attrs["head_dim"] != ropes[1].attrs["head_dim"]:
        return None
    return pieces
