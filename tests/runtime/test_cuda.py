"""The CUDA path on a GPU: decode replayed from CUDA graphs and prefills run as recorded
pieces against eager steps, and a CUDA artefact's greedy tokens against the same checkpoint
on the CPU. Skipped where torch sees no
CUDA device (everything but the capture call is tested on the CPU in test_capture.py);
benchmarks/gpu_check.sh runs it where there is one."""

from __future__ import annotations

import re

import pytest
import torch
from batch_invariance import scenarios

from kiln import Engine
from kiln.core.ops import HOST_SYNC_OPS
from kiln.example import FAMILIES
from kiln.runtime.capture import GraphDecode, PiecewisePrefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The CPU named: on a machine with a GPU an unset --device is the GPU (as in SGLang).
CPU = {"device": "cpu"}
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
BATCHES = ([[1, 5, 9]], [[3], [8, 1], [5, 5, 5]], [[i, i + 1] for i in range(3, 8)])


def test_cuda_graphs_replay_what_eager_steps_compute(artefact) -> None:
    cuda = {"device": "cuda", "cuda_graph_max_bs": 8}
    graphs = Engine(artefact("llama", compile_args=cuda), max_total_tokens=1024)
    assert isinstance(graphs.runner.decode, GraphDecode) and graphs.runner.decode.ready
    assert sorted(graphs.runner.decode.replays) == [1, 2, 4, 8]
    eager = Engine(
        artefact("llama", compile_args={**cuda, "disable_cuda_graph": True}),
        max_total_tokens=1024,
    )
    assert eager.runner.decode is None
    cpu = Engine(artefact("llama", compile_args=CPU), max_total_tokens=1024)
    assert str(cpu.runner.device) == "cpu" and str(graphs.runner.device).startswith("cuda")
    for prompts in BATCHES:
        got = graphs.generate(input_ids=prompts, sampling_params=GREEDY)
        want = eager.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        on_cpu = cpu.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [c["output_ids"] for c in on_cpu]


def test_piecewise_prefill_graphs_match_eager_prefill(artefact) -> None:
    cuda = {"device": "cuda", "disable_cuda_graph": True}
    pieces = {**cuda, "enable_piecewise_cuda_graph": True, "piecewise_cuda_graph_tokens": "8,16,32"}
    graphs = Engine(artefact("llama", compile_args=pieces), max_total_tokens=1024)
    prefill = graphs.runner.prefill
    assert isinstance(prefill, PiecewisePrefill) and prefill.ready
    recorded = prefill.recordings
    assert recorded == 3 * 3  # three buckets of three pieces (two layers)
    eager = Engine(artefact("llama", compile_args=cuda), max_total_tokens=1024)
    # Prompts of 3 to 30 tokens: every bucket, padded and not, and one past the largest.
    batches = [*BATCHES, [list(range(3, 33))], [list(range(3, 40)), [4, 4]]]
    for prompts in batches:
        got = graphs.generate(input_ids=prompts, sampling_params=GREEDY)
        want = eager.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert prefill.recordings == recorded


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_on_the_gpu_decodes_as_on_the_cpu(artefact, family: str) -> None:
    """Each family's tiny checkpoint compiled for the GPU, decode replayed from CUDA graphs
    (buckets 1, 2, 4; eager for MoE models, whose expert loop no graph can record): greedy
    tokens of a batch of three, one prompt longer than the sliding windows (16), against
    the same checkpoint on the CPU. The families reach torch_native attention (Gemma 2's
    soft cap, GPT-OSS's sinks), MLA, MoE routing and every rope scaling on the GPU."""
    gpu = Engine(
        artefact(family, compile_args={"device": "cuda", "cuda_graph_max_bs": 4}),
        max_total_tokens=1024,
    )
    if any(n.op in HOST_SYNC_OPS for n in gpu.art.graph.nodes):
        # the MoE's expert loop reads its routing on the host: decode runs eagerly
        assert gpu.runner.decode is None
    else:
        assert gpu.runner.decode is not None and gpu.runner.decode.ready
    cpu = Engine(artefact(family, compile_args=CPU), max_total_tokens=1024)
    prompts = [[1, 5, 9], [3], list(range(4, 27))]
    got = gpu.generate(input_ids=prompts, sampling_params=GREEDY)
    want = cpu.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_sampling_penalties_and_logprobs_on_the_gpu(artefact) -> None:
    """Seeded sampling with every filter and penalty, and logprobs, run on the GPU's
    logits: the same seed gives the same tokens, each a token the filters allow."""
    gpu = Engine(artefact("llama", compile_args={"device": "cuda"}), max_total_tokens=1024)
    params = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": {"5": 3.0, "6": -100},
        "max_new_tokens": 8,
        "ignore_eos": True,
        "seed": 7,
    }
    prompts = [[1, 2, 3], [4, 5]]
    kw = {"return_logprob": True, "top_logprobs_num": 3}
    first = gpu.generate(input_ids=prompts, sampling_params=params, **kw)
    again = gpu.generate(input_ids=prompts, sampling_params=params, **kw)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    for out in first:
        assert len(out["output_ids"]) == 8 and 6 not in out["output_ids"]
        logprobs = out["meta_info"]["output_token_logprobs"]
        assert len(logprobs) == 8 and all(lp <= 0.0 for lp, *_ in logprobs)


