"""Op front-ends for model definitions: each call records one IR node while tracing.

The names and signatures mirror `kiln.core.ir.OPS`; tensors are `Value`s or the
module's own parameters, everything else is a static attribute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.core.trace import Value, active_tracer


def _op(op: str, *args: object, **attrs: object) -> Value:
    return Value(active_tracer().emit(op, list(args), attrs))


def embedding(ids: Value, weight: torch.Tensor) -> Value:
    return _op("embedding", ids, weight)


def linear(x: Value, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Value:
    return _op("linear", x, weight) if bias is None else _op("linear", x, weight, bias)


def rmsnorm(x: Value, weight: torch.Tensor, eps: float, group: int = 0) -> Value:
    """RMSNorm over the last dim, or over each `group`-sized chunk of it (per-head norms)."""
    return _op("rmsnorm", x, weight, eps=eps, group=group)


def add(a: Value, b: Value) -> Value:
    return _op("add", a, b)


def mul(a: Value, b: Value) -> Value:
    return _op("mul", a, b)


def silu(x: Value) -> Value:
    return _op("silu", x)


def rope_cos_sin(positions: Value, inv_freq: Value) -> Value:
    return _op("rope_cos_sin", positions, inv_freq)


def rope(x: Value, cos_sin: Value, head_dim: int) -> Value:
    return _op("rope", x, cos_sin, head_dim=head_dim)


def attention(
    q: Value,
    k: Value,
    v: Value,
    *,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
) -> Value:
    return _op(
        "attention",
        q,
        k,
        v,
        layer=layer,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=scale,
        sliding_window=sliding_window,
        kv_scale=1.0,
    )


def moe(
    x: Value,
    router: torch.Tensor,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    top_k: int,
    renormalize: bool,
) -> Value:
    """Mixture of experts: `experts` are (gate, up, down) weights, as an MLP's."""
    flat = [w for expert in experts for w in expert]
    return _op(
        "moe",
        x,
        router,
        *flat,
        num_experts=len(experts),
        top_k=top_k,
        renormalize=int(renormalize),
        first_expert=0,
    )


def index_select(x: Value, index: Value) -> Value:
    return _op("index_select", x, index)


def constant(name: str, value: torch.Tensor) -> Value:
    return active_tracer().constant(name, value)


def split(x: Value, sizes: Sequence[int]) -> tuple[Value, ...]:
    tracer = active_tracer()
    parts = tracer.emit("split", [x], {"sizes": list(sizes)})
    return tuple(
        Value(tracer.emit("getitem", [Value(parts)], {"index": i})) for i in range(len(sizes))
    )
