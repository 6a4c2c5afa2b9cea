"""The ingress (deployments/) and the coordinator (workers/coordinator.py, workers/serve_coordinator.py)
load neither torch nor the model's runner: they route requests, and torch is the shards' business (a
second copy of it in every ingress and coordinator process costs memory and start-up time)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import deployments.app, workers.coordinator, workers.serve_coordinator
print(sorted(m for m in ("torch", "model.runner") if m in sys.modules))
"""


def test_ingress_and_coordinator_import_neither_torch_nor_the_runner():
    # a fresh interpreter: this test session has imported torch already
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
