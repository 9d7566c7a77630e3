"""Speculative decoding's parts on their own: NGRAM drafting from a request's own tokens,
the planner's choice of how many drafts to verify, and the compile flags and manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.args import ArgError, ServerArgs
from kiln.compiler import report
from kiln.compiler.options import speculative_options, verify_batch_sizes
from kiln.runtime.speculative import NgramIndex, StepCosts, acceptance, plan_drafts


def test_ngram_continues_the_longest_earlier_match() -> None:
    index = NgramIndex(1, 4)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 7, 2, 3, 4, 8, 1, 2, 3]
    # The suffix 1 2 3 occurred at 1..3 (then 9 7 2 ...); 2 3 alone also at 6..7 (then 4 8):
    # the longer match wins.
    assert index.propose(tokens, 3) == [9, 7, 2]
    assert index.propose(tokens, 1) == [9]


def test_ngram_never_matches_the_suffix_with_itself() -> None:
    index = NgramIndex(2, 3)
    assert index.propose([1, 2, 3, 4], 5) == []  # 3 4 occurred nowhere before
    assert index.propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]  # runs up to the end
    assert index.propose([7], 5) == []


def test_ngram_takes_the_most_recent_of_equal_matches_and_grows_with_the_tokens() -> None:
    index = NgramIndex(1, 2)
    tokens = [4, 1, 6, 4, 1, 7, 4, 1]
    assert index.propose(tokens, 2) == [7, 4]  # "4 1" ended at 1 and at 4: the later one
    tokens += [7, 9]
    assert index.propose(tokens, 2) == []  # "7 9": new
    tokens += [4, 1]
    assert index.propose(tokens, 1) == [7]


def test_the_planner_drafts_where_rows_are_cheap_and_not_where_they_cost_a_step() -> None:
    flat = StepCosts({1: 1.0, 64: 1.0}, 64)  # memory-bound: a row more costs nothing
    assert plan_drafts([0.5], [6], [100], flat) == [6]
    linear = StepCosts({1: 1.0, 2: 2.0}, 64)  # compute-bound: each row a step's worth
    assert plan_drafts([0.9], [6], [100], linear) == [0]
    # Rows at a tenth of a step each: drafts kept half the time pay for one or two rows.
    tenth = StepCosts({1: 1.0, 2: 1.1}, 64)
    assert 1 <= plan_drafts([0.5], [8], [100], tenth)[0] <= 3
    # In a batch, the request whose drafts are kept more often gets the rows.
    mixed = plan_drafts([0.9, 0.1], [8, 8], [100, 100], tenth)
    assert mixed[0] > mixed[1]
    assert plan_drafts([0.9, 0.9], [0, 0], [100, 100], flat) == [0, 0]
    # Free rows but a long cache each verify row must read again: fewer drafts.
    reads = StepCosts({1: 1.0, 64: 1.0}, 64, per_kv=1e-3)
    assert plan_drafts([0.7], [8], [10], reads) == [8]
    assert plan_drafts([0.7], [8], [2000], reads)[0] < 4


def test_step_costs_interpolate_and_follow_what_steps_take() -> None:
    costs = StepCosts({1: 1.0, 3: 2.0}, 8, per_kv=0.01)
    assert costs(2) == pytest.approx(1.5)
    assert costs(5) == pytest.approx(3.0)  # the last slope carried on
    assert costs(20) > costs(8)
    assert costs(2, kv=100) == pytest.approx(2.5)
    costs.observe(2, 100, 3.5)  # 1.0 of it the cache reads: the rows' part moves toward 2.5
    assert 1.5 < costs(2) < 2.5
    pinned = StepCosts({1: 1.0, 3: 2.0}, 8, fixed=True)
    pinned.observe(2, 0, 9.0)
    assert pinned(2) == pytest.approx(1.5)


def test_acceptance_starts_at_the_prior_and_learns() -> None:
    assert acceptance(0, 0) == pytest.approx(0.5)
    assert acceptance(100, 95) > 0.9
    assert acceptance(100, 5) < 0.1


def test_speculative_flags_resolve_as_sglang_does() -> None:
    assert speculative_options(ServerArgs(model_path="m")) is None
    got = speculative_options(ServerArgs(model_path="m", speculative_algorithm="NGRAM"))
    assert got == {
        "algorithm": "NGRAM",
        "num_draft_tokens": 12,  # --speculative-ngram-max-match-window-size's default
        "ngram_min_window": 1,
        "ngram_max_window": 12,
        "ngram_branch_length": 18,
    }
    assert verify_batch_sizes([1, 2, 4, 8], got) == [1, 2, 4, 8, 12, 24, 36, 48]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens: 1"),
        ({"speculative_ngram_min_match_window_size": 0}, "min-match-window-size: 0"),
        (
            {
                "speculative_ngram_min_match_window_size": 5,
                "speculative_ngram_max_match_window_size": 3,
            },
            "--speculative-ngram-max-match-window-size: 3",
        ),
        ({"speculative_ngram_branch_length": 0}, "--speculative-ngram-branch-length: 0"),
    ],
)
def test_bad_speculative_flags_are_named(flags: dict, message: str) -> None:
    with pytest.raises(ArgError, match=message):
        speculative_options(ServerArgs(model_path="m", speculative_algorithm="NGRAM", **flags))


def test_the_manifest_records_the_speculation_and_inspect_shows_it(artefact) -> None:
    flags = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5}
    art = artefact(compile_args=flags)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["runtime"]["speculative"]["num_draft_tokens"] == 5
    text = report.format_summary(report.summary(art))
    assert "speculate  NGRAM: verify steps of up to 5 tokens a request" in text


def test_a_thousand_requests_leave_the_pool_as_they_found_it(artefact) -> None:
    """Drafts on a tiny random model (its greedy text repeats, so n-grams match and are
    often rejected): every page taken for drafts comes back, and the prefix cache holds
    only accepted tokens (what a plain engine computes for them)."""
    import random

    from kiln import Engine

    flags = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}
    engine = Engine(artefact(compile_args=flags), max_total_tokens=512)
    engine.step_costs = StepCosts({1: 1.0, 64: 1.0}, 64, fixed=True)
    pool = engine.runner.pool
    rng = random.Random(0)
    drafted = kept = 0
    for _ in range(250):
        prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
        params = {"temperature": rng.choice([0, 1.0]), "max_new_tokens": rng.randrange(1, 12)}
        for out in engine.generate(input_ids=prompts, sampling_params=params):
            drafted += out["meta_info"]["spec_draft_token_num"]
            kept += out["meta_info"]["spec_accept_token_num"]
    assert drafted - kept > 100 and kept > 0  # many drafts rejected, some kept
    engine.flush_cache()
    assert pool.free_pages == pool.num_pages


def _standalone(artefact, checkpoint, **draft_config) -> Path:
    draft = checkpoint("llama", **draft_config)
    flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft)}
    return artefact(compile_args=flags)


@pytest.mark.parametrize(
    "draft_config", [{}, {"seed": 7, "hidden_size": 64}], ids=["itself", "another-model"]
)
def test_a_draft_models_drafts_leave_decodings_output_and_pages_as_they_were(
    artefact, checkpoint, draft_config: dict
) -> None:
    """STANDALONE on a tiny model, drafted by itself (every greedy draft kept) and by
    another random model (most rejected): output is plain decoding's, greedy and seeded,
    and both KV pools get every page back."""
    from kiln import Engine

    plain = Engine(artefact(), max_total_tokens=512)
    spec = Engine(_standalone(artefact, checkpoint, **draft_config), max_total_tokens=512)
    assert spec.draft_model is not None
    spec.step_costs = StepCosts({1: 1.0, 64: 1.0}, 64, fixed=True)  # rows free,
    spec.draft_costs = StepCosts({1: 1e-3, 4: 1e-3}, 4, fixed=True)  # drafts nearly so
    prompts = [[5, 9, 17, 5, 9], [40, 41, 42, 43], [7]]
    counts = []
    for params in (
        {"temperature": 0, "max_new_tokens": 20},
        {"temperature": 0.8, "sampling_seed": 3, "max_new_tokens": 20},
    ):
        want = plain.generate(input_ids=prompts, sampling_params=params)
        got = spec.generate(input_ids=prompts, sampling_params=params)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        metas = [g["meta_info"] for g in got]
        counts.append(
            (
                sum(m["spec_draft_token_num"] for m in metas),
                sum(m["spec_accept_token_num"] for m in metas),
            )
        )
    assert all(drafted > 10 for drafted, _ in counts)
    if not draft_config:  # the model drafting for itself: every greedy draft is kept
        assert counts[0][0] == counts[0][1]
    spec.flush_cache()
    assert spec.runner.pool.free_pages == spec.runner.pool.num_pages
    draft_pool = spec.draft_model.pool
    assert draft_pool.free_pages == draft_pool.num_pages


def test_a_draft_model_is_compiled_into_the_artefact_and_inspect_names_it(
    artefact, checkpoint
) -> None:
    art = _standalone(artefact, checkpoint)
    manifest = json.loads((art / "manifest.json").read_text())
    spec = manifest["runtime"]["speculative"]
    assert spec["algorithm"] == "STANDALONE" and spec["num_draft_tokens"] == 4
    assert (art / "draft" / "manifest.json").is_file()
    assert "draft/weights/rank0.safetensors" in manifest["files"]
    text = report.format_summary(report.summary(art))
    assert f"draft model {spec['draft']['cache_key'][:16]}" in text


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(checkpoint, tmp_path) -> None:
    from kiln.compiler.compile import compile_model

    target, draft = checkpoint("llama"), checkpoint("llama", vocab_size=500)
    args = ServerArgs(
        model_path=str(target),
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(draft),
    )
    with pytest.raises(ArgError, match="--speculative-draft-model-path: its vocabulary has 500"):
        compile_model(args, tmp_path / "art")
    with pytest.raises(ArgError, match="STANDALONE: needs --speculative-draft-model-path"):
        compile_model(ServerArgs(model_path=str(target), speculative_algorithm="STANDALONE"))


def test_sampled_tokens_follow_the_models_distribution_with_or_without_drafts(
    artefact, checkpoint
) -> None:
    """The statistical check of the acceptance rule, on a vocabulary cut to four tokens
    (top_k 4, temperature 1): the second and third tokens of 400 requests drafted by the
    model itself (its greedy token, kept whenever the sample equals it) against 400 plain
    ones with other seeds, by a chi-square test of their counts at p = 0.001."""
    from collections import Counter

    from kiln import Engine

    spec = Engine(_standalone(artefact, checkpoint), max_total_tokens=512)
    spec.step_costs = StepCosts({1: 1.0, 64: 1.0}, 64, fixed=True)
    spec.draft_costs = StepCosts({1: 1e-3, 4: 1e-3}, 4, fixed=True)
    plain = Engine(artefact(), max_total_tokens=512)
    prompt = [5, 9, 17, 40, 41]
    counts: list[list[Counter]] = [[Counter(), Counter()], [Counter(), Counter()]]
    drafted = kept = 0
    for which, (engine, base) in enumerate(((spec, 0), (plain, 10_000))):
        for start in range(0, 400, 4):
            params = [
                {"temperature": 1.0, "top_k": 4, "max_new_tokens": 3, "ignore_eos": True}
                | {"sampling_seed": base + s}
                for s in range(start, start + 4)
            ]
            for out in engine.generate(input_ids=[prompt] * 4, sampling_params=params):
                counts[which][0][out["output_ids"][1]] += 1
                counts[which][1][out["output_ids"][2]] += 1
                drafted += out["meta_info"].get("spec_draft_token_num", 0)
                kept += out["meta_info"].get("spec_accept_token_num", 0)
    assert drafted >= 400 and kept > 100 and drafted - kept > 100, (drafted, kept)
    for position in (0, 1):
        a, b = counts[0][position], counts[1][position]
        # Tokens seen fewer than 10 times in both samples together pooled into one cell.
        cells: dict[int, tuple[int, int]] = {}
        for t in set(a) | set(b):
            key = t if a[t] + b[t] >= 10 else -1
            x, y = cells.get(key, (0, 0))
            cells[key] = (x + a[t], y + b[t])
        # Two samples of equal size: sum (a - b)^2 / (a + b), chi-square with cells - 1
        # degrees of freedom; its 0.999 quantile by Wilson and Hilferty's approximation.
        chi2 = sum((x - y) ** 2 / (x + y) for x, y in cells.values())
        df = len(cells) - 1
        critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
        assert df >= 1 and chi2 < critical, (position, chi2, critical, a, b)
