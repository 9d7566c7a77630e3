"""Compiler passes over the kiln IR; each is `(graph, ctx) -> PassResult(graph, changed)`."""

from __future__ import annotations

from kiln.passes.absorb_mla import absorb_mla
from kiln.passes.base import PassError, run_passes
from kiln.passes.capture_plan import capture_plan
from kiln.passes.dce import dce
from kiln.passes.deterministic import deterministic
from kiln.passes.fp32_lm_head import fp32_lm_head
from kiln.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from kiln.passes.fuse_gate_up import fuse_gate_up
from kiln.passes.fuse_qkv import fuse_qkv
from kiln.passes.fuse_rope import fuse_rope, fuse_rope_attention
from kiln.passes.fuse_silu_linear import fuse_silu_linear
from kiln.passes.kv_cache import kv_cache
from kiln.passes.layout import pack_weights
from kiln.passes.options import CompileOptions, Pass, PassResult, compiler_pass
from kiln.passes.quantize import quantize
from kiln.passes.select_backends import select_backends
from kiln.passes.shard import shard
from kiln.passes.verify import verify

# The one pipeline: a pass that the options leave nothing to do returns the graph
# unchanged (shard at --tp-size 1, quantize without a scheme, pack_weights off kiln_cpu...).
PIPELINE: list[Pass] = [
    dce,
    shard,
    fuse_qkv,
    fuse_gate_up,
    fuse_add_rmsnorm,
    fuse_rope,
    fuse_rope_attention,
    absorb_mla,
    dce,
    quantize,
    fp32_lm_head,
    kv_cache,
    deterministic,
    pack_weights,
    fuse_silu_linear,
    select_backends,
    capture_plan,
    verify,
]

__all__ = [
    "PIPELINE",
    "CompileOptions",
    "Pass",
    "PassError",
    "PassResult",
    "absorb_mla",
    "capture_plan",
    "compiler_pass",
    "dce",
    "deterministic",
    "fp32_lm_head",
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
