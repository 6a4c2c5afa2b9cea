"""benchmarks/results.py: every result file parses with the schema and is named for its run, the docs'
tables are what the result files render now, and the benchmarks' figures reach a file under the names
the tables read."""
import datetime
import re

import pytest
from pydantic import ValidationError

from benchmarks import (cache_bench, grammar_steps, kv_capacity, prefix_lookup_bench, results, roofline, serve_bench,
                        step_bound, traffic, ttft_breakdown)
from benchmarks.bench_stats import RequestResult, summarize
from benchmarks.result_tables import TABLES
from benchmarks.results import Result, Row, Table
from tests.test_cache_bench import sample_result as cache_bench_result

# figures no benchmark writes: backfilled from the README's profiles, attention sweep and GPU soak
BACKFILLED = (".profile_ms.", ".experts_read_ms", "attention.", "soak.")


def test_every_result_file_parses_and_is_named_for_its_run():
    loaded = results.load()
    assert loaded
    for name, result in loaded.items():
        m = results.FILE.match(name)
        assert m, f"{name}: not <date>-<commit>-<card>-<tool>.json"
        assert (m["date"], m["commit"], m["card"]) == (str(result.date), result.commit.replace("+", "-"),
                                                       results.card_slug(result.card)), name


def test_the_docs_tables_are_what_the_result_files_render():
    assert results.stale() == [], "a table differs from the result files: python -m benchmarks.results render"


def test_every_table_is_in_a_doc_and_every_marker_is_closed_and_names_a_table():
    used = set()
    for path in results.docs():
        text = path.read_text()
        found = [m["name"] for m in results.MARKED.finditer(text)]
        opened, closed = (len(re.findall(rf"^<!-- {m}results:", text, re.MULTILINE)) for m in ("", "/"))
        assert opened == closed == len(found), path
        assert set(found) <= set(TABLES), (path, set(found) - set(TABLES))
        used |= set(found)
    assert used == set(TABLES), f"tables in no doc: {set(TABLES) - used}"


def _result(date: str, card: str, commit: str, **figures) -> Result:
    return Result(card=card, commit=commit, date=datetime.date.fromisoformat(date), command="x", figures=figures)


def test_a_row_takes_the_newest_file_holding_its_figures_on_its_card():
    files = {"a": _result("2026-01-01", "NVIDIA H100 80GB HBM3", "aaaaaaa", x=1, y=2.5),
             "b": _result("2026-01-02", "NVIDIA H200", "bbbbbbb", x=3),
             "c": _result("2026-01-03", "NVIDIA H100 80GB HBM3", "ccccccc", x=1234.5)}
    table = Table("t", (Row("x", ("x",), ",.0f"), Row("x and y", ("x", "y")), Row("on an H200", ("x",), card="h200"),
                        Row("z", ("z",), target="<= 1")))
    text = "before\n<!-- results:t -->\nold\n<!-- /results:t -->\nafter\n"
    out = results.render_text(text, {"t": table}, files)
    assert out == ("before\n<!-- results:t -->\n"
                   "| t | measured | target | card | commit |\n|---|---|---|---|---|\n"
                   "| x | 1,234 |  | H100 80GB HBM3 | ccccccc |\n"
                   "| x and y | 1 / 2.5 |  | H100 80GB HBM3 | aaaaaaa |\n"
                   "| on an H200 | 3 |  | H200 | bbbbbbb |\n"
                   "| z | not measured | <= 1 |  |  |\n"
                   "<!-- /results:t -->\nafter\n")
    assert results.render_text(out, {"t": table}, files) == out
    columns = Table("c", (Row("r", ("x", "y")),), columns=("x", "y"))
    assert results.render_table(columns, files) == "| c | x | y | card | commit |\n|---|---|---|---|---|\n" \
                                                   "| r | 1 | 2.5 | H100 80GB HBM3 | aaaaaaa |\n"
    with pytest.raises(KeyError, match="results:t"):
        results.render_text(text, {}, files)


@pytest.mark.parametrize("change", [{"card": ""}, {"commit": "HEAD"}, {"figures": {}}, {"figures": {"a b": 1}},
                                    {"figures": {"x": float("nan")}}, {"extra": 1}, {"date": "yesterday"}])
def test_the_schema_refuses_a_file_a_table_could_not_name(change):
    good = {"card": "H200", "commit": "abcdef1", "date": "2026-01-01", "command": "x", "figures": {"x": 1}}
    Result.model_validate(good)
    with pytest.raises(ValidationError):
        Result.model_validate(good | change)


