"""benchmarks/filters_bench.py on the CPU: --tiny under triton's interpreter, with --against timing a
second copy of the kernel's module beside it and checking both against torch."""
import json

import pytest

from tests.interpreter import ROOT, run_interpreted, run_marked

BENCH = r"""
import tempfile
from pathlib import Path
from benchmarks.filters_bench import main
out = Path(tempfile.mkdtemp()) / "bench.json"
code = main(["--tiny", "--shapes", "nem_tiny_fp32", "--asks", {ask!r}, "--iters", "1",
             "--profile", "--against", {against!r}, "--json", str(out)])
print("bench exit", code)
print("json:", out.read_text().replace("\n", " "))
"""


@pytest.mark.parametrize("ask", [  # one snippet an ask, run side by side (tests/interpreter.py)
    pytest.param(ask, marks=pytest.mark.interpreted(
        BENCH.format(ask=ask, against=str(ROOT / "model/kernels/filters.py")), "bench exit 0", timeout=300))
    for ask in ("mixed", "traffic")])
def test_tiny_bench_times_and_checks_a_module_against_in_the_interpreter(ask, request):
    printed = run_marked(request)
    assert "against_ms" in printed and "--profile: no CUDA device" in printed
    rows = json.loads(printed.split("json:", 1)[1])["cases"]
    assert [row["ask"] for row in rows] == [ask]
    for row in rows:
        assert row["exact"] and row["against_exact"] and row["against_ms"] > 0 and row["speedup"] > 0


SWEEP = r"""
from benchmarks.filters_bench import SWEEP, main
code = main(["--tiny", "--shapes", "dg_tiny_rows", "--asks", "traffic", "--iters", "1", "--sweep", "--json", {json!r}])
print("sweep exit", code, len(SWEEP))
"""


@pytest.mark.reliability   # ~2 minutes of interpreter on 2 cores
def test_tiny_sweep_checks_every_setting_against_torch_in_the_interpreter(tmp_path):
    """Every setting the GPU sweep times (tile and split sizes, warps) gives torch's thresholds: a setting
    that is fast but wrong shows as not exact."""
    out = tmp_path / "sweep.json"
    printed = run_interpreted(SWEEP.format(json=str(out)), "sweep exit 0", timeout=400)
    rows = json.loads(out.read_text())["sweep"]
    assert len(rows) == int(printed.split("sweep exit 0 ")[1].split()[0])
    assert all(row["exact"] for row in rows)
    assert len({(row["count_block"], row["split"], row["mass_block"]) for row in rows}) >= 4
