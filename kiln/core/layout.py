"""Weight layouts the artefact can store, shared by the layout pass, the weight writer and
the loader (no torch import: the loader checks shapes from the graph alone).

- "rows": the tensor as the model defines it.
- "panels{L}x{G}": a linear's [N, K] weight for kiln_cpu's linear kernels, as panels of L
  output columns (one vector of fp32), [N_pad / L][K][L]; N padded with zeros to whole
  groups of G panels (the wide micro-tile's width), so every panel is one contiguous stream
  and no group runs short. L and G are fixed by the target's build of the kernels.
- "q8panels{L}" / "q4panels{L}": a quantized linear's [N, K] codes for the same kernels,
  panels of L columns with N padded to whole panels: one byte per k ([N_pad / L][K][L],
  int8 or fp8 codes) or two k's per byte ([N_pad / L][K / 2][L], k even in the low nibble).
- "q5panels{L}": 5-bit codes (0..31), the q4 nibble panels [N_pad / L][K / 2][L] then a
  plane of their fifth bits [N_pad / L][K / 8][L], bit j of a lane's byte b for k = 8b + j;
  one uint8 tensor [N_pad / L][K / 2 + K / 8][L].
- "q6panels{L}": 6-bit codes (0..63), the q4 nibble panels [N_pad / L][K / 2][L] then a
  plane of their top two bits [N_pad / L][K / 4][L], bits 2j and 2j + 1 of a lane's byte b
  for k = 4b + j; one uint8 tensor [N_pad / L][K / 2 + K / 4][L].
- "a8panels{L}": int8 codes for int8 dot products of 4 k's a lane (w8a8_int8, int8_a8),
  [N_pad / L][K / 4][L][4].
- "a4panels{L}": 4-bit codes for the same dot products (uint4_a8), [N_pad / L][K / 8][L][4]
  bytes: byte j of a lane's 4 holds k = 8b + j in its low nibble, 8b + 4 + j in its high.
- "a5panels{L}" / "a6panels{L}": 5- and 6-bit codes for those dot products (the int8-
  activation forms of the GGUF 5-bit, Q5_K and Q6_K formats): a4's nibbles [N_pad / L][K / 8]
  [L][4], then the bits above them as top bytes [N_pad / L][K / 8U][L][4], a unit of U
  blocks of 8 k's (a5: U = 4, one bit a code; a6: U = 2, two bits) a byte for each code
  byte: block i's low-nibble code's top bits at bit iw, its high-nibble code's at 4 + iw
  (w the bits a code); one uint8 tensor [N_pad / L][K / 2 + K / 8 (a6: K / 4)][L], K a
  multiple of 8U.
- "spanels{L}": the scales (and mins) of those codes, logical [N, K / group, P] with P = 1
  (scale) or 2 (scale, min), stored [N_pad / L][K / group][P][L].
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kiln.core.lazy import lazy_module
from kiln.core.target import Target

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

LAYOUT = re.compile(r"rows|panels(8|16)x([1-8])|(q8|q4|q5|q6|a8|a4|a5|a6|s|k)panels(8|16)")


def panel_shape(target: Target) -> tuple[int, int]:
    """(lanes, panels per group) of the target's kiln_cpu build (csrc: LANES, GROUP_PANELS):
    AVX-512 has 32 vector registers for a 6 x 4 wide tile, AVX2 16 for 4 x 3."""
    return (16, 4) if target.vector_lanes == 16 else (8, 3)


def panels_name(lanes: int, group: int) -> str:
    return f"panels{lanes}x{group}"


def _match(layout: str) -> re.Match[str]:
    hit = LAYOUT.fullmatch(layout)
    if hit is None:
        raise ValueError(f"unknown weight layout {layout!r}")
    return hit


def panels_of(layout: str) -> tuple[int, int] | None:
    """(lanes, group) of an fp32 panels layout; None for any other."""
    hit = _match(layout)
    return (int(hit.group(1)), int(hit.group(2))) if hit.group(1) else None


def qpanels_of(layout: str) -> tuple[str, int] | None:
    """(kind, lanes) of a quantized layout (kind q8, q4, q5, q6, a8, a4, s or k); None for
    any other."""
    hit = _match(layout)
    return (hit.group(3), int(hit.group(4))) if hit.group(3) else None


def lanes_of(layout: str) -> int | None:
    """The vector width a layout was stored for; None for plain rows."""
    panels, q = panels_of(layout), qpanels_of(layout)
    return panels[0] if panels else (q[1] if q else None)


def stored_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in under `layout`."""
    panels = panels_of(layout)
    if panels is not None:
        lanes, group = panels
        n, k = shape
        return (-(-n // (lanes * group)) * group, k, lanes)
    q = qpanels_of(layout)
    if q is None:
        return shape
    kind, lanes = q
    tiles = -(-shape[0] // lanes)
    if kind == "s":
        return (tiles, shape[1], shape[2], lanes)
    if kind == "k":
        return (tiles, shape[1] * shape[2], lanes)
    if kind in ("a8", "a4"):
        return (tiles, shape[1] // (4 if kind == "a8" else 8), lanes, 4)
    if kind in ("q5", "q6", "a5", "a6"):
        return (tiles, shape[1] // 2 + shape[1] // (8 if kind in ("q5", "a5") else 4), lanes)
    return (tiles, shape[1] // 2 if kind == "q4" else shape[1], lanes)


def pack_panels(w: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, K] rows -> the stored tensor of a panels layout."""
    panels = panels_of(layout)
    assert panels is not None
    lanes, group = panels
    n, k = w.shape
    padded = -(-n // (lanes * group)) * lanes * group
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.view(padded // lanes, lanes, k).transpose(1, 2).contiguous()


def pack_qpanels(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Codes [N, K] (one per element; 4-bit ones as uint8 0..15) or scales [N, G, P] -> the
    stored tensor of a quantized layout."""
    q = qpanels_of(layout)
    assert q is not None
    kind, lanes = q
    n = t.shape[0]
    padded = -(-n // lanes) * lanes
    if padded != n:
        t = torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])])
    tiles = t.view(padded // lanes, lanes, *t.shape[1:])
    if kind == "s":  # [T, L, G, P] -> [T, G, P, L]
        return tiles.permute(0, 2, 3, 1).contiguous()
    if kind == "k":  # [T, L, SB, R] -> [T, SB * R, L]
        return tiles.reshape(tiles.shape[0], lanes, -1).transpose(1, 2).contiguous()
    if kind == "a8":  # [T, L, K] -> [T, K / 4, L, 4]
        return tiles.view(tiles.shape[0], lanes, -1, 4).permute(0, 2, 1, 3).contiguous()
    if kind in ("a4", "a5", "a6"):  # [T, L, K] -> [T, L, K / 8, 2, 4] -> [T, K / 8, L, 4]
        blocks = tiles.view(tiles.shape[0], lanes, -1, 2, 4) & 0xF
        packed = (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).permute(0, 2, 1, 3)
        if kind == "a4":
            return packed.contiguous()
        nibbles = packed.reshape(tiles.shape[0], -1, lanes)  # [T, K / 2, L] bytes
        return torch.cat([nibbles, _top_bytes(tiles, 2 if kind == "a6" else 1)], dim=1)
    panels = tiles.transpose(1, 2).contiguous()  # [T, K, L]
    if kind == "q8":
        return panels
    low = panels & 0xF if kind in ("q5", "q6") else panels
    nibbles = low[:, 0::2] | (low[:, 1::2] << 4)
    if kind == "q4":
        return nibbles.contiguous()
    # the top bits above each nibble, `width` a k: a byte a lane per 8 / width k's
    width = 1 if kind == "q5" else 2
    top = (panels >> 4).view(panels.shape[0], -1, 8 // width, panels.shape[2])
    shifts = (torch.arange(8 // width, dtype=torch.uint8) * width).view(1, 1, -1, 1)
    packed = (top << shifts).sum(2, dtype=torch.uint8)
    return torch.cat([nibbles, packed], dim=1).contiguous()


def _top_shifts(width: int) -> torch.Tensor:
    """Where block i's low (h = 0) and high (h = 1) nibble's top bits sit in a top byte of a
    unit of 4 / width blocks: bit 4h + i width, as [U, 2, 1]."""
    unit = 4 // width
    blocks = torch.arange(unit, dtype=torch.uint8).view(unit, 1, 1) * width
    return blocks + torch.tensor([0, 4], dtype=torch.uint8).view(1, 2, 1)


def _top_bytes(tiles: torch.Tensor, width: int) -> torch.Tensor:
    """The bits of codes [T, L, K] above their nibbles (`width` of them) as a5 / a6's top
    bytes [T, K / 8U * 4, L] ([T][K / 8U][L][4] in memory)."""
    t, lanes, k = tiles.shape
    unit = 4 // width
    if k % (8 * unit):
        raise ValueError(f"{k} inputs: 5- and 6-bit codes need a multiple of {8 * unit}")
    top = (tiles >> 4).view(t, lanes, k // (8 * unit), unit, 2, 4) << _top_shifts(width)
    packed = top.sum((3, 4), dtype=torch.uint8)  # [T, L, K / 8U, 4]
    return packed.permute(0, 2, 1, 3).reshape(t, -1, lanes).contiguous()


def _unpack_top_bytes(stored: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """a5 / a6's top bytes [T, K / 8U * 4, L] -> each code's top bits [T, K, L]."""
    t, _, lanes = stored.shape
    unit = 4 // width
    units = stored.view(t, k // (8 * unit), lanes, 1, 1, 4)
    bits = (units >> _top_shifts(width)) & ((1 << width) - 1)  # [T, K / 8U, L, U, 2, 4]
    return bits.permute(0, 1, 3, 4, 5, 2).reshape(t, k, lanes)


def unpack_codes(codes: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """Codes stored in layout `kind` (q8, q4, q5, q6, a8, a4) -> [rows, K], one code per
    element (4-, 5- and 6-bit codes as 0..15 / 0..31 / 0..63), as `pack_qpanels` had them."""
    if kind == "a8":  # [T, K/4, L, 4] -> [T, K, L]
        codes = codes.permute(0, 1, 3, 2).reshape(codes.shape[0], -1, codes.shape[2])
    elif kind in ("a5", "a6"):  # a4's nibbles [T, K/2, L] as [T, K/8, L, 4], then top bytes
        tiles, stored, lanes = codes.shape
        k = stored * (8 if kind == "a5" else 4) // (5 if kind == "a5" else 3)
        nib = codes[:, : k // 2].reshape(tiles, k // 8, lanes, 4)
        low = unpack_codes(nib, "a4", tiles * lanes)  # [T * L, K]
        low = low.view(tiles, lanes, k).transpose(1, 2)
        width = 2 if kind == "a6" else 1
        codes = low | (_unpack_top_bytes(codes[:, k // 2 :], width, k) << 4)
    elif kind == "a4":  # [T, K/8, L, 4] bytes -> [T, K, L], 4 low nibbles first
        t, blocks, lanes, _ = codes.shape
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=3)  # [T, K/8, L, 2, 4]
        codes = nibbles.permute(0, 1, 3, 4, 2).reshape(t, blocks * 8, lanes)
    elif kind == "q4":  # [T, K/2, L] bytes -> [T, K, L], k even from the low nibble
        tiles, _, lanes = codes.shape
        codes = torch.stack([codes & 0xF, codes >> 4], dim=2).reshape(tiles, -1, lanes)
    elif kind in ("q5", "q6"):  # nibbles [T, K/2, L], then top bits [T, K/8 or K/4, L]
        tiles, stored, lanes = codes.shape
        width = 1 if kind == "q5" else 2  # top bits a k
        half = stored * 4 // (5 if width == 1 else 6)  # K/2 of K/2 + K/8 (or K/4)
        nib, packed = codes[:, :half], codes[:, half:]
        low = torch.stack([nib & 0xF, nib >> 4], dim=2).reshape(tiles, -1, lanes)
        shifts = (torch.arange(8 // width, dtype=torch.uint8) * width).view(1, 1, -1, 1)
        top = ((packed.unsqueeze(2) >> shifts) & ((1 << width) - 1)).reshape(tiles, -1, lanes)
        codes = low | (top << 4)
    tiles, _, lanes = codes.shape
    return codes.transpose(1, 2).reshape(tiles * lanes, -1)[:rows]


def unpack_scales(scales: torch.Tensor, rows: int, record_bytes: int = 0) -> torch.Tensor:
    """spanels [T, G, P, L] -> [rows, G, P]; kpanels [T, SB * R, L] -> records [rows, SB, R]
    (`record_bytes` R)."""
    if record_bytes:
        return scales.transpose(1, 2).reshape(-1, scales.shape[1] // record_bytes, record_bytes)[
            :rows
        ]
    return scales.permute(0, 3, 1, 2).reshape(-1, *scales.shape[1:3])[:rows]
