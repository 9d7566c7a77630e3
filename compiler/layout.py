"""Weight layouts the artefact can store, shared by the layout pass, the weight writer and
the loader (no torch import: the loader checks shapes from the graph alone).

- "rows": the tensor as the model defines it.
- "panels{L}x{G}": a linear's [N, K] weight for kiln_cpu's linear kernels, as panels of L
  output columns (one vector of fp32), [N_pad / L][K][L]; N padded with zeros to whole
  groups of G panels (the wide micro-tile's width), so every panel is one contiguous stream
  and no group runs short. L and G are fixed by the target's build of the kernels.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kiln.compiler.target import Target

if TYPE_CHECKING:
    import torch

LAYOUT = re.compile(r"rows|panels(8|16)x([1-8])")


def panel_shape(target: Target) -> tuple[int, int]:
    """(lanes, panels per group) of the target's kiln_cpu build (csrc: LANES, GROUP_PANELS):
    AVX-512 has 32 vector registers for a 6 x 4 wide tile, AVX2 16 for 4 x 3."""
    return (16, 4) if target.vector_lanes == 16 else (8, 3)


def panels_name(lanes: int, group: int) -> str:
    return f"panels{lanes}x{group}"


def panels_of(layout: str) -> tuple[int, int] | None:
    """(lanes, group) of a panels layout; None for plain rows."""
    hit = LAYOUT.fullmatch(layout)
    if hit is None:
        raise ValueError(f"unknown weight layout {layout!r}")
    return None if layout == "rows" else (int(hit.group(1)), int(hit.group(2)))


def stored_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in under `layout`."""
    panels = panels_of(layout)
    if panels is None:
        return shape
    lanes, group = panels
    n, k = shape
    return (-(-n // (lanes * group)) * group, k, lanes)


def pack_panels(w: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, K] rows -> the stored tensor of a panels layout."""
    import torch

    panels = panels_of(layout)
    assert panels is not None
    lanes, group = panels
    n, k = w.shape
    padded = -(-n // (lanes * group)) * lanes * group
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.view(padded // lanes, lanes, k).transpose(1, 2).contiguous()
