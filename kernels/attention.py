"""Paged attention over the runtime's KV pool (torch_native backend).

The runtime builds one `AttentionBatch` per forward step; every attention node of the
graph reads it. K/V pages live in one tensor per layer, indexed by token slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kiln.kernels.registry import register


@dataclass
class SeqSpan:
    """One sequence of the batch: its new tokens are rows [q_start, q_start + q_len)."""

    q_start: int
    q_len: int
    kv_len: int  # cached tokens plus the new ones
    kv_slots: torch.Tensor  # [kv_len] slot of every token of the sequence, in order


@dataclass
class AttentionBatch:
    k_cache: torch.Tensor  # [layers, slots, kv_heads, head_dim]
    v_cache: torch.Tensor
    out_slots: torch.Tensor  # [tokens] where each new token's K/V is written
    seqs: list[SeqSpan]
    # Decode-only steps (every q_len == 1) attend in one padded batched call.
    decode: bool = False
    kv_index: torch.Tensor | None = None  # [batch, max_kv_len] slots, padded with slot 0
    kv_lens: torch.Tensor | None = None  # [batch]
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqSpan]
    ) -> AttentionBatch:
        out_slots = torch.cat([s.kv_slots[s.kv_len - s.q_len :] for s in seqs])
        batch = cls(k_cache, v_cache, out_slots, seqs)
        if all(s.q_len == 1 for s in seqs) and len(seqs) > 1:
            width = max(s.kv_len for s in seqs)
            index = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                index[i, : s.kv_len] = s.kv_slots
            batch.decode = True
            batch.kv_index = index
            batch.kv_lens = torch.tensor([s.kv_len for s in seqs])
        return batch

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[batch, 1, 1, max_kv_len] True where the key is visible to the new token."""
        mask = self._masks.get(window)
        if mask is None:
            assert self.kv_index is not None and self.kv_lens is not None
            j = torch.arange(self.kv_index.shape[1])[None, :]
            lens = self.kv_lens[:, None]
            mask = j < lens
            if window is not None:
                mask &= j > lens - 1 - window
            mask = mask[:, None, None, :]
            self._masks[window] = mask
        return mask


def _causal_mask(q_len: int, kv_len: int, window: int | None) -> torch.Tensor:
    qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    mask = j <= qpos
    if window is not None:
        mask &= j > qpos - window
    return mask


@register("attention", needs_ctx=True)
def attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    k_cache[ctx.out_slots] = k
    v_cache[ctx.out_slots] = v
    gqa = num_heads != num_kv_heads

    if ctx.decode:
        assert ctx.kv_index is not None
        b = len(ctx.seqs)
        qb = q.view(b, num_heads, 1, head_dim)
        kb = k_cache[ctx.kv_index].transpose(1, 2)  # [b, kv_heads, L, d]
        vb = v_cache[ctx.kv_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=ctx.decode_mask(sliding_window), scale=scale, enable_gqa=gqa
        )
        return out.reshape(b, num_heads * head_dim)

    outs = []
    for s in ctx.seqs:
        qs = q[s.q_start : s.q_start + s.q_len].view(s.q_len, num_heads, head_dim).transpose(0, 1)
        fresh = s.kv_len == s.q_len
        if fresh:
            ks = k[s.q_start : s.q_start + s.q_len]
            vs = v[s.q_start : s.q_start + s.q_len]
        else:
            ks, vs = k_cache[s.kv_slots], v_cache[s.kv_slots]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
        if fresh and sliding_window is None:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
            )
        elif s.q_len == 1 and (sliding_window is None or s.kv_len <= sliding_window):
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=gqa)
        else:
            mask = _causal_mask(s.q_len, s.kv_len, sliding_window)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        outs.append(o.transpose(0, 1).reshape(s.q_len, num_heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
