"""Kernels against plain-torch / transformers references: the reference kernels
(torch_native) and kiln's C kernels (kiln_cpu) answer the same tests, the C kernels in every
build this CPU can run (the x86-64 baseline, AVX2 = x86-64-v3, AVX-512 = x86-64-v4), not
only the one for this host."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from native_libs import HOST_LEVELS, library

from kiln.core.layout import pack_panels, pack_qpanels, panels_name, unpack_codes
from kiln.core.opdef import with_attrs
from kiln.core.ops.attention import AttentionBatch, SeqSpan, to_pool
from kiln.core.quant import (
    FORMATS,
    dequantize,
    quantize,
    quantize_activations,
    quantize_group_activations,
)
from kiln.kernels import catalog


def k(op: str, backend: str = "torch_native"):
    """The kernel, called as the tests write it: tensors, then the op's attributes by
    position or name (`rmsnorm(x, w, 1e-6, group=8)`), which become its attribute object;
    `kiln_cpu/<level>` binds the C library built for that level."""
    name, _, level = backend.partition("/")
    kernel = catalog.get(op, name)
    fn = functools.partial(kernel.fn, lib=library(level)) if level else kernel.fn
    return with_attrs(kernel.op, fn)


def for_step(op: str, backend: str, batch: AttentionBatch):
    """The kernel a step runs: an attention backend covers only the phases it registered
    (kiln_cpu's, decode steps); other steps run the reference, as select_backends records."""
    phase = "decode" if batch.decode else "prefill"
    return k(
        op, backend if phase in catalog.get(op, backend.split("/")[0]).phases else "torch_native"
    )


# Backends of the ops both implement; kiln_cpu must really run here (CI has a C compiler).
NATIVE = [f"kiln_cpu/{level}" for level in HOST_LEVELS]
BOTH = pytest.mark.parametrize("backend", ["torch_native", *NATIVE])


@BOTH
def test_rmsnorm_grouped_equals_per_head_norm(backend: str) -> None:
    x, w = torch.randn(5, 4 * 8), torch.randn(8)
    ref = torch.stack([F.rms_norm(h, (8,), w, 1e-6) for h in x.view(5, 4, 8).unbind(1)], 1)
    torch.testing.assert_close(k("rmsnorm", backend)(x, w, 1e-6, group=8), ref.reshape(5, 32))
    # A strided view (q of the fused QKV row) is normalised the same way.
    wide = torch.randn(5, 6 * 8)
    wide[:, :32] = x
    torch.testing.assert_close(
        k("rmsnorm", backend)(wide[:, :32], w, 1e-6, group=8), ref.reshape(5, 32)
    )


@BOTH
@pytest.mark.parametrize("rows", [3, 160])  # 160 x 576: the C kernels' threaded path
def test_rmsnorm_and_add_rmsnorm(backend: str, rows: int) -> None:
    n = 16 if rows == 3 else 576
    a, b, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    torch.testing.assert_close(k("rmsnorm", backend)(a, w, 1e-5), F.rms_norm(a, (n,), w, 1e-5))
    normed, total = k("add_rmsnorm", backend)(a, b, w, 1e-5)
    torch.testing.assert_close(total, a + b)
    torch.testing.assert_close(normed, F.rms_norm(a + b, (n,), w, 1e-5))


@BOTH
@pytest.mark.parametrize("rows", [3, 160])
def test_layernorm_with_and_without_bias(backend: str, rows: int) -> None:
    n = 16 if rows == 3 else 576
    wide = torch.randn(rows, n + 8)  # read in place from wider rows
    x, w, b = wide[:, 4 : 4 + n], torch.randn(n), torch.randn(n)
    got = k("layernorm", backend)(x, w, b, 1e-5)
    torch.testing.assert_close(got, F.layer_norm(x, (n,), w, b, 1e-5))
    torch.testing.assert_close(
        k("layernorm", backend)(x, w, None, 1e-5), F.layer_norm(x, (n,), w, None, 1e-5)
    )
    # rows far from zero mean, against float64: a variance taken as E[x^2] - E[x]^2 in
    # float32 would lose them (torch's own float32 kernel is within 4e-5 here)
    far = x + 100.0
    ref = F.layer_norm(far.double(), (n,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(
        k("layernorm", backend)(far, w, b, 1e-5).double(), ref, atol=1e-4, rtol=0
    )


@BOTH
def test_layernorm_grouped_equals_per_head_layernorms(backend: str) -> None:
    """Per-head q/k LayerNorms: every head's weight and bias alike (Phi's) or a weight and
    bias for each head (Cohere's, StableLM's), over q's columns of a wider fused row."""
    heads, d = 4, 8
    wide = torch.randn(5, 6 * d) + 3.0
    x = wide[:, : heads * d]
    per_head = x.reshape(5, heads, d).unbind(1)
    shared, shared_b = torch.randn(d), torch.randn(d)
    ref = torch.stack([F.layer_norm(h, (d,), shared, shared_b, 1e-5) for h in per_head], 1)
    got = k("layernorm", backend)(x, shared, shared_b, 1e-5, group=d)
    torch.testing.assert_close(got, ref.reshape(5, heads * d))
    w, b = torch.randn(heads, d), torch.randn(heads, d)
    for bias in (b, None):
        ref = torch.stack(
            [
                F.layer_norm(h, (d,), w[i], None if bias is None else bias[i], 1e-5)
                for i, h in enumerate(per_head)
            ],
            1,
        )
        flat_b = None if bias is None else bias.reshape(-1)
        got = k("layernorm", backend)(x, w.reshape(-1), flat_b, 1e-5, group=d)
        torch.testing.assert_close(got, ref.reshape(5, heads * d))


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 13, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_both_micro_kernels(backend: str, rows: int, with_bias: bool) -> None:
    # 1000 outputs: the last panel and the last group are partial; rows across the tiles'
    # edges of both micro-kernels (narrow_rows [0, 0]: all wide; [1, 128]: all narrow); no
    # rows at all (the logits of a prompt chunk that samples nothing)
    lib = library(backend.partition("/")[2])
    lanes, group = lib.kiln_linear_lanes(), lib.kiln_linear_group_panels()
    x, w = torch.randn(rows, 96), torch.randn(1000, 96)
    b = torch.randn(1000) if with_bias else None
    packed = pack_panels(w, panels_name(lanes, group))
    assert packed.shape == (-(-1000 // (lanes * group)) * group, 96, lanes)
    for narrow in ([0, 0], [1, 128]):
        out = k("packed_linear", backend)(x, packed, b, out_features=1000, narrow_rows=narrow)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    # x read in place from a wider row (a split's view)
    wide = torch.randn(rows, 128)
    wide[:, :96] = x
    out = k("packed_linear", backend)(
        wide[:, :96], packed, b, out_features=1000, narrow_rows=[2, 4]
    )
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    # prologue silu_and_mul: the [gate | up] rows in, the activation taken in the call
    gate_up = torch.randn(rows, 2 * 96) * 3
    out = k("packed_linear", backend)(
        gate_up, packed, b, out_features=1000, narrow_rows=[2, 4], prologue="silu_and_mul"
    )
    ref = F.linear(F.silu(gate_up[:, :96]) * gate_up[:, 96:], w, b)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", NATIVE)
def test_packed_embedding_reads_the_tied_panels(backend: str) -> None:
    lib = library(backend.partition("/")[2])
    table = torch.randn(100, 24)
    packed = pack_panels(
        table, panels_name(lib.kiln_linear_lanes(), lib.kiln_linear_group_panels())
    )
    ids = torch.tensor([0, 99, 17, 17, 64])
    torch.testing.assert_close(
        k("packed_embedding", backend)(ids, packed), table[ids], rtol=0, atol=0
    )
    with pytest.raises(RuntimeError, match="outside"):
        k("packed_embedding", backend)(torch.tensor([3, 10**6]), packed)


def _lanes(backend: str) -> int:
    level = backend.partition("/")[2]
    return int(library(level).kiln_linear_lanes()) if level else 16


def _stored(w: torch.Tensor, fmt: str, group: int, backend: str) -> tuple[torch.Tensor, ...]:
    """(codes, scales, stored codes, stored scales) of `w` quantized as the artefact holds
    them for `backend`'s vector width."""
    lanes = _lanes(backend)
    q, s = quantize(w, fmt, group)
    codes = pack_qpanels(q, f"{FORMATS[fmt].layout}panels{lanes}")
    stored = s.to(getattr(torch, FORMATS[fmt].scale_dtype))  # float16 for the *h formats
    return q, s, codes, pack_qpanels(stored, f"spanels{lanes}")


QUANT_CASES = [
    ("int8", 32),
    ("int8", 96),
    ("uint4", 32),
    ("uint4", 48),
    ("fp8_e4m3", 96),
    ("int8m", 32),
    ("int5", 32),  # GGUF Q5_0
    ("uint5", 32),  # GGUF Q5_1
    ("uint5", 48),
    ("int8h", 32),  # GGUF Q8_0 as stored: float16 scales
    ("uint4h", 32),  # Q4_0 / Q4_1
    ("int5h", 32),  # Q5_0
    ("uint5h", 32),  # Q5_1
    ("int8mh", 32),  # Q8_0 and Q5_1 parts of one fused weight
]


@BOTH
@pytest.mark.parametrize(("fmt", "group"), QUANT_CASES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 8, 17, 40])
def test_quant_linear_matches_its_dequantized_weight(
    backend: str, fmt: str, group: int, rows: int
) -> None:
    # 1000 outputs: a partial last panel; rows across the tile edges (the decode tile's 1 to
    # 6 rows, each its own x stride, the prompt tiles' 4 or 6, the copies' 8 or 16). Sums of
    # 96 O(1) products in another order than F.linear's: 2e-4 absolute (an output that
    # cancels to near 0 was seen 1.1e-4 away).
    torch.manual_seed(rows * 1000 + group)
    x, w, b = torch.randn(rows, 96), torch.randn(1000, 96), torch.randn(1000)
    q, s, codes, scales = _stored(w, fmt, group, backend)
    ref = F.linear(x, dequantize(q, s, fmt), b)
    kw = {"format": fmt, "group": group, "out_features": 1000}
    torch.testing.assert_close(
        k("quant_linear", backend)(x, codes, scales, b, **kw), ref, atol=2e-4, rtol=1e-4
    )
    # x read in place from a wider row, no bias
    wide = torch.randn(rows, 128)
    wide[:, :96] = x
    out = k("quant_linear", backend)(wide[:, :96], codes, scales, **kw)
    torch.testing.assert_close(out, ref - b, atol=2e-4, rtol=1e-4)
    # prologue silu_and_mul, from a wider row: silu(gate) * up is the linear's input
    gate_up = torch.randn(rows, 256) * 3
    h = F.silu(gate_up[:, :96]) * gate_up[:, 96:192]
    kw["prologue"] = "silu_and_mul"
    out = k("quant_linear", backend)(gate_up[:, :192], codes, scales, b, **kw)
    torch.testing.assert_close(out, F.linear(h, dequantize(q, s, fmt), b), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", NATIVE)
def test_prompt_linears_split_rows_where_column_groups_share_out_unevenly(backend: str) -> None:
    # 150 outputs: 3 column groups at 16 lanes, 7 at 8 lanes, both odd: on 2 threads each
    # group's 100 rows are split in two parts (runs whose sums must be the unsplit ones).
    # The quantized path splits from 48 rows a part.
    torch.manual_seed(5)
    x, w, b = torch.randn(100, 96), torch.randn(150, 96), torch.randn(150)
    lib = library(backend.partition("/")[2])
    packed = pack_panels(w, panels_name(lib.kiln_linear_lanes(), lib.kiln_linear_group_panels()))
    q, s, codes, scales = _stored(w, "uint4h", 32, backend)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = k("packed_linear", backend)(x, packed, b, out_features=150, narrow_rows=[0, 0])
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        kw = {"format": "uint4h", "group": 32, "out_features": 150}
        out = k("quant_linear", backend)(x, codes, scales, b, **kw)
        ref = F.linear(x, dequantize(q, s, "uint4h"), b)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def random_super_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Codes and scale records of a super-block format (GGUF K-quants: kiln cannot make
    them from floats) drawn at random over their whole ranges: (codes [n, k], records)."""
    form = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    top = {"uint4k": 16, "uint5k": 32, "int6k": 64}[fmt]
    q = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    blocks = k // 256
    halves = (torch.rand(n, blocks, form.planes, generator=gen) * 0.02).half()
    if form.has_min:
        halves[..., 1] = -halves[..., 1]  # -dmin, as GGUF's Q4_K / Q5_K are read
    lo, hi = (-128, 128) if fmt == "int6k" else (0, 64)
    ints = torch.randint(lo, hi, (n, blocks, form.record_bytes - 2 * form.planes), generator=gen)
    records = torch.cat([halves.view(torch.uint8), ints.to(torch.int8).view(torch.uint8)], -1)
    return q, records


SUPER_BLOCKS = pytest.mark.parametrize("fmt", ["uint4k", "uint5k", "int6k"])


@BOTH
@SUPER_BLOCKS
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 17])
def test_super_block_linear_matches_its_dequantized_weight(
    backend: str, fmt: str, rows: int
) -> None:
    """GGUF Q4_K / Q5_K / Q6_K as stored: the kernels compose each group's scale from the
    super-block's float16 and the group's integer, at decode and prefill widths; 200 outputs
    (a partial last panel), two super-blocks a row."""
    lanes, form = _lanes(backend), FORMATS[fmt]
    q, records = random_super_blocks(fmt, 200, 512, seed=rows)
    codes = pack_qpanels(q, f"{form.layout}panels{lanes}")
    scales = pack_qpanels(records, f"kpanels{lanes}")
    w = dequantize(q, records, fmt)
    torch.manual_seed(rows)
    x, b = torch.randn(rows, 512), torch.randn(200)
    kw = {"format": fmt, "group": form.gguf[0][1], "out_features": 200}
    out = k("quant_linear", backend)(x, codes, scales, b, **kw)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-4, rtol=1e-4)
    gate_up = torch.randn(rows, 1024)
    kw["prologue"] = "silu_and_mul"
    out = k("quant_linear", backend)(gate_up, codes, scales, **kw)
    h = F.silu(gate_up[:, :512]) * gate_up[:, 512:]
    torch.testing.assert_close(out, F.linear(h, w), atol=2e-4, rtol=1e-4)
    kw = {"format": fmt, "group": form.gguf[0][1], "num_embeddings": 200}
    ids = torch.tensor([0, 199, 17, 17, 64])
    got = k("quant_embedding", backend)(ids, codes, scales, **kw)
    torch.testing.assert_close(got, w[ids], rtol=0, atol=0)
    # --quantize-activations int8: the same codes in the int8 dot products' layout, the
    # same records; activations rounded per group as the reference rounds them
    a8 = FORMATS[f"{fmt}_a8"]
    codes = pack_qpanels(q, f"{a8.layout}panels{lanes}")
    group = form.gguf[0][1]
    kw = {"format": a8.name, "group": group, "out_features": 200}
    ref = (quantize_group_activations(x, group) @ w.double().T).float() + b
    got = k("quant_linear", backend)(x, codes, scales, b, **kw)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)
    assert (got - F.linear(x, w, b)).abs().max() > 0


@pytest.mark.parametrize(("layout", "top", "unit"), [("a5", 32, 32), ("a6", 64, 16)])
def test_top_bytes_round_trip_and_need_whole_units(layout: str, top: int, unit: int) -> None:
    """5- and 6-bit codes for int8 activations keep the bits above their nibbles in top
    bytes shared by 4 (5-bit) or 2 (6-bit) blocks of 8 k's: every code comes back from both
    lane widths, and an input count that is not whole units is refused when packing."""
    q = torch.randint(0, top, (37, 3 * unit), dtype=torch.uint8)
    for lanes in (8, 16):
        stored = pack_qpanels(q, f"{layout}panels{lanes}")
        assert torch.equal(unpack_codes(stored, layout, 37), q)
    with pytest.raises(ValueError, match=f"multiple of {unit}"):
        pack_qpanels(q[:, : unit + 8], f"{layout}panels8")


@BOTH
@SUPER_BLOCKS
def test_int8_activation_sums_at_their_bound_do_not_wrap(backend: str, fmt: str) -> None:
    """Without VNNI the maddubs pairs of 4-, 5- and 6-bit codes are summed in int16 over
    several blocks before they are widened: every code at its top and every activation at
    +-127 (a constant row) is the largest those sums get; a tile of 8 rows and one of 9
    (8 + 1) give the float64 reference's numbers, nothing wrapped or saturated."""
    lanes, form = _lanes(backend), FORMATS[fmt]
    q, records = random_super_blocks(fmt, 64, 512)
    q.fill_({"uint4k": 15, "uint5k": 31, "int6k": 63}[fmt])
    a8, group = FORMATS[f"{fmt}_a8"], form.gguf[0][1]
    codes = pack_qpanels(q, f"{a8.layout}panels{lanes}")
    scales = pack_qpanels(records, f"kpanels{lanes}")
    w = dequantize(q, records, fmt).double()
    x = torch.full((9, 512), 3.0)
    x[4:] = -3.0
    ref = (quantize_group_activations(x, group) @ w.T).float()
    kw = {"format": a8.name, "group": group, "out_features": 64}
    for rows in (8, 9):
        got = k("quant_linear", backend)(x[:rows], codes, scales, **kw)
        torch.testing.assert_close(got, ref[:rows], atol=2e-4, rtol=1e-5)


@BOTH
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
def test_w8a8_linear_sums_int8_activations_exactly(backend: str, rows: int) -> None:
    """Per-token int8 activations times per-row int8 weights, summed exactly, then both
    scales: every ISA level (VNNI or plain integer code) gives the same numbers."""
    x, w, b = torch.randn(rows, 96) * 3, torch.randn(1000, 96), torch.randn(1000)
    q, s, codes, scales = _stored(w, "w8a8_int8", 96, backend)
    xq, sx = quantize_activations(x)
    ref = (xq.double() @ q.double().T).float() * (sx * s[:, 0, 0]) + b
    kw = {"format": "w8a8_int8", "group": 96, "out_features": 1000}
    got = k("quant_linear", backend)(x, codes, scales, b, **kw)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    # and it is a quantization of the float product, not something else
    assert (got - F.linear(x, w, b)).abs().max() < 0.1 * F.linear(x, w).abs().max()
    # with the activation prologue: the same sums over silu(gate) * up
    gate_up = torch.randn(rows, 192) * 3
    xq, sx = quantize_activations(F.silu(gate_up[:, :96]) * gate_up[:, 96:])
    ref = (xq.double() @ q.double().T).float() * (sx * s[:, 0, 0]) + b
    got = k("quant_linear", backend)(gate_up, codes, scales, b, prologue="silu_and_mul", **kw)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)


GA8_CASES = [
    ("uint4_a8", 32),
    ("uint4_a8", 48),
    ("uint4_a8", 96),
    ("int8_a8", 32),
    ("int8_a8", 16),  # GGUF Q6_K's groups
    ("int8_a8", 12),
    ("int8h_a8", 32),  # GGUF Q8_0 as stored: float16 scales, no code-sum plane
    ("int8h_a8", 12),
    ("uint4h_a8", 32),  # GGUF Q4_0 / Q4_1 as stored: float16 scale and min
]
# int8-activation forms no embedding kernel reads (a table shared with the embedding keeps
# its stored format): GGUF Q5_0, Q5_1, and int8mh.
GA8_LINEAR_CASES = [
    ("int5h_a8", 32),
    ("uint5h_a8", 32),
    ("uint5h_a8", 48),
    ("int8mh_a8", 32),  # Q8_0 and Q5_1 parts of one fused weight
]


@BOTH
@pytest.mark.parametrize(("fmt", "group"), GA8_CASES + GA8_LINEAR_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_group_int8_activation_linear_sums_exactly(
    backend: str, fmt: str, group: int, rows: int
) -> None:
    """--quantize-activations int8: activations rounded to int8 per weight group, the
    group's products summed in int32, then the scales (and mins): every ISA level (VNNI or
    plain integer code) gives the float64 reference's numbers up to float32 rounding."""
    x, w, b = torch.randn(rows, 96) * 3, torch.randn(1000, 96), torch.randn(1000)
    if rows > 1:
        x[-1, :group] = 0.0  # a group of zeros: its scale must not divide by zero
    q, s, codes, scales = _stored(w, fmt, group, backend)
    wd = dequantize(q, s, fmt).double()
    ref = (quantize_group_activations(x, group) @ wd.T).float() + b
    kw = {"format": fmt, "group": group, "out_features": 1000}
    got = k("quant_linear", backend)(x, codes, scales, b, **kw)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)
    # a quantization of the float product on the same weights, not something else
    exact = F.linear(x, wd.float(), b)
    assert 0 < (got - exact).abs().max() < 0.05 * F.linear(x, wd.float()).abs().max()
    # read in place from a wider row, and through the silu_and_mul prologue
    wide = torch.randn(rows, 128)
    wide[:, :96] = x
    got = k("quant_linear", backend)(wide[:, :96], codes, scales, b, **kw)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)
    gate_up = torch.randn(rows, 192) * 3
    h = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    ref = (quantize_group_activations(h, group) @ wd.T).float() + b
    got = k("quant_linear", backend)(gate_up, codes, scales, b, prologue="silu_and_mul", **kw)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)


def test_the_vnni_build_uses_vnni() -> None:
    expect = {level: int(level == "avx512_vnni") for level in HOST_LEVELS}
    assert {level: library(level).kiln_a8_vnni() for level in HOST_LEVELS} == expect


@BOTH
@pytest.mark.parametrize(("fmt", "group"), QUANT_CASES + GA8_CASES)
def test_quant_embedding_reads_the_quantized_table(backend: str, fmt: str, group: int) -> None:
    table = torch.randn(100, 96)
    q, s, codes, scales = _stored(table, fmt, group, backend)
    ids = torch.tensor([0, 99, 17, 17, 64])
    kw = {"format": fmt, "group": group, "num_embeddings": 100}
    got = k("quant_embedding", backend)(ids, codes, scales, **kw)
    torch.testing.assert_close(got, dequantize(q, s, fmt)[ids], rtol=0, atol=1e-6)
    with pytest.raises((RuntimeError, IndexError), match="outside"):
        k("quant_embedding", backend)(torch.tensor([3, 100]), codes, scales, **kw)


def test_quantized_weights_are_close_to_the_floats() -> None:
    """The formats themselves. int8: every weight within half a step of its grid. uint4: each
    group's squared error no worse than rounding to its min/max grid (the scale and min are
    refined by least squares from there)."""
    w = torch.randn(64, 256)
    g = w.reshape(64, -1, 32)
    q, s = quantize(w, "int8", 32)
    err = (dequantize(q, s, "int8") - w).reshape(64, -1, 32).abs()
    assert (err <= g.abs().amax(-1, keepdim=True) / 127 * 0.501 + 1e-6).all()
    lo = g.amin(-1, keepdim=True)
    step = (g.amax(-1, keepdim=True) - lo) / 15
    plain = ((torch.round((g - lo) / step) * step + lo - g) ** 2).sum(-1)
    q, s = quantize(w, "uint4", 32)
    refined = ((dequantize(q, s, "uint4") - w).reshape(64, -1, 32) ** 2).sum(-1)
    assert (refined <= plain * (1 + 1e-5)).all() and refined.sum() < 0.95 * plain.sum()
    q, s = quantize(w, "fp8_e4m3", 256)  # 3 mantissa bits: relative error <= 2^-4
    rel = (dequantize(q, s, "fp8_e4m3") - w).abs() / w.abs().clamp_min(s[:, 0] * 2**-6)
    assert rel.max() <= 2**-4 + 1e-6


@BOTH
@pytest.mark.parametrize("rows", [4, 64])
def test_silu_and_mul(backend: str, rows: int) -> None:
    x = torch.randn(rows, 2 * 1536) * 6  # wide range: both tails
    # past exp's clamps at -87 and 88 (kexp clamps on the bits), and a NaN that must stay one
    x[:, 5:13] = torch.tensor([-1e4, -100.0, -88.0, -87.5, 88.5, 100.0, 1e4, float("nan")])
    d = x.shape[1] // 2
    got = k("silu_and_mul", backend)(x)
    torch.testing.assert_close(got, F.silu(x[:, :d]) * x[:, d:], equal_nan=True)
    assert got[:, 12].isnan().all() and not got[:, 13:].isnan().any()


@BOTH
@pytest.mark.parametrize("rows", [4, 64])
def test_gelu_tanh(backend: str, rows: int) -> None:
    wide = torch.randn(rows, 4096) * 6  # both tails; read in place from a wider row
    x = wide[:, 100:2148]
    torch.testing.assert_close(k("gelu_tanh", backend)(x), F.gelu(x, approximate="tanh"))


@BOTH
def test_softcap(backend: str) -> None:
    x = torch.randn(5, 3000) * 40  # both saturated tails and the near-linear middle
    x[:, 7] = float("nan")  # stays a NaN (exp's clamp would make it a finite +-cap)
    got = k("softcap", backend)(x, 30.0)
    torch.testing.assert_close(
        got, torch.tanh(x / 30.0) * 30.0, rtol=1e-6, atol=4e-6, equal_nan=True
    )
    assert got[:, 7].isnan().all()


@BOTH
def test_rope_matches_transformers(backend: str) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, heads, d = 6, 3, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.tensor([0, 1, 2, 7, 8, 30])
    # q read in place from a wider fused row, as the split of the QKV projection gives it
    q = torch.randn(t, (heads + 2) * d)[:, : heads * d]
    ours = k("rope", backend)(q, k("rope_cos_sin")(pos, inv), head_dim=d)
    freqs = pos[:, None].float() * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    ref, _ = apply_rotary_pos_emb(
        q.view(1, t, heads, d).transpose(1, 2),
        q.view(1, t, heads, d).transpose(1, 2),
        emb.cos()[None],
        emb.sin()[None],
    )
    torch.testing.assert_close(ours, ref.transpose(1, 2).reshape(t, heads * d))


@BOTH
def test_rope_qkv_rotates_q_and_k_of_the_fused_row_and_passes_v(backend: str) -> None:
    t, d, sizes = 5, 16, [4 * 16, 2 * 16, 2 * 16]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos_sin = k("rope_cos_sin")(torch.tensor([0, 3, 4, 9, 40]), inv)
    qkv = torch.randn(t, sum(sizes))
    q, kk, v = k("rope_qkv", backend)(qkv, cos_sin, head_dim=d, sizes=sizes)
    refs = [k("rope")(part.contiguous(), cos_sin, d) for part in qkv.split(sizes, -1)[:2]]
    torch.testing.assert_close(q, refs[0])
    torch.testing.assert_close(kk, refs[1])
    assert torch.equal(v, qkv[:, -sizes[2] :])


def _reference(q, k_, v, window, heads, kv_heads, d):
    """Causal (optionally windowed) attention of the last len(q) positions, no cache."""
    n, m = q.shape[0], k_.shape[0]
    qh = q.view(n, heads, d).transpose(0, 1)
    rep = heads // kv_heads
    kh = k_.view(m, kv_heads, d).repeat_interleave(rep, 1).transpose(0, 1)
    vh = v.view(m, kv_heads, d).repeat_interleave(rep, 1).transpose(0, 1)
    qpos = torch.arange(m - n, m)[:, None]
    j = torch.arange(m)[None]
    mask = (j <= qpos) & ((j > qpos - window) if window else True)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return o.transpose(0, 1).reshape(n, heads * d)


@BOTH
def test_paged_attention_prefill_and_batched_decode_with_windows(backend: str) -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, slots = 4, 2, 8, 64
    lens = [5, 9, 1]
    for window in (None, 3):
        kc = torch.zeros(1, kv_heads, slots, d)
        vc = torch.zeros(1, kv_heads, slots, d)
        perm = torch.randperm(slots)  # scattered slots, as pages would be
        slot_of = [perm[sum(lens[:i]) * 2 : sum(lens[:i]) * 2 + 2 * n] for i, n in enumerate(lens)]
        keys = [torch.randn(n + 1, kv_heads * d) for n in lens]
        vals = [torch.randn(n + 1, kv_heads * d) for n in lens]
        qs = [torch.randn(n + 1, heads * d) for n in lens]
        args = (window, heads, kv_heads, d)
        # Prefill all prompts in one batch.
        spans, start = [], 0
        for n, s in zip(lens, slot_of, strict=True):
            spans.append(SeqSpan(start, n, n, s[:n]))
            start += n
        prompt = [[x[:-1] for x in t] for t in (qs, keys, vals)]
        _check_step(backend, AttentionBatch.build(kc, vc, spans), *prompt, lens, *args)
        # One decode step for every sequence, reading the cache.
        spans = [
            SeqSpan(i, 1, n + 1, s[: n + 1])
            for i, (n, s) in enumerate(zip(lens, slot_of, strict=True))
        ]
        batch = AttentionBatch.build(kc, vc, spans)
        assert batch.decode
        last_q = [q[-1:] for q in qs]
        _check_step(backend, batch, last_q, keys, vals, [1] * len(lens), *args)


@pytest.mark.parametrize("level", HOST_LEVELS[:1] + HOST_LEVELS[-1:])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
def test_fp8_kv_write_rounds_as_torch(level: str, dtype: torch.dtype, kv_scale: float) -> None:
    """The native step's fp8 pool write (kiln_kv_write_fp8) gives attention.py's to_pool
    bytes: value / kv_scale saturated, then torch's rounding. Every fp32 bit pattern whose
    low 12 bits are one of a few (so every sign, exponent and high mantissa: subnormals,
    ties at each fp8 ulp, the largest finite and past it), inf and NaN, and random rows."""
    high = torch.arange(1 << 20, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFF])
    bits = (high[:, None] + low[None, :]).flatten().to(torch.int32)  # wraps: every sign
    special = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0])
    values = torch.cat(
        (bits.view(torch.float32), special, -special, torch.randn(4096) * 100)
    ).contiguous()
    kv_heads, d = 2, 8
    rows = values.numel() // (kv_heads * d)
    k = values[: rows * kv_heads * d].view(rows, kv_heads * d)
    v = -k.flip(0).contiguous()
    slots = torch.arange(rows, dtype=torch.int64)
    fmt = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}[dtype]
    pools = [torch.zeros(kv_heads, rows, d, dtype=torch.uint8) for _ in range(2)]
    library(level).kiln_kv_write_fp8(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), rows,
        pools[0].data_ptr(), pools[1].data_ptr(), rows, kv_heads, d, fmt, kv_scale,
    )  # fmt: skip
    for got, x in zip(pools, (k, v), strict=True):
        want = to_pool(x.view(rows, kv_heads, d).transpose(0, 1), dtype, kv_scale)
        assert torch.equal(got, want.view(torch.uint8).contiguous())


