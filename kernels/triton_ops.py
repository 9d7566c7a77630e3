"""triton: the CUDA target's kernels, Triton programs (kernels/triton_jit.py).

Registered for cuda only: select_backends takes them on a CUDA target and keeps
torch_native for the ops they do not cover (the linears are cuBLAS GEMMs through torch,
except under --enable-deterministic-inference, which takes the Triton linear).
Attention is one program for prefill, extend and decode over the paged pool
(`StepContext.plan` gives every step a page table, so one layout serves all three), after
the step's K/V are stored with the reference `write_kv`. fp8 pools are read back through
their scale inside the program.

Hardware: every kernel here is tested against torch_native on the CPU under
TRITON_INTERPRET=1 (tests/kernels/test_triton.py, in CI) and, compiled for sm_90, on the
H100 and H200 the `device` tool lent (benchmarks/gpu_check.sh; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.ops.attention import Attention, AttentionBatch, rope_then_attend, write_kv
from kiln.core.ops.norm import AddNorm, Norm
from kiln.core.ops.rope import Rope, RopeQKV
from kiln.kernels.registry import register

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# The paged attention's tiles, (query, head) rows by keys: a decode step's group of query
# heads fits the small one; a prompt's rows take the large one (a quarter of the K/V reads,
# fuller tensor-core products), except under --enable-deterministic-inference, where every
# step keeps the small one so a row's sums run over the same key blocks in any step.
DECODE_TILE, PROMPT_TILE = (16, 32), (64, 64)
LINEAR_TILE = (64, 64, 64)  # BLOCK_M, BLOCK_N, BLOCK_K of the batch-invariant linear


@functools.cache
def _jit() -> ModuleType:
    try:
        from kiln.kernels import triton_jit
    except ImportError as e:
        raise RuntimeError(
            f"the triton kernels need Triton ({e}); install kiln's gpu extra: "
            "pip install 'kiln[gpu]'"
        ) from None
    return triton_jit


@functools.cache
def _interpreted() -> bool:
    """Triton's interpreter runs the programs (TRITON_INTERPRET=1, the CPU's tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _triton(op: str, unsupported: tuple[str, ...] = (), deterministic_only: bool = False) -> Any:
    # Every program here gives a row the same arithmetic whatever else the call holds: the
    # norms, rope and silu take a row (or a row's heads) a program; attention's tiles (the
    # decode tile in every step of an attention node marked deterministic) run over keys
    # from key 0, so a query's sums run in one order whether it comes alone, in a prompt or
    # beside other sequences; the linear's tiles are fixed.
    return register(
        op,
        backend="triton",
        devices=("cuda",),
        unsupported=unsupported,
        batch_invariant=True,
        deterministic_only=deterministic_only,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows are contiguous (strided rows are fine)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


@_triton("rmsnorm")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, a: Norm) -> torch.Tensor:
    shape, eps = x.shape, a.eps
    rows = _rows(x if not a.group else x.reshape(-1, a.group))
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    _jit().rmsnorm_kernel[(rows.shape[0],)](
        rows, rows, weight, y, y, rows.stride(0), 0, y.stride(0), 0, n, eps,
        HAS_RESIDUAL=False, BLOCK=_pow2(n),
    )  # fmt: skip
    return y.reshape(shape)


@_triton("add_rmsnorm")
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, a: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    xs, r = _rows(x), _rows(residual)
    y, total = torch.empty_like(xs), torch.empty_like(xs)
    n = xs.shape[1]
    _jit().rmsnorm_kernel[(xs.shape[0],)](
        xs, r, weight, y, total, xs.stride(0), r.stride(0), y.stride(0), total.stride(0), n,
        a.eps, HAS_RESIDUAL=True, BLOCK=_pow2(n),
    )  # fmt: skip
    return y.view(x.shape), total.view(x.shape)


@_triton("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    d = rows.shape[1] // 2
    y = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(d))
    grid = (rows.shape[0], -(-d // block))
    _jit().silu_and_mul_kernel[grid](rows, y, rows.stride(0), y.stride(0), d, BLOCK=block)
    return y.view(*x.shape[:-1], d)


@_triton("linear", deterministic_only=True)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in fixed 64 x 64 tiles over K in order (no split-K, no per-shape
    choice): a row's outputs are bitwise the same at any row count, which cuBLAS's
    heuristics do not promise. For --enable-deterministic-inference only: slower than
    cuBLAS at most shapes."""
    rows = _rows(x)
    m, k = rows.shape
    n = weight.shape[0]
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (-(-m // LINEAR_TILE[0]), -(-n // LINEAR_TILE[1]))
    _jit().linear_kernel[grid](
        rows, weight, y if bias is None else bias, y, m, n, k,
        rows.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _interpreted(),
        BLOCK_M=LINEAR_TILE[0], BLOCK_N=LINEAR_TILE[1], BLOCK_K=LINEAR_TILE[2],
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


@_triton("rope")
def rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: Rope) -> torch.Tensor:
    rows, head_dim = _rows(x), a.head_dim
    cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in cos_sin)
    if cos.shape[1] != head_dim:
        raise ValueError(f"triton rope: rotary dim {cos.shape[1]} != head_dim {head_dim}")
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    heads = rows.shape[1] // head_dim
    _jit().rope_kernel[(rows.shape[0], heads)](
        rows, y, cos, sin, rows.stride(0), y.stride(0), cos.stride(0), heads,
        HEAD_DIM=head_dim, BLOCK=_pow2(head_dim, 2),
    )  # fmt: skip
    return y


@_triton("rope_qkv")
def rope_qkv(
    qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: RopeQKV
) -> tuple[torch.Tensor, ...]:
    nq, nk, _ = a.sizes
    qk = rope(qkv[:, : nq + nk], cos_sin, a=Rope(a.head_dim))
    return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]


@_triton("attention", unsupported=("softcap", "sinks"))
def attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *sinks: torch.Tensor,  # never given: it refuses sinks (`unsupported`)
    a: Attention,
) -> torch.Tensor:
    layer, num_heads, num_kv_heads, head_dim = a.layer, a.num_heads, a.num_kv_heads, a.head_dim
    scale, sliding_window, kv_scale = a.scale, a.sliding_window, a.kv_scale
    if ctx.page_table is None:
        raise ValueError("triton attention: the step has no page table (plan it with StepContext)")
    write_kv(ctx, layer, k, v, num_kv_heads, head_dim, kv_scale)
    q = _rows(q)
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    k_pool, v_pool = ctx.k_cache[layer], ctx.v_cache[layer]
    table = ctx.page_table
    group = num_heads // num_kv_heads
    rows = ctx.max_q_len * group
    block_m, block_n = DECODE_TILE if a.deterministic or rows < PROMPT_TILE[0] else PROMPT_TILE
    grid = (ctx.num_seqs, num_kv_heads, -(-rows // block_m))
    _jit().paged_attention_kernel[grid](
        q, k_pool, v_pool, out, table, ctx.q_starts, ctx.q_lens, ctx.seq_kv_lens,
        q.stride(0), out.stride(0), k_pool.stride(0), table.stride(0),
        scale, kv_scale, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, PAGE=ctx.page_size,
        HAS_WINDOW=sliding_window is not None,
        TENSOR_CORES=q.dtype in (torch.bfloat16, torch.float16) and not _interpreted(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(head_dim),
    )  # fmt: skip
    return out


@_triton("rope_attention", unsupported=("softcap", "sinks"))
def rope_attention(
    ctx: AttentionBatch, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: Attention
) -> torch.Tensor:
    return rope_then_attend(rope_qkv, attention, ctx, qkv, cos_sin, a)
