"""Triton kernels on the CPU: a snippet run by triton's interpreter in a fresh process (the interpreter
is chosen when triton is imported, so it cannot be switched on inside the test session).

A test marked `@pytest.mark.interpreted(code, done, timeout=...)` and calling `run_marked(request)` has
its snippet started ahead: when the session's first test sets up (conftest.py), every selected test's
snippet is queued, in the session's order, and they run JOBS at a time in the background while the
other tests run; conftest.py puts the modules with snippets after the others, so their tests find their
snippets done. Each interpreter is one busy Python thread, and most of the suite keeps one of the
2-core CI machine's cores idle (Ray and HTTP tests wait more than they compute), so the snippets, a
few minutes of one core, run at the lowest CPU priority in time that was idle (the suite: 21.4 minutes
with each module's snippets two at a time beside that module's tests, 16.6 this way, same machine and
day); the test still fails on its own snippet, with its output, as if it had run it in place.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one at a time: they run beside the other tests, on the core those leave idle
JOBS = 1
# a snippet started ahead runs at the lowest priority and may wait for the foreground's cores: its bound
# is this many times its own (still a bound; a test that runs its snippet itself keeps the plain one)
AHEAD_SLACK = 3

_pool: ThreadPoolExecutor | None = None
_ahead: dict[str, Future] = {}   # a snippet's code -> its background run
_started = False


def _interpret(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    # at the lowest CPU priority: a snippet takes the cores the tests in the foreground leave idle, and
    # slows a Ray test beside it as little as it can (one started ahead and not yet awaited took 20-60 s
    # more of the first Ray modules' time at the default priority). The child lowers its own priority:
    # a preexec_fn is unsafe from the pool's thread. On the snippet's blank first line where it has one,
    # so a traceback's line numbers stay the snippet's.
    niced = "import os; os.nice(19)" + (code if code.startswith("\n") else "\n" + code)
    return subprocess.run([sys.executable, "-c", niced], env=env, capture_output=True, text=True, timeout=timeout)


def run_interpreted(code: str, done: str, timeout: float = 300) -> str:
    """Runs `code` under TRITON_INTERPRET=1 (or takes its run started ahead); it must exit 0 and print
    `done` (an assert that never ran cannot pass). Returns what it printed."""
    pytest.importorskip("triton")
    ahead = _ahead.pop(code, None)
    out = ahead.result() if ahead is not None else _interpret(code, timeout)   # a timeout raises here
    assert out.returncode == 0 and done in out.stdout, out.stderr[-3000:]
    return out.stdout


def run_marked(request: pytest.FixtureRequest) -> str:
    """run_interpreted of the test's `interpreted` mark; what it printed."""
    mark = request.node.get_closest_marker("interpreted")
    assert mark is not None, f"{request.node.name} has no interpreted mark"
    return run_interpreted(*mark.args, **mark.kwargs)


def start_session_ahead(item: pytest.Item) -> None:
    """Queues the snippet of every selected test of `item`'s session, once, in the session's order."""
    global _pool, _started
    if _started:
        return
    _started = True
    if importlib.util.find_spec("triton") is None:
        return
    for other in item.session.items:
        if other.get_closest_marker("skip"):
            continue
        mark = other.get_closest_marker("interpreted")
        if mark is not None and mark.args[0] not in _ahead:
            _pool = _pool or ThreadPoolExecutor(JOBS, thread_name_prefix="interpreter")
            _ahead[mark.args[0]] = _pool.submit(_interpret, mark.args[0], AHEAD_SLACK * mark.kwargs.get("timeout", 300))


def stop_ahead() -> None:
    """Drops the runs no test took (a session stopped early); a running one ends within its timeout."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