def test_registry_lists_backends_per_device() -> None:
    assert set(catalog.available("linear", "cpu")) == {"torch_native"}
    assert catalog.available("packed_linear", "cpu") == ["torch_native", "kiln_cpu"]
    assert catalog.available("linear", "cuda") == ["torch_native"]
    assert catalog.available("attention", "cuda") == ["torch_native", "triton"]


@BOTH
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("d", [8, 64, 80, 128])  # AVX-512: 16-lane scores, 64/128-wide values
# query heads a KV head: the C kernel weighs values 3 heads a pass (3; 3 + 1; 3 + 3 + 2), a
# lone head 8 vectors a pass
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_reads_whole_pages(backend: str, window, d: int, group: int) -> None:
    torch.manual_seed(1)
    heads, kv_heads, page = 2 * group, 2, 4
    kc = torch.zeros(1, kv_heads, 64, d)
    vc = torch.zeros(1, kv_heads, 64, d)
    lens = [7, 2, 37]  # last pages partly filled; 37 keys: blocks of 8 and a remainder
    page_ids = [torch.tensor(p) for p in ([9, 3], [14], [0, 11, 6, 1, 2, 4, 5, 7, 8, 10])]
    keys = [torch.randn(n, kv_heads * d) for n in lens]
    vals = [torch.randn(n, kv_heads * d) for n in lens]
    qs = [torch.randn(1, heads * d) for _ in lens]
    spans = []
    for i, (n, p) in enumerate(zip(lens, page_ids, strict=True)):
        slots = (p[:, None] * page + torch.arange(page)[None]).reshape(-1)[:n]
        # Everything but the newest token is already in the cache.
        kc[0][:, slots[:-1]] = keys[i][:-1].view(-1, kv_heads, d).transpose(0, 1)
        vc[0][:, slots[:-1]] = vals[i][:-1].view(-1, kv_heads, d).transpose(0, 1)
        spans.append(SeqSpan(i, 1, n, slots, p))
    batch = AttentionBatch.build(kc, vc, spans, page_size=page)
    assert batch.decode and batch.kv_width == 10 * page
    new = [1] * len(lens)
    _check_step(backend, batch, qs, keys, vals, new, window, heads, kv_heads, d)


