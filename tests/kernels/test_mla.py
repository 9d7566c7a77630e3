"""Multi-head latent attention: the pool holds one latent + rope row per token, and the
weight-absorbed form (passes/absorb_mla.py) computes what the expanded one does, prefill,
decode and a mixed step, over pages scattered in the pool."""

from __future__ import annotations

import torch

from kiln.core.ops.attention import AttentionBatch, SeqSpan
from kiln.core.ops.mla import MLA, HeadLinear, head_linear, latent_attention, mla_attention
from kiln.runtime.kv_cache import KVCache

H, DN, DR, DV, DL = 4, 16, 8, 12, 32
ATTRS = MLA(0, H, 1, DL + DR, 0.2, DL, DR, DN, DV)


def _absorbed(ctx, q, q_rope, latent, k_rope, kv_b):
    w = kv_b.view(H, DN + DV, DL)
    uk, uv = w[:, :DN].transpose(1, 2), w[:, DN:]
    q_lat = head_linear.reference(q, uk, a=HeadLinear(H))
    o = latent_attention.reference(ctx, q_lat, q_rope, latent, k_rope, a=ATTRS)
    return head_linear.reference(o, uv, a=HeadLinear(H))


def _pools(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, 1, slots, DL + DR), torch.zeros(1, 1, slots, 0)


def test_absorbed_latent_attention_equals_the_expanded_form() -> None:
    torch.manual_seed(0)
    kv_b = torch.randn(H * (DN + DV), DL) / DL**0.5
    lens = [5, 9, 1]
    perm = torch.randperm(64)
    slot_of = [perm[16 * i : 16 * i + 16] for i in range(len(lens))]
    n = sum(lens) + len(lens)
    q, q_rope = torch.randn(n, H * DN), torch.randn(n, H * DR)
    latent, k_rope = torch.randn(n, DL), torch.randn(n, DR)
    # Prefill every prompt, then one decode step per sequence; then a mixed step (a new
    # prompt beside a decoding sequence) on fresh pools.
    prefill, start = [], 0
    for length, s in zip(lens, slot_of, strict=True):
        prefill.append(SeqSpan(start, length, length, s[:length]))
        start += length
    decode = [
        SeqSpan(i, 1, length + 1, s[: length + 1])
        for i, (length, s) in enumerate(zip(lens, slot_of, strict=True))
    ]
    mixed = [SeqSpan(0, 3, 3, slot_of[0][:3]), SeqSpan(3, 1, 1, slot_of[1][:1])]
    pools = {"expanded": _pools(64), "absorbed": _pools(64)}
    results: dict[str, list[torch.Tensor]] = {k: [] for k in pools}
    for spans, rows in (
        (prefill, slice(0, sum(lens))),
        (decode, slice(sum(lens), n)),
        (mixed, slice(0, 4)),
    ):
        if spans is mixed:
            pools = {k: _pools(64) for k in pools}
        args = (q[rows], q_rope[rows], latent[rows], k_rope[rows])
        for form, (kc, vc) in pools.items():
            ctx = AttentionBatch.build(kc, vc, spans)
            assert ctx.decode == (spans is decode)
            if form == "expanded":
                out = mla_attention.reference(ctx, *args, kv_b, a=ATTRS)
            else:
                out = _absorbed(ctx, *args, kv_b)
            results[form].append(out)
    for got, want in zip(results["absorbed"], results["expanded"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The pool holds exactly the step's [latent | k_rope] rows, one "head" per token.
    kc = pools["absorbed"][0]
    torch.testing.assert_close(kc[0, 0, slot_of[0][:3]], torch.cat((latent[:3], k_rope[:3]), -1))


def test_a_latent_pool_is_latent_plus_rope_wide() -> None:
    """DeepSeek-V3's shape in bf16: 61 layers x (512 + 64) features = 70,272 bytes a token,
    where a multi-head pool of its 128 heads (keys 192 wide, values 128) would take 4,997,120."""
    mla = KVCache.bytes_per_token(61, 1, 512 + 64, torch.bfloat16, v_head_dim=0)
    mha = KVCache.bytes_per_token(61, 128, 192, torch.bfloat16, v_head_dim=128)
    assert (mla, mha) == (70_272, 4_997_120)
    pool = KVCache(2, 32, 1, DL + DR, torch.float32, v_head_dim=0)
    assert pool.v.numel() == 0 and pool.nbytes == 2 * 32 * (DL + DR) * 4
