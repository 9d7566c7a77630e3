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
    # DeepSeek: "softmax" (V2) or "sigmoid" (V3) router scores; with n_group > 0, experts
    # only from the topk_group best groups, a group scored by its best expert's score (V2)
    # or, with a correction bias (an input after the router's bias; it only picks experts,
    # V3), by its two best biased scores; the weights times routed_scaling.
    scoring: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    correction_bias: int = 0
    routed_scaling: float = 1.0

    @property
    def per_expert(self) -> int:
        return 6 if self.expert_biases else 3


def _moe(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    experts, k = a["num_experts"], a["top_k"]
    check.positive(num_experts=experts, top_k=k)
    if k > experts:
        raise check.fail(f"top_k {k} is more than num_experts {experts}")
    head = 2 + bool(a.get("router_bias")) + bool(a.get("correction_bias"))
    if a.get("scoring", "softmax") not in ("softmax", "sigmoid"):
        raise check.fail(f"moe scoring {a['scoring']!r}: softmax or sigmoid")
    groups = a.get("n_group", 0)
    if groups and (experts % groups or not 0 < a.get("topk_group", 0) <= groups):
        raise check.fail(f"{experts} experts in {groups} groups, {a.get('topk_group')} of them")
    per = 6 if a.get("expert_biases") else 3
    local, extra = divmod(len(ins) - head, per)
    first = a["first_expert"]
    if extra or local == 0 or first < 0 or first + local > experts:
        raise check.fail(
            f"moe takes x, a router{' and its biases' if head > 2 else ''} and {per} tensors "
            f"for each of experts [first_expert, ...) of {experts}; got {len(ins) - head} "
            f"from {first}"
        )
    check.expect("router", check.weight(1, 2), (experts, x.features))
    for i in range(2, head):
        check.expect("router bias", check.weight(i, 1), (experts,))
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
    correction_bias: Any = None,
    scoring: str = "softmax",
    groups: tuple[int, int] = (0, 0),
    routed_scaling: float = 1.0,
) -> Any:
    """moe(x, router, [(gate, up, down[, gate_bias, up_bias, down_bias]), ...], top_k,
    renormalize, router_bias=None, swiglu=(limit, alpha), correction_bias=None,
    scoring="softmax", groups=(n_group, topk_group), routed_scaling=1.0), as definitions
    write it."""
    flat = [w for expert in experts for w in expert]
    attrs = {
        "num_experts": len(experts),
        "top_k": top_k,
        "renormalize": int(renormalize),
        "router_bias": int(router_bias is not None),
        "expert_biases": int(len(experts[0]) == 6),
        "swiglu_limit": swiglu[0],
        "swiglu_alpha": swiglu[1],
        "scoring": scoring,
        "n_group": groups[0],
        "topk_group": groups[1],
        "correction_bias": int(correction_bias is not None),
        "routed_scaling": routed_scaling,
    }
    head = [x, router, *(b for b in (router_bias, correction_bias) if b is not None)]
    return definition.emit([*head, *flat], attrs)


def route(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor | None,
    correction: torch.Tensor | None,
    a: MoE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) each token's top_k: [tokens, top_k] each."""
    logits = F.linear(x, router, bias).float()
    scores = torch.sigmoid(logits) if a.scoring == "sigmoid" else torch.softmax(logits, -1)
    choice = scores if correction is None else scores + correction.float()
    if a.n_group:
        grouped = choice.view(x.shape[0], a.n_group, -1)
        if correction is None:  # V2: a group is as good as its best expert
            group_score = grouped.max(-1).values
        else:  # V3: the sum of its best two
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_score.topk(a.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(choice.shape)
        choice = choice.masked_fill(~keep, 0.0 if correction is None else float("-inf"))
    chosen = torch.topk(choice, a.top_k, dim=-1).indices
    top = scores.gather(1, chosen)
    if a.renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + (1e-20 if a.scoring == "sigmoid" else 0))
    return top * a.routed_scaling if a.routed_scaling != 1.0 else top, chosen


@op("x, router, *weights", MoE, rule=_moe, front=_trace)
def moe(x: torch.Tensor, router: torch.Tensor, *weights: torch.Tensor, a: MoE) -> torch.Tensor:
    """Each token runs its top_k experts by router softmax and sums their outputs so
    weighted; tokens are grouped by expert, each expert's MLP run once on its rows (this
    rank's experts only, under expert parallelism)."""
    bias = weights[0] if a.router_bias else None
    weights = weights[a.router_bias :]
    correction = weights[0] if a.correction_bias else None
    weights = weights[a.correction_bias :]
    top, chosen = route(x, router, bias, correction, a)
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
