"""Reference kernels in plain torch: every op, every device. Numerics follow transformers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F

from kiln.core.quant import (
    GA8_KIND,
    dequantize,
    quantize_activations,
    quantize_group_activations,
)
from kiln.kernels.attention import AttentionBatch, attention, rope_then_attend
from kiln.kernels.registry import register


@register("embedding")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


@register("embedding_part")
def embedding_part(ids: torch.Tensor, weight: torch.Tensor, first_row: int) -> torch.Tensor:
    local = ids - first_row
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _unpack_quant(codes: torch.Tensor, scales: torch.Tensor, fmt: str, rows: int) -> torch.Tensor:
    """Quantized panels (kiln/core/layout.py) -> float32 [rows, K]."""
    if fmt in ("w8a8_int8", "int8_a8"):  # [T, K/4, L, 4] -> [T, K, L]
        codes = codes.permute(0, 1, 3, 2).reshape(codes.shape[0], -1, codes.shape[2])
    if fmt == "uint4_a8":  # [T, K/8, L, 4] bytes -> [T, K, L] codes, 4 low nibbles first
        t, blocks, lanes, _ = codes.shape
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=3)  # [T, K/8, L, 2, 4]
        codes = nibbles.permute(0, 1, 3, 4, 2).reshape(t, blocks * 8, lanes)
    tiles, _, lanes = codes.shape
    if fmt == "uint4":  # [T, K/2, L] bytes -> [T, K, L] codes, k even from the low nibble
        codes = torch.stack([codes & 0xF, codes >> 4], dim=2).reshape(tiles, -1, lanes)
    if fmt in ("int8", "w8a8_int8", "int8_a8"):
        codes = codes.view(torch.int8)
    q = codes.transpose(1, 2).reshape(tiles * lanes, -1)[:rows]
    s = scales.permute(0, 3, 1, 2).reshape(tiles * lanes, *scales.shape[1:3])[:rows]
    return dequantize(q, s, fmt)


@register("quant_linear")
def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    format: str,
    group: int,
    out_features: int,
    prologue: str = "none",
) -> torch.Tensor:
    """Reference: dequantize the whole weight, then a float GEMM (w8a8_int8: the integer
    sums of per-token int8 activations, exact in float64, then the two scales; uint4_a8 /
    int8_a8: the activations rounded to int8 per group as their kernel does, then a float64
    GEMM, which is the kernel's sum before its float32 roundings)."""
    if prologue == "silu_and_mul":
        x = silu_and_mul(x)
    w = _unpack_quant(codes, scales, format, out_features)
    if format in GA8_KIND:
        out = (quantize_group_activations(x, group) @ w.double().T).float()
        return out if bias is None else out + bias
    if format != "w8a8_int8":
        return F.linear(x, w.to(x.dtype), bias)
    tiles, _, lanes, _ = codes.shape
    sw = scales[:, 0, 0, :].reshape(tiles * lanes)[:out_features]
    wq = torch.round(w / sw[:, None])
    xq, sx = quantize_activations(x.float())
    sums = (xq.double() @ wq.double().T).float()
    out = sums * (sx * sw)
    return out if bias is None else out + bias


@register("quant_embedding")
def quant_embedding(
    ids: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    format: str,
    group: int,
    num_embeddings: int,
) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise IndexError(f"a token id is outside [0, {num_embeddings})")
    return F.embedding(ids, _unpack_quant(codes, scales, format, num_embeddings))


@register("rmsnorm")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 0) -> torch.Tensor:
    shape = x.shape
    if group:
        x = x.reshape(-1, group)
    if x.dtype == torch.float32:
        # aten's fused rms_norm: bit-identical to the reference below in fp32, ~2x faster.
        return F.rms_norm(x, (x.shape[-1],), weight, eps).reshape(shape)
    # 16-bit: as transformers, normalise in fp32, round, then scale in the input dtype.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).reshape(shape)


@register("add_rmsnorm")
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rmsnorm(total, weight, eps), total


@register("add")
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


@register("mul")
def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


@register("silu")
def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


@register("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@register("split")
def split(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return torch.split(x, sizes, dim=-1)


@register("moe")
def moe(
    x: torch.Tensor,
    router: torch.Tensor,
    *weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: int,
    first_expert: int,
) -> torch.Tensor:
    """Tokens grouped by expert: each expert's MLP runs once on the rows routed to it (this
    rank's experts only, under expert parallelism)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    local = len(weights) // 3
    for e in torch.unique(chosen).tolist():
        if not first_expert <= e < first_expert + local:
            continue
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        i = 3 * (e - first_expert)
        gate, up, down = weights[i : i + 3]
        h = x.index_select(0, rows)
        y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        out.index_add_(0, rows, y * top[rows, slot].unsqueeze(-1).to(y.dtype))
    return out


@register("index_select")
def index_select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


@register("rope_cos_sin")
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-step rotary tables, [tokens, 1, rotary_dim]: cos for both halves, and sin signed
    so that rope is one multiply-add with the halves swapped (see `rope`)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


@register("rope_qkv")
def rope_qkv(
    qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], head_dim: int, sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    nq, nk, _ = sizes
    qk = rope(qkv[:, : nq + nk], cos_sin, head_dim)
    return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]


@register("rope_attention", needs_ctx=True)
def rope_attention(
    ctx: AttentionBatch, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], **attrs: Any
) -> torch.Tensor:
    return rope_then_attend(rope_qkv, attention, ctx, qkv, cos_sin, attrs)


@register("rope")
def rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], head_dim: int) -> torch.Tensor:
    # Rotate-half layout (as transformers): [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    # = x * [cos, cos] + [x2, x1] * [-sin, sin]; rolling by half a head swaps the halves.
    cos, sin = (t.to(x.dtype) for t in cos_sin)
    t = x.shape[0]
    xh = x.view(t, -1, head_dim)
    return torch.addcmul(xh * cos, xh.roll(head_dim // 2, -1), sin).view(t, -1)


@register("all_reduce")
def all_reduce(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """The sum over the tensor-parallel group (the default process group), in place on x,
    which is a fresh output of the row-parallel linear before it."""
    if ranks > 1:
        torch.distributed.all_reduce(x)
    return x


@register("all_gather")
def all_gather(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    if ranks == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ranks)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
