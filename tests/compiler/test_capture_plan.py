"""The capture plan: SGLang's flags -> decode and prefill buckets and the graph's split points,
recorded in the artefact, shown by `kiln inspect`, and checked when an artefact is read."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.compiler.options import capture_options, decode_batch_sizes, prefill_token_sizes
from kiln.core.graph_json import graph_from_json, load_graph
from kiln.core.ir import IRError
from kiln.core.target import cpu_target, cuda_target

CUDA = {"device": "cuda", "target_isa": "sm_90"}


def _plan(art: Path) -> dict:
    return json.loads((art / "graph.json").read_text())["capture_plan"]


def test_sglang_bucket_lists() -> None:
    # SGLang's server_args lists, for a max of 160 (its default without a GPU) and 600
    sizes = decode_batch_sizes(160, padding=True)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 160 and len(sizes) == 24
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[5:]))
    big = decode_batch_sizes(600, padding=True)
    after = big.index(256) + 1
    assert big[after : after + 2] == [272, 288] and big[-3:] == [512, 544, 576]
    assert decode_batch_sizes(5, padding=False) == [1, 2, 3, 4, 5]
    tokens = prefill_token_sizes(4096)
    assert tokens[:3] == [4, 8, 12] and tokens[-2:] == [3840, 4096] and 1024 in tokens
    assert prefill_token_sizes(8192)[-1] == 8192


def test_the_plan_follows_the_flags(checkpoint, tmp_path: Path) -> None:
    ckpt = str(checkpoint("llama"))  # 2 layers
    runs = {
        "cpu": {},
        "cpu-off": {"disable_cuda_graph": True},
        "cpu-tp2": {"tp_size": 2},
        "cuda": CUDA,
        "cuda-max-24": {**CUDA, "cuda_graph_max_bs": 24},
        "cuda-no-padding": {**CUDA, "cuda_graph_max_bs": 6, "disable_cuda_graph_padding": True},
        "cuda-explicit": {**CUDA, "cuda_graph_bs": [5, 1, 3, 3]},
        "cuda-off": {**CUDA, "disable_cuda_graph": True},
        "cuda-tp2": {**CUDA, "tp_size": 2},
    }
    got = {}
    for name, flags in runs.items():
        compile_model(ServerArgs(model_path=ckpt, **flags), tmp_path / name)
        got[name] = _plan(tmp_path / name)
    # a CPU target lowers every step, decode and prefill, to one native call
    # (compiler/lower_step.py); --disable-cuda-graph turns that off, as it turns off a GPU's
    # recorded steps, and a tensor-parallel artefact (collectives between the kernels) keeps
    # the executor
    assert got["cpu"]["decode"] == {"mode": "native", "batch_sizes": [], "padding": True}
    assert got["cpu"]["prefill"] == {"mode": "native", "tokens": []}
    for name in ("cpu-off", "cpu-tp2"):
        assert got[name]["decode"] == {"mode": "eager", "batch_sizes": [], "padding": True}
        assert got[name]["prefill"] == {"mode": "eager", "tokens": []}
    # one split at each layer's attention: the pieces between are static-shape
    graph = json.loads((tmp_path / "cpu/graph.json").read_text())["nodes"]
    attention = [n["name"] for n in graph if n["op"] in ("attention", "rope_attention")]
    assert got["cpu"]["split_at"] == attention and len(attention) == 2
    # SGLang's default for an sm_90 (80-160 GB) GPU below tp 4: 256
    assert got["cuda"]["decode"]["mode"] == "cuda_graph"
    assert got["cuda"]["decode"]["batch_sizes"] == decode_batch_sizes(256, padding=True)
    assert got["cuda-max-24"]["decode"]["batch_sizes"] == [1, 2, 4, 8, 12, 16, 24]
    assert got["cuda-no-padding"]["decode"] == {
        "mode": "cuda_graph",
        "batch_sizes": [1, 2, 3, 4, 5, 6],
        "padding": False,
    }
    assert got["cuda-explicit"]["decode"]["batch_sizes"] == [1, 3, 5]
    assert got["cuda-off"]["decode"]["mode"] == "eager"
    assert got["cuda-tp2"]["decode"]["batch_sizes"][-1] == 256
    assert json.loads((tmp_path / "cuda-tp2/graph.rank1.json").read_text())["capture_plan"]
    with pytest.raises(ArgError, match="--cuda-graph-max-bs: a cpu target captures no CUDA"):
        compile_model(ServerArgs(model_path=ckpt, cuda_graph_max_bs=8), tmp_path / "bad")
    with pytest.raises(ArgError, match=r"--cuda-graph-bs: expected positive sizes"):
        compile_model(ServerArgs(model_path=ckpt, cuda_graph_bs=[0, 4], **CUDA), tmp_path / "b")


def test_compiled_and_piecewise_plans() -> None:
    """--enable-torch-compile's buckets stop at --torch-compile-max-bs; piecewise prefill
    (refused on the command line until the CUDA runtime replays it) is a CUDA plan only."""
    cpu, h100 = cpu_target("avx2"), cuda_target("sm_90")

    def plan(target, **flags):
        return capture_options(ServerArgs(**flags), target, 1)

    decode = plan(cpu, enable_torch_compile=True, torch_compile_max_bs=16)
    assert (decode.decode, decode.batch_sizes, decode.padding) == (
        "compiled",
        (1, 2, 4, 8, 12, 16),
        True,
    )
    with pytest.raises(ArgError, match="--enable-piecewise-cuda-graph: a cpu target captures"):
        plan(cpu, enable_piecewise_cuda_graph=True)
    prefill = plan(h100, enable_piecewise_cuda_graph=True)
    assert (prefill.prefill, prefill.tokens) == ("piecewise", tuple(prefill_token_sizes(4096)))
    listed = {"enable_piecewise_cuda_graph": True, "piecewise_cuda_graph_tokens": "[64, 8,16]"}
    assert plan(h100, **listed).tokens == (8, 16, 64)
    with pytest.raises(ArgError, match="--piecewise-cuda-graph-tokens: expected token counts"):
        plan(h100, **{**listed, "piecewise_cuda_graph_tokens": "8,lots"})


def test_inspect_shows_it_and_a_tampered_plan_is_refused(checkpoint, tmp_path: Path) -> None:
    art = tmp_path / "art"
    compile_model(
        ServerArgs(model_path=str(checkpoint("llama")), cuda_graph_max_bs=64, **CUDA), art
    )
    shown = subprocess.run(
        [sys.executable, "-m", "kiln", "inspect", str(art)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("capture "))
    assert "decode cuda_graph at batch 1, 2, 4, 8, ..., 64 (12 sizes), padded" in line
    assert "prefill eager; 3 pieces between 2 attentions" in line
    data = json.loads((art / "graph.json").read_text())
    assert graph_from_json(data).plan == data["capture_plan"]
    piecewise = tmp_path / "piecewise"
    compile_model(
        ServerArgs(
            model_path=str(checkpoint("llama")),
            enable_piecewise_cuda_graph=True,
            piecewise_cuda_graph_tokens="64,8",
            **CUDA,
        ),
        piecewise,
    )
    loaded = load_graph((piecewise / "graph.json").read_text())
    assert loaded.plan is not None
    prefill = loaded.plan["prefill"]
    assert prefill["mode"] == "piecewise" and prefill["tokens"] == [8, 64]
    # The eager tail starts at the node that reads the logits rows.
    tail = next(n for n in loaded.nodes if n.name == prefill["eager_from"])
    assert [a.attrs.get("name") for a in tail.args if a.op == "input"] == ["logits_indices"]
    broken = json.loads((piecewise / "graph.json").read_text())
    broken["capture_plan"]["prefill"]["eager_from"] = "nowhere"
    with pytest.raises(IRError, match="eager_from: expected a node name"):
        graph_from_json(broken)
    for path, bad, message in (
        (("split_at",), ["v1"], "expected attention or moe node names"),
        (("decode", "batch_sizes"), [4, -1], "expected positive integers"),
        (("decode", "mode"), "__import__('os')", "with a mode of"),
    ):
        tampered = json.loads(json.dumps(data))
        *outer, last = path
        target = tampered["capture_plan"]
        for key in outer:
            target = target[key]
        target[last] = bad
        with pytest.raises(IRError, match=message):
            graph_from_json(tampered)


def test_a_moe_graph_decodes_without_cuda_graphs_and_cuts_its_prefill_at_the_moes(
    checkpoint, tmp_path: Path
) -> None:
    """The MoE's kernel loops over the experts its tokens chose, read back to the host, which
    a CUDA graph cannot record (found on an H200): a CUDA decode runs eagerly with the reason
    in the plan and in `kiln inspect`; a piecewise prefill runs the MoEs between its pieces.
    A dense model keeps its graphs."""
    art = tmp_path / "moe"
    flags = {"enable_piecewise_cuda_graph": True, "piecewise_cuda_graph_tokens": "8,16"}
    compile_model(ServerArgs(model_path=str(checkpoint("mixtral")), **flags, **CUDA), art)
    plan = _plan(art)
    assert plan["decode"]["mode"] == "eager" and plan["decode"]["batch_sizes"] == []
    assert "moe (%" in plan["decode"]["graphs_refused"]
    assert "CUDA graph cannot record" in plan["decode"]["graphs_refused"]
    nodes = json.loads((art / "graph.json").read_text())["nodes"]
    cuts = [n["name"] for n in nodes if n["op"] in ("attention", "rope_attention", "moe")]
    assert plan["split_at"] == cuts and sum(n["op"] == "moe" for n in nodes) == 2
    shown = subprocess.run(
        [sys.executable, "-m", "kiln", "inspect", str(art)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "5 pieces between 2 attentions and 2 MoEs" in shown.stdout
    assert "graphs     decode without CUDA graphs: moe (%" in shown.stdout
    assert graph_from_json(json.loads((art / "graph.json").read_text())).plan == plan
