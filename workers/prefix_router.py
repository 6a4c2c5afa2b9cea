"""Routing that follows the prefix cache across Coordinator replicas: a Ray Serve RequestRouter.

A `generate` call goes to the replica that holds the longest run of its prompt's leading full pages:
what each replica reports of its cache (`record_routing_stats`, refreshed every few seconds) and what
this router sent it since (which the next report will hold). A holder is passed over only once it has
more than `imbalance` requests (a replica's batch, by default) beyond the least loaded and over `ratio`
times as many, so an uneven load still spreads while a few requests more, which join the holder's running
batch, do not cost a conversation its cache (vLLM's and SGLang's cache-aware routers keep the same two
conditions); ties and cold prompts go
by rendezvous hashing on the prompt's deepest full page, so every ingress replica picks alike, a prompt's
choices stay together, and cold conversations spread. Other calls (stats, health) go to the less
loaded of two. Ray's own PrefixCacheAffinityRouter matches characters of a text prompt; our calls carry
token ids, and the pages' addresses are the replicas' own (workers/kv_pages.py: page_hashes).
"""
from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import OrderedDict
from typing import Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from workers.kv_pages import page_hashes

log = logging.getLogger("dllm.router")
STATS_KEY = "cached_pages"     # a replica's routing stats: the addresses of the pages it caches
# pages a replica reports: its most recently used (Serve ships the report to every router whenever it
# changes, so its size is bounded)
ROUTED_PAGES = 4096
RECENT = 65536                 # pages this router remembers sending, per replica (oldest forgotten first)


def short(h: bytes) -> int:
    """A page address as a replica reports it: its first 8 bytes (cheap to ship and to compare)."""
    return int.from_bytes(h[:8], "little")


def _rendezvous(key: bytes, replica: RunningReplica) -> bytes:
    return hashlib.blake2b(key + replica.replica_id.unique_id.encode(), digest_size=8).digest()


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, page_size: int = 16, salt: str = "", imbalance: int = 8, ratio: float = 1.5,
                         recent_s: float = 30.0) -> None:
        """page_size, salt: the replicas' (their pages' addresses); imbalance, ratio: a cache holder is
        passed over when it has more than `imbalance` requests beyond the least loaded replica and more than
        `ratio` times its count; recent_s: how long a page this router sent a replica counts as held there
        without its report."""
        self.page_size, self.salt = page_size, salt.encode()
        self.imbalance, self.ratio, self.recent_s = imbalance, ratio, recent_s
        self.sent: dict[object, OrderedDict[int, float]] = {}   # replica id -> page -> when sent
        self.reported: dict[object, tuple[int, frozenset[int]]] = {}   # replica id -> (stats' id, its pages)

    def _prompt(self, request: PendingRequest | None) -> Sequence[int] | None:
        if request is None or request.metadata.call_method != "generate" or not request.args:
            return None
        prompt = request.args[0]
        return prompt if isinstance(prompt, (list, tuple)) and prompt else None

    def _held(self, replica: RunningReplica, now: float):
        """page -> whether `replica` holds it, by its report and what was sent it lately."""
        stats = (replica.routing_stats or {}).get(STATS_KEY) or ()
        seen = self.reported.get(replica.replica_id)
        if seen is None or seen[0] != id(stats):   # a fresh report: a set once, not a scan a request
            seen = self.reported[replica.replica_id] = (id(stats), frozenset(stats))
        sent = self.sent.get(replica.replica_id, {})
        return lambda page: page in seen[1] or now - sent.get(page, -1e18) < self.recent_s

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:   # Serve retries at once, with no backoff, unless asked
            pending_request.routing_context.should_backoff = True
        try:
            return self._rank(candidate_replicas, pending_request)
        except Exception:   # noqa: BLE001 - a routing task that raises strands its request
            log.exception("prefix routing failed; the least loaded replica takes the request")
            return [sorted(candidate_replicas, key=self._queue)]

    def _queue(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _rank(self, replicas: list[RunningReplica], request: PendingRequest | None) -> list[list[RunningReplica]]:
        prompt = self._prompt(request)
        if prompt is None:   # stats, health: the less loaded of two
            return [sorted(random.sample(replicas, min(2, len(replicas))), key=self._queue)]
        hashes = page_hashes(prompt[: len(prompt) - 1], self.page_size, self.salt)
        pages = [short(h) for h in hashes]
        key = hashes[-1] if hashes else b"".join(t.to_bytes(4, "little") for t in prompt)
        now = time.monotonic()

        def cached(replica: RunningReplica) -> int:
            held, n = self._held(replica, now), 0
            while n < len(pages) and held(pages[n]):
                n += 1
            return n

        least = min(self._queue(r) for r in replicas)
        near = [r for r in replicas
                if self._queue(r) <= least + self.imbalance or self._queue(r) <= least * self.ratio]
        best = max(near, key=lambda r: (cached(r), _rendezvous(key, r)))
        rest = sorted((r for r in replicas if r is not best), key=self._queue)
        return [[best], rest] if rest else [[best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        prompt = self._prompt(pending_request)
        if prompt is None:
            return
        sent = self.sent.setdefault(replica_id, OrderedDict())
        now = time.monotonic()
        for h in page_hashes(prompt, self.page_size, self.salt):
            sent[short(h)] = now
            sent.move_to_end(short(h))
        while len(sent) > RECENT:
            sent.popitem(last=False)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for table in (self.sent, self.reported):
            for rid in [rid for rid in table if rid not in live]:
                del table[rid]
