from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kiln.runtime.sampler import (
    SamplingRow,
    argmax_rows,
    new_generator,
    sample,
    token_logprobs,
)
from kiln.runtime.sampling_params import SamplingParams


def gen(seed: int) -> np.random.Generator:
    return new_generator(seed)


def row(
    seed: int = 0,
    output: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (1,),
    top: int | None = None,
    **params,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), gen(seed), prompt, output, top)


def tokens(logits, rows):
    return sample(logits, rows)[0]


def test_greedy_and_degenerate_filters_take_the_argmax() -> None:
    logits = torch.randn(6, 50)
    rows = [
        row(temperature=0),
        row(top_k=1),
        row(top_p=1e-6),
        row(min_p=1.0),
        row(temperature=1e-4),
        row(temperature=0.0, top_k=5),
    ]
    assert tokens(logits, rows) == logits.argmax(-1).tolist()


def test_argmax_rows_picks_torch_argmax_ties_and_nans_included() -> None:
    """Host float32 rows go through numpy: the first maximum of ties, a NaN over any
    number, as torch picks them; a view of a wider buffer and bfloat16 rows (torch's
    own) too."""
    logits = torch.randn(5, 49152)
    logits[1, [7, 9000]] = 50.0  # a tie: the first
    logits[2, 123] = float("nan")
    logits[3, :] = 0.0  # all equal: 0
    logits[4, [10, 20]] = float("inf")
    expect = [int(logits[0].argmax()), 7, 123, 0, 10]
    assert argmax_rows(logits) == expect == logits.argmax(-1).tolist()
    assert argmax_rows(logits[1:3, :10000]) == [7, 123]
    half = logits.bfloat16()
    assert argmax_rows(half) == half.argmax(-1).tolist()
    assert argmax_rows(logits.numpy()) == expect  # the native step's logits


