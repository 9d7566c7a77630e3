"""Paged attention over the runtime's KV pool: the step's attention context
(`AttentionBatch`, built by runtime/step.py and read by every backend's attention kernels),
the pool's fp8 conversions, and the reference kernels.

The runtime builds one `AttentionBatch` per forward step; every attention node of the
graph reads it. The pool is head-major, [layers, kv_heads, slots, head_dim], so gathering
a sequence's slots yields contiguous [kv_heads, len, head_dim] blocks: SDPA's fast CPU
path needs contiguous 4-D inputs (a transposed view falls back to a path ~5x slower).

An fp8 pool (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`) holds value / kv_scale, saturated to
the format's largest finite value, and is read back as value * kv_scale in the query's
dtype before SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op
from kiln.core.ops.rope import RopeQKV, rope_qkv

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


@dataclass
class SeqSpan:
    """One sequence of the batch: its new tokens are rows [q_start, q_start + q_len)."""

    q_start: int
    q_len: int
    kv_len: int  # cached tokens plus the new ones
    kv_slots: torch.Tensor  # [kv_len] slot of every token of the sequence, in order
    pages: torch.Tensor | None = None  # the pages holding it (None: page size 1, pages = slots)


@dataclass
class AttentionBatch:
    k_cache: torch.Tensor  # [layers, kv_heads, slots, head_dim]
    v_cache: torch.Tensor
    out_slots: torch.Tensor  # [tokens] where each new token's K/V is written
    seqs: list[SeqSpan]
    # Decode-only steps (every q_len == 1) attend in one padded batched call.
    decode: bool = False
    # Single-token rows (every row of a decode step; the decoding requests of a mixed
    # chunk) read the cache through a page table: [rows * max_pages] page ids, padded
    # with 0. Decode gathers whole pages (a contiguous block per page and head, about
    # twice as fast as gathering token rows at 16-token pages).
    kv_index: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None  # [rows]
    page_size: int = 1
    kv_width: int = 0  # max_pages * page_size: keys per sequence after the gather
    # Mixed batches: which seqs are those single-token rows, and their query rows.
    single_seqs: list[int] = field(default_factory=list)
    single_rows: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    # Sequences in the step (padding included) and the longest one's length, known on the
    # host so that no kernel reads a device value back to decide a shape.
    num_seqs: int = 0
    max_kv_len: int = 0
    # Every sequence's layout on the device (set by runtime/step.py StepContext.plan; the
    # triton attention reads these): [seqs, width] page ids, and per sequence its first
    # query row, new tokens and total length; the most new tokens of any sequence.
    page_table: torch.Tensor | None = None
    q_starts: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    seq_kv_lens: torch.Tensor | None = None
    # A step with LoRA adapters' rows (runtime/lora.py): per adapter slot, its rows (an
    # index tensor, or None for all)
    lora: list[tuple[int, Any]] = field(default_factory=list)
    max_q_len: int = 0
    # An EAGLE head's step: the hidden state each row reads (`step_hidden`), [tokens, width]
    hidden: torch.Tensor | None = None

    @classmethod
    def build(
        cls, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqSpan], page_size: int = 1
    ) -> AttentionBatch:
        out_slots = torch.cat([s.kv_slots[s.kv_len - s.q_len :] for s in seqs])
        batch = cls(k_cache, v_cache, out_slots, seqs, page_size=page_size)
        batch.num_seqs = len(seqs)
        batch.decode = all(s.q_len == 1 for s in seqs)
        if batch.decode:
            batch._page_table(seqs)
        else:
            batch.plan_singles()
        return batch

    def plan_singles(self) -> None:
        """A mixed step: the page table of its single-token sequences, if any."""
        single = [i for i, s in enumerate(self.seqs) if s.q_len == 1]
        if single:
            self._page_table([self.seqs[i] for i in single])
            self.single_seqs = single
            self.single_rows = torch.tensor(
                [self.seqs[i].q_start for i in single], device=self.k_cache.device
            )

    def _page_table(self, seqs: list[SeqSpan]) -> None:
        page_size = self.page_size
        used = [-(-s.kv_len // page_size) for s in seqs]
        pages = [s.kv_slots if s.pages is None else s.pages for s in seqs]
        if len(seqs) == 1:
            index = pages[0][: used[0]]
        else:
            index = torch.zeros(len(seqs), max(used), dtype=torch.long, device=pages[0].device)
            for i, (p, n) in enumerate(zip(pages, used, strict=True)):
                index[i, :n] = p[:n]
        self.kv_index = index.reshape(-1).contiguous()
        self.kv_lens = torch.tensor([s.kv_len for s in seqs], device=self.kv_index.device)
        self.kv_width = max(used) * page_size
        self.max_kv_len = max(s.kv_len for s in seqs)

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[1, batch, 1, max_kv_len] True where a key is visible to the new token, or None
        when every key is (one sequence, no window cutting in)."""
        if window in self._masks:
            return self._masks[window]
        assert self.kv_index is not None and self.kv_lens is not None
        lens = self.kv_lens[:, None]
        width = self.kv_width
        mask: torch.Tensor | None = None
        cut = width > self.max_kv_len or (window is not None and width > window)
        if self.num_seqs > 1 or cut:
            j = torch.arange(width, device=lens.device)[None, :]
            mask = j < lens
            if window is not None:
                mask &= j > lens - 1 - window
            mask = mask[None, :, None, :]
        self._masks[window] = mask
        return mask


