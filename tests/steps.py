"""Driving a model runner by hand in tests: sequences prefilled, then steps built on
demand, and the Python executor's answer for a step (the reference every other way of
running a decode step is held to)."""

from __future__ import annotations

import torch

from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.step import StepInputs


class Seqs:
    """Sequences on a runner: prompts prefilled, then decode steps built on demand."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner, self.pool = runner, runner.pool
        self.tokens = [list(p) for p in prompts]
        self.pages = [self.pool.allocate(self.pool.pages_for(64)) for _ in prompts]
        self.cached = [0] * len(prompts)

    def step(self, which: list[int], new: dict[int, list[int]] | None = None) -> StepInputs:
        """One step over sequences `which`: each feeds `new[i]` (default: one token)."""
        ids, positions, q, kv, counts, pages, rows = [], [], [], [], [], [], []
        for i in which:
            fed = (new or {}).get(i) or [self.tokens[i][-1] % 50 + 3]
            start = self.cached[i]
            ids += fed
            positions += range(start, start + len(fed))
            rows.append(len(ids) - 1)
            q.append(len(fed))
            kv.append(start + len(fed))
            counts.append(len(self.pages[i]))
            pages += self.pages[i]
        return StepInputs(ids, positions, rows, q, kv, counts, pages)

    def advance(self, step: StepInputs, which: list[int]) -> None:
        for i, n in zip(which, step.q_lens, strict=True):
            self.cached[i] += n

    def prefill(self) -> None:
        which = list(range(len(self.tokens)))
        step = self.step(which, dict(enumerate(self.tokens)))
        self.runner.run(step)
        self.advance(step, which)


def eager(runner: ModelRunner, step: StepInputs, bucket: int | None = None) -> torch.Tensor:
    ctx, ids, positions, rows = runner.step.plan(step, bucket)
    return runner.executor(ctx, ids, positions, rows)[: len(step.rows)]
