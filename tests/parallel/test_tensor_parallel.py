"""Tensor parallelism: tp=2 artefacts run as two real processes over gloo on loopback, and
give the greedy ids of tp=1 and of transformers, and tp=1's logits closely."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from int4_files import write_int4_checkpoint
from oracle import hf_greedy
from transformers import AutoModelForCausalLM

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.core.artefact import graph_file

PROMPTS = [[1, 5, 9, 33], list(range(3, 43)), [7] * 11]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
# qwen2: 2 KV heads for 4 q heads (each rank keeps one); llama's 4 KV heads split two a
# rank. One family of each cut rule: Mistral's is Llama's (its window is per head, as
# Gemma 3's sliding layers are), Gemma 2's is Gemma 3's, Qwen3-MoE's is Qwen3's q/k norms
# with Qwen2-MoE's experts.
FAMILIES = {
    "llama": {"num_kv_heads": 4},
    "qwen2": {"num_kv_heads": 1},
    "qwen3": {},
    # each expert split across the ranks, the router whole
    "mixtral": {"num_kv_heads": 4},
    # the shared expert split like a dense MLP, its one-row sigmoid gate whole on each rank
    "qwen2_moe": {"num_kv_heads": 4},
    # GELU-tanh MLP split like SiLU's; the 1 + w norms and the embedding scale whole
    "gemma3": {},
    # q/k/v and gate/up cut from one fused tensor each; partial rotary rows per head
    "phi3": {"rope_scaling": None},
    # sinks by query head; each expert's biases: gate/up by rows, down on rank 0 only
    "gpt_oss": {},
    # latent attention by heads (q's two parts, kv_b), the latent whole on every rank
    "deepseek_v3": {},
    "deepseek_v2": {},
    # each residual branch scaled after its all-reduce, the logits after the all-gather
    "granite": {},
    # each head's q/k rows de-interleaved, then cut by heads
    "ernie4_5": {},
    # the same with biases and a half-head rotary: biases reordered and cut as their rows
    "glm4": {"num_kv_heads": 2},
    # side by side from one LayerNorm; the plain MLP's fc1 by rows with its bias, fc2 by
    # columns (bias on rank 0); the lm_head's bias cut by vocabulary rows with its weight
    # (StarCoder 2's, Nemotron's and Cohere's layers are cut by the same rules)
    "phi": {},
    # a LayerNorm over each head of q and k with a weight of its own: cut as q's and k's rows
    "stablelm": {"qk_layernorm": True},
}


def _tp1_and_tp2(tp1: Path, tp2: Path) -> tuple[list, torch.Tensor, list, torch.Tensor]:
    """Greedy outputs of PROMPTS and the logits of PROMPTS[1] from each artefact (tp2's rank
    processes stopped afterwards): tp1's, then tp2's."""
    one = Engine(tp1, max_total_tokens=2048)
    ref_out = one.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    ref_logits = one.prompt_logits(PROMPTS[1])
    two = Engine(tp2, max_total_tokens=2048)
    try:
        out = two.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        logits = two.prompt_logits(PROMPTS[1])
    finally:
        two.shutdown()
    return ref_out, ref_logits, out, logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_gives_tp1_and_transformers_greedy_ids(
    family: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = checkpoint(family, **FAMILIES[family])
    arts = {}
    for tp in (1, 2):
        arts[tp] = tmp_path / f"tp{tp}"
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), arts[tp])
    manifest = json.loads((arts[2] / "manifest.json").read_text())
    assert {"graph.rank1.json", "weights/rank1.safetensors"} <= set(manifest["files"])
    ref_out, ref_logits, out, logits = _tp1_and_tp2(arts[1], arts[2])
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for prompt, o in zip(PROMPTS, out, strict=True):
        assert o["output_ids"] == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_ep2_holds_whole_experts_and_gives_tp1s_ids(
    family: str, checkpoint: Callable[..., Path], artefact: Callable[..., Path], tmp_path: Path
) -> None:
    """--ep-size 2: each rank holds half of the experts whole (the router whole), adds its
    experts' share of each token, and an all-reduce sums the ranks."""
    kw = FAMILIES[family]
    art = tmp_path / "ep2"
    ckpt = checkpoint(family, **kw)
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=2, ep_size=2), art)
    for rank in (0, 1):
        nodes = json.loads((art / graph_file(rank)).read_text())["nodes"]
        [moe, *_] = [n for n in nodes if n["op"] == "moe"]
        a = moe["attrs"]
        head = 2 + a["router_bias"] + a["correction_bias"]  # GPT-OSS, DeepSeek V3
        per = 6 if a["expert_biases"] else 3
        local = a["num_experts"] // 2
        assert a["first_expert"] == local * rank and len(moe["args"]) == head + per * local
    ref_out, ref_logits, out, logits = _tp1_and_tp2(artefact(family, **kw), art)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    with pytest.raises(ArgError, match="--ep-size 4: kiln runs expert parallelism over"):
        compile_model(ServerArgs(model_path=str(ckpt), tp_size=2, ep_size=4), tmp_path / "x")


