"""The kernels this process compiles while a block runs: triton JIT variants (our kernels; a new variant
of one comes from a new constexpr or a new specialization of an integer argument, e.g. a width that is
or is not a multiple of 16) and torch.compile graphs (the fused chains, the compiled updates).

After warm-up a replica should compile nothing: a compile inside a served step stalls every request of
the replica for its duration (a triton variant takes about a second, an inductor graph longer), which a
user sees as a TTFT or inter-token outlier the first time a shape comes. Tests and benchmarks use this
to list what compiled, with how long each took.
"""
from __future__ import annotations

import time
from typing import Callable

_active: list["CompileWatch"] = []   # the open watches, fed by one pair of triton hooks
_hooks: tuple | None = None          # (ours before, ours after) as installed


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _install() -> None:
    """Our hooks in triton's knobs, chaining whatever was there (installed again if something replaced
    them since): every open watch hears of every compile, whatever order watches open and close in."""
    global _hooks
    from triton import knobs

    runtime = knobs.runtime
    if _hooks is not None and (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == _hooks:
        return
    theirs_before, theirs_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def before(**kw):   # a variant missing from the in-memory cache is about to compile (or load)
        now = time.perf_counter()
        for watch in _active:
            watch._started = now
        return theirs_before(**kw) if theirs_before else None

    def after(**kw):
        name = kw["repr"].split("[", 1)[0]
        for watch in list(_active):
            watch._record(name)
        return theirs_after(**kw) if theirs_after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = _hooks = (before, after)


class CompileWatch:
    """with CompileWatch() as w: ... -> w.kernels [(triton kernel's name, seconds)], w.graphs (torch.compile
    graphs compiled). A served runner keeps one open from its warm-up on (`start()`; `count` so far),
    calling `on_compile(name, seconds)` for each triton variant."""

    def __init__(self, on_compile: Callable[[str, float], None] | None = None):
        self.kernels: list[tuple[str, float]] = []
        self.graphs = 0
        self.on_compile = on_compile
        self._started: float | None = None
        self._graphs: int | None = None

    def _record(self, name: str) -> None:
        took = time.perf_counter() - self._started if self._started is not None else 0.0
        self.kernels.append((name, took))
        self._started = None
        if self.on_compile is not None:
            self.on_compile(name, took)

    def __enter__(self) -> "CompileWatch":
        if self not in _active:
            _install()
            _active.append(self)
            self._graphs = _dynamo_graphs()
        return self

    def __exit__(self, *exc) -> None:
        if self in _active:
            _active.remove(self)
            self.graphs, self._graphs = _dynamo_graphs() - self._graphs, None

    start = __enter__

    def stop(self) -> None:
        self.__exit__()

    @property
    def count(self) -> int:
        """Triton variants and torch.compile graphs compiled so far (while open: up to now)."""
        graphs = self.graphs if self._graphs is None else _dynamo_graphs() - self._graphs
        return len(self.kernels) + graphs

    @property
    def compiled(self) -> bool:
        return self.count > 0

    def summary(self) -> str:
        kernels = ", ".join(f"{name} {took:.2f} s" for name, took in self.kernels) or "none"
        return f"triton variants: {kernels}; torch.compile graphs: {self.graphs}"
