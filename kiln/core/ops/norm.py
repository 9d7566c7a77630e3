"""RMSNorm, alone or after the residual add it follows; LayerNorm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, op

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


@dataclass(frozen=True, slots=True)
class Norm(Attrs):
    eps: float
    group: int = 0  # normalise every `group` features on their own (per-head q/k norms)


@dataclass(frozen=True, slots=True)
class AddNorm(Attrs):
    eps: float


def _norm(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    group = a.get("group", 0)
    if group:
        check.positive(group=group)
        if not isinstance(x.features, int) or x.features % group:
            raise check.fail(f"rmsnorm group {group} does not divide {x.features} features")
    check.expect("weight size", check.weight(len(ins) - 1, 1)[0], group or x.features)
    return x


def _add_norm(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = _norm(check, a, ins)
    residual = check.float_tensor(ins[1], "residual")
    check.expect("residual features", residual.features, x.features)
    check.same_dtype(x, residual)
    return (x, x)


@op("x, weight", Norm, rule=_norm)
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, a: Norm) -> torch.Tensor:
    shape = x.shape
    if a.group:
        x = x.reshape(-1, a.group)
    if x.dtype == torch.float32:
        # aten's fused rms_norm: bit-identical to the reference below in fp32, ~2x faster.
        return F.rms_norm(x, (x.shape[-1],), weight, a.eps).reshape(shape)
    # 16-bit: as transformers, normalise in fp32, round, then scale in the input dtype.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + a.eps)
    return (weight * h.to(x.dtype)).reshape(shape)


@op("x, residual, weight", AddNorm, rule=_add_norm, outputs=2)
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, a: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual)."""
    total = x + residual
    return rmsnorm.kernel(total, weight, a=Norm(a.eps)), total


@dataclass(frozen=True, slots=True)
class LayerNormAttrs(Attrs):
    eps: float
    group: int = 0  # normalise every `group` features on their own (per-head q/k norms)


def _layer_norm(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    group = a.get("group", 0)
    if group:
        check.positive(group=group)
        if not isinstance(x.features, int) or x.features % group:
            raise check.fail(f"layernorm group {group} does not divide {x.features} features")
    sizes = check.weight(1, 1)[0], *(check.weight(i, 1)[0] for i in range(2, len(ins)))
    # one weight (and bias) every group shares, or one for every feature
    for size in sizes:
        check.expect("weight size", size, sizes[0])
    if not (sizes[0] == x.features or (group and sizes[0] == group)):
        check.expect("weight size", sizes[0], x.features)
    return x


@op("x, weight, bias?", LayerNormAttrs, rule=_layer_norm)
def layernorm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, a: LayerNormAttrs
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight (+ bias) over each row's features (StarCoder
    2's norms), computed in float32 for 16-bit inputs as torch's layer_norm does. With a
    `group`, over every `group` features (per-head q/k norms): the weight and bias are the
    group's (Phi's, every head alike) or the row's (Cohere's and StableLM's, a head each)."""
    if not a.group:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, a.eps)
    shape, g = x.shape, a.group
    if weight.shape[0] == g:
        return F.layer_norm(x.reshape(-1, g), (g,), weight, bias, a.eps).reshape(shape)
    y = F.layer_norm(x.reshape(-1, g), (g,), None, None, a.eps).reshape(shape) * weight
    return y if bias is None else y + bias


OPS = (rmsnorm, add_rmsnorm, layernorm)
