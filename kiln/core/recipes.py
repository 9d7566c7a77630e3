"""Row orders of weight recipes (kiln/core/ir.py WeightSpec): which rows of the inner
tensor a {"head_parts"} or {"rotary_order"} recipe takes, in order. The compiler builds
weights with them (compiler/compile.py); LoRA adapters' B matrices follow the same rows
(runtime/lora.py)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.models.rope import rotary_order


def head_part_rows(src: dict[str, Any]) -> torch.Tensor:
    """Row order of a {"head_parts"} recipe."""
    parts = src["parts"]
    width = sum(parts)
    lo, hi = src.get("head_range") or (0, src["heads"])  # a tensor-parallel rank's heads
    out, start = [], 0
    for i, n in enumerate(parts):
        within = torch.arange(start, start + n)
        if src["deinterleave"] and i == len(parts) - 1:
            within = torch.cat((within[0::2], within[1::2]))
        out.append((torch.arange(lo, hi)[:, None] * width + within[None, :]).reshape(-1))
        start += n
    return torch.cat(out)


def rotary_rows(src: dict[str, Any]) -> torch.Tensor:
    """Row order of a {"rotary_order"} recipe: each head's rows in rotary_order."""
    head, rotary = src["head_dim"], src["rotary_dim"]
    inner = src["rotary_order"]
    rows = (inner["stop"] - inner["start"]) if "slice" in inner else inner["shape"][0]
    order = rotary_order(head, rotary)
    return (torch.arange(0, rows, head)[:, None] + order[None, :]).reshape(-1)
