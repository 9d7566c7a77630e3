"""The artefact: layout, cache hits, relocation, load formats, damage detection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.checkpoint import CheckpointError
from kiln.compiler.compile import compile_model
from kiln.core.artefact import FORMAT_VERSION, ArtefactError, FileCheck, read_manifest
from kiln.core.target import host_cpu_level

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = [1, 4, 9, 16, 25]


def compile_(ckpt: Path, out: Path, **kw):
    return compile_model(ServerArgs(model_path=str(ckpt), **{"dtype": "float32", **kw}), out)


def test_layout_and_manifest(artefact) -> None:
    art = artefact("qwen2")
    for rel in (
        "manifest.json",
        "graph.json",
        "weights/rank0.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ):
        assert (art / rel).is_file(), rel
    m = json.loads((art / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and m["target"]["device"] == "cpu"
    assert m["target"]["isa"] == host_cpu_level()
    assert m["torch_version"] == torch.__version__
    # (resolved: a cache entry records the spelling of the compile that made it, and the
    # session's cache may hold this key from a compile that said `auto`)
    assert m["cache_factors"]["compile_args"]["dtype"] == "float32"
    assert [p["pass"] for p in m["passes"]][:3] == ["dce", "shard", "fuse_qkv"]
    assert set(m["files"]) >= {"graph.json", "weights/rank0.safetensors"}
    weights = load_file(art / "weights/rank0.safetensors")
    # Weights are stored as the graph wants them: fused.
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights
    assert "model.layers.0.self_attn.q_proj.weight" not in weights
    assert "model.layers.0.mlp.gate_up_proj.weight" in weights
    # The kernels are built for the target and carried along; the packed linears' weights
    # are stored in the panel layout of that build.
    assert (art / "kernels/cpu_kernels.so").is_file()
    assert m["native"]["lanes"] in (8, 16) and m["files"]["kernels/cpu_kernels.so"]
    if host_cpu_level() != "x86-64":
        qkv = weights["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.dim() == 3 and qkv.shape[2] == m["native"]["lanes"]


def test_no_absolute_paths_inside(artefact, checkpoint) -> None:
    art = artefact("llama")
    ckpt = checkpoint("llama")
    for name in ("manifest.json", "graph.json"):
        text = (art / name).read_text()
        assert str(ckpt) not in text and str(art) not in text


def test_second_compile_is_a_cache_hit_and_a_change_is_not(
    checkpoint, tmp_path, fresh_cache
) -> None:
    ckpt = checkpoint("llama")
    first = compile_(ckpt, tmp_path / "art")
    again = compile_(ckpt, tmp_path / "art")
    assert not first.cache_hit and again.cache_hit and again.cache_key == first.cache_key
    other = compile_(ckpt, tmp_path / "art", page_size=4)
    assert not other.cache_hit and other.cache_key != first.cache_key
    m = json.loads((tmp_path / "art/manifest.json").read_text())
    assert m["compile_args"]["page_size"] == 4


def test_moved_artefact_still_runs(artefact, tmp_path) -> None:
    src = artefact("mistral")
    expected = Engine(src, max_total_tokens=256).generate(input_ids=PROMPT, sampling_params=GREEDY)
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(src, moved)
    got = Engine(moved, max_total_tokens=256).generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert got["output_ids"] == expected["output_ids"]


def test_damaged_weights_and_missing_manifest_are_clear_errors(damaged_llama: Path) -> None:
    art = damaged_llama
    weights = art / "weights/rank0.safetensors"
    data = weights.read_bytes()
    with pytest.raises(ArtefactError, match=r"weights/rank0.safetensors is damaged \(checksum"):
        Engine(art)
    # the same through a check started before the engine (as `kiln serve` starts it); one of
    # another manifest is not taken for this one's
    with pytest.raises(ArtefactError, match=r"weights/rank0.safetensors is damaged \(checksum"):
        Engine(art, file_check=FileCheck(art, read_manifest(art)))
    other = read_manifest(art)
    other["files"] = {}
    passed = FileCheck(art, other)
    passed.wait()
    assert not passed.covers(art, read_manifest(art))
    with pytest.raises(ArtefactError, match=r"weights/rank0.safetensors is damaged \(checksum"):
        Engine(art, file_check=passed)
    weights.write_bytes(bytes(data[:100]))
    with pytest.raises(ArtefactError, match="is damaged"):
        Engine(art)
    (art / "manifest.json").unlink()
    with pytest.raises(ArtefactError, match="has no manifest.json: not a kiln artefact"):
        Engine(art)


def test_sharded_safetensors_pt_and_dummy_formats(checkpoint, artefact, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = checkpoint("qwen3")
    expected = Engine(artefact("qwen3"), max_total_tokens=256).generate(
        input_ids=PROMPT, sampling_params=GREEDY
    )["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save(model.state_dict(), pt / "pytorch_model.bin")
    for folder in (sharded, pt):
        shutil.copy(ckpt / "config.json", folder / "config.json")
        for f in ckpt.glob("tokenizer*"):
            shutil.copy(f, folder / f.name)

    for folder, fmt in ((sharded, "auto"), (pt, "pt")):
        out = compile_(folder, tmp_path / f"art-{folder.name}", load_format=fmt)
        got = Engine(out.path, max_total_tokens=256).generate(
            input_ids=PROMPT, sampling_params=GREEDY
        )
        assert got["output_ids"] == expected, folder.name

    out = compile_(ckpt, tmp_path / "art-dummy", load_format="dummy")
    got = Engine(out.path, max_total_tokens=256).generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert len(got["output_ids"]) == 8 and got["output_ids"] != expected


def test_compile_errors_name_the_flag(checkpoint, tmp_path) -> None:
    with pytest.raises(ArgError, match="--model-path: required"):
        compile_model(ServerArgs(), tmp_path / "a")
    with pytest.raises(ArgError, match="--model-path: .* does not exist"):
        compile_model(ServerArgs(model_path=str(tmp_path / "nope")), tmp_path / "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(checkpoint("llama") / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no weights in .*--load-format dummy"):
        compile_(empty, tmp_path / "a")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "keep.txt").write_text("mine")
    with pytest.raises(ArtefactError, match="not a kiln artefact; refusing to overwrite"):
        compile_(checkpoint("llama"), stranger)
    assert (stranger / "keep.txt").read_text() == "mine"
    for bad, message in (("{rope", "not valid JSON"), ("[1]", "a JSON object, got list")):
        args = ServerArgs(model_path=str(checkpoint("llama")), json_model_override_args=bad)
        with pytest.raises(ArgError, match=f"--json-model-override-args: {message}"):
            compile_model(args, tmp_path / "a")


def test_auto_dtype_follows_sglang_on_cuda_and_the_fast_kernels_on_cpu(
    checkpoint, tmp_path
) -> None:
    ckpt = str(checkpoint("llama"))  # an fp32 checkpoint
    # CUDA (compiled here for an H100 fleet, no GPU needed): fp32 becomes fp16, as SGLang.
    out = compile_model(
        ServerArgs(model_path=ckpt, device="cuda", target_isa="sm_90"), tmp_path / "gpu"
    )
    m = json.loads((out.path / "manifest.json").read_text())
    assert m["runtime"]["dtype"] == "float16" and m["target"]["isa"] == "sm_90"
    assert m["native"] is None and not (out.path / "kernels").exists()
    # CPU: the float kiln's kernels run at full speed, fp32 (a documented kiln deviation).
    out = compile_model(ServerArgs(model_path=ckpt), tmp_path / "cpu")
    m = json.loads((out.path / "manifest.json").read_text())
    assert m["runtime"]["dtype"] == "float32"


def test_every_compile_time_argument_is_recorded(artefact) -> None:
    from kiln.args import FLAGS

    m = json.loads((artefact("llama") / "manifest.json").read_text())
    compile_time = {d for d, f in FLAGS.items() if f.stage == "compile"}
    assert set(m["compile_args"]) == compile_time
    # The key's copy is resolved: what `auto` and `native` became, paths dropped.
    resolved = m["cache_factors"]["compile_args"]
    assert resolved["dtype"] == "float32" and resolved["device"] == "cpu"
    assert resolved["target_isa"] == m["target"]["isa"] and "model_path" not in resolved


def test_kiln_source_is_a_cache_factor(artefact) -> None:
    """A build of kiln with other passes or kernels must not reuse old artefacts."""
    m = json.loads((artefact("llama") / "manifest.json").read_text())
    assert len(m["cache_factors"]["kiln_source_sha256"]) == 64


def test_the_same_inputs_give_a_byte_identical_artefact(
    checkpoint, tmp_path, monkeypatch, fresh_cache
) -> None:
    """Compiled again into another folder, under another cache root (its own kernel build
    included), every file is the same bytes: nothing of the compile's time, place or
    timings is in the artefact. (Both compiles are this test's: the session's cache may
    hold the key from a compile that spelled its flags otherwise, `--dtype auto`.)"""
    args = ServerArgs(model_path=str(checkpoint("llama")), dtype="float32")
    first = compile_model(args, tmp_path / "first").path
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "another-cache"))
    again = compile_model(args, tmp_path / "again").path
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (again / rel).read_bytes(), rel
    assert "seconds" not in (first / "manifest.json").read_text()
