"""An artefact is untrusted input: tampering is refused in one line and runs nothing.

Each tampered copy is re-sealed (checksums recomputed), as an attacker would, so what
stops it is the loader's checks, not the checksums.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln import Engine
from kiln.compiler.artefact import FORMAT_VERSION, ArtefactError, file_entry
from kiln.compiler.ir import Graph
from kiln.runtime.executor import generate_source


def reseal(art: Path) -> None:
    """Recompute every checksum in the manifest, as whoever edits an artefact can."""
    m = json.loads((art / "manifest.json").read_text())
    m["files"] = {rel: file_entry(art, rel) for rel in m["files"]}
    (art / "manifest.json").write_text(json.dumps(m))


def edit_json(art: Path, name: str, change: Callable[[Any], Any]) -> None:
    path = art / name
    data = change(json.loads(path.read_text()))
    path.write_text(json.dumps(data))
    reseal(art)


@pytest.fixture
def copy(artefact, tmp_path) -> Path:
    art = tmp_path / "art"
    shutil.copytree(artefact("qwen3"), art)
    return art


def payload(marker: Path) -> str:
    return f"__import__('os').system('touch {marker}')"


def test_the_payload_would_run_if_evaluated(tmp_path) -> None:
    """Control: the payload used below does create its marker when Python evaluates it."""
    marker = tmp_path / "ran"
    eval(payload(marker))
    assert marker.exists()


def _first(graph: dict, op: str) -> dict:
    # A linear is a packed_linear where the target packs weights.
    ops = (op, "packed_linear") if op == "linear" else (op,)
    return next(n for n in graph["nodes"] if n["op"] in ops)


def _rename_node(graph: dict, old: str, new: str) -> dict:
    for n in graph["nodes"]:
        if n["name"] == old:
            n["name"] = new
        n["args"] = [new if a == old else a for a in n["args"]]
    return graph


def _rename_weight(graph: dict, old: str, new: str) -> dict:
    graph["weights"][new] = graph["weights"].pop(old)
    for n in graph["nodes"]:
        if n["op"] == "param" and n["attrs"]["name"] == old:
            n["attrs"]["name"] = new
    return graph


INJECTIONS: dict[str, Callable[[dict, str], dict]] = {
    "attr key": lambda g, p: (_first(g, "linear").setdefault("attrs", {}).update({p: 1}), g)[1],
    "attr value": lambda g, p: (_first(g, "rmsnorm")["attrs"].update(eps=p), g)[1],
    "getitem index": lambda g, p: (_first(g, "getitem")["attrs"].update(index=f"({p}*0)"), g)[1],
    "node name": lambda g, p: _rename_node(g, _first(g, "linear")["name"], f"v1;{p};x"),
    "op name": lambda g, p: (_first(g, "add_rmsnorm").update(op=p), g)[1],
    "weight name": lambda g, p: _rename_weight(g, "model.norm.weight", f"w'];{p};#"),
    "backend": lambda g, p: (_first(g, "linear")["meta"].update(backend=p), g)[1],
}


@pytest.mark.parametrize("site", sorted(INJECTIONS))
def test_code_injection_is_refused_at_every_site(copy, tmp_path, site) -> None:
    marker = tmp_path / "ran"
    edit_json(copy, "graph.json", lambda g: INJECTIONS[site](g, payload(marker)))
    with pytest.raises(ArtefactError) as e:
        Engine(copy, max_total_tokens=64)
    assert "\n" not in str(e.value) and "graph.json" in str(e.value)
    assert not marker.exists()


def test_executor_emits_no_source_from_the_graph(artefact) -> None:
    """Even a graph built in memory, past the loader, cannot put text into the code."""
    graph = Graph.loads((artefact("qwen3") / "graph.json").read_text())
    for i, n in enumerate(graph.nodes):
        if n.op != "input":
            n.name = f"zzname{i}"
    weights = {name: None for name in graph.weights}
    source, _ = generate_source(graph, weights, lib=object())
    assert "zzname" not in source and "model." not in source
    getitem = next(n for n in graph.nodes if n.op == "getitem")
    getitem.attrs["index"] = "__import__('os')"
    with pytest.raises(ValueError, match="getitem index must be an int"):
        generate_source(graph, weights, lib=object())


def _set(path: list[str], value: Any) -> Callable[[dict], dict]:
    def change(d: dict) -> dict:
        inner = d
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        return d

    return change


MANIFEST_DEFECTS = [
    ("not an object", lambda m: [], "manifest.json is damaged: expected a JSON object"),
    (
        "no files",
        lambda m: {k: v for k, v in m.items() if k != "files"},
        "manifest.json is invalid: files: Field required",
    ),
    (
        "format as a string",
        _set(["format_version"], "1"),
        f"artefact format '1', this kiln reads format {FORMAT_VERSION}",
    ),
    (
        "vocab",
        _set(["runtime", "vocab_size"], 1000),
        "runtime.vocab_size is 1000, the graph has an embedding of 384 rows",
    ),
    ("layers", _set(["runtime", "num_layers"], 3), "runtime.num_layers is 3"),
    ("kv heads", _set(["runtime", "num_kv_heads"], 4), "runtime.num_kv_heads is 4"),
    ("head dim", _set(["runtime", "head_dim"], 8), "runtime.head_dim is 8"),
    ("eos", _set(["runtime", "eos_token_ids"], [384]), "bos/eos token ids"),
    (
        "vocab as text",
        _set(["runtime", "vocab_size"], "384"),
        "runtime.vocab_size: Input should be a valid integer",
    ),
    ("device", _set(["target", "device"], "tpu"), "target.device: Input should be 'cpu'"),
    ("page size", _set(["runtime", "page_size"], 0), "runtime.page_size: Input should be greater"),
]


@pytest.mark.parametrize(
    "name, change, message", MANIFEST_DEFECTS, ids=[d[0] for d in MANIFEST_DEFECTS]
)
def test_manifest_defects_are_one_line(copy, name, change, message) -> None:
    path = copy / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(ArtefactError) as e:
        Engine(copy, max_total_tokens=64)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_manifest_file_paths_stay_inside(copy) -> None:
    def escape(m: dict) -> dict:
        m["files"]["../outside"] = next(iter(m["files"].values()))
        return m

    path = copy / "manifest.json"
    path.write_text(json.dumps(escape(json.loads(path.read_text()))))
    with pytest.raises(ArtefactError, match="must stay inside the artefact"):
        Engine(copy, max_total_tokens=64)


def _unpack(g: dict) -> dict:
    """The packed lm_head's weight declared as plain rows: the kernel would read panels."""
    name = next(n for n in g["nodes"] if n["op"] == "packed_linear")["args"][1]
    param = next(n for n in g["nodes"] if n["name"] == name)
    g["weights"][param["attrs"]["name"]].pop("layout")
    return g


