"""Feature sizes through the graph: the last dim of every activation, from the weights.

Both sides use it. The `verify` pass runs it so a fusion that stacks the wrong weights or a
bad split fails at compile time; the artefact loader runs it on every graph it reads, so
a tampered attribute (`num_heads`, `group`, a split size) is refused before a kernel that
trusts those numbers ever sees them (kiln's C kernels index memory with them).
"""

from __future__ import annotations

from typing import Any

from kiln.core.ir import ATTENTION_OPS, PROLOGUES, Graph, IRError, Node

# A feature size: an int, None for per-token scalars (ids, positions), a tuple for
# multi-output ops, or ("rope", rotary_dim) for the rotary tables.
Feature = Any


def check_features(graph: Graph) -> dict[str, Feature]:
    """Propagate feature sizes; raise IRError naming the first node that disagrees.
    Returns each node's feature size by node name."""
    feat: dict[str, Feature] = {}
    for n in graph.nodes:
        feat[n.name] = _feature(graph, n, [feat[a.name] for a in n.args])
    return feat


def _prologue_in(node: Node, features: int) -> int:
    """The input features a linear of `features` inputs takes with its prologue."""
    prologue = node.attrs["prologue"]
    if prologue not in PROLOGUES:
        raise IRError(f"%{node.name}: prologue must be one of {', '.join(PROLOGUES)}")
    return 2 * features if prologue == "silu_and_mul" else features


def _expect(node: Node, what: str, got: object, want: object) -> None:
    if got != want:
        raise IRError(f"%{node.name}: {node.op} {what} is {got}, expected {want}")


def _positive(node: Node, **values: object) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise IRError(f"%{node.name}: {node.op} {name} must be a positive integer, got {v!r}")


def _weight_shape(graph: Graph, node: Node, dims: int) -> tuple[int, ...]:
    spec = graph.weight_of(node)
    if spec is None:
        raise IRError(f"%{node.name}: expected a weight, got a computed value")
    if len(spec.shape) != dims:
        raise IRError(f"%{node.name}: weight {node.attrs['name']!r} must be {dims}-D")
    return spec.shape


# Ops whose kernels read weights stored as panels (and only those).
PACKED_OPS = ("packed_linear", "packed_embedding", "quant_linear", "quant_embedding")


def _panels(graph: Graph, node: Node, param: Node) -> None:
    """A packed op's weight must be stored as panels (its kernel reads them, nothing else)."""
    spec = graph.weight_of(param)
    if spec is None or spec.layout == "rows":
        raise IRError(f"%{node.name}: {node.op} needs a weight stored as panels")


