"""LoRA adapters served beside the base model (SGLang's --enable-lora and --lora-paths).

An adapter is a PEFT folder: `adapter_config.json` (rank `r`, `lora_alpha`, the target
modules) and `adapter_model.safetensors` (per module, `lora_A` [r, in] and `lora_B`
[out, r]). A request that names one gets, on every linear the adapter targets,
y = x W^T + scale (x A^T) B^T, scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA);
requests of other adapters and of the base model share its steps.

The compiled graph fused and reordered the base weights (q, k and v into one linear, gate
and up into another, rows of q and k in the rotary kernel's order): every linear's weight
records the recipe that built it from checkpoint tensors (kiln/core/ir.py WeightSpec). An
adapter's B matrices go through the same recipe, with each checkpoint tensor replaced by
its module's B, so the delta's rows land where the base weight's rows did: one A [R, in]
and one B [out, R] per graph linear, R the ranks of its modules summed (B block-diagonal
over them). Nothing is merged into the base weights, which stay shared (and quantized).
A and B stay as the file has them when both are bfloat16 (half the bytes a token reads
through them; the scale is applied to x A^T, so nothing is rounded), else float32.

The native step has a hook after each such linear (kernels/csrc/kiln_step.h step_lora;
runtime/native_step.py passes each step's adapters, rows and tables), so adapters' steps
run natively with the base model's. Where a step is not native (a CUDA target, a step not
lowered) the Python executor runs it, its linears wrapped to add each adapter's delta on
that adapter's rows. Speculative decoding and latent-attention models are refused.

Tensor parallelism (passes/shard.py): a rank's linear holds a slice of the weight. A
column-parallel one (q, k, v, gate, up: output rows [lo, hi)) takes the same rows of B,
through the recipe as above; a row-parallel one (o, down: input columns [lo, hi), the
ranks' partial sums then all-reduced) takes those columns of A, so each rank's delta is
its part of (x A^T) B^T and the all-reduce that sums the base model's parts sums the
deltas' too: no traffic of its own. Every rank holds the same adapters in the same slots
(rank 0 tells the others what to load: runtime/parallel.py TPGroup.control).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.core.ir import Graph, Node
from kiln.core.recipes import (
    FUSED_MODULES,
    LORA_MODULES,
    head_part_rows,
    lora_modules,
    recipe_loads,
    rotary_rows,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LINEAR_OPS = ("linear", "packed_linear", "quant_linear")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KEY = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)(?:\.default)?\.weight$")
MAX_ADAPTER_BYTES = 4 << 30


class LoraError(ValueError):
    """An adapter that cannot be served: the message names it and what is wrong."""


@dataclass(frozen=True)
class AdapterSource:
    """One --lora-paths entry: `PATH`, `NAME=PATH` or {"lora_name", "lora_path", "pinned"}."""

    name: str
    path: str
    pinned: bool = False

    @classmethod
    def parse(cls, entry: str) -> AdapterSource:
        text = entry.strip()
        if text.startswith("{"):
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise LoraError(f"--lora-paths: {entry!r} is not valid JSON ({e})") from None
            if not isinstance(d, dict) or set(d) - {"lora_name", "lora_path", "pinned"}:
                raise LoraError(
                    f"--lora-paths: {entry!r}: a JSON entry has lora_name, lora_path and pinned"
                )
            name, path, pinned = d.get("lora_name"), d.get("lora_path"), d.get("pinned", False)
            if not isinstance(name, str) or not isinstance(path, str):
                raise LoraError(f"--lora-paths: {entry!r}: lora_name and lora_path are strings")
            if not isinstance(pinned, bool):
                raise LoraError(f"--lora-paths: {entry!r}: pinned is true or false")
        elif "=" in text:
            name, path = (s.strip() for s in text.split("=", 1))
            pinned = False
        else:
            path, pinned = text, False
            name = Path(path).name
        check_name(name, "--lora-paths: ")
        return cls(name, path, pinned)


def check_name(name: str, where: str = "") -> None:
    """An adapter name a request can spell (and /v1/models list): LoraError otherwise."""
    if not _NAME.match(name):
        raise LoraError(
            f"{where}adapter name {name!r}: letters, digits, '.', '_' and '-', at most 128, "
            "starting with a letter or digit"
        )


def parse_lora_paths(entries: Iterable[str]) -> list[AdapterSource]:
    sources = [AdapterSource.parse(e) for e in entries]
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LoraError(f"--lora-paths: adapter name {twice[0]!r} is given twice")
    return sources


@dataclass
class Adapter:
    """An adapter as read: per module name (`model.layers.0.self_attn.q_proj`), A [r, in],
    B [out, r] (bfloat16 as stored, or float32) and its scale."""

    name: str
    path: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def targets(self) -> set[str]:
        """The PEFT module kinds it touches (q_proj, down_proj...)."""
        return {m.rsplit(".", 1)[-1] for m in self.modules}


def read_adapter(source: AdapterSource, max_rank: int | None = None) -> Adapter:
    """The adapter in folder `source.path`, checked: a LoraError names what is wrong."""
    from safetensors import safe_open

    root = Path(source.path)
    where = f"LoRA adapter {source.name!r} ({root})"
    if not (root / ADAPTER_CONFIG).is_file():
        raise LoraError(f"{where}: no {ADAPTER_CONFIG} (a PEFT adapter folder is expected)")
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = (root / "adapter_model.bin").is_file()
        raise LoraError(
            f"{where}: no {ADAPTER_WEIGHTS}"
            + ("; adapter_model.bin is a pickle, which kiln does not load" if pickled else "")
        )
    if weights.stat().st_size > MAX_ADAPTER_BYTES:
        raise LoraError(f"{where}: {ADAPTER_WEIGHTS} is over {MAX_ADAPTER_BYTES >> 30} GiB")
    try:
        cfg = json.loads((root / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{where}: {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    default_rank, default_alpha = _check_config(cfg, where)
    ranks = _Pattern(cfg.get("rank_pattern") or {}, default_rank, "rank_pattern", where)
    alphas = _Pattern(cfg.get("alpha_pattern") or {}, default_alpha, "alpha_pattern", where)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = f.keys()  # a safetensors handle is not iterable
            for key in names:
                m = _KEY.match(key)
                if m is None:
                    raise LoraError(
                        f"{where}: tensor {key!r} is not a linear's lora_A or lora_B (embedding "
                        "adapters, modules_to_save and DoRA are not supported)"
                    )
                parts.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(key)
    except LoraError:
        raise
    except Exception as e:  # a damaged file: safetensors' own error, named
        raise LoraError(f"{where}: {ADAPTER_WEIGHTS}: {e}") from None
    modules = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraError(f"{where}: {module} has {sorted(ab)}, not lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        rank, alpha = int(ranks.of(module)), float(alphas.of(module))
        if max_rank is not None and rank > max_rank:
            raise LoraError(f"{where}: {module}: rank {rank} is above --max-lora-rank {max_rank}")
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
            raise LoraError(f"{where}: {module}: lora_A and lora_B must be float tensors")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(
                f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not have rank {rank}"
            )
        kept = torch.bfloat16 if a.dtype == b.dtype == torch.bfloat16 else torch.float32
        a, b = a.to(kept), b.to(kept)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{where}: {module}: lora_A or lora_B holds inf or NaN")
        modules[module] = (a.contiguous(), b.contiguous(), scale)
    if not modules:
        raise LoraError(f"{where}: {ADAPTER_WEIGHTS} holds no lora_A / lora_B tensors")
    return Adapter(source.name, str(root), max(a.shape[0] for a, _, _ in modules.values()), modules)


# Characters that would make a PEFT pattern key a regular expression: kiln takes keys as
# names (a module's whole name, or its last dotted parts), never as a pattern a file wrote.
_REGEX = set("*+?[](){}|^$\\")


class _Pattern:
    """PEFT's rank_pattern / alpha_pattern: a value for the modules a key names (the
    module's whole name, or a suffix of it at a dot, first key first), else `default`."""

    def __init__(self, table: Any, default: float, what: str, where: str) -> None:
        if not isinstance(table, dict):
            raise LoraError(f"{where}: {what} must be an object")
        for key, value in table.items():
            if set(key) & _REGEX:
                raise LoraError(
                    f"{where}: {what} key {key!r}: regular expressions are not supported "
                    "(name modules, or their last dotted parts)"
                )
            if what == "rank_pattern":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and math.isfinite(value)
            if not ok:
                raise LoraError(f"{where}: {what}[{key!r}] = {value!r} is not a valid value")
        self.table, self.default = table, default

    def of(self, module: str) -> float:
        for key, value in self.table.items():
            if module == key or module.endswith("." + key):
                return float(value)
        return self.default