def test_numpy_logits_sample_as_the_same_tensor_does() -> None:
    """The native step's logits are a numpy array: a step of plain greedy rows is their
    argmax, and any other row (suppressed tokens, penalties, logprobs, sampling) gets
    what the same values as a tensor get (logprobs to float32 rounding)."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(11))
    top = int(logits[1].argmax())
    rows = [
        row(temperature=0),
        SamplingRow(SamplingParams(temperature=0), None, (1,), (), None, (top,)),
        row(temperature=0, repetition_penalty=1.3, prompt=(5, 6, 7)),
        row(temperature=0, top=3),
        row(seed=4, temperature=0.8),
    ]
    assert [r.plain for r in rows] == [True, False, False, False, False]
    plain = sample(logits.numpy()[:1], rows[:1])
    assert plain == ([int(logits[0].argmax())], [None])
    got = sample(logits.numpy(), rows)
    rows[-1] = row(seed=4, temperature=0.8)  # the generator afresh
    want = sample(logits, rows)
    assert got[0] == want[0] and got[0][1] != top
    assert [lp is None for lp in got[1]] == [lp is None for lp in want[1]] == [1, 1, 1, 0, 1]
    assert got[1][3].token == want[1][3].token
    assert_logprobs_close(got[1][3], want[1][3])


def test_a_native_steps_rows_need_no_torch_but_for_a_grammar(monkeypatch) -> None:
    """The native step's numpy logits: greedy and sampled rows, with penalties, suppressed
    tokens and logprobs, are chosen without a torch op (each costs ~80 us right after a
    step, and a server that has not imported torch need not); a row with a grammar does
    need it (xgrammar's bitmask is a tensor)."""
    from kiln.runtime import sampler

    logits = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    plain, logprobs = row(temperature=0), row(temperature=0, top=2)
    drawn = row(3, temperature=0.7, top_k=40, top_p=0.9, min_p=0.01)
    penalised = row(4, output=(7, 7, 9), temperature=0.9, frequency_penalty=0.5, top=1)
    suppressed = SamplingRow(SamplingParams(temperature=0), None, (1,), (), None, (3, 4))
    constrained = SamplingRow(SamplingParams(), None, (1,), (), grammar=object())
    monkeypatch.setattr(sampler, "torch", None)
    assert sample(logits, [plain, plain]) == (logits.argmax(-1).tolist(), [None, None])
    tokens, _ = sample(logits, [plain, drawn, plain])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    tokens, lps = sample(logits, [logprobs, penalised, suppressed])
    assert lps[0] is not None and lps[1] is not None and lps[2] is None
    assert tokens[2] not in (3, 4)
    with pytest.raises(AttributeError):
        sample(logits, [plain, constrained])


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 50},
        {"temperature": 0.8, "top_p": 0.95},
        {"temperature": 1.3, "top_p": 0.5, "min_p": 0.05},
        {"temperature": 0.6, "top_k": 1000, "top_p": 0.9, "min_p": 0.001},
        {"temperature": 1e-30},  # overflows to the largest float: the argmax
        {"temperature": 0.8, "top_p": 0.95, "frequency_penalty": 0.7, "presence_penalty": 0.3},
        {"temperature": 0, "repetition_penalty": 1.3, "logit_bias": {"17": 9.5, "4": -100}},
        {"temperature": 1.0, "repetition_penalty": 0.8, "frequency_penalty": -0.4},
    ],
)
@pytest.mark.parametrize("scale", [0.5, 4.0])  # flat .. peaked rows
def test_host_rows_pick_what_the_torch_sampler_picks(params: dict, scale: float) -> None:
    """A native step's row is chosen in numpy (`_host_row`): the same penalties and
    filters, the same uniform numbers from the request's generator, so the same tokens as
    the torch path on the same values (random rows: no ties at a boundary), over 25 steps
    of each row's own output; logprobs and suppressed tokens on two of the four rows."""
    rng = np.random.default_rng(int(scale * 10))
    logits = (rng.standard_normal((4, 49152)) * scale).astype(np.float32)
    sp = SamplingParams.from_dict(params)
    outputs: list[list[int]] = [[] for _ in range(4)]
    host_gens, device_gens = [gen(s) for s in range(4)], [gen(s) for s in range(4)]

    def rows(gens: list) -> list[SamplingRow]:
        return [
            SamplingRow(
                sp,
                gens[s],
                (3, 17, 40000),
                tuple(outputs[s]),
                top_logprobs=(0, 4, None, None)[s],
                suppress=((), (), (int(logits[2].argmax()),), ())[s],
            )
            for s in range(4)
        ]

    for _ in range(25):
        got_tokens, got_lps = sample(logits, rows(host_gens))
        want_tokens, want_lps = sample(torch.from_numpy(logits), rows(device_gens))
        assert got_tokens == want_tokens
        assert got_tokens[2] != int(logits[2].argmax())
        for got, want in zip(got_lps, want_lps, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert got.token == want.token
                assert_logprobs_close(got, want)
        for s, t in enumerate(got_tokens):
            outputs[s].append(t)


@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.9, 0.999])
def test_the_host_nucleus_is_the_full_sorts(top_p: float) -> None:
    from kiln.runtime.sampler import _host_nucleus

    rng = np.random.default_rng(5)
    for scale in (0.3, 3.0, 12.0):
        x = rng.standard_normal(49152).astype(np.float32) * scale
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        probs[rng.integers(0, 49152, 500)] = 0.0
        want = full_sort_nucleus(torch.from_numpy(probs.copy()), top_p).numpy()
        assert np.array_equal(_host_nucleus(probs, top_p), want)
        # top_k's cut first: all but 50 (then all but 2000) zero
        for kept in (50, 2000):
            cut = probs.copy()
            cut[np.argsort(cut, kind="stable")[:-kept]] = 0.0
            cut /= cut.sum()
            want = full_sort_nucleus(torch.from_numpy(cut.copy()), top_p).numpy()
            assert np.array_equal(_host_nucleus(cut, top_p), want)


