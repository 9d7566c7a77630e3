"""New weights for a running model (SGLang's /update_weights_from_disk): the weights of
another artefact, compiled from another checkpoint with the served artefact's arguments,
copied into the served weights' own memory between two steps.

An update is taken only when it is the same program: each rank's graph file equal byte for
byte to the one served (the manifests list the same checksum: same architecture, shapes,
formats, kernels), every weight of the same shape and element type, the new artefact's
files matching their checksums. The copy
goes into the memory the running code already reads (the mapped file's private pages on a
CPU, the device tensors on a GPU), so the native step's addresses, captured CUDA graphs and
the executor's bound tensors all see the new values; nothing is rebuilt. A tensor-parallel
group checks on every rank first and copies only when every rank can (runtime/engine.py,
runtime/rank_worker.py), so no rank is left with other weights than the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core import artefact as fmt
from kiln.runtime.artefact import Artefact, checked_manifest
from kiln.runtime.weights import HostWeights, dtype_name, torch_view

if TYPE_CHECKING:
    from kiln.runtime.model_runner import ModelRunner


class WeightUpdateError(ValueError):
    """New weights that do not fit the served model; the message says why."""


def read_update(art: Artefact, root: Path, rank: int) -> HostWeights:
    """Rank `rank`'s weights of artefact `root`, once they fit `art` (see the module). Rank
    0 checks every file's checksum; the other ranks, reading the same files after it, do
    not read them all again (as at start: runtime/rank_worker.py)."""
    try:
        manifest = checked_manifest(root, verify=rank == 0)
        graph = fmt.graph_file(rank)  # the same bytes: the same size and checksum listed
        if manifest["files"].get(graph) != art.manifest["files"].get(graph):
            raise WeightUpdateError(
                "the checkpoint compiles to another program than the one served (its "
                "architecture, shapes or stored formats differ); serve a new artefact instead"
            )
        weights = HostWeights(fmt.open_member(root, fmt.weights_file(rank)))
    except (OSError, fmt.ArtefactError) as e:
        raise WeightUpdateError(f"{root}: {e}") from None
    for name, (shape, dtype) in _served(art).items():
        if name not in weights or tuple(weights[name].shape) != shape:
            raise WeightUpdateError(f"{root}: weight {name} is missing or of another shape")
        if weights.dtype(name) != dtype:
            raise WeightUpdateError(f"{root}: weight {name} is {weights.dtype(name)}, not {dtype}")
    return weights


def _served(art: Artefact) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each served weight's stored shape and element type."""
    if art.host is not None:
        return {n: (tuple(art.host[n].shape), art.host.dtype(n)) for n in art.host}
    return {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in art.weights.items()}


def apply_update(runner: ModelRunner, new: HostWeights) -> None:
    """Copy `new` (checked by read_update) into the served weights, in place."""
    art = runner.art
    for name in _served(art):
        if art.host is not None:
            art.host[name][...] = new[name]
        else:
            art.weights[name].copy_(torch_view(new[name], new.dtype(name)))
    runner.pick_rope_tables()  # the new file holds the short LongRoPE table again
