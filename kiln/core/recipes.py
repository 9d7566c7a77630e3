"""Row orders of weight recipes (kiln/core/ir.py WeightSpec): which rows of the inner
tensor a {"head_parts"} or {"rotary_order"} recipe takes, in order. The compiler builds
weights with them (compiler/compile.py); LoRA adapters' B matrices follow the same rows
(runtime/lora.py)."""

from __future__ import annotations

from typing import Any

import torch


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's features under which rope over the first `rotary_dim` of them
    (rotate-half pairs i, i + rotary_dim/2) is rope over the whole head (pairs i,
    i + head_dim/2) with the pass-through pairs at frequency 0: [rotated first half,
    passed first half, rotated second half, passed second half]. With `interleaved` the
    rotated features' pairs are (2i, 2i + 1) (GLM's, ERNIE's rope): their evens are taken
    as the first half, their odds as the second. q and k rows are stored in this order;
    their dot products, hence attention, do not change."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    spans = ((0, r), (2 * r, 2 * r + p), (r, 2 * r), (2 * r + p, head_dim))
    order = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
    if not interleaved:
        return order
    pairs = torch.arange(rotary_dim)
    halves = torch.cat((pairs[0::2], pairs[1::2], torch.arange(rotary_dim, head_dim)))
    return halves[order]


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
    order = rotary_order(head, rotary, bool(src.get("interleaved")))
    return (torch.arange(0, rows, head)[:, None] + order[None, :]).reshape(-1)


# LoRA's projections (PEFT module names; runtime/lora.py): a graph linear whose weight is
# built from checkpoint tensors of these modules alone can take an adapter's delta. A
# linear kiln fused serves the modules of its parts; qkv_proj and gate_up_proj are
# checkpoints' own fused modules (Phi-3).
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    *FUSED_MODULES,
)


def recipe_loads(src: dict[str, Any]) -> list[dict[str, Any]]:
    """The checkpoint tensors ({"load"} recipes) a weight recipe reads, in its order."""
    if "load" in src:
        return [src]
    out: list[dict[str, Any]] = []
    for key in ("quantize", "concat", "join", "slice", "rotary_order", "head_parts", "shift"):
        inner = src.get(key)
        if isinstance(inner, dict):
            out += recipe_loads(inner)
        elif isinstance(inner, list):
            for s in inner:
                out += recipe_loads(s)
    return out


def lora_modules(source: dict[str, Any]) -> list[str]:
    """The checkpoint modules (`model.layers.0.self_attn.q_proj`) a linear's weight recipe
    is built from, when they are all LoRA projections; else []."""
    loads = recipe_loads(source.get("quantize", source))
    modules = [str(s["load"]).removesuffix(".weight") for s in loads]
    if not modules or any(m.rsplit(".", 1)[-1] not in LORA_MODULES for m in modules):
        return []
    return modules
