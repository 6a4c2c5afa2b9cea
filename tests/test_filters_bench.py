"""benchmarks/filters_bench.py on the CPU: --tiny under triton's interpreter, with --against timing a
second copy of the kernel's module beside it and checking both against torch."""
import json

from tests.interpreter import ROOT, run_interpreted

BENCH = r"""
from benchmarks.filters_bench import main
code = main(["--tiny", "--shapes", "nem_tiny_fp32", "--asks", "mixed", "traffic", "--iters", "1",
             "--profile", "--against", {against!r}, "--json", {json!r}])
print("bench exit", code)
"""


def test_tiny_bench_times_and_checks_a_module_against_in_the_interpreter(tmp_path):
    out = tmp_path / "bench.json"
    printed = run_interpreted(BENCH.format(against=str(ROOT / "model/kernels/filters.py"),
                                           json=str(out)), "bench exit 0", timeout=300)
    assert "against_ms" in printed and "--profile: no CUDA device" in printed
    rows = json.loads(out.read_text())["cases"]
    assert [row["ask"] for row in rows] == ["mixed", "traffic"]
    for row in rows:
        assert row["exact"] and row["against_exact"] and row["against_ms"] > 0 and row["speedup"] > 0
