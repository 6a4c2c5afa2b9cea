"""Triton kernels on the CPU: a snippet run by triton's interpreter in a fresh process (the interpreter
is chosen when triton is imported, so it cannot be switched on inside the test session)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, done: str, timeout: float = 300) -> str:
    """Runs `code` under TRITON_INTERPRET=1; it must exit 0 and print `done` (an assert that never ran
    cannot pass). Returns what it printed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and done in out.stdout, out.stderr[-3000:]
    return out.stdout
