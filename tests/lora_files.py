"""Random LoRA adapters in PEFT's layout for the tiny test checkpoints, and the oracle:
transformers on the checkpoint with each adapter's delta merged into its weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    checkpoint: Path,
    out: Path,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ALL,
    seed: int = 0,
    std: float = 0.2,
    config: dict[str, Any] | None = None,
    rank_pattern: dict[str, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A PEFT adapter folder for `checkpoint` (a transformers folder) with random A and B
    (PEFT starts B at zero; these are non-zero so the adapter changes the output); a module
    `rank_pattern` names (its whole name or last dotted parts) gets that rank; A and B
    stored in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, torch.nn.Linear):
            r = _pattern(rank_pattern or {}, name, rank)
            a = torch.randn(int(r), module.in_features, generator=gen) * std
            b = torch.randn(module.out_features, int(r), generator=gen) * std
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(dtype)
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "base_model_name_or_path": str(checkpoint),
        "rank_pattern": rank_pattern or {},
        **(config or {}),
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def merged_model(checkpoint: Path, adapter: Path | None) -> Any:
    """transformers' model of `checkpoint` with `adapter`'s deltas merged (W + s B A)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model if adapter is None else merge_into(model, adapter)


def merge_into(model: Any, adapter: Path) -> Any:
    """`model` with `adapter`'s deltas added to its weights (W + s B A)."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            r = _pattern(cfg.get("rank_pattern") or {}, name, cfg["r"])
            scale = _pattern(cfg.get("alpha_pattern") or {}, name, cfg["lora_alpha"]) / r
            modules[name].weight += scale * (b.float() @ a.float())
    return model


def _pattern(table: dict[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern value of `module` (keys as names)."""
    for key, value in table.items():
        if module == key or module.endswith("." + key):
            return value
    return default
