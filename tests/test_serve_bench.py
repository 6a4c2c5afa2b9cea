"""benchmarks/serve_bench: its statistics on synthetic timings, and the CLI against the Serve app on CPU."""
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from benchmarks import serve_bench
from benchmarks.bench_prompts import load_tokenizer
from benchmarks.bench_stats import RequestResult, chunk_gaps, format_report, summarize
from deployments.app import build_app
from tests.serve_harness import start_serve, stop_serve

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
CANVAS = 32  # the tiny Nemotron-LD checkpoint's block_size


def _result(times: list[float], latency: float, out: int, diffusion: dict | None = None) -> RequestResult:
    usage = {"prompt_tokens": 10, "completion_tokens": out, "total_tokens": 10 + out}
    if diffusion is not None:
        usage["diffusion"] = diffusion
    return RequestResult(ok=True, input_tokens=10, output_tokens=out, chunk_times=times, latency=latency, usage=usage)


def test_statistics_on_synthetic_timings():
    assert chunk_gaps([0.5, 0.75, 1.5]) == [0.25, 0.75] and chunk_gaps([0.5]) == [] and chunk_gaps([]) == []
    a = _result([0.1, 0.3, 0.6], 0.7, 65, {"denoising_steps": 10, "canvases": 3, "canvas_positions": 320})
    b = _result([0.2, 0.4], 0.5, 33, {"denoising_steps": 4, "canvases": 2, "canvas_positions": 128})
    failed = RequestResult(error="HTTP 503: busy", input_tokens=10)
    assert a.ttft == 0.1 and a.itl == pytest.approx([0.2, 0.3])
    s = summarize([a, b, failed], duration=2.0, max_concurrency=2, request_rate=float("inf"), percentiles=[50, 90])

    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 20, 98)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 49.0 and s["total_token_throughput"] == 59.0
    # TTFT over requests: 100 and 200 ms.
    assert (s["mean_ttft_ms"], s["median_ttft_ms"]) == pytest.approx((150.0, 150.0))
    assert s["p90_ttft_ms"] == pytest.approx(190.0)  # linear interpolation between the two
    # ITL over every chunk gap of every request: 200, 300 (a) and 200 (b) ms.
    assert (s["mean_itl_ms"], s["median_itl_ms"]) == pytest.approx((700 / 3, 200.0))
    assert s["p90_itl_ms"] == pytest.approx(280.0)
    # TPOT per request, per token after the first: (0.7 - 0.1) / 64 and (0.5 - 0.2) / 32 s.
    assert s["mean_tpot_ms"] == pytest.approx((600 / 64 + 300 / 32) / 2)
    assert s["mean_e2el_ms"] == pytest.approx(600.0) and s["errors"] == ["", "", "HTTP 503: busy"]
    assert s["itls"][2] == [] and s["ttfts"][2] is None and s["e2els"][2] is None

    d = s["diffusion"]
    assert (d["committed_tokens"], d["denoising_steps"], d["canvases"], d["canvas_positions"]) == (98, 14, 5, 448)
    assert d["committed_throughput"] == 49.0 and d["steps_per_canvas"] == 14 / 5 and d["committed_per_step"] == 7.0

    report = format_report(s, [50, 90], ["ttft", "tpot", "itl"])
    assert "Successful requests:                     2" in report
    assert "P90 ITL (ms):                            280.00" in report
    assert "Canvas positions evaluated:              448" in report
    # A server without diffusion usage: no Diffusion Decoding block; an old one without canvas_positions: n/a.
    plain = summarize([_result([0.1], 0.1, 1)], 1.0, None, 1.0, [99])
    assert plain["diffusion"] is None and "Diffusion Decoding" not in format_report(plain, [99], ["ttft"])
    old = summarize([_result([0.1], 0.1, 4, {"denoising_steps": 2, "canvases": 1})], 1.0, None, 1.0, [99])
    assert old["diffusion"]["canvas_positions"] is None
    assert "Canvas positions evaluated:              n/a" in format_report(old, [99], [])


