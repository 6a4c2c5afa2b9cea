"""benchmarks/filters_bench.py --tiny under triton's CPU interpreter, with --against timing a second
copy of the kernel's module beside it and checking both against torch. Run under TRITON_INTERPRET=1
only (tests/test_interpreted_kernels.py); its --sweep is tests/test_filters_bench.py's (reliability)."""
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks.filters_bench import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ask", ["mixed", "traffic"])
def test_tiny_bench_times_and_checks_a_module_against_in_the_interpreter(ask, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["--tiny", "--shapes", "nem_tiny_fp32", "--asks", ask, "--iters", "1", "--profile",
                 "--against", str(ROOT / "model/kernels/filters.py"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "against_ms" in printed and "--profile: no CUDA device" in printed
    rows = json.loads(out.read_text())["cases"]
    assert [row["ask"] for row in rows] == [ask]
    for row in rows:
        assert row["exact"] and row["against_exact"] and row["against_ms"] > 0 and row["speedup"] > 0
