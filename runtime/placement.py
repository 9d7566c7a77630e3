"""Where a rank runs and how big its KV pool is, from the artefact's target: resolved once
per process, before anything is allocated, and shown in the startup line.

- device: "cpu", or "cuda:{local_rank}" (each rank of a node its own GPU, as SGLang does);
- process-group backend: gloo on CPU, NCCL on CUDA;
- KV pool, in tokens: `--max-total-tokens` when given; else on CUDA SGLang's meaning of
  `--mem-fraction-static` (default 0.9): that share of the GPU's memory holds the weights
  and the pool, so the pool gets the share less this rank's weights; on CPU the share
  (default 0.3) of the available RAM. Either way never more than the context length times
  the running requests can fill (a larger pool would stay empty: on CPU it would cost
  nothing, its pages being committed as used, but on a GPU it is allocated up front).

Nothing here touches a device: what it needs of the machine (the GPU's memory, the free
RAM) is passed in, so a CUDA target's placement is resolved and tested on any machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.args import ArgError
from kiln.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

DEFAULT_CPU_MEM_FRACTION = 0.3
DEFAULT_GPU_MEM_FRACTION = 0.9  # SGLang's documented default for --mem-fraction-static


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:N"
    backend: str  # the torch.distributed backend of a tensor-parallel group
    kv_tokens: int

    def describe(self) -> str:
        return f"{self.device} ({self.backend} between ranks), KV pool {self.kv_tokens} tokens"


@dataclass(frozen=True)
class KVDemand:
    """What sizes a rank's pool: bytes one token's K and V take on this rank, the page
    size, and the most tokens the requests can hold at once."""

    bytes_per_token: int
    page_size: int
    max_tokens: int  # context length x running requests


def place(
    target_device: str,
    local_rank: int,
    demand: KVDemand,
    weight_bytes: int,
    memory_bytes: int,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
) -> Placement:
    """The placement of local rank `local_rank` of a node. `memory_bytes`: the GPU's
    total memory on CUDA, the available RAM on CPU; `weight_bytes`: this rank's weights."""
    if target_device == "cuda":
        device, backend = f"cuda:{local_rank}", "nccl"
        fraction = mem_fraction_static or DEFAULT_GPU_MEM_FRACTION
        budget = int(memory_bytes * fraction) - weight_bytes
        if max_total_tokens is None and budget < demand.bytes_per_token * demand.page_size:
            raise ArgError(
                f"--mem-fraction-static {fraction}: {fraction:.0%} of the GPU's "
                f"{memory_bytes / 2**30:.1f} GiB holds the weights ({weight_bytes / 2**30:.1f} "
                "GiB) and leaves no room for a KV pool; raise it, or use more GPUs (--tp-size)"
            )
    else:
        device, backend = "cpu", "gloo"
        fraction = mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
        budget = int(memory_bytes * fraction)
    if max_total_tokens:
        tokens = int(max_total_tokens)
    else:
        tokens = min(budget // demand.bytes_per_token, demand.max_tokens)
    return Placement(device, backend, max(demand.page_size, tokens))


def available_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_memory(local_rank: int) -> int:
    """Total memory of this node's GPU `local_rank` (only called on CUDA targets)."""
    return int(torch.cuda.get_device_properties(local_rank).total_memory)
