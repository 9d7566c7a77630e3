"""Placement from the target (runtime/placement.py): a CUDA target's device, process-group
backend and KV pool are resolved here, on a CPU machine, without running anything."""

from __future__ import annotations

import json

import pytest

from kiln.args import ArgError
from kiln.runtime.artefact import model_spec
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.placement import KVDemand, place

GIB = 2**30


@pytest.fixture(scope="module")
def cuda_artefact(artefact):
    return artefact(
        "llama", compile_args={"device": "cuda", "target_isa": "sm_90", "dtype": "auto"}
    )


def demand_of(art, context: int, running: int) -> tuple[KVDemand, int]:
    manifest = json.loads((art / "manifest.json").read_text())
    spec = model_spec(manifest)
    per_token = KVCache.bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_torch_dtype
    )
    weights = manifest["files"]["weights/rank0.safetensors"]["bytes"]
    return KVDemand(per_token, spec.page_size, context * running), weights


def test_a_cuda_rank_gets_its_own_gpu_nccl_and_sglangs_memory_share(cuda_artefact) -> None:
    demand, weights = demand_of(cuda_artefact, context=10**9, running=1)  # no demand cap
    p = place("cuda", 1, demand, weights, 80 * GIB)
    assert (p.device, p.backend) == ("cuda:1", "nccl")
    # --mem-fraction-static (default 0.9, SGLang's) of the GPU holds weights and pool.
    assert p.kv_tokens == (int(80 * GIB * 0.9) - weights) // demand.bytes_per_token
    half = place("cuda", 0, demand, weights, 80 * GIB, mem_fraction_static=0.5)
    assert half.kv_tokens == (int(80 * GIB * 0.5) - weights) // demand.bytes_per_token
    with pytest.raises(ArgError, match="--mem-fraction-static 0.5: 50% of the GPU's"):
        place("cuda", 0, demand, weights, weights, mem_fraction_static=0.5)


def test_a_pool_holds_no_more_than_the_requests_can_fill(cuda_artefact) -> None:
    demand, weights = demand_of(cuda_artefact, context=256, running=4)
    assert place("cuda", 0, demand, weights, 80 * GIB).kv_tokens == 256 * 4
    assert place("cpu", 0, demand, weights, 64 * GIB).kv_tokens == 256 * 4
    assert place("cuda", 0, demand, weights, 80 * GIB, max_total_tokens=5000).kv_tokens == 5000


def test_a_cpu_rank_uses_gloo_and_a_share_of_the_free_ram(artefact) -> None:
    demand, weights = demand_of(artefact("llama"), context=10**9, running=1)
    p = place("cpu", 3, demand, weights, 8 * GIB)
    assert (p.device, p.backend) == ("cpu", "gloo")
    assert p.kv_tokens == int(8 * GIB * 0.3) // demand.bytes_per_token