def test_a_grammar_on_the_gpu(artefact) -> None:
    """A regex-constrained request on the GPU: the grammar's token mask applied to GPU
    logits, greedy and sampled; the text matches."""
    gpu = Engine(artefact("llama", compile_args={"device": "cuda"}), max_total_tokens=1024)
    for temperature in (0.0, 1.0):
        params = {"regex": "(ab|ba){3}", "max_new_tokens": 16, "temperature": temperature}
        out = gpu.generate(input_ids=[[1, 2, 3], [7]], sampling_params=params)
        assert all(re.fullmatch("(ab|ba){3}", o["text"]) for o in out), out


def _entries(rows) -> tuple[list[float], list[int]]:
    """A meta_info logprob field's (logprob, id, text) entries, flattened: the values and
    the ids (a position's list of entries, or a single entry, or None for the first prompt
    token)."""
    flat = [
        e
        for row in rows
        if row is not None
        for e in (row if isinstance(row[0], list | tuple) else [row])
    ]
    return [e[0] for e in flat], [e[1] for e in flat]


def test_prompt_and_named_logprobs_on_the_gpu_are_the_cpus(artefact) -> None:
    """Logprobs read off the GPU's logits (decode from CUDA graphs): the chosen tokens',
    the top 3, SGLang's token_ids_logprob at every generated and every scored prompt
    position (logprob_start_len 0), against the same float32 checkpoint on the CPU."""
    gpu = Engine(artefact("llama", compile_args={"device": "cuda"}), max_total_tokens=1024)
    assert gpu.runner.decode is not None and gpu.runner.decode.ready
    cpu = Engine(artefact("llama", compile_args=CPU), max_total_tokens=1024)
    kw = {
        "input_ids": [list(range(3, 15)), [1, 5, 9]],
        "sampling_params": {**GREEDY, "max_new_tokens": 6},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 300, 5, 0],
    }
    fields = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
    fields += ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
    for got, want in zip(gpu.generate(**kw), cpu.generate(**kw), strict=True):
        assert got["output_ids"] == want["output_ids"]
        for field in fields:
            (gv, gi), (wv, wi) = (
                _entries(got["meta_info"][field]),
                _entries(want["meta_info"][field]),
            )
            assert gv and gv == pytest.approx(wv, abs=1e-4), field
            if "top" not in field:  # the top 3 may order near-ties differently
                assert gi == wi, field
        assert len(got["meta_info"]["output_token_ids_logprobs"]) == 6


def test_embeddings_on_the_gpu_are_the_cpus(artefact) -> None:
    """An --is-embedding artefact compiled for the GPU: each prompt's pooled, normalised
    last hidden state (batched, then one prompt again through the prefix cache) against
    the same checkpoint's on the CPU."""
    import numpy as np

    emb = {"is_embedding": True}
    gpu = Engine(artefact("llama", compile_args={**emb, "device": "cuda"}), max_total_tokens=1024)
    cpu = Engine(artefact("llama", compile_args={**emb, **CPU}), max_total_tokens=1024)
    prompts = [[1, 5, 9], list(range(3, 30)), [7, 8, 9, 10, 11]]
    got, want = gpu.embed(input_ids=prompts), cpu.embed(input_ids=prompts)
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["embedding"], w["embedding"], atol=1e-5)
    again = gpu.embed(input_ids=prompts[1])
    assert again["meta_info"]["cached_tokens"] > 0
    assert np.allclose(again["embedding"], want[1]["embedding"], atol=1e-5)