def test_each_rank_holds_only_its_part(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = checkpoint("llama", num_kv_heads=4)
    sizes = {}
    for tp in (1, 2):
        art = tmp_path / f"tp{tp}"
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), art)
        sizes[tp] = [f.stat().st_size for f in sorted((art / "weights").iterdir())]
    assert len(sizes[2]) == 2
    # Layers, lm_head and embedding are split: each rank about half (norms are whole).
    assert max(sizes[2]) < 0.55 * sizes[1][0]


# A rank's quantized weights are its part of the whole weight's codes and scales, so tp=2
# runs tp=1's numbers: per-row scales (int8wo), 4-bit groups of a GPTQ checkpoint as stored
# with int8 activations per group (up to rounding, below). w8a8_int8 rounds each rank's
# part of a token's inputs to a row-parallel linear with that part's own scale, so it is
# only as close as quantization is.
SHAPE = {"num_kv_heads": 4, "hidden_size": 128, "intermediate_size": 256}  # o_proj: 2 groups a rank
QUANTIZED = {
    "int8wo": {"torchao_config": "int8wo"},
    "gptq-32+a8": {"quantize_activations": "int8"},
    "w8a8_int8": {"quantization": "w8a8_int8"},
}


@pytest.mark.parametrize("scheme", sorted(QUANTIZED))
def test_tp2_quantized_runs_tp1s_numbers(
    scheme: str, checkpoint: Callable[..., Path], artefact: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = checkpoint("llama", **SHAPE)
    if scheme.startswith("gptq"):
        ckpt = tmp_path / "gptq"
        write_int4_checkpoint(checkpoint("llama", **SHAPE), ckpt, "gptq", 32)
    arts = {}
    for tp in (1, 2):
        arts[tp] = tmp_path / f"tp{tp}"
        compile_model(ServerArgs(model_path=str(ckpt), tp_size=tp, **QUANTIZED[scheme]), arts[tp])
    nodes = json.loads((arts[2] / "graph.rank1.json").read_text())["nodes"]
    assert sum(n["op"] == "quant_linear" for n in nodes) == 4 * 2  # qkv, o, gate_up, down
    ref_out, ref_logits, out, logits = _tp1_and_tp2(arts[1], arts[2])
    if scheme == "int8wo":
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        return
    if scheme == "gptq-32+a8":
        # The ranks' codes and scales are tp=1's, but a row-parallel linear's two partial
        # sums add in another order than one rank's groups (float rounding, ~1e-6): where
        # that moves a later input across an int8 rounding boundary, tp=2 rounds it one
        # step away (a Zen 3's AVX2 kernels hit one; the Xeon's AVX-512 ones none). So: the
        # same ids, and logits far closer to tp=1's than int8 activations are to float
        # ones on the same weights (one such step: 0.0016 mean against 0.067).
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
        compile_model(ServerArgs(model_path=str(ckpt)), tmp_path / "float-act")
        floats = Engine(tmp_path / "float-act", max_total_tokens=2048)
        a8_err = (ref_logits - floats.prompt_logits(PROMPTS[1])).abs()
        tp_err = (logits - ref_logits).abs()
        assert tp_err.mean() < 0.1 * a8_err.mean() and tp_err.max() < a8_err.max(), (
            tp_err.mean(),
            a8_err.mean(),
        )
        return
    floats = Engine(artefact("llama", **SHAPE), max_total_tokens=2048)
    exact = floats.prompt_logits(PROMPTS[1])
    err1, err2 = ((x - exact).abs().mean().item() for x in (ref_logits, logits))
    assert 0 < err2 < 2 * err1, (err1, err2)


def test_tp2_k_quant_ranks_hold_whole_super_blocks_or_their_groups(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A GGUF Q4_K file at --tp-size 2: a rank's part of down_proj (256 of 512 inputs) is
    whole super-blocks and keeps them (the scale records cut by super-block); o_proj's 128
    of 256 are not, and run as the same weights with a float32 scale a group (uint4); both
    give tp=1's ids and logits."""
    from gguf_files import write_gguf

    ckpt = checkpoint("llama", hidden_size=256, intermediate_size=512)
    path = write_gguf(ckpt, tmp_path / "q4_k.gguf", "Q4_K")
    arts = {tp: tmp_path / f"tp{tp}" for tp in (1, 2)}
    for tp, art in arts.items():
        compile_model(ServerArgs(model_path=str(path), tp_size=tp), art)
    nodes = json.loads((arts[2] / "graph.rank1.json").read_text())["nodes"]
    formats = [n["attrs"]["format"] for n in nodes if n["op"] == "quant_linear"]
    assert formats[:4] == ["uint4k", "uint4", "uint4k", "uint4k"]  # qkv, o, gate_up, down
    ref_out, ref_logits, out, logits = _tp1_and_tp2(arts[1], arts[2])
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def test_tp_refuses_what_does_not_divide(checkpoint: Callable[..., Path], tmp_path: Path):
    ckpt = str(checkpoint("llama", num_heads=6, num_kv_heads=2))
    with pytest.raises(ArgError, match="--tp-size 4: num_attention_heads 6 is not divisible"):
        compile_model(ServerArgs(model_path=ckpt, tp_size=4), tmp_path / "a")
    # o_proj's 64 inputs in two ranks' parts of 32 are not whole groups of 64
    wide = str(checkpoint("llama", num_kv_heads=2, hidden_size=64, intermediate_size=128))
    with pytest.raises(ArgError, match="--tp-size 2: each rank's 32 inputs of .* groups of 64"):
        compile_model(
            ServerArgs(model_path=wide, tp_size=2, torchao_config="int4wo-64"), tmp_path / "b"
        )
    # OLMo 2's and OLMoE's q/k norms span every head: refused, not normalised over a rank's
    # heads alone
    from kiln.passes.base import PassError

    for family in ("olmo2", "olmoe"):
        with pytest.raises(PassError, match="a norm over the whole q or k projection"):
            compile_model(
                ServerArgs(model_path=str(checkpoint(family)), tp_size=2), tmp_path / family
            )


def test_a_heartbeat_counts_in_the_store_and_stops_before_its_rank_exits() -> None:
    """A rank's heartbeat bumps its count in the rendezvous store and is stopped and joined
    (a rank process stops it before exiting: a daemon thread caught inside the store's C++
    call at interpreter exit aborted a node's rank once); with the store's host gone the
    thread ends by itself."""
    import time

    from torch import distributed as dist

    from kiln.runtime.parallel import Heartbeat, rendezvous_store

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = host.port
    beat = Heartbeat(1, rendezvous_store(f"tcp://127.0.0.1:{port}", 5))
    deadline = time.monotonic() + 10
    while int(host.add("kiln/alive/1", 0)) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert int(host.add("kiln/alive/1", 0)) >= 1
    start = time.monotonic()
    beat.stop()
    assert not beat._thread.is_alive() and time.monotonic() - start < 1.0
    gone = Heartbeat(2, rendezvous_store(f"tcp://127.0.0.1:{port}", 5))
    del host  # the store's host (rank 0) goes away
    gone._thread.join(timeout=30)
    assert not gone._thread.is_alive()


def test_tp2_serves_lora_adapters_as_tp1(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """LoRA on a tp=2 artefact: each rank takes its rows of B (q, k, v, gate, up) or its
    columns of A (o, down; the all-reduce sums the deltas' parts), float32 and bfloat16
    files in one batch with the base: tp=1's greedy ids and logits. An adapter loaded while
    serving reaches every rank; one a rank cannot read is refused and nothing is lost."""
    import shutil

    from lora_files import write_adapter

    from kiln.runtime.engine import RequestError
    from kiln.runtime.lora import AdapterSource, read_adapter

    ckpt = checkpoint("llama", **FAMILIES["llama"])
    arts = {}
    for tp in (1, 2):
        arts[tp] = tmp_path / f"tp{tp}"
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), arts[tp])
    qv_down = ("q_proj", "v_proj", "down_proj")
    files = {
        "a": write_adapter(ckpt, tmp_path / "a", seed=1),
        "b": write_adapter(ckpt, tmp_path / "b", 2, 3.0, qv_down, seed=2, dtype=torch.bfloat16),
        "c": write_adapter(ckpt, tmp_path / "c", seed=3, alpha=4.0),
    }
    paths = (f"a={files['a']}", f"b={files['b']}")
    one = Engine(arts[1], max_total_tokens=2048, lora_paths=paths)
    two = Engine(arts[2], max_total_tokens=2048, lora_paths=paths)
    prompts, loras = [*PROMPTS, PROMPTS[0]], [None, "a", "b", "b"]

    def same(names: list[str | None], logits: bool = False) -> list[list[int]]:
        params = {**GREEDY, "max_new_tokens": 12}
        want = one.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        got = two.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want], names
        for name in set(names) - {None} if logits else ():
            ref = one.prompt_logits(PROMPTS[1], lora=name)
            got_logits = two.prompt_logits(PROMPTS[1], lora=name)
            torch.testing.assert_close(got_logits, ref, atol=1e-4, rtol=0)
        return [g["output_ids"] for g in got]

    try:
        out = same(loras, logits=True)
        assert len({tuple(out[0]), tuple(out[1]), tuple(out[3])}) == 3  # each adapter counts
        c = read_adapter(AdapterSource("c", str(files["c"])))
        one.load_adapter(c)
        two.load_adapter(c)
        same([None, "c", "a", "c"], logits=True)
        two.unload_adapter("a")
        one.unload_adapter("a")
        same(["b", "c", None, "c"])
        # rank 0 read it; rank 1 finds the folder gone: refused on every rank
        gone = read_adapter(AdapterSource("d", str(files["a"])))
        shutil.rmtree(files["a"])
        with pytest.raises(RequestError, match="a tensor-parallel rank could not load it"):
            two.load_adapter(gone)
        assert "d" not in two.adapters
        same(["c", "b", None, "b"])
    finally:
        two.shutdown()
