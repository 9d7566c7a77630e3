"""Reading checkpoint tensors by name: safetensors (single or sharded), pt, or dummy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

LOAD_FORMATS = ("auto", "pt", "safetensors", "dummy")


class CheckpointError(ValueError):
    """The checkpoint's files are missing, unreadable or lack a tensor the graph needs."""


class CheckpointReader:
    """Name -> tensor over the checkpoint's weight files, opened lazily (memory-mapped)."""

    def __init__(self, path: Path, load_format: str = "auto") -> None:
        if load_format not in LOAD_FORMATS:
            raise CheckpointError(f"--load-format {load_format!r}: choose from {LOAD_FORMATS}")
        self.path = path
        self.load_format = _resolve_format(path, load_format)
        self.files: list[Path] = []
        self._where: dict[str, Path] = {}
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        if self.load_format == "safetensors":
            self._index("model.safetensors.index.json", "*.safetensors")
        elif self.load_format == "pt":
            self._index("pytorch_model.bin.index.json", "*.bin")
            if not self.files:
                self._index("", "*.pt")

    def _index(self, index_name: str, pattern: str) -> None:
        index = self.path / index_name if index_name else None
        if index is not None and index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in self.files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index.name} names missing shards: {missing}")
            self._where = {k: self.path / f for k, f in weight_map.items()}
            return
        self.files = sorted(self.path.glob(pattern))
        for f in self.files:
            for name in self._names(f):
                self._where[name] = f

    def _names(self, f: Path) -> list[str]:
        # A safetensors handle and a loaded pt state dict both answer keys().
        return list(self._handle(f).keys())

    def _handle(self, f: Path) -> Any:
        h = self._open.get(f)
        if h is None:
            try:
                if self.load_format == "safetensors":
                    h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                else:
                    h = _torch_load(f)
            except Exception as e:
                raise CheckpointError(f"cannot read {f.name}: {e}") from e
            self._open[f] = h
        return h

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self.load_format == "dummy":
            return _dummy(name, shape)
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        h = self._handle(f)
        t = h.get_tensor(name) if self.load_format == "safetensors" else h[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {tuple(shape)}"
            )
        return t

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iter_files(self) -> Iterator[Path]:
        yield from self.files


def _torch_load(f: Path) -> Any:
    # weights_only: a checkpoint must never run code on load. mmap needs the zip format;
    # legacy pickles are read whole.
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(f, map_location="cpu", weights_only=True)


def _resolve_format(path: Path, load_format: str) -> str:
    if load_format != "auto":
        if load_format == "safetensors" and not any(path.glob("*.safetensors")):
            raise CheckpointError(f"--load-format safetensors: no *.safetensors in {path}")
        return load_format
    if any(path.glob("*.safetensors")):
        return "safetensors"
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        return "pt"
    raise CheckpointError(
        f"no weights in {path} (*.safetensors, *.bin or *.pt); "
        "use --load-format dummy for random weights"
    )


def _dummy(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # Deterministic per name, so a dummy compile is reproducible and cacheable.
    g = torch.Generator().manual_seed(int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little"))
    if len(shape) == 1:  # norms and biases: near 1 and near 0 keep activations sane
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return base + 0.02 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g)
