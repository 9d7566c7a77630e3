"""Every op kiln's IR has, each defined once (kiln/core/opdef.py): `OPS` by name. The
definitions are also the tracing front-ends model definitions call (`ops.linear(x, w)`).

Families of ops, one module each: structure (graph inputs, weights, output, getitem),
elementwise, norm, rope, attention, linear (float, panels, quantized; embeddings), moe,
collective. A new op is one definition in one of them (or a new module listed here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.core.lazy import lazy_module
from kiln.core.opdef import OpDef
from kiln.core.ops import attention as _attention
from kiln.core.ops import collective as _collective
from kiln.core.ops import elementwise as _elementwise
from kiln.core.ops import linear as _linear
from kiln.core.ops import mla as _mla
from kiln.core.ops import moe as _moe
from kiln.core.ops import norm as _norm
from kiln.core.ops import rope as _rope
from kiln.core.ops import structure as _structure
from kiln.core.ops.attention import OPS as _POOL_ATTENTION
from kiln.core.ops.attention import attention, rope_attention
from kiln.core.ops.collective import all_gather, all_reduce
from kiln.core.ops.elementwise import (
    add,
    concat,
    gelu_tanh,
    index_select,
    mul,
    relu2,
    scale,
    sigmoid_gate,
    silu,
    silu_and_mul,
    softcap,
    split,
    step_hidden,
)
from kiln.core.ops.linear import PROLOGUES, embedding, linear
from kiln.core.ops.mla import head_linear, latent_attention, mla_attention
from kiln.core.ops.moe import moe
from kiln.core.ops.norm import add_rmsnorm, layernorm, rmsnorm
from kiln.core.ops.rope import rope, rope_cos_sin, rope_qkv
from kiln.core.ops.structure import STRUCTURAL_OPS
from kiln.core.trace import Value, active_tracer

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

OPS: dict[str, OpDef] = {
    d.name: d
    for module in (
        _structure,
        _elementwise,
        _norm,
        _rope,
        _attention,
        _linear,
        _mla,
        _moe,
        _collective,
    )
    for d in (module.STRUCTURAL if module is _structure else module.OPS)
}
# The ops that attend over one layer's KV pool (their attributes have `Attention`'s fields).
ATTENTION_OPS = tuple(d.name for d in (*_POOL_ATTENTION, _mla.mla_attention, _mla.latent_attention))
# Ops whose torch_native kernel reads device values back to the host mid-step (the MoE's
# loop over the experts its tokens chose), which a CUDA graph cannot record: a CUDA decode
# runs eagerly where the graph has one, and a piecewise prefill runs them between its
# recorded pieces, as it runs the attentions.
HOST_SYNC_OPS = ("moe",)
# Ops whose output feature j depends on input feature j alone.
ELEMENTWISE = frozenset(d.name for d in _elementwise.ELEMENTWISE)


def shifted(weight: torch.nn.Parameter, by: float) -> Value:
    """A checkpoint weight plus a constant, folded in at compile time."""
    return active_tracer().shifted(weight, by)


def rows(
    weight: torch.Tensor,
    part: str,
    start: int = 0,
    stop: int | None = None,
    rotary: tuple[int, int] = (0, 0),
    interleaved: bool = False,
) -> Value:
    """Rows of a checkpoint weight as module `part`'s own weight, cut (and for a partial
    or interleaved rotary's q and k, reordered per head) at compile time."""
    end = weight.shape[0] if stop is None else stop
    return active_tracer().rows(weight, part, start, end, rotary, interleaved)


def joined(
    weights: list[torch.Tensor],
    part: str,
    rotary: tuple[int, int] = (0, 0),
    interleaved: bool = False,
) -> Value:
    """Checkpoint weights flattened and joined as module `part`'s one 1-D weight at compile
    time (per-head norm weights), each head's features reordered for a partial or
    interleaved rotary as ops.rows reorders q's rows."""
    return active_tracer().joined(weights, part, rotary, interleaved)


def head_parts(
    weight: torch.Tensor, heads: int, parts: tuple[int, ...], deinterleave: bool = False
) -> Value:
    """A weight's rows regrouped by part across heads, cut at compile time."""
    return active_tracer().head_parts(weight, heads, parts, deinterleave)


def expert_part(
    weight: torch.Tensor,
    part: str,
    index: int,
    take: tuple[int, int] = (0, 1),
    transpose: bool = False,
    rows: tuple[int, int] | None = None,
) -> Value:
    """One expert's part of a stacked expert tensor, cut at compile time."""
    return active_tracer().expert_part(weight, part, index, take, transpose, rows)


def constant(name: str, value: torch.Tensor) -> Value:
    """A tensor the model definition computes (rope frequencies), stored as a weight."""
    return active_tracer().constant(name, value)


__all__ = [
    "ATTENTION_OPS",
    "ELEMENTWISE",
    "HOST_SYNC_OPS",
    "OPS",
    "PROLOGUES",
    "STRUCTURAL_OPS",
    "add",
    "add_rmsnorm",
    "all_gather",
    "all_reduce",
    "attention",
    "concat",
    "constant",
    "embedding",
    "gelu_tanh",
    "head_linear",
    "index_select",
    "latent_attention",
    "layernorm",
    "linear",
    "mla_attention",
    "moe",
    "mul",
    "relu2",
    "rmsnorm",
    "rope",
    "rope_attention",
    "rope_cos_sin",
    "rope_qkv",
    "scale",
    "shifted",
    "sigmoid_gate",
    "silu",
    "silu_and_mul",
    "softcap",
    "split",
    "step_hidden",
]