def test_a_peaked_nucleus_is_found_above_a_cut_without_a_whole_row_selection(
    monkeypatch,
) -> None:
    """A peaked row's nucleus (tens of tokens, as a model's usually is) is found among the
    probabilities above max x NUCLEUS_CUTS, no argpartition of the row: the full sort's
    tokens."""
    from kiln.runtime import sampler

    rng = np.random.default_rng(9)
    rows = []
    for scale in (6.0, 12.0):
        x = rng.standard_normal(49152).astype(np.float32) * scale
        probs = np.exp(x - x.max())
        rows.append(probs / probs.sum())
    want = {
        (i, q): full_sort_nucleus(torch.from_numpy(p.copy()), q).numpy()
        for i, p in enumerate(rows)
        for q in (0.5, 0.9, 0.95)
    }

    def whole_row(*args, **kwargs):
        raise AssertionError("an argpartition of the whole row")

    monkeypatch.setattr(sampler.np, "argpartition", whole_row)
    for (i, q), expect in want.items():
        assert np.array_equal(sampler._host_nucleus(rows[i], q), expect)


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed() -> None:
    logits = torch.zeros(1, 1000)
    a = [tokens(logits, [row(1)])[0] for _ in range(3)]
    assert a == [a[0]] * 3
    assert len({tokens(logits, [row(s)])[0] for s in range(20)}) > 10


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p by one full sort: the definition _nucleus must keep."""
    sorted_p, idx = probs.sort(descending=True)
    sorted_p[sorted_p.cumsum(0) - sorted_p > top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, idx, sorted_p)


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (a nucleus of thousands) .. peaked
@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.9, 0.999])
def test_the_nucleus_from_the_largest_is_the_full_sorts(scale: float, top_p: float) -> None:
    """top_p keeps the same tokens whether it finds the prefix among the k largest or
    sorts all 49,152 (random rows: no ties at the boundary)."""
    from kiln.runtime.sampler import _nucleus

    g = torch.Generator().manual_seed(int(scale * 10))
    for _ in range(3):
        probs = torch.softmax(torch.randn(49152, generator=g) * scale, -1)
        probs[torch.randint(49152, (500,), generator=g)] = 0.0  # suppressed tokens
        assert torch.equal(_nucleus(probs, top_p), full_sort_nucleus(probs, top_p))
    nan = torch.full((1000,), float("nan"))
    assert torch.equal(_nucleus(nan, 0.9).isnan(), full_sort_nucleus(nan, 0.9).isnan())


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    assert {tokens(logits, [row(s, top_k=2)])[0] for s in range(200)} == {0, 1}
    # p(0) ~ 0.665, p(1) ~ 0.245: top_p 0.8 keeps exactly those two.
    assert {tokens(logits, [row(s, top_p=0.8)])[0] for s in range(200)} == {0, 1}


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    assert tokens(logits, [row(temperature=0, output=(0,))]) == [0]
    assert tokens(logits, [row(temperature=0, output=(0,), frequency_penalty=0.5)]) == [1]
    assert tokens(logits, [row(temperature=0, output=(0, 0), presence_penalty=0.2)]) == [1]
    # Repetition penalty divides positive logits of seen tokens (prompt included).
    assert tokens(logits, [row(temperature=0, prompt=(0,), repetition_penalty=1.1)]) == [1]
    # A negative frequency penalty rewards repeats.
    assert tokens(logits, [row(temperature=0, output=(1,), frequency_penalty=-0.5)]) == [1]


def test_logprobs_of_chosen_and_top_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    toks, lps = sample(logits, [row(temperature=0, top=2)])
    ref = torch.log_softmax(logits[0], -1)
    assert toks == [0] and lps[0] is not None
    assert lps[0].token == 0 and lps[0].logprob == pytest.approx(float(ref[0]))
    assert [t for t, _ in lps[0].top] == [0, 1]
    assert sample(logits, [row(temperature=0)])[1] == [None]


def test_named_tokens_get_their_logprobs_on_both_paths() -> None:
    """token_ids_logprob: each named token's logprob in the order named (repeats too), the
    numpy path's as the tensor path's to float32 rounding; a suppressed one is clamped at
    float32's lowest (JSON has no -Infinity); prompt rows (token_logprobs) alike."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3)) * 4
    ids = (7, 499, 0, 7)

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(SamplingParams(temperature=0), None, (1,), (), 2, (), None, ids),
            SamplingRow(SamplingParams(temperature=0), None, (1,), (), 0, (7,), None, ids),
            SamplingRow(SamplingParams(temperature=0.9), gen(1), (1,), (), 1, (), None, ids),
        ]

    ref = torch.log_softmax(logits, -1)
    cut = logits[1].clone()
    cut[7] = float("-inf")
    ref[1] = torch.log_softmax(cut, -1).clamp(min=torch.finfo(torch.float32).min)
    host, tensor = sample(logits.numpy(), rows()), sample(logits, rows())
    assert host[0] == tensor[0]
    for got in (host[1], tensor[1]):
        for i, lp in enumerate(got):
            assert lp is not None and [t for t, _ in lp.ids] == list(ids)
            assert [v for _, v in lp.ids] == pytest.approx(ref[i, list(ids)].tolist(), abs=1e-5)
        assert got[1].ids[0][1] == torch.finfo(torch.float32).min
    for scored in (
        token_logprobs(logits.numpy(), [3, 4, 5], 1, ids),
        token_logprobs(logits, [3, 4, 5], 1, ids),
    ):
        want = torch.log_softmax(logits, -1)[:, list(ids)]
        got = [v for lp in scored for _, v in lp.ids]
        assert got == pytest.approx(want.flatten().tolist(), abs=1e-5)
    assert token_logprobs(logits.numpy(), [3], 0)[0].ids == ()


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
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop must"),
    ],
)
def test_validation(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(bad)


def test_aliases_and_stop_as_string() -> None:
    p = SamplingParams.from_dict({"seed": 3, "max_tokens": 9, "stop": "\n"})
    assert p.sampling_seed == 3 and p.max_new_tokens == 9 and p.stop == ("\n",)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"temperature": "hot"}, "temperature: expected a finite number, got 'hot'"),
        ({"temperature": float("nan")}, "temperature: expected a finite number"),
        ({"max_new_tokens": "5"}, "max_new_tokens: expected an integer, got '5'"),
        ({"n": None}, "n: expected a value, got null"),
        ({"n": 129}, r"n must be in \[1, 128\]"),
        ({"stop": 5}, "stop: expected a string or a list of strings, got 5"),
        ({"stop": ["x"] * 33}, "stop: at most 32 strings"),
        ({"stop": "x" * 1025}, "at most 1024 characters"),
        ({"sampling_seed": 1.5}, "sampling_seed: expected an integer, got 1.5"),
        ({"top_k": 2.5}, "top_k: expected an integer, got 2.5"),
        ({"ignore_eos": 1}, "ignore_eos: expected true or false, got 1"),
        ({"stop_token_ids": [True]}, "stop_token_ids: expected a list of integers"),
        ({"logit_bias": {"5": None}}, r"logit_bias\['5'\]: expected a finite number, got null"),
        ({"logit_bias": [[5.5, 1]]}, "logit_bias: expected an object of token id to bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias: keys must be token ids"),
        ({"stop_regex": "a+"}, "stop_regex: not supported by kiln yet"),
        ({"json_schema": "{}", "ebnf": "x"}, "json_schema, ebnf: give at most one constraint"),
        ({"regex": 5}, "regex: expected a string"),
        ({"json_schema": ["x"]}, "json_schema: expected a JSON object or its text"),
        ({"seed": 1, "sampling_seed": 2}, "give sampling_seed or seed, not both"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens must be in"),
    ],
)
def test_wrong_types_are_named(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(bad)


def test_nullable_fields_mean_not_set() -> None:
    p = SamplingParams.from_dict({"stop": None, "sampling_seed": None, "logit_bias": None})
    assert p == SamplingParams()
    assert SamplingParams.from_dict({"temperature": 1e-45}).greedy
    assert SamplingParams.from_dict({"regex": None}) == SamplingParams()


# -- every value the validator accepts is safe in the sampler (issue 23, item 8) ---------------
VOCAB = 12
_edge_floats = st.one_of(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False),
    st.sampled_from([0.0, 1e-38, -1e-38, 3.0e38, -3.0e38, 1e30, -1e30]),
)


