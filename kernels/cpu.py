"""kiln_cpu: hand-written fp32 CPU kernels (csrc/cpu_kernels.c).

What they replace, per batch-16 decode step of SmolLM2-135M on the CI machine kind (2
cores), torch profiler: paged decode attention gathered every sequence's K/V pages into a padded
batch (index_select, ~20 ms) and then ran SDPA on it (~11 ms); the C kernel reads K/V in
place through the page table. RMSNorm, SiLU-and-mul and rope were 4-6 small aten ops each.
The linear streams weights the compiler stored as panels (kiln/core/layout.py), where
oneDNN and MKL reached 50-70% of the memory bandwidth on decode batches.
Figures: benchmarks/RESULTS.md.

The library is built by `kiln compile` for the artefact's target (kernels/native.py) and
opened by the runtime (runtime/native.py); the executor binds it to each kernel as `lib`.
These kernels run what the graph says or raise: the compiler checked every shape they rely
on, so a tensor they cannot take is a bug to report, not something to route elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.ops.attention import Attention, AttentionBatch, is_fp8, rope_then_attend, write_kv
from kiln.core.ops.elementwise import Cap
from kiln.core.ops.linear import PackedLinear, QuantEmbedding, QuantLinear
from kiln.core.ops.norm import AddNorm, LayerNormAttrs, Norm
from kiln.core.ops.rope import Rope, RopeQKV
from kiln.core.quant import FORMATS
from kiln.kernels import native
from kiln.kernels.registry import register

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


class KernelError(RuntimeError):
    """A kiln_cpu kernel got what the compiled graph promised it would not."""


def _native(
    op: str, phases: tuple[str, ...] = ("decode", "prefill"), unsupported: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return register(
        op, "kiln_cpu", devices=("cpu",), native=True, phases=phases, unsupported=unsupported
    )


@_native("packed_linear")
def packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    a: PackedLinear,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """x @ W.T (+ bias) on W stored as panels; a row count in `narrow_rows` takes the
    narrow micro-kernel, any other the wide one, as the layout pass decided."""
    x = _rows(x, "packed_linear input")
    m, k, out_features = x.shape[0], weight.shape[1], a.out_features
    out = torch.empty(m, out_features)
    rc = lib.kiln_linear_f32(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        weight.data_ptr(),
        out_features,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        int(not a.narrow_rows[0] <= m <= a.narrow_rows[1]),
        _PROLOGUES[a.prologue],
        _threads(),
    )
    if rc != 0:
        raise MemoryError(f"kiln_cpu linear: no memory for a {m} x {k} copy of its input")
    return out


@_native("packed_embedding")
def packed_embedding(ids: torch.Tensor, weight: torch.Tensor, *, lib: ctypes.CDLL) -> torch.Tensor:
    """Rows `ids` of a [V, h] table stored as panels (the tied lm_head's)."""
    ids, table = ids.contiguous(), weight
    h = table.shape[1]
    vocab = table.shape[0] * table.shape[2]  # padded rows read zeros; ids are checked below
    out = torch.empty(ids.shape[0], h)
    if lib.kiln_embedding_packed_f32(
        ids.data_ptr(), ids.shape[0], table.data_ptr(), vocab, h, out.data_ptr()
    ):
        raise KernelError(f"kiln_cpu embedding: a token id is outside [0, {vocab})")
    return out


@_native("quant_linear")
def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    a: QuantLinear,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """x @ dequant(W).T (+ bias) on codes and scales stored as quantized panels."""
    x = _rows(x, "quant_linear input")
    format, group, out_features, prologue = a.format, a.group, a.out_features, a.prologue
    m, k = x.shape[0], x.shape[1] // (2 if prologue == "silu_and_mul" else 1)
    out = torch.empty(m, out_features)
    form = FORMATS[format]
    if form.kernel == "a8":
        rc = lib.kiln_a8_linear_f32(
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            codes.data_ptr(),
            scales.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            _PROLOGUES[prologue],
            _threads(),
        )
    else:
        # int8-activation formats have their own kernel; both take the same arguments
        if form.kernel == "ga8":
            fn, kind = lib.kiln_ga8_linear_f32, form.ga8
        else:
            fn, kind = lib.kiln_qlinear_f32, form.qfmt
        # --enable-deterministic-inference: each row its own call (passes/deterministic.py)
        rows = [(r, 1) for r in range(m)] if a.deterministic else [(0, m)]
        rc = 0
        for r, count in rows:
            rc = rc or fn(
                x.data_ptr() + r * x.stride(0) * 4,
                x.stride(0),
                count,
                k,
                codes.data_ptr(),
                scales.data_ptr(),
                kind,
                group,
                out_features,
                None if bias is None else bias.data_ptr(),
                out.data_ptr() + r * out_features * 4,
                _PROLOGUES[prologue],
                _threads(),
            )
    if rc == -1:
        raise MemoryError(f"kiln_cpu quant_linear: no memory for a {m} x {k} copy of its input")
    if rc != 0:
        raise KernelError(f"kiln_cpu quant_linear: {format} with group {group} over {k} inputs")
    return out


@_native("quant_embedding")
def quant_embedding(
    ids: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    a: QuantEmbedding,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """Rows `ids` of a quantized [V, h] table (the tied lm_head's), as float32."""
    format, group, num_embeddings = a.format, a.group, a.num_embeddings
    ids = ids.contiguous()
    form = FORMATS[format]
    h = scales.shape[1] * group  # spanels [T, groups, P, L]; kpanels [T, blocks * R, L]
    if form.superblock:
        h = scales.shape[1] // form.record_bytes * form.superblock * group
    out = torch.empty(ids.shape[0], h)
    rc = lib.kiln_qembedding_f32(
        ids.data_ptr(),
        ids.shape[0],
        codes.data_ptr(),
        scales.data_ptr(),
        form.qfmt,
        group,
        num_embeddings,
        h,
        out.data_ptr(),
    )
    if rc == -1:
        raise KernelError(f"kiln_cpu embedding: a token id is outside [0, {num_embeddings})")
    if rc != 0:
        raise KernelError(f"kiln_cpu quant_embedding: {format} with group {group} over {h}")
    return out


@_native("layernorm")
def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    a: LayerNormAttrs,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """`group`: normalise every `group` features on their own, with the group's weight and
    bias or a weight and bias for every feature (per-head q/k norms)."""
    x = _rows(x, "layernorm input")
    n = a.group or x.shape[-1]
    groups = x.shape[1] // n
    out = torch.empty(x.shape)
    lib.kiln_layernorm_f32(
        x.data_ptr(),
        x.stride(0),
        groups,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        0 if weight.shape[0] == n else n,
        out.data_ptr(),
        x.shape[0] * groups,
        n,
        a.eps,
        _threads(),
    )
    return out


@_native("rmsnorm")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, a: Norm, lib: ctypes.CDLL) -> torch.Tensor:
    """`group`: normalise every `group` features on their own (Qwen3's per-head q/k norm)."""
    x = _rows(x, "rmsnorm input")
    n = a.group or x.shape[-1]
    groups = x.shape[1] // n
    out = torch.empty(x.shape)
    lib.kiln_rmsnorm_f32(
        x.data_ptr(),
        x.stride(0),
        groups,
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0] * groups,
        n,
        a.eps,
        _threads(),
    )
    return out


