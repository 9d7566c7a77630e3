"""The CUDA target's Triton kernels against torch_native, run by Triton's interpreter on the
CPU (TRITON_INTERPRET=1): odd head dims, GQA, page sizes 1 and 16, sliding windows, and
prefill, extend, mixed and decode steps through the same paged attention program.
KILN_TRITON_DEVICE=cuda runs the same tests compiled for a GPU (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from kiln.core.opdef import with_attrs
from kiln.core.ops.rope import Tables
from kiln.kernels import catalog
from kiln.runtime.step import StepContext, StepInputs

DEVICE = os.environ.get("KILN_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    # Read when kiln.kernels.triton_jit is first imported, on a kernel's first call.
    os.environ["TRITON_INTERPRET"] = "1"

torch.manual_seed(0)
randn = functools.partial(torch.randn, device=DEVICE)
zeros = functools.partial(torch.zeros, device=DEVICE)
arange = functools.partial(torch.arange, device=DEVICE)


def kernel(op: str, backend: str):
    k = catalog.get(op, backend)
    return with_attrs(k.op, k.fn)


def both(op: str):
    return kernel(op, "triton"), kernel(op, "torch_native")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 100])
def test_norms_and_silu(dtype: torch.dtype, hidden: int) -> None:
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    x = randn(7, hidden, dtype=dtype)
    r = randn(7, hidden, dtype=dtype)
    w = randn(hidden, dtype=dtype)
    tri, ref = both("rmsnorm")
    torch.testing.assert_close(tri(x, w, 1e-6), ref(x, w, 1e-6), **tol)
    grouped = randn(3, 4 * 24, dtype=dtype)
    gw = randn(24, dtype=dtype)
    torch.testing.assert_close(tri(grouped, gw, 1e-6, 24), ref(grouped, gw, 1e-6, 24), **tol)
    tri, ref = both("add_rmsnorm")
    for got, want in zip(tri(x, r, w, 1e-5), ref(x, r, w, 1e-5), strict=True):
        torch.testing.assert_close(got, want, **tol)
    tri, ref = both("silu_and_mul")
    wide = randn(5, 2 * hidden, dtype=dtype)
    torch.testing.assert_close(tri(wide), ref(wide), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_invariant_linear(dtype: torch.dtype) -> None:
    """--enable-deterministic-inference's linear: F.linear's values (K not a whole tile, N
    and M not whole tiles, with and without a bias), and each row bitwise the same alone,
    in a few rows and in a batch past one 64-row tile, where cuBLAS may pick other tiles."""
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    x = randn(70, 200, dtype=dtype)
    w = randn(90, 200, dtype=dtype)
    b = randn(90, dtype=dtype)
    tri, ref = both("linear")
    full = tri(x, w, b)
    torch.testing.assert_close(full, ref(x, w, b), **tol)
    torch.testing.assert_close(tri(x, w), ref(x, w), **tol)
    # A GPU's tensor cores give an output the same sum wherever its row sits in a tile; the
    # interpreter's tile products are numpy's BLAS, whose last rows of a 64-row tile take
    # another micro-kernel, so on the CPU rows are compared at the places BLAS treats alike.
    rows = (0, 5, 60, 63, 64, 69) if DEVICE == "cuda" else (0, 5, 64, 69)
    for i in rows:
        assert torch.equal(tri(x[i : i + 1], w, b), full[i : i + 1])
    assert torch.equal(tri(x[64:70], w, b), full[64:70])
    if DEVICE == "cuda":
        assert torch.equal(tri(x[60:67], w, b), full[60:67])
    assert torch.equal(tri(x.view(7, 10, 200), w, b), full.view(7, 10, 90))


@pytest.mark.parametrize("head_dim", [24, 64])
def test_rope_qkv_on_a_fused_projection(head_dim: int) -> None:
    """q and k columns of [q | k | v] rotated, v passed through, from strided rows."""
    heads, kv_heads, tokens = 4, 2, 6
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = randn(tokens, sum(sizes))
    inv_freq = 1.0 / (10000 ** (arange(0, head_dim, 2).float() / head_dim))
    tables = catalog.get("rope_cos_sin", "torch_native").fn
    cos_sin = tables(arange(3, 9), inv_freq, a=Tables())
    tri, ref = both("rope_qkv")
    got_all, want_all = tri(qkv, cos_sin, head_dim, sizes), ref(qkv, cos_sin, head_dim, sizes)
    for got, want in zip(got_all, want_all, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _attend(backend: str, step: StepInputs, pools, q, k, v, attrs) -> torch.Tensor:
    k_cache, v_cache, page = pools
    ctx = StepContext(k_cache, v_cache, page).plan(step)[0]
    return kernel("attention", backend)(ctx, q, k, v, **attrs)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [4, 14])
def test_paged_attention_prefill_extend_mixed_decode(
    page: int, head_dim: int, window: int | None, heads: int
) -> None:
    """Against torch_native, two KV heads shared by groups of 2 or 7 query heads (a
    program's rows are (query, head) pairs: 7 does not divide its 16 rows)."""
    _check_paged_attention(page, head_dim, window, heads, torch.float32)


@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_in_bf16(head_dim: int, window: int | None) -> None:
    """A bf16 model's queries and pool: on a GPU its products run on the tensor cores
    (bf16 inputs, fp32 sums), under the interpreter as fp32 FMAs."""
    _check_paged_attention(16, head_dim, window, 14, torch.bfloat16)


def _check_paged_attention(
    page: int, head_dim: int, window: int | None, heads: int, dtype: torch.dtype
) -> None:
    kv_heads, layers = 2, 2
    pages = 64 // page + 1
    shape = (layers, kv_heads, pages * page, head_dim)
    pools = {
        b: (zeros(shape, dtype=dtype), zeros(shape, dtype=dtype), page)
        for b in ("triton", "torch_native")
    }
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    attrs = {
        "layer": 1,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "scale": head_dim**-0.5,
        "sliding_window": window,
    }
    # Three sequences' page lists (sequence i: pages spread over the pool).
    need = [-(-30 // page)] * 3
    owned = [list(range(i, pages - 1, 3))[: need[i]] for i in range(3)]
    cached = [0, 0, 0]

    def step(new: list[int]) -> StepInputs:
        ids, pos, q_lens, kv_lens, counts, flat = [], [], [], [], [], []
        for i, n in enumerate(new):
            if not n:
                continue
            ids += [0] * n
            pos += range(cached[i], cached[i] + n)
            q_lens.append(n)
            kv_lens.append(cached[i] + n)
            counts.append(len(owned[i]))
            flat += owned[i]
        return StepInputs(ids, pos, [], q_lens, kv_lens, counts, flat)

    # prefill two, then extend one beside decoding the other with a third's prefill,
    # then decode all three
    for new in ([9, 13, 0], [1, 6, 11], [1, 1, 1], [1, 1, 1]):
        s = step(new)
        t = len(s.ids)
        q = randn(t, heads * head_dim, dtype=dtype)
        k = randn(t, kv_heads * head_dim, dtype=dtype)
        v = randn(t, kv_heads * head_dim, dtype=dtype)
        got = _attend("triton", s, pools["triton"], q, k, v, attrs)
        want = _attend("torch_native", s, pools["torch_native"], q, k, v, attrs)
        torch.testing.assert_close(got, want, **tol)
        for i, n in enumerate(new):
            cached[i] += n
    # The K/V both wrote are the same.
    assert torch.equal(pools["triton"][0], pools["torch_native"][0])


def test_a_cuda_artefact_runs_them(artefact) -> None:
    """Compiled for CUDA on this CPU machine: the ops with a triton kernel take it."""
    from kiln.core.graph_json import load_graph

    art = artefact("llama", compile_args={"device": "cuda", "target_isa": "sm_90"})
    graph = load_graph((art / "graph.json").read_text())
    backends = {n.op: n.meta.get("backend") for n in graph.nodes if "backend" in n.meta}
    for op in ("rope_attention", "add_rmsnorm", "rmsnorm"):
        assert backends[op] == "triton", backends
    assert backends["linear"] == "torch_native"  # cuBLAS: the Triton linear is slower


def test_a_deterministic_cuda_artefact_takes_batch_invariant_kernels(artefact) -> None:
    """--enable-deterministic-inference on CUDA: the linears (the LM head's too) take the
    Triton linear in place of cuBLAS, and every other node a batch-invariant kernel."""
    from kiln.core.graph_json import load_graph

    flags = {"device": "cuda", "target_isa": "sm_90", "enable_deterministic_inference": True}
    graph = load_graph((artefact("llama", compile_args=flags) / "graph.json").read_text())
    picked = [(n.op, n.meta["backend"]) for n in graph.nodes if "backend" in n.meta]
    assert ("linear", "triton") in picked and ("linear", "torch_native") not in picked
    assert all(catalog.get(op, backend).batch_invariant for op, backend in picked), picked
    # the Triton attention keeps one tile for prompts and decode steps alike
    assert all(n.attrs["deterministic"] for n in graph.nodes if n.op == "rope_attention")
