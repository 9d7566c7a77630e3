"""A mixture-of-experts MLP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, OpDef, op

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


@dataclass(frozen=True, slots=True)
class MoE(Attrs):
    num_experts: int
    top_k: int
    renormalize: int  # 1: the k chosen weights rescaled to sum to 1
    # An expert-parallel rank holds experts [first_expert, first_expert + its weights / 3).
    first_expert: int = 0


def _moe(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    experts, k = a["num_experts"], a["top_k"]
    check.positive(num_experts=experts, top_k=k)
    if k > experts:
        raise check.fail(f"top_k {k} is more than num_experts {experts}")
    local, extra = divmod(len(ins) - 2, 3)
    first = a["first_expert"]
    if extra or local == 0 or first < 0 or first + local > experts:
        raise check.fail(
            f"moe takes x, a router and 3 weights for each of experts [first_expert, ...) "
            f"of {experts}; got {len(ins) - 2} weights from {first}"
        )
    check.expect("router", check.weight(1, 2), (experts, x.features))
    return x


def _trace(
    definition: OpDef,
    x: Any,
    router: torch.Tensor,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    top_k: int,
    renormalize: bool,
) -> Any:
    """moe(x, router, [(gate, up, down), ...], top_k, renormalize), as definitions write it."""
    flat = [w for expert in experts for w in expert]
    attrs = {"num_experts": len(experts), "top_k": top_k, "renormalize": int(renormalize)}
    return definition.emit([x, router, *flat], attrs)


@op("x, router, *weights", MoE, rule=_moe, front=_trace)
def moe(x: torch.Tensor, router: torch.Tensor, *weights: torch.Tensor, a: MoE) -> torch.Tensor:
    """Each token runs its top_k experts by router softmax and sums their outputs so
    weighted; tokens are grouped by expert, each expert's MLP run once on its rows (this
    rank's experts only, under expert parallelism)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    top, chosen = torch.topk(probs, a.top_k, dim=-1)
    if a.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    local = len(weights) // 3
    for e in torch.unique(chosen).tolist():
        if not a.first_expert <= e < a.first_expert + local:
            continue
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        i = 3 * (e - a.first_expert)
        gate, up, down = weights[i : i + 3]
        h = x.index_select(0, rows)
        y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        out.index_add_(0, rows, y * top[rows, slot].unsqueeze(-1).to(y.dtype))
    return out


OPS = (moe,)
