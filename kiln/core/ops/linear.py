"""Linears and embedding lookups, on float weights as stored (rows), on weights the layout
pass stored as panels for kiln's CPU kernels (kiln/core/layout.py), and on quantized codes
and scales (kiln/core/quant.py). A linear may take a `prologue`: "silu_and_mul" computes
silu(x1) * x2 of an input of twice its features inside the same call
(passes/fuse_silu_linear.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kiln.core.layout import unpack_codes, unpack_scales
from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op
from kiln.core.ops.elementwise import silu_and_mul
from kiln.core.quant import (
    FORMATS,
    dequantize,
    quantize_activations,
    quantize_group_activations,
)

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")

Prologue = Literal["none", "silu_and_mul"]
PROLOGUES = ("none", "silu_and_mul")


@dataclass(frozen=True, slots=True)
class PackedLinear(Attrs):
    out_features: int
    # Row counts in [lo, hi] take the narrow micro-kernel, others the wide one (decided at
    # compile by the layout pass).
    narrow_rows: list[int]
    prologue: Prologue = "none"


@dataclass(frozen=True, slots=True)
class QuantLinear(Attrs):
    format: str
    group: int
    out_features: int
    prologue: Prologue = "none"
    # --enable-deterministic-inference: 1 when each row of a float-activation format is
    # its own call (passes/deterministic.py): that kernel's 1-row, few-row and prompt
    # tiles round differently.
    deterministic: int = 0


@dataclass(frozen=True, slots=True)
class QuantEmbedding(Attrs):
    format: str
    group: int
    num_embeddings: int


@dataclass(frozen=True, slots=True)
class EmbeddingPart(Attrs):
    first_row: int  # this rank's rows are [first_row, first_row + its rows)


# -- type rules ------------------------------------------------------------------------
def _prologue_in(check: Check, a: dict[str, Any], features: int) -> int:
    """The input features a linear of `features` inputs takes with its prologue."""
    return 2 * features if a["prologue"] == "silu_and_mul" else features


def _bias(check: Check, ins: list[Any], index: int, out: int) -> None:
    if len(ins) > index:
        check.expect("bias size", check.weight(index, 1)[0], out)


def _panels(check: Check, index: int) -> None:
    spec = check.graph.weight_of(check.node.args[index])
    if spec is None or spec.layout == "rows":
        raise check.fail(f"{check.node.op} needs a weight stored as panels")


def _linear(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    out, inp = check.weight(1, 2)
    check.expect("input features", x.features, inp)
    _bias(check, ins, 2, out)
    check.same_dtype(x, ins[1])
    return TensorType(out, x.dtype)


def _linear_fp32(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    return TensorType(_linear(check, a, ins).features, "float32")


def _packed_linear(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    _panels(check, 1)
    out, inp = check.weight(1, 2)
    check.expect("out_features", a["out_features"], out)
    lo_hi = a["narrow_rows"]
    if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
        raise check.fail("narrow_rows must be [lo, hi], 0 <= lo <= hi")
    check.expect("input features", x.features, _prologue_in(check, a, inp))
    _bias(check, ins, 2, out)
    return TensorType(out, x.dtype)


def _quant(check: Check, a: dict[str, Any]) -> tuple[int, int]:
    """A quantized op's codes and scales agree with its format and group: (N, K)."""
    fmt, group = a["format"], a["group"]
    form = FORMATS.get(fmt)
    if form is None:
        raise check.fail(f"unknown quantization format {fmt!r}")
    check.positive(group=group)
    graph, node = check.graph, check.node
    codes, scales = graph.weight_of(node.args[1]), graph.weight_of(node.args[2])
    if codes is None or scales is None:
        raise check.fail(f"{node.op} needs stored codes and scales")
    want = f"{form.layout}panels"
    if not codes.layout.startswith(want) or codes.dtype != form.code_dtype:
        raise check.fail(f"{fmt} codes must be {form.code_dtype} {want}")
    kind = f"{form.scale_layout}panels"
    if not scales.layout.startswith(kind) or scales.dtype != form.scale_dtype:
        raise check.fail(f"{fmt} scales must be {form.scale_dtype} {kind}")
    n, k = check.weight(1, 2)
    if k % group or group % form.group_step:
        raise check.fail(
            f"group {group} does not divide {k} input features in whole steps of "
            f"{form.group_step} ({fmt})"
        )
    span = group * (form.superblock or 1)
    if k % span:
        raise check.fail(f"{fmt}: {k} input features are not whole super-blocks of {span}")
    check.expect("scales shape", check.weight(2, 3), form.scales_shape(n, k, group))
    return n, k


