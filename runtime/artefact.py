"""Opening an artefact for execution: manifest, checks, graph and weights.

Imports the IR and the on-disk format from `kiln.compiler`, never `models/` or `passes/`:
everything the runtime needs is in the artefact.

An artefact is untrusted input. Checksums catch damage, not tampering (whoever edits a file
can recompute them), so every file is also checked for sense: the manifest against its
schema, the graph field by field (`kiln.core.graph_json`), feature sizes through the
graph (`kiln.core.shapes`), every kernel the graph names, every weight's shape and
dtype, and the manifest's model numbers against the graph's. A failure is one line.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core import artefact as fmt
from kiln.core.check import check, infer_types
from kiln.core.graph_json import load_graph
from kiln.core.ir import Graph, IRError
from kiln.core.lazy import lazy_module
from kiln.core.ops import ATTENTION_OPS, STRUCTURAL_OPS
from kiln.core.target import Target, missing_on_host
from kiln.kernels import catalog
from kiln.runtime.native import open_library, open_step
from kiln.runtime.weights import HostWeights
from kiln.version import __version__

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

log = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime knows about the model: the manifest's `runtime` section."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    dtype: str
    page_size: int
    kv_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    served_model_name: str
    tp_size: int = 1
    long_rope: tuple[dict[str, Any], ...] = ()  # kiln.core.artefact.LongRope
    v_head_dim: int | None = None  # the V pool's width where not head_dim (MLA: 0)
    speculative: dict[str, Any] | None = None  # kiln.core.artefact.Speculative
    is_embedding: bool = False  # its steps give hidden states to pool, not logits
    # generation_config.json's recommended sampling, as stated (SAMPLING_DEFAULT_KEYS)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    embedding_dim: int | None = None  # an embedding model's pooled width
    # Whether a request's `dimensions` may cut it (a Matryoshka model), and to which
    # widths (empty: any up to embedding_dim).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # A sequence classifier's label names (its pooled output: their logits, not normalised)
    labels: tuple[str, ...] = ()
    # --enable-return-hidden-states: its steps give the logits rows' final hidden states too
    return_hidden_states: bool = False
    # EAGLE: its steps give every row's hidden states for its head, this wide, too
    eagle_hidden: int = 0
    # An EAGLE-3 head's logits: its draft vocabulary (None: vocab_size)
    logits_size: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)


def model_spec(manifest: dict[str, Any]) -> ModelSpec:
    rt = dict(manifest["runtime"])
    rt["eos_token_ids"] = tuple(rt["eos_token_ids"])
    rt["long_rope"] = tuple(rt.get("long_rope", ()))
    rt["matryoshka_dimensions"] = tuple(rt.get("matryoshka_dimensions", ()))
    rt["labels"] = tuple(rt.get("labels", ()))
    return ModelSpec(**rt)


def checked_manifest(root: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of the artefact at `root`, once its format, kiln and torch versions and
    target fit this host and (with `verify`) every file matches its checksum."""
    manifest = fmt.read_manifest(root)
    check_versions(root, manifest)
    check_target(root, manifest)
    if verify:
        fmt.verify_files(root, manifest)
    return manifest


