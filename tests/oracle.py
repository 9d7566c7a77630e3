"""Helpers shared by the tests that hold kiln against transformers (importable from every
test folder: pytest puts tests/ on the path, see pyproject.toml)."""

from __future__ import annotations

import torch

from kiln import Engine
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Batch


def kiln_all_logits(engine: Engine, seq: list[int]) -> torch.Tensor:
    """Logits at every position of `seq`, through the runtime's own batch path."""
    runner = engine.runner
    req = Request("parity", seq, SamplingParams())
    req.pages = runner.pool.allocate(runner.pool.pages_for(len(seq)))
    try:
        return runner.forward(Batch([req], [seq], [True], is_prefill=True), all_logits=True)
    finally:
        runner.pool.free(req.pages)
