"""benchmarks/filters_bench.py --tiny under triton's CPU interpreter, with --against timing a second
copy of the kernel's module beside it and checking both against torch. Run under TRITON_INTERPRET=1
only (tests/test_interpreted_kernels.py); its --sweep is tests/test_filters_bench.py's (reliability)."""
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

import benchmarks.filters_bench as bench
from benchmarks.filters_bench import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ask", ["mixed", "traffic"])
def test_tiny_bench_times_and_checks_a_module_against_in_the_interpreter(ask, tmp_path, capsys, monkeypatch):
    # the bench runs the thresholds 6 times a case (each module: a warm-up, a timed run, a check), which
    # the interpreter takes by programs and tiles: its fp32 shape at one position of 1000 entries (two
    # tiles, the asks' k of 40 to 499 past them as at 3000, within the vocabulary) instead of 2 of 3000
    shape, dtype, kw = bench.TINY["nem_tiny_fp32"]
    monkeypatch.setitem(bench.TINY, "nem_tiny_fp32", ((shape[0], 1, 1000), dtype, kw))
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
