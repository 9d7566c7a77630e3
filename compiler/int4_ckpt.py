"""GPTQ and AWQ checkpoints: 4-bit weights packed eight to an int32, with float16 scales and
4-bit zero points per group of inputs, read into kiln's uint4 format (kiln/core/quant.py)
without loss.

Per linear `P` (out features N, in features K, group G; both methods: w = s (q - z)):

- GPTQ (`quant_method: gptq`): `P.qweight` int32 [K / 8, N], input k = 8 i + j in bits
  4j..4j+3 of row i; `P.qzeros` int32 [K / G, N / 8], output n = 8 c + j in bits 4j.. of
  column c; `P.scales` [K / G, N]; `P.g_idx` int32 [K], the group of each input. The
  original format (`checkpoint_format: gptq`, the default) stores each zero minus one;
  `gptq_v2` stores it as it is. With `desc_act` the groups are not runs of inputs (g_idx
  is a permutation's); kiln's format needs runs, so such a weight is read as floats.
- AWQ (`quant_method: awq`, GEMM layout): `P.qweight` int32 [K, N / 8] and `P.qzeros` int32
  [K / G, N / 8], both packed along the outputs with output 8 c + ORDER[j] in bits 4j of
  column c; `P.scales` [K / G, N]; zeros stored as they are.

In kiln's uint4 format w = q * scale + min, so min = -s z: exact in float32 (an fp16 scale
times a 5-bit zero), and so is the kernel's q * s + min.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

METHODS = ("gptq", "awq")
# AWQ's GEMM packing: bits 4j..4j+3 of a column hold output 8 c + AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PARTS = ("qweight", "qzeros", "scales", "g_idx")


class Int4CheckpointError(ValueError):
    """A GPTQ / AWQ checkpoint kiln cannot read as it is (bits, layout, shapes)."""


@dataclass(frozen=True)
class Int4Config:
    method: str  # gptq or awq (the group size comes from the tensors' shapes)
    zero_offset: int  # added to a stored zero (GPTQ's original format stores z - 1)

    @classmethod
    def of_checkpoint(cls, folder: Path) -> Int4Config | None:
        """The checkpoint's GPTQ / AWQ quantization_config (config.json, or the
        quantize_config.json AutoGPTQ writes beside it); None for any other checkpoint."""
        q = None
        config = folder / "config.json"
        if config.is_file():
            q = json.loads(config.read_text()).get("quantization_config")
        legacy = folder / "quantize_config.json"
        if not q and legacy.is_file():
            q = {"quant_method": "gptq", **json.loads(legacy.read_text())}
        method = str((q or {}).get("quant_method", "")).lower()
        if method not in METHODS:
            return None
        assert q is not None
        bits = int(q.get("bits", q.get("w_bit", 4)))
        if bits != 4:
            raise Int4CheckpointError(
                f"{method} checkpoint with {bits}-bit weights: kiln reads 4-bit ones"
            )
        if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
            raise Int4CheckpointError(
                f"awq checkpoint in the {q.get('version')!r} layout: kiln reads the gemm one"
            )
        if method == "awq" and not q.get("zero_point", True):
            raise Int4CheckpointError("awq checkpoint without zero points: kiln reads zero_point")
        v1 = method == "gptq" and q.get("checkpoint_format", "gptq") == "gptq"
        return cls(method, 1 if v1 else 0)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..] -> uint8 codes with each int32's 8 nibbles (low first) spread along `dim`."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    x = packed.to(torch.int32).unsqueeze(-1) >> shifts  # [.., 8] (arithmetic shift; masked)
    codes = (x & 0xF).to(torch.uint8)
    if dim == 0:  # [R, C, 8] -> [R, 8, C] -> [8R, C]
        return codes.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return codes.reshape(packed.shape[0], -1)  # [R, C, 8] -> [R, 8C]


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """Columns unpacked in nibble order -> in output order."""
    import torch

    c = codes.reshape(codes.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(j) for j in range(8)]
    return c[:, :, torch.tensor(inverse)].reshape(codes.shape)


@dataclass
class Int4Weight:
    """One linear's unpacked parts: codes uint8 [N, K], zeros int16 [N, G], scales float32
    [N, G], and the group of each input, g_idx int64 [K]."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    @property
    def runs(self) -> bool:
        """Whether the groups are runs of consecutive inputs of one size (kiln's format)."""
        k, groups = self.codes.shape[1], self.scales.shape[1]
        return k % groups == 0 and runs(self.g_idx, k // groups)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: s (q - z), each input with its group's s and z."""
        s = self.scales[:, self.g_idx]
        return s * (self.codes.float() - self.zeros[:, self.g_idx].float())

    def kiln_uint4(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K], scales [N, G, 2] = (s, -s z)) in kiln's uint4 format."""
        import torch

        assert self.runs
        return self.codes, torch.stack([self.scales, -self.scales * self.zeros.float()], -1)


def runs(g_idx: torch.Tensor, group: int) -> bool:
    """Whether input k is in group k // `group` for every k (no act-order permutation)."""
    import torch

    return bool(torch.equal(g_idx.to(torch.int64), torch.arange(g_idx.numel()) // group))


def unpack(cfg: Int4Config, parts: dict[str, torch.Tensor], name: str) -> Int4Weight:
    """A linear's stored parts (`PARTS`, g_idx optional) -> its codes, zeros and scales."""
    import torch

    missing = [p for p in PARTS[:3] if p not in parts]
    if missing:
        raise Int4CheckpointError(f"{cfg.method} weight {name!r} lacks {', '.join(missing)}")
    qweight, qzeros = parts["qweight"], parts["qzeros"]
    scales = parts["scales"].float()
    if cfg.method == "gptq":
        codes = _nibbles(qweight, 0).t()  # [K, N] -> [N, K]
        zeros = _nibbles(qzeros, 1)
    else:
        codes = _awq_columns(_nibbles(qweight, 1)).t()
        zeros = _awq_columns(_nibbles(qzeros, 1))
    n, k = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or zeros.shape != (groups, n):
        raise Int4CheckpointError(
            f"{cfg.method} weight {name!r}: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not agree"
        )
    if "g_idx" in parts:
        g_idx = parts["g_idx"].to(torch.int64)
    else:
        if k % groups:
            raise Int4CheckpointError(f"{name!r}: {groups} groups do not divide {k} inputs")
        g_idx = torch.arange(k) // (k // groups)
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise Int4CheckpointError(f"{cfg.method} weight {name!r}: g_idx does not fit its groups")
    return Int4Weight(
        codes.contiguous(),
        (zeros.to(torch.int16) + cfg.zero_offset).t().contiguous(),
        scales.t().contiguous(),
        g_idx,
    )


def shape_of(cfg: Int4Config, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
    """The [N, K] of the float weight a stored qweight stands for."""
    rows, cols = qweight_shape
    return (cols, rows * 8) if cfg.method == "gptq" else (cols * 8, rows)
