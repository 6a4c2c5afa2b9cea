"""workers/kv_pages.py: the page pool's states (free, held, cached), content addresses, LRU eviction that
never takes a held page, and lookups that cost a dict access a page."""
import random
import time

import pytest

from workers.kv_pages import PagePool, page_hashes

SALT = b"model|bfloat16|none"


def test_a_page_address_depends_on_every_token_up_to_its_end_and_on_the_salt():
    a = page_hashes(list(range(40)), 16, SALT)
    assert len(a) == 2   # full pages only
    assert page_hashes(list(range(32)), 16, SALT) == a
    b = page_hashes([99] + list(range(1, 40)), 16, SALT)   # a change in page 0 changes every later address
    assert b[0] != a[0] and b[1] != a[1]
    c = page_hashes(list(range(16)) + [0] + list(range(17, 40)), 16, SALT)   # a change in page 1 only
    assert c[0] == a[0] and c[1] != a[1]
    assert page_hashes(list(range(40)), 16, b"other")[0] != a[0]
    # continuing a chain from its last address gives the same addresses as hashing the whole
    assert page_hashes(list(range(16, 32)), 16, SALT, start=a[0]) == a[1:]
    assert page_hashes([2**31 + 5] * 16, 16, SALT) != page_hashes([5] * 16, 16, SALT)


def test_held_cached_and_free_pages():
    pool = PagePool(4)
    pages = pool.allocate(3)
    assert sorted(pages) == [0, 1, 2] and pool.available == 1 and pool.used == 3
    h = page_hashes(list(range(32)), 16, SALT)
    assert pool.register(pages[0], h[0]) == pages[0] and pool.register(pages[1], h[1]) == pages[1]
    assert pool.lookup(h) == pages[:2]
    other = page_hashes([7] + list(range(1, 32)), 16, SALT)   # page 1's tokens, another page 0
    assert pool.lookup(other) == []
    pool.release(pages[::-1])
    pool.check()
    assert pool.available == 4 and pool.cached == 2
    again = pool.lookup(h)
    pool.acquire(again)                 # a hit takes the cached pages back: they are no longer evictable
    assert pool.available == 2 and pool.refs(pages[0]) == 1
    pool.acquire(again[:1])             # shared by a second request
    assert pool.refs(pages[0]) == 2
    pool.release(again + again[:1])
    pool.check()


def test_eviction_takes_the_least_recently_released_cached_page_never_a_held_one():
    pool = PagePool(3)
    a, b, c = pool.allocate(3)
    ha, hb, hc = (bytes([i]) * 16 for i in range(3))
    for page, h in ((a, ha), (b, hb), (c, hc)):
        pool.register(page, h)
    pool.release([b])
    pool.release([a])                   # released after b: b is the least recently used
    (fresh,) = pool.allocate(1)
    assert fresh == b and pool.lookup([hb]) == [] and pool.lookup([ha]) == [a]
    with pytest.raises(RuntimeError):   # c is held, a is the only evictable page
        pool.allocate(2)
    pool.check()


def test_registering_content_another_page_already_caches_keeps_the_first():
    pool = PagePool(2)
    first, second = pool.allocate(2)
    h = b"x" * 16
    assert pool.register(first, h) == first
    assert pool.register(second, h) == first     # the same prefix computed twice (two cold requests at once)
    pool.release([second])                       # unhashed: free at once
    assert pool.available == 1 and pool.lookup([h]) == [first]
    pool.check()


def test_random_use_never_leaks_a_page():
    rng = random.Random(0)
    pool = PagePool(64)
    held: list[list[int]] = []
    for step in range(3000):
        if held and (rng.random() < 0.45 or pool.available == 0):
            pages = held.pop(rng.randrange(len(held)))
            pool.release(pages[::-1])
        else:
            tokens = [rng.randrange(4) for _ in range(16 * rng.randrange(1, 6))]
            hashes = page_hashes(tokens, 16, SALT)
            hit = pool.lookup(hashes)
            pool.acquire(hit)
            n = min(len(hashes) - len(hit), pool.available)
            fresh = pool.allocate(n)
            for page, h in zip(fresh, hashes[len(hit):]):
                pool.register(page, h)
            held.append(hit + fresh)
        if step % 100 == 0:
            pool.check()
    for pages in held:
        pool.release(pages)
    pool.check()
    assert pool.available == pool.num_pages


def test_a_lookup_costs_a_dict_access_a_page_with_many_pages_cached():
    """10k cached pages: a 4k-token prompt's lookup (256 pages, hashing included) in well under a
    millisecond a page; the cost does not grow with what is cached."""
    pool = PagePool(10_000)
    rng = random.Random(1)
    for _ in range(40):   # 40 distinct 250-page prompts cached
        tokens = [rng.randrange(50_000) for _ in range(250 * 16)]
        hashes = page_hashes(tokens, 16, SALT)
        pages = pool.allocate(len(hashes))
        for p, h in zip(pages, hashes):
            pool.register(p, h)
        pool.release(pages[::-1])
    assert pool.cached == 10_000
    prompt = tokens[: 4096]
    begin = time.perf_counter()
    for _ in range(20):
        hit = pool.lookup(page_hashes(prompt, 16, SALT))
    per_page = (time.perf_counter() - begin) / 20 / 256
    assert len(hit) == 250 and per_page < 50e-6, per_page
