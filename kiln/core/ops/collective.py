"""Tensor parallelism's collectives over the default process group (passes/shard.py puts
them in the graph)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.lazy import lazy_module
from kiln.core.opdef import Attrs, Check, TensorType, op

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
else:
    torch = lazy_module("torch")
    dist = lazy_module("torch.distributed")


@dataclass(frozen=True, slots=True)
class Ranks(Attrs):
    ranks: int


def _reduce(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.positive(ranks=a["ranks"])
    return check.float_tensor(ins[0])


def _gather(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    check.positive(ranks=a["ranks"])
    x = check.float_tensor(ins[0])
    if not isinstance(x.features, int):
        raise check.fail(f"all_gather takes a feature size, not {x.features}")
    return TensorType(x.features * a["ranks"], x.dtype)


@op("x", Ranks, rule=_reduce)
def all_reduce(x: torch.Tensor, *, a: Ranks) -> torch.Tensor:
    """The sum over the group, in place on x, which is a fresh output of the row-parallel
    linear before it."""
    if a.ranks > 1:
        dist.all_reduce(x)
    return x


@op("x", Ranks, rule=_gather)
def all_gather(x: torch.Tensor, *, a: Ranks) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    if a.ranks == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(a.ranks)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


OPS = (all_reduce, all_gather)
