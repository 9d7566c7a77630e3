"""Multi-head latent attention (DeepSeek V2 / V3): the KV pool holds, per token and layer,
the compressed latent (kv_lora_rank features, normed) and the shared rope part of the key
(qk_rope_head_dim, turned), one "KV head" of latent + rope features. The per-head keys
and values are never stored: they are the latent times `kv_b_proj`.

- `mla_attention(q_nope, q_rope, latent, k_rope, kv_b)`: what the model definition writes,
  the expanded form (keys and values made from the latent for every cached token);
- `latent_attention(q_latent, q_rope, latent, k_rope)`: attention over the pool as it is
  (one shared KV head: scores q_latent . latent + q_rope . k_rope, values the latents), and
  `head_linear`, a per-head matmul: passes/absorb_mla.py rewrites each mla_attention into
  head_linear(q_nope, W_uk) -> latent_attention -> head_linear(., W_uv), kv_b's key and
  value halves folded into the query and the output ("weight absorption"): per token and
  head it reads kv_lora_rank + qk_rope_head_dim features instead of making
  (qk_nope_head_dim + v_head_dim) x kv_lora_rank of them.

Both attention ops take `MLA` attributes, the `Attention` fields (num_kv_heads 1, head_dim
the pooled width) plus the four widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op
from kiln.core.ops.attention import AttentionBatch, from_pool, is_fp8, to_pool

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


@dataclass(frozen=True, slots=True)
class MLA(Attrs):
    layer: int
    num_heads: int
    num_kv_heads: int  # 1: the latent is shared by every head
    head_dim: int  # the pooled width: latent_dim + rope_dim
    scale: float
    latent_dim: int  # kv_lora_rank
    rope_dim: int  # qk_rope_head_dim
    nope_dim: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim
    sliding_window: int | None = None
    kv_scale: float = 1.0  # an fp8 pool's scale (passes/kv_cache.py)
    softcap: float = 0.0  # not used by MLA models; here so backends see Attention's fields
    sinks: int = 0


@dataclass(frozen=True, slots=True)
class HeadLinear(Attrs):
    num_heads: int


def _widths(check: Check, a: dict[str, Any]) -> None:
    check.positive(
        num_heads=a["num_heads"],
        latent_dim=a["latent_dim"],
        rope_dim=a["rope_dim"],
        nope_dim=a["nope_dim"],
        v_dim=a["v_dim"],
    )
    check.expect("num_kv_heads", a["num_kv_heads"], 1)
    check.expect("head_dim", a["head_dim"], a["latent_dim"] + a["rope_dim"])
    if a["sliding_window"] is not None or a["softcap"] or a["sinks"]:
        raise check.fail("latent attention has no window, soft cap or sinks")


def _pooled_inputs(check: Check, a: dict[str, Any], ins: list[Any], q_dim: int) -> Any:
    """Both latent attention ops' first four inputs: queries of q_dim a head, their rope
    part, the latent and the key's rope part. Returns the queries' type."""
    _widths(check, a)
    h = a["num_heads"]
    widths = (h * q_dim, h * a["rope_dim"], a["latent_dim"], a["rope_dim"])
    types = [check.float_tensor(t, n) for t, n in zip(ins[:4], _NAMES, strict=True)]
    for name, t, want in zip(_NAMES, types, widths, strict=True):
        check.expect(f"{name} features", t.features, want)
    return types[0]


def _mla(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    q = _pooled_inputs(check, a, ins, a["nope_dim"])
    h = a["num_heads"]
    check.expect("kv_b", check.weight(4, 2), (h * (a["nope_dim"] + a["v_dim"]), a["latent_dim"]))
    return TensorType(h * a["v_dim"], q.dtype)


def _latent(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    q = _pooled_inputs(check, a, ins, a["latent_dim"])
    return TensorType(a["num_heads"] * a["latent_dim"], q.dtype)


def _head_linear(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    h = a["num_heads"]
    check.positive(num_heads=h)
    heads, out, inner = check.weight(1, 3)
    check.expect("weight heads", heads, h)
    check.expect("x features", x.features, h * inner)
    return TensorType(h * out, x.dtype)


_NAMES = ("q", "q_rope", "latent", "k_rope")


def write_latent(ctx: AttentionBatch, a: MLA, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Store the step's new tokens' [latent | k_rope] rows in the layer's pool (one head)."""
    rows = torch.cat((latent, k_rope.to(latent.dtype)), -1).unsqueeze(0)  # [1, tokens, width]
    pool = ctx.k_cache[a.layer]
    if is_fp8(pool.dtype):
        rows, pool = to_pool(rows, pool.dtype, a.kv_scale).view(torch.uint8), pool.view(torch.uint8)
    pool.index_copy_(1, ctx.out_slots, rows)


