"""LoRA adapters (--enable-lora, --lora-paths; runtime/lora.py) against transformers with
each adapter's delta merged into the checkpoint's weights: greedy tokens equal, logits
within fp32 rounding, for requests of several adapters and of the base in one batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_files import ALL, merge_into, merged_model, write_adapter
from oracle import hf_greedy

from kiln import Engine
from kiln.args import ArgError
from kiln.core.recipes import FUSED_MODULES
from kiln.runtime.engine import RequestError
from kiln.runtime.lora import AdapterSource, LoraError, parse_lora_paths
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.request_log import ended

PROMPTS = [[5, 17, 33, 8, 91, 12], [40, 2, 77], [9, 9, 61, 30, 4, 18, 52, 7, 70]]
NEW = 10


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> Callable[[str], dict[str, Path]]:
    """adapters(family) -> two adapters: "all", every module at rank 4 in float32; "qv", q
    and v at rank 2 in bfloat16, scale 1.5 (Phi-3's checkpoint has qkv_proj and gate_up_proj
    modules: those)."""
    root = tmp_path_factory.mktemp("lora")
    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            ckpt = checkpoint(family)
            fused = family == "phi3"
            every = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if fused else ALL
            if family == "glm4":  # gate and up one module; q/k rows in GLM's rope order
                every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
            qv = ("qkv_proj",) if fused else ("q_proj", "v_proj")
            made[family] = {
                "all": write_adapter(ckpt, root / f"{family}-all", seed=1, targets=every),
                "qv": write_adapter(
                    ckpt, root / f"{family}-qv", 2, 3.0, qv, seed=2, dtype=torch.bfloat16
                ),
            }
        return made[family]

    return get


def _engine(art: Path, paths: dict[str, Path], **kw) -> Engine:
    return Engine(art, lora_paths=tuple(f"{k}={v}" for k, v in paths.items()), **kw)


@pytest.mark.parametrize(
    "family, path",
    [
        ("llama", "native"),
        ("llama", "executor"),
        ("qwen3", "native"),
        ("phi3", "native"),
        ("glm4", "native"),
    ],
)
def test_adapters_in_one_batch_follow_transformers(
    artefact, checkpoint, adapters, family, path
) -> None:
    """Through the native step's LoRA hooks (kiln_step.h step_lora), and through the
    Python executor (what runs where a step has no hooks: a CUDA target, an artefact whose
    step was not lowered)."""
    paths = adapters(family)
    # Phi-3's LongRoPE: transformers turns sequences within its pretraining context (32
    # here) by the short factors, which kiln serves at a context of 32
    extra = {"context_length": 32} if family == "phi3" else {}
    engine = _engine(artefact(family), paths, **extra)
    assert engine.runner.native_lora
    engine.runner.native_lora = path == "native"
    # a bfloat16 file's A and B are kept as stored (half the bytes a token reads)
    kept = {d.at.dtype for lin in engine.runner.lora.linears.values() for d in lin.deltas.values()}
    assert kept == {torch.float32, torch.bfloat16}
    loras = [None, "all", "qv"]
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, lora_path=loras)
    for prompt, lora, out in zip(PROMPTS, loras, outs, strict=True):
        hf = merged_model(checkpoint(family), paths[lora] if lora else None)
        assert out["output_ids"] == hf_greedy(hf, prompt, NEW), lora
        seq = prompt + out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        # a prefill of the whole sequence, and decoding it token by token
        for chunk in (None, 1):
            got = engine.prompt_logits(seq, chunk=chunk, lora=lora)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # the adapters change the output (else the test above shows nothing)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]


def test_an_adapter_never_reads_the_base_models_cached_prefix(
    artefact, checkpoint, adapters
) -> None:
    paths = adapters("llama")
    engine = _engine(artefact("llama"), paths)
    prompt = [(3 * i) % 90 + 4 for i in range(40)]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    base = engine.generate(input_ids=prompt, sampling_params=params)
    again = engine.generate(input_ids=prompt, sampling_params=params)
    assert again["meta_info"]["cached_tokens"] > 0  # the base's own prefix is cached
    tuned = engine.generate(input_ids=prompt, sampling_params=params, lora_path="all")
    assert tuned["meta_info"]["cached_tokens"] == 0
    hf = merged_model(checkpoint("llama"), paths["all"])
    assert tuned["output_ids"] == hf_greedy(hf, prompt, 4) != base["output_ids"]
    tuned2 = engine.generate(input_ids=prompt, sampling_params=params, lora_path="all")
    assert tuned2["meta_info"]["cached_tokens"] > 0 and tuned2["output_ids"] == tuned["output_ids"]


def _dequantized(hf: torch.nn.Module, art: Path) -> torch.nn.Module:
    """`hf` with each linear's weight the artefact's 4-bit one, dequantized (q, k, v and
    gate, up cut from the fused weights): the base model kiln's kernels compute."""
    from kiln.core.ops.linear import unpack_quant
    from kiln.runtime.artefact import Artefact

    opened = Artefact.open(art)
    weights = opened.weights
    modules = dict(hf.named_modules())
    for n in opened.graph.nodes:
        if n.op != "quant_linear":
            continue
        name = n.args[1].attrs["name"]
        fmt, rows = n.attrs["format"], n.attrs["out_features"]
        w = unpack_quant(weights[name], weights[name + ".scales"], fmt, rows)
        stem = name.removesuffix(".weight")
        parts = FUSED_MODULES.get(stem.rsplit(".", 1)[-1])
        targets = [f"{stem.rsplit('.', 1)[0]}.{p}" for p in parts] if parts else [stem]
        at = 0
        with torch.no_grad():
            for t in targets:
                rows = modules[t].weight.shape[0]
                modules[t].weight.copy_(w[at : at + rows])
                at += rows
        assert at == w.shape[0], name
    return hf


