"""The prefix cache's disk tier (runtime/kv_store.py, --enable-hierarchical-cache
--hicache-storage-backend file): blocks of K/V kept as files are read back into the pool
for a prompt that starts with them (after a restart, after the pool evicted them) and
change no answer; they never reach another model, another tenant or a damaged file's
reader. The tiny models' pages are one token: a block is 64 tokens, 64 pages."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln import Engine
from kiln.args import ArgError
from kiln.runtime.kv_store import MAGIC, StoreError
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = list(range(3, 203))  # 200 tokens: three whole blocks
BLOCK = 64


def _engine(art: Path, folder: Path, **kw) -> Engine:
    extra = {"storage_dir": str(folder), **kw.pop("extra", {})}
    return Engine(
        art,
        max_total_tokens=kw.pop("max_total_tokens", 1024),
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps(extra),
        **kw,
    )


def _run(eng: Engine, prompt: list[int], **params) -> dict:
    out = eng.generate(input_ids=prompt, sampling_params={**GREEDY, **params}, return_logprob=True)
    assert isinstance(out, dict)
    return out


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def reference(artefact) -> dict:
    eng = Engine(artefact("llama"), max_total_tokens=1024, disable_radix_cache=True)
    return _run(eng, PROMPT)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def test_a_restarted_engine_reads_the_pages_back_and_answers_the_same(
    artefact, reference, tmp_path
) -> None:
    art = artefact("llama")
    first = _engine(art, tmp_path)
    out = _run(first, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0
    first.kv_store.flush()
    assert first.kv_store.block_tokens == BLOCK
    # the whole blocks of the prompt once computed, of the request (prompt and output but
    # the last token) when it ended
    assert len(_files(tmp_path)) == (len(PROMPT) + GREEDY["max_new_tokens"] - 1) // BLOCK == 3
    first.shutdown()

    # restarted with another pool size (a server's follows the memory free at start)
    again = _engine(art, tmp_path, max_total_tokens=2048)
    assert again.kv_store.stored_blocks == 3
    out = _run(again, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 3 * BLOCK and again.kv_store.hits == 3
    assert out["output_ids"] == reference["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(reference), abs=1e-4)


def test_pages_are_kept_apart_by_model_and_cache_key(artefact, tmp_path) -> None:
    art = artefact("llama")
    eng = _engine(art, tmp_path)
    _run(eng, PROMPT)
    eng.kv_store.flush()
    eng.shutdown()
    # another tenant's key, on a restarted engine: none of the shared tree's pages
    eng = _engine(art, tmp_path)
    req = _finish(eng, PROMPT, "tenant-b")
    assert req.cached_tokens == 0 and eng.kv_store.hits == 0
    # the same tokens under that key read its own pages once kept
    eng.kv_store.flush()
    again = _engine(art, tmp_path)
    req = _finish(again, PROMPT, "tenant-b")
    assert req.cached_tokens > 0 and again.kv_store.hits > 0
    # other weights of the same architecture in the same folder: nothing of the first's
    other = _engine(artefact("llama", seed=1), tmp_path)
    assert other.kv_store.stored_blocks == 0
    out = _run(other, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0 and other.kv_store.hits == 0


def _finish(eng: Engine, prompt: list[int], cache_key: str) -> Request:
    req = eng.make_request(prompt, SamplingParams(**GREEDY))
    req.cache_key = cache_key
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    return req


def test_new_weights_never_read_the_old_ones_blocks(artefact, tmp_path) -> None:
    """/update_weights_from_disk: the tier's blocks of the old weights are another model's."""
    new_art = artefact("llama", seed=1)
    expect = _run(Engine(new_art, max_total_tokens=1024, disable_radix_cache=True), PROMPT)
    eng = _engine(artefact("llama"), tmp_path)
    _run(eng, PROMPT)
    eng.update_weights(new_art)
    out = _run(eng, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0 and eng.kv_store.hits == 0
    assert out["output_ids"] == expect["output_ids"]
    # what it kept since is the new weights': an engine started on them reads it
    eng.kv_store.flush()
    fresh = _engine(new_art, tmp_path)
    out = _run(fresh, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 3 * BLOCK
    assert out["output_ids"] == expect["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(expect), abs=1e-4)


def test_a_request_named_under_the_old_weights_keeps_its_blocks_under_the_new(
    artefact, tmp_path
) -> None:
    """A request whose block names were computed before /update_weights_from_disk (it was
    waiting): its blocks are named again, so an engine on the new weights finds them."""
    new_art = artefact("llama", seed=1)
    eng = _engine(artefact("llama"), tmp_path)
    req = eng.make_request(PROMPT, SamplingParams(**GREEDY))
    assert eng.kv_store.names(PROMPT[:-1], None, req.page_names) is not None
    stale = list(req.page_names)
    eng.update_weights(new_art)
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    assert req.page_names[:3] != stale
    eng.kv_store.flush()
    fresh = _engine(new_art, tmp_path)
    assert _run(fresh, PROMPT)["meta_info"]["cached_tokens"] == 3 * BLOCK


def test_new_weights_whose_folder_fails_turn_the_tier_off(artefact, tmp_path) -> None:
    """A folder the new identity cannot use (here: made writable by others): the tier
    stops rather than keep serving the old weights' blocks."""
    eng = _engine(artefact("llama"), tmp_path)
    _run(eng, PROMPT)
    eng.kv_store.flush()
    new_art = artefact("llama", seed=1)
    probe = _engine(new_art, tmp_path / "probe")
    (tmp_path / probe.kv_store.folder.name).mkdir(mode=0o777)
    os.chmod(tmp_path / probe.kv_store.folder.name, 0o777)
    eng.update_weights(new_art)
    assert eng.kv_store.off
    out = _run(eng, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0 and eng.kv_store.hits == 0
    eng.shutdown()
    eng.kv_store.close()  # a second close does nothing


def test_a_damaged_page_is_a_miss_and_the_answer_stays_right(artefact, reference, tmp_path):
    art = artefact("llama")
    eng = _engine(art, tmp_path)
    _run(eng, PROMPT)
    eng.kv_store.flush()
    eng.shutdown()
    names = [p.name for p in _files(tmp_path)]
    again = _engine(art, tmp_path)
    chain = again.kv_store.names(PROMPT, None, [])
    assert chain is not None and {n.hex() + ".kv" for n in chain} <= set(names)
    # the second block's header names another block: the first block is read, no more
    second = again.kv_store._path(chain[1])
    data = bytearray(second.read_bytes())
    assert data[:8] == MAGIC
    data[8] ^= 0xFF
    second.write_bytes(bytes(data))
    out = _run(again, PROMPT)
    assert out["meta_info"]["cached_tokens"] == BLOCK
    assert out["output_ids"] == reference["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(reference), abs=1e-4)
    # the first block cut short (on a restarted engine): nothing is read
    again.kv_store.flush()
    first = again.kv_store._path(chain[0])
    first.write_bytes(first.read_bytes()[:-1])
    last = _engine(art, tmp_path)
    out = _run(last, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0 and last.kv_store.hits == 0
    assert out["output_ids"] == reference["output_ids"]


def test_write_back_keeps_what_the_pool_evicts(artefact, reference, tmp_path) -> None:
    art = artefact("llama")
    # a pool of 256 tokens: the second prompt evicts the first's pages
    eng = _engine(art, tmp_path, max_total_tokens=256, hicache_write_policy="write_back")
    _run(eng, PROMPT)
    eng.kv_store.flush()
    assert _files(tmp_path) == []  # nothing written while memory lasts
    _run(eng, list(range(203, 383)))
    eng.kv_store.flush()
    assert len(_files(tmp_path)) > 0
    out = _run(eng, PROMPT)
    assert eng.kv_store.hits > 0 and out["meta_info"]["cached_tokens"] == 3 * BLOCK
    assert out["output_ids"] == reference["output_ids"]
    assert _logprobs(out) == pytest.approx(_logprobs(reference), abs=1e-4)


def test_write_through_selective_keeps_what_is_used_twice(artefact, reference, tmp_path):
    art = artefact("llama")
    eng = _engine(art, tmp_path, hicache_write_policy="write_through_selective")
    _run(eng, PROMPT)
    eng.kv_store.flush()
    assert _files(tmp_path) == []  # used once
    _run(eng, PROMPT)  # found in the prefix cache: its three blocks are kept
    eng.kv_store.flush()
    assert len(_files(tmp_path)) == 3
    again = _engine(art, tmp_path)
    out = _run(again, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 3 * BLOCK
    assert out["output_ids"] == reference["output_ids"]


def test_write_through_selective_keeps_only_the_prefix_found(artefact, reference, tmp_path):
    """A request whose block names reach past what it finds in the tree (a request tried
    before, its names computed for the whole prompt): only the found prefix's blocks are
    kept, and it runs."""
    art = artefact("llama")
    eng = _engine(art, tmp_path, hicache_write_policy="write_through_selective")
    _run(eng, [*PROMPT[:BLOCK], 300, 301, 302])  # the tree holds the first block only
    req = eng.make_request(PROMPT, SamplingParams(**GREEDY))
    assert eng.kv_store.names(PROMPT[:-1], None, req.page_names) is not None
    assert len(req.page_names) == 3
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    assert req.output_ids == reference["output_ids"] and req.cached_tokens == BLOCK
    eng.kv_store.flush()
    assert len(_files(tmp_path)) == 1


def test_the_oldest_pages_go_past_the_capacity(artefact, tmp_path) -> None:
    art = artefact("llama")
    eng = _engine(art, tmp_path)
    store = eng.kv_store
    # room for two blocks
    store.capacity = 2 * (store.block_bytes + 48)
    _run(eng, PROMPT)
    store.flush()
    kept = _files(tmp_path)
    assert len(kept) == 2 and store.evicted >= 1 and store.stored_blocks == 2
    # what the index holds is what the folder holds
    chain = store.names(PROMPT, None, [])
    assert chain is not None
    assert {store._path(n) for n in chain if store.stored([n])} == set(kept)


def test_the_folder_must_be_this_users_own(artefact, tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(StoreError, match="--hicache-storage-backend file: .* writable by no one"):
        _engine(artefact("llama"), shared)
    made = tmp_path / "new"
    _engine(artefact("llama"), made).kv_store.close()
    assert (made.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"extra": {"capacity": 1}}, "takes storage_dir and capacity_gb, not \\['capacity'\\]"),
        ({"extra": {"capacity_gb": -1}}, "capacity_gb must be a positive number"),
        ({"extra": {"storage_dir": ""}}, "storage_dir must be a folder's path"),
    ],
)
def test_bad_settings_are_refused_by_name(artefact, tmp_path, kw, message) -> None:
    with pytest.raises((ArgError, ValueError), match=message):
        _engine(artefact("llama"), tmp_path, **kw)


def test_a_tensor_parallel_artefact_is_refused_before_its_ranks_start(artefact) -> None:
    with pytest.raises(ArgError, match="one rank only .* --tp-size 2"):
        Engine(
            artefact("llama", compile_args={"tp_size": 2}),
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
        )


def test_a_backend_without_the_flag_or_the_prefix_cache_is_refused(artefact) -> None:
    with pytest.raises(ArgError, match="needs --enable-hierarchical-cache"):
        Engine(artefact("llama"), max_total_tokens=256, hicache_storage_backend="file")
    with pytest.raises(ArgError, match="not with --disable-radix-cache"):
        Engine(
            artefact("llama"),
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            disable_radix_cache=True,
        )


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_a_block_comes_back_bit_for_bit_into_any_pages(tmp_path, dtype) -> None:
    """Scattered pages (read through a buffer) and consecutive ones (one readv straight into
    the pool), for a 4- and a 1-byte element type."""
    import numpy as np

    from kiln.runtime.kv_cache import KVCache
    from kiln.runtime.kv_store import KVStore

    kv = KVCache(num_layers=3, num_slots=16 * 16, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert kv.k_host is not None and kv.v_host is not None
    rng = np.random.default_rng(0)
    for pool in (kv.k_host, kv.v_host):
        pool[...] = (
            rng.integers(0, 255, pool.shape, dtype=np.uint8).view(pool.dtype)
            if (pool.dtype.itemsize == 1)
            else rng.standard_normal(pool.shape).astype(pool.dtype)
        )
    store = KVStore(tmp_path, b"m" * 32, kv, page_size=16)
    assert store.block_pages == 4
    names = store.names(list(range(64)), None, [])
    assert names is not None and len(names) == 1
    source = [7, 2, 5, 0]

    def block(pages: list[int]) -> bytes:
        return store._gather(pages)

    store.save(names, source)
    store.flush()
    for target in ([8, 9, 10, 11], [12, 15, 13, 14]):
        assert block(target) != block(source)
        assert store.load(names, target) == 1
        assert block(target) == block(source)


def test_a_stopped_servers_unfinished_writes_go_and_a_running_ones_stay(artefact, tmp_path):
    eng = _engine(artefact("llama"), tmp_path)
    folder = eng.kv_store.folder
    eng.shutdown()
    stale, fresh = folder / "aa.1.tmp", folder / "bb.2.tmp"
    for f in (stale, fresh):
        f.write_bytes(b"half a block")
    os.utime(stale, (0, 0))
    _engine(artefact("llama"), tmp_path).kv_store.close()
    assert not stale.exists() and fresh.exists()