@dataclass(frozen=True, slots=True)
class Attention(Attrs):
    """What every op that attends over one layer's KV pool takes."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    # An fp8 KV pool stores K/V / kv_scale (passes/kv_cache.py); 1.0 otherwise.
    kv_scale: float = 1.0
    # Gemma 2: scores become softcap * tanh(scores / softcap) before the softmax; 0: none.
    softcap: float = 0.0
    # GPT-OSS: 1 when a fourth input holds a learned logit per query head (its "sink"),
    # which joins each row's softmax and takes its share of the weight, attending to
    # nothing.
    sinks: int = 0
    # --enable-deterministic-inference: 1 when every row is attended on its own, whole, so
    # that its result does not depend on what else a step holds (kernels/csrc/cpu_kernels.c
    # decode_attention; the Triton kernel keeps its decode tile in every step).
    deterministic: int = 0


def _heads(check: Check, a: dict[str, Any]) -> tuple[int, int, int]:
    heads, kv, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    check.positive(num_heads=heads, num_kv_heads=kv, head_dim=d)
    if heads % kv:
        raise check.fail(f"num_heads {heads} is not a multiple of num_kv_heads {kv}")
    if a["sliding_window"] is not None:
        check.positive(sliding_window=a["sliding_window"])
    if a["layer"] < 0:
        raise check.fail(f"attention layer must be >= 0, got {a['layer']}")
    return heads, kv, d


def _attention(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    heads, kv, d = _heads(check, a)
    if len(ins) != 3 + bool(a.get("sinks")):
        raise check.fail(
            f"attention takes q, k, v and sinks={a.get('sinks', 0)}: {len(ins)} inputs"
        )
    if a.get("sinks"):
        check.expect("sinks", check.weight(3, 1), (heads,))
    q, k, v = (check.float_tensor(t, n) for t, n in zip(ins[:3], "qkv", strict=True))
    check.expect("q features", q.features, heads * d)
    check.expect("k features", k.features, kv * d)
    check.expect("v features", v.features, kv * d)
    check.same_dtype(q, k, v)
    return q


def _rope_attention(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    heads, kv, d = _heads(check, a)
    qkv = check.float_tensor(ins[0])
    check.expect("q, k and v features", qkv.features, (heads + 2 * kv) * d)
    check.expect("rotary tables", ins[1], TensorType(d, "float32", "rope"))
    return TensorType(heads * d, qkv.dtype)


def rope_then_attend(
    rope_qkv: Callable[..., tuple[torch.Tensor, ...]],
    attend: Callable[..., torch.Tensor],
    ctx: AttentionBatch,
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, ...],
    a: Attention,
) -> torch.Tensor:
    """rope_attention as its two ops, one backend's `rope_qkv` and `attention`."""
    d = a.head_dim
    kv = a.num_kv_heads * d
    q, k, v = rope_qkv(qkv, cos_sin, a=RopeQKV(d, [a.num_heads * d, kv, kv]))
    return attend(ctx, q, k, v, a=a)


def _causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    mask = j <= qpos
    if window is not None:
        mask &= j > qpos - window
    return mask


@op("q, k, v, *sinks", Attention, rule=_attention, needs_ctx=True)
def attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *sinks: torch.Tensor,
    a: Attention,
) -> torch.Tensor:
    """Paged attention of a step's rows over the layer's pool, their K/V written first."""
    layer = a.layer
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    write_kv(ctx, layer, k, v, a.num_kv_heads, a.head_dim, a.kv_scale)
    sink = sinks[0] if sinks else None
    if ctx.decode:
        return _decode(ctx, q, k_cache, v_cache, a, sink)
    outs = [attend_one(ctx, s, q, k, v, a, sink) for s in ctx.seqs]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def write_kv(
    ctx: AttentionBatch,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: float = 1.0,
) -> None:
    """Store the step's new K/V rows ([tokens, kv_heads * head_dim]) at `ctx.out_slots`."""
    k = k.view(-1, num_kv_heads, head_dim).transpose(0, 1)  # [kv_heads, tokens, d]
    v = v.view(-1, num_kv_heads, head_dim).transpose(0, 1)
    k_pool, v_pool = ctx.k_cache[layer], ctx.v_cache[layer]
    if is_fp8(k_pool.dtype):
        # aten has no fp8 index_copy_ on CPU: the bytes are copied as uint8.
        k, v = (to_pool(t, k_pool.dtype, kv_scale).view(torch.uint8) for t in (k, v))
        k_pool, v_pool = k_pool.view(torch.uint8), v_pool.view(torch.uint8)
    k_pool.index_copy_(1, ctx.out_slots, k)
    v_pool.index_copy_(1, ctx.out_slots, v)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_pool(x: torch.Tensor, pool: torch.dtype, kv_scale: float) -> torch.Tensor:
    """x / kv_scale in the pool's fp8 format, saturated (e5m2 would overflow to inf)."""
    big = torch.finfo(pool).max
    return (x.float() / kv_scale).clamp_(-big, big).to(pool)


