"""Rotary fusion: split(qkv) -> rope(q), rope(k) becomes one `rope_qkv(qkv)`, and
rope_qkv -> attention becomes one `rope_attention(qkv, cos_sin)`.

The fused q/k/v projection's rows are [q | k | v]; q and k heads sit side by side, so one
rotary call covers both, and v is a view. A decode step saves two kernel calls per layer
(the split and the second rope); with the attention fused too, kiln's C kernel does the
rotary, the KV write and decode attention in one call (two fewer again). Models with a
per-head norm between the split and the rope (Qwen3's q/k norm) keep their ops.
"""

from __future__ import annotations

from kiln.core.ir import Graph, Node
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def fuse_rope(graph: Graph, ctx: CompileOptions) -> PassResult:
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


@compiler_pass()
def fuse_rope_attention(graph: Graph, ctx: CompileOptions) -> PassResult:
    users = graph.users()
    changed = False
    for rope in [n for n in graph.nodes if n.op == "rope_qkv"]:
        attn = _sole_attention(rope, users)
        if attn is None:
            continue
        fused = graph.add("rope_attention", list(rope.args), dict(attn.attrs), before=attn)
        graph.replace_all_uses(attn, fused)
        for old in (attn, *users[rope], rope):
            graph.remove(old)
        changed = True
    return PassResult(graph, changed)


def _sole_attention(rope: Node, users: dict[Node, list[Node]]) -> Node | None:
    """The attention that reads rope's (q, k, v) in order and is their only reader, when
    its heads are exactly rope's sizes."""
    got = {n.attrs["index"]: n for n in users.get(rope, []) if n.op == "getitem"}
    if sorted(got) != [0, 1, 2] or len(users.get(rope, [])) != 3:
        return None
    readers = [users.get(got[i], []) for i in range(3)]
    if any(len(r) != 1 for r in readers):
        return None
    attn = readers[0][0]
    at = attn.attrs
    if attn.op != "attention" or attn.args != [got[0], got[1], got[2]]:
        return None
    q, kv = at["num_heads"] * at["head_dim"], at["num_kv_heads"] * at["head_dim"]
    if rope.attrs["sizes"] != [q, kv, kv] or rope.attrs["head_dim"] != at["head_dim"]:
        return None
    return attn


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
