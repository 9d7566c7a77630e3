"""Quantization formats of kiln's quantized linears, and the compile-time maths that makes
their codes and scales (from float weights, or from GGUF blocks without loss).

A format is what a kernel reads; a scheme (the `quantize` pass, passes/quantize.py) says
which weights get which format and group size. Every format stores, per output row and
group of `group` consecutive inputs, float32 scales and codes:

- int8:     w = q * s,           q in [-127, 127]      (symmetric; GGUF Q8_0 is group 32)
- uint4:    w = q * s + m,       q in [0, 15]          (scale and min; GGUF Q4_1 is group 32,
                                                         Q4_0 is s = d, m = -8 d)
- fp8_e4m3: w = fp8(q) * s                              (one scale per row by default)
- int8m:    w = q * s + m,       q in [-128, 127]      (scale and min: int8 and 5-bit
                                                         parts of one fused weight together)
- int5:     w = (q - 16) * s,    q in [0, 31]          (GGUF Q5_0)
- uint5:    w = q * s + m,       q in [0, 31]          (scale and min; GGUF Q5_1, Q5_K)
- w8a8_int8: w = q * s, one scale per row, q in [-127, 127]; the kernel also quantizes
  the activations per token (SGLang's w8a8_int8) and sums in int32. Its second plane is
  128 * sum_k q, the correction for the kernel's unsigned activation bytes.
- uint4_a8 / int8_a8 (`--quantize-activations int8`): the weights of uint4 / int8, and the
  kernel quantizes the activations to int8 per group of `group` inputs (llama.cpp's way
  with its Q4_0 / Q4_1 / Q8_0 blocks) to sum each group in int32. uint4_a8's planes are
  uint4's; int8_a8's second plane is 128 * sum_k q over the group (as w8a8_int8's).

`dequantize` is the reference every kernel is tested against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from kiln.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


@dataclass(frozen=True)
class QuantFormat:
    """One quantization format: everything the compiler, the type rules, the reference
    kernel and kiln_cpu's dispatch need to know about it, in one entry of FORMATS."""

    name: str
    code_dtype: Literal["int8", "uint8"]  # what the codes are stored as
    layout: Literal["q8", "q4", "q5", "a8", "a4"]  # their panel kind (kiln/core/layout.py)
    planes: int  # scale planes: 1 (scale) or 2 (scale and min, or scale and code sum)
    # kiln_cpu's entry point for its linears, and the format's numbers in the C source:
    # QFMT_* (qlinear and the quantized embedding) and GA8_* (the ga8 linear).
    kernel: Literal["qlinear", "ga8", "a8"]
    qfmt: int | None = None
    ga8: int | None = None
    group_step: int = 1  # a group size must be a multiple of this (its kernel's step)
    fp8: bool = False  # codes are fp8 e4m3 bit patterns
    has_min: bool = False  # the second plane is a min added after scaling
    base: str | None = None  # an int8-activation format: the weight format it runs
    int8_activations: str | None = None  # this format under --quantize-activations int8
    gguf: tuple[tuple[str, int], ...] = ()  # GGUF block types kept as this: (type, group)
    offset: int = 0  # codes are stored plus this (int5: 0..31 for -16..15)
    # float16: the scales (and mins) are stored as halves (GGUF blocks whose d and m are
    # float16 already, kept exactly at their own size); `full` names the same format with
    # float32 ones.
    scale_dtype: Literal["float32", "float16"] = "float32"
    full: str | None = None


_FULL: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat(
            "int8",
            "int8",
            "q8",
            1,
            "qlinear",
            0,
            int8_activations="int8_a8",
            gguf=(("Q6_K", 16),),
        ),
        QuantFormat(
            "uint4",
            "uint8",
            "q4",
            2,
            "qlinear",
            1,
            group_step=2,
            has_min=True,
            int8_activations="uint4_a8",
            gguf=(("Q4_K", 32),),
        ),
        QuantFormat("fp8_e4m3", "uint8", "q8", 1, "qlinear", 2, fp8=True),
        # 8-bit codes with a scale and a min: what int8 and 5-bit parts of one fused
        # weight run as together (`widen`).
        QuantFormat("int8m", "int8", "q8", 2, "qlinear", 5, has_min=True),
        # 5-bit codes (a nibble plane and a bit plane): GGUF's Q5_0, w = (q - 16) s, and its
        # Q5_1 / Q5_K, w = q s + m.
        QuantFormat("int5", "uint8", "q5", 1, "qlinear", 6, group_step=8, offset=16),
        QuantFormat(
            "uint5",
            "uint8",
            "q5",
            2,
            "qlinear",
            7,
            group_step=8,
            has_min=True,
            gguf=(("Q5_1", 32), ("Q5_K", 32)),
        ),
        QuantFormat("w8a8_int8", "int8", "a8", 2, "a8", base="int8"),
        QuantFormat(
            "uint4_a8", "uint8", "a4", 2, "ga8", 3, 0, group_step=8, has_min=True, base="uint4"
        ),
        QuantFormat("int8_a8", "int8", "a8", 2, "ga8", 4, 1, group_step=4, base="int8"),
    )
}


