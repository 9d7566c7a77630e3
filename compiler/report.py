"""What `kiln inspect` and `kiln diff` print about artefacts; reads files only (no torch)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kiln.compiler.store import explain
from kiln.core import artefact as fmt
from kiln.core.graph_json import load_graph
from kiln.core.ir import Graph, Node
from kiln.core.ops import ATTENTION_OPS, HOST_SYNC_OPS, STRUCTURAL_OPS
from kiln.terminal import printable

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4}
_DTYPE_BYTES |= {"float8_e4m3fn": 1, "float8_e5m2": 1}


def load(root: Path) -> tuple[dict[str, Any], Graph]:
    manifest = fmt.read_manifest(root)
    text = fmt.read_member(root, fmt.GRAPH, manifest["files"][fmt.GRAPH])
    return manifest, load_graph(text)


def step_source(root: Path) -> str:
    """The C of the artefact's lowered decode step (checked against the manifest), or one
    line saying why there is none."""
    manifest, graph = load(root)
    entry = manifest["files"].get(fmt.STEP_SOURCE)
    if manifest.get("native_step") is None or entry is None:
        why = (graph.plan or {}).get("decode", {}).get("native_refused") or "not a CPU target"
        return f"no native step: {printable(why)}\n"
    text = fmt.read_member(root, fmt.STEP_SOURCE, entry).decode("utf-8", "replace")
    return "".join(printable(line) + "\n" for line in text.splitlines())


def summary(root: Path) -> dict[str, Any]:
    manifest, graph = load(root)
    rt = manifest["runtime"]
    kernels = Counter(kernel_line(n) for n in graph.nodes if n.op not in STRUCTURAL_OPS)
    by_dtype: Counter[str] = Counter()
    for w in graph.weights.values():
        count = 1
        for d in w.stored_shape:
            count *= d
        by_dtype[f"{w.dtype} {w.layout}"] += count * _DTYPE_BYTES.get(w.dtype, 4)
    kv_per_token = 2 * rt["num_layers"] * rt["num_kv_heads"] * rt["head_dim"]
    kv_per_token *= _DTYPE_BYTES[rt["kv_dtype"]]
    native = manifest.get("native")
    cuts = set((graph.plan or {}).get("split_at", []))
    cut_nodes = [n for n in graph.nodes if n.name in cuts]
    return {
        "path": str(root),
        "model": {
            "name": rt["served_model_name"],
            "type": manifest["model"].get("model_type"),
            "layers": rt["num_layers"],
            "vocab_size": rt["vocab_size"],
            "context_length": rt["context_length"],
        },
        "target": f"{manifest['target']['device']}/{manifest['target']['isa']}",
        "features": manifest["target"]["features"],
        "dtype": rt["dtype"],
        "versions": {k: manifest[f"{k}_version"] for k in ("kiln", "torch")}
        | {"format": manifest["format_version"]},
        "cache_key": manifest["cache_key"],
        "passes": [
            f"{p['pass']}{'' if p.get('changed') else ' (no change)'}" for p in manifest["passes"]
        ],
        "kernels": dict(sorted(kernels.items())),
        "weight_bytes": dict(sorted(by_dtype.items())),
        "kv_cache": {
            "layers": rt["num_layers"],
            "kv_heads": rt["num_kv_heads"],
            "head_dim": rt["head_dim"],
            "page_size": rt["page_size"],
            "dtype": rt["kv_dtype"],
            "bytes_per_token": kv_per_token,
        },
        "capture_plan": graph.plan,
        # the nodes a piecewise capture cuts at: attentions, and MoEs (a prefill's)
        "capture_cuts": {
            "attention": sum(n.op in ATTENTION_OPS for n in cut_nodes),
            "moe": sum(n.op in HOST_SYNC_OPS for n in cut_nodes),
        },
        "native_step": None
        if manifest.get("native_step") is None
        else {k: manifest["native_step"][k] for k in ("build_id", "calls", "arena_width")}
        | {"weights": len(manifest["native_step"]["weights"])},
        "speculative": rt.get("speculative"),
        "native_kernels": None
        if native is None
        else {k: native[k] for k in ("build_id", "compiler", "flags", "lanes", "group_panels")},
    }


def kernel_line(n: Node) -> str:
    """What runs `n`: its kernel, or for an op that attends its decode and prefill ones."""
    prefill = n.meta.get("prefill_backend")
    if prefill is None or prefill == n.meta.get("backend"):
        return f"{n.op} -> {n.meta.get('backend')}"
    return f"{n.op} -> {n.meta.get('backend')} (decode) / {prefill} (prefill)"


def format_summary(s: dict[str, Any]) -> str:
    m = s["model"]
    lines = [
        f"artefact   {s['path']}",
        f"model      {m['name']} ({m['type']}, {m['layers']} layers, vocab {m['vocab_size']}, "
        f"context {m['context_length']})",
        f"target     {s['target']} [{' '.join(s['features']) or 'baseline'}], {s['dtype']}",
        f"built by   kiln {s['versions']['kiln']}, torch {s['versions']['torch']}, "
        f"format {s['versions']['format']}",
        f"cache key  {s['cache_key']}",
        f"passes     {', '.join(s['passes'])}",
        "kernels",
        *(f"  {k:<40} {n}" for k, n in s["kernels"].items()),
        "weights",
        *(f"  {k:<40} {_mb(b)}" for k, b in s["weight_bytes"].items()),
    ]
    kv = s["kv_cache"]
    lines.append(
        f"kv cache   {kv['layers']} layers x {kv['kv_heads']} kv heads x {kv['head_dim']}, "
        f"{kv['dtype']}, pages of {kv['page_size']}, {kv['bytes_per_token']} bytes per token"
    )
    plan = s["capture_plan"]
    if plan:
        d, p = plan["decode"], plan["prefill"]
        lines.append(
            f"capture    decode {d['mode']}"
            + (f" at batch {_sizes(d['batch_sizes'])}" if d["batch_sizes"] else "")
            + (", padded up to the next" if d["batch_sizes"] and d["padding"] else "")
            + f"; prefill {p['mode']}"
            + (f" at tokens {_sizes(p['tokens'])}" if p["tokens"] else "")
            + (f" (eager from %{p['eager_from']})" if p.get("eager_from") else "")
            + f"; {len(plan['split_at']) + 1} pieces between {s['capture_cuts']['attention']}"
            + " attentions"
            + (f" and {s['capture_cuts']['moe']} MoEs" if s["capture_cuts"]["moe"] else "")
        )
        if d.get("graphs_refused"):
            lines.append(f"graphs     decode without CUDA graphs: {d['graphs_refused']}")
    step = s.get("native_step")
    if step:
        lines.append(
            f"step       {_lowered(plan)} lowered to C: {step['calls']} kernel calls on "
            f"{step['weights']} weights, an arena of {step['arena_width']} floats a row "
            f"(build {step['build_id']}; `kiln inspect --step` prints it)"
        )
    elif plan and plan["decode"].get("native_refused"):
        why = plan["decode"]["native_refused"]
        lines.append(f"step       every step in the Python executor: {why}")
    spec = s.get("speculative")
    if spec and spec["algorithm"] == "NGRAM":
        lines.append(
            f"speculate  NGRAM: verify steps of up to {spec['num_draft_tokens']} tokens a "
            f"request (the last one and {spec['num_draft_tokens'] - 1} drafted); n-grams of "
            f"{spec['ngram_min_window']} to {spec['ngram_max_window']} tokens, branches of up "
            f"to {spec['ngram_branch_length']}"
        )
    elif spec:
        lines.append(
            f"speculate  {spec['algorithm']}: "
            f"{'draft model' if spec['algorithm'] == 'STANDALONE' else 'head'} "
            f"{spec['draft']['cache_key'][:16]} "
            f"(in draft/), up to {spec['num_steps']} drafted tokens a step"
        )
    nk = s["native_kernels"]
    if nk:
        lines.append(
            f"native     {nk['compiler']}, {' '.join(nk['flags'])} (build {nk['build_id']})"
        )
    # Names come from the manifest, which anyone can edit: one printed line per line here.
    return "\n".join(map(printable, lines))


def _lowered(plan: dict[str, Any] | None) -> str:
    """Which steps a lowered step runs, by the capture plan."""
    if plan and plan["prefill"]["mode"] == "native":
        return "every step (decode, prefill, extend: a row a new token)"
    return "decode"


def _sizes(sizes: list[int]) -> str:
    """1, 2, 4, ..., 256 (36 sizes): a long bucket list, shortened."""
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]} ({len(sizes)} sizes)"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def to_dot(graph: Graph) -> str:
    """The graph for graphviz: compute nodes labelled op / backend, weights as notes."""
    out = ["digraph kiln {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    ids = {id(n): f"n{i}" for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.op == "param":
            label = json.dumps(n.attrs["name"])
            out.append(f"  {ids[id(n)]} [shape=note, label={label}];")
            continue
        label = n.op + (f"\\n{n.meta['backend']}" if "backend" in n.meta else "")
        out.append(f'  {ids[id(n)]} [label="{label}"];')
        out += [f"  {ids[id(a)]} -> {ids[id(n)]};" for a in n.args]
    out.append("}")
    return "\n".join(out)


def diff(a: Path, b: Path) -> list[str]:
    """Cache factors that differ (old -> new), then graph and weight changes."""
    ma, ga = load(a)
    mb, gb = load(b)
    lines = [f"factor  {x}" for x in explain(ma["cache_factors"], mb["cache_factors"])]
    ka, kb = (
        Counter(kernel_line(n) for n in g.nodes if n.op not in STRUCTURAL_OPS) for g in (ga, gb)
    )
    for k in sorted(set(ka) | set(kb)):
        if ka[k] != kb[k]:
            lines.append(f"graph   {k}: {ka[k]} -> {kb[k]} nodes")
    for name in sorted(set(ga.weights) | set(gb.weights)):
        wa, wb = ga.weights.get(name), gb.weights.get(name)
        if wa is None or wb is None:
            lines.append(f"weight  {name} {'added' if wa is None else 'removed'}")
        elif (wa.shape, wa.dtype, wa.layout) != (wb.shape, wb.dtype, wb.layout):
            lines.append(
                f"weight  {name}: {list(wa.shape)} {wa.dtype} {wa.layout} -> "
                f"{list(wb.shape)} {wb.dtype} {wb.layout}"
            )
    fa, fb = ma["files"], mb["files"]
    for rel in sorted(set(fa) | set(fb)):
        if fa.get(rel, {}).get("sha256") != fb.get(rel, {}).get("sha256"):
            what = "added" if rel not in fa else "removed" if rel not in fb else "differs"
            lines.append(f"file    {rel}: {what}")
    return [printable(line) for line in lines]