@st.composite
def accepted_params(draw: st.DrawFn) -> dict:
    """Sampling parameters anywhere in the ranges SamplingParams accepts, edges included."""
    return {
        "temperature": draw(st.one_of(st.sampled_from([0.0, 1e-6, 2e-6, 1e6]), st.floats(0, 100))),
        "top_p": draw(st.one_of(st.sampled_from([1e-30, 1.0]), st.floats(1e-9, 1.0))),
        "top_k": draw(st.one_of(st.just(-1), st.integers(1, VOCAB + 5))),
        "min_p": draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1))),
        "frequency_penalty": draw(st.floats(-2, 2)),
        "presence_penalty": draw(st.floats(-2, 2)),
        "repetition_penalty": draw(
            st.one_of(st.sampled_from([1e-38, 1e-45, 2.0]), st.floats(1e-30, 2.0))
        ),
        "logit_bias": draw(
            st.dictionaries(
                st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=VOCAB
            )
        ),
    }


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # the float32 tie the tie rule below is for (found by this test in CI)
    params={"temperature": 5.0, "top_p": 1e-30, "top_k": -1, "min_p": 0.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1e-45, "logit_bias": {}},
    logits=[0.0, -3e38, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -3e38, -3e38, -3e38],
    output=[], suppress=[0], seed=0,
)  # fmt: skip
@given(
    params=accepted_params(),
    logits=st.lists(_edge_floats, min_size=VOCAB, max_size=VOCAB),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    suppress=st.lists(st.integers(0, VOCAB - 1), max_size=3, unique=True),
    seed=st.integers(0, 2**63 - 1),
)
def test_every_accepted_parameter_samples_a_token(params, logits, output, suppress, seed) -> None:
    """A repetition_penalty of 1e-38 used to give inf logits and a 500 ("probability tensor
    contains inf or nan"): for any accepted values and any finite logits, the sampler picks
    a token it was allowed to pick, and every logprob is finite. A native step's numpy
    logits (sampled in numpy) give the same token and the same logprobs to float32
    rounding."""
    sp = SamplingParams.from_dict(params)
    picked = []
    for values in (torch.tensor([logits]), np.array([logits], dtype=np.float32)):
        r = SamplingRow(sp, gen(seed), (1, 2), tuple(output), 5, tuple(suppress))
        [token], [lp] = sample(values, [r])
        assert 0 <= token < VOCAB and token not in suppress
        assert lp is not None and np.isfinite([lp.logprob, *(v for _, v in lp.top)]).all()
        picked.append((token, lp))
    (token, lp), (host_token, host_lp) = picked
    if host_token != token:
        # Only a tie at float32's resolution: probabilities that torch's softmax keeps one
        # ulp apart and numpy's exp-then-divide rounds equal (found by this test: logits 0
        # and -4e-7 at temperature 5, top_p 1e-30), where each path's nucleus may begin
        # with either token. Their logprobs, scaled by the temperature, are that close.
        r = SamplingRow(sp, gen(seed), (1, 2), tuple(output), 0, tuple(suppress),
                        logprob_ids=(token, host_token))  # fmt: skip
        [(_, a), (_, b)] = sample(torch.tensor([logits]), [r])[1][0].ids
        assert abs(a - b) / max(sp.temperature, 1e-6) <= 3e-7, (token, host_token, a, b)
        return
    assert host_lp is not None and host_lp.token == lp.token
    assert_logprobs_close(host_lp, lp)


