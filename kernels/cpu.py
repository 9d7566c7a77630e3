"""kiln_cpu: hand-written fp32 CPU kernels (csrc/cpu_kernels.c), built for this machine.

What they replace, per batch-16 decode step of SmolLM2-135M on the CI machine kind (2
cores), torch profiler: paged decode attention gathered every sequence's K/V pages into a padded
batch (index_select, ~20 ms) and then ran SDPA on it (~11 ms); the C kernel reads K/V in
place through the page table. RMSNorm, SiLU-and-mul and rope were 4-6 small aten ops each.
The linear for decode batches streams weights repacked into column blocks, prefetched
ahead, where oneDNN and MKL reached 50-70% of the memory bandwidth.
Figures: benchmarks/RESULTS.md.

The library is compiled on first use with the system C compiler (`$CC`, else `cc`) and
`-O3 -march=native -fopenmp` (fused multiply-adds on), and cached under the kiln cache
folder, keyed by the source, the flags, the compiler and the CPU. Without a compiler the
kernels fall back to the torch_native ones, with one warning, so an artefact still runs
anywhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.kernels import onednn, torch_native
from kiln.kernels.attention import AttentionBatch, attend_one
from kiln.kernels.attention import attention as torch_attention
from kiln.kernels.packed import PackedWeights
from kiln.kernels.registry import register
from kiln.paths import cache_dir

log = logging.getLogger("kiln.kernels")

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# -ffp-contract=fast: ISO C mode (-std=c11) otherwise keeps a * b + c as two roundings and
# two instructions; fused multiply-adds are what the dot products want.
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# Ops this backend implements; select_backends takes it for these on fp32 CPU graphs.
OPS = ("linear", "rmsnorm", "add_rmsnorm", "silu_and_mul", "rope", "attention")
# Rows up to which `linear` runs the packed small-M kernel, by its tile height (16 rows
# where AVX-512 gives 32 vector registers, 8 otherwise); above, oneDNN (where it exists,
# else MKL's GEMM on the plain weight). Measured on every linear of a SmolLM2-135M pass
# (benchmarks/RESULTS.md): the 16-row build matches or beats oneDNN up to 64-96 rows (37
# against 55 ms at 16 rows); the 8-row build, run on the same AVX-512 machine against
# oneDNN's AVX-512 code, wins up to 8 rows (31 against 43 ms) and loses from 16.
LINEAR_MAX_ROWS = {16: 64, 8: 8}

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "kiln_rmsnorm_f32": (None, [_P, _I64, _I64, _P, _P, _I64, _I64, _F32, _INT]),
    "kiln_add_rmsnorm_f32": (None, [_P, _P, _P, _P, _P, _I64, _I64, _F32, _INT]),
    "kiln_silu_and_mul_f32": (None, [_P, _P, _I64, _I64, _INT]),
    "kiln_rope_f32": (None, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "kiln_kv_write_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64]),
    "kiln_linear_lanes": (_I64, []),
    "kiln_linear_tile_rows": (_I64, []),
    "kiln_pack_linear_f32": (None, [_P, _I64, _I64, _P, _INT]),
    "kiln_linear_f32": (_INT, [_P, _I64, _I64, _P, _I64, _P, _P, _INT]),
    "kiln_decode_attention_f32": (
        _INT,
        [_P, _I64, _P, _P, _I64, _P, _I64, _P, _P] + [_I64] * 5 + [_I64, _F32, _INT],
    ),
}


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(out_dir: Path | None = None, march: str = "native") -> Path:
    """Compile the kernels for this machine (or find them built) and return the library.
    `march` other than native builds for another CPU level (tests use the x86-64 baseline
    to run the code paths that have no AVX)."""
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelBuildError(f"no working C compiler ({cc!r}: {e})") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256()
    flags = (*FLAGS, f"-march={march}")
    for part in (source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()):
        key.update(part)
    out_dir = out_dir or cache_dir() / "kernels"
    lib = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    command = [cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"]  # libraries after the source
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = done.stderr.strip().splitlines()[-3:]
        raise KernelBuildError(f"{cc} failed on {SOURCE.name}: {' / '.join(tail)}")
    os.replace(tmp, lib)  # atomic: concurrent builders (TP ranks) never load a partial file
    return lib


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (with one warning) where it cannot be built."""
    try:
        return load(build())
    except (KernelBuildError, OSError) as e:
        log.warning("kiln_cpu kernels unavailable, using torch_native instead: %s", e)
        return None


def available() -> bool:
    return library() is not None


@functools.cache
def _linear_shape() -> tuple[int, int]:
    """(lanes of a packed column block, most rows the packed kernel takes) of this build."""
    lib = library()
    assert lib is not None
    return lib.kiln_linear_lanes(), LINEAR_MAX_ROWS[lib.kiln_linear_tile_rows()]


