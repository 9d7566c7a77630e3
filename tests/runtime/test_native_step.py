"""The native step (compiler/lower_step.py, runtime/native_step.py): the compiler lowers a
CPU artefact's step to one C function; the runtime calls it once a step, every kind of step.

A decode step must be the Python executor's to the bit (same kernels, same order, rotary
rows of the same values), and a prefill, extend or mixed step close to it (its attention
is another kernel), for every family and weight format it lowers; refuse by name what it
cannot lower (the executor then runs the step); never run a step library this user's kiln
did not build; and check what it binds (weights, KV pool) before the first call."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from steps import Seqs, eager

from kiln import Engine
from kiln.compiler import report
from kiln.compiler.lower_step import Refused, lower_step
from kiln.core.artefact import ArtefactError
from kiln.core.ops.rope import Tables, rope_cos_sin
from kiln.kernels import native
from kiln.kernels.cpu import KernelError
from kiln.runtime.artefact import Artefact
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.native_step import NativeStep, rope_table
from kiln.runtime.sampler import as_tensor

# (family, compile args): what each brings to the lowering.
CASES = {
    # fused rope + attention, packed fp32 linears with the silu prologue; pages of 4
    "llama": ("llama", {"page_size": 4}),
    # the per-channel int8-activation kernel
    "llama-w8a8": ("llama", {"quantization": "w8a8_int8"}),
    # the 4-bit group kernel (float activations) and its embedding
    "llama-int4": ("llama", {"torchao_config": "int4wo-32"}),
    # split q/k/v views, per-head norms, rope and attention apart, sliding windows, the
    # scaled embedding, gelu_tanh and mul, two rotary tables
    "gemma3": ("gemma3", {}),
    # attention and final-logit softcaps, sandwich norms
    "gemma2": ("gemma2", {}),
    # per-head q/k norms read in place from the fused projection
    "qwen3": ("qwen3", {}),
    # a layer without rope (attention straight from the projections), whole-projection
    # q/k norms and post norms only, scaled residual branches and logits
    "smollm3": ("smollm3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    # q/k rows stored de-interleaved per head (ERNIE 4.5's rope pairs)
    "ernie4_5": ("ernie4_5", {}),
    "exaone4": ("exaone4", {}),
    # biased q and k (rows in rotary order), half-head rope, fused gate/up, GLM's 4 norms
    "glm4": ("glm4", {}),
    # LayerNorms (weight and bias), biased linears everywhere, a plain GELU-tanh MLP
    "starcoder2": ("starcoder2", {}),
    # LayerNorm1P (1 + w, with bias), a relu^2 MLP, half of each head turned
    "nemotron": ("nemotron", {}),
    # the lm_head's bias; plain GELU-tanh MLP side by side with attention
    "phi": ("phi", {}),
    # fp8 pools: rotary apart from the fused attention, the fp8 write and attention
    "llama-fp8": ("llama", {"kv_cache_dtype": "fp8_e4m3", "page_size": 4}),
    "qwen3-fp8-e5m2": ("qwen3", {"kv_cache_dtype": "fp8_e5m2"}),
}
# Twenty sequences of 1..20 tokens: more rows than the arena's first size (16).
PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(i + 1)] for i in range(20)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_decode_is_the_executors_step_to_the_bit(artefact, case: str) -> None:
    family, cargs = CASES[case]
    art = Artefact.open(artefact(family, compile_args=cargs))
    runner = ModelRunner(art, 2048)
    assert isinstance(runner.decode, NativeStep), art.graph.plan["decode"]  # lowered
    seqs = Seqs(runner, PROMPTS)
    seqs.prefill()
    for which in (list(range(20)), [3, 0, 17], [5]):
        for _ in range(2):
            step = seqs.step(which)
            got = as_tensor(runner.run(step))  # the native step (numpy logits)
            want = eager(runner, step)  # the executor, on the same inputs and pool
            assert got.shape == want.shape
            assert torch.equal(got, want), (got - want).abs().max()
            seqs.advance(step, which)


@pytest.mark.parametrize("case", sorted(c for c in CASES if "fp8" not in c))
def test_native_prefill_extend_and_mixed_steps_are_the_executors(artefact, case: str) -> None:
    """Every kind of step as rows of the lowered step: fresh prompts (runs of rows scored
    together, past one block of 32), then a mixed step of chunks over cached prefixes and
    decode rows; every row's logits against the executor's on the same inputs and pool
    (its prefill attention is another kernel: close, not to the bit)."""
    family, cargs = CASES[case]
    art = Artefact.open(artefact(family, compile_args=cargs))
    runner = ModelRunner(art, 2048)
    assert isinstance(runner.decode, NativeStep) and runner.decode.every_step
    seqs = Seqs(runner, [[(5 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate(LENS)])
    which = list(range(len(LENS)))
    for new in (dict(enumerate(seqs.tokens)), {0: [9] * 25, 1: [4], 2: [7] * 5, 3: [8] * 30}):
        step = seqs.step(which, new)
        step.rows = list(range(len(step.ids)))  # every row's logits
        want = eager(runner, step)  # the executor writes the step's K/V, then the native step
        got = as_tensor(runner.run(step))
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
        seqs.advance(step, which)


LENS = [33, 3, 1, 20]


def test_greedy_text_is_the_executors(artefact) -> None:
    """Through the engine: the same tokens with the step lowered and with it turned off."""
    native_art = artefact("llama")
    off = artefact("llama", compile_args={"disable_cuda_graph": True})
    prompts = ["hello world", "the cat sat on", "a"]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    a, b = Engine(native_art), Engine(off)
    assert isinstance(a.runner.decode, NativeStep) and b.runner.decode is None
    assert a.runner.decode_mode(a.art) == "native step"
    assert b.runner.decode_mode(b.art) == "Python executor"  # asked for: no reason to give
    assert [r["text"] for r in a.generate(prompts, greedy)] == [
        r["text"] for r in b.generate(prompts, greedy)
    ]
    a.shutdown()
    b.shutdown()


def test_the_step_clock_readings_cover_every_call(artefact) -> None:
    """`profile` (benchmarks/step_profile.py reads it): a reading before the first call
    and one after each, rising; turned off, steps leave the old readings alone."""
    engine = Engine(artefact("llama"))
    step = engine.runner.decode
    assert isinstance(step, NativeStep)
    ticks = step.profile()
    greedy = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
    assert len(ticks) == len(step.call_nodes()) + 1
    assert ticks[0] > 0 and (np.diff(ticks) >= 0).all() and ticks[-1] > ticks[0]
    seen = ticks.copy()
    step.profile(False)
    engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
    assert (ticks == seen).all()
    engine.shutdown()


def test_native_fp8_pool_with_scales_is_the_executors(artefact, tmp_path_factory) -> None:
    """Per-layer scales (--quantization-param-path): each layer's K/V written as value /
    its scale, read back times it, as the executor does (to the bit on a decode step)."""
    scales = tmp_path_factory.mktemp("kv") / "scales.json"
    factors = {"0": 0.5, "1": 0.125}
    scales.write_text(
        json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": factors}}})
    )
    cargs = {"kv_cache_dtype": "fp8_e4m3", "quantization_param_path": str(scales)}
    art = Artefact.open(artefact("llama", compile_args=cargs))
    runner = ModelRunner(art, 2048)
    # decode steps only: a prompt's attention in the executor reads its K/V unrounded
    assert isinstance(runner.decode, NativeStep) and not runner.decode.every_step
    assert "0.125f" in report.step_source(art.root)  # layer 1's scale, a literal
    seqs = Seqs(runner, PROMPTS[:6])
    seqs.prefill()
    for _ in range(3):
        step = seqs.step(list(range(6)))
        got = as_tensor(runner.run(step))
        assert torch.equal(got, eager(runner, step))
        seqs.advance(step, list(range(6)))


def test_what_cannot_be_lowered_runs_in_the_executor_and_says_why(artefact) -> None:
    art = artefact("mixtral")
    plan = Artefact.open(art).graph.plan
    assert plan["decode"]["mode"] == "eager"
    why = plan["decode"]["native_refused"]
    assert "moe" in why, why
    text = report.format_summary(report.summary(art))
    assert f"step       every step in the Python executor: {why}" in text
    assert report.step_source(art).startswith(f"no native step: {why}")
    opened = Artefact.open(art)
    runner = ModelRunner(opened, 256)
    assert runner.decode is None
    assert runner.decode_mode(opened) == f"Python executor ({plan['decode']['native_refused']})"


def test_the_lowering_refuses_what_it_cannot_write_as_numbers(artefact) -> None:
    graph = Artefact.open(artefact("llama", compile_args={"page_size": 4})).graph
    assert lower_step(graph).calls > 0
    norm = next(n for n in graph.nodes if n.op == "rmsnorm")
    eps = norm.attrs["eps"]
    for bad in ("1.0f); abort(", float("nan"), True):
        norm.attrs["eps"] = bad
        with pytest.raises(Refused, match="eps"):
            lower_step(graph)
    norm.attrs["eps"] = eps
    norm.meta["backend"] = "torch_native"
    with pytest.raises(Refused, match=f"%{norm.name}: rmsnorm on torch_native has no native"):
        lower_step(graph)


def test_inspect_shows_the_lowered_step(artefact) -> None:
    art = artefact("llama", compile_args={"page_size": 4})
    text = report.format_summary(report.summary(art))
    assert "capture    decode native; prefill native;" in text
    assert "step       every step (decode, prefill, extend: a row a new token) lowered to C" in text
    source = report.step_source(art)
    assert "int kiln_step_run(kiln_step_args *s) {" in source
    assert source.count("STEP_CALL(") >= 2 * 4  # two layers of linears and attention


def test_a_step_not_built_here_is_not_loaded(artefact, tmp_path: Path, caplog) -> None:
    """The step is code: as with the kernels, only this user's build of it (by checksum)
    loads, else the artefact's copy with --trust-remote-code; else the executor runs the
    steps and one warning says how to get the step back."""
    art = tmp_path / "art"
    shutil.copytree(artefact("llama"), art)
    build_id = Artefact.open(art).manifest["native_step"]["build_id"]
    built = native.store() / f"step-{build_id}.so"
    aside = built.with_name(built.name + ".aside")
    built.rename(aside)
    try:
        with caplog.at_level(logging.WARNING, "kiln.runtime"):
            loaded = Artefact.open(art)
        assert loaded.step_lib is None
        assert "native decode step was not built by kiln on this machine" in caplog.text
        engine = Engine(art)
        assert engine.runner.decode is None
        assert engine.generate("hello", {"max_new_tokens": 3, "ignore_eos": True})["text"]
        engine.shutdown()
        assert Artefact.open(art, trust_remote_code=True).step_lib is not None
    finally:
        aside.rename(built)


def test_the_step_checks_what_it_binds(artefact) -> None:
    art = Artefact.open(artefact("llama", compile_args={"page_size": 4}))
    runner = ModelRunner(art, 256)
    info = art.manifest["native_step"]
    name = info["weights"][3]
    assert art.host is not None
    short = dict(art.host)
    short[name] = art.host[name].reshape(-1)[:-1]
    with pytest.raises(ArtefactError, match=f"weight '{name}'"):
        NativeStep(art.step_lib, art.lib, info, art.graph, short, runner.kv, 4)
    # a token id past the vocabulary: the embedding's own check, named
    assert isinstance(runner.decode, NativeStep)
    seqs = Seqs(runner, [[5, 6, 7]])
    seqs.prefill()
    step = seqs.step([0])
    step.ids[0] = art.spec.vocab_size + 5
    with pytest.raises(KernelError, match="token id is outside the vocabulary"):
        runner.run(step)


def test_the_building_threads_openmp_pool_is_handed_back_and_kernels_still_run(artefact):
    """EngineThread.start hands back the building thread's OpenMP workers (an idle pool
    there slowed every kernel call of the engine thread); OpenMP must then start new ones
    on demand, on that thread and on others."""
    import threading

    from kiln.runtime.engine_thread import release_openmp_pool

    x = torch.randn(4096, 512)
    want = (x @ x.T).sum()  # a parallel region on this thread: its pool exists now
    release_openmp_pool()
    assert torch.equal((x @ x.T).sum(), want)
    engine = Engine(artefact("llama"))
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    here = engine.generate("hello", greedy)["text"]
    release_openmp_pool()
    got: list[str] = []
    worker = threading.Thread(target=lambda: got.append(engine.generate("hello", greedy)["text"]))
    worker.start()
    worker.join()
    assert got == [here]
    engine.shutdown()


@pytest.mark.parametrize(
    "base, dim, attrs",
    [(1e4, 64, Tables()), (5e5, 128, Tables(1.2)), (1e6, 96, Tables(0.9, 12))],
)
def test_rotary_tables_are_the_reference_kernels_to_the_bit(
    base: float, dim: int, attrs: Tables
) -> None:
    """The native step's tables come from numpy (no torch at load), the executor's from
    the op's torch kernel: equal bits at every position of a long context, or a decode
    step would no longer be the executor's."""
    rows = 32768
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    cos, sin = rope_cos_sin.kernel(torch.arange(rows), inv_freq, a=attrs)
    want = torch.stack((cos.reshape(rows, -1), sin.reshape(rows, -1)), 1).numpy()
    got = rope_table(rows, inv_freq.numpy(), attrs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