def _check_config(cfg: dict[str, Any], where: str) -> tuple[int, float]:
    """The adapter's rank and alpha, once its config is one kiln serves."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{where}: peft_type {peft_type!r}; kiln serves LORA adapters")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"{where}: r must be a positive integer, got {rank!r}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    refused = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "modules_to_save": "modules_to_save",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise LoraError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    return rank, float(alpha)


@dataclass(frozen=True)
class Delta:
    """An adapter's part of one graph linear: a row's delta is ((x A^T) * scale) B^T (two
    matmuls over contiguous rows, 2.3x faster at one row and rank 8 than over the transposed
    views, a 2-core Zen 3)."""

    at: torch.Tensor  # A^T [in, R], float32 or bfloat16
    bt: torch.Tensor  # B^T [R, out], A^T's dtype
    # per row of B^T, the columns [lo, hi) outside which it is zero ([R, 2] int64; a fused
    # linear's B is block-diagonal over its parts; the native step's hook reads only these)
    span: torch.Tensor
    scale: torch.Tensor  # [R] float32: each rank row's module's scale


@dataclass
class _Linear:
    """A graph linear an adapter may touch: its weight's recipe, with the checkpoint
    modules it is built from, in order."""

    param: str
    recipe: dict[str, Any]
    modules: list[str]
    out_features: int
    in_features: int
    prologue: str
    # the input columns [lo, hi) a row-parallel rank's weight keeps (None: all of them)
    columns: tuple[int, int] | None = None
    deltas: dict[int, Delta] = field(default_factory=dict)  # slot -> its adapter's


class LoraBank:
    """Every linear of a graph that adapters may touch, the adapters loaded into slots
    (slot 0 is the base model), and the executor's wrapped kernels."""

    def __init__(
        self, graph: Graph, targets: Iterable[str] | None = None, device: str = "cpu"
    ) -> None:
        """`targets`: --lora-target-modules (None or "all": every module kiln supports);
        `device`: where the deltas live (the runner's weights')."""
        self.device = device
        chosen = set(targets or ()) - {"all"}
        if not chosen or "all" in (targets or ()):
            chosen = set(LORA_MODULES)
        for fused, parts in FUSED_MODULES.items():  # qkv_proj admits q, k and v too
            if fused in chosen:
                chosen |= set(parts)
        self.targets = chosen & set(LORA_MODULES)
        self.linears: dict[str, _Linear] = {}
        self._by_module: dict[str, _Linear] = {}
        self.version = 0  # counts adapters added and removed (the native step's tables)
        for n in graph.nodes:
            if n.op in ("mla_attention", "latent_attention"):
                raise LoraError("LoRA: latent-attention models (DeepSeek) are not supported")
            if n.op not in LINEAR_OPS:
                continue
            param = n.args[1]
            if param.op != "param":
                continue
            name = param.attrs["name"]
            spec = graph.weights.get(name)
            if spec is None:
                continue
            modules = lora_modules(spec.source)
            if not modules:
                continue
            recipe = spec.source.get("quantize", spec.source)
            linear = _Linear(
                name,
                recipe,
                modules,
                int(n.attrs.get("out_features") or spec.shape[0]),
                int(recipe_loads(recipe)[0]["shape"][1]),
                str(n.attrs.get("prologue", "none")),
                _columns(recipe),
            )
            self.linears[name] = linear
            for m in modules:
                self._by_module[m] = linear

    def add(self, slot: int, adapter: Adapter) -> None:
        """Load `adapter` into `slot` (1, 2, ...): its deltas per graph linear."""
        outside = sorted({m.rsplit(".", 1)[-1] for m in adapter.modules} - self.targets)
        if outside:
            raise LoraError(
                f"LoRA adapter {adapter.name!r} targets {', '.join(outside)}, outside "
                f"--lora-target-modules ({', '.join(sorted(self.targets))})"
            )
        touched: dict[str, _Linear] = {}
        for module in adapter.modules:
            linear = self._by_module.get(module)
            if linear is None:
                raise LoraError(
                    f"LoRA adapter {adapter.name!r}: this model has no linear {module!r}"
                )
            touched[linear.param] = linear
        made = {name: self._delta(linear, adapter) for name, linear in touched.items()}
        for name, delta in made.items():  # all checked first: nothing half-loaded
            self.linears[name].deltas[slot] = delta
        self.version += 1

    def remove(self, slot: int) -> None:
        for linear in self.linears.values():
            linear.deltas.pop(slot, None)
        self.version += 1

    def _delta(self, linear: _Linear, adapter: Adapter) -> Delta:
        where = f"LoRA adapter {adapter.name!r}"
        # a checkpoint's fused module is read once a part (Phi-3's q, k, v slices of qkv_proj)
        present = list(dict.fromkeys(m for m in linear.modules if m in adapter.modules))
        cols: dict[str, int] = {}
        total = 0
        for m in present:
            cols[m] = total
            total += adapter.modules[m][0].shape[0]
        a_parts, scales = [], []
        # bfloat16 if every part is (a fused linear's parts, q, k and v, are modules apart)
        bf16 = all(adapter.modules[m][0].dtype == torch.bfloat16 for m in present)
        dtype = torch.bfloat16 if bf16 else torch.float32
        for m in present:
            a, _, scale = adapter.modules[m]
            scales.append(torch.full((a.shape[0],), scale))
            if a.shape[1] != linear.in_features:
                raise LoraError(
                    f"{where}: {m}.lora_A has {a.shape[1]} inputs; the model's has "
                    f"{linear.in_features}"
                )
            if linear.columns is not None:  # a row-parallel rank's part of the inputs
                a = a[:, linear.columns[0] : linear.columns[1]]
            a_parts.append(a.to(dtype))

        def b_of(load: dict[str, Any]) -> torch.Tensor:
            module = str(load["load"]).removesuffix(".weight")
            rows = int(load["shape"][0])
            out = torch.zeros(rows, total, dtype=dtype)
            if module in cols:
                b = adapter.modules[module][1]
                if b.shape[0] != rows:
                    raise LoraError(
                        f"{where}: {module}.lora_B has {b.shape[0]} outputs; the model's has {rows}"
                    )
                out[:, cols[module] : cols[module] + b.shape[1]] = b.to(dtype)
            return out

        b = _rows(linear.recipe, b_of)
        if b.shape[0] != linear.out_features:
            rows = f"{b.shape[0]} rows, not {linear.out_features}"
            raise LoraError(f"{where}: {linear.param}: {rows}")
        bt = b.T.contiguous()
        at, span, scaled = torch.cat(a_parts).T.contiguous(), _spans(bt), torch.cat(scales)
        if self.device != "cpu":
            # the executor's matmuls run beside the weights, and there every step: float32,
            # widened once here rather than each call (the native step's hooks read bf16)
            at, bt = at.float().to(self.device), bt.float().to(self.device)
            scaled = scaled.to(self.device)
        return Delta(at, bt, span, scaled)

    def wrap(
        self, node: Node, kernel: Callable[..., Any], needs_ctx: bool
    ) -> tuple[Callable[..., Any], bool]:
        """The executor's kernel for `node`: a linear adapters may touch adds their deltas
        on their rows (`ctx.lora`: (slot, row indices or None for all) per adapter)."""
        if node.op not in LINEAR_OPS or node.args[1].op != "param":
            return kernel, needs_ctx
        linear = self.linears.get(node.args[1].attrs["name"])
        if linear is None:
            return kernel, needs_ctx
        return _lora_linear(kernel, needs_ctx, linear), True

    def __len__(self) -> int:
        return len(self.linears)