def _pack_linear(weight: torch.Tensor) -> torch.Tensor:
    lib = library()
    assert lib is not None
    n, k = weight.shape
    lanes = _linear_shape()[0]
    packed = torch.empty(-(-n // lanes) * k * lanes)
    lib.kiln_pack_linear_f32(weight.data_ptr(), n, k, packed.data_ptr(), _threads())
    return packed


_packed = PackedWeights(_pack_linear)


@register("linear", backend="kiln_cpu", devices=("cpu",))
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    lib = library()
    dense = _dense(x) and _dense(weight) and (bias is None or _dense(bias, dims=1))
    if lib is None or not dense or x.shape[0] > _linear_shape()[1]:
        return onednn.linear(x, weight, bias) if onednn.available() else F.linear(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n)
    rc = lib.kiln_linear_f32(
        x.data_ptr(),
        m,
        k,
        _packed.get(weight).data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        _threads(),
    )
    if rc != 0:
        raise MemoryError(f"kiln_cpu linear: no memory for a {m} x {k} copy of its input")
    return out


def _rows(x: torch.Tensor) -> bool:
    """fp32, 2-D, unit stride along the row: what the C kernels read."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


@register("rmsnorm", backend="kiln_cpu", devices=("cpu",))
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 0) -> torch.Tensor:
    """`group`: normalise every `group` features on their own (Qwen3's per-head q/k norm)."""
    lib = library()
    n = group or x.shape[-1]
    if lib is None or not _rows(x) or not _dense(weight, dims=1) or x.shape[1] % n:
        return torch_native.rmsnorm(x, weight, eps, group)
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
        eps,
        _threads(),
    )
    return out


@register("add_rmsnorm", backend="kiln_cpu", devices=("cpu",))
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    dense = _dense(x) and _dense(residual) and _dense(weight, dims=1)
    if lib is None or not dense or x.shape != residual.shape:
        return torch_native.add_rmsnorm(x, residual, weight, eps)
    rows, n = x.shape
    out, total = torch.empty(rows, n), torch.empty(rows, n)
    lib.kiln_add_rmsnorm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        total.data_ptr(),
        rows,
        n,
        eps,
        _threads(),
    )
    return out, total


@register("silu_and_mul", backend="kiln_cpu", devices=("cpu",))
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = library()
    if lib is None or not _dense(x):
        return torch_native.silu_and_mul(x)
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d)
    lib.kiln_silu_and_mul_f32(x.data_ptr(), out.data_ptr(), rows, d, _threads())
    return out


@register("rope", backend="kiln_cpu", devices=("cpu",))
def rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], head_dim: int) -> torch.Tensor:
    lib = library()
    cos, sin = cos_sin
    tokens = x.shape[0]
    tables_ok = all(t.dtype == torch.float32 and t.is_contiguous() for t in cos_sin)
    if lib is None or not _rows(x) or cos.shape[-1] != head_dim or not tables_ok:
        return torch_native.rope(x, cos_sin, head_dim)
    heads = x.shape[1] // head_dim
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


@register("attention", backend="kiln_cpu", devices=("cpu",), needs_ctx=True)
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
    """Single-token rows (all of a decode step, the decoding requests of a mixed chunk) run
    the C kernel on the paged pool; multi-token rows keep SDPA (compute-bound, where aten's
    flash kernel is already good)."""
    lib = library()
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    cache_ok = _dense(k_cache, dims=3) and _dense(v_cache, dims=3)
    shaped = cache_ok and head_dim % 8 == 0 and all(map(_rows, (q, k, v)))
    if lib is None or ctx.kv_index is None or not shaped:
        return torch_attention(
            ctx,
            q,
            k,
            v,
            layer=layer,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=scale,
            sliding_window=sliding_window,
        )
    slots = k_cache.shape[1]
    lib.kiln_kv_write_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        ctx.out_slots.data_ptr(),
        q.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots,
        num_kv_heads,
        head_dim,
    )
    if ctx.decode:
        return _decode(
            lib, ctx, q, k_cache, v_cache, num_heads, num_kv_heads, sliding_window, scale
        )
    # Mixed batch: the single-token rows together in C, the others one by one in SDPA.
    assert ctx.single_rows is not None
    out = torch.empty(q.shape[0], num_heads * head_dim)
    single = _decode(
        lib,
        ctx,
        q.index_select(0, ctx.single_rows),
        k_cache,
        v_cache,
        num_heads,
        num_kv_heads,
        sliding_window,
        scale,
    )
    out.index_copy_(0, ctx.single_rows, single)
    skip = set(ctx.single_seqs)
    for i, s in enumerate(ctx.seqs):
        if i not in skip:
            out[s.q_start : s.q_start + s.q_len] = attend_one(
                ctx, s, q, k, v, layer, num_heads, num_kv_heads, head_dim, scale, sliding_window
            )
    return out


def _decode(
    lib: ctypes.CDLL,
    ctx: AttentionBatch,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """One new token per row of q, each attending to its sequence in `ctx`'s page table."""
    assert ctx.kv_index is not None and ctx.kv_lens is not None
    rows, head_dim = q.shape[0], k_cache.shape[2]
    out = torch.empty(rows, num_heads * head_dim)
    rc = lib.kiln_decode_attention_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        ctx.kv_index.data_ptr(),
        ctx.kv_width // ctx.page_size,
        ctx.kv_lens.data_ptr(),
        out.data_ptr(),
        rows,
        num_heads,
        num_kv_heads,
        head_dim,
        ctx.page_size,
        window or 0,
        scale,
        _threads(),
    )
    if rc != 0:
        raise MemoryError("kiln_cpu decode attention: out of memory for its scratch rows")
    return out


def _dense(x: torch.Tensor, dims: int = 2) -> bool:
    return x.dtype == torch.float32 and x.dim() == dims and x.is_contiguous()


def _threads() -> int:
    return torch.get_num_threads()
