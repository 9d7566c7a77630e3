"""The `kiln` command as a user runs it: real processes, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=300
    )


def test_compile_then_generate(checkpoint, tmp_path, fresh_cache) -> None:
    ckpt = checkpoint("qwen2")
    art = tmp_path / "art"
    first = kiln("compile", "--model", str(ckpt), "--dtype", "float32", "-o", str(art))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("compiled: ")
    again = kiln("compile", "--model-path", str(ckpt), "--dtype", "float32", "-o", str(art))
    assert again.returncode == 0 and again.stdout.startswith("cache hit: ")
    gen = kiln(
        "generate",
        str(art),
        "--prompt",
        "Hello",
        "--prompt",
        "The capital of",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--max-total-tokens",
        "512",
    )
    assert gen.returncode == 0, gen.stderr
    lines = [json.loads(x) for x in gen.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "The capital of"]
    assert all(x["meta_info"]["completion_tokens"] == 6 for x in lines)


def test_errors_are_one_line_naming_the_flag(tmp_path) -> None:
    r = kiln("compile", "-o", str(tmp_path / "a"))
    assert r.returncode == 2
    assert (
        r.stderr.strip() == "kiln compile: error: --model-path: required "
        "(the Hugging Face checkpoint folder)"
    )
    r = kiln("compile", "--model", str(tmp_path), "--page-size", "0", "-o", str(tmp_path / "a"))
    assert r.returncode == 2 and "--page-size: must be > 0, got 0" in r.stderr
    r = kiln("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "has no manifest.json: not a kiln artefact" in r.stderr
    assert "Traceback" not in r.stderr
    r = kiln("compile", "--model", str(tmp_path), "--dtype", "int3", "-o", str(tmp_path / "a"))
    assert r.returncode == 2 and "--dtype" in r.stderr


def test_yaml_config_and_compile_time_mismatch(checkpoint, tmp_path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model-path: {checkpoint('llama')}\ndtype: float32\npage_size: 4\n")
    art = tmp_path / "art"
    r = kiln("compile", "--config", str(cfg), "--page-size", "2", "-o", str(art))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["compile_args"]["page_size"] == 2  # the command line beat the YAML
    r = kiln("generate", str(art), "--prompt", "x", "--page-size", "4")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "kiln generate: error: --page-size: 4 disagrees with the artefact, compiled with 2 "
        "(compile-time argument: recompile to change it)"
    )
    r = kiln("compile", "--config", str(cfg), "--pp-size", "2", "-o", str(art))
    assert r.returncode == 2 and "--pipeline-parallel-size 2: is not implemented" in r.stderr


def test_version_and_usage_errors_do_not_load_torch() -> None:
    code = (
        "import sys, contextlib\n"
        "from kiln.cli import main\n"
        "for argv in (['--version'], ['compile', '--modle-path', 'x', '-o', 'y']):\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == ["kiln 0.1.0", "False"], r.stdout + r.stderr


def test_typos_get_a_short_usage_and_a_suggestion(tmp_path) -> None:
    r = kiln("compile", "--modle-path", "ckpt", "-o", str(tmp_path / "a"))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "usage: kiln compile [options]  (kiln compile --help)",
        "kiln compile: error: unrecognized arguments: --modle-path ckpt "
        "(did you mean --model-path?)",
    ]
    r = kiln("compiel", "--model-path", "ckpt")
    assert r.returncode == 2 and "(did you mean compile?)" in r.stderr
    assert len(r.stderr.splitlines()) == 2


def test_generate_prints_prompt_and_completion_apart(artefact) -> None:
    r = kiln(
        "generate",
        str(artefact("llama")),
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--max-total-tokens",
        "256",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Prompt: 'Hello'" and lines[1].startswith("Generated: '")