def test_write_names_the_file_for_its_run_and_never_overwrites(tmp_path):
    figures = {"a.b": 1.5, "missing": None, "inf": float("inf")}
    first = results.write(figures, "traffic", card="NVIDIA H100 80GB HBM3", commit="abcdef1+dirty", command="cmd",
                          results_dir=tmp_path)
    second = results.write(figures, "traffic", card="NVIDIA H100 80GB HBM3", commit="abcdef1+dirty", command="cmd",
                           results_dir=tmp_path)
    assert first.name == f"{datetime.date.today()}-abcdef1-dirty-h100-traffic.json"
    assert second.name == first.name.replace(".json", "-2.json") and results.FILE.match(second.name)
    loaded = results.load(tmp_path)
    assert loaded[first.name] == loaded[second.name]
    assert loaded[first.name].figures == {"a.b": 1.5} and loaded[first.name].commit == "abcdef1+dirty"
    assert results.card_slug("CPU (2 cores)") == "cpu" and results.card_slug("NVIDIA H200") == "h200"
    assert results.card_slug("modelled: 4.3 TB/s, 750 TFLOP/s BF16") == "modelled"
    assert results.directory("") is None and results.directory("x") is not None


def _run(step_s: float, tok_s: float) -> dict:
    return {"steady_step_s": step_s, "tok_per_s": tok_s, "denoising_steps_per_s": 200.0}


def _roofline_result() -> dict:
    """A roofline result of every section (as benchmarks/roofline.py's main builds it) with made-up values."""
    steps = {"with_self_conditioning": [0.019, 0.018, 0.020], "without_self_conditioning": [0.018, 0.018, 0.018]}
    fp8 = {"gemma": {d: {"floor_s": 0.01, "batch1_step_s": 0.02, "batch4_step_s": 0.04, "P1": 2.0}
                     for d in ("bf16", "fp8")},
           "nemotron": {d: {"floor_s": 0.003, "batch1_step_s": 0.006, "batch16_step_s": 0.012, "P1": 2.0}
                        for d in ("bf16", "fp8")}}
    return {"device": "NVIDIA H100 80GB HBM3", "copy_bandwidth_bytes_per_s": 3.01e12,
            "nemotron_8b": {"floor_s": 0.004, "batch1": _run(0.005, 180.0), "batch16": _run(0.015, 1000.0),
                            "batch_invariant": {"batch1": _run(0.006, 150.0), "batch16": _run(0.024, 600.0)},
                            "served": {"denoising_steps_per_s": 190.0}},
            "P1_nemotron": 1.25, "P4": 5.5, "BI_nemotron": {1: 1.2, 16: 1.6}, "P2": 0.95,
            "diffusion_gemma_26b": {"floor_s": 0.012, "ours": {256: {"tok_per_s": 770.0}, 768: {"tok_per_s": 790.0}},
                                    "steady_step_s": steps, "batch_invariant_steady_step_s": [0.026] * 3,
                                    "transformers": {256: {"tok_per_s": 90.0}, 768: {"tok_per_s": 100.0}}},
            "P1_diffusion_gemma": 1.5, "SC": 1.05, "P3": {256: 8.5, 768: 7.9}, "BI_diffusion_gemma": 1.4,
            "fp8": fp8, "FP8_gemma": {1: 1.0, 4: 1.0}, "FP8_nemotron": {1: 1.0, 16: 1.0},
            "P5": {"nemotron": {"tp1": {"1": 6.0, "16": 9.0}, "tp2": {"1": 4.0, "16": 5.0}, "allreduce_share": 0.2},
                   "gemma": {"tp1": {"1": 10.0, "4": 20.0}, "tp2": {"1": 6.0, "4": 12.0}, "allreduce_share": 0.1}},
            "traffic": {"diffusion-gemma-fp8": _traffic_result("diffusion-gemma-26b-a4b-fp8"),
                        "nemotron-ld": {"family": "nemotron-ld", "error": "the server did not start"}}}


def _traffic_result(model: str) -> dict:
    """A traffic result of a server that started and ran no phase: every row, mostly None (the names are
    what is checked)."""
    result = {"family": "diffusion-gemma", "model": model, "phases": {}, "seed": {},
              "cold_start": {"health_200_s": 150.0, "first_completion_s": 151.0}, "warm_start": {"health_200_s": 60.0}}
    result["rows"] = traffic.derive(result, [1, 2, 4, 8])
    return result


