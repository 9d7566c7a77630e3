"""Helpers shared by the tests that hold kiln against transformers (importable from every
test folder: pytest puts tests/ on the path, see pyproject.toml)."""

from __future__ import annotations

import torch

from kiln import Engine


def kiln_all_logits(engine: Engine, seq: list[int]) -> torch.Tensor:
    """Logits at every position of `seq`, through the runtime's own batch path."""
    return engine.prompt_logits(seq)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `new_tokens` long (no stop at eos)."""
    out = hf.generate(  # type: ignore[operator]
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()
