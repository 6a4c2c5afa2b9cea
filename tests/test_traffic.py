"""benchmarks/traffic.py, the client side of issue 23's measurement: its launcher and phases end to end
against the tiny model served by scripts/serve_local.py on CPU, the rows it derives, the /metrics it
reads, a server that cannot start, and roofline's table of its rows; and the GPU soak script against
the tiny model (reliability)."""
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks import roofline, traffic
from benchmarks.server_process import GRAPH_METRICS, READY_LINE, SCRAPED, ServerError, ServerProcess, parse_metrics

ROOT = Path(__file__).resolve().parents[1]
MIX = ('{"prompt_len": {"uniform": [4, 24]}, "max_tokens": {"choice": [8, 40]}, "temperature": {"choice": [0, 0.7]}, '
       '"top_k": {"choice": [0, 5, {"uniform": [1, 499]}]}, "logprobs": {"choice": [null, 2]}, '
       '"diffusion.mode": {"choice": ["diffusion", "ar"]}}\n'
       '{"prompt_len": 12, "max_tokens": 33, "diffusion.policy": "low_confidence"}\n')


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _measure(tiny_nemotron, tmp_path, *args: str):
    mix = tmp_path / "mix.jsonl"
    mix.write_text(MIX)
    opts = traffic.parse_args(["--family", "nemotron-ld", "--model", str(tiny_nemotron), "--server-arg", "device=cpu",
                               "--mix", str(mix), "--seed-rounds", "1", "--seed-prompt-len", "16", "--seed-max-tokens",
                               "32", "--start-timeout", "150", "--out", str(tmp_path / "traffic.json"),
                               "--results-dir", "", *args])
    return opts, traffic.measure(opts)


