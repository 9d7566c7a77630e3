"""--enable-deterministic-inference: a request's greedy tokens and logprobs are bitwise the
same alone, after a prefix-cache hit, beside other requests of other lengths, and with its
prompt cut into other chunks. The same checks on the artefact without the flag find a
difference (its prompt rows are scored as runs, a lone long row's keys split over the
threads), so they can fail."""

from __future__ import annotations

import re

import pytest
from batch_invariance import scenarios

from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.passes.base import PassError


# fp32 weights, and 4-bit ones with float activations (the kernel whose 1-row, few-row and
# prompt tiles round differently: each row its own call under the flag)
@pytest.mark.parametrize("scheme", [{}, {"torchao_config": "int4wo-32"}], ids=["f32", "int4"])
def test_a_requests_logprobs_do_not_depend_on_its_batch(artefact, scheme) -> None:
    flag = {**scheme, "enable_deterministic_inference": True}
    det = scenarios(artefact("llama", compile_args=flag))
    assert all(run == det[0] for run in det[1:]), det
    loose = scenarios(artefact("llama", compile_args=scheme))
    assert any(run != loose[0] for run in loose[1:])  # what the flag changes
    assert max(abs(a - b) for run in loose for a, b in zip(run, det[0], strict=True)) < 1e-4


@pytest.mark.parametrize(
    ("family", "flags", "refusal"),
    [
        # Gemma 2's soft cap keeps attention off the Triton kernel
        ("gemma2", {}, "no batch-invariant rope_attention kernel on cuda for its softcap"),
        ("mixtral", {}, "no batch-invariant moe kernel on cuda"),
        ("llama", {"enable_torch_compile": True}, "--enable-torch-compile's generated"),
    ],
)
def test_what_a_cuda_target_cannot_make_batch_invariant(checkpoint, family, flags, refusal):
    args = ServerArgs(
        model_path=str(checkpoint(family)),
        device="cuda",
        target_isa="sm_90",
        enable_deterministic_inference=True,
        **flags,
    )
    with pytest.raises((ArgError, PassError), match=re.escape(refusal)):
        compile_model(args)
