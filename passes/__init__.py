"""Compiler passes over the kiln IR; each is `(graph, ctx) -> PassResult(graph, changed)`."""

from __future__ import annotations

from kiln.passes.base import Pass, PassContext, PassError, PassResult, run_passes
from kiln.passes.capture_plan import capture_plan
from kiln.passes.dce import dce
from kiln.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from kiln.passes.fuse_gate_up import fuse_gate_up
from kiln.passes.fuse_qkv import fuse_qkv
from kiln.passes.fuse_rope import fuse_rope, fuse_rope_attention
from kiln.passes.fuse_silu_linear import fuse_silu_linear
from kiln.passes.kv_cache import kv_cache
from kiln.passes.layout import pack_weights
from kiln.passes.quantize import quantize
from kiln.passes.select_backends import select_backends
from kiln.passes.shard import shard
from kiln.passes.verify import verify

# Named pipelines: the compile driver picks one from the compile-time arguments.
PIPELINES: dict[str, list[Pass]] = {
    "default": [
        dce,
        shard,
        fuse_qkv,
        fuse_gate_up,
        fuse_add_rmsnorm,
        fuse_rope,
        fuse_rope_attention,
        dce,
        quantize,
        kv_cache,
        pack_weights,
        fuse_silu_linear,
        select_backends,
        capture_plan,
        verify,
    ],
    "unfused": [dce, shard, quantize, kv_cache, pack_weights, select_backends, verify],
}

__all__ = [
    "PIPELINES",
    "Pass",
    "PassContext",
    "PassError",
    "PassResult",
    "capture_plan",
    "dce",
    "fuse_add_rmsnorm",
    "fuse_gate_up",
    "fuse_qkv",
    "fuse_rope",
    "fuse_rope_attention",
    "fuse_silu_linear",
    "kv_cache",
    "pack_weights",
    "quantize",
    "run_passes",
    "select_backends",
    "shard",
    "verify",
]
