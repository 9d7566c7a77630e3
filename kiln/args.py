"""Server arguments: one frozen dataclass, built once at the boundary.

Each field carries its CLI spelling(s), help text, choices and its *stage*:
`compile` fields change the artefact (recorded in its manifest and cache key),
`runtime` fields may differ at serve time. Names, aliases and defaults follow SGLang's
`launch_server`, so existing command lines carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Stage = Literal["compile", "runtime"]

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "pt", "safetensors", "dummy")
DEVICES = ("cpu", "cuda")


def arg(
    default: Any,
    *flags: str,
    stage: Stage,
    help: str,
    choices: Sequence[Any] | None = None,
) -> Any:
    return field(
        default=default,
        metadata={"flags": flags, "stage": stage, "help": help, "choices": choices},
    )


class ArgError(ValueError):
    """A bad argument value; the message names the flag."""


@dataclass(frozen=True)
class ServerArgs:
    # -- model and tokenizer --------------------------------------------------------------
    model_path: str | None = arg(
        None,
        "--model-path",
        "--model",
        stage="compile",
        help="Hugging Face checkpoint folder (config.json, weights, tokenizer files).",
    )
    tokenizer_path: str | None = arg(
        None,
        "--tokenizer-path",
        stage="compile",
        help="Tokenizer folder; defaults to --model-path.",
    )
    load_format: str = arg(
        "auto",
        "--load-format",
        stage="compile",
        choices=LOAD_FORMATS,
        help="Weight format; 'dummy' makes random weights of the right shapes.",
    )
    dtype: str = arg(
        "auto",
        "--dtype",
        stage="compile",
        choices=DTYPES,
        help="Weight and activation dtype. 'auto': FP16 for FP32/FP16 checkpoints, "
        "BF16 for BF16 checkpoints (as SGLang).",
    )
    trust_remote_code: bool = arg(
        False,
        "--trust-remote-code",
        stage="compile",
        help="Accepted for compatibility; kiln runs its own model definitions only.",
    )
    context_length: int | None = arg(
        None,
        "--context-length",
        stage="runtime",
        help="Maximum tokens per request (prompt + output); defaults to the model's.",
    )
    # -- compiler and kernels ---------------------------------------------------------------
    device: str | None = arg(
        None,
        "--device",
        stage="compile",
        choices=DEVICES,
        help="Target device; defaults to cuda when available, else cpu.",
    )
    page_size: int = arg(1, "--page-size", stage="compile", help="Tokens per KV-cache page.")
    # -- memory and scheduling ----------------------------------------------------------------
    mem_fraction_static: float | None = arg(
        None,
        "--mem-fraction-static",
        stage="runtime",
        help="Fraction of memory for weights and the KV pool (CPU: of available RAM).",
    )
    max_total_tokens: int | None = arg(
        None,
        "--max-total-tokens",
        stage="runtime",
        help="KV-pool size in tokens; overrides --mem-fraction-static.",
    )
    max_running_requests: int | None = arg(
        None, "--max-running-requests", stage="runtime", help="Most requests decoding at once."
    )
    max_prefill_tokens: int = arg(
        16384, "--max-prefill-tokens", stage="runtime", help="Token budget of one prefill batch."
    )
    random_seed: int | None = arg(
        None, "--random-seed", stage="runtime", help="Seed for sampling without a per-request seed."
    )
    log_level: str = arg(
        "info",
        "--log-level",
        stage="runtime",
        choices=("debug", "info", "warning", "error", "critical"),
        help="Logging level.",
    )

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None, prog: str = "kiln") -> ServerArgs:
        parser = argparse.ArgumentParser(prog=prog)
        add_cli_args(parser)
        return cls.from_namespace(parser.parse_args(argv))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        values = {
            f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)
        }
        return cls(**values)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ArgError(f"{flag_of(f.name)}: {value!r} is not one of {list(choices)}")
        positive = (
            "page_size",
            "max_total_tokens",
            "max_running_requests",
            "max_prefill_tokens",
            "context_length",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ArgError(f"{flag_of(name)}: must be > 0, got {value}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ArgError(
                f"--mem-fraction-static: must be in (0, 1], got {self.mem_fraction_static}"
            )

    # -- views ------------------------------------------------------------------------------
    def stage_values(self, stage: Stage) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("stage") == stage
        }

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def flag_of(name: str) -> str:
    return ServerArgs.__dataclass_fields__[name].metadata["flags"][0]


def add_cli_args(
    parser: argparse.ArgumentParser, stages: Sequence[Stage] = ("compile", "runtime")
) -> None:
    """Add every ServerArgs field of the given stages to `parser`."""
    for f in dataclasses.fields(ServerArgs):
        meta = f.metadata
        if meta.get("stage") not in stages:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _parse_type(f)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        parser.add_argument(*meta["flags"], **kwargs)


def _parse_type(f: dataclasses.Field[Any]) -> Any:
    t = str(f.type)
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str