def test_a_quantized_base_takes_the_adapter(artefact, checkpoint, adapters) -> None:
    """4-bit weights: the adapter's delta in float32 over the dequantized base, as
    transformers computes it with those weights and the adapter merged."""
    paths = adapters("llama")
    art = artefact("llama", compile_args={"torchao_config": "int4wo-32"})
    engine = _engine(art, paths)
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    for lora in (None, "all"):
        hf = merged_model(checkpoint("llama"), None)
        hf = _dequantized(hf, art)
        if lora is not None:
            hf = merge_into(hf, paths[lora])
        out = engine.generate(input_ids=PROMPTS[2], sampling_params=params, lora_path=lora)
        assert out["output_ids"] == hf_greedy(hf, PROMPTS[2], NEW), lora
        seq = PROMPTS[2] + out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(engine.prompt_logits(seq, lora=lora), ref, atol=1e-4, rtol=0)


def test_max_loras_per_batch_counts_the_base_model(artefact, adapters) -> None:
    engine = _engine(artefact("llama"), adapters("llama"), max_loras_per_batch=2)
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    loras = ["all", "qv", None]
    reqs = [engine.make_request(p, sp, lora=lora) for p, lora in zip(PROMPTS, loras, strict=True)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    # "all" and "qv" fill the two places; the base request waits for one of them
    assert {r.lora for r in engine.scheduler.running} == {"all", "qv"}
    assert engine.scheduler.waiting == [reqs[2]]
    while any(not r.finished for r in reqs):
        engine.step()
        assert len({r.lora for r in engine.scheduler.running}) <= 2
    assert all(len(r.output_ids) == 3 for r in reqs)
    # request logs and crash dumps name the adapter (`kiln replay` sends it again)
    assert [ended(r, None, False).get("lora_path") for r in reqs] == loras


def test_requests_name_loaded_adapters(artefact, adapters) -> None:
    engine = _engine(artefact("llama"), adapters("llama"))
    with pytest.raises(RequestError, match=r"no LoRA adapter 'nope' is loaded \(loaded: all, qv\)"):
        engine.generate(input_ids=PROMPTS[0], lora_path="nope")
    plain = Engine(artefact("llama"))
    with pytest.raises(RequestError, match="without --enable-lora"):
        plain.generate(input_ids=PROMPTS[0], lora_path="all")


def test_per_module_ranks_and_alphas(artefact, checkpoint, tmp_path) -> None:
    """PEFT's rank_pattern and alpha_pattern: a module named by a key (its whole name or
    its last dotted parts) takes that rank or alpha."""
    ckpt = checkpoint("llama")
    ranks = {"q_proj": 2, "model.layers.1.mlp.down_proj": 6}
    alphas = {"o_proj": 3.0, "model.layers.0.self_attn.q_proj": 16.0}
    path = write_adapter(
        ckpt, tmp_path / "patterns", seed=7, rank_pattern=ranks, config={"alpha_pattern": alphas}
    )
    engine = Engine(artefact("llama"), lora_paths=(f"p={path}",))
    hf = merged_model(ckpt, path)
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=params, lora_path="p")
    assert out["output_ids"] == hf_greedy(hf, PROMPTS[0], NEW)
    seq = PROMPTS[0] + out["output_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(seq, lora="p"), ref, atol=1e-4, rtol=0)


def test_lora_paths_forms() -> None:
    assert AdapterSource.parse("/a/b/sql-lora") == AdapterSource("sql-lora", "/a/b/sql-lora")
    assert AdapterSource.parse("sql=/x") == AdapterSource("sql", "/x")
    got = AdapterSource.parse('{"lora_name": "s", "lora_path": "/y", "pinned": true}')
    assert got == AdapterSource("s", "/y", True)
    with pytest.raises(LoraError, match="given twice"):
        parse_lora_paths(["a=/x", "a=/y"])
    for bad, why in [
        ("{nope", "not valid JSON"),
        ('{"lora_name": "s"}', "lora_name and lora_path are strings"),
        ('{"lora_name": "s", "lora_path": "/y", "x": 1}', "a JSON entry has"),
        ("bad name=/x", "adapter name 'bad name'"),
    ]:
        with pytest.raises(LoraError, match=why):
            AdapterSource.parse(bad)


def _broken(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != drop:
            (dst / f.name).write_bytes(f.read_bytes())
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_adapters_that_cannot_be_served_stop_the_start(
    artefact, checkpoint, adapters, tmp_path
) -> None:
    good = adapters("llama")["all"]
    pickled = _broken(good, tmp_path / "pickled", drop="adapter_model.safetensors")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    other = write_adapter(checkpoint("llama", hidden_size=64), tmp_path / "other-model")
    cases = [
        (tmp_path / "missing", "no adapter_config.json"),
        (pickled, "adapter_model.bin is a pickle"),
        (_broken(good, tmp_path / "dora", {"use_dora": True}), "DoRA is not supported"),
        (_broken(good, tmp_path / "r", {"r": 3}), "do not have rank 3"),
        (_broken(good, tmp_path / "re", {"rank_pattern": {"q.*": 4}}), "regular expressions"),
        (other, "has 64 (inputs|outputs); the model.s has 96"),
    ]
    art = artefact("llama")
    for path, why in cases:
        with pytest.raises(ArgError, match=f"--enable-lora: .*{why}"):
            Engine(art, lora_paths=(f"x={path}",))
    with pytest.raises(ArgError, match="rank 4 is above --max-lora-rank 2"):
        Engine(art, lora_paths=(f"x={good}",), max_lora_rank=2)
    outside = "targets down_proj, gate_proj, k_proj, o_proj, up_proj, outside"
    with pytest.raises(ArgError, match=outside):
        Engine(art, lora_paths=(f"x={good}",), lora_target_modules=("q_proj", "v_proj"))
    two = (f"x={good}", f"y={good}")
    with pytest.raises(ArgError, match="--max-loaded-loras is 1"):
        Engine(art, lora_paths=two, max_loaded_loras=1, max_loras_per_batch=1)