def test_roofline_and_traffic_figures_have_stable_names():
    got = roofline.figures(_roofline_result())
    assert got["copy_bandwidth_tb_s"] == pytest.approx(3.01)
    assert got["bf16.nemotron-ld-8b.step_ms.b1"] == pytest.approx(5.0) and got["served.nemotron-ld-8b.P2"] == 0.95
    assert got["bf16.diffusion-gemma-26b-a4b.step_ms.c1"] == pytest.approx(19.0)   # the median of its requests
    assert got["bf16.diffusion-gemma-26b-a4b.over_transformers.n768"] == 7.9
    assert got["fp8.diffusion-gemma-26b-a4b.step_ms.c4"] == pytest.approx(40.0)
    assert got["fp8.nemotron-ld-8b.bf16_step_ms.b16"] == pytest.approx(12.0)
    assert got["tp.diffusion-gemma-26b-a4b.tp1_over_tp2.c4"] == pytest.approx(20 / 12)
    assert got["traffic.diffusion-gemma-26b-a4b-fp8.cold_start_health_200_s"] == 150.0
    assert not any(k.startswith("traffic.nemotron") for k in got)   # a server that did not start: no figures
    t = traffic.figures(_traffic_result("m"))
    assert {"traffic.m.seed_tok_s.c8", "traffic.m.seed_over_c1.c4", "traffic.m.seed_busy_share.c1",
            "traffic.m.ms_per_pass.mixed", "traffic.m.passes.matched", "traffic.m.mixed_over_homogeneous",
            "traffic.m.warm_start_health_200_s"} <= set(t)


def _serve_bench_result() -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 64, "total_tokens": 74,
             "diffusion": {"denoising_steps": 62, "canvases": 2, "canvas_positions": 62 * 32}}
    done = RequestResult(ok=True, input_tokens=10, output_tokens=64, chunk_times=[0.1, 0.3], latency=0.4, usage=usage)
    runs = [summarize([done, done], duration=1.0, max_concurrency=c, request_rate=float("inf"), percentiles=[99])
            for c in (1, 2, 4, 8)]
    return {"model": "tiny-nemotron-ld", "runs": runs}


def test_serve_bench_figures_per_level():
    got = serve_bench.figures(_serve_bench_result())
    assert got["serve_bench.tiny-nemotron-ld.c2.output_throughput"] == 128.0
    assert got["serve_bench.tiny-nemotron-ld.c2.committed_per_step"] == pytest.approx(128 / 124)
    assert got["serve_bench.tiny-nemotron-ld.c8.p99_itl_ms"] == pytest.approx(200.0)
    assert not any(".std_" in k for k in got)


def test_step_bound_writes_its_bounds(tmp_path, monkeypatch):
    shapes = {"nemotron-ld": step_bound.Shape("nemotron-ld", 32, 1000, 64, 0, 0, 0, 100_000, 1,
                                              ((4, 2, 16, None, False),)),
              "diffusion-gemma": step_bound.Shape("diffusion-gemma", 256, 1000, 64, 400_000, 8, 2, 100_000, 2,
                                                  ((4, 2, 16, 64, False), (4, 1, 32, None, True)))}
    monkeypatch.setattr(step_bound, "shape_of", shapes.__getitem__)
    step_bound.main(["--results-dir", str(tmp_path)])
    (result,) = results.load(tmp_path).values()
    assert result.card.startswith("modelled: 4.3 TB/s") and "--tbps 4.3" in result.command
    assert result.figures["step_bound.diffusion-gemma-26b-a4b.bf16.gain.c1"] == 1.0
    bounds = result.figures
    assert bounds["step_bound.nemotron-ld-8b.fp8.step_ms.b16"] > bounds["step_bound.nemotron-ld-8b.fp8.step_ms.b1"]


def test_every_figure_a_table_names_is_one_a_benchmark_writes(tmp_path, monkeypatch):
    written = set(roofline.figures(_roofline_result())) | set(serve_bench.figures(_serve_bench_result()))
    for model in ("nemotron-ld-8b", "diffusion-gemma-26b-a4b", "diffusion-gemma-26b-a4b-fp8"):
        written |= set(traffic.figures(_traffic_result(model)))
    monkeypatch.setattr(step_bound, "bound", lambda *a, **k: {"step": 1.0})
    monkeypatch.setattr(step_bound, "shape_of", lambda family: None)
    step_bound.main(["--results-dir", str(tmp_path)])
    written |= {k for r in results.load(tmp_path).values() for k in r.figures}
    written |= set(cache_bench.figures(cache_bench_result()))
    written |= set(prefix_lookup_bench.measure(cached_pages=20, prompt_len=64, requests=2))
    monkeypatch.setattr(kv_capacity, "fits", lambda family, n, *a: {
        f"kv_capacity.{family}.{n}.{k}": 1.0 for k in ("slots", "paged", "ratio", "full_pages")})
    written |= set(kv_capacity.main([]))
    written |= set(grammar_steps.measure(grammar_steps.DEFAULT_MODEL, requests=1, max_tokens=8))
    row = {"ttft": 2.0, "schedule": 0.1, "command": 1.0, "prefill": 0.5, "steps": 0.4, "apply": 0.1, "commands": 1,
           "cached_tokens": 0}
    written |= set(ttft_breakdown.figures({"cold": row, "cached": row, "short": row}))
    named = {k for table in TABLES.values() for row in table.rows for k in row.keys}
    assert {k for k in named if not any(b in k for b in BACKFILLED)} <= written
