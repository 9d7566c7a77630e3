"""What the passes are told: one frozen, typed object, `CompileOptions`, built and
validated once from the server arguments (compiler/options.py raises every flag error,
naming the flag) and the checkpoint's facts. Passes never see argparse values or raw
config dicts, and never probe the machine that compiles.

Each pass declares the fields it reads (`@compiler_pass("tp", "target")`); the pass
manager hands it a view of only those, so a pass that starts reading an option it does
not declare fails at once instead of silently depending on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from kiln.core.ir import Graph
from kiln.core.target import Target, cpu_target


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    experts_whole: bool = False  # --ep-size equal to --tp-size: whole experts per rank


@dataclass(frozen=True)
class Quantization:
    """Which weights become which format (passes/quantize.py)."""

    # One format and group for every quantizable float weight (group 0: one scale a row),
    # or, for a checkpoint stored quantized (GGUF blocks, GPTQ / AWQ, fp8 blocks), each
    # checkpoint tensor's own: name -> (format, group).
    format: str | None = None
    group: int = 0
    stored: Mapping[str, tuple[str, int]] | None = None
    int8_activations: bool = False  # --quantize-activations int8
    flag: str = "quantization"  # what asked for it, for messages


@dataclass(frozen=True)
class KVCache:
    """An fp8 KV pool: its element type and each layer's scale (passes/kv_cache.py)."""

    dtype: str
    scales: tuple[float, ...]


@dataclass(frozen=True)
class Capture:
    """The static shapes steps may run at (passes/capture_plan.py records them)."""

    decode: Literal["cuda_graph", "compiled", "native", "eager"] = "eager"
    batch_sizes: tuple[int, ...] = ()
    padding: bool = True
    prefill: Literal["piecewise", "native", "eager"] = "eager"
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompileOptions:
    target: Target = field(default_factory=lambda: cpu_target("x86-64"))
    dtype: str = "float32"
    native_kernels: bool = False  # a C compiler built kiln_cpu for the target
    attention_backend: str | None = None  # --attention-backend
    prefill_attention_backend: str | None = None  # --prefill-attention-backend
    decode_attention_backend: str | None = None  # --decode-attention-backend
    quantization: Quantization | None = None
    kv_cache: KVCache | None = None
    capture: Capture = field(default_factory=Capture)
    tp: TensorParallel = field(default_factory=TensorParallel)
    # Speculative decoding as compiled (compiler/options.py speculative_options): the
    # manifest's runtime.speculative; verify steps are decode steps of more rows.
    speculative: dict[str, Any] | None = None
    # --enable-deterministic-inference: batch-invariant attention (passes/deterministic.py)
    deterministic: bool = False
    # --enable-fp32-lm-head: float32 logits from a 16-bit model (passes/fp32_lm_head.py)
    fp32_lm_head: bool = False

    @property
    def device(self) -> str:
        return self.target.device

    def for_rank(self, rank: int) -> CompileOptions:
        return dataclasses.replace(self, tp=dataclasses.replace(self.tp, rank=rank))

    @property
    def compiles_pieces(self) -> bool:
        """`--enable-torch-compile`: Inductor generates the code between the attention ops."""
        return self.capture.decode == "compiled"


FIELDS = frozenset(f.name for f in dataclasses.fields(CompileOptions))


class OptionsView:
    """The options a pass declared, and nothing else (a read of another is a bug)."""

    def __init__(self, options: CompileOptions, reads: frozenset[str], owner: str) -> None:
        self._options, self._reads, self._owner = options, reads, owner

    def __getattr__(self, name: str) -> Any:
        wanted = {"device": "target", "compiles_pieces": "capture"}.get(name, name)
        if wanted not in self._reads:
            raise AttributeError(
                f"pass {self._owner} reads the compile option {name!r} without declaring it"
            )
        return getattr(self._options, name)


@dataclass
class PassResult:
    graph: Graph
    changed: bool


Pass = Callable[[Graph, CompileOptions], PassResult]
P = TypeVar("P", bound=Callable[..., PassResult])


def compiler_pass(*reads: str) -> Callable[[P], P]:
    """Declare the CompileOptions fields a pass reads."""
    unknown = sorted(set(reads) - FIELDS)
    if unknown:
        raise ValueError(f"no compile options {unknown} (there are {sorted(FIELDS)})")

    def declare(fn: P) -> P:
        fn.reads = frozenset(reads)  # type: ignore[attr-defined]
        return fn

    return declare


def reads_of(p: Callable[..., Any]) -> frozenset[str]:
    return frozenset(getattr(p, "reads", ()))