@dataclass
class Artefact:
    root: Path
    manifest: dict[str, Any]
    spec: ModelSpec
    graph: Graph
    # A CPU artefact's weights as numpy views of the mapped file (runtime/weights.py):
    # what the native step binds, no torch needed. None on a GPU, where `weights` is all.
    host: HostWeights | None
    lib: Any = None  # the native kernel library (runtime/native.py), when the graph uses it
    step_lib: Any = None  # the native decode step (runtime/native.py open_step), if loaded
    device: str = "cpu"  # where the weights were loaded (runtime/placement.py)
    _weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The weights as torch tensors (on the host, views of `host`'s memory, made at
        the first call: the Python executor's and the reference kernels' input)."""
        if self._weights is None:
            assert self.host is not None
            self._weights = self.host.tensors()
        return self._weights

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer files the manifest lists, by name, each read once and checked
        against its checksum: nothing unlisted is ever read, and no symbolic link followed."""
        return tokenizer_files(self.root, self.manifest)

    @classmethod
    def open(
        cls,
        root: str | Path,
        verify: bool = True,
        trust_remote_code: bool = False,
        rank: int = 0,
        device: str | None = None,
        manifest: dict[str, Any] | None = None,
        file_check: fmt.FileCheck | None = None,
        mapped: bool = True,
        model: Artefact | None = None,
    ) -> Artefact:
        """Load and check an artefact (tensor-parallel rank `rank`'s graph and weights, onto
        `device`: by default the target's); raises ArtefactError with one line naming the
        problem. `manifest`: one `checked_manifest(root, verify=False)` already read;
        `file_check`: its files' checksums already under way, waited for if it covers the
        manifest (else they are computed here). `mapped`: False reads the weights file
        into memory instead of mapping it (--weight-loader-disable-mmap). `model`: the
        artefact whose weights this one's graph takes (source {"model": name}: an EAGLE
        head's embedding and lm_head), served from its memory."""
        root = Path(root)
        if manifest is None:
            manifest = checked_manifest(root, verify)
        elif verify and file_check is not None and file_check.covers(root, manifest):
            file_check.wait()
        elif verify:
            fmt.verify_files(root, manifest)
        device = device or manifest["target"]["device"]
        spec = model_spec(manifest)
        if not 0 <= rank < spec.tp_size:
            raise fmt.ArtefactError(f"{root} has ranks 0..{spec.tp_size - 1}, not {rank}")
        graph = _load_graph(root, manifest, fmt.graph_file(rank))
        wfile = fmt.weights_file(rank)
        # The file the checksums covered, reached as they reached it (no symbolic link),
        # mapped; on a GPU its tensors are copied to the device and the mapping let go.
        fd = fmt.open_member(root, wfile)
        try:
            host = HostWeights(fd, mapped)
        except Exception as e:
            raise fmt.ArtefactError(f"{root}/{wfile} is damaged: {e}") from e
        borrowed = {n: s.source["model"] for n, s in graph.weights.items() if "model" in s.source}
        if borrowed and (model is None or model.host is None):
            raise fmt.ArtefactError(
                f"{root} takes {len(borrowed)} weights from its model's artefact, which "
                "serves them from host memory: open it through its model's"
            )
        for name, theirs in borrowed.items():
            assert model is not None and model.host is not None
            if name != theirs or name not in model.host:
                raise fmt.ArtefactError(f"{root}: its model has no weight {theirs!r}")
            host.adopt(name, model.host)
        _check_weights(root / wfile, graph, {n: (host[n].shape, host.dtype(n)) for n in host})
        _check_agreement(root, spec, graph)
        tensors = None
        if device != "cpu":
            tensors = {n: t.to(device) for n, t in host.tensors().items()}
        lib = open_library(root, manifest, graph, trust_remote_code)
        step_lib = None
        if lib is not None and rank == 0:
            step_lib = open_step(root, manifest, trust_remote_code)
        kept = host if tensors is None else None
        return cls(root, manifest, spec, graph, kept, lib, step_lib, device, tensors)


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def check_versions(root: Path, manifest: dict[str, Any]) -> None:
    """The documented rule (docs/serving.md): the artefact format must match exactly (checked
    with the manifest); kiln and torch must match in major.minor, else the artefact is
    refused; a different patch release (or local build tag) only warns."""
    for name, ours in (("kiln", __version__), ("torch", torch_version())):
        theirs = manifest[f"{name}_version"]
        if theirs == ours:
            continue
        if _major_minor(theirs) != _major_minor(ours):
            raise fmt.ArtefactError(
                f"{root} was compiled with {name} {theirs}; this is {name} {ours}: "
                "recompile it with this kiln (`kiln compile`)"
            )
        log.warning("%s was compiled with %s %s; this is %s %s", root, name, theirs, name, ours)


def torch_version() -> str:
    """This torch's version, without importing it where it is not imported yet."""
    if "torch" in sys.modules and hasattr(sys.modules["torch"], "__version__"):
        return str(sys.modules["torch"].__version__)
    return importlib.metadata.version("torch")


def check_target(root: Path, manifest: dict[str, Any]) -> None:
    """The host must have what the artefact's target requires."""
    target = Target.from_json(manifest["target"])
    missing = missing_on_host(target)
    if missing:
        device = "cpu" if target.device == "cpu" or missing == ["a CUDA GPU"] else "cuda"
        raise fmt.ArtefactError(
            f"{root} was compiled for {target}; this machine lacks {', '.join(missing)}. "
            "Compile for this machine: "
            + fmt.compile_command(manifest, f"--device {device} --target-isa native")
        )


def tokenizer_files(root: Path, manifest: dict[str, Any]) -> dict[str, bytes]:
    """See `Artefact.tokenizer_files`."""
    prefix = fmt.TOKENIZER_DIR + "/"
    return {
        rel.removeprefix(prefix): fmt.read_member(root, rel, entry)
        for rel, entry in manifest["files"].items()
        if rel.startswith(prefix)
    }