def _quant(graph: Graph, node: Node) -> tuple[int, int]:
    """A quantized op's codes and scales agree with its format and group: (N, K)."""
    from kiln.core.quant import CODE_DTYPE, CODE_LAYOUT, GROUP_STEP, PLANES

    fmt, group = node.attrs["format"], node.attrs["group"]
    if fmt not in CODE_DTYPE:
        raise IRError(f"%{node.name}: unknown quantization format {fmt!r}")
    _positive(node, group=group)
    codes, scales = graph.weight_of(node.args[1]), graph.weight_of(node.args[2])
    if codes is None or scales is None:
        raise IRError(f"%{node.name}: {node.op} needs stored codes and scales")
    want = f"{CODE_LAYOUT[fmt]}panels"
    if not codes.layout.startswith(want) or codes.dtype != CODE_DTYPE[fmt]:
        raise IRError(f"%{node.name}: {fmt} codes must be {CODE_DTYPE[fmt]} {want}")
    if not scales.layout.startswith("spanels") or scales.dtype != "float32":
        raise IRError(f"%{node.name}: scales must be float32 spanels")
    n, k = _weight_shape(graph, node.args[1], 2)
    if k % group or group % GROUP_STEP.get(fmt, 1):
        raise IRError(
            f"%{node.name}: group {group} does not divide {k} input features in whole "
            f"steps of {GROUP_STEP.get(fmt, 1)} ({fmt})"
        )
    _expect(
        node, "scales shape", _weight_shape(graph, node.args[2], 3), (n, k // group, PLANES[fmt])
    )
    return n, k


def _feature(graph: Graph, n: Node, sizes: list[Feature]) -> Feature:
    a, at = n.args, n.attrs
    op = n.op
    if op not in PACKED_OPS and any(
        (spec := graph.weight_of(x)) is not None and spec.layout != "rows" for x in a
    ):
        raise IRError(f"%{n.name}: {op} cannot read a weight stored as panels")
    if op == "input":
        return None
    if op == "param":
        shape = graph.weights[at["name"]].shape
        _positive(n, **{f"dim {i}": d for i, d in enumerate(shape)})
        return shape[-1] if shape else None
    if op == "output":
        return tuple(sizes)
    if op == "embedding_part":
        if at["first_row"] < 0:
            raise IRError(f"%{n.name}: first_row must be >= 0, got {at['first_row']}")
        return _weight_shape(graph, a[1], 2)[1]
    if op in ("embedding", "packed_embedding"):
        if op == "packed_embedding":
            _panels(graph, n, a[1])
        return _weight_shape(graph, a[1], 2)[1]
    if op == "quant_linear":
        out, inp = _quant(graph, n)
        _expect(n, "out_features", at["out_features"], out)
        _expect(n, "input features", sizes[0], _prologue_in(n, inp))
        if len(a) == 4:
            _expect(n, "bias size", _weight_shape(graph, a[3], 1)[0], out)
        return out
    if op == "quant_embedding":
        rows, h = _quant(graph, n)
        _expect(n, "num_embeddings", at["num_embeddings"], rows)
        return h
    if op in ("linear", "packed_linear"):
        out, inp = _weight_shape(graph, a[1], 2)
        if op == "packed_linear":
            _panels(graph, n, a[1])
            _expect(n, "out_features", at["out_features"], out)
            lo_hi = at["narrow_rows"]
            if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
                raise IRError(f"%{n.name}: narrow_rows must be [lo, hi], 0 <= lo <= hi")
            inp = _prologue_in(n, inp)
        _expect(n, "input features", sizes[0], inp)
        if len(a) == 3:
            _expect(n, "bias size", _weight_shape(graph, a[2], 1)[0], out)
        return out
    if op in ("rmsnorm", "add_rmsnorm"):
        x = sizes[0]
        group = at.get("group", 0)
        if group:
            _positive(n, group=group)
            if not isinstance(x, int) or x % group:
                raise IRError(f"%{n.name}: rmsnorm group {group} does not divide {x} features")
        _expect(n, "weight size", _weight_shape(graph, a[-1], 1)[0], group or x)
        if op == "add_rmsnorm":
            _expect(n, "residual features", sizes[1], x)
            return (x, x)
        return x
    if op in ("add", "mul"):
        _expect(n, "right operand features", sizes[1], sizes[0])
        return sizes[0]
    if op == "silu_and_mul":
        if not isinstance(sizes[0], int) or sizes[0] % 2:
            raise IRError(f"%{n.name}: silu_and_mul needs an even feature size, got {sizes[0]}")
        return sizes[0] // 2
    if op == "split":
        _positive(n, **{f"size {i}": s for i, s in enumerate(at["sizes"])})
        _expect(n, "total", sum(at["sizes"]), sizes[0])
        return tuple(at["sizes"])
    if op == "getitem":
        parts = sizes[0]
        if not isinstance(parts, tuple) or not 0 <= at["index"] < len(parts):
            raise IRError(f"%{n.name}: getitem index {at['index']} is out of range")
        return parts[at["index"]]
    if op == "rope_cos_sin":
        return ("rope", 2 * _weight_shape(graph, a[1], 1)[0])
    if op == "rope":
        head_dim = at["head_dim"]
        _positive(n, head_dim=head_dim)
        _expect(n, "rotary dim", sizes[1], ("rope", head_dim))
        if not isinstance(sizes[0], int) or sizes[0] % head_dim:
            raise IRError(f"%{n.name}: rope head_dim {head_dim} does not divide {sizes[0]}")
        return sizes[0]
    if op == "rope_qkv":
        head_dim, parts = at["head_dim"], at["sizes"]
        _positive(n, head_dim=head_dim, **{f"size {i}": x for i, x in enumerate(parts)})
        if len(parts) != 3:
            raise IRError(f"%{n.name}: rope_qkv takes 3 sizes (q, k, v), got {len(parts)}")
        _expect(n, "total", sum(parts), sizes[0])
        _expect(n, "rotary dim", sizes[1], ("rope", head_dim))
        if parts[0] % head_dim or parts[1] % head_dim:
            raise IRError(f"%{n.name}: rope head_dim {head_dim} does not divide q or k")
        return tuple(parts)
    if op in ATTENTION_OPS:
        heads, kv, d = at["num_heads"], at["num_kv_heads"], at["head_dim"]
        _positive(n, num_heads=heads, num_kv_heads=kv, head_dim=d)
        if heads % kv:
            raise IRError(f"%{n.name}: num_heads {heads} is not a multiple of num_kv_heads {kv}")
        if at["sliding_window"] is not None:
            _positive(n, sliding_window=at["sliding_window"])
        if at["layer"] < 0:
            raise IRError(f"%{n.name}: attention layer must be >= 0, got {at['layer']}")
        if op == "rope_attention":
            _expect(n, "q, k and v features", sizes[0], (heads + 2 * kv) * d)
            _expect(n, "rotary dim", sizes[1], ("rope", d))
            return heads * d
        _expect(n, "q features", sizes[0], heads * d)
        _expect(n, "k features", sizes[1], kv * d)
        _expect(n, "v features", sizes[2], kv * d)
        return sizes[0]
    if op in ("silu", "index_select"):
        return sizes[0]
    if op == "moe":
        experts, k = at["num_experts"], at["top_k"]
        _positive(n, num_experts=experts, top_k=k)
        if k > experts:
            raise IRError(f"%{n.name}: top_k {k} is more than num_experts {experts}")
        local, extra = divmod(len(sizes) - 2, 3)
        first = at["first_expert"]
        if extra or local == 0 or first < 0 or first + local > experts:
            raise IRError(
                f"%{n.name}: moe takes x, a router and 3 weights for each of experts "
                f"[first_expert, ...) of {experts}; got {len(sizes) - 2} weights from {first}"
            )
        _expect(n, "router", _weight_shape(graph, a[1], 2), (experts, sizes[0]))
        return sizes[0]
    if op in ("all_reduce", "all_gather"):
        _positive(n, ranks=at["ranks"])
        if op == "all_gather" and not isinstance(sizes[0], int):
            raise IRError(f"%{n.name}: all_gather takes a feature size, not {sizes[0]}")
        return sizes[0] * at["ranks"] if op == "all_gather" else sizes[0]
    raise IRError(f"%{n.name}: no shape rule for op {op!r}")
