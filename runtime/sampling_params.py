"""Per-request sampling parameters, with SGLang's names, defaults and validation.

Parameters come from clients, so `from_dict` checks each one's type strictly (an int is
not a bool, `"5"` is not 5, 2.5 is not a top_k, numbers are finite) and its range, and
names the field in the error. Parameters SGLang defines that kiln does not implement
(custom logit processors, stop regexes...) are refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.grammar import KINDS, Constraint, constraint_of

_ALIASES = {"seed": "sampling_seed", "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# SGLang treats temperatures below this as greedy (dividing logits by them overflows).
SAMPLING_EPS = 1e-6
# Limits on what one request may ask for (documented in docs/serving.md).
MAX_N = 128
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 1024
# SGLang sampling parameters kiln does not implement yet: refused when given a value.
UNSUPPORTED = ("stop_regex", "custom_params", "stream_interval")
# Seeds are taken modulo 2**64 (a request's PCG64 stream is seeded with that: runtime/
# sampler.py new_generator); any integer of 64 bits, signed or not, is a seed.
SEED_RANGE = (-(2**63), 2**64 - 1)
# Fields that may be null (meaning: not set). The others must hold a value if given.
_NULLABLE = (
    "max_new_tokens",
    "sampling_seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    *KINDS,
)


_TOKEN_KEY = re.compile(r"\s*-?[0-9]{1,18}\s*")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _show(v: Any) -> str:
    text = "null" if v is None else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
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
    # Grammar-constrained decoding (runtime/grammar.py): at most one of these.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a client's dict (SGLang names, plus OpenAI's `seed`, `max_tokens`,
        `min_tokens`); raises ValueError naming the first bad field."""
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params: expected an object, got {_show(d)}")
        d = dict(d or {})
        for alias, name in _ALIASES.items():
            if alias in d:
                if name in d:
                    raise ValueError(f"give {name} or {alias}, not both")
                d[name] = d.pop(alias)
        refused = [k for k in UNSUPPORTED if d.get(k) is not None]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported by kiln yet")
        for k in UNSUPPORTED:
            d.pop(k, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, v in d.items():
            if v is None:
                if name not in _NULLABLE:
                    raise ValueError(f"{name}: expected a value, got null")
                continue
            values[name] = _checked(name, v, _KINDS[name])
        if 0 < values.get("temperature", 1.0) < SAMPLING_EPS:
            values["temperature"] = 0.0  # as SGLang: too small to divide by, so greedy
        constraint_of(values)  # at most one, each a non-empty text
        return cls(**values)

    @property
    def constraint(self) -> Constraint | None:
        """The grammar the output must follow, if any."""
        return constraint_of({k: getattr(self, k) for k in KINDS})

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
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}",
            ),
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (
                all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
                f"stop must be non-empty strings of at most {MAX_STOP_LENGTH} characters",
            ),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
            ),
            (
                all(-100 <= b <= 100 for _, b in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                self.sampling_seed is None or SEED_RANGE[0] <= self.sampling_seed <= SEED_RANGE[1],
                f"seed must be an integer in [-2**63, 2**64 - 1], got {_show(self.sampling_seed)}",
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


def _checked(name: str, v: Any, kind: str) -> Any:
    """`v` in the form `kind` asks for, or ValueError naming `name`."""
    if kind == "int" and _is_int(v):
        return v
    if kind == "float" and _is_number(v):
        return float(v)
    if kind == "bool" and isinstance(v, bool):
        return v
    if kind == "strs" and isinstance(v, str):
        return (v,)
    if kind == "strs" and isinstance(v, list | tuple) and all(isinstance(s, str) for s in v):
        return tuple(v)
    if kind == "ints" and isinstance(v, list | tuple) and all(_is_int(t) for t in v):
        return tuple(v)
    if kind == "bias" and isinstance(v, dict):
        return _logit_bias(v)
    if kind == "text" and isinstance(v, str):
        return v
    if kind == "json" and isinstance(v, str | dict):
        return v if isinstance(v, str) else json.dumps(v)
    wanted = {
        "int": "an integer",
        "float": "a finite number",
        "bool": "true or false",
        "strs": "a string or a list of strings",
        "ints": "a list of integers",
        "bias": 'an object of token id to bias, e.g. {"42": -100}',
        "text": "a string",
        "json": "a JSON object or its text",
    }[kind]
    raise ValueError(f"{name}: expected {wanted}, got {_show(v)}")


def _logit_bias(bias: dict[Any, Any]) -> tuple[tuple[int, float], ...]:
    out = []
    for k, b in bias.items():
        token = k if _is_int(k) else None
        # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them.
        if isinstance(k, str) and _TOKEN_KEY.fullmatch(k):
            token = int(k)
        if token is None:
            raise ValueError(f"logit_bias: keys must be token ids, got {_show(k)}")
        if not _is_number(b):
            raise ValueError(f"logit_bias[{k!r}]: expected a finite number, got {_show(b)}")
        out.append((token, float(b)))
    return tuple(sorted(out))


_KINDS = {
    "max_new_tokens": "int",
    "min_new_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "frequency_penalty": "float",
    "presence_penalty": "float",
    "repetition_penalty": "float",
    "stop": "strs",
    "stop_token_ids": "ints",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "sampling_seed": "int",
    "n": "int",
    "logit_bias": "bias",
    "json_schema": "json",
    "regex": "text",
    "ebnf": "text",
    "structural_tag": "json",
}
