"""An artefact is untrusted input: tampering is refused in one line and runs nothing.

Each tampered copy is re-sealed (checksums recomputed), as an attacker would, so what
stops it is the loader's checks, not the checksums.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln import Engine
from kiln.core.artefact import FORMAT_VERSION, ArtefactError, file_entry
from kiln.core.graph_json import load_graph
from kiln.runtime.executor import generate


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


def kiln(*argv: str) -> subprocess.CompletedProcess[str]:
    """The `kiln` command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kiln", *argv], capture_output=True, text=True, timeout=120
    )


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


def _triton_attention(graph: dict) -> dict:
    """The first attention node, its decode kernel named as Triton's (which caps nothing)."""
    node = _first(graph, "attention")
    node["meta"]["backend"] = "triton"
    return node


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
    graph = load_graph((artefact("qwen3") / "graph.json").read_text())
    for i, n in enumerate(graph.nodes):
        if n.op != "input":
            n.name = f"zzname{i}"
    weights = {name: None for name in graph.weights}
    source = generate(graph, weights, lib=object()).source
    assert "zzname" not in source and "model." not in source
    getitem = next(n for n in graph.nodes if n.op == "getitem")
    getitem.attrs["index"] = "__import__('os')"
    with pytest.raises(ValueError, match="getitem index must be an int"):
        generate(graph, weights, lib=object())


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
        "attr prologue: expected one of none, silu_and_mul",
    ),
    (
        "heads",
        lambda g: (_first(g, "attention")["attrs"].update(num_heads=40), g)[1],
        "attention q features is 96, expected 960",
    ),
    (
        "softcap on a kernel that does not cap",
        lambda g: (_triton_attention(g)["attrs"].update(softcap=2.0), g)[1],
        "asks the triton kernel of attention for softcap=2.0, which it does not compute",
    ),
    (
        "sinks without their input",
        lambda g: (_first(g, "attention")["attrs"].update(sinks=1), g)[1],
        "attention takes q, k, v and sinks=1: 3 inputs",
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
    with pytest.raises(ArtefactError, match=r"'model.norm.weight' is \(50,\) float32, the graph"):
        Engine(copy, max_total_tokens=64)


def _rewrite_header(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """The weights file with its header changed (its data as it was)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = change(json.loads(raw[8 : 8 + n]))
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _entry(h: dict[str, Any], name: str = "model.norm.weight") -> dict[str, Any]:
    return h[name]


# Each a header the file's data cannot back, and what the one-line refusal says.
BAD_HEADERS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "past the data": (
        lambda h: _entry(h).update(data_offsets=[o + 8 for o in _entry(h)["data_offsets"]]) or h,
        "model.norm.weight",
    ),
    "shape not its bytes": (
        lambda h: _entry(h).update(shape=[95]) or h,
        "a float32 tensor of \\[95\\]",
    ),
    "unknown type": (
        lambda h: _entry(h).update(dtype="F8_E8M0") or h,
        "'F8_E8M0' is not one kiln keeps",
    ),
    "overlap": (
        lambda h: {
            **h,
            "extra": {
                "dtype": "U8",
                "shape": [4],
                "data_offsets": _entry(h)["data_offsets"][:1] * 2,
            },
        },
        "bytes",
    ),
    "negative size": (lambda h: _entry(h).update(shape=[-96]) or h, "is not a list of sizes"),
    "not JSON": (lambda h: b"{not json", "header is not JSON"),
    "not an object": (lambda h: [1, 2], "not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_a_weights_header_the_data_cannot_back_is_refused_in_one_line(copy, case) -> None:
    """The weights are views of the mapped file made from its header (runtime/weights.py):
    each entry must fit the data, agree with its shape and type, and neither overlap
    another nor leave a gap, before any view is made."""
    change, says = BAD_HEADERS[case]
    _rewrite_header(copy / "weights/rank0.safetensors", change)
    reseal(copy)
    with pytest.raises(ArtefactError, match="rank0.safetensors is damaged: ") as e:
        Engine(copy, max_total_tokens=64)
    assert re.search(says, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_cli_refuses_a_tampered_artefact_in_one_line(copy, tmp_path) -> None:
    marker = tmp_path / "ran"
    edit_json(copy, "graph.json", lambda g: INJECTIONS["getitem index"](g, payload(marker)))
    r = kiln("generate", str(copy), "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "graph.json is invalid" in r.stderr
    assert not marker.exists()


# -- the second hardening round (issue 23, items 1-5) -------------------------------------------
def _one_line_refusal(art: Path, *parts: str) -> str:
    with pytest.raises(ArtefactError) as e:
        Engine(art, max_total_tokens=64)
    message = str(e.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


def test_a_tokenizer_that_asks_for_custom_code_is_refused_without_running_it(
    copy, tmp_path
) -> None:
    """Item 1: an auto_map naming a module planted beside the tokenizer never runs, and
    nobody is asked whether it may (transformers would prompt "[y/N]")."""
    marker = tmp_path / "ran"
    (copy / "tokenizer" / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    edit_json(
        copy,
        "tokenizer/tokenizer_config.json",
        lambda c: {**c, "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}},
    )
    _one_line_refusal(copy, "tokenizer/tokenizer_config.json asks for custom tokenizer code")
    assert not marker.exists()


def test_transformers_is_never_let_run_tokenizer_code(copy, tmp_path) -> None:
    """Item 1, one level down: the fallback to transformers refuses remote code itself."""
    from kiln.runtime.tokenizer import TokenizerError, _transformers_tokenizer, read_folder

    marker = tmp_path / "ran"
    folder = copy / "tokenizer"
    (folder / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    files = read_folder(folder)
    config = json.loads(files["tokenizer_config.json"])
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    files["tokenizer_config.json"] = json.dumps(config).encode()
    files["tokenization_evil.py"] = (folder / "tokenization_evil.py").read_bytes()
    try:
        tok = _transformers_tokenizer(files)
    except TokenizerError:
        tok = None
    assert not marker.exists()
    assert tok is None or type(tok).__module__.startswith("transformers.")


def test_a_listed_file_kiln_never_writes_is_refused(copy) -> None:
    (copy / "tokenizer" / "tokenization_evil.py").write_text("print('hi')\n")
    m = json.loads((copy / "manifest.json").read_text())
    m["files"]["tokenizer/tokenization_evil.py"] = file_entry(
        copy, "tokenizer/tokenization_evil.py"
    )
    (copy / "manifest.json").write_text(json.dumps(m))
    _one_line_refusal(copy, "tokenization_evil.py", "not a file kiln compile writes")


def _unlist(art: Path, rel: str) -> None:
    m = json.loads((art / "manifest.json").read_text())
    del m["files"][rel]
    (art / "manifest.json").write_text(json.dumps(m))


def test_an_unlisted_chat_template_is_never_read(copy) -> None:
    """Item 2: a template the manifest does not list (planted, or left over) is not used."""
    planted = "{{ 'PLANTED' }}"
    _unlist(copy, "tokenizer/chat_template.jinja")
    (copy / "tokenizer" / "chat_template.jinja").write_text(planted)
    engine = Engine(copy, max_total_tokens=64)
    assert engine.tokenizer is not None and engine.tokenizer.chat_template != planted


@pytest.mark.parametrize(
    "link",
    ["tokenizer/chat_template.jinja", "tokenizer", "graph.json", "manifest.json"],
)
def test_no_symbolic_link_is_followed(copy, tmp_path, link) -> None:
    """Item 2: a file of the artefact made a link (to /etc/passwd, or to a folder outside)
    is refused in one line, however the checksums were recomputed."""
    path = copy / link
    if link == "tokenizer/chat_template.jinja":
        path.unlink()
        path.symlink_to("/etc/passwd")
        reseal(copy)  # the checksum of /etc/passwd, as an attacker would write it
    else:
        moved = tmp_path / "outside" / link
        moved.parent.mkdir()
        path.rename(moved)
        path.symlink_to(moved, target_is_directory=moved.is_dir())
    message = _one_line_refusal(copy, link)
    assert "symbolic link" in message or (link == "manifest.json" and "symbolic" in message)


def test_a_fifo_in_place_of_a_file_does_not_hang_the_load(copy) -> None:
    (copy / "tokenizer" / "tokenizer.json").unlink()
    os.mkfifo(copy / "tokenizer" / "tokenizer.json")
    _one_line_refusal(copy, "tokenizer/tokenizer.json is not a regular file")


def test_a_malformed_tokenizer_is_one_line(copy) -> None:
    """Item 3: tokenizer.json that is JSON but not a tokenizer, checksum recomputed."""
    (copy / "tokenizer" / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    reseal(copy)
    _one_line_refusal(copy, "tokenizer/tokenizer.json is invalid")
    r = kiln("generate", str(copy), "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "tokenizer.json is invalid" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_layers", int(2e8), "runtime.num_layers: Input should be less than or equal"),
        ("num_layers", 10**9, "runtime.num_layers: Input should be less than or equal"),
        ("num_layers", 4000, "runtime.num_layers is 4000, the graph has attention layers"),
        ("context_length", 10**12, "runtime.context_length: Input should be less than or equal"),
        ("context_length", 2, "runtime.context_length is 2, the graph has 256"),
        ("context_length", 100_000, "runtime.context_length is 100000, the graph has 256"),
        ("eos_token_ids", list(range(10_000)), "runtime.eos_token_ids: List should have at most"),
        ("served_model_name", "x" * 10_000, "runtime.served_model_name: String should have at"),
        (
            "long_rope",
            [{"weight": "rope.inv_freq", "context_above": 2, "inv_freq": [float("nan")]}],
            "runtime.long_rope.0.inv_freq.0: Input should be a finite number",
        ),
    ],
)
def test_manifest_numbers_are_bounded_before_use(copy, field, value, message) -> None:
    """Item 4: numbers the manifest holds (it has no checksum) are bounded and held to the
    graph before anything is sized by them: each refusal is quick."""
    edit_json(copy, "manifest.json", _set(["runtime", field], value))
    start = time.perf_counter()
    _one_line_refusal(copy, message)
    assert time.perf_counter() - start < 5


def test_tp_size_is_held_to_the_graphs_collectives(artefact, tmp_path) -> None:
    art = tmp_path / "art"
    shutil.copytree(artefact("llama", compile_args={"tp_size": 2}, num_kv_heads=4), art)
    m = json.loads((art / "manifest.json").read_text())
    m["runtime"]["tp_size"] = 1
    (art / "manifest.json").write_text(json.dumps(m))
    _one_line_refusal(art, "runtime.tp_size is 1, the graph has collectives over [2] ranks")


def test_manifest_strings_are_printed_escaped(copy) -> None:
    """Item 5: a model_path with a terminal escape and newlines, a served_model_name that
    would forge a log line: both reach stderr escaped, one line each."""
    forged = "INFO kiln.serve: forged"
    m = json.loads((copy / "manifest.json").read_text())
    m["runtime"]["served_model_name"] = f"evil\n{forged}"
    (copy / "manifest.json").write_text(json.dumps(m))
    r = kiln("generate", str(copy), "--prompt", "x", "--max-new-tokens", "1")
    assert r.returncode == 0, r.stderr
    assert not any(line.startswith(forged) for line in r.stderr.splitlines()), r.stderr
    assert "evil\\nINFO" in r.stderr
    m["compile_args"]["model_path"] = "\x1b[2J\nrm -rf"
    m["target"]["features"] = [*m["target"]["features"], "no_such_feature"]
    (copy / "manifest.json").write_text(json.dumps(m))
    r = kiln("generate", str(copy), "--prompt", "x")
    assert r.returncode == 2 and "\x1b" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "\\x1b[2J\\nrm -rf" in r.stderr
    shown = kiln("inspect", str(copy))
    assert "\x1b" not in shown.stdout and "evil\\nINFO" in shown.stdout
