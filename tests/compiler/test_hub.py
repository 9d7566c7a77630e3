"""Checkpoints named by their Hugging Face Hub id (compiler/hub.py), through the Hub
library's own cache: a cache laid out as the Hub writes it, read with HF_HUB_OFFLINE=1 (no
network here). The id compiles as the same content's local folder does: one cache entry,
served under the id; a revision or a repository the cache lacks is a one-line error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kiln.args import ArgError, ServerArgs
from kiln.args.stages import refuse_compile_time_changes
from kiln.compiler.compile import compile_model
from kiln.compiler.hub import hub_name, is_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(checkpoint, tmp_path):
    repo = tmp_path / "hub" / "models--kiln-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(checkpoint("llama"), repo / "snapshots" / COMMIT)
    return tmp_path / "hub"


def kiln(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kiln", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_a_hub_id_compiles_from_the_hub_cache(hub_cache, checkpoint, tmp_path, fresh_cache):
    out = kiln("compile", "--model", "kiln-test/tiny-llama", "--download-dir", str(hub_cache),
               "--dtype", "float32", "-o", str(tmp_path / "art"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["runtime"]["served_model_name"] == "kiln-test/tiny-llama"
    assert manifest["compile_args"]["model_path"] == "kiln-test/tiny-llama"
    # `kiln launch --model-path ID` serves what it compiled: the id agrees with the artefact
    refuse_compile_time_changes({"model_path": "kiln-test/tiny-llama"}, manifest)
    with pytest.raises(ArgError, match="--model-path: 'kiln-test/other' disagrees"):
        refuse_compile_time_changes({"model_path": "kiln-test/other"}, manifest)
    # the same files from a folder: the same entry (contents, not names, are the key)
    local = compile_model(ServerArgs(model_path=str(checkpoint("llama")), dtype="float32"))
    assert local.cache_hit and local.cache_key == manifest["cache_key"]
    missing = kiln("compile", "--model", "kiln-test/tiny-llama", "--revision", "v2",
                   "--download-dir", str(hub_cache), "-o", str(tmp_path / "v2"))  # fmt: skip
    assert missing.returncode != 0 and not (tmp_path / "v2").exists()
    [line] = [ln for ln in missing.stderr.splitlines() if "error" in ln]
    assert "--model-path: kiln-test/tiny-llama is not a path here" in line
    assert "at revision v2" in line


def test_what_names_a_repository() -> None:
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id("gpt2")
    for path in ("./model", "/abs/model", "../up", "a/b/c", "model.gguf", "~/m", "a/../b"):
        assert not is_repo_id(path), path
    assert hub_name(f"/c/models--Qwen--Qwen2.5-0.5B/snapshots/{COMMIT}") == "Qwen/Qwen2.5-0.5B"
    assert hub_name("/models/Qwen2.5-0.5B") is None
    with pytest.raises(ArgError, match="--model-path: nowhere/at-all is not a path here"):
        compile_model(ServerArgs(model_path="nowhere/at-all", download_dir="/nonexistent"))
