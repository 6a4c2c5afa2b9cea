"""The triton kernels' tests under triton's CPU interpreter (tests/interpreted/), run in one subprocess.

The interpreter is chosen when triton is imported, so it cannot be switched on inside this session, and
must not be: with it on, model.attention and others send CPU tensors to the triton kernels, and the
whole suite would crawl. So tests/conftest.py collects tests/interpreted only under TRITON_INTERPRET=1,
and starts `python -m pytest tests/interpreted` under it when the session's first test sets up (where
the test here is selected), at the lowest CPU priority: a few minutes of one busy core, run beside the
whole session in time its tests leave idle. The test here runs last and awaits it: exit status 0 and
every one of its tests passed. By hand: TRITON_INTERPRET=1 python -m pytest tests/interpreted
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.background_run import kill, output, summary

ROOT = Path(__file__).resolve().parents[1]
# the tests in tests/interpreted: one added there is counted here (a file that collects nothing, or a test
# that skips, fails this)
EXPECTED = 35
# the run's bound from its start, beside the whole session at the lowest priority (alone: ~6 minutes on 2
# busy cores); each of its tests has its own, far above its minute at most alone
BOUND_S = 1800
TEST_BOUND_S = 900

_run: tuple[subprocess.Popen, object, float] | None = None   # the process, its output file, its start


def start_ahead() -> None:
    """Starts the run, once (tests/conftest.py, as the session's first test sets up; else the test)."""
    global _run
    if _run is not None or importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        return
    out = tempfile.TemporaryFile("w+")   # noqa: SIM115 (read when the test awaits the run)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    # the child lowers its own priority first: it takes the cores the session leaves idle and slows the
    # Ray and HTTP tests beside it as little as it can
    code = "import os, sys; os.nice(19); import pytest; sys.exit(pytest.main())"
    cmd = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "-o", f"timeout={TEST_BOUND_S}",
           "tests/interpreted"]
    # a session of its own: torch.compile's workers go with it if it is stopped
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _run = (proc, out, time.monotonic())


def stop_ahead() -> None:
    """Stops a run no test awaited (a session stopped early)."""
    if _run is not None and _run[0].poll() is None:
        kill(_run[0])


@pytest.mark.timeout(BOUND_S + 60)
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session is under the interpreter: it collects tests/interpreted itself")
    start_ahead()
    proc, out, started = _run
    try:
        proc.wait(timeout=max(1.0, started + BOUND_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"tests/interpreted not done in {BOUND_S} s; its output:\n{output(out)}")
    text = output(out)
    counts = summary(text)
    assert proc.returncode == 0 and counts == {"passed": EXPECTED}, (
        f"tests/interpreted under TRITON_INTERPRET=1: exit status {proc.returncode}, {counts or 'no summary'}"
        f" (expected {EXPECTED} passed, nothing else); its output:\n{text}")
    print("tests/interpreted:", text.strip().splitlines()[-1])   # its count and time (-rP shows it)
