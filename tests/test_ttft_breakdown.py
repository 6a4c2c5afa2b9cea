"""benchmarks/ttft_breakdown.py on the CPU: its parts are wired to the engine's (each timed, nested
inside the command and the request), a cached prompt skips its prefix's pages, a cold prompt longer
than the prefill chunk takes a command a chunk, and the first token waits for no step."""
from __future__ import annotations

from benchmarks import ttft_breakdown
from model.protocol import PAGE_SIZE


def test_the_breakdown_times_each_part_of_a_cached_and_a_cold_first_token(tiny_nemotron, tmp_path):
    prefix, suffix, chunk = 200, 29, 64
    profile = tmp_path / "profile.txt"
    measured = ttft_breakdown.measure(tiny_nemotron, {"device": "cpu", "num_slots": 2, "max_model_len": 512,
                                                      "prefill_chunk": chunk}, prefix, suffix, turns=2, first_tokens=2,
                                      profile=profile)
    for case, row in measured.items():
        assert min(row[p] for p in ("schedule", "command", "prefill", "apply")) > 0, (case, row)
        # an AR request's first token is its prefill's prediction: its commands until then are prefills alone
        assert row["steps"] == 0 and row["command"] >= row["prefill"], (case, row)
        assert row["ttft"] >= row["command"] + row["schedule"] + row["apply"], (case, row)
    assert measured["cached"]["cached_tokens"] == prefix // PAGE_SIZE * PAGE_SIZE
    assert measured["cold"]["cached_tokens"] == measured["short"]["cached_tokens"] == 0
    assert measured["cold"]["commands"] == -(-(prefix + suffix) // chunk)
    assert measured["cached"]["commands"] == measured["short"]["commands"] == 1
    figures = ttft_breakdown.figures(measured)
    assert figures["ttft.cached_over_cold"] == measured["cached"]["ttft"] / measured["cold"]["ttft"]
    assert figures["ttft.cached.prefill_ms"] == measured["cached"]["prefill"]
    assert "by self host time" in profile.read_text() and "aten::" in profile.read_text()


def test_engine_arguments_take_the_engines_own_types_and_names():
    import pytest

    args = ttft_breakdown.engine_args(["num_slots=2", "batch_invariant=true", "gpu_memory_utilization=0.8"])
    assert (args["num_slots"], args["batch_invariant"], args["gpu_memory_utilization"]) == (2, True, 0.8)
    assert args["device"] == ttft_breakdown.DEFAULTS["device"]
    for bad, says in (("num_slot=2", "num_slots"), ("num_slots=two", "integer"), ("num_slots", "KEY=VALUE")):
        with pytest.raises(SystemExit, match=says):
            ttft_breakdown.engine_args([bad])
