"""Rotary position embeddings: the per-step tables, and their application to heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


@dataclass(frozen=True, slots=True)
class Rope(Attrs):
    head_dim: int


@dataclass(frozen=True, slots=True)
class Tables(Attrs):
    scale: float = 1.0  # cos and sin times this (YaRN's and LongRoPE's attention factor)
    # The pairs `scale` applies to (0: all): a partial rotary's pass-through pairs are
    # frequency 0 and unscaled (kiln.core.recipes.rotary_order).
    scaled_pairs: int = 0


@dataclass(frozen=True, slots=True)
class RopeQKV(Attrs):
    head_dim: int
    sizes: list[int]  # q, k and v features of the fused projection's rows


def _tables(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.ids(ins[0], "positions")
    half = check.weight(1, 1)[0]
    if not 0 <= a.get("scaled_pairs", 0) <= half:
        raise check.fail(f"scaled_pairs {a['scaled_pairs']} of a {half}-pair table")
    return TensorType(2 * half, "float32", "rope")


def _rotary(check: Check, tables: Any, head_dim: int) -> None:
    want = TensorType(head_dim, "float32", "rope")
    check.expect("rotary tables", tables, want)


def _rope(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    check.positive(head_dim=a["head_dim"])
    _rotary(check, ins[1], a["head_dim"])
    if not isinstance(x.features, int) or x.features % a["head_dim"]:
        raise check.fail(f"rope head_dim {a['head_dim']} does not divide {x.features}")
    return x


def _rope_qkv(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    qkv = check.float_tensor(ins[0])
    head_dim, parts = a["head_dim"], a["sizes"]
    check.positive(head_dim=head_dim, **{f"size {i}": x for i, x in enumerate(parts)})
    if len(parts) != 3:
        raise check.fail(f"rope_qkv takes 3 sizes (q, k, v), got {len(parts)}")
    check.expect("total", sum(parts), qkv.features)
    _rotary(check, ins[1], head_dim)
    if parts[0] % head_dim or parts[1] % head_dim:
        raise check.fail(f"rope head_dim {head_dim} does not divide q or k")
    return tuple(TensorType(p, qkv.dtype) for p in parts)


@op("positions, inv_freq", Tables, rule=_tables)
def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, *, a: Tables
) -> tuple[torch.Tensor, ...]:
    """Per-step rotary tables, [tokens, 1, rotary_dim]: cos for both halves, and sin signed
    so that rope is one multiply-add with the halves swapped (see `rope`).

    The angles are float32 products, as transformers makes them; their cos and sin are
    taken in float64 and rounded once, so the tables are the correctly rounded values
    whatever computes them (torch here, numpy for the native step's tables: runtime/
    native_step.py), not each library's own float32 approximation."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    wide = freqs.to(torch.float64)
    cos, sin = wide.cos().to(torch.float32), wide.sin().to(torch.float32)
    if a.scale != 1.0:
        factor = torch.full_like(inv_freq, a.scale)
        if a.scaled_pairs:
            factor[a.scaled_pairs :] = 1.0
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


@op("x, cos_sin", Rope, rule=_rope)
def rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: Rope) -> torch.Tensor:
    # Rotate-half layout (as transformers): [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    # = x * [cos, cos] + [x2, x1] * [-sin, sin]; rolling by half a head swaps the halves.
    cos, sin = (t.to(x.dtype) for t in cos_sin)
    t, d = x.shape[0], a.head_dim
    xh = x.view(t, -1, d)
    return torch.addcmul(xh * cos, xh.roll(d // 2, -1), sin).view(t, -1)


@op("qkv, cos_sin", RopeQKV, rule=_rope_qkv, outputs=3)
def rope_qkv(
    qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: RopeQKV
) -> tuple[torch.Tensor, ...]:
    """A fused projection's rows [q | k | v] -> (rope(q), rope(k), v): one rotary call over
    the q and k heads together, v a view (passes/fuse_rope.py)."""
    nq, nk, _ = a.sizes
    qk = rope.kernel(qkv[:, : nq + nk], cos_sin, a=Rope(a.head_dim))
    return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]


OPS = (rope_cos_sin, rope, rope_qkv)
