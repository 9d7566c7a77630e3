"""The disk tier behind a real server (--enable-hierarchical-cache --hicache-storage-backend
file): a completion's pages land in the folder, a second server over the same folder serves
the prompt from them, and SGLang's /clear_hicache_storage_backend empties it."""

from __future__ import annotations

import json

from serve_helpers import stop_server

PROMPT = list(range(3, 143))  # two blocks of 64 tokens


def _flags(folder) -> tuple[str, ...]:
    extra = json.dumps({"storage_dir": str(folder)})
    return (
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        extra,
    )


def _complete(server) -> dict:
    r = server.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_second_server_reads_the_first_ones_pages(artefact, launch, tmp_path) -> None:
    art = artefact("llama")
    first = launch(art, *_flags(tmp_path))
    out = _complete(first)
    assert out["meta_info"]["cached_tokens"] == 0
    stop_server(first)  # its pages on the way are written as it stops
    kept = list(tmp_path.glob("*/*.kv"))
    assert kept

    second = launch(art, *_flags(tmp_path))
    again = _complete(second)
    assert again["meta_info"]["cached_tokens"] == 128
    assert again["output_ids"] == out["output_ids"]
    info = second.get("/get_server_info").json()["hicache_storage"]
    assert info["blocks_read"] == 2 and info["stored_blocks"] >= len(kept)
    assert second.get("/clear_hicache_storage_backend").status_code == 405  # a page's GET
    assert len(list(tmp_path.glob("*/*.kv"))) == len(kept)
    r = second.post("/clear_hicache_storage_backend")
    assert r.status_code == 200 and r.json()["removed_blocks"] >= len(kept)
    assert list(tmp_path.glob("*/*.kv")) == []
    assert second.post("/clear_hicache_storage_backend").json()["removed_blocks"] == 0
