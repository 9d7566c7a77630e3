"""Quantization: linears (and the embedding tables they share) onto quantized formats.

The scheme comes from the compile arguments, resolved by `scheme_from_args`:
- `--quantization fp8`: fp8 e4m3 codes, one float32 scale per output row;
- `--quantization w8a8_int8`: int8 codes, one scale per output row, activations quantized
  per token by the kernel (int8 dot products);
- `--torchao-config int8wo`: int8 codes, one scale per output row (weight-only);
- `--torchao-config int4wo-G` (G = 32, 64, 128, 256): 4-bit codes with a scale and a min
  per G inputs of a row (weight-only);
- a GGUF checkpoint with `--dtype auto` (or `--quantization gguf`): each weight keeps the
  format of its GGUF blocks where kiln runs it as it is (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and
  the K-quants Q4_K, Q5_K, Q6_K as super-blocks: kiln/core/quant.py, no loss), tied
  embedding and lm_head included; a K-quant weight whose rank part is not whole super-blocks
  takes the same weights with a float32 scale a group;
  other block types are read as floats;
- an fp8 checkpoint (config `quant_method: fp8`): its fp8 e4m3 weights as stored, the
  128 x 128 block scales as a scale per row per 128 inputs (no loss).
With a float checkpoint the lm_head stays float, as SGLang leaves it.
`--quantize-activations int8` (scheme "activations") turns each uint4 / int8 weight into
uint4_a8 / int8_a8, and each GGUF format kept as stored into its own _a8 form (int8h_a8,
uint4k_a8, ...: kiln/core/quant.py; a table the embedding also reads keeps its stored
format where no embedding kernel reads the _a8 layout): the same codes and scales, run
with activations rounded to int8 per
group (kiln/core/quant.py); the other formats are left as they are.

A quantized linear becomes `quant_linear(x, codes, scales[, bias])` with its format and group
as attributes; the weight's recipe becomes {"quantize": recipe, "format", "group", "part"},
which the compile driver turns into stored codes and scales (the runtime only runs them).
Group 0 in a recipe is one scale per row. After the shard pass, a recipe is a rank's slice
of a weight: the driver quantizes the whole weight and keeps the slice's codes and scales,
so a tensor-parallel rank runs the numbers of tp=1 (a row-parallel part's groups must be
whole; per-row scales stay the whole row's). Only what depends on the activations' cut
differs: w8a8_int8 rounds each rank's part of a token, and a per-row int8_a8 group is the
rank's part of the row.
"""

from __future__ import annotations

from typing import Any

from kiln.core.ir import Graph, Node, WeightSpec
from kiln.core.layout import panel_shape
from kiln.core.quant import FORMATS, widest
from kiln.passes.options import CompileOptions, PassResult, Quantization, compiler_pass

# Roles (recorded at trace time) whose weights a float checkpoint keeps float, as SGLang
# leaves the lm_head (and the embedding table a tied lm_head shares).
# score: a classifier's head; expert_gate: Qwen2-MoE's one-row shared-expert gate (both
# float in SGLang too)
_FLOAT_ROLES = ("lm_head", "embedding", "score", "expert_gate")


