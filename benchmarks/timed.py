"""A function wrapped to sum the seconds its calls take, for the benchmarks that split a path into parts."""
from __future__ import annotations

import time
from typing import Callable


class Timed:
    """Wraps `fn`, summing its calls' seconds and counting them. With `sync` (a device's synchronize), the
    work queued before a call is finished first (not counted) and the call's own before its end is read."""

    def __init__(self, fn: Callable, sync: Callable[[], None] | None = None):
        self.fn, self.sync, self.seconds, self.calls = fn, sync, 0.0, 0

    def __call__(self, *args, **kwargs):
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def take(self) -> float:
        """The seconds since the last take, and a fresh sum."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