def _load_graph(root: Path, manifest: dict[str, Any], name: str = fmt.GRAPH) -> Graph:
    where = f"{root}/{name}"
    text = fmt.read_member(root, name, manifest["files"][name])
    try:
        graph = load_graph(text)
        check(graph)
    except (IRError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fmt.ArtefactError(f"{where} is invalid: {e}") from None
    for n in graph.nodes:
        if n.op in STRUCTURAL_OPS:
            continue
        phases = {"backend": "decode"}
        if n.op in ATTENTION_OPS:  # one kernel for decode steps, one for the others
            phases = {"backend": "decode", "prefill_backend": "prefill"}
        for key, phase in phases.items():
            backend = n.meta.get(key)
            try:
                kernel = catalog.get(n.op, str(backend))
            except KeyError:
                raise fmt.ArtefactError(
                    f"{where}: %{n.name} asks for the {backend!r} kernel of {n.op}, "
                    "which this kiln does not have"
                ) from None
            if phase not in kernel.phases:
                raise fmt.ArtefactError(
                    f"{where}: %{n.name} asks the {backend} kernel of {n.op} to run {phase} "
                    "steps, which it does not"
                )
            refused = kernel.refuses(n.attrs)
            if refused is not None:
                raise fmt.ArtefactError(
                    f"{where}: %{n.name} asks the {backend} kernel of {n.op} for "
                    f"{refused}={n.attrs[refused]!r}, which it does not compute"
                )
    return graph


def _check_weights(
    where: Path, graph: Graph, found: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    """Every weight the graph names, of its shape and element type (a file's tensors are
    contiguous by the format: each is one run of bytes)."""
    for name, spec in graph.weights.items():
        if name not in found:
            raise fmt.ArtefactError(f"{where} lacks {name!r}")
        shape, dtype = found[name]
        if tuple(shape) != spec.stored_shape or dtype != spec.dtype:
            raise fmt.ArtefactError(
                f"{where}: {name!r} is {tuple(shape)} {dtype}, the graph says "
                f"{spec.stored_shape} {spec.dtype}"
            )


def _check_agreement(root: Path, spec: ModelSpec, graph: Graph) -> None:
    """The manifest's runtime numbers (used to size the KV pool and check token ids)
    against the graph they describe."""

    def refuse(what: str, manifest_value: object, graph_value: object) -> None:
        raise fmt.ArtefactError(
            f"{root}/{fmt.MANIFEST} disagrees with {fmt.GRAPH}: runtime.{what} is "
            f"{manifest_value}, the graph has {graph_value}"
        )

    # Compared by count first: the manifest's number sizes nothing until it matches.
    layers = sorted(n.attrs["layer"] for n in graph.nodes if n.op in ATTENTION_OPS)
    if len(layers) != spec.num_layers or layers != list(range(len(layers))):
        refuse("num_layers", spec.num_layers, f"attention layers {layers[:8]}")
    if graph.context_length != spec.context_length:
        refuse("context_length", spec.context_length, graph.context_length)
    collectives = {n.attrs["ranks"] for n in graph.nodes if n.op in ("all_reduce", "all_gather")}
    if collectives - {spec.tp_size} or (spec.tp_size > 1 and not collectives):
        refuse("tp_size", spec.tp_size, f"collectives over {sorted(collectives) or 'no'} ranks")
    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            if n.attrs["num_kv_heads"] != spec.num_kv_heads:
                refuse("num_kv_heads", spec.num_kv_heads, n.attrs["num_kv_heads"])
            if n.attrs["head_dim"] != spec.head_dim:
                refuse("head_dim", spec.head_dim, n.attrs["head_dim"])
        if n.op in ("embedding", "packed_embedding", "quant_embedding"):
            table = graph.weights[n.args[1].attrs["name"]]
            if table.shape[0] != spec.vocab_size:
                refuse("vocab_size", spec.vocab_size, f"an embedding of {table.shape[0]} rows")
            if table.dtype != spec.dtype and n.op != "quant_embedding":
                refuse("dtype", spec.dtype, table.dtype)
    outs = infer_types(graph)[graph.output.name]
    if len(outs) != 1 + (spec.return_hidden_states or spec.eagle_hidden > 0):
        refuse("return_hidden_states", spec.return_hidden_states, f"{len(outs)} step outputs")
    if spec.eagle_hidden and outs[1].features != spec.eagle_hidden:
        refuse("eagle_hidden", spec.eagle_hidden, f"hidden states of {outs[1].features}")
    out = outs[0]
    head = any(n.meta.get("role") == "lm_head" for n in graph.nodes)
    if spec.is_embedding == head:  # an embedding model's steps end at the final norm
        refuse("is_embedding", spec.is_embedding, "an lm_head" if head else "no lm_head")
    if head and out.features != (spec.logits_size or spec.vocab_size):
        refuse(
            "vocab_size", spec.logits_size or spec.vocab_size, f"logits of {out.features} features"
        )
    score = any(n.meta.get("role") == "score" for n in graph.nodes)  # a classifier's head
    if score != bool(spec.labels) or (score and out.features != len(spec.labels)):
        had = f"a score head of {out.features} labels" if score else "no score head"
        refuse("labels", len(spec.labels), had)
    ids = [*spec.eos_token_ids, *([spec.bos_token_id] if spec.bos_token_id is not None else [])]
    if any(t >= spec.vocab_size for t in ids):
        refuse("bos/eos token ids", ids, f"a vocabulary of {spec.vocab_size}")