@pytest.fixture(scope="module")
def server(tiny_nemotron):
    port = start_serve()
    serve.run(build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "max_model_len": 256,
                         "max_num_seqs": 4, "max_steps_per_command": 8}), name="bench", route_prefix="/bench")
    yield f"http://127.0.0.1:{port}/bench"
    stop_serve()


def test_usage_reports_canvas_positions(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    usage = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["usage"]
    d = usage["diffusion"]
    assert d["canvases"] == 2 and d["denoising_steps"] >= 2
    assert d["canvas_positions"] == d["denoising_steps"] * CANVAS


def test_serve_bench_sweep_against_the_serve_app(server, tiny_nemotron, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.serve_bench", "--base-url", server, "--num-prompts", "6",
           "--max-concurrency", "1,2", "--random-input-len", "16", "--random-output-len", "40", "--ignore-eos",
           "--tokenizer", str(tiny_nemotron), "--save-result", str(out), "--metric-percentiles", "50,99"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    stdout = run.stdout
    for section in ("Serving Benchmark Result", "Time to First Token", "Time per Output Token (excl. 1st token)",
                    "Inter-token Latency", "Diffusion Decoding", "Concurrency Sweep"):
        assert section in stdout
    assert stdout.count("Successful requests:                     6") == 2
    assert "Committed per denoising step:" in stdout and "Canvas positions evaluated:" in stdout
    assert "concurrency 2" in run.stderr  # the progress bar, one per level

    result = json.loads(out.read_text())
    assert result["model"] == MODEL and result["args"]["max_concurrency"] == [1, 2]
    assert result["prompts"].startswith("text, exactly 16 tokens")
    tok = load_tokenizer(str(tiny_nemotron))
    added = len(tok("x").input_ids) - len(tok("x", add_special_tokens=False).input_ids)  # the server's BOS
    for run_, concurrency in zip(result["runs"], (1, 2)):
        assert run_["max_concurrency"] == concurrency and run_["completed"] == 6 and run_["failed"] == 0
        assert run_["input_lens"] == [16 + added] * 6 and run_["output_lens"] == [40] * 6
        assert run_["total_output_tokens"] == 240 and run_["output_throughput"] == pytest.approx(240 / run_["duration"])
        # 40 tokens = a 32-token canvas, then the next one cut at 8: two streamed blocks, one gap.
        assert all(len(gaps) == 1 and gaps[0] > 0 for gaps in run_["itls"])
        assert all(0 < t < e for t, e in zip(run_["ttfts"], run_["e2els"]))
        assert run_["p50_itl_ms"] == pytest.approx(float(np.median([g for gaps in run_["itls"] for g in gaps])) * 1e3)
        d = run_["diffusion"]
        assert d["requests"] == 6 and d["committed_tokens"] == 240 and d["canvases"] == 12
        assert d["canvas_positions"] == d["denoising_steps"] * CANVAS and d["denoising_steps"] >= 12
        assert d["committed_per_step"] == pytest.approx(240 / d["denoising_steps"])

    png = out.with_suffix(".png")
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] >= 1000 and 400 <= image.size[1] < image.size[0]
        assert len(image.convert("L").getcolors()) > 16  # drawn on, not a blank canvas
    assert 20_000 < png.stat().st_size < 400_000


def test_token_id_prompts_without_a_tokenizer(server, capsys):
    # "tiny" is no tokenizer anywhere on disk: prompts fall back to random token ids, sent as they are.
    result = serve_bench.main(["--base-url", server + "/v1", "--model", MODEL, "--num-prompts", "2",
                               "--max-concurrency", "2", "--random-input-len", "12", "--random-output-len", "8",
                               "--ignore-eos", "--disable-tqdm"])
    assert result["prompts"].startswith("token ids, 12 each") and result["tokenizer"] is None
    run = result["runs"][0]
    assert run["completed"] == 2 and run["input_lens"] == [12, 12] and run["output_lens"] == [8, 8]
    assert "Diffusion Decoding" in capsys.readouterr().out
