"""The KV cache's pages as the scheduler sees them: which pages each request holds, which full pages are
cached by their content, and how many pages admission can still take. Pure python (no torch, no ray).

A page holds model.protocol.PAGE_SIZE positions of every attention layer's keys and values. KV written causally (a
prefill, a commit) depends only on the token ids up to its position, so a full page is addressed by a
hash chain over the token ids of it and every page before it (`page_hashes`), salted with what else
changes its bits (the model, dtype, quantization). A page is free, held (reference count > 0; a shared
page is read-only: a request writes only past its cached prefix), or cached (count 0, hash kept):
cached pages are evicted least recently used first, and only when a fresh page is needed. The page
tables themselves live on the shards' devices; the scheduler sends them the pages a slot holds.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from model.kv_budget import sliding_pages


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes, start: bytes | None = None) -> list[bytes]:
    """The content address of each full page of `tokens`: blake2b of (the previous page's address, the
    page's token ids), the first page's previous address being `start` or blake2b(salt). Deterministic
    across processes (the router and every replica compute the same chain)."""
    parent = start if start is not None else hashlib.blake2b(salt, digest_size=16).digest()
    n = len(tokens) // page_size
    ids = array("I", tokens[: n * page_size])   # each id as 4 bytes, little-endian: one conversion a prompt
    if sys.byteorder == "big":
        ids.byteswap()
    data, width = ids.tobytes(), 4 * page_size
    out = []
    for i in range(n):
        parent = hashlib.blake2b(parent + data[i * width:(i + 1) * width], digest_size=16).digest()
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

    def addresses(self, limit: int) -> list[bytes]:
        """Up to `limit` cached pages' addresses: those some request holds, then the most recently used of
        the rest (what a router asks of this pool)."""
        held = [h for h, p in self._page_of.items() if self._refs[p] > 0]
        recent = [self._hash_of[p] for p in reversed(self._evictable)]
        return (held + recent)[:limit]

    def page_of(self, h: bytes) -> int | None:
        """The page caching `h`, if any."""
        return self._page_of.get(h)

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



@dataclass(frozen=True)
class PageGroup:
    """Layers that share page tables: every full-attention layer (window None), or every sliding-window
    layer (a query sees `window` positions up to its own; pages wholly before that are released)."""

    num_pages: int
    window: int | None = None

    def window_pages(self, page_size: int) -> int:
        """Pages before a position that its queries can read (a sliding group's; 0: every page)."""
        return 0 if self.window is None else -(-(self.window - 1) // page_size)


@dataclass
class Held:
    """What one request holds in one group: its page table from page 0 (None: released, or never held:
    the shards read the sink there) and how many more pages it may take (its reservation)."""

    table: list[int | None] = field(default_factory=list)
    reserved: int = 0
    sent: int = 0            # the leading entries the shards' page table has (a new request's: none)
    changed: int | None = None   # the lowest entry changed since they were sent


@dataclass
class RequestPages:
    """A request's pages in every group, and the token ids their KV is of (prompt, then committed)."""

    groups: list[Held]
    tokens: list[int]
    hashes: list[bytes]       # the addresses of its full pages of `tokens`
    registered: int           # its pages whose address is cached (its cache hit's, then those it wrote)
    cached_tokens: int        # the prompt's tokens served from the cache at admission


class KVPages:
    """The scheduler's view of the KV pool: a PagePool per PageGroup, each request's pages and
    reservation, and the prefix cache's counters (prompt tokens looked up and found, as vLLM counts).

    A request is admitted with a reservation of every page it can hold at once (its positions in a full
    group; in a sliding one, a window plus how far its tables run ahead of its known length), so it never
    runs short mid-way; it takes pages from it as its positions come (`extend`), and a sliding group's
    pages go back once no query can read them. Its full pages are cached once their KV is written
    (`register`). The pool is never promised twice: the pages held plus every request's reservation are
    at most the pool. A full group's page held by several requests (a shared prefix) counts against none
    of their reservations twice: each reserves only what it does not hold. A sliding group's requests let
    go of pages mid-way and take new ones, so there a shared page is charged to one holder, its owner,
    and the others reserve for it too; when the owner lets go of it first, the charge passes to another
    holder, whose reservation has room for it.
    """

    @classmethod
    def from_report(cls, report: dict, salt: bytes, caching: bool = True) -> "KVPages":
        """The pool a runner reports (model.runner.Runner.warm_up: its layer groups and page size)."""
        groups = [PageGroup(g["num_pages"], g["window"]) for g in report["kv_groups"]]
        return cls(groups, report["page_size"], salt, caching)

    def __init__(self, groups: Sequence[PageGroup], page_size: int, salt: bytes, caching: bool = True):
        if page_size < 1 or not groups:
            raise ValueError(f"page_size={page_size} must be >= 1, and some group given")
        self.groups = list(groups)
        self.pools = [PagePool(g.num_pages) for g in self.groups]
        self.page_size, self.salt, self.caching = page_size, salt, caching
        self.reserved = [0] * len(self.groups)
        self.owner: list[dict[int, str]] = [{} for _ in self.groups]          # held page -> who is charged
        self.holders: list[dict[int, set[str]]] = [{} for _ in self.groups]   # held page -> who holds it
        self.requests: dict[str, RequestPages] = {}
        self.queries = self.hits = 0

    # ---- sizes ----------------------------------------------------------------------------------
    def pages_for(self, positions: int, ahead: int) -> list[int]:
        """Per group, the most pages a request of `positions` positions holds at once, when its tables run
        at most `ahead` positions past what is known of its length."""
        P = self.page_size
        full = -(-positions // P)
        return [full if g.window is None else min(full, sliding_pages(g.window, ahead, P)) for g in self.groups]

    def fits_ever(self, positions: int, ahead: int) -> bool:
        """Whether an empty pool could take such a request."""
        return all(n <= g.num_pages for n, g in zip(self.pages_for(positions, ahead), self.groups))

    @property
    def capacity_tokens(self) -> int:
        """Positions the pool holds for a request's whole length: its full-attention groups' pages (a
        sliding group holds windows)."""
        return min((g.num_pages for g in self.groups if g.window is None), default=0) * self.page_size

    @property
    def usage(self) -> float:
        """The share of pages requests hold or have reserved."""
        taken = sum(pool.used + r for pool, r in zip(self.pools, self.reserved))
        return taken / sum(g.num_pages for g in self.groups)

    # ---- requests -------------------------------------------------------------------------------
    def addresses(self, prompt: Sequence[int]) -> list[bytes]:
        """The cache addresses of a prompt's full pages (none where caching is off): hashed once, as the
        request comes, so an admission (and a retry of one) only looks them up."""
        return page_hashes(prompt, self.page_size, self.salt) if self.caching else []

    def admit(self, request_id: str, prompt: Sequence[int], positions: int, ahead: int,
              hashes: list[bytes] | None = None) -> RequestPages | None:
        """Takes a request whose KV spans `positions` positions: the cached pages of its prompt's longest
        cached prefix of full pages short of its last token (whose KV it computes for its prediction),
        and a reservation of the rest; None where the pool cannot take it now. `hashes`: the prompt's
        `addresses`, where already hashed."""
        assert request_id not in self.requests, request_id
        P = self.page_size
        hashes = self.addresses(prompt) if hashes is None else list(hashes)
        hit, tables = self._lookup(hashes[: (len(prompt) - 1) // P])
        need = self.pages_for(positions, ahead)
        credit = []   # per group, the hit pages its reservation need not cover
        for i, (g, pool) in enumerate(zip(self.groups, self.pools)):
            mine = [p for p in tables[i] if p is not None]
            unheld = sum(pool.refs(p) == 0 for p in mine)   # evictable now: taken from the pool
            credit.append(len(mine) if g.window is None else unheld)
            if pool.available - unheld - self.reserved[i] < need[i] - credit[i]:
                return None
        held = []
        for i, pool in enumerate(self.pools):
            for p in tables[i]:
                if p is None:
                    continue
                if pool.refs(p) == 0:
                    self.owner[i][p], self.holders[i][p] = request_id, set()
                self.holders[i][p].add(request_id)
                pool.acquire([p])
            self.reserved[i] += need[i] - credit[i]
            held.append(Held(table=list(tables[i]), reserved=need[i] - credit[i]))
        self.queries += len(prompt)
        self.hits += hit * P
        request = RequestPages(held, list(prompt), hashes, registered=hit, cached_tokens=hit * P)
        self.requests[request_id] = request
        return request

    def _lookup(self, hashes: Sequence[bytes]) -> tuple[int, list[list[int | None]]]:
        """The longest prefix of `hashes` whose pages every group can serve (a full group every page, a
        sliding group the pages the prefill after it reads), and each group's table of it."""
        m = len(hashes)
        for g, pool in zip(self.groups, self.pools):
            if g.window is None:
                m = min(m, len(pool.lookup(hashes[:m])))
        for g, pool in zip(self.groups, self.pools):
            if g.window is not None and m:
                k, run, best = g.window_pages(self.page_size), 0, 0
                for j in range(m):
                    run = run + 1 if pool.page_of(hashes[j]) is not None else 0
                    if run >= min(k, j + 1):
                        best = j + 1
                m = best
        tables = []
        for g, pool in zip(self.groups, self.pools):
            first = 0 if g.window is None else max(m - g.window_pages(self.page_size), 0)
            tables.append([None] * first + [pool.page_of(h) for h in hashes[first:m]])
        return m, tables

    def _let_go(self, i: int, request_id: str, held: Held, page: int) -> None:
        """`request_id` drops `page` of group i. In a sliding group, where it was charged for the page, its
        reservation gets the page back and another holder, if any, takes the charge from its own."""
        holders = self.holders[i][page]
        holders.discard(request_id)
        self.pools[i].release([page])
        owner = self.owner[i][page] == request_id
        if not holders:
            del self.owner[i][page], self.holders[i][page]
        elif owner:
            self.owner[i][page] = min(holders)
        if not owner or self.groups[i].window is None:
            return
        held.reserved += 1
        if holders:
            self.requests[min(holders)].groups[i].reserved -= 1
        else:
            self.reserved[i] += 1

    def extend(self, request_id: str, end: int, known: int) -> None:
        """Its tables cover the positions below `end` (pages from its reservation), and in a sliding group
        it lets go of the pages wholly before `known` - window + 1, which no query from `known` on reads."""
        request, P = self.requests[request_id], self.page_size
        for i, (g, pool, held) in enumerate(zip(self.groups, self.pools, request.groups)):
            if g.window is not None:
                stale = min(max(known - g.window + 1, 0) // P, len(held.table))
                for j in range(stale):
                    if held.table[j] is not None:
                        self._let_go(i, request_id, held, held.table[j])
                        held.table[j] = None
                        held.changed = j if held.changed is None else min(held.changed, j)
            grow = -(-end // P) - len(held.table)
            if grow > 0:
                assert grow <= held.reserved, (request_id, i, grow, held.reserved)
                held.changed = len(held.table) if held.changed is None else held.changed
                for p in pool.allocate(grow):
                    self.owner[i][p], self.holders[i][p] = request_id, {request_id}
                    held.table.append(p)
                held.reserved -= grow
                self.reserved[i] -= grow

    def changes(self, request_id: str) -> list[tuple[int, int, list[int | None]]]:
        """What of its tables the shards do not have yet: (group, first page index, the table from
        there); from now on they have it."""
        changes = []
        for i, held in enumerate(self.requests[request_id].groups):
            first = min(held.sent, len(held.table) if held.changed is None else held.changed)
            if first < len(held.table):
                changes.append((i, first, held.table[first:]))
            held.sent, held.changed = len(held.table), None
        return changes

    def register(self, request_id: str, tokens: Sequence[int], written: int) -> None:
        """Its tokens (prompt and committed) are `tokens`, and KV is written for its first `written`
        positions: every full page of those is cached under its address."""
        if not self.caching:
            return
        request, P = self.requests[request_id], self.page_size
        if len(tokens) > len(request.tokens):
            request.tokens += tokens[len(request.tokens):]
            request.hashes += page_hashes(request.tokens[len(request.hashes) * P:], P, self.salt,
                                          start=request.hashes[-1] if request.hashes else None)
        full = min(written // P, len(request.hashes))
        for j in range(request.registered, full):
            for pool, held in zip(self.pools, request.groups):
                if j < len(held.table) and held.table[j] is not None:
                    pool.register(held.table[j], request.hashes[j])
        request.registered = max(request.registered, full)

    def free(self, request_id: str) -> None:
        """Gives back every page it holds (cached ones stay cached, its deepest evicted first) and what is
        left of its reservation."""
        request = self.requests[request_id]
        for i, held in enumerate(request.groups):
            for page in reversed(held.table):
                if page is not None:
                    self._let_go(i, request_id, held, page)
            self.reserved[i] -= held.reserved
        del self.requests[request_id]

    def check(self) -> None:
        """Invariants (the tests' leak checks): each pool's; every held page charged to one holder; each
        request's charged pages and reservation make its need; the pool never promised twice."""
        for i, pool in enumerate(self.pools):
            pool.check()
            for page, holders in self.holders[i].items():
                assert pool.refs(page) == len(holders) > 0 and self.owner[i][page] in holders, (i, page)
            assert sum(pool.refs(p) > 0 for p in range(pool.num_pages)) == len(self.owner[i]) == pool.used, i
            assert self.reserved[i] == sum(r.groups[i].reserved for r in self.requests.values()), i
            assert pool.available >= self.reserved[i], (i, pool.available, self.reserved[i])