def _half_scales(full: str, qfmt: int, gguf: tuple[tuple[str, int], ...]) -> QuantFormat:
    """`full` with float16 scales (and mins), named `full` + "h": GGUF blocks whose scales
    are float16 already, kept at their own size."""
    return dataclasses.replace(
        _FULL[full], name=f"{full}h", qfmt=qfmt, gguf=gguf, scale_dtype="float16", full=full
    )


FORMATS: dict[str, QuantFormat] = {
    **_FULL,
    "int8h": _half_scales("int8", 8, (("Q8_0", 32),)),
    "uint4h": _half_scales("uint4", 9, (("Q4_0", 32), ("Q4_1", 32))),
    "int5h": _half_scales("int5", 10, (("Q5_0", 32),)),
}
# Formats a wider one holds exactly: where a fused weight's parts are stored in several
# of these at one group size, they all run as the narrowest that holds every part (int8
# holds int5's codes minus 16; int8m holds all, an int8 or int5 part with a min of 0).
WIDENS = ("int5", "int8", "uint5", "int8m")


def widest(formats: set[str]) -> str | None:
    """The format that holds every one of `formats` exactly, None if there is none (a
    float16-scale format is held by its float32-scale one, and int8h holds int5h)."""
    if len(formats) == 1:
        return next(iter(formats))
    if formats <= {"int5h", "int8h"}:
        return "int8h"
    full = {FORMATS[f].full or f for f in formats}
    if len(full) == 1:
        return full.pop()
    if not full <= set(WIDENS):
        return None
    return "int8" if full <= {"int5", "int8"} else "int8m"