@_native("add_rmsnorm")
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, a: AddNorm, lib: ctypes.CDLL
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    rows, n = x.shape
    if residual.shape != x.shape:
        raise KernelError(f"add_rmsnorm: residual {tuple(residual.shape)} against x {(rows, n)}")
    out, total = torch.empty(rows, n), torch.empty(rows, n)
    lib.kiln_add_rmsnorm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        total.data_ptr(),
        rows,
        n,
        a.eps,
        _threads(),
    )
    return out, total


@_native("silu_and_mul")
def silu_and_mul(x: torch.Tensor, *, lib: ctypes.CDLL) -> torch.Tensor:
    x = x.contiguous()
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d)
    lib.kiln_silu_and_mul_f32(x.data_ptr(), out.data_ptr(), rows, d, _threads())
    return out


@_native("gelu_tanh")
def gelu_tanh(x: torch.Tensor, *, lib: ctypes.CDLL) -> torch.Tensor:
    x = _rows(x, "gelu_tanh input")
    rows, n = x.shape
    out = torch.empty(rows, n)
    lib.kiln_gelu_tanh_f32(x.data_ptr(), x.stride(0), out.data_ptr(), rows, n, _threads())
    return out


@_native("softcap")
def softcap(x: torch.Tensor, *, a: Cap, lib: ctypes.CDLL) -> torch.Tensor:
    x = _rows(x, "softcap input")
    rows, n = x.shape
    out = torch.empty(rows, n)
    lib.kiln_softcap_f32(x.data_ptr(), x.stride(0), a.cap, out.data_ptr(), rows, n, _threads())
    return out