def _spans(bt: torch.Tensor) -> torch.Tensor:
    """Per row of B^T, the columns [lo, hi) holding its non-zeros ([0, 0) for none)."""
    nonzero = bt != 0
    cols = torch.arange(bt.shape[1])
    lo = torch.where(nonzero, cols, bt.shape[1]).min(dim=1).values
    hi = torch.where(nonzero, cols + 1, 0).max(dim=1).values
    return torch.stack((torch.minimum(lo, hi), hi), dim=1).contiguous()


def _rows(src: dict[str, Any], load: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor:
    """A weight recipe's row operations (concat, slice along rows, rotary and head-part
    orders) applied to other tensors: `load` gives each checkpoint tensor's stand-in."""
    if "load" in src:
        return load(src)
    if "concat" in src and src.get("dim", 0) == 0:
        return torch.cat([_rows(s, load) for s in src["concat"]])
    if "slice" in src and src["dim"] == 0:
        return _rows(src["slice"], load)[src["start"] : src["stop"]]
    if "slice" in src and src["dim"] == 1:  # a row-parallel rank's columns: rows all kept
        return _rows(src["slice"], load)
    if "rotary_order" in src:
        return _rows(src["rotary_order"], load)[rotary_rows(src)]
    if "head_parts" in src:
        return _rows(src["head_parts"], load)[head_part_rows(src)]
    raise LoraError(f"LoRA: a weight built by {sorted(src)} cannot take an adapter")


def _columns(src: dict[str, Any]) -> tuple[int, int] | None:
    """The input columns [start, stop) of the checkpoint's weight that a recipe keeps (a
    row-parallel rank's slice along dim 1), or None when it keeps them all."""
    found: set[tuple[int, int] | None] = set()
    if "slice" in src and src["dim"] == 1:
        if _columns(src["slice"]) is not None:
            raise LoraError("LoRA: a weight sliced twice along its inputs cannot take an adapter")
        return int(src["start"]), int(src["stop"])
    for key in ("slice", "concat", "rotary_order", "head_parts"):
        inner = src.get(key)
        for part in inner if isinstance(inner, list) else [inner] if inner else []:
            found.add(_columns(part))
    if len(found) > 1:
        raise LoraError("LoRA: a weight whose parts keep different inputs cannot take an adapter")
    return found.pop() if found else None


def _lora_linear(
    kernel: Callable[..., Any], needs_ctx: bool, linear: _Linear
) -> Callable[..., Any]:
    from kiln.core.ops.elementwise import silu_and_mul

    deltas = linear.deltas
    gated = linear.prologue == "silu_and_mul"

    def run(ctx: Any, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        out = kernel(ctx, x, *rest) if needs_ctx else kernel(x, *rest)
        groups = [(deltas[s], rows) for s, rows in ctx.lora if s in deltas]
        if not groups:
            return out
        h = silu_and_mul.kernel(x) if gated else x
        h = h.float()
        for d, rows in groups:
            at, bt = d.at.float(), d.bt.float()
            if rows is None and out.dtype == torch.float32:
                out = torch.addmm(out, (h @ at) * d.scale, bt)  # every row this adapter's
                continue
            part = h if rows is None else h.index_select(0, rows)
            delta = (((part @ at) * d.scale) @ bt).to(out.dtype)
            out = out + delta if rows is None else out.index_add(0, rows, delta)
        return out

    return run


def step_groups(
    adapters: list[int], q_lens: list[int], device: Any = "cpu"
) -> list[tuple[int, Any]]:
    """Per adapter slot of a step's sequences (0, the base, left out): the rows of its
    tokens, as an index tensor on `device`, or None when it has every row."""
    if not any(adapters):
        return []
    if len(set(adapters)) == 1:
        return [(adapters[0], None)]
    rows: dict[int, list[int]] = {}
    at = 0
    for slot, q in zip(adapters, q_lens, strict=True):
        if slot:
            rows.setdefault(slot, []).extend(range(at, at + q))
        at += q
    return [(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in rows.items()]
