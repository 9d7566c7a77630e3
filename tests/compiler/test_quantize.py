"""Quantization schemes, compiled: each against transformers running the same quantized
weights (every linear but the lm_head replaced by its dequantized codes), so kiln's greedy
ids must match exactly and its logits closely; and the flags' refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from oracle import assert_continues_as, assert_rounds_like, round_linear_inputs
from transformers import AutoModelForCausalLM

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.core.quant import dequantize, quantize

SHAPE = {"hidden_size": 128, "intermediate_size": 256}
SCHEMES = {
    "int8wo": ({"torchao_config": "int8wo"}, "int8", 0),
    "int4wo-32": ({"torchao_config": "int4wo-32"}, "uint4", 32),
    "int4wo-64": ({"torchao_config": "int4wo-64"}, "uint4", 64),
    "fp8": ({"quantization": "fp8"}, "fp8_e4m3", 0),
}
# w8a8_int8 quantizes activations too: held to its own kernel reference (tests/kernels) and
# to transformers on the quantized weights with a looser bound here.
PROMPTS = [[1, 5, 9, 33], list(range(3, 43))]


def quantized_reference(ckpt: Path, fmt: str, group: int) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                w = mod.weight
                mod.weight.copy_(dequantize(*quantize(w, fmt, group or w.shape[1]), fmt))
    return hf


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_scheme_matches_transformers_on_the_same_quantized_weights(
    scheme: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    flags, fmt, group = SCHEMES[scheme]
    ckpt = checkpoint("qwen2", **SHAPE)  # biases too
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt), **flags), art)
    graph = json.loads((art / "graph.json").read_text())
    quant = [n for n in graph["nodes"] if n["op"] == "quant_linear"]
    # q/k/v and gate/up are fused: 4 linears per layer, each quantized; the lm_head is not.
    assert len(quant) == 4 * 2 and all(n["attrs"]["format"] == fmt for n in quant)
    assert sum(n["op"] in ("linear", "packed_linear") for n in graph["nodes"]) == 1

    hf = quantized_reference(ckpt, fmt, group)
    assert_continues_as(Engine(art, max_total_tokens=1024), hf, PROMPTS)


def test_phi3_fused_and_reordered_rows_quantize_with_their_scales(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Phi-3's q/k/v are cut from one tensor and q/k rows reordered for the partial rotary:
    group-quantized, each row must keep its own codes and scales through the cut and the
    reorder (transformers quantizes the fused tensors row by row alike)."""
    ckpt = checkpoint("phi3", rope_scaling=None, **SHAPE)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt), torchao_config="int4wo-32"), art)
    graph = json.loads((art / "graph.json").read_text())
    assert sum(n["op"] == "quant_linear" for n in graph["nodes"]) == 4 * 2
    hf = quantized_reference(ckpt, "uint4", 32)
    assert_continues_as(Engine(art, max_total_tokens=1024), hf, PROMPTS)


