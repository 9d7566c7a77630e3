"""Which files of a checkpoint folder hold its weights, found without opening any of them
(no torch, no safetensors): the cache key hashes exactly these files, and the reader
(`compiler/checkpoint.py`) opens exactly these."""

from __future__ import annotations

import json
from pathlib import Path

LOAD_FORMATS = ("auto", "pt", "safetensors", "gguf", "dummy")
# Per format: (the index file of a sharded checkpoint, the shard pattern without one).
_LAYOUTS = {
    "safetensors": (("model.safetensors.index.json", "*.safetensors"),),
    "pt": (("pytorch_model.bin.index.json", "*.bin"), ("", "*.pt")),
}


class CheckpointError(ValueError):
    """The checkpoint's files are missing, unreadable or lack a tensor the graph needs."""


def find_gguf(path: Path) -> Path | None:
    """The `.gguf` file `path` names: itself, or the only one in a folder; None if none."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise CheckpointError(
            f"{path} holds several GGUF files ({names}); pass one of them to --model-path"
        )
    return found[0] if found else None


def resolve_format(path: Path, load_format: str) -> str:
    """--load-format `auto` made concrete for the checkpoint at `path` (a folder, or a
    `.gguf` file)."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"--load-format {load_format!r}: choose from {LOAD_FORMATS}")
    if load_format == "gguf" or (load_format == "auto" and path.is_file()):
        if find_gguf(path) is None:
            raise CheckpointError(f"--load-format gguf: no *.gguf file at {path}")
        return "gguf"
    if load_format != "auto":
        if load_format == "safetensors" and not any(path.glob("*.safetensors")):
            raise CheckpointError(f"--load-format safetensors: no *.safetensors in {path}")
        return load_format
    if any(path.glob("*.safetensors")):
        return "safetensors"
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        return "pt"
    if find_gguf(path) is not None:
        return "gguf"
    raise CheckpointError(
        f"no weights in {path} (*.safetensors, *.bin, *.pt or *.gguf); "
        "use --load-format dummy for random weights"
    )


def weight_files(path: Path, load_format: str) -> tuple[list[Path], dict[str, str] | None]:
    """(the weight files, the index's tensor -> file map or None) for a resolved format."""
    if load_format == "gguf":
        gguf = find_gguf(path)
        return ([gguf] if gguf else []), None
    for index_name, pattern in _LAYOUTS.get(load_format, ()):
        index = path / index_name if index_name else None
        if index is not None and index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index.name} names missing shards: {missing}")
            return files, weight_map
        files = sorted(path.glob(pattern))
        if files:
            return files, None
    return [], None