@pytest.mark.timeout(180)
def test_traffic_smoke_from_a_cold_start(tiny_nemotron, tmp_path):
    """The bench's launcher, every phase and its rows, at the smallest size (the whole measurement,
    concurrency 2 and a warm restart, is the reliability tier's, below): every request answered, the rows
    derived, and the server stopped with its Ray."""
    opts, result = _measure(tiny_nemotron, tmp_path, "--requests", "2", "--warmup-requests", "1", "--concurrency",
                            "1", "--seed-levels", "1", "--seed-schema")
    cold = result["cold_start"]
    assert 0 < cold["health_200_s"] <= cold["first_completion_s"] < 150 and cold["model"] == tiny_nemotron.name
    for name, n in (("warmup", 1), ("homogeneous", 2), ("matched", 2), ("mixed", 2)):
        phase = result["phases"][name]
        assert phase["error"] is None and phase["summary"]["completed"] == n and phase["summary"]["failed"] == 0
    assert [result["seed"][c]["summary"]["completed"] for c in ("warmup", "1")] == [1, 1]
    # --seed-schema: the seed workload under a JSON schema, and beside unconstrained / constrained neighbours
    assert {name: phase["summary"]["completed"] for name, phase in result["schema"].items()} == {
        "c1": 1, "beside_plain_free": 1, "beside_plain_other": 1, "beside_schema_free": 1, "beside_schema_other": 1}
    rows = result["rows"]
    assert rows["failed_requests"] == 0 and rows["seed_over_concurrency_1"]["1"] == 1.0
    assert rows["seed_schema_over_plain_c1"] > 0 and rows["schema_neighbours_ratio"] > 0
    assert "unconstrained tok/s beside constrained neighbours / beside unconstrained" in traffic.format_table(result)
    assert json.loads(opts.out.read_text())["server_exit_status"] == 0
    deadline = time.monotonic() + 15
    while _group_members(result["server_pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(result["server_pid"]) == []


@pytest.mark.reliability
@pytest.mark.timeout(240)
def test_traffic_measures_a_tiny_server_from_its_cold_start(tiny_nemotron, tmp_path):
    """One cold start of serve_local (a subprocess, device=cpu), every phase at a tiny size: the
    cold-start timeline, a summary per phase with every request answered, the rows, None where this
    machine has no GPU (or the server no graph series), the log, and the server stopped with its Ray;
    then a warm restart."""
    opts, result = _measure(tiny_nemotron, tmp_path, "--requests", "4", "--warmup-requests", "2", "--concurrency",
                            "2", "--seed-levels", "1,2", "--warm-restart")

    cold = result["cold_start"]
    assert 0 < cold["health_200_s"] <= cold["first_completion_s"] < 150 and cold["model"] == tiny_nemotron.name
    assert cold["ready_line_s"] is not None and cold["first_completion_attempts"] >= 1
    for name, n in (("warmup", 2), ("homogeneous", 4), ("matched", 4), ("mixed", 4)):
        phase = result["phases"][name]
        assert phase["error"] is None and phase["summary"]["completed"] == n and phase["summary"]["failed"] == 0
        assert all(t is not None for t in phase["summary"]["ttfts"])
        assert set(phase["metrics_after"]) == set(SCRAPED)
        assert all(v is None or v >= 0 for v in phase["metrics_after"].values())
    # homogeneous, matched and mixed: the same prompts and max_tokens (ignore_eos: each commits what it asks)
    phases = result["phases"]
    assert phases["homogeneous"]["summary"]["output_lens"] == phases["matched"]["summary"]["output_lens"] \
        == phases["mixed"]["summary"]["output_lens"]
    assert [result["seed"][c]["summary"]["completed"] for c in ("warmup", "1", "2")] == [1, 1, 2]
    assert result["seed"]["2"]["summary"]["output_lens"] == [32, 32]

    rows = result["rows"]
    assert rows["mixed_over_homogeneous"] == pytest.approx(rows["mixed_tok_s"] / rows["homogeneous_tok_s"])
    split = rows["mixed_over_matched"] * rows["matched_over_homogeneous"]
    assert rows["mixed_over_homogeneous"] == pytest.approx(split)
    assert rows["mixed_p99_over_median"] >= 1 and rows["failed_requests"] == 0
    assert rows["seed_over_concurrency_1"]["1"] == 1.0 and rows["seed_tok_s"]["2"] > 0
    if result["phases"]["mixed"]["memory_after_mib"] is None:   # no nvidia-smi here
        assert rows["gpu_memory_mixed_minus_warmup_mib"] is None
    table = traffic.format_table(result)
    assert "mixed / homogeneous committed tok/s" in table and "seed workload tok/s at concurrency 2 / at 1" in table
    # the weight reads each phase took for its tokens (the server's dllm_passes_total), and the rows each carried
    for name in ("homogeneous", "matched", "mixed"):
        # (a pass whose rows are all done, idling to its command's end, counts no row: below 1 is possible)
        assert rows["passes"][name] > 0 and 0 < rows["rows_per_pass"][name] <= 2, (name, rows)
        assert 0 < rows["ms_per_pass"][name] < 1e3 * phases[name]["wall_s"], (name, rows)
        assert f"{name}: passes ({traffic._fmt(rows['rows_per_pass'][name])} rows, " \
               f"{traffic._fmt(rows['ms_per_pass'][name])} ms each)" in table
    assert 0 < rows["seed_rows_per_pass"]["2"] <= 2 and "seed at concurrency 2: ms a pass (" in table
    # the shards ran commands for part of each seed level's duration (the rest: HTTP, Ray, the scheduler)
    assert all(0 < rows["seed_busy_share"][c] <= 1.05 for c in ("1", "2")), rows["seed_busy_share"]
    assert rows["mixed_over_homogeneous_passes"] == rows["passes"]["mixed"] / rows["passes"]["homogeneous"]

    saved = json.loads(opts.out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["server_exit_status"] == 0
    log = opts.log.read_text().splitlines()
    assert log[1] == "# " + " ".join(result["server_command"]) and any(READY_LINE in line for line in log)
    assert all(re.match(r" *\d+\.\d{3} \d\d:\d\d:\d\d\.\d{3} \| ", line) for line in log[2:])  # stamped
    # the second start, on the caches the first one filled (under --work, a directory of this run,
    # removed at the end)
    warm = result["warm_start"]
    assert 0 < warm["health_200_s"] <= warm["first_completion_s"] < 150 and warm["model"] == tiny_nemotron.name
    assert result["warm_server_exit_status"] == 0 and "warm start: seconds to GET /health 200" in table
    assert Path(result["compile_cache"]).parent == opts.work and not Path(result["compile_cache"]).exists()
    assert traffic.warm_log(opts.log).is_file()
    deadline = time.monotonic() + 15   # killed processes take a moment to go
    while (_group_members(result["server_pid"]) or _group_members(result["warm_server_pid"])) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(result["server_pid"]) == _group_members(result["warm_server_pid"]) == []   # and their Rays


def test_the_server_gets_the_compile_caches_of_its_measurement(tmp_path):
    """A cold start is cold, and a warm restart warm, because the server (and the Ray it starts, which
    inherits its environment) keeps inductor's and triton's caches where the measurement says."""
    (tmp_path / "tree" / "scripts").mkdir(parents=True)
    (tmp_path / "tree" / "scripts" / "serve_local.py").write_text(
        "import os\nprint('caches', os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['TRITON_CACHE_DIR'])\n")
    env = traffic.compile_cache_env(tmp_path / "cache")
    server = ServerProcess(tmp_path / "tree", "m", [], tmp_path / "server.log", env=env)
    with server:
        server.proc.wait(30)
    assert f"caches {tmp_path / 'cache' / 'inductor'} {tmp_path / 'cache' / 'triton'}" in server.log_path.read_text()


def test_a_server_that_cannot_start_is_a_clear_error_within_its_bound(tmp_path):
    with pytest.raises(ServerError, match="has no scripts/serve_local.py"):
        ServerProcess(tmp_path, "m", [], tmp_path / "log")
    server = ServerProcess(ROOT, "/nonexistent", ["no_such_field=1"], tmp_path / "server.log")

    async def wait():
        async with httpx.AsyncClient() as http:
            return await server.wait_ready(http, 120, {"prompt": [1], "max_tokens": 1})

    with server, pytest.raises(ServerError, match=r"the server exited with status [1-9]") as err:
        asyncio.run(wait())
    assert "no_such_field" in str(err.value) and str(tmp_path / "server.log") in str(err.value)
    assert not server.alive()


def test_parse_metrics_sums_labels_and_reports_absent_series_as_none():
    text = ('# HELP dllm_graph_captures_total Graphs captured while serving\n# TYPE dllm_graph_captures_total counter\n'
            'dllm_graph_captures_total{model="m",kind="denoise"} 2.0\n'
            'dllm_graph_captures_total{model="m",kind="commit"} 1.0\n'
            '# TYPE dllm_cuda_graphs gauge\ndllm_cuda_graphs{model="m"} 40.0\n'
            '# TYPE dllm_free_slots gauge\ndllm_free_slots{model="m"} 8.0\n')
    assert parse_metrics(text, GRAPH_METRICS) == {"dllm_eager_steps_total": None, "dllm_graph_captures_total": 3.0,
                                                  "dllm_kernel_compiles_total": None, "dllm_cuda_graphs": 40.0,
                                                  "dllm_cuda_graph_memory_bytes": None}


def _phase(tok_s: float, median_ms: float, p99_ms: float, memory: float | None, captures: float | None,
           failed: int = 0, passes: float | None = None, forwards: float | None = None,
           duration_s: float = 10.0, busy_s: float | None = None) -> dict:
    metrics = dict.fromkeys(GRAPH_METRICS) | {"dllm_graph_captures_total": captures}
    delta = {"dllm_passes_total": passes, "dllm_forwards_total": forwards, "dllm_shard_busy_seconds_total": busy_s}
    return {"requests": 8, "memory_after_mib": memory, "metrics_after": metrics, "metrics_delta": delta,
            "wall_s": duration_s + 0.05,
            "summary": {"completed": 8 - failed, "failed": failed, "output_throughput": tok_s,
                        "median_e2el_ms": median_ms, "p99_e2el_ms": p99_ms, "duration": duration_s}}


def test_the_matched_phase_keeps_a_draws_algorithm_options_alone(tmp_path):
    """matched: each mixed request with its `diffusion` options (mode, policy) and no other; a mix that
    draws none (DiffusionGemma's built-in) has no matched phase, whose bodies would be the homogeneous ones."""
    mix = tmp_path / "mix.jsonl"
    mix.write_text(MIX)
    bodies = traffic.plan(traffic.parse_args(["--family", "nemotron-ld", "--mix", str(mix), "--requests", "24"]), "m")
    sampling = {"temperature", "top_k", "top_p", "logprobs"}
    for plain, matched, mixed in zip(bodies["homogeneous"], bodies["matched"], bodies["mixed"], strict=True):
        assert plain["prompt"] == matched["prompt"] == mixed["prompt"]
        assert plain["max_tokens"] == matched["max_tokens"] == mixed["max_tokens"]
        assert matched.get("diffusion") == mixed.get("diffusion") and not sampling & set(matched)
    assert sum("diffusion" in b for b in bodies["matched"]) > 0 and any(sampling & set(b) for b in bodies["mixed"])
    assert "matched" not in traffic.plan(traffic.parse_args(["--family", "diffusion-gemma"]), "m")


def test_the_schema_phases_constrain_only_their_constrained_groups():
    """--seed-schema: the seed workload's bodies, a JSON schema on the concurrency-1 phase and on the
    neighbours of the second pair only; each group half the highest seed level, rounds times over."""
    opts = traffic.parse_args(["--family", "diffusion-gemma", "--seed-levels", "1,8", "--seed-rounds", "2",
                               "--seed-schema"])
    bodies = traffic.plan(opts, "m")
    assert "schema_c1" not in traffic.plan(traffic.parse_args(["--family", "diffusion-gemma"]), "m")
    seed = bodies["seed"][0]
    for name, n, bound in (("schema_c1", 2, True), ("beside_plain_free", 8, False), ("beside_plain_other", 8, False),
                           ("beside_schema_free", 8, False), ("beside_schema_other", 8, True)):
        assert len(bodies[name]) == n, name
        for b in bodies[name]:
            assert (b.get("response_format") == traffic.SEED_SCHEMA) == bound, name
            assert {k: v for k, v in b.items() if k not in ("prompt", "response_format")} == \
                {k: v for k, v in seed.items() if k != "prompt"}


def test_rows_from_synthetic_phases():
    result = {"family": "diffusion-gemma", "server_tree": "/t", "server_commit": "abc",
              "cold_start": {"health_200_s": 50.0, "first_completion_s": 52.0},
              "phases": {"warmup": _phase(900, 1000, 1100, 70_000.0, 0.0),
                         "homogeneous": _phase(1000, 1000, 1500, 70_010.0, 0.0, passes=200, forwards=1400),
                         "mixed": _phase(920, 2000, 3600, 70_030.0, 2.0, failed=1, passes=200, forwards=1400,
                                         duration_s=12.0)},
              "seed": {"warmup": _phase(700, 1300, 1300, 70_030.0, 2.0), "1": _phase(800, 1300, 1300, 70_030.0, 2.0),
                       "2": _phase(1500, 1400, 1400, 70_030.0, 3.0, passes=80, forwards=160, duration_s=4.0,
                                   busy_s=3.6)}}
    rows = result["rows"] = traffic.derive(result, [1, 2])
    assert rows["mixed_over_homogeneous"] == pytest.approx(0.92) and rows["mixed_p99_over_median"] == 1.8
    assert rows["seed_schema_over_plain_c1"] is None and "JSON schema" not in traffic.format_table(result)
    with_schema = result | {"schema": {"c1": _phase(600, 1, 1, None, 2.0), "beside_plain_free": _phase(500, 1, 1, None, 2.0),
                                       "beside_schema_free": _phase(480, 1, 1, None, 2.0, failed=1)}}
    schema_rows = traffic.derive(with_schema, [1, 2])
    assert schema_rows["seed_schema_over_plain_c1"] == 0.75 and schema_rows["schema_neighbours_ratio"] == 0.96
    assert schema_rows["failed_requests"] == rows["failed_requests"] + 1
    assert rows["mixed_over_matched"] is None and "mixed / matched" not in traffic.format_table(result)
    # with a matched phase, the ratio in its two factors
    split = result | {"phases": result["phases"] | {"matched": _phase(800, 1000, 1200, 70_020.0, 0.0)}}
    split["rows"] = traffic.derive(split, [1, 2])
    assert split["rows"]["mixed_over_matched"] == pytest.approx(920 / 800)
    assert split["rows"]["matched_over_homogeneous"] == 0.8
    assert "mixed / matched (the options' own cost)" in traffic.format_table(split)
    assert rows["gpu_memory_mixed_minus_warmup_mib"] == 30.0 and rows["graph_captures_after_ready"] == 3.0
    assert rows["failed_requests"] == 1 and rows["seed_over_concurrency_1"] == {"1": 1.0, "2": 1.875}
    assert rows["eager_steps_while_serving"] is None and rows["kernel_compiles_while_serving"] is None   # no series
    # the phase's duration (tok/s's clock, not its wall time with the scrapes) over its passes
    assert rows["ms_per_pass"] == {"homogeneous": 50.0, "matched": None, "mixed": 60.0}
    assert rows["seed_ms_per_pass"] == {"1": None, "2": 50.0} and rows["seed_rows_per_pass"]["2"] == 2.0
    # the shards' execute time over the phase's duration (None without the series)
    assert rows["seed_busy_share"] == {"1": None, "2": pytest.approx(0.9)}
    table = traffic.format_table(result)
    assert "seed at concurrency 2: shards' busy share of the time" in table
    assert "seed at concurrency 1: shards' busy share" not in table
    assert "mixed: passes (7 rows, 60 ms each)" in table and "seed at concurrency 2: ms a pass (2 rows)" in table
    # a phase that timed out: its requests count as failed, its rows are None
    result["phases"]["mixed"] = {"requests": 8, "memory_after_mib": None, "summary": None,
                                 "metrics_after": dict.fromkeys(GRAPH_METRICS)}
    rows = traffic.derive(result, [1, 2])
    assert rows["mixed_over_homogeneous"] is None and rows["failed_requests"] == 8
    assert rows["gpu_memory_mixed_minus_warmup_mib"] is None

    # roofline's table carries the same rows, per family
    result["rows"] = rows
    table = roofline.summary({"traffic": {"diffusion-gemma": result, "nemotron-ld": {"error": "died"}}})
    assert "T diffusion-gemma: p99 / median request latency under the mix" in table
    assert "T diffusion-gemma: seed workload tok/s at concurrency 2 / at 1" in table and "1.875" in table
    assert "T nemotron-ld: the server did not start" in table and "P1 Nemotron-LD 8B" in table


def test_a_stopped_run_writes_the_figures_of_the_phases_that_ended(tmp_path, monkeypatch):
    """A bounded GPU call's end (SIGTERM) mid-run: the phases saved as they ended give a result file that
    says it was stopped, and the exit status says so too."""
    def stopped(opts):
        result = {"family": "nemotron-ld", "server_commit": "abc1234", "cold_start": {"health_200_s": 50.0},
                  "phases": {"homogeneous": _phase(1000, 1000, 1500, 70_010.0, 0.0, passes=200, forwards=1400)},
                  "seed": {}}
        result["rows"] = traffic.derive(result, opts.seed_levels)
        traffic.save(result, opts.out)
        raise KeyboardInterrupt

    monkeypatch.setattr(traffic, "measure", stopped)
    status = traffic.main(["--family", "nemotron-ld", "--out", str(tmp_path / "t.json"), "--results-dir", str(tmp_path)])
    assert status == 130
    [written] = [json.loads(f.read_text()) for f in tmp_path.glob("*-traffic.json")]
    assert "stopped midway" in written["note"] and written["commit"] == "abc1234"
    assert written["figures"]["traffic.nemotron-ld.cold_start_health_200_s"] == 50.0
    assert written["figures"]["traffic.nemotron-ld.homogeneous_tok_s"] > 0


def test_the_soak_fits_within_its_bound(monkeypatch):
    """--within shortens the soak to what the start leaves of it, less the reserve, never below
    MIN_SOAK_S; without it (or with room to spare) the soak is --seconds."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import soak_gpu
    monkeypatch.delenv("DLLM_SOAK_WITHIN_S", raising=False)
    monkeypatch.delenv("DLLM_SOAK_S", raising=False)
    assert soak_gpu.soak_seconds(soak_gpu.parse_args([]), 300) == 240
    assert soak_gpu.soak_seconds(soak_gpu.parse_args(["--within", "560"]), 306) == 560 - 306 - 90
    assert soak_gpu.soak_seconds(soak_gpu.parse_args(["--within", "560"]), 200) == 240
    assert soak_gpu.soak_seconds(soak_gpu.parse_args(["--within", "560"]), 500) == soak_gpu.MIN_SOAK_S
    monkeypatch.setenv("DLLM_SOAK_WITHIN_S", "400")
    assert soak_gpu.soak_seconds(soak_gpu.parse_args(["--within-reserve", "60"]), 100) == 240
    assert soak_gpu.soak_seconds(soak_gpu.parse_args(["--within-reserve", "60"]), 200) == 140


@pytest.mark.reliability
@pytest.mark.timeout(400)
def test_the_gpu_soak_script_against_the_tiny_model(tiny_nemotron, tmp_path):
    """scripts/soak_gpu.py end to end on CPU, 30-60 s: every kind of request, the burst (200s and 429s
    only), 0 errors, every slot free after, exit 0; a soak of 600 s asked for within 100 s of the start
    is shortened to what the start leaves (less the 40 s reserve asked for)."""
    run = subprocess.run([sys.executable, "scripts/soak_gpu.py", "--family", "nemotron-ld", "--model",
                          str(tiny_nemotron), "--server-arg", "device=cpu", "--seconds", "600", "--within", "100",
                          "--within-reserve", "40", "--sample-every", "2", "--out-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "soak-nemotron-ld.json").read_text())
    start_s = result["cold_start"]["first_completion_s"]
    assert result["soak_s"] == max(20.0, 100 - start_s - 40) and "(of 600: --within 100)" in run.stdout
    assert result["passed"] and result["errors"] == {} and result["slots_free_at_end"]
    assert set(result["burst"]["statuses"]) <= {"200", "429"} and result["burst"]["statuses"]["429"] > 0
    assert {"whole", "stream", "hangup"} <= set(result["requests"])
    assert result["resident_memory"] is not None and result["server_exit_status"] == 0
    assert "PASSED" in run.stdout


@pytest.mark.reliability
@pytest.mark.timeout(300)
def test_an_interrupted_gpu_soak_keeps_what_it_counted(tiny_nemotron, tmp_path):
    """SIGTERM (a caller's time limit) mid-soak: the server is stopped, exit 130, and the JSON holds the
    requests and errors counted so far, marked interrupted."""
    import signal
    proc = subprocess.Popen([sys.executable, "scripts/soak_gpu.py", "--family", "nemotron-ld", "--model",
                             str(tiny_nemotron), "--server-arg", "device=cpu", "--seconds", "600",
                             "--sample-every", "2", "--out-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:   # the first completion came: the soak runs
            lines.append(line)
            if "soaking" in line:
                break
        time.sleep(15)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, "".join(lines) + out
    result = json.loads((tmp_path / "soak-nemotron-ld.json").read_text())
    assert result["interrupted"] and result["errors"] == {} and sum(result["requests"].values()) > 0
    assert f"interrupted after {result['requests']}" in out
