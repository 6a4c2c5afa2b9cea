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


# ---- KVPages: requests, reservations, sliding windows ---------------------------------------------

from workers.kv_pages import KVPages, PageGroup  # noqa: E402


def test_a_prompts_cached_pages_are_shared_and_the_rest_reserved():
    kv = KVPages([PageGroup(16)], 4, SALT)
    prompt = list(range(10))                    # 2 full pages and 2 tokens
    a = kv.admit("a", prompt, positions=18, ahead=8)
    assert a.cached_tokens == 0 and a.groups[0].reserved == 5 and kv.reserved == [5]
    kv.extend("a", end=10, known=0)
    assert kv.changes("a") == [(0, 0, a.groups[0].table)] and len(a.groups[0].table) == 3
    kv.register("a", prompt, written=10)        # its prefill wrote positions 0..9: pages 0 and 1 are full
    b = kv.admit("b", prompt + [99], positions=19, ahead=8)
    assert b.cached_tokens == 8 and b.groups[0].table == a.groups[0].table[:2]   # shared, read-only
    # its first tables sent to the shards hold the cached pages too (the slot's old table is gone)
    kv.extend("b", end=11, known=8)
    (group, first, table), = kv.changes("b")
    assert (group, first, table[:2]) == (0, 0, a.groups[0].table[:2]) and len(table) == 3
    kv.extend("b", end=11, known=8)
    assert kv.changes("b") == []   # nothing new: nothing sent
    assert kv.hits == 8 and kv.queries == 21
    # a prompt of exactly its cached pages recomputes its last page (its prediction needs its last token)
    c = kv.admit("c", prompt[:8], positions=12, ahead=4)
    assert c.cached_tokens == 4
    kv.check()
    for r in ("a", "b", "c"):
        kv.free(r)
    kv.check()
    assert kv.pools[0].available == 16 and kv.reserved == [0] and kv.pools[0].cached == 2


def test_admission_waits_for_pages_and_never_overcommits():
    kv = KVPages([PageGroup(6)], 4, SALT)
    assert kv.admit("a", [1, 2, 3], positions=16, ahead=4) is not None   # 4 pages reserved
    assert kv.admit("b", [4, 5, 6], positions=12, ahead=4) is None       # 3 more do not fit in 6
    assert kv.admit("c", [7], positions=8, ahead=4) is not None          # 2 do
    assert not kv.fits_ever(positions=28, ahead=4) and kv.fits_ever(positions=24, ahead=4)
    kv.free("a")
    assert kv.admit("b", [4, 5, 6], positions=12, ahead=4) is not None
    kv.check()


def test_a_sliding_group_holds_a_window_and_lets_go_behind_it():
    W, P = 8, 4
    kv = KVPages([PageGroup(64), PageGroup(12, window=W)], P, SALT)
    prompt = list(range(1, 13))
    r = kv.admit("r", prompt, positions=60, ahead=8)
    full, sliding = r.groups
    assert kv.pages_for(60, 8)[1] == 2 + 2 + 2 and sliding.reserved == 6
    kv.extend("r", end=12, known=0)
    kv.register("r", prompt, written=12)
    for known in range(12, 52, 4):              # committing 4 positions at a time
        kv.extend("r", end=known + 8, known=known)
        held = [p for p in sliding.table if p is not None]
        first = sliding.table.index(held[0])
        assert first == max(known - W + 1, 0) // P and len(held) <= 6   # exactly what queries from `known` read
        kv.check()
    assert len([p for p in full.table if p is not None]) == 14          # the full group keeps every page (to 56)
    kv.free("r")
    kv.check()


def test_a_sliding_hit_needs_the_pages_of_its_window():
    W, P = 8, 4
    kv = KVPages([PageGroup(64), PageGroup(64, window=W)], P, SALT)
    prompt = list(range(1, 30))
    kv.admit("a", prompt, positions=32, ahead=32)
    kv.extend("a", end=29, known=0)
    kv.register("a", prompt, written=29)
    kv.extend("a", end=29, known=29)   # its sliding pages before 29 - W + 1 = 22 go (5 of them), cached
    kv.free("a")
    b = kv.admit("b", prompt + [7], positions=40, ahead=16)
    assert b.cached_tokens == 28      # 7 full pages; the window before position 28 is pages 5 and 6
    assert b.groups[1].table[:5] == [None] * 5 and None not in b.groups[1].table[5:7]
    kv.check()
    # evict the window's last page from the sliding cache: the hit falls back to where a window is whole
    kv.free("b")
    pool = kv.pools[1]
    page6 = pool.page_of(page_hashes(prompt, P, SALT)[6])
    pool.acquire([page6])
    pool._hash_of[page6], pool._page_of = None, {h: p for h, p in pool._page_of.items() if p != page6}
    pool.release([page6])
    c = kv.admit("c", prompt + [7], positions=40, ahead=16)
    assert c.cached_tokens == 24
    kv.check()


def test_random_requests_sharing_prefixes_never_leak_or_overcommit():
    """Requests with shared prefixes in both kinds of group, admitted, extended, registered and freed in
    random order: every invariant holds after every operation, and the pool is whole at the end."""
    rng = random.Random(3)
    P, W = 4, 10
    kv = KVPages([PageGroup(80), PageGroup(40, window=W)], P, SALT)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    live: dict[str, dict] = {}
    for step in range(2500):
        op = rng.random()
        if op < 0.3 and len(live) < 8:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            positions = len(prompt) + rng.randrange(1, 40)
            ahead = 12
            if kv.admit(rid, prompt, positions, max(ahead, len(prompt))) is not None:
                kv.extend(rid, end=len(prompt), known=kv.requests[rid].cached_tokens)
                kv.register(rid, prompt, written=len(prompt))
                live[rid] = dict(tokens=list(prompt), positions=positions, ahead=max(ahead, len(prompt)))
        elif op < 0.8 and live:
            rid = rng.choice(sorted(live))
            r = live[rid]
            known = len(r["tokens"])
            if known < r["positions"]:
                grow = min(rng.randrange(1, 6), r["positions"] - known)
                kv.extend(rid, end=min(known + r["ahead"], r["positions"]), known=known)
                r["tokens"] += [rng.randrange(50) for _ in range(grow)]
                kv.register(rid, r["tokens"], written=len(r["tokens"]))
        elif live:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        kv.check()
    for rid in list(live):
        kv.free(rid)
    kv.check()
    assert [p.available for p in kv.pools] == [80, 40] and kv.reserved == [0, 0]
    assert kv.hits > 0


def test_a_shared_prefix_counts_once_against_a_full_pool():
    """Two requests of one 25-token prompt in a pool of 10 pages of 4: the second reserves only what it
    does not share (its prompt's 6 full pages are the first's), so both fit where two copies would not."""
    kv = KVPages([PageGroup(10)], 4, SALT)
    prompt = list(range(25))
    kv.admit("a", prompt, positions=28, ahead=4)
    kv.extend("a", end=25, known=0)
    kv.register("a", prompt, written=25)
    b = kv.admit("b", prompt, positions=28, ahead=4)
    assert b is not None and b.cached_tokens == 24 and b.groups[0].reserved == 1
    kv.extend("b", end=28, known=24)
    kv.free("a")               # the shared pages stay, b holds them
    kv.check()
    assert kv.pools[0].used == 7 and kv.reserved == [0]
    kv.free("b")
    kv.check()
