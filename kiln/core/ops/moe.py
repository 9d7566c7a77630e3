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
    # An expert-parallel rank holds experts [first_expert, first_expert + its experts).
    first_expert: int = 0
    # GPT-OSS: a bias on the router's logits (an input after the router), biases on each
    # expert's gate, up and down (after its three weights), and its clamped SwiGLU:
    # gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate). 0: off.
    router_bias: int = 0
    expert_biases: int = 0
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    @property
    def per_expert(self) -> int:
        return 6 if self.expert_biases else 3


def _moe(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    experts, k = a["num_experts"], a["top_k"]
    check.positive(num_experts=experts, top_k=k)
    if k > experts:
        raise check.fail(f"top_k {k} is more than num_experts {experts}")
    head = 2 + bool(a.get("router_bias"))
    per = 6 if a.get("expert_biases") else 3
    local, extra = divmod(len(ins) - head, per)
    first = a["first_expert"]
    if extra or local == 0 or first < 0 or first + local > experts:
        raise check.fail(
            f"moe takes x, a router{' and its bias' if head == 3 else ''} and {per} tensors "
            f"for each of experts [first_expert, ...) of {experts}; got {len(ins) - head} "
            f"from {first}"
        )
    check.expect("router", check.weight(1, 2), (experts, x.features))
    if head == 3:
        check.expect("router bias", check.weight(2, 1), (experts,))
    return x


def _trace(
    definition: OpDef,
    x: Any,
    router: Any,
    experts: Sequence[Sequence[Any]],
    top_k: int,
    renormalize: bool,
    router_bias: Any = None,
    swiglu: tuple[float, float] = (0.0, 0.0),
) -> Any:
    """moe(x, router, [(gate, up, down[, gate_bias, up_bias, down_bias]), ...], top_k,
    renormalize, router_bias=None, swiglu=(limit, alpha)), as definitions write it."""
    flat = [w for expert in experts for w in expert]
    attrs = {
        "num_experts": len(experts),
        "top_k": top_k,
        "renormalize": int(renormalize),
        "router_bias": int(router_bias is not None),
        "expert_biases": int(len(experts[0]) == 6),
        "swiglu_limit": swiglu[0],
        "swiglu_alpha": swiglu[1],
    }
    head = [x, router] if router_bias is None else [x, router, router_bias]
    return definition.emit([*head, *flat], attrs)


@op("x, router, *weights", MoE, rule=_moe, front=_trace)
def moe(x: torch.Tensor, router: torch.Tensor, *weights: torch.Tensor, a: MoE) -> torch.Tensor:
    """Each token runs its top_k experts by router softmax and sums their outputs so
    weighted; tokens are grouped by expert, each expert's MLP run once on its rows (this
    rank's experts only, under expert parallelism)."""
    bias = weights[0] if a.router_bias else None
    weights = weights[1:] if a.router_bias else weights
    probs = torch.softmax(F.linear(x, router, bias).float(), dim=-1)
    top, chosen = torch.topk(probs, a.top_k, dim=-1)
    if a.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    per = a.per_expert
    local = len(weights) // per
    for e in torch.unique(chosen).tolist():
        if not a.first_expert <= e < a.first_expert + local:
            continue
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        i = per * (e - a.first_expert)
        gate, up, down = weights[i : i + 3]
        gb, ub, db = weights[i + 3 : i + 6] if a.expert_biases else (None, None, None)
        h = x.index_select(0, rows)
        g, u = F.linear(h, gate, gb), F.linear(h, up, ub)
        if a.swiglu_limit:
            g, u = g.clamp(max=a.swiglu_limit), u.clamp(-a.swiglu_limit, a.swiglu_limit)
            act = (u + 1) * g * torch.sigmoid(g * a.swiglu_alpha)
        else:
            act = F.silu(g) * u
        y = F.linear(act, down, db)
        out.index_add_(0, rows, y * top[rows, slot].unsqueeze(-1).to(y.dtype))
    return out


OPS = (moe,)
