from __future__ import annotations

import pytest
import torch

from kiln.runtime.sampler import sample
from kiln.runtime.sampling_params import SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_and_degenerate_filters_take_the_argmax() -> None:
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=0.0, top_k=5),
    ]
    assert sample(logits, params, [gen(i) for i in range(6)]) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed() -> None:
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0)]
    a = [sample(logits, p, [gen(1)])[0] for _ in range(3)]
    assert a == [a[0]] * 3
    assert len({sample(logits, p, [gen(s)])[0] for s in range(20)}) > 10


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    g = gen(0)
    picks = {sample(logits, [SamplingParams(top_k=2)], [g])[0] for _ in range(200)}
    assert picks == {0, 1}
    # p(0) ~ 0.665, p(1) ~ 0.245: top_p 0.8 keeps exactly those two.
    picks = {sample(logits, [SamplingParams(top_p=0.8)], [g])[0] for _ in range(200)}
    assert picks == {0, 1}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n must"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"bogus": 1}, "unknown sampling parameters"),
    ],
)
def test_validation(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(bad)


def test_aliases() -> None:
    p = SamplingParams.from_dict({"seed": 3, "max_tokens": 9})
    assert p.sampling_seed == 3 and p.max_new_tokens == 9
