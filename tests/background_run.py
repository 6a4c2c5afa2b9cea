"""What the suite's background pytest runs share (tests/test_interpreted_kernels.py, tests/test_beside.py): each
a subprocess in a session of its own, its output in a temporary file read when its test awaits it."""
from __future__ import annotations

import os
import re
import signal
import subprocess


def kill(proc: subprocess.Popen) -> None:
    """The run's whole process group (torch.compile's workers too), then its exit."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def output(out, chars: int = 12000) -> str:
    """The run's output file, its last `chars` characters."""
    out.seek(0)
    text = out.read()
    return text if len(text) <= chars else "...\n" + text[-chars:]


def summary(text: str) -> dict[str, int]:
    """pytest's closing line ("90 passed, 1 failed, 3 warnings in 101.02s") as {outcome: count}, without the
    warnings."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", line)]
    if not lines:
        return {}
    counts = re.findall(r"(\d+) (\w+)", lines[-1].strip("= ").split(" in ")[0])
    return {kind: int(n) for n, kind in counts if not kind.startswith("warning")}