def test_w8a8_int8_compiles_to_int8_dot_products(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Its activations are quantized too, so it is held to its kernel's integer reference
    (tests/kernels) and to the real model's quality gate; here: the graph, and logits near
    the float ones."""
    ckpt = checkpoint("llama", **SHAPE)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt), quantization="w8a8_int8"), art)
    graph = json.loads((art / "graph.json").read_text())
    quant = [n for n in graph["nodes"] if n["op"] == "quant_linear"]
    assert len(quant) == 4 * 2 and {n["attrs"]["format"] for n in quant} == {"w8a8_int8"}
    layouts = {w["layout"] for w in graph["weights"].values() if "layout" in w}
    assert any(x.startswith("a8panels") for x in layouts)
    seq = PROMPTS[1]
    got = Engine(art, max_total_tokens=1024).prompt_logits(seq)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    # A random model's activations are rougher than a trained one's: 11% measured here; a
    # wrong scale or correction term is off by multiples.
    assert (got - ref).abs().max() < 0.2 * ref.abs().max()


@pytest.mark.parametrize("scheme", ["int4wo-32", "int8wo"])
def test_int8_activations_match_transformers_rounding_the_same(
    scheme: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """--quantize-activations int8 on a weight-only scheme: the same codes, each linear's
    input rounded to int8 per weight group (int8wo: per row); transformers on the same
    quantized weights with that rounding gives kiln's logits up to float32 rounding and
    ties (oracle.assert_rounds_like)."""
    flags, fmt, group = SCHEMES[scheme]
    ckpt = checkpoint("qwen2", **SHAPE)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt), quantize_activations="int8", **flags), art)
    graph = json.loads((art / "graph.json").read_text())
    quant = [n for n in graph["nodes"] if n["op"] == "quant_linear"]
    assert len(quant) == 4 * 2 and {n["attrs"]["format"] for n in quant} == {f"{fmt}_a8"}
    hf = quantized_reference(ckpt, fmt, group)
    seq = PROMPTS[1]
    with torch.no_grad():
        plain = hf(torch.tensor([seq])).logits[0]
        round_linear_inputs(hf, group or None, skip=("lm_head",))
        ref = hf(torch.tensor([seq])).logits[0]
    assert_rounds_like(Engine(art, max_total_tokens=1024).prompt_logits(seq), ref, plain)


def test_schemes_store_fewer_bytes(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = checkpoint("llama", **SHAPE)
    sizes = {}
    for name, flags in (("float", {}), ("int8wo", {"torchao_config": "int8wo"})):
        art = tmp_path / name
        compile_model(ServerArgs(model_path=str(ckpt), **flags), art)
        sizes[name] = (art / "weights" / "rank0.safetensors").stat().st_size
    # Layer matrices shrink 4x; the float embedding and lm_head stay.
    assert sizes["int8wo"] < 0.75 * sizes["float"]


def test_quantization_flags_are_refused_in_one_line(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = str(checkpoint("llama", **SHAPE))
    cases = [
        ({"torchao_config": "int3wo"}, "--torchao-config int3wo: kiln runs int8wo, int4wo-32"),
        (
            {"torchao_config": "int8wo", "quantization": "fp8"},
            "--quantization and --torchao-config: give one of them",
        ),
        (
            {"quantization": "fp8", "device": "cuda", "target_isa": "sm_90"},
            "--quantization fp8: quantized kernels exist for cpu targets only",
        ),
        ({"quantization": "gguf"}, "--quantization gguf: the checkpoint is not a GGUF file"),
        ({"quantization": "mxfp4"}, "--quantization mxfp4: the checkpoint has no MXFP4 tensors"),
        (
            {"torchao_config": "int4wo-256"},
            "--torchao-config int4wo-256: group 256 does not divide the 128 inputs of",
        ),
        ({"quantize_activations": "int8"}, "--quantize-activations int8: needs quantized"),
        (
            {"quantize_activations": "int8", "quantization": "fp8"},
            "--quantize-activations int8: applies to 4- and 8-bit integer weights, not "
            "--quantization fp8",
        ),
    ]
    for flags, message in cases:
        with pytest.raises(ArgError, match=message):
            compile_model(ServerArgs(model_path=ckpt, **flags), tmp_path / "a")
    with pytest.raises(ArgError, match="--quantization bitsandbytes: is not implemented"):
        ServerArgs.from_cli(["--model-path", ckpt, "--quantization", "bitsandbytes"])


def _fp8_checkpoint(src: Path, dst: Path, block: bool) -> dict[str, torch.Tensor]:
    """`src` as an fp8 checkpoint the way DeepSeek-V3 / Qwen3-FP8 are published (fp8 e4m3
    weights, `weight_scale_inv` per 128 x 128 block) or per tensor (`weight_scale`); the
    lm_head stays in the float dtype. Returns the dequantized weights (the oracle's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, dequant = {}, {}
    for name, w in tensors.items():
        if w.dim() != 2 or "embed" in name or "lm_head" in name:
            out[name] = w
            continue
        n, k = w.shape
        if block:
            rows = -(-n // 128) * 128  # the last block of rows may be partial (k_proj: 64)
            padded = torch.cat([w, w.new_zeros(rows - n, k)])
            blocks = padded.reshape(rows // 128, 128, k // 128, 128).abs().amax((1, 3))
            inv = blocks / 448.0
            full = inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n]
            out[name + "_scale_inv"] = inv
        else:
            inv = w.abs().amax() / 448.0
            full = inv
            out[name + "_scale"] = inv.reshape(1)
        q = (w / full).to(torch.float8_e4m3fn)
        out[name] = q
        dequant[name] = q.float() * full
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block:
        cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequant


@pytest.mark.parametrize("block", [True, False], ids=["block-128", "per-tensor"])
def test_fp8_checkpoints_run_as_stored(
    block: bool, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = checkpoint("llama", **SHAPE)
    fp8 = tmp_path / "fp8-ckpt"
    dequant = _fp8_checkpoint(src, fp8, block)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(fp8)), art)
    graph = json.loads((art / "graph.json").read_text())
    quant = [n for n in graph["nodes"] if n["op"] == "quant_linear"]
    assert len(quant) == 4 * 2 and {n["attrs"]["format"] for n in quant} == {"fp8_e4m3"}
    assert {n["attrs"]["group"] for n in quant} == ({128} if block else {128, 256})
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequant:
                p.copy_(dequant[name])
    engine = Engine(art, max_total_tokens=1024)
    seq = PROMPTS[1]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(seq), ref, atol=1e-4, rtol=0)
    with pytest.raises(ArgError, match="--quantization w8a8_int8: the checkpoint is fp8"):
        compile_model(ServerArgs(model_path=str(fp8), quantization="w8a8_int8"), tmp_path / "b")
