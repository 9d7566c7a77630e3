"""The prefix cache as a data structure: matching, sharing, locking, eviction."""

from __future__ import annotations

from kiln.runtime.kv_cache import PagePool
from kiln.runtime.radix_cache import RadixCache


def filled(pool: PagePool, tokens: list[int]) -> list[int]:
    return pool.allocate(pool.pages_for(len(tokens)))


def test_match_is_page_aligned_and_shares_pages() -> None:
    pool = PagePool(32, 2)
    cache = RadixCache(pool)
    a = list(range(10))
    pages = filled(pool, a)
    assert cache.insert(a, pages) == []
    got, length, _ = cache.match([0, 1, 2, 3, 4, 99, 7])
    assert length == 4 and got == pages[:2]  # [0,1][2,3] match; [4,99] differs
    got, length, _ = cache.match([*a, 10, 11])
    assert length == 10 and got == pages
    assert cache.match([5, 5])[1] == 0


def test_insert_returns_duplicate_pages_to_free() -> None:
    pool = PagePool(32, 2)
    cache = RadixCache(pool)
    a = [1, 2, 3, 4, 5, 6]
    first = filled(pool, a)
    cache.insert(a, first)
    again = filled(pool, a)  # the same tokens computed a second time elsewhere
    assert sorted(cache.insert(a, again)) == sorted(again)
    # Sharing the cached prefix and extending it: only the extension is new.
    pages, _, _ = cache.match(a)
    ext = pages + pool.allocate(1)
    assert cache.insert([*a, 7, 8], ext) == []
    assert cache.cached_pages == 4


def test_locked_nodes_survive_eviction_and_lru_order() -> None:
    pool = PagePool(8, 1)
    cache = RadixCache(pool, "lru")
    a, b = [1, 2, 3], [4, 5, 6]
    cache.insert(a, pool.allocate(3))
    cache.insert(b, pool.allocate(3))
    _, _, node = cache.match(a)  # a is now more recently used than b
    cache.lock(node)
    assert cache.evictable_pages() == 3
    assert cache.evict(10) == 3  # only b can go
    assert cache.match(b)[1] == 0 and cache.match(a)[1] == 3
    cache.unlock(node)
    assert cache.reset() == 3 and pool.free_pages == 8


def test_lfu_keeps_the_frequently_used() -> None:
    pool = PagePool(8, 1)
    cache = RadixCache(pool, "lfu")
    a, b = [1, 2], [3, 4]
    cache.insert(a, pool.allocate(2))
    cache.insert(b, pool.allocate(2))
    for _ in range(3):
        cache.match(a)
    cache.match(b)  # b is the most recent, but a is the most frequent
    cache.evict(2)
    assert cache.match(a)[1] == 2 and cache.match(b)[1] == 0


def test_split_keeps_locks_consistent() -> None:
    pool = PagePool(16, 1)
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], pool.allocate(4))
    _, _, whole = cache.match([1, 2, 3, 4])
    cache.lock(whole)
    _, length, _ = cache.match([1, 2, 9])  # splits the node after two pages
    assert length == 2
    cache.unlock(whole)  # unlocking through the split leaves nothing locked
    assert cache.evictable_pages() == 4


def test_prefix_len_peeks_without_touching_the_tree() -> None:
    pool = PagePool(16, 2)
    cache = RadixCache(pool, "lfu")
    cache.insert([1, 2, 3, 4, 5, 6], pool.allocate(3))
    node = next(iter(cache.root.children.values()))
    before = (node.key, node.hits, node.last_used)
    assert cache.prefix_len([1, 2, 3, 4, 9, 9]) == 4  # two whole pages
    assert cache.prefix_len([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.prefix_len([8, 8]) == 0
    assert (node.key, node.hits, node.last_used) == before  # no split, no use counted
    assert cache.match([1, 2, 3, 4, 9, 9])[1] == 4  # agrees with match


def test_cache_keys_keep_trees_apart() -> None:
    """SGLang's extra_key / cache_salt: the same tokens under another key match nothing,
    under the same key everything; a key's tree locks and evicts as the default one does,
    and goes once empty."""
    pool = PagePool(32, 2)
    cache = RadixCache(pool)
    a = list(range(8))
    salted = filled(pool, a)
    assert cache.insert(a, salted, "tenant-a") == []
    assert cache.match(a)[1] == 0 and cache.prefix_len(a) == 0
    assert cache.match(a, "tenant-b")[1] == 0 and cache.prefix_len(a, "tenant-b") == 0
    pages, length, node = cache.match(a, "tenant-a")
    assert (pages, length) == (salted, 8) and cache.prefix_len(a, "tenant-a") == 8
    plain = filled(pool, a)
    assert cache.insert(a, plain) == []  # its own copy: nothing shared across keys
    assert cache.match(a)[0] == plain and cache.cached_pages == 8
    cache.lock(node)
    assert cache.evict(8) == 4  # only the unkeyed copy: the keyed one is in use
    assert cache.match(a, "tenant-a")[1] == 8
    cache.unlock(node)
    assert cache.reset() == 4 and cache.cached_pages == 0
    assert cache._roots == {}  # the key's emptied tree went with it