def _pooled(ctx: AttentionBatch, a: MLA, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sequence's pooled rows [kv_len, latent_dim + rope_dim], in order."""
    return from_pool(ctx.k_cache[a.layer][0].index_select(0, slots), dtype, a.kv_scale)


def _causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def _spans(
    ctx: AttentionBatch, a: MLA, dtype: torch.dtype
) -> list[tuple[slice, torch.Tensor, torch.Tensor | None]]:
    """(query rows, pooled rows [batch, keys, width], mask [batch, 1, rows, keys] or None)
    of each group of rows attending together: every sequence of a prefill or mixed step
    alone; a decode step's sequences at once, their pages gathered through the page table
    (padded to the longest, masked)."""
    if not ctx.decode:
        return [
            (
                slice(s.q_start, s.q_start + s.q_len),
                _pooled(ctx, a, s.kv_slots, dtype).unsqueeze(0),
                _causal(s.q_len, s.kv_len, s.kv_slots.device)[None, None],
            )
            for s in ctx.seqs
        ]
    assert ctx.kv_index is not None
    b, width = ctx.num_seqs, a.head_dim
    pool = ctx.k_cache[a.layer].view(-1, ctx.page_size * width)
    rows = from_pool(pool.index_select(0, ctx.kv_index), dtype, a.kv_scale).view(b, -1, width)
    mask = ctx.decode_mask(None)  # [1, batch, 1, keys]
    return [(slice(0, b), rows, None if mask is None else mask[0][:, None])]


@op("q, q_rope, latent, k_rope, kv_b", MLA, rule=_mla, needs_ctx=True)
def mla_attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    kv_b: torch.Tensor,
    *,
    a: MLA,
) -> torch.Tensor:
    """Attention with keys [latent kv_b_k | k_rope] and values latent kv_b_v per head, made
    for every token of each sequence from the pool (its new tokens' rows written first)."""
    write_latent(ctx, a, latent, k_rope)
    h, dn, dv, dl = a.num_heads, a.nope_dim, a.v_dim, a.latent_dim
    w = kv_b.view(h, dn + dv, dl).to(q.dtype)
    outs = []
    for rows, pooled, mask in _spans(ctx, a, q.dtype):
        b, keys = pooled.shape[:2]
        kv = torch.einsum("bkl,hel->bhke", pooled[..., :dl], w)  # [batch, heads, keys, dn+dv]
        k = torch.cat((kv[..., :dn], pooled[:, None, :, dl:].expand(b, h, keys, -1)), -1)
        qs = _queries(q[rows], q_rope[rows], b, h, dn, a.rope_dim)
        o = F.scaled_dot_product_attention(qs, k, kv[..., dn:], attn_mask=mask, scale=a.scale)
        outs.append(o.transpose(1, 2).reshape(-1, h * dv))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@op("q, q_rope, latent, k_rope", MLA, rule=_latent, needs_ctx=True)
def latent_attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    *,
    a: MLA,
) -> torch.Tensor:
    """Every head attends over the pooled rows as they are: queries [q_latent | q_rope],
    keys the rows, values their latent part (the new tokens' rows written first)."""
    write_latent(ctx, a, latent, k_rope)
    h, dl = a.num_heads, a.latent_dim
    outs = []
    for rows, pooled, mask in _spans(ctx, a, q.dtype):
        b, keys, width = pooled.shape
        k = pooled[:, None].expand(b, h, keys, width)  # one KV head shared by every head
        qs = _queries(q[rows], q_rope[rows], b, h, dl, a.rope_dim)
        o = F.scaled_dot_product_attention(qs, k, k[..., :dl], attn_mask=mask, scale=a.scale)
        outs.append(o.transpose(1, 2).reshape(-1, h * dl))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _queries(
    q: torch.Tensor, q_rope: torch.Tensor, batch: int, heads: int, dim: int, rope_dim: int
) -> torch.Tensor:
    """[batch, heads, rows, dim + rope_dim] queries of rows [batch * rows, ...]: each
    head's [q | q_rope]."""
    parts = (q.view(batch, -1, heads, dim), q_rope.view(batch, -1, heads, rope_dim))
    return torch.cat(parts, -1).transpose(1, 2)


@op("x, weight", HeadLinear, rule=_head_linear)
def head_linear(x: torch.Tensor, weight: torch.Tensor, *, a: HeadLinear) -> torch.Tensor:
    """Each head's features times its own matrix: x [tokens, heads * in], weight
    [heads, out, in] -> [tokens, heads * out]."""
    h, out, inner = weight.shape
    y = torch.einsum("thi,hoi->tho", x.view(-1, h, inner), weight.to(x.dtype))
    return y.reshape(-1, h * out)


OPS = (mla_attention, latent_attention, head_linear)