GRAPH_DEFECTS = [
    (
        "packed out_features",
        lambda g: (_first(g, "packed_linear")["attrs"].update(out_features=10**6), g)[1],
        "packed_linear out_features is 1000000",
    ),
    (
        "packed narrow_rows",
        lambda g: (_first(g, "packed_linear")["attrs"].update(narrow_rows=[9, 2]), g)[1],
        "narrow_rows must be [lo, hi]",
    ),
    ("packed layout", _unpack, "packed_linear needs a weight stored as panels"),
    (
        "prologue",
        lambda g: (_first(g, "packed_linear")["attrs"].update(prologue="os.system"), g)[1],
        "prologue must be one of none, silu_and_mul",
    ),
    (
        "heads",
        lambda g: (_first(g, "attention")["attrs"].update(num_heads=40), g)[1],
        "attention q features is 96, expected 960",
    ),
    (
        "group",
        lambda g: (_first(g, "rmsnorm")["attrs"].update(group=7), g)[1],
        "rmsnorm group 7 does not divide 96",
    ),
    (
        "split",
        lambda g: (_first(g, "split")["attrs"].update(sizes=[96, 48, 4800]), g)[1],
        "split total is 4944, expected 192",
    ),
    (
        "weight shape",
        lambda g: (g["weights"]["model.norm.weight"].update(shape=[97]), g)[1],
        "weight size is 97, expected 96",
    ),
    (
        "bool index",
        lambda g: (_first(g, "getitem")["attrs"].update(index=True), g)[1],
        "expected an integer, got True",
    ),
    (
        "nan eps",
        lambda g: (_first(g, "rmsnorm")["attrs"].update(eps=float("nan")), g)[1],
        "expected a finite number",
    ),
]


@pytest.mark.parametrize("name, change, message", GRAPH_DEFECTS, ids=[d[0] for d in GRAPH_DEFECTS])
def test_graph_defects_that_kernels_would_trust_are_refused(copy, name, change, message) -> None:
    edit_json(copy, "graph.json", change)
    with pytest.raises(ArtefactError) as e:
        Engine(copy, max_total_tokens=64)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_weight_file_must_match_the_graph(copy) -> None:
    from safetensors.torch import load_file, save_file

    path = copy / "weights/rank0.safetensors"
    weights = load_file(path)
    weights["model.norm.weight"] = weights["model.norm.weight"][:50].clone()
    save_file(weights, path)
    reseal(copy)
    with pytest.raises(ArtefactError, match=r"'model.norm.weight' is \(50,\) torch.float32"):
        Engine(copy, max_total_tokens=64)


def test_cli_refuses_a_tampered_artefact_in_one_line(copy, tmp_path) -> None:
    marker = tmp_path / "ran"
    edit_json(copy, "graph.json", lambda g: INJECTIONS["getitem index"](g, payload(marker)))
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "generate", str(copy), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "graph.json is invalid" in r.stderr
    assert not marker.exists()
