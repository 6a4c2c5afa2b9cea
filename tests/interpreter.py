"""Triton kernels on the CPU: a snippet run by triton's interpreter in a fresh process (the interpreter
is chosen when triton is imported, so it cannot be switched on inside the test session).

A test marked `@pytest.mark.interpreted(code, done, timeout=...)` and calling `run_marked(request)` has
its snippet started ahead: when its module's first test sets up
(conftest.py), every selected test of the module queues its snippet, which run JOBS at a time in the
background while the module's other tests run. Each interpreter is one busy Python thread, so on the
2-core CI machine this halves the wall time of a module of snippets; the test still fails on its own
snippet, with its output, as if it had run it in place.
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
JOBS = max(1, min(2, os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None
_ahead: dict[str, Future] = {}   # a snippet's code -> its background run
_started_modules: set[Path] = set()


def _interpret(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


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


def start_module_ahead(item: pytest.Item) -> None:
    """Queues the snippet of every selected test of `item`'s module, once per module."""
    global _pool
    if item.path in _started_modules:
        return
    _started_modules.add(item.path)
    if importlib.util.find_spec("triton") is None:
        return
    for other in item.session.items:
        if other.path != item.path or other.get_closest_marker("skip"):
            continue
        mark = other.get_closest_marker("interpreted")
        if mark is not None and mark.args[0] not in _ahead:
            _pool = _pool or ThreadPoolExecutor(JOBS, thread_name_prefix="interpreter")
            _ahead[mark.args[0]] = _pool.submit(_interpret, mark.args[0], mark.kwargs.get("timeout", 300))


def stop_ahead() -> None:
    """Drops the runs no test took (a session stopped early); a running one ends within its timeout."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