def _check_step(backend, batch, qs, keys, vals, new, window, heads, kv_heads, d) -> None:
    """Run one attention step whose sequence i brings its last new[i] tokens, and compare
    with attention over each sequence's whole K/V without a cache."""
    out = for_step("attention", backend, batch)(
        batch,
        torch.cat(qs),
        torch.cat([x[len(x) - n :] for x, n in zip(keys, new, strict=True)]),
        torch.cat([x[len(x) - n :] for x, n in zip(vals, new, strict=True)]),
        layer=0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        scale=d**-0.5,
        sliding_window=window,
    )
    ref = torch.cat(
        [
            _reference(q, kk, vv, window, heads, kv_heads, d)
            for q, kk, vv in zip(qs, keys, vals, strict=True)
        ]
    )
    torch.testing.assert_close(out, ref)


@BOTH
@pytest.mark.parametrize("window", [None, 4])
def test_mixed_batch_of_decode_rows_and_prefill_chunks(backend: str, window) -> None:
    # What --enable-mixed-chunk builds: decoding requests (one new token over a cache), a
    # fresh prompt and a later chunk of a long prompt, in one step, on 4-token pages.
    torch.manual_seed(2)
    heads, kv_heads, d, page = 4, 2, 16, 4
    kc = torch.zeros(1, kv_heads, 128, d)
    vc = torch.zeros(1, kv_heads, 128, d)
    # (cached tokens, new tokens) per sequence
    shape = [(9, 1), (0, 5), (6, 3), (20, 1)]
    spans, qs, keys, vals, start, next_page = [], [], [], [], 0, 0
    for cached, new in shape:
        n = cached + new
        pages = torch.arange(next_page, next_page + -(-n // page)) * 3 % 32  # scattered
        next_page += -(-n // page)
        slots = (pages[:, None] * page + torch.arange(page)[None]).reshape(-1)[:n]
        keys.append(torch.randn(n, kv_heads * d))
        vals.append(torch.randn(n, kv_heads * d))
        qs.append(torch.randn(new, heads * d))
        old = slots[:cached]
        kc[0][:, old] = keys[-1][:cached].view(-1, kv_heads, d).transpose(0, 1)
        vc[0][:, old] = vals[-1][:cached].view(-1, kv_heads, d).transpose(0, 1)
        spans.append(SeqSpan(start, new, n, slots, pages))
        start += new
    batch = AttentionBatch.build(kc, vc, spans, page_size=page)
    assert not batch.decode and batch.single_seqs == [0, 3]
    new = [n for _, n in shape]
    _check_step(backend, batch, qs, keys, vals, new, window, heads, kv_heads, d)


@BOTH
@pytest.mark.parametrize("pool", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
def test_fp8_pool_stores_scaled_values_and_reads_them_back(backend, pool, kv_scale) -> None:
    # --kv-cache-dtype fp8_*: a mixed step (decode rows over cached pages, a fresh prompt, a
    # later chunk) on an fp8 pool equals attention over K/V rounded through that format,
    # except a fresh prompt's own rows, which attend to its K/V as computed.
    from kiln.core.ops.attention import from_pool, to_pool

    torch.manual_seed(3)
    heads, kv_heads, d, page = 4, 2, 64, 4
    kc = torch.zeros(1, kv_heads, 128, d, dtype=pool)
    vc = torch.zeros(1, kv_heads, 128, d, dtype=pool)
    shape = [(9, 1), (0, 5), (6, 3), (30, 1)]
    spans, qs, keys, vals, ref_kv, start, next_page = [], [], [], [], [], 0, 0
    for cached, new in shape:
        n = cached + new
        pages = torch.arange(next_page, next_page + -(-n // page)) * 3 % 32
        next_page += -(-n // page)
        slots = (pages[:, None] * page + torch.arange(page)[None]).reshape(-1)[:n]
        kk, vv = torch.randn(n, kv_heads * d) * 2, torch.randn(n, kv_heads * d) * 2
        keys.append(kk)
        vals.append(vv)
        qs.append(torch.randn(new, heads * d))
        rounded = [from_pool(to_pool(t, pool, kv_scale), torch.float32, kv_scale) for t in (kk, vv)]
        ref_kv.append((kk, vv) if cached == 0 else tuple(rounded))
        for cache, t in ((kc, kk), (vc, vv)):
            stored = to_pool(t[:cached].view(-1, kv_heads, d).transpose(0, 1), pool, kv_scale)
            cache[0].view(torch.uint8)[:, slots[:cached]] = stored.view(torch.uint8)
        spans.append(SeqSpan(start, new, n, slots, pages))
        start += new
    batch = AttentionBatch.build(kc, vc, spans, page_size=page)
    out = for_step("attention", backend, batch)(
        batch,
        torch.cat(qs),
        torch.cat([x[len(x) - n :] for x, (_, n) in zip(keys, shape, strict=True)]),
        torch.cat([x[len(x) - n :] for x, (_, n) in zip(vals, shape, strict=True)]),
        layer=0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        scale=d**-0.5,
        sliding_window=None,
        kv_scale=kv_scale,
    )
    ref = torch.cat(
        [
            _reference(q, kk, vv, None, heads, kv_heads, d)
            for q, (kk, vv) in zip(qs, ref_kv, strict=True)
        ]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # The new tokens were written as scaled fp8: what the next step will read.
    last = spans[3].kv_slots[-1]
    stored = from_pool(kc[0][:, last], torch.float32, kv_scale).reshape(-1)
    expect = from_pool(to_pool(keys[3][-1], pool, kv_scale), torch.float32, kv_scale)
    torch.testing.assert_close(stored, expect)
    # Rounding is real: the cached keys the reference read are not the float ones.
    assert not torch.allclose(ref_kv[0][0], keys[0])


@BOTH
@pytest.mark.parametrize("pool", [torch.float32, torch.float8_e4m3fn])
def test_rope_attention_is_rope_qkv_then_attention(backend: str, pool: torch.dtype) -> None:
    # A decode step over 4-token pages (the C kernel's one call on an fp32 pool), then a
    # prefill step (rope and attention one after the other): the same output and the same
    # pool as the two ops, each step.
    torch.manual_seed(4)
    heads, kv_heads, d, page = 6, 2, 16, 4
    sizes = [heads * d, kv_heads * d, kv_heads * d]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    attrs = {"layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    attrs |= {"scale": d**-0.5, "sliding_window": None, "kv_scale": 0.5}
    pools = [torch.randn(2, kv_heads, 64, d).to(pool) for _ in range(2)]
    copies = [p.clone() for p in pools]
    pages = [torch.tensor([3, 9]), torch.tensor([0, 5, 7]), torch.tensor([12])]
    for lens, fed in (([6, 11, 1], [1, 1, 1]), ([8, 4, 3], [2, 4, 2])):
        spans, start = [], 0
        for n, f, p in zip(lens, fed, pages, strict=True):
            slots = (p[:, None] * page + torch.arange(page)[None]).reshape(-1)[:n]
            spans.append(SeqSpan(start, f, n, slots, p))
            start += f
        positions = torch.cat([torch.arange(n - f, n) for n, f in zip(lens, fed, strict=True)])
        cos_sin = k("rope_cos_sin")(positions, inv)
        qkv = torch.randn(start, sum(sizes))
        fused = AttentionBatch.build(*pools, spans, page_size=page)
        assert fused.decode == (fed == [1, 1, 1])
        got = for_step("rope_attention", backend, fused)(fused, qkv, cos_sin, **attrs)
        q, kk, v = k("rope_qkv")(qkv, cos_sin, head_dim=d, sizes=sizes)
        two = AttentionBatch.build(*copies, spans, page_size=page)
        want = k("attention")(two, q, kk, v, **attrs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(pools, copies, strict=True):
            torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize(
    "capped, sunk, long",
    [(True, False, False), (False, True, False), (True, True, False), (True, True, True)],
)
def test_native_decode_attention_caps_scores_and_counts_sinks(backend, capped, sunk, long) -> None:
    """Gemma 2's soft cap and GPT-OSS's per-head sinks in kiln's C decode kernel: against
    the reference on a decode step over scattered pages, windowed and not. `long`: one
    sequence of 300 keys, 2 KV heads, whose keys the kernel splits into parts merged by
    their maxima and sums (fewer items than two a thread; 2 threads or more)."""
    from kiln.core.ops.attention import Attention

    torch.manual_seed(3)
    heads, kv_heads, d, page = 4, 2, 16, 4
    lens = [300] if long else [7, 13, 1]
    per_seq = 75 if long else 4  # pages a sequence
    for window in (None, 100 if long else 5):
        count = per_seq * len(lens) + 1
        pools = [torch.zeros(1, kv_heads, count * page, d) for _ in range(4)]
        order = torch.randperm(count)
        pages = [order[per_seq * i : per_seq * (i + 1)] for i in range(len(lens))]
        slots = [(p[:, None] * page + torch.arange(page)).reshape(-1) for p in pages]
        for pool in pools:
            pool.normal_()  # cached keys and values, the same in every pool
            pool.copy_(pools[0])
        spans = [
            SeqSpan(i, 1, n, s[:n], p)
            for i, (n, s, p) in enumerate(zip(lens, slots, pages, strict=True))
        ]
        q, kn, vn = (torch.randn(len(lens), h * d) * 3 for h in (heads, kv_heads, kv_heads))
        attrs = Attention(
            0, heads, kv_heads, d, d**-0.5, window, softcap=1.5 if capped else 0.0, sinks=int(sunk)
        )
        sinks = (torch.randn(heads) * 2,) if sunk else ()
        outs = []
        for name, (kc, vc) in (("torch_native", pools[:2]), (backend, pools[2:])):
            batch = AttentionBatch.build(kc, vc, spans, page_size=page)
            assert batch.decode
            kernel = catalog.get("attention", name.split("/")[0])
            level = name.partition("/")[2]
            fn = functools.partial(kernel.fn, lib=library(level)) if level else kernel.fn
            outs.append(fn(batch, q, kn, vn, *sinks, a=attrs))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
