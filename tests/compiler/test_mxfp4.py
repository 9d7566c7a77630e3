"""GPT-OSS checkpoints as published: expert tensors in MXFP4 (P_blocks, P_scales), read
dequantized at compile time. The oracle is transformers' own MXFP4 unpacking
(`convert_moe_packed_tensors`) and transformers' model on the weights it gives."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from oracle import assert_continues_as
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.core.quant import dequantize_mxfp4

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, in, out] floats -> (blocks [experts, out, in / 32, 16], scales [.., in / 32])
    as GPT-OSS stores them: groups of 32 inputs, a power-of-two scale, e2m1 codes."""
    g = w.transpose(1, 2).float().reshape(*w.shape[:1], w.shape[2], w.shape[1] // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    q = g / torch.exp2(exp)[..., None]
    code = (q.abs()[..., None] - _E2M1).abs().argmin(-1) | ((q < 0).long() << 3)
    pairs = code.reshape(*code.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_unpacks_as_transformers_does() -> None:
    w = torch.randn(3, 64, 40) * torch.logspace(-3, 2, 40)  # scales over a wide range
    blocks, scales = pack_mxfp4(w)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales).transpose(1, 2), ref)
    assert (ref - w).abs().max() < w.abs().max() / 4  # a real rounding, not garbage


def test_gpt_oss_mxfp4_checkpoint_runs_as_transformers_on_its_weights(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = checkpoint("gpt_oss")
    floats, packed = tmp_path / "floats", tmp_path / "mxfp4"
    for d in (floats, packed):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    stored, rounded = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t)
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            rounded[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            stored[name] = rounded[name] = t
    save_file(rounded, str(floats / "model.safetensors"))
    save_file(stored, str(packed / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))

    art = tmp_path / "art"
    # SGLang's flag for such a checkpoint is accepted: it names what the checkpoint is.
    compile_model(ServerArgs(model_path=str(packed), dtype="float32", quantization="mxfp4"), art)
    hf = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    assert_continues_as(Engine(art, max_total_tokens=1024), hf, [[1, 5, 9, 33], list(range(3, 43))])
