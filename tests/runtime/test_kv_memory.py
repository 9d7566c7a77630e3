"""KV memory goes back to the OS when its pages fall free (issue 23, item 13): after a soak
the server's RSS stayed where the busiest moment left it, /flush_cache included."""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

from kiln import Engine
from kiln.runtime.kv_cache import KVCache, PagePool


def resident(t: torch.Tensor) -> int:
    """Bytes of `t`'s memory that are in RAM: its pages' present bits in /proc/self/pagemap
    (8 bytes a page; bit 63 says present), exact whatever else shares the mapping."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    count = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) - first
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"<{count}Q", f.read(count * 8))
    return sum(e >> 63 for e in entries) * page


def test_released_pages_leave_ram_and_read_as_zeros() -> None:
    pool = PagePool(256, 16)
    kv = KVCache(2, (256 + 1) * 16, 2, 64, torch.float32)  # 4 KiB per page per layer-head
    pages = pool.allocate(256)
    kv.k.fill_(1.0)
    kv.v.fill_(1.0)
    full = resident(kv.k)
    assert full >= kv.k.numel() * 4 * 0.9
    pool.free(pages[:64])
    pool.free(pages[128:])
    released, rest = kv.release(pool.take_freed(), pool.page_size)
    assert rest == []
    assert released >= 2 * 192 * 16 * 64 * 4 * 4 * 0.9  # K and V, 192 pages, 2x2 layer-heads
    assert resident(kv.k) < full / 2
    slots = kv.k[:, :, : 256 * 16].reshape(2, 2, 256, 16, 64)
    assert (slots[:, :, pages[:64]] == 0).all() and (slots[:, :, pages[128:]] == 0).all()
    assert (slots[:, :, pages[64:128]] == 1).all()  # pages still in use are untouched
    assert pool.take_freed() == []


def test_a_release_out_of_time_hands_back_the_rest() -> None:
    pool = PagePool(64, 16)
    kv = KVCache(1, 65 * 16, 1, 64, torch.float32)
    pages = pool.allocate(64)
    pool.free(pages[::2])  # 32 runs of one page
    released, rest = kv.release(pool.take_freed(), pool.page_size, budget_s=0.0)
    assert released == 0 and rest == sorted(pages[::2])
    pool.put_back_freed(rest)
    assert pool.take_freed() == rest


def test_a_page_taken_again_is_not_released() -> None:
    pool = PagePool(8, 4)
    pages = pool.allocate(8)
    pool.free(pages)
    again = pool.allocate(3)
    assert pool.take_freed() == sorted(set(pages) - set(again))


@pytest.fixture(scope="module")
def wide(artefact):
    # Head size 64, 4 KV heads, pages of 16 tokens: one page of one layer's head is 4 KiB.
    return artefact(
        "llama",
        compile_args={"page_size": 16},
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    )


def test_the_engine_gives_memory_back_when_idle_and_on_flush(wide) -> None:
    params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    prompts = [[(7 * i + j) % 300 + 3 for j in range(1000)] for i in range(3)]
    for radix in (False, True):
        engine = Engine(wide, max_total_tokens=16 * 256, disable_radix_cache=not radix)
        k = engine.runner.kv.k
        engine.generate(input_ids=prompts, sampling_params=params)
        used = 3 * 1008 * 2 * 4 * 64 * 4  # tokens x layers x heads x head size x 4 bytes (K)
        if radix:  # the prefix cache keeps what it cached until it is flushed
            assert resident(k) >= used * 0.8
            assert engine.flush_cache() > 0
        assert resident(k) < used * 0.2, (radix, resident(k), used)
        engine.shutdown()
