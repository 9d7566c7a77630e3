"""Per-request sampling parameters, with SGLang's names and validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_ALIASES = {"seed": "sampling_seed", "max_tokens": "max_new_tokens"}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    n: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        for alias, name in _ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
        if d.get("stop_token_ids") is not None:
            d["stop_token_ids"] = tuple(d["stop_token_ids"])
        else:
            d.pop("stop_token_ids", None)
        return cls(**{k: v for k, v in d.items() if v is not None})

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
