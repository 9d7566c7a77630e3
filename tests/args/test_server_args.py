"""ServerArgs: the tree, YAML + CLI precedence, validation, status, help and docs."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from kiln.args import FLAGS, SECTIONS, ArgError, ServerArgs, add_cli_args
from kiln.args.docs import DOC, render


def cli(*argv: str) -> ServerArgs:
    return ServerArgs.from_cli(list(argv))


def test_tree_is_frozen_with_flat_access() -> None:
    args = cli("--model", "ckpt", "--page-size", "4")
    assert args.page_size == 4 and args.memory_and_scheduling.page_size == 4
    assert dataclasses.is_dataclass(args.memory_and_scheduling)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.page_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.memory_and_scheduling.page_size = 8  # type: ignore[misc]
    changed = args.replace(page_size=16)
    assert changed.page_size == 16 and args.page_size == 4
    with pytest.raises(ArgError, match="--page-size: must be > 0"):
        args.replace(page_size=0)
    assert repr(args) == "ServerArgs(model_path='ckpt', page_size=4)"
    with pytest.raises(ArgError, match="unknown argument 'nope'"):
        ServerArgs(nope=1)


def test_yaml_either_spelling_and_cli_wins(tmp_path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "model-path: ./ckpt\ntensor-parallel-size: 1\npage_size: 4\n"
        "max-running-requests: 8\ntrust-remote-code: true\nmem_fraction_static: 0.5\n"
    )
    args = cli("--config", str(cfg), "--page-size", "16")
    assert args.model_path == "./ckpt" and args.tp_size == 1
    assert args.page_size == 16  # the command line beats the file
    assert args.max_running_requests == 8 and args.mem_fraction_static == 0.5
    assert args.trust_remote_code is True


@pytest.mark.parametrize(
    "text, message",
    [
        ("bogus-key: 1\n", "unknown key 'bogus-key'"),
        ("page-size: four\n", "--page-size: expected int, got 'four'"),
        ("page-size: 1\npage_size: 2\n", "sets --page-size twice"),
        ("- a\n- b\n", "must hold a mapping"),
        ("config: other.yaml\n", "cannot name another config file"),
        ("model-path: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_yaml_is_a_clear_error(tmp_path, text, message) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ArgError, match=message):
        cli("--config", str(cfg))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--page-size", "0"], "--page-size: must be > 0, got 0"),
        (["--max-stored-response-bytes", "-1"], "--max-stored-response-bytes: must be >= 0"),
        (["--max-session-tokens", "-1"], "--max-session-tokens: must be >= 0"),
        (["--mem-fraction-static", "1.5"], r"--mem-fraction-static: must be in \(0, 1\]"),
        (["--swa-full-tokens-ratio", "2"], r"--swa-full-tokens-ratio: must be in \[0, 1\]"),
        (["--port", "70000"], "--port: must be a port in 1..65535"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size: must be -1 \\(off\\) or > 0"),
        (["--log-level", "loud"], "--log-level: 'loud' is not one of"),
        (["--nnodes", "2", "--node-rank", "2"], r"--node-rank: must be in \[0, --nnodes=2\)"),
        (
            ["--max-loaded-loras", "2", "--max-loras-per-batch", "4"],
            r"--max-loaded-loras \(2\) must be >= --max-loras-per-batch \(4\)",
        ),
        (
            ["--enable-dp-attention", "--dp", "2"],
            r"--enable-dp-attention: needs --dp-size equal to --tp-size \(got dp 2, tp 1\)",
        ),
        (
            ["--load-balance-method", "minimum_tokens"],
            "minimum_tokens: needs --enable-dp-attention",
        ),
        (["--schedule-low-priority-values-first"], "only with --enable-priority-scheduling"),
        (["--max-lora-chunk-size", "32"], "only used with --lora-backend csgmv"),
        (["--dynamic-batch-tokenizer-batch-size", "4"], "only with --enable-dynamic-batch"),
        (["--speculative-num-steps", "3"], "--speculative-num-steps: only with --speculative-alg"),
        (
            ["--enable-mixed-chunk", "--chunked-prefill-size", "-1"],
            "--enable-mixed-chunk: needs chu",
        ),
    ],
)
def test_validation_rules(argv, message) -> None:
    with pytest.raises(ArgError, match=message):
        cli(*argv)


def test_choices_are_checked_for_python_callers_too() -> None:
    with pytest.raises(ArgError, match="--dtype: 'int3' is not one of auto, half"):
        ServerArgs(dtype="int3")
    with pytest.raises(ArgError, match="--page-size: expected int, got '4'"):
        ServerArgs(page_size="4")


def test_support_status() -> None:
    # A planned flag is accepted at its default, refused otherwise, never ignored.
    assert cli("--tokenizer-mode", "auto", "--pp-size", "1").pp_size == 1
    with pytest.raises(
        ArgError,
        match=r"--pipeline-parallel-size 2: is not implemented in kiln "
        r"yet \(leave it at its default, 1\)",
    ):
        cli("--pp-size", "2")
    assert cli("--tp", "2").tp_size == 2  # implemented: a compiler pass
    with pytest.raises(ArgError, match="--lora-backend csgmv: is not implemented in kiln yet"):
        cli("--enable-lora", "--lora-backend", "csgmv")
    with pytest.raises(ArgError, match=r"--enable-dp-attention: is not implemented in"):
        cli("--enable-dp-attention")
    with pytest.raises(ArgError, match=r"--piecewise-cuda-graph-compiler inductor: is not impl"):
        cli("--piecewise-cuda-graph-compiler", "inductor")
    # Hardware this machine lacks is named.
    with pytest.raises(ArgError, match=r"--attention-backend fa3: needs an NVIDIA Hopper GPU"):
        cli("--attention-backend", "fa3")
    # Compiling for cuda needs no GPU (a CPU CI machine builds for a GPU fleet).
    assert cli("--device", "cuda", "--target-isa", "sm_90").device == "cuda"
    assert cli("--attention-backend", "torch_native").attention_backend == "torch_native"
    assert cli("--load-format", "dummy").load_format == "dummy"
    with pytest.raises(ArgError, match="--load-format npcache: is not implemented"):
        cli("--load-format", "npcache")
    # Structured output, tools and reasoning (issue 25): what is built runs, the rest is
    # refused by name.
    args = cli("--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1")
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen25", "deepseek-r1")
    assert cli("--tool-call-parser", "step3").tool_call_parser == "step3"
    assert cli("--grammar-backend", "outlines").grammar_backend == "outlines"
    with pytest.raises(ArgError, match="--schedule-policy dfs-weight: is not implemented in"):
        cli("--schedule-policy", "dfs-weight")


def test_deprecated_flags_print_the_advice(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.args"):
        args = cli("--enable-ep-moe")
    assert "--enable-ep-moe is deprecated: set --ep-size to the same value as --tp-size" in (
        caplog.text
    )
    assert args.ep_size == args.tp_size == 1
    with pytest.raises(ArgError, match=r"--moe-a2a-backend deepep \(set by --enable-deepep-moe\)"):
        cli("--enable-deepep-moe")


def test_lora_paths_turn_lora_on() -> None:
    args = cli("--lora-paths", "a=/x", "b=/y", "--lora-target-modules", "q_proj", "v_proj")
    assert args.enable_lora and args.lora_paths == ("a=/x", "b=/y")
    assert args.lora_target_modules == ("q_proj", "v_proj")
    with pytest.raises(ArgError, match="--lora-target-modules: 'lm_head' is not one of"):
        ServerArgs(lora_target_modules=("lm_head",))


def test_help_is_grouped_by_section() -> None:
    parser = argparse.ArgumentParser(prog="kiln compile", argument_default=argparse.SUPPRESS)
    add_cli_args(parser)
    text = parser.format_help()
    positions = [text.index(f"\n{s.title}:\n") for s in SECTIONS]
    assert positions == sorted(positions)
    memory = text[text.index("\nMemory and scheduling:\n") : text.index("\nRuntime options:\n")]
    assert "--page-size" in memory and "--max-total-tokens" in memory and "[compile]" in memory


def test_stage_of_every_flag_is_set() -> None:
    stages = {f.stage for f in FLAGS.values()}
    assert stages == {"compile", "runtime"}
    for dest in (
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "tp_size",
        "ep_size",
        "pp_size",
        "attention_backend",
        "page_size",
        "cuda_graph_bs",
        "enable_torch_compile",
    ):
        assert FLAGS[dest].stage == "compile", dest
    for dest in ("host", "port", "api_key", "max_running_requests", "log_level", "schedule_policy"):
        assert FLAGS[dest].stage == "runtime", dest


def test_generated_docs_are_in_sync() -> None:
    assert DOC.read_text() == render(), "run: python -m kiln.args.docs"


def test_readme_states_the_implemented_count() -> None:
    from kiln.args.docs import counts

    readme = (DOC.parents[1] / "README.md").read_text()
    assert f"{counts()[0]} arguments are implemented today" in readme


def test_token_histogram_bucket_rules() -> None:
    """SGLang's rules for --prompt-tokens-buckets / --generation-tokens-buckets, its own
    example for tse; a rule that is none of them is a one-line error naming the flag."""
    from kiln.args import token_buckets

    tse = [984.0, 992.0, 996.0, 998.0, 1000.0, 1002.0, 1004.0, 1008.0, 1016.0]
    assert token_buckets("--prompt-tokens-buckets", ["tse", "1000", "2", "8"]) == tse
    assert token_buckets("--prompt-tokens-buckets", ["custom", "50", "10", "10"]) == [10, 50]
    assert token_buckets("--prompt-tokens-buckets", None)[:3] == [100, 300, 500]
    assert cli("--collect-tokens-histogram", "--prompt-tokens-buckets", "tse", "9", "3", "2")
    for bad in (["tse", "1000", "1", "8"], ["custom"], ["linear", "1"], ["custom", "x"]):
        with pytest.raises(ArgError, match="--generation-tokens-buckets: 'default', 'tse"):
            cli("--generation-tokens-buckets", *bad)


def test_flags_that_would_run_foreign_code_are_refused_by_design() -> None:
    """Not planned: refused, saying why, so no one waits for them."""
    for flag, value in (
        ("--enable-custom-logit-processor", None),
        ("--forward-hooks", '{"name": "x"}'),
        ("--custom-weight-loader", "pkg.loader"),
    ):
        with pytest.raises(ArgError, match=f"{flag}.*: is refused by kiln: "):
            cli(flag) if value is None else cli(flag, value)
    assert FLAGS["forward_hooks"].status.label.startswith("refused: ")


def test_model_impl_names_kilns_own_definitions() -> None:
    """--model-impl: auto and sglang are kiln's own model definitions (what SGLang's are to
    SGLang); transformers is refused by name, an unknown value as not a choice."""
    assert cli("--model-impl", "sglang").model_impl == "sglang"
    with pytest.raises(ArgError, match="--model-impl transformers: is not implemented"):
        cli("--model-impl", "transformers")
    with pytest.raises(ArgError, match="--model-impl: 'vllm' is not one of auto, sglang"):
        ServerArgs(model_impl="vllm")  # a YAML config's value (the command line: argparse's)


def test_flags_that_ask_for_what_kiln_does_are_accepted() -> None:
    """--sleep-on-idle (kiln's engine thread always sleeps when idle) and
    --disable-overlap-schedule (kiln does not overlap steps) are accepted, not refused."""
    args = cli("--sleep-on-idle", "--disable-overlap-schedule")
    assert args.sleep_on_idle and args.disable_overlap_schedule