def from_pool(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Pool rows as `dtype` values (identity for a float pool)."""
    if not is_fp8(x.dtype):
        return x
    y = x.to(torch.float32)
    if kv_scale != 1.0:
        y = y * kv_scale
    return y.to(dtype)


def attend_one(
    ctx: AttentionBatch,
    s: SeqSpan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: Attention,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output rows [q_len, heads * head_dim] of one sequence of a prefill or
    mixed batch (its K/V already written): SDPA on its fresh K/V when nothing was cached
    before, else on its cached slots gathered in order."""
    heads, kv, d, window = a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window
    rows = slice(s.q_start, s.q_start + s.q_len)
    qs = q[rows].view(s.q_len, heads, d).transpose(0, 1).unsqueeze(0)
    if s.kv_len == s.q_len:
        ks = k[rows].view(s.q_len, kv, d).transpose(0, 1).unsqueeze(0)
        vs = v[rows].view(s.q_len, kv, d).transpose(0, 1).unsqueeze(0)
    else:
        ks, vs = (
            from_pool(c[a.layer].index_select(1, s.kv_slots), q.dtype, a.kv_scale).unsqueeze(0)
            for c in (ctx.k_cache, ctx.v_cache)
        )
    sink = None if sinks is None else sinks.view(1, heads, 1, 1)
    if s.kv_len == s.q_len and window is None:
        o = _sdpa(qs, ks, vs, a, causal=True, sinks=sink)
    else:
        mask = _causal_mask(s.q_len, s.kv_len, window, q.device)
        o = _sdpa(qs, ks, vs, a, mask=mask, sinks=sink)
    return o[0].transpose(0, 1).reshape(s.q_len, heads * d)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: Attention,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of [..., heads, rows, d] queries over [..., kv_heads, keys, d]
    (`mask`: True where a key is visible): torch's SDPA, or, with a soft cap, the scores
    capped before the mask and softmax as transformers' Gemma 2 does (fp32 softmax), or
    with sinks (broadcast against the scores), each row's softmax over its keys and its
    head's sink, the sink's share dropped."""
    gqa = q.shape[-3] != k.shape[-3]
    if not a.softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=a.scale, enable_gqa=gqa
        )
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = (q @ k.transpose(-1, -2)) * a.scale
    if a.softcap:
        scores = torch.tanh(scores / a.softcap) * a.softcap
    if causal:
        rows, keys = scores.shape[-2:]
        mask = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).tril(keys - rows)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores.float(), sink), -1), dim=-1)[..., :-1]
    return probs.to(q.dtype) @ v


def _decode(
    ctx: AttentionBatch,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    a: Attention,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # One new token per sequence: the query heads sharing a KV head become query *rows*
    # of that head ([kv_heads, batch, group, d]), so no K/V is repeated for GQA.
    assert ctx.kv_index is not None
    b, kv, d = ctx.num_seqs, a.num_kv_heads, a.head_dim
    group = a.num_heads // kv
    block = ctx.page_size * d
    ks = k_cache.view(kv, -1, block).index_select(1, ctx.kv_index)
    vs = v_cache.view(kv, -1, block).index_select(1, ctx.kv_index)
    ks, vs = (from_pool(t, q.dtype, a.kv_scale).view(kv, b, -1, d) for t in (ks, vs))
    qg = q.view(b, kv, group, d).transpose(0, 1)
    sink = None if sinks is None else sinks.view(kv, 1, group, 1)
    o = _sdpa(qg, ks, vs, a, mask=ctx.decode_mask(a.sliding_window), sinks=sink)
    return o.transpose(0, 1).reshape(b, a.num_heads * d)


@op("qkv, cos_sin", Attention, rule=_rope_attention, needs_ctx=True)
def rope_attention(
    ctx: AttentionBatch, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: Attention
) -> torch.Tensor:
    """rope_qkv and attention in one op: args the fused projection's rows [q | k | v] and
    the rotary tables (passes/fuse_rope.py); a decode step runs it as one native call."""
    return rope_then_attend(rope_qkv.kernel, attention.kernel, ctx, qkv, cos_sin, a)


# The ops that attend over one layer's K and V pools (their attributes are `Attention`).
OPS = (attention, rope_attention)
