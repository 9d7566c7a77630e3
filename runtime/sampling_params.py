"""Per-request sampling parameters, with SGLang's names, defaults and validation."""

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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

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
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for name in ("stop", "stop_token_ids"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        bias = d.get("logit_bias")
        if isinstance(bias, dict):  # OpenAI: {"token id": bias}
            try:
                d["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        return cls(**{k: v for k, v in d.items() if v is not None})

    def __post_init__(self) -> None:
        checks = (
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k == -1 or self.top_k >= 1,
                f"top_k must be -1 (off) or >= 1, got {self.top_k}",
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                0 < self.repetition_penalty <= 2,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (
                all(-100 <= b <= 100 for _, b in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
