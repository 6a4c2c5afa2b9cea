"""Modules of computation alone run in one pytest subprocess beside the session, in the time the session's own
tests leave a core idle: they run one at a time, most of them on one of a CI machine's two cores. What runs
here starts no Ray and no server, spawns no ranks, and checks no clock; a subprocess of its own has a bound
far above its time (it runs at the lowest CPU priority, so it may wait for a core).

When the test here is selected on a machine without a GPU, tests/conftest.py hands it the session's selected
tests of MODULES (they leave the session's own list) and starts their run once the triton-interpreter run
(tests/test_interpreted_kernels.py) is done, at the lowest CPU priority; the test here runs last but one and
awaits it: exit status 0 and every one of them passed (or skipped as it would in the session). Run without the
test here (`pytest tests/test_graph_plans.py`, `-k`, a machine with a GPU), a module runs in the session as any
other. -rP prints the run's counts and slowest tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.background_run import kill, output, summary

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("test_ar_rides.py", "test_compiled_update.py", "test_decode_logprobs.py", "test_decode_schedule.py",
           "test_default_model.py", "test_fp8_parity.py", "test_graph_plans.py", "test_hopper_compile.py",
           "test_http_fuzz.py", "test_import_layers.py", "test_prefill.py")
IDS_ENV = "DLLM_BESIDE_IDS"   # in the run's environment: the file of the node ids it runs (tests/conftest.py)
# the run's bound from its start: the interpreter's run first (its own bound 1800 s), then its own (~100 s of a
# core alone); each of its tests has its own, as the session's
BOUND_S = 2400
TEST_BOUND_S = 900

# the run's process: the lowest CPU priority, then a wait while the process `after` runs (a zombie, ended but
# not yet reaped by the session, has ended), then pytest
LAUNCH = """
import os, sys, time
os.nice(19)
def running(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while {after} and running({after}):
    time.sleep(1)
import pytest
sys.exit(pytest.main())
"""

node_ids: list[str] = []   # the session's tests this run takes (tests/conftest.py)
_run: tuple[subprocess.Popen, object, str] | None = None   # the process, its output file, the file of ids


def start_ahead(after_pid: int | None) -> None:
    """Starts the run, once (tests/conftest.py, as the session's first test sets up): it waits for the process
    `after_pid` (the interpreter's run) to end first, so that the two take turns at the idle core."""
    global _run
    if _run is not None or not node_ids:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as ids:
        ids.write("\n".join(node_ids))
    out = tempfile.TemporaryFile("w+")   # noqa: SIM115 (read when the test awaits the run)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, IDS_ENV: ids.name, "PYTHONPATH": path}
    env.pop("TRITON_INTERPRET", None)
    code = LAUNCH.format(after=after_pid or 0)
    modules = sorted({i.split("::")[0] for i in node_ids})
    # -m "": exactly the tests handed over, whatever pyproject's addopts deselect
    cmd = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "-m", "", "-o", f"timeout={TEST_BOUND_S}",
           "--durations=10", *modules]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _run = (proc, out, ids.name)


def stop_ahead() -> None:
    """Stops a run no test awaited (a session stopped early)."""
    if _run is not None:
        if _run[0].poll() is None:
            kill(_run[0])
        Path(_run[2]).unlink(missing_ok=True)


@pytest.mark.timeout(BOUND_S + 60)
def test_the_modules_run_beside_the_session_pass():
    if not node_ids:
        pytest.skip("no test of its modules handed over: they run in the session (a GPU, or none selected)")
    start_ahead(None)
    proc, out, ids = _run
    # nothing of the session is left to run beside it: it may take a whole core now (where this process may)
    try:
        os.setpriority(os.PRIO_PGRP, proc.pid, 0)
    except OSError:
        pass
    started = time.monotonic()
    try:
        proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"the run beside the session not done in {BOUND_S} s; its output:\n{output(out)}")
    finally:
        Path(ids).unlink(missing_ok=True)
    text = output(out)
    counts = summary(text)
    expected = len(node_ids)
    failed = "\n".join(line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR ")))
    assert proc.returncode == 0 and set(counts) <= {"passed", "skipped"} and sum(counts.values()) == expected, (
        f"the run beside the session: exit status {proc.returncode}, {counts or 'no summary'} (expected "
        f"{expected} passed or skipped, nothing else)\n{failed}\nits output:\n{text}")
    print(f"the run beside the session ({len(MODULES)} modules, awaited {time.monotonic() - started:.1f} s):\n"
          + "\n".join(text.strip().splitlines()[-14:]))