def test_deterministic_inference_on_the_gpu(artefact) -> None:
    """--enable-deterministic-inference on CUDA (the Triton linear in place of cuBLAS, the
    Triton attention and norms; decode replayed from CUDA graphs, padded to their buckets):
    a request's greedy logprobs are bitwise the same alone, after a prefix-cache hit,
    beside four others of other lengths and with its prompt in 64-token chunks, and close
    to the default kernels'."""
    cuda = {"device": "cuda", "cuda_graph_max_bs": 8}
    flag = {**cuda, "enable_deterministic_inference": True}
    det = scenarios(artefact("llama", compile_args=flag))
    assert all(run == det[0] for run in det[1:]), det
    loose = scenarios(artefact("llama", compile_args=cuda))
    print("default kernels' runs equal:", [run == loose[0] for run in loose[1:]])
    assert max(abs(a - b) for run in loose for a, b in zip(run, det[0], strict=True)) < 0.05


def test_lora_adapters_on_a_gpu_answer_as_on_the_cpu(artefact, checkpoint, tmp_path) -> None:
    """Adapters' steps on a CUDA artefact (the executor, eager, beside the graphs of base
    steps): the CPU's greedy tokens, adapter for adapter, in one mixed batch."""
    from lora_files import write_adapter

    ckpt = checkpoint("llama")
    paths = (
        f"a={write_adapter(ckpt, tmp_path / 'a', seed=1)}",
        # a bfloat16 file: the CPU keeps it bfloat16, a GPU widens it once when it loads
        f"b={write_adapter(ckpt, tmp_path / 'b', seed=2, alpha=12.0, dtype=torch.bfloat16)}",
    )
    cuda = {"device": "cuda", "cuda_graph_max_bs": 8}
    gpu = Engine(artefact("llama", compile_args=cuda), max_total_tokens=1024, lora_paths=paths)
    cpu = Engine(artefact("llama", compile_args=CPU), max_total_tokens=1024, lora_paths=paths)
    prompts = [[1, 5, 9], [1, 5, 9], [5, 5], [1, 5, 9], [7, 3, 3, 2]]
    loras = [None, "a", "a", "b", "b"]
    got = gpu.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)
    want = cpu.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    answers = {tuple(got[i]["output_ids"]) for i in (0, 1, 3)}
    assert len(answers) == 3  # each adapter changes the answer
    for name in ("a", "b"):
        torch.testing.assert_close(
            gpu.prompt_logits(prompts[4], lora=name).cpu(),
            cpu.prompt_logits(prompts[4], lora=name),
            rtol=1e-4,
            atol=1e-4,
        )


def test_fp32_lm_head_on_the_gpu(artefact) -> None:
    """--enable-fp32-lm-head on a bfloat16 CUDA artefact (its lm_head widened whole on the
    GPU; decode replayed from CUDA graphs): float32 logits, the bfloat16 head's to within
    its rounding, and greedy decoding takes them."""
    prompt = [5, 17, 33, 8, 91, 12]
    cuda = {"device": "cuda", "cuda_graph_max_bs": 8, "dtype": "bfloat16"}
    plain = Engine(artefact("llama", compile_args=cuda), max_total_tokens=256)
    wide = Engine(
        artefact("llama", compile_args={**cuda, "enable_fp32_lm_head": True}),
        max_total_tokens=256,
    )
    assert isinstance(wide.runner.decode, GraphDecode) and wide.runner.decode.ready
    l16, l32 = plain.prompt_logits(prompt).cpu(), wide.prompt_logits(prompt).cpu()
    assert l16.dtype == torch.bfloat16 and l32.dtype == torch.float32
    assert not torch.equal(l32.to(torch.bfloat16).float(), l32)
    torch.testing.assert_close(l32, l16.float(), rtol=2**-7, atol=1e-2)
    outs = wide.generate(input_ids=[prompt, prompt[:3]], sampling_params=GREEDY)
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
    assert outs[0]["output_ids"][0] == int(l32[-1].argmax())
