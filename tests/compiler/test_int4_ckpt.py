"""GPTQ and AWQ checkpoints: the packing facts read by hand, then tiny checkpoints in each
layout compiled and run against transformers holding the same dequantized weights (greedy ids
exactly, logits closely), and the flags' refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from int4_files import write_int4_checkpoint
from oracle import hf_greedy, kiln_all_logits
from transformers import AutoModelForCausalLM

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.checkpoint import CheckpointError
from kiln.compiler.compile import compile_model
from kiln.compiler.int4_ckpt import Int4Config, unpack

SHAPE = {"hidden_size": 128, "intermediate_size": 256}
PROMPTS = [[1, 5, 9, 33], list(range(3, 43))]
WORD = 0x76543210  # nibbles 0, 1, ..., 7 from the low bits up


def test_gptq_packs_inputs_down_a_column_and_stores_zeros_minus_one() -> None:
    # one output, 8 inputs, one group: qweight [1, 1], qzeros [1, 1] (8 outputs' worth)
    cfg = Int4Config("gptq", 1)
    parts = {
        "qweight": torch.tensor([[WORD]], dtype=torch.int32),
        "qzeros": torch.tensor([[0x00000004]], dtype=torch.int32),
        "scales": torch.tensor([[0.5]], dtype=torch.float16),
    }
    with pytest.raises(ValueError, match="do not agree"):  # qzeros covers 8 outputs, not 1
        unpack(cfg, parts, "p")
    parts["qweight"] = torch.full((1, 8), WORD, dtype=torch.int32)
    parts["scales"] = torch.full((1, 8), 0.5, dtype=torch.float16)
    w = unpack(cfg, parts, "p")
    assert w.codes.shape == (8, 8) and w.codes[0].tolist() == list(range(8))
    assert w.zeros[:, 0].tolist() == [5, 1, 1, 1, 1, 1, 1, 1]  # stored + 1
    assert w.dequantize()[0].tolist() == [0.5 * (i - 5) for i in range(8)]


def test_awq_packs_outputs_along_a_row_in_its_interleaved_order() -> None:
    cfg = Int4Config("awq", 0)
    parts = {
        "qweight": torch.tensor([[WORD]], dtype=torch.int32),  # one input, 8 outputs
        "qzeros": torch.tensor([[WORD]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    w = unpack(cfg, parts, "p")
    # nibble j holds output (0, 2, 4, 6, 1, 3, 5, 7)[j]: output 1 is nibble 4, and so on
    assert w.codes[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert w.zeros[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


LAYOUTS = {
    "gptq-g32": ("gptq", 32, {}),
    "gptq_v2-per-row": ("gptq", -1, {"v2": True}),
    "gptq-act-order": ("gptq", 64, {"act_order": True}),
    "awq-g64": ("awq", 64, {}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_int4_checkpoint_matches_transformers_on_its_weights(
    layout: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    method, group, kw = LAYOUTS[layout]
    src = checkpoint("qwen2", **SHAPE)  # biases too: they stay float beside the packed weight
    ckpt = tmp_path / "ckpt"
    dequant = write_int4_checkpoint(src, ckpt, method, group, **kw)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt)), art)
    graph = json.loads((art / "graph.json").read_text())
    quant = [n for n in graph["nodes"] if n["op"] == "quant_linear"]
    if kw.get("act_order"):  # its groups are not runs of inputs: read as floats
        assert not quant
    else:
        assert len(quant) == 4 * 2 and {n["attrs"]["format"] for n in quant} == {"uint4"}
        assert {n["attrs"]["group"] for n in quant} == ({32} if group == 32 else {128, 256}
                                                        if group == -1 else {64})  # fmt: skip

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequant:
                p.copy_(dequant[name])
    engine = Engine(art, max_total_tokens=1024)
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, 12)
    seq = PROMPTS[1]
    with torch.no_grad():
        ref_logits = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(kiln_all_logits(engine, seq), ref_logits, atol=1e-4, rtol=0)


def test_int4_checkpoints_refuse_what_kiln_does_not_read(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = checkpoint("llama", **SHAPE)
    gptq = tmp_path / "gptq"
    write_int4_checkpoint(src, gptq, "gptq", 32)
    with pytest.raises(ArgError, match="--quantization awq: the checkpoint is gptq"):
        compile_model(ServerArgs(model_path=str(gptq), quantization="awq"), tmp_path / "a")
    with pytest.raises(ArgError, match="--quantization gptq: the checkpoint has no gptq"):
        compile_model(ServerArgs(model_path=str(src), quantization="gptq"), tmp_path / "a")
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gptq checkpoint with 8-bit weights"):
        compile_model(ServerArgs(model_path=str(gptq)), tmp_path / "a")
