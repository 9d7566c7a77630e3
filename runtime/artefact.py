"""Opening an artefact for execution: manifest, checks, graph and weights.

Imports the IR and the on-disk format from `kiln.compiler`, never `models/` or `passes/`:
everything the runtime needs is in the artefact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kiln.compiler import artefact as fmt
from kiln.compiler.ir import Graph, IRError


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
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    served_model_name: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Artefact:
    root: Path
    manifest: dict[str, Any]
    spec: ModelSpec
    graph: Graph
    weights: dict[str, torch.Tensor]

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / fmt.TOKENIZER_DIR

    @classmethod
    def open(cls, root: str | Path, verify: bool = True) -> Artefact:
        """Load and check an artefact; raises ArtefactError with one line naming the problem."""
        root = Path(root)
        manifest = fmt.read_manifest(root)
        device = manifest["target"]["device"]
        if device == "cuda" and not torch.cuda.is_available():
            raise fmt.ArtefactError(
                f"{root} was compiled for cuda; this machine has no CUDA "
                "device (recompile with --device cpu)"
            )
        if verify:
            fmt.verify_files(root, manifest)
        try:
            graph = Graph.loads((root / fmt.GRAPH).read_text())
            graph.lint()
        except (IRError, ValueError, KeyError) as e:
            raise fmt.ArtefactError(f"{root}/{fmt.GRAPH} is damaged: {e}") from e
        try:
            weights = load_file(str(root / fmt.WEIGHTS), device=device)
        except Exception as e:
            raise fmt.ArtefactError(f"{root}/{fmt.WEIGHTS} is damaged: {e}") from e
        missing = set(graph.weights) - set(weights)
        if missing:
            raise fmt.ArtefactError(f"{root}/{fmt.WEIGHTS} lacks {sorted(missing)[:3]}")
        rt = dict(manifest["runtime"])
        rt["eos_token_ids"] = tuple(rt["eos_token_ids"])
        return cls(root, manifest, ModelSpec(**rt), graph, weights)