@compiler_pass("quantization", "target")
def quantize(graph: Graph, ctx: CompileOptions) -> PassResult:
    scheme = ctx.quantization
    if scheme is None:
        return PassResult(graph, False)
    lanes = panel_shape(ctx.target)[0] if ctx.device == "cpu" else 16
    users = graph.users()
    changed = False
    for param in [n for n in graph.nodes if n.op == "param"]:
        spec = graph.weight_of(param)
        readers = users.get(param, [])
        if spec is None or len(spec.shape) != 2 or not _quantizable(param, readers):
            continue
        chosen = _format_for(spec, scheme, readers)
        if chosen is None:
            continue
        fmt, per = chosen  # per = 0: one scale per row (of this rank's part, when sharded)
        group = per or spec.shape[1]
        span = group * FORMATS[fmt].superblock
        if span and spec.shape[1] % span:
            # A rank's part that is not whole super-blocks (--tp-size): the same weights
            # with a float32 scale a group.
            fmt = FORMATS[fmt].full or fmt
        a8 = FORMATS[fmt].int8_activations
        table = any(r.op == "embedding" for r in readers)
        if scheme.int8_activations and a8 is not None and not (table and FORMATS[a8].qfmt is None):
            fmt = a8  # (a table shared with an embedding keeps a format it can read)
        form = FORMATS[fmt]
        if spec.shape[1] % group or group % form.group_step:
            # compiler/options.py checked the flags against the model's shapes
            raise ValueError(
                f"{param.attrs['name']}: {spec.shape[1]} inputs are not whole {fmt} groups "
                f"of {group}"
            )
        name = param.attrs["name"]
        recipe = {"quantize": spec.source, "format": fmt, "group": per}
        n, k = spec.shape
        graph.weights[name] = WeightSpec(
            (n, k),
            form.code_dtype,
            {**recipe, "part": "codes"},
            f"{form.layout}panels{lanes}",
        )
        scales_name = f"{name}.scales"
        graph.weights[scales_name] = WeightSpec(
            form.scales_shape(n, k, group),
            form.scale_dtype,
            {**recipe, "part": "scales"},
            f"{form.scale_layout}panels{lanes}",
        )
        scales = graph.param(scales_name, before=param)
        for r in readers:
            attrs = {"format": fmt, "group": group}
            if r.op == "linear":
                r.op, r.args = "quant_linear", [r.args[0], param, scales, *r.args[2:]]
                r.attrs = {**attrs, "out_features": n, "prologue": "none", "deterministic": 0}
            else:
                r.op, r.args = "quant_embedding", [r.args[0], param, scales]
                r.attrs = {**attrs, "num_embeddings": n}
            r.meta.pop("backend", None)
        changed = True
    return PassResult(graph, changed)


def _quantizable(param: Node, readers: list[Node]) -> bool:
    """Read only as a linear's weight or an embedding's table, and by a linear at least."""
    ok = all(n.op in ("linear", "embedding") and n.args[1] is param for n in readers)
    return ok and any(n.op == "linear" for n in readers) and param not in _rest(readers)


def _rest(readers: list[Node]) -> list[Node]:
    return [a for n in readers for a in n.args[2:]]


def _loads(source: dict[str, Any]) -> list[str] | None:
    """The checkpoint tensors a recipe reads, if it only loads, concatenates, cuts and
    reorders rows (a tensor-parallel rank's slice, Phi-3's fused weights)."""
    if "load" in source:
        return [source["load"]]
    if "slice" in source:
        return _loads(source["slice"])
    if "rotary_order" in source:
        return _loads(source["rotary_order"])
    if "concat" in source and source.get("dim") == 0:
        parts = [_loads(s) for s in source["concat"]]
        return None if any(p is None for p in parts) else [x for p in parts for x in p or []]
    return None


def _format_for(
    spec: WeightSpec, scheme: Quantization, readers: list[Node]
) -> tuple[str, int] | None:
    loads = _loads(spec.source)
    if loads is None:
        return None
    if scheme.stored is not None:  # as the checkpoint stores them, where every part agrees
        stored = scheme.stored
        formats = [stored.get(x) for x in loads]
        if not formats or any(f is None for f in formats):
            return None
        # Parts in several formats (GGUF Q8_0 v beside Q5_0 or Q5_1 q/k) at one group
        # size run in the one that holds each exactly (kiln.core.quant.widest).
        groups = {f[1] for f in formats if f is not None}
        common = widest({f[0] for f in formats if f is not None})
        return (common, groups.pop()) if common is not None and len(groups) == 1 else None
    if scheme.format is None or any(r.meta.get("role") in _FLOAT_ROLES for r in readers):
        return None
    return scheme.format, scheme.group
