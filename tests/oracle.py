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


def assert_continues_as(
    engine: Engine, hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int = 16
) -> None:
    """kiln's greedy continuation of every prompt equals transformers', and its logits at
    every position of prompt + continuation are within 1e-4 of transformers' (fp32)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, new_tokens), f"{len(prompt)} tokens"
        seq = prompt + out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]  # type: ignore[operator]
        torch.testing.assert_close(kiln_all_logits(engine, seq), ref, atol=1e-4, rtol=0)


def round_linear_inputs(hf: torch.nn.Module, group: int | None, skip: tuple[str, ...] = ()) -> None:
    """Make transformers round every Linear's input (but `skip`'s) to int8 per group of
    `group` inputs (None: the whole row), as kiln's --quantize-activations int8 kernels do."""
    from kiln.core.quant import quantize_group_activations

    def hook(_mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        rounded = quantize_group_activations(rows, group or x.shape[-1]).to(x.dtype)
        return (rounded.reshape(x.shape),)

    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name not in skip:
            mod.register_forward_pre_hook(hook)


def assert_rounds_like(got: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor) -> None:
    """kiln's logits `got` with int8 activations against transformers rounding the same way
    (`ref`) and not rounding (`plain`). Equal up to float32 rounding, but for ties: an
    activation within a float32 ulp of a rounding midpoint goes either way on the smallest
    difference in how it was computed, which happens a few times a forward pass, and a tiny
    random model can move its later logits by a third of rounding's whole effect. So: most
    positions to float rounding, and on average far nearer `ref` than `plain` is (no
    rounding, or rounding over other groups, is as far as `plain` or farther)."""
    err, moved = (got - ref).abs().amax(-1), (plain - ref).abs().amax(-1)
    assert (err < 1e-3).float().mean() >= 0.5, err
    assert err.mean() < 0.25 * moved.mean(), (err.mean(), moved.mean())
