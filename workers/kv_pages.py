"""The KV cache's pages as the scheduler sees them: which pages each request holds, which full pages are
cached by their content, and how many pages admission can still take. Pure python (no torch, no ray).

A page holds PAGE_SIZE positions of every attention layer's keys and values. KV written causally (a
prefill, a commit) depends only on the token ids up to its position, so a full page is addressed by a
hash chain over the token ids of it and every page before it (`page_hashes`), salted with what else
changes its bits (the model, dtype, quantization). A page is free, held (reference count > 0; a shared
page is read-only: a request writes only past its cached prefix), or cached (count 0, hash kept):
cached pages are evicted least recently used first, and only when a fresh page is needed. The page
tables themselves live on the shards' devices; the scheduler sends them the pages a slot holds.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

# Positions per page. 16, as vLLM's default block: a cache hit is at most 15 tokens short of the shared
# prefix, and the attention kernel reads a page as one contiguous run of keys.
PAGE_SIZE = 16


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes, start: bytes | None = None) -> list[bytes]:
    """The content address of each full page of `tokens`: blake2b of (the previous page's address, the
    page's token ids), the first page's previous address being `start` or blake2b(salt). Deterministic
    across processes (the router and every replica compute the same chain)."""
    parent = start if start is not None else hashlib.blake2b(salt, digest_size=16).digest()
    out = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in page), digest_size=16).digest()
        out.append(parent)
    return out


class PagePool:
    """`num_pages` pages (ids 0 .. num_pages - 1): free, held, or cached (see the module's docstring)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))    # a stack: low ids first
        self._refs = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}               # hash -> its cached (or held) page
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced: oldest first

    @property
    def available(self) -> int:
        """Pages a request can take now: free, or cached and unreferenced (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached(self) -> int:
        """Pages with a content hash (held or not)."""
        return len(self._page_of)

    @property
    def used(self) -> int:
        """Pages some request holds."""
        return self.num_pages - self.available

    def refs(self, page: int) -> int:
        return self._refs[page]

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of leading `hashes` that are cached (held or not): one dict lookup a
        page, never a scan."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """Takes a reference to each of `pages` (cached ones leave the eviction order)."""
        for p in pages:
            assert self._hash_of[p] is not None or self._refs[p] > 0, f"page {p} is free"
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each held once: free ones first, then the least recently used cached ones
        (their content forgotten). The caller checks `available` first."""
        if n > self.available:
            raise RuntimeError(f"{n} pages asked, {self.available} available")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of[p]]
                self._hash_of[p] = None
            self._refs[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops a reference to each of `pages`. One no request holds stays cached if it has a hash (most
        recently used, in the order given: give a request's pages last first, so that its deepest pages,
        which fewer requests share, go first), else is free."""
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released more than held"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._hash_of[p] is not None:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def register(self, page: int, h: bytes) -> int:
        """A held page's content is now final and addressed by `h`. Returns the page that caches `h`: this
        one, or the one that cached it first (this one then stays unhashed, freed when released)."""
        assert self._refs[page] > 0 and self._hash_of[page] is None, page
        cached = self._page_of.get(h)
        if cached is not None:
            return cached
        self._page_of[h] = page
        self._hash_of[page] = h
        return page

    def check(self) -> None:
        """Internal invariants (the tests' leak checks): every page free, held or cached, exactly once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        for p in range(self.num_pages):
            held, hashed = self._refs[p] > 0, self._hash_of[p] is not None
            assert (p in free) == (not held and not hashed), p
            assert (p in self._evictable) == (not held and hashed), p
            if hashed:
                assert self._page_of[self._hash_of[p]] == p, p
        assert len(self._page_of) == sum(h is not None for h in self._hash_of)
