"""What one server argument is: its spellings, type, default, stage and support status.

Stage: `compile` arguments change the artefact (they are recorded in its manifest and
cache key); `runtime` arguments may differ each time the artefact is served.

Status, kept next to each flag in `spec.py`:
  implemented   works;
  needs(...)    works only where this machine has some hardware or library; asking for it
                elsewhere is a clear error naming what is missing;
  planned       not implemented yet: any value but the default is refused, never ignored.
A flag may carry per-choice statuses (e.g. `--attention-backend torch_native` is
implemented while `fa3` needs a Hopper GPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Stage = Literal["compile", "runtime"]
COMPILE: Stage = "compile"
RUNTIME: Stage = "runtime"


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _hopper() -> bool:
    import torch

    return _cuda() and torch.cuda.get_device_capability()[0] >= 9


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


# Probes answer "does this machine have it?"; they run only when a value needs them.
PROBES: dict[str, Callable[[], bool]] = {
    "cuda": _cuda,
    "hopper": _hopper,
    "flashinfer": lambda: _cuda() and _module("flashinfer")(),
    "triton-gpu": lambda: _cuda() and _module("triton")(),
    "multi-gpu": lambda: _cuda() and __import__("torch").cuda.device_count() > 1,
}


@dataclass(frozen=True)
class Status:
    implemented: bool
    requires: str | None = None  # in words, for the error: "a CUDA GPU"
    probe: str | None = None  # key of PROBES
    refused: str | None = None  # why kiln will not do it (not planned: refused by design)

    @property
    def label(self) -> str:
        if self.refused:
            return f"refused: {self.refused}"
        if self.requires:
            return f"needs {self.requires}" + ("" if self.implemented else " (then planned)")
        return "implemented" if self.implemented else "planned"

    def problem(self) -> str | None:
        """Why this value cannot be used on this machine, or None when it can."""
        if self.refused:
            return f"is refused by kiln: {self.refused}"
        if self.requires and self.probe and not PROBES[self.probe]():
            return f"needs {self.requires}, which this machine lacks"
        if not self.implemented:
            return "is not implemented in kiln yet"
        return None


IMPLEMENTED = Status(True)
PLANNED = Status(False)


def refused(why: str) -> Status:
    return Status(False, refused=why)


def needs(requires: str, probe: str, implemented: bool = False) -> Status:
    return Status(implemented, requires, probe)


_PY_TYPES: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True, init=False)
class Flag:
    flags: tuple[str, ...]
    type: str  # str | int | float | bool | list[str] | list[int] | list[float]
    default: Any
    choices: tuple[Any, ...] | None
    dest: str
    stage: Stage
    status: Status
    choice_status: dict[Any, Status] = field(hash=False)
    help: str
    deprecated: str | None  # replacement advice, for deprecated flags

    def __init__(
        self,
        *flags: str,
        type: str,
        stage: Stage,
        default: Any = None,
        choices: tuple[Any, ...] | None = None,
        dest: str | None = None,
        status: Status = PLANNED,
        choice_status: dict[Any, Status] | None = None,
        help: str = "",
        deprecated: str | None = None,
    ) -> None:
        values = {
            "flags": flags,
            "type": type,
            "default": False if type == "bool" and default is None else default,
            "choices": choices,
            "dest": dest or flags[0][2:].replace("-", "_"),
            "stage": stage,
            "status": status,
            "choice_status": choice_status or {},
            "help": help,
            "deprecated": deprecated,
        }
        for k, v in values.items():
            object.__setattr__(self, k, v)

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def is_list(self) -> bool:
        return self.type.startswith("list[")

    @property
    def element_type(self) -> Any:
        return _PY_TYPES[self.type[5:-1] if self.is_list else self.type]

    @property
    def annotation(self) -> Any:
        t = self.element_type
        # Lists are stored as tuples (the tree is frozen); built at run time from the spec.
        return tuple.__class_getitem__((t, ...)) if self.is_list else t

    def status_of(self, value: Any) -> Status:
        return self.choice_status.get(value, self.status)

    @property
    def status_label(self) -> str:
        """'implemented', or per value: 'implemented: cpu; needs a CUDA GPU: cuda; ...'."""
        if not self.choice_status:
            return self.status.label
        groups: dict[str, list[str]] = {}
        for choice in self.choices or tuple(self.choice_status):
            groups.setdefault(self.status_of(choice).label, []).append(str(choice))
        parts = [f"{label}: {', '.join(values)}" for label, values in groups.items()]
        if not self.choices:
            parts.append(f"{self.status.label}: other values")
        return "; ".join(parts)


@dataclass(frozen=True)
class Section:
    title: str
    attr: str
    flags: tuple[Flag, ...]
