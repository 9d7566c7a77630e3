"""Ops that work feature by feature or row by row: sums, products, activations, splits,
picking rows. Each is `elementwise` where a feature of the output depends only on the
same feature of the inputs, which lets the tensor-parallel pass carry a split through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


@dataclass(frozen=True, slots=True)
class Sizes(Attrs):
    sizes: list[int]


def _same(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    """Two float tensors of one size and type in, the same out."""
    x, y = (check.float_tensor(t) for t in ins)
    check.expect("right operand features", y.features, x.features)
    check.same_dtype(x, y)
    return x


def _unary(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    return check.float_tensor(ins[0])


def _gated(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    """x and a one-feature gate of its type in, x's type out."""
    x, g = (check.float_tensor(t) for t in ins)
    check.expect("gate features", g.features, 1)
    check.same_dtype(x, g)
    return x


@op("a, b", rule=_same)
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


@op("a, b", rule=_same)
def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


@op("x", rule=_unary)
def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


@op("x", rule=_unary)
def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x) squared (Nemotron's and Arcee's MLP activation, `relu2`)."""
    return torch.square(torch.relu(x))


@op("x", rule=_unary)
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
    return F.gelu(x, approximate="tanh")


@op("x, gate", rule=_gated)
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x times sigmoid(gate), one gate value a row (Qwen2-MoE's shared expert's output
    times sigmoid(shared_expert_gate(hidden)))."""
    return torch.sigmoid(gate) * x


@dataclass(frozen=True, slots=True)
class Factor(Attrs):
    factor: float


@dataclass(frozen=True, slots=True)
class Cap(Attrs):
    cap: float


@op("x", Cap, rule=_unary)
def softcap(x: torch.Tensor, *, a: Cap) -> torch.Tensor:
    """cap * tanh(x / cap): values held inside (-cap, cap) (Gemma 2's final logits)."""
    return torch.tanh(x / a.cap) * a.cap


@op("x", Factor, rule=_unary)
def scale(x: torch.Tensor, *, a: Factor) -> torch.Tensor:
    """x times a constant, rounded to x's dtype first as transformers does (Gemma's
    embeddings times sqrt(hidden size))."""
    return x * torch.tensor(a.factor, dtype=x.dtype)


def _halves(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    if not isinstance(x.features, int) or x.features % 2:
        raise check.fail(f"silu_and_mul needs an even feature size, got {x.features}")
    return TensorType(x.features // 2, x.dtype)


@op("x", rule=_halves)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x1) * x2 for x = [x1 | x2] (a fused gate and up projection's output)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _split(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    check.positive(**{f"size {i}": s for i, s in enumerate(a["sizes"])})
    check.expect("total", sum(a["sizes"]), x.features)
    return tuple(TensorType(s, x.dtype) for s in a["sizes"])


@op("x", Sizes, rule=_split, outputs=-1)
def split(x: torch.Tensor, *, a: Sizes) -> tuple[torch.Tensor, ...]:
    return torch.split(x, a.sizes, dim=-1)


def _rows(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.ids(ins[1], "index")
    return check.float_tensor(ins[0])


@op("x, index", rule=_rows)
def index_select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of x (the rows whose logits a step wants)."""
    return x.index_select(0, index)


def _concat(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    parts = [check.float_tensor(t) for t in ins]
    widths = [p.features for p in parts]
    for p in parts[1:]:
        check.same_dtype(parts[0], p)
    if any(w is None for w in widths):
        raise check.fail("concat of a value without features")
    return TensorType(sum(w for w in widths if w is not None), parts[0].dtype)


@op("x, *rest", rule=_concat)
def concat(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The inputs' features side by side, row by row (EAGLE's token and hidden state)."""
    return torch.cat([x, *rest], dim=-1)


@dataclass(frozen=True, slots=True)
class Width(Attrs):
    features: int


def _step_hidden(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    like = check.float_tensor(ins[0])
    check.positive(features=a["features"])
    return TensorType(a["features"], like.dtype)


@op("like", Width, rule=_step_hidden, needs_ctx=True)
def step_hidden(ctx: Any, like: torch.Tensor, *, a: Width) -> torch.Tensor:
    """The hidden states the runtime feeds this step, a row per token (an EAGLE draft's
    input: the model's own for the tokens it checked, the draft's for those it drafted),
    in the type and on the device of `like`, a value of the same rows."""
    hidden = ctx.hidden
    if hidden is None or tuple(hidden.shape) != (like.shape[0], a.features):
        got = None if hidden is None else tuple(hidden.shape)
        raise ValueError(f"step_hidden: the step fed hidden states {got}, the graph reads "
                         f"{(like.shape[0], a.features)}")  # fmt: skip
    return hidden.to(device=like.device, dtype=like.dtype)


# Ops whose output feature j depends on input feature j alone (split inputs stay split).
ELEMENTWISE = (add, mul, silu, relu2, gelu_tanh, scale, softcap, silu_and_mul)
OPS = (
    add,
    mul,
    silu,
    relu2,
    gelu_tanh,
    scale,
    softcap,
    silu_and_mul,
    sigmoid_gate,
    split,
    index_select,
    concat,
    step_hidden,
)
