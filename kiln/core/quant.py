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
- uint5:    w = q * s + m,       q in [0, 31]          (scale and min; GGUF Q5_1)
- uint4k / uint5k / int6k: GGUF's K-quant super-blocks as stored (Q4_K, Q5_K, Q6_K): the
  codes of uint4 / uint5 / int6 (w = (q - 32) * s, q in [0, 63]), and per `superblock`
  groups one float16 per plane times an int8 per group and plane (`kscale_values`).
- w8a8_int8: w = q * s, one scale per row, q in [-127, 127]; the kernel also quantizes
  the activations per token (SGLang's w8a8_int8) and sums in int32. Its second plane is
  128 * sum_k q, the correction for the kernel's unsigned activation bytes.
- uint4_a8 / int8_a8 (`--quantize-activations int8`): the weights of uint4 / int8, and the
  kernel quantizes the activations to int8 per group of `group` inputs (llama.cpp's way
  with its Q4_0 / Q4_1 / Q8_0 blocks) to sum each group in int32. uint4_a8's planes are
  uint4's; int8_a8's second plane is 128 * sum_k q over the group (as w8a8_int8's).
  The GGUF formats kept as stored have int8-activation forms of their own (int8h_a8,
  uint4h_a8, int8mh_a8, int5h_a8, uint5h_a8, uint4k_a8, uint5k_a8, int6k_a8): their codes and scales
  as they are, in layouts for the same int8 dot products (`_with_a8`).

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
    # their panel kind (kiln/core/layout.py)
    layout: Literal["q8", "q4", "q5", "q6", "a8", "a4", "a5", "a6"]
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
    # float16 already, kept exactly at their own size); uint8: as K-quant super-block
    # records (`superblock`). `full` names the format that holds the same weights with
    # float32 scales, one per group.
    scale_dtype: Literal["float32", "float16", "uint8"] = "float32"
    full: str | None = None
    # Groups per super-block: every `superblock` groups of a row share one float16 per
    # plane, and each group's scale (and min) is that times an int8 of its own. The scales
    # tensor is then uint8 records [N, K / (group * superblock), record_bytes]: the planes'
    # float16s (little-endian), then the int8s [superblock][planes]. 0: no super-blocks.
    superblock: int = 0

    @property
    def record_bytes(self) -> int:
        """Bytes of one super-block's scale record (2 a plane's float16, 1 an int8)."""
        return self.planes * (2 + self.superblock)

    @property
    def scale_layout(self) -> str:
        """The stored layout kind of this format's scales (kiln/core/layout.py)."""
        return "k" if self.superblock else "s"

    def scales_shape(self, n: int, k: int, group: int) -> tuple[int, int, int]:
        """The scales of an [n, k] weight: [n, groups, planes], or the super-block records
        [n, blocks, record_bytes]."""
        if self.superblock:
            return (n, k // (group * self.superblock), self.record_bytes)
        return (n, k // group, self.planes)


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
            gguf=(("IQ4_XS", 32),),  # its codebook's int8 values, d (ls - 32) a group
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
            gguf=(("Q2_K", 16),),  # its 2-bit codes, d sc and -dmin m a group of 16
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


def _super_blocks(
    full: str, name: str, qfmt: int, gguf: tuple[str, ...], group: int
) -> QuantFormat:
    """A GGUF K-quant kept as stored: `full`'s codes (int6k: its own), scales as super-block
    records (256 weights of a row per record)."""
    base = _FULL.get(full) if name != "int6k" else None
    if base is None:  # Q6_K: 6-bit codes, w = (q - 32) s; int8 holds them as q - 32
        base = QuantFormat(name, "uint8", "q6", 1, "qlinear", group_step=4, offset=32)
    return dataclasses.replace(
        base,
        name=name,
        qfmt=qfmt,
        gguf=tuple((g, group) for g in gguf),
        scale_dtype="uint8",
        full=full,
        superblock=256 // group,
        int8_activations=None,
    )


FORMATS: dict[str, QuantFormat] = {
    **_FULL,
    "int8h": _half_scales("int8", 8, (("Q8_0", 32), ("IQ4_NL", 32))),
    "uint4h": _half_scales("uint4", 9, (("Q4_0", 32), ("Q4_1", 32))),
    "int5h": _half_scales("int5", 10, (("Q5_0", 32),)),
    "uint5h": _half_scales("uint5", 15, (("Q5_1", 32),)),
    "int8mh": _half_scales("int8m", 16, ()),
    "uint4k": _super_blocks("uint4", "uint4k", 11, ("Q4_K",), 32),
    "uint5k": _super_blocks("uint5", "uint5k", 12, ("Q5_K",), 32),
    # Q3_K's 3-bit codes are 6-bit ones (q - 4 = q6 - 32), its scales Q6_K's record
    "int6k": _super_blocks("int8", "int6k", 13, ("Q6_K", "Q3_K"), 16),
}


def _with_a8(stored: str, layout: str, kind: int, qfmt: int | None = None) -> QuantFormat:
    """The int8-activation form of a 5-bit, 6-bit or super-block format: its codes in
    `layout` (kiln/core/layout.py) for kiln_cpu's ga8 linear, its scales as they are. The
    kernel's kind carries how the scales are stored: kind | 256 x (1 for float16, or the
    groups of a super-block)."""
    form = FORMATS[stored]
    mode = form.superblock or (1 if form.scale_dtype == "float16" else 0)
    return dataclasses.replace(
        form,
        name=f"{stored}_a8",
        layout=layout,  # type: ignore[arg-type]
        kernel="ga8",
        qfmt=qfmt,  # the embedding kernel's, where it reads the layout (else a table keeps
        # `stored`)
        ga8=kind | mode << 8,
        group_step=4 if layout == "a8" else 8,
        base=stored,
        int8_activations=None,
        gguf=(),
    )


# ga8 kinds in the C source: GA8_UINT4 = 0, GA8_UINT5 = 2, GA8_INT5 = 3, GA8_INT6 = 4,
# GA8_INT8H = 5 (Q8_0's codes and float16 scales as stored, no code-sum plane),
# GA8_INT8MH = 6 (Q8_0 and Q5_1 parts of one fused weight).
for _stored, _layout, _kind, _qfmt in (
    ("int8h", "a8", 5, 17),
    ("uint4h", "a4", 0, 18),
    ("int8mh", "a8", 6, None),
    ("int5h", "a5", 3, None),
    ("uint5h", "a5", 2, None),
    ("uint4k", "a4", 0, None),
    ("uint5k", "a5", 2, None),
    ("int6k", "a6", 4, None),
):
    FORMATS[f"{_stored}_a8"] = _with_a8(_stored, _layout, _kind, _qfmt)
    FORMATS[_stored] = dataclasses.replace(FORMATS[_stored], int8_activations=f"{_stored}_a8")

# Formats a wider one holds exactly: where a fused weight's parts are stored in several
# of these at one group size, they all run as the narrowest that holds every part (int8
# holds int5's codes minus 16; int8m holds all, an int8 or int5 part with a min of 0).
WIDENS = ("int5", "int8", "uint5", "int8m")


def widest(formats: set[str]) -> str | None:
    """The format that holds every one of `formats` exactly, None if there is none (a
    float16-scale or super-block format is held by its float32-scale one; float16-scale
    formats alone by the float16-scale form of the one that holds their float32 forms:
    int8h holds int5h, int8mh holds int8h and uint5h, as their float16s are the same)."""
    if len(formats) == 1:
        return next(iter(formats))
    full = {FORMATS[f].full or f for f in formats}
    if len(full) == 1:
        common = full.pop()
    elif full <= set(WIDENS):
        common = "int8" if full <= {"int5", "int8"} else "int8m"
    else:
        return None
    halves = all(FORMATS[f].scale_dtype == "float16" for f in formats)
    return f"{common}h" if halves and f"{common}h" in FORMATS else common


def widen(
    codes: np.ndarray, scales: np.ndarray, stored: str, fmt: str
) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales stored as `stored`, as format `fmt` that holds them exactly."""
    if stored == fmt:
        return codes, scales
    if widest({stored, fmt}) != fmt:
        raise QuantError(f"{stored} does not widen to {fmt}")
    form, to = FORMATS[stored], FORMATS[fmt]
    if form.superblock:
        scales = kscale_values(scales, stored)
    if (form.full or stored) == (to.full or fmt) and form.offset == to.offset:
        return codes, scales  # the same codes; scales are float32 in memory either way
    signed = (codes.astype(np.int16) - form.offset).astype(np.int8)
    if to.planes == 1 or form.has_min:
        return signed, scales
    return signed, np.concatenate([scales, np.zeros_like(scales)], axis=-1)


# GGUF block types kiln runs as they are: type -> (format, group).
GGUF_FORMATS = {t: (f.name, group) for f in FORMATS.values() for t, group in f.gguf}


def kscale_values(records: np.ndarray, fmt: str) -> np.ndarray:
    """A super-block format's scale records [N, SB, record_bytes] -> the float32 scales
    (and mins) [N, SB * superblock, planes] they stand for: each a float16 times an int8,
    exact in float32."""
    form = FORMATS[fmt]
    n, blocks, size = records.shape
    planes, per = form.planes, form.superblock
    if size != form.record_bytes:
        raise QuantError(f"{fmt} scale records are {form.record_bytes} bytes, not {size}")
    rec = np.ascontiguousarray(records)
    d = rec[..., : 2 * planes].copy().view(np.float16).astype(np.float32)  # [N, SB, P]
    ints = rec[..., 2 * planes :].copy().view(np.int8).astype(np.float32)
    return (d[:, :, None, :] * ints.reshape(n, blocks, per, planes)).reshape(n, -1, planes)


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
    if form.superblock:
        raise QuantError(f"{fmt} is GGUF {form.gguf[0][0]} blocks as stored, not made from floats")
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
        return _codes_for(g, s, fmt), s
    if fmt == "uint4":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = (hi - lo) / 15.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q, s, lo = _refine_uint4(g, s, lo)
        return q.to(torch.uint8).reshape(n, k), torch.cat([s, lo], dim=-1)
    if fmt == "int5":
        s = g.abs().amax(-1, keepdim=True) / 16.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        return _codes_for(g, s, fmt), s
    if fmt in ("uint5", "int8m"):
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = (hi - lo) / (31.0 if fmt == "uint5" else 255.0)
        s = torch.where(s > 0, s, torch.ones_like(s))
        m = lo if fmt == "uint5" else lo + 128.0 * s  # int8m: codes centred on 0
        planes = torch.cat([s, m], dim=-1)
        return _codes_for(g, planes, fmt), planes
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
    if fmt in ("uint4", "uint5", "int8m"):
        lo, hi, dtype = {"uint4": (0, 15, torch.uint8), "uint5": (0, 31, torch.uint8)}.get(
            fmt, (-128, 127, torch.int8)
        )
        q = torch.round((g - s[..., 1:]) / s[..., :1]).clamp(lo, hi)
        return q.to(dtype).reshape(n, -1)
    raise QuantError(f"no codes for scales of {fmt}")


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
    form = FORMATS[fmt]
    if form.superblock:
        s = torch.from_numpy(kscale_values(s.cpu().numpy(), fmt)).to(s.device)
    groups = s.shape[1]
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
    Super-blocks of 256, kept as they are (uint4k, uint5k, int6k: codes, and scale records
    of the super-block's float16s and the groups' integers): Q4_K = f16 d, f16 dmin, 12 bytes
    of eight 6-bit scales and mins, 128 bytes of nibbles (each 64 weights: 32 low nibbles,
    then the same bytes' high ones), w = (d sc) q - (dmin m) (a record of d, -dmin and the
    (sc, m) pairs); Q5_K = the same with 32 bytes of fifth bits before the nibbles (bit j for
    sub-block j); Q6_K = 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    f16 d, w = (d sc) (q - 32) (a record of d and the 16 scales)."""
    if qtype in _K_QUANTS:
        return _from_k_quant(np.ascontiguousarray(raw).reshape(n, k // 256, -1), qtype, n, k)
    if qtype in _TRANSCODED:
        return _TRANSCODED[qtype](np.ascontiguousarray(raw).reshape(n, -1), n, k)
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
    codes = _nibbles(rows[..., start : start + 16])
    if qtype == "Q4_0":
        m = -8.0 * d
    elif qtype == "Q4_1":
        m = rows[..., 2:4].copy().view(np.float16).astype(np.float32)
    else:
        raise QuantError(f"GGUF type {qtype} has no kiln format")
    return codes.reshape(n, k), np.concatenate([d, m], axis=-1)


_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")

# GGUF block types kiln has no kernel of their own for, held exactly by a wider format
# (twice or so their bytes in memory, against eight times or more as floats):
#   Q2_K (2.6 bits a weight) -> uint4 with float32 scales and mins a group of 16 (8 bits)
#   Q3_K (3.4) -> int6k, Q6_K's records (6.6); IQ4_NL (4.5) -> int8h, Q8_0's (8.5);
#   IQ4_XS (4.3) -> int8 with a float32 scale a group of 32 (9).
# Q2_K and Q3_K super-blocks of 256 run as two halves of 128, each 4 shifts x 2 parts of
# 16: weight 128 h + 32 j + 16 p + l is bits 2j of byte 32 h + 16 p + l of the codes
# (Q3_K: its third bit, bit 4 h + j of hmask byte 16 p + l), sub-block 8 h + 2 j + p.
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)  # llama.cpp's kvalues_iq4nl: the non-linear 4-bit codebook of IQ4_NL and IQ4_XS


def _nibbles(b: np.ndarray) -> np.ndarray:
    """16 bytes a block of 32 -> its codes: byte j's low nibble is weight j, its high one
    weight j + 16 (Q4_0, Q4_1, IQ4_NL, each IQ4_XS group)."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(np.uint8)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K low bits: qs [N, SB, 64] -> [N, SB, 2 (h), 4 (j), 2 (p), 16 (l)]."""
    n, sb = qs.shape[:2]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1, 1)
    return (qs.reshape(n, sb, 2, 1, 2, 16) >> shifts) & 3


def _from_q2_k(rows: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K = 16 bytes of (sc, m) nibbles, 64 of 2-bit codes, f16 d, f16 dmin:
    w = (d sc) q - (dmin m)."""
    sb = rows.reshape(n, k // 256, 84)
    d = sb[..., 80:82].copy().view(np.float16).astype(np.float32)  # [N, SB, 1]
    dmin = sb[..., 82:84].copy().view(np.float16).astype(np.float32)
    sc = sb[..., 0:16]
    scale = d * (sc & 0x0F).astype(np.float32)  # [N, SB, 16]
    low = -(dmin * (sc >> 4).astype(np.float32))
    codes = _two_bit_codes(sb[..., 16:80]).astype(np.uint8).reshape(n, k)
    return codes, np.stack([scale, low], axis=-1).reshape(n, k // 16, 2)


def _from_q3_k(rows: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K = 32 bytes of third bits, 64 of 2-bit codes, 12 bytes of sixteen 6-bit scales
    (stored + 32), f16 d: w = (d (sc - 32)) (q - 4), held as int6k codes q + 28."""
    sb = rows.reshape(n, k // 256, 110)
    nsb = sb.shape[1]
    hmask = sb[..., 0:32].reshape(n, nsb, 1, 1, 2, 16)
    bits = np.arange(8, dtype=np.uint8).reshape(1, 1, 2, 4, 1, 1)  # 4 h + j
    third = (hmask >> bits) & 1
    codes = (_two_bit_codes(sb[..., 32:96]) | (third << 2)).astype(np.uint8) + 28
    b = sb[..., 96:108].astype(np.uint16)  # the 12 scale bytes
    lo4, mid4, top = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    six = np.concatenate(
        [
            (lo4 & 0x0F) | ((top & 0x03) << 4),
            (mid4 & 0x0F) | (((top >> 2) & 0x03) << 4),
            (lo4 >> 4) | (((top >> 4) & 0x03) << 4),
            (mid4 >> 4) | (((top >> 6) & 0x03) << 4),
        ],
        axis=-1,
    )  # [N, SB, 16] in 0..63
    scales = (six.astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    records = np.concatenate([sb[..., 108:110], scales], axis=-1)  # d, then 16 scales
    return codes.reshape(n, k), np.ascontiguousarray(records)


def _from_iq4_nl(rows: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL = f16 d, 16 bytes of nibbles in Q4_0's order: w = d value(q)."""
    blocks = rows.reshape(n, k // 32, 18)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    return IQ4_VALUES[_nibbles(blocks[..., 2:18])].reshape(n, k), d


def _from_iq4_xs(rows: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS = f16 d, 16 bits of scales' high pairs, 4 bytes of their low nibbles, 128
    bytes of nibbles (each 32 weights: 16 bytes' low nibbles, then their high ones):
    w = (d (ls - 32)) value(q), ls = 6 bits a group of 32."""
    sb = rows.reshape(n, k // 256, 136)
    nsb = sb.shape[1]
    d = sb[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, SB, 1]
    high = sb[..., 2:4].copy().view(np.uint16)  # [N, SB, 1]
    ib = np.arange(8)
    low = (sb[..., 4:8][..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
    ls = low.astype(np.int32) | (((high >> (2 * ib).astype(np.uint16)) & 3) << 4).astype(np.int32)
    scales = d * (ls - 32).astype(np.float32)  # [N, SB, 8]
    codes = IQ4_VALUES[_nibbles(sb[..., 8:136].reshape(n, nsb, 8, 16))]
    return codes.reshape(n, k), scales.reshape(n, k // 32, 1)


_TRANSCODED = {
    "Q2_K": _from_q2_k,
    "Q3_K": _from_q3_k,
    "IQ4_NL": _from_iq4_nl,
    "IQ4_XS": _from_iq4_xs,
}


def _from_k_quant(rows: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Super-blocks [N, K / 256, bytes] of Q4_K, Q5_K or Q6_K -> codes [N, K] and scale
    records [N, K / 256, record_bytes]."""
    sb = rows.shape[1]
    if qtype in ("Q4_K", "Q5_K"):
        packed = rows[..., 4:16].reshape(n, sb, 3, 4)
        lo, hi, both = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        halves = rows[..., 0:4].copy()
        halves[..., 3] ^= 0x80  # -dmin: the min plane's float16, so that min = (-dmin) m
        records = np.concatenate([halves, np.stack([sc, mn], axis=-1).reshape(n, sb, 16)], -1)
        at = 16 if qtype == "Q4_K" else 48  # Q5_K: 32 bytes of fifth bits first
        qs = rows[..., at : at + 128].reshape(n, sb, 4, 1, 32) >> np.array(
            [0, 4], np.uint8
        ).reshape(1, 1, 1, 2, 1)
        codes = (qs & 0x0F).astype(np.uint8).reshape(n, sb, 8, 32)
        if qtype == "Q4_K":
            return codes.reshape(n, k), records
        # Sub-block j's fifth bits: bit j of the 32 bytes, weight by weight.
        fifth = rows[..., 16:48].reshape(n, sb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
            1, 1, 8, 1
        )
        return (codes | ((fifth & 1) << 4)).reshape(n, k), records
    shifted = rows[..., 0:128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 1, 2, 1
    )
    low = (shifted & 0x0F).reshape(n, sb, 2, 4, 32)  # [.., half, quarter, 32]
    pairs = rows[..., 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    six = (low | ((pairs & 0x03) << 4)).astype(np.uint8).reshape(n, k)  # q in [0, 63]
    records = np.concatenate([rows[..., 208:210], rows[..., 192:208]], axis=-1)  # d, 16 scales
    return six, np.ascontiguousarray(records)
