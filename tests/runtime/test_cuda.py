"""The CUDA path on a GPU: decode replayed from CUDA graphs against eager steps, and a CUDA
artefact's greedy tokens against the same checkpoint on the CPU. Skipped where torch sees no
CUDA device (everything but the capture call is tested on the CPU in test_capture.py);
benchmarks/gpu_check.sh runs it where there is one."""

from __future__ import annotations

import pytest
import torch

from kiln import Engine
from kiln.runtime.capture import GraphDecode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

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
    cpu = Engine(artefact("llama"), max_total_tokens=1024)
    for prompts in BATCHES:
        got = graphs.generate(input_ids=prompts, sampling_params=GREEDY)
        want = eager.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        on_cpu = cpu.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [c["output_ids"] for c in on_cpu]
