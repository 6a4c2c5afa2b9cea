"""benchmarks/filters_bench.py --tiny --sweep on the CPU, under triton's interpreter in a process of its
own (the interpreter is chosen when triton is imported): every setting the GPU sweep times checked
against torch. Its cases with --against are tests/interpreted/test_interpreted_filters_bench.py's (run
by tests/test_interpreted_kernels.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.reliability   # ~2 minutes of interpreter on 2 cores
def test_tiny_sweep_checks_every_setting_against_torch_in_the_interpreter(tmp_path):
    """Every setting the GPU sweep times (tile and split sizes, warps) gives torch's thresholds: a setting
    that is fast but wrong shows as not exact."""
    pytest.importorskip("triton")
    from benchmarks.filters_bench import SWEEP

    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "benchmarks.filters_bench", "--tiny", "--shapes", "dg_tiny_rows",
                          "--asks", "traffic", "--iters", "1", "--sweep", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rows = json.loads(out.read_text())["sweep"]
    assert len(rows) == len(SWEEP)
    assert all(row["exact"] for row in rows)
    assert len({(row["count_block"], row["split"], row["mass_block"]) for row in rows}) >= 4