def widen(
    codes: np.ndarray, scales: np.ndarray, stored: str, fmt: str
) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales stored as `stored`, as format `fmt` that holds them exactly."""
    if stored == fmt:
        return codes, scales
    if widest({stored, fmt}) != fmt:
        raise QuantError(f"{stored} does not widen to {fmt}")
    if (FORMATS[stored].full or stored) == (FORMATS[fmt].full or fmt):
        return codes, scales  # the same codes; scales are float32 in memory either way
    signed = (codes.astype(np.int16) - FORMATS[stored].offset).astype(np.int8)
    if FORMATS[fmt].planes == 1 or FORMATS[stored].has_min:
        return signed, scales
    return signed, np.concatenate([scales, np.zeros_like(scales)], axis=-1)


# GGUF block types kiln runs as they are: type -> (format, group).
GGUF_FORMATS = {t: (f.name, group) for f in FORMATS.values() for t, group in f.gguf}
FP8_E4M3_MAX = 448.0


class QuantError(ValueError):
    """A weight cannot take the asked format (shape, group)."""


def quantize(w: torch.Tensor, fmt: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (codes [N, K], scales [N, K / group, planes]) in `fmt`; group 0 is
    one group per row."""
    n, k = w.shape
    group = group or k
    if group < 0 or k % group:
        raise QuantError(f"group size {group} does not divide {k} input features")
    form = FORMATS.get(fmt)
    if form is None:
        raise QuantError(f"unknown quantization format {fmt!r} (known: {', '.join(FORMATS)})")
    if group % form.group_step:
        raise QuantError(f"{fmt} needs a group size that is a multiple of {form.group_step}")
    g = w.float().reshape(n, k // group, group)
    if form.base is not None and form.kernel == "ga8":
        return with_int8_activations(*quantize(w, form.base, group), fmt)
    if form.full is not None:  # its codes for scales as float16 holds them
        _, s = quantize(w, form.full, group)
        return _codes_for(g, s.half().float(), form.full), s.half().float()
    if fmt == "w8a8_int8":
        if group != k:
            raise QuantError(f"w8a8_int8 has one scale per row, not a group of {group}")
        if k % 4:
            raise QuantError(f"w8a8_int8 needs input features in fours, got {k}")
        return with_int8_activations(*quantize(w, "int8", k), fmt)
    if fmt == "int8":
        s = g.abs().amax(-1, keepdim=True) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(g / s).clamp(-127, 127).to(torch.int8)
        return q.reshape(n, k), s
    if fmt == "uint4":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = (hi - lo) / 15.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q, s, lo = _refine_uint4(g, s, lo)
        return q.to(torch.uint8).reshape(n, k), torch.cat([s, lo], dim=-1)
    if fmt == "int5":
        s = g.abs().amax(-1, keepdim=True) / 16.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (torch.round(g / s).clamp(-16, 15) + 16).to(torch.uint8)
        return q.reshape(n, k), s
    if fmt == "uint5":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = (hi - lo) / 31.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round((g - lo) / s).clamp(0, 31).to(torch.uint8)
        return q.reshape(n, k), torch.cat([s, lo], dim=-1)
    if fmt == "int8m":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = (hi - lo) / 255.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        m = lo + 128.0 * s
        q = torch.round((g - m) / s).clamp(-128, 127).to(torch.int8)
        return q.reshape(n, k), torch.cat([s, m], dim=-1)
    if fmt == "fp8_e4m3":
        s = g.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (g / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).reshape(n, k), s
    raise QuantError(f"unknown quantization format {fmt!r} (known: {', '.join(FORMATS)})")


def _codes_for(g: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of groups `g` [N, G, group] for given scales (and mins) in format `fmt`."""
    n = g.shape[0]
    if fmt == "int8":
        return torch.round(g / s).clamp(-127, 127).to(torch.int8).reshape(n, -1)
    if fmt == "int5":
        return (torch.round(g / s).clamp(-16, 15) + 16).to(torch.uint8).reshape(n, -1)
    if fmt == "uint4":
        return (
            torch.round((g - s[..., 1:]) / s[..., :1]).clamp(0, 15).to(torch.uint8).reshape(n, -1)
        )
    raise QuantError(f"no half-scale form of {fmt}")


def _refine_uint4(
    g: torch.Tensor, s: torch.Tensor, m: torch.Tensor, rounds: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes for the min/max grid, then a few rounds of: the least-squares scale and min for
    those codes, and the codes for that grid (each round lowers the group's squared error;
    a group whose codes are all equal keeps its grid)."""
    size = g.shape[-1]
    best_q = torch.round((g - m) / s).clamp(0, 15)
    best_s, best_m = s, m
    best_err = ((best_q * s + m - g) ** 2).sum(-1, keepdim=True)
    q = best_q
    for _ in range(rounds):
        sq, sw = q.sum(-1, keepdim=True), g.sum(-1, keepdim=True)
        sqq, sqw = (q * q).sum(-1, keepdim=True), (q * g).sum(-1, keepdim=True)
        det = size * sqq - sq * sq
        ok = det > 0
        s_new = torch.where(ok, (size * sqw - sq * sw) / torch.where(ok, det, 1.0), best_s)
        s_new = torch.where(s_new > 0, s_new, best_s)
        m_new = torch.where(ok, (sw - s_new * sq) / size, best_m)
        q = torch.round((g - m_new) / s_new).clamp(0, 15)
        err = ((q * s_new + m_new - g) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_s = torch.where(better, s_new, best_s)
        best_m = torch.where(better, m_new, best_m)
        best_err = torch.minimum(err, best_err)
    return best_q, best_s, best_m


def with_int8_activations(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint4 / int8 (codes, scales) -> the same weights in `fmt` (uint4_a8 / int8_a8 /
    w8a8_int8: a plane of 128 x the group's code sum, for the kernels' unsigned inputs)."""
    form = FORMATS[fmt]
    if form.base is None or form.planes == FORMATS[form.base].planes:
        return codes, scales  # no code-sum plane to add (uint4_a8 runs uint4's as they are)
    n, groups = scales.shape[:2]
    sums = codes.view(torch.int8).reshape(n, groups, -1).sum(-1, dtype=torch.int64)
    return codes, torch.cat([scales, (128.0 * sums.double()).float().unsqueeze(-1)], dim=-1)


def quantize_group_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """uint4_a8 / int8_a8's activations as their kernel rounds them: x [M, K] -> float64
    [M, K] of xq * sx, sx = max|x| / 127 per group of `group` inputs, xq = round(x / sx)."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = torch.round(g / sx).clamp(-127, 127)
    return (xq.double() * sx.double()).reshape(m, k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8_int8's per-token activations, as its kernel computes them: (codes [M, K] in
    [-127, 127] as float, scales [M, 1])."""
    amax = x.abs().amax(-1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / sx).clamp(-127, 127), sx


# OCP MXFP4: 4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) by value.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as GPT-OSS checkpoints store it: `blocks` uint8 [..., groups, 16] (two codes a
    byte, the low nibble first: 32 values a group) and `scales` uint8 [..., groups], each a
    power of two (e8m0: 2 ** (s - 127)); -> float32 [..., groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks {blocks.dtype} and scales {scales.dtype}, not uint8")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} against scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def dequantize(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """(codes [N, K], scales [N, G, planes]) -> float32 [N, K] (w8a8_int8: its weights)."""
    n, k = q.shape
    groups = s.shape[1]
    form = FORMATS[fmt]
    vals = q.view(torch.float8_e4m3fn).float() if form.fp8 else q.float()
    if form.offset:
        vals = vals - form.offset
    vals = vals.reshape(n, groups, k // groups)
    out = vals * s[..., :1]
    if form.has_min:
        out = out + s[..., 1:2]
    return out.reshape(n, k)


def from_gguf_blocks(raw: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF rows of blocks (uint8 [N, bytes]) -> (codes [N, K], scales [N, groups, planes])
    that `dequantize` turns into exactly, bit for bit, what the `gguf` package (and
    llama.cpp) decode them to. Every scale below is a product exact in float32 (a float16
    times an integer of at most 8 bits), and the decode's order of operations is kept.

    Blocks of 32 weights: Q8_0 = f16 d, 32 x int8; Q4_0 = f16 d, 16 bytes of nibbles
    (weight j in the low nibble of byte j, weight j + 16 in the high one), w = d (q - 8);
    Q4_1 = f16 d, f16 m, the same nibbles, w = d q + m; Q5_0 = f16 d, 32 high bits, the
    nibbles, w = d (q - 16) (as int5, group 32); Q5_1 = f16 d, f16 m, the high bits, the
    nibbles, w = d q + m (as uint5, group 32).
    Super-blocks of 256: Q4_K = f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins,
    128 bytes of nibbles (each 64 weights: 32 low nibbles, then the same bytes' high ones),
    w = (d sc) q - (dmin m) (as uint4, group 32, min -(dmin m)); Q5_K = the same with 32
    bytes of fifth bits before the nibbles (bit j for sub-block j; as uint5); Q6_K = 128
    bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d, w = (d sc) (q - 32)
    (as int8, group 16)."""
    if qtype in _K_QUANTS:
        return _from_k_quant(np.ascontiguousarray(raw).reshape(n, k // 256, -1), qtype, n, k)
    blocks = k // 32
    rows = np.ascontiguousarray(raw).reshape(n, blocks, -1)
    d = rows[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    if qtype == "Q8_0":
        codes = rows[..., 2:34].copy().view(np.int8)
        return codes.reshape(n, k), d
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4  # Q5_1: f16 m after d
        high = rows[..., at : at + 4].copy().view(np.uint32)  # [N, B, 1]: bit j is weight j's
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        nib = rows[..., at + 4 : at + 20]
        five = (np.concatenate([nib & 0x0F, nib >> 4], axis=-1) | (bits << 4)).reshape(n, k)
        if qtype == "Q5_0":
            return five, d
        m = rows[..., 2:4].copy().view(np.float16).astype(np.float32)
        return five, np.concatenate([d, m], axis=-1)
    start = 2 if qtype == "Q4_0" else 4
    nib = rows[..., start : start + 16]
    codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.uint8)
    if qtype == "Q4_0":
        m = -8.0 * d
    elif qtype == "Q4_1":
        m = rows[..., 2:4].copy().view(np.float16).astype(np.float32)
    else:
        raise QuantError(f"GGUF type {qtype} has no kiln format")
    return codes.reshape(n, k), np.concatenate([d, m], axis=-1)


_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _from_k_quant(rows: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Super-blocks [N, K / 256, bytes] of Q4_K or Q6_K -> codes and scales."""
    sb = rows.shape[1]
    if qtype in ("Q4_K", "Q5_K"):
        d = rows[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, SB, 1]
        dmin = rows[..., 2:4].copy().view(np.float16).astype(np.float32)
        packed = rows[..., 4:16].reshape(n, sb, 3, 4)
        lo, hi, both = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        scale = d * sc.astype(np.float32)  # [N, SB, 8], exact
        mins = -(dmin * mn.astype(np.float32))
        planes = np.stack([scale, mins], axis=-1).reshape(n, sb * 8, 2)
        at = 16 if qtype == "Q4_K" else 48  # Q5_K: 32 bytes of fifth bits first
        qs = rows[..., at : at + 128].reshape(n, sb, 4, 1, 32) >> np.array(
            [0, 4], np.uint8
        ).reshape(1, 1, 1, 2, 1)
        codes = (qs & 0x0F).astype(np.uint8).reshape(n, sb, 8, 32)
        if qtype == "Q4_K":
            return codes.reshape(n, k), planes
        # Sub-block j's fifth bits: bit j of the 32 bytes, weight by weight.
        fifth = rows[..., 16:48].reshape(n, sb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
            1, 1, 8, 1
        )
        return (codes | ((fifth & 1) << 4)).reshape(n, k), planes
    shifted = rows[..., 0:128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 1, 2, 1
    )
    low = (shifted & 0x0F).reshape(n, sb, 2, 4, 32)  # [.., half, quarter, 32]
    pairs = rows[..., 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    high = pairs & 0x03  # [.., half, quarter, 32]
    signed = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    sc = rows[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, SB, 16]
    d = rows[..., 208:210].copy().view(np.float16).astype(np.float32)
    return signed, (d * sc).reshape(n, sb * 16, 1)
