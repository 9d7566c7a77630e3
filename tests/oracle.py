"""Helpers shared by the tests that hold kiln against transformers (importable from every
test folder: pytest puts tests/ on the path, see pyproject.toml)."""

from __future__ import annotations

import torch

from kiln import Engine


def kiln_all_logits(engine: Engine, seq: list[int]) -> torch.Tensor:
    """Logits at every position of `seq`, through the runtime's own batch path."""
    return engine.prompt_logits(seq)
