"""Token selection from the last-position logits of each sequence in a batch."""

from __future__ import annotations

import torch

from kiln.runtime.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others sample after
    temperature, top-k, top-p and min-p, each with its request's own generator."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return greedy
    out = list(greedy)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[i], p)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_p.cumsum(0) - sorted_p > p.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