@_native("rope")
def rope(
    x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: Rope, lib: ctypes.CDLL
) -> torch.Tensor:
    return _rope(x, cos_sin, a.head_dim, 0, lib)


def _rope(
    x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], head_dim: int, heads: int, lib: Any
) -> torch.Tensor:
    """Every head of x's rows, or the first `heads` of each row."""
    x = _rows(x, "rope input")
    cos, sin = (t.contiguous() for t in cos_sin)
    tokens = x.shape[0]
    if cos.shape[-1] != head_dim or cos.dtype != torch.float32:
        raise KernelError(f"rope: tables of {cos.shape[-1]} {cos.dtype}, head_dim {head_dim}")
    heads = heads or x.shape[1] // head_dim
    out = torch.empty(tokens, heads * head_dim)
    lib.kiln_rope_f32(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        tokens,
        heads,
        head_dim,
        _threads(),
    )
    return out


@_native("rope_qkv")
def rope_qkv(
    qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], *, a: RopeQKV, lib: ctypes.CDLL
) -> tuple[torch.Tensor, ...]:
    """One rotary call over the q and k heads of a fused projection's rows; v stays a view."""
    nq, nk, _ = a.sizes
    qk = _rope(qkv, cos_sin, a.head_dim, (nq + nk) // a.head_dim, lib)
    return qk[:, :nq], qk[:, nq:], qkv[:, nq + nk :]


@_native("attention", phases=("decode",))
def attention(
    ctx: AttentionBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *sinks: torch.Tensor,
    a: Attention,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """A decode step: each sequence's new K/V written, then its one new token attending to
    the paged pool in place, through the page table. Decode only: prefill steps are
    compute-bound, where aten's SDPA is already good, and run the prefill kernel the graph
    records (select_backends)."""
    layer, kv, d = a.layer, a.num_kv_heads, a.head_dim
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    if not ctx.decode or ctx.kv_index is None:
        raise KernelError("kiln_cpu attention runs decode steps only (the graph says so)")
    if d % 8:
        raise KernelError(f"kiln_cpu attention: head_dim {d} is not a multiple of 8")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelError("kiln_cpu attention: the KV pool must be contiguous")
    q, k, v = (_rows(t, "attention input") for t in (q, k, v))
    if is_fp8(k_cache.dtype):
        write_kv(ctx, layer, k, v, kv, d, a.kv_scale)
    else:
        lib.kiln_kv_write_f32(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            ctx.out_slots.data_ptr(),
            q.shape[0],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.shape[1],
            kv,
            d,
        )
    return _decode(lib, ctx, q, a, sinks[0] if sinks else None)


# Sinks never reach it: passes/fuse_rope.py leaves an attention with sinks unfused.
@_native("rope_attention", phases=("decode",), unsupported=("sinks",))
def rope_attention(
    ctx: AttentionBatch,
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, ...],
    *,
    a: Attention,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """rope_qkv then attention on a decode step: on an fp32 pool one C call (rotary, the
    KV write and paged attention); on an fp8 pool this backend's rope_qkv and attention."""
    if ctx.k_cache.dtype != torch.float32:
        two = (functools.partial(rope_qkv, lib=lib), functools.partial(attention, lib=lib))
        return rope_then_attend(*two, ctx, qkv, cos_sin, a)
    heads, head_dim = a.num_heads, a.head_dim
    qkv = _rows(qkv, "rope_attention input")
    cos, sin = (t.contiguous() for t in cos_sin)
    if cos.shape[-1] != head_dim or cos.dtype != torch.float32 or head_dim % 8:
        raise KernelError(f"rope_attention: tables of {cos.shape[-1]}, head_dim {head_dim}")
    rows = qkv.shape[0]
    out = torch.empty(rows, heads * head_dim)
    rc = lib.kiln_rope_decode_attention_f32(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        ctx.out_slots.data_ptr(),
        *_paged_pool(ctx, a.layer),
        out.data_ptr(),
        rows,
        heads,
        a.num_kv_heads,
        head_dim,
        ctx.page_size,
        a.sliding_window or 0,
        a.scale,
        a.softcap,
        None,
        _threads(),
        a.deterministic,
    )
    if rc != 0:
        raise MemoryError("kiln_cpu decode attention: out of memory for its scratch rows")
    return out


def _decode(
    lib: ctypes.CDLL,
    ctx: AttentionBatch,
    q: torch.Tensor,
    a: Attention,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row of q, each attending to its sequence in `ctx`'s page table."""
    pool = ctx.k_cache  # [layers, kv_heads, slots, head_dim]; _paged_pool finds the layer
    rows, head_dim = q.shape[0], pool.shape[3]
    out = torch.empty(rows, a.num_heads * head_dim)
    if sinks is not None:
        sinks = sinks.float().contiguous()
        if sinks.shape != (a.num_heads,):
            raise KernelError(
                f"kiln_cpu attention: {tuple(sinks.shape)} sinks, {a.num_heads} heads"
            )
    rc = lib.kiln_decode_attention(
        q.data_ptr(),
        q.stride(0),
        *_paged_pool(ctx, a.layer),
        out.data_ptr(),
        rows,
        a.num_heads,
        a.num_kv_heads,
        head_dim,
        ctx.page_size,
        a.sliding_window or 0,
        a.scale,
        native.KV_FORMATS[str(pool.dtype).removeprefix("torch.")],
        a.kv_scale,
        a.softcap,
        None if sinks is None else sinks.data_ptr(),
        _threads(),
        a.deterministic,
    )
    if rc == -2:
        raise KernelError(f"kiln_cpu decode attention: no kernel for a {pool.dtype} pool")
    if rc != 0:
        raise MemoryError("kiln_cpu decode attention: out of memory for its scratch rows")
    return out


def _paged_pool(ctx: AttentionBatch, layer: int) -> tuple[int | None, ...]:
    """The decode kernels' pool arguments for one layer: K and V pools, slots per head,
    the page table, pages per row of it, each row's KV length, and which table each row
    reads (None: a table a row)."""
    assert ctx.kv_index is not None and ctx.kv_lens is not None
    k_cache, v_cache = ctx.k_cache, ctx.v_cache
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelError("kiln_cpu attention: the KV pool must be contiguous")
    if not 0 <= layer < k_cache.shape[0]:
        raise KernelError(f"kiln_cpu attention: layer {layer} of {k_cache.shape[0]}")
    # The layer's pools by address arithmetic: indexing the [layers, ...] tensors would make
    # two views a call (~10 us of a ~40 us call on a slow CPU, 30 calls a decode step).
    layer_bytes = k_cache.stride(0) * k_cache.element_size()
    return (
        k_cache.data_ptr() + layer * layer_bytes,
        v_cache.data_ptr() + layer * layer_bytes,
        k_cache.shape[2],
        ctx.kv_index.data_ptr(),
        ctx.kv_width // ctx.page_size,
        ctx.kv_lens.data_ptr(),
        None,
    )


# A linear's prologue attr -> the C kernels' PROLOGUE_* (kernels/csrc/cpu_kernels.c).
_PROLOGUES = {"none": 0, "silu_and_mul": 1}


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as the C kernels read it: fp32, 2-D, unit stride along the row (a column slice of
    a wider row is read in place, its row stride passed on)."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise KernelError(f"kiln_cpu {what}: expected 2-D float32, got {x.dim()}-D {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def _threads() -> int:
    return torch.get_num_threads()