def _quant_linear(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    x = check.float_tensor(ins[0])
    out, inp = _quant(check, a)
    check.expect("out_features", a["out_features"], out)
    check.expect("input features", x.features, _prologue_in(check, a, inp))
    _bias(check, ins, 3, out)
    return TensorType(out, x.dtype)


def _embedding(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.ids(ins[0])
    return TensorType(check.weight(1, 2)[1], ins[1].dtype)


def _packed_embedding(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    _panels(check, 1)
    return _embedding(check, a, ins)


def _quant_embedding(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.ids(ins[0])
    rows, h = _quant(check, a)
    check.expect("num_embeddings", a["num_embeddings"], rows)
    return TensorType(h, "float32")


def _embedding_part(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    if a["first_row"] < 0:
        raise check.fail(f"first_row must be >= 0, got {a['first_row']}")
    return _embedding(check, a, ins)


# -- reference kernels -------------------------------------------------------------------
def unpack_panels(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The [rows, K] weight a panels layout stores as [P, K, L]."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:rows]


def unpack_quant(codes: torch.Tensor, scales: torch.Tensor, fmt: str, rows: int) -> torch.Tensor:
    """Quantized panels (kiln/core/layout.py) -> float32 [rows, K]."""
    form = FORMATS[fmt]
    q = unpack_codes(codes, form.layout, rows)
    if form.code_dtype == "int8":
        q = q.view(torch.int8)
    return dequantize(q, unpack_scales(scales, rows, form.superblock and form.record_bytes), fmt)


def _with_prologue(x: torch.Tensor, prologue: str) -> torch.Tensor:
    return silu_and_mul.kernel(x) if prologue == "silu_and_mul" else x


@op("x, weight, bias?", rule=_linear)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


WIDEN_ROWS = 1024  # linear_fp32's block of weight rows on a CPU


@op("x, weight, bias?", rule=_linear_fp32)
def linear_fp32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) with x and W widened to float32: float32 out from 16-bit inputs
    (the lm_head under --enable-fp32-lm-head, passes/fp32_lm_head.py). On a CPU the weight
    is widened WIDEN_ROWS rows at a time, each block while it is in cache: SmolLM2's
    49152 x 576 bfloat16 lm_head at one row took 80.7 ms widened whole, 9.9 ms so, against
    6.0 ms in bfloat16 (2-core Zen 3)."""
    x32, b32 = x.float(), None if bias is None else bias.float()
    rows = weight.shape[0]
    if x.device.type != "cpu" or rows <= WIDEN_ROWS:
        return F.linear(x32, weight.float(), b32)
    out = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
    for lo in range(0, rows, WIDEN_ROWS):
        hi = min(lo + WIDEN_ROWS, rows)
        out[..., lo:hi] = F.linear(x32, weight[lo:hi].float(), None if b32 is None else b32[lo:hi])
    return out


@op("x, weight, bias?", PackedLinear, rule=_packed_linear, panels=True)
def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, a: PackedLinear
) -> torch.Tensor:
    """x @ W.T (+ bias) on W stored as panels."""
    w = unpack_panels(weight, a.out_features)
    return F.linear(_with_prologue(x, a.prologue), w, bias)


@op("x, codes, scales, bias?", QuantLinear, rule=_quant_linear, panels=True)
def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    a: QuantLinear,
) -> torch.Tensor:
    """Dequantize the whole weight, then a float GEMM (w8a8_int8: the integer sums of
    per-token int8 activations, exact in float64, then the two scales; uint4_a8 / int8_a8:
    the activations rounded to int8 per group as their kernel does, then a float64 GEMM,
    which is the kernel's sum before its float32 roundings)."""
    x = _with_prologue(x, a.prologue)
    w = unpack_quant(codes, scales, a.format, a.out_features)
    if FORMATS[a.format].kernel == "ga8":
        out = (quantize_group_activations(x, a.group) @ w.double().T).float()
        return out if bias is None else out + bias
    if FORMATS[a.format].kernel != "a8":
        return F.linear(x, w.to(x.dtype), bias)
    tiles, _, lanes, _ = codes.shape
    sw = scales[:, 0, 0, :].reshape(tiles * lanes)[: a.out_features]
    wq = torch.round(w / sw[:, None])
    xq, sx = quantize_activations(x.float())
    sums = (xq.double() @ wq.double().T).float()
    out = sums * (sx * sw)
    return out if bias is None else out + bias


@op("ids, weight", rule=_embedding)
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


@op("ids, weight", rule=_packed_embedding, panels=True)
def packed_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of a table stored as panels (the tied lm_head's): one copy of it, not two."""
    return F.embedding(ids, unpack_panels(weight, weight.shape[0] * weight.shape[2]))


@op("ids, codes, scales", QuantEmbedding, rule=_quant_embedding, panels=True)
def quant_embedding(
    ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, a: QuantEmbedding
) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= a.num_embeddings):
        raise IndexError(f"a token id is outside [0, {a.num_embeddings})")
    return F.embedding(ids, unpack_quant(codes, scales, a.format, a.num_embeddings))


@op("ids, weight", EmbeddingPart, rule=_embedding_part)
def embedding_part(ids: torch.Tensor, weight: torch.Tensor, *, a: EmbeddingPart) -> torch.Tensor:
    """A vocabulary-parallel rank's rows of the table: ids of other ranks' rows give zeros
    (an all_reduce after it sums the ranks)."""
    local = ids - a.first_row
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


OPS = (
    linear,
    linear_fp32,
    packed_linear,
    quant_linear,
    embedding,
    packed_embedding,
    quant_embedding,
    embedding_part,
)