def assert_logprobs_close(got, want) -> None:
    """The same logprob and top values to float32 rounding (torch's CPU log_softmax was
    1.3e-5 off a float64 one on rows of standard deviation 4, numpy's 1.7e-6); the same
    top tokens where no other token has their value (a tie outside the top k is with its
    smallest)."""
    close = {"rel": 1e-5, "abs": 1e-4}
    assert got.logprob == pytest.approx(want.logprob, **close)
    assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], **close)
    values = [v for _, v in want.top]
    for (t, _), (u, v) in zip(got.top, want.top, strict=True):
        if values.count(v) == 1 and v != min(values):
            assert t == u


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_a_grammar_mask_reaches_its_own_rows_only(vocab: int) -> None:
    """Constrained rows anywhere in the batch (not only first) get their own mask, the others
    none; xgrammar's own kernel, given a full-batch mask, is the reference."""
    import xgrammar

    from kiln.runtime.grammar import apply_bitmask

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [1, 4, 2]
    mask = xgrammar.allocate_token_bitmask(len(rows), vocab)
    mask.copy_(torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=gen, dtype=torch.int32))
    got = logits.clone()
    apply_bitmask(got, mask, rows)
    full = xgrammar.allocate_token_bitmask(5, vocab)
    full[rows] = mask
    want = logits.clone()
    xgrammar.apply_token_bitmask_inplace(want, full, vocab_size=vocab, indices=rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 3]], logits[[0, 3]])  # unconstrained rows untouched
    assert torch.isinf(got[rows]).any()


def test_draws_follow_the_distribution_and_never_pick_a_zero() -> None:
    from kiln.runtime.sampler import _draw

    probs = torch.tensor([0.1, 0.0, 0.6, 0.0, 0.3, 0.0])
    g = gen(7)
    counts = torch.bincount(torch.tensor([_draw(probs, g) for _ in range(20_000)]), minlength=6)
    assert counts[[1, 3, 5]].sum() == 0
    assert torch.allclose(counts.float() / 20_000, probs, atol=0.012), counts
    # The same seed draws the same tokens.
    a, b = gen(3), gen(3)
    assert [_draw(probs, a) for _ in range(50)] == [_draw(probs, b) for _ in range(50)]


@pytest.mark.parametrize("size", [7, 255, 256, 1000, 49152, 49155])
def test_the_host_top_k_is_a_full_sorts(size: int) -> None:
    """`_host_top` looks only in the blocks with the largest maxima: the same indices as a
    full sort (largest first, ties by index), ties and -inf included."""
    from kiln.runtime.sampler import _host_top

    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(np.float32) * 3
    for row in (x, np.round(x), np.round(x * 0.2), np.zeros_like(x), np.where(x > 1, -np.inf, x)):
        row = row.astype(np.float32)
        for k in (1, 2, 5, 20):
            if k <= size:
                want = np.lexsort((np.arange(size), -row))[:k]
                assert _host_top(row, k).tolist() == want.tolist()
