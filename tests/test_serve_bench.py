"""benchmarks/serve_bench: its statistics on synthetic timings, the request mix, the chunk counting, and
the CLI against the Serve app on CPU."""
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks import serve_bench
from benchmarks.bench_prompts import load_tokenizer
from benchmarks.bench_stats import RequestResult, chunk_gaps, format_report, summarize
from benchmarks.request_mix import BUILTIN, MixError, load_mix
from deployments.app import build_app
from tests.serve_harness import serving

pytestmark = pytest.mark.shared_serve

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


# ---- the mix ---------------------------------------------------------------------------------------

def _values(draws, get) -> set:
    return {get(d) for d in draws}


def test_builtin_mixes_draw_every_option_of_issue_23_deterministically():
    draws = load_mix("nemotron-ld").draw(3000, np.random.default_rng(0))
    assert draws == load_mix("nemotron-ld").draw(3000, np.random.default_rng(0))   # the seed decides all
    assert draws != load_mix("nemotron-ld").draw(3000, np.random.default_rng(1))
    assert _values(draws, lambda d: d.prompt_len) == set(range(16, 301))
    assert _values(draws, lambda d: d.max_tokens) == set(range(32, 129))
    options = [d.options for d in draws]
    assert _values(options, lambda o: o["temperature"]) == {0, 0.7, 1}
    assert _values(options, lambda o: o["top_p"]) == {1, 0.9, 0.5}
    assert _values(options, lambda o: o.get("logprobs", "none")) == {"none", 0, 1, 2, 5, 20}
    top_k = [o["top_k"] for o in options]
    assert {0, 1, 5, 17, 40, 100} <= set(top_k) and all(0 <= k < 500 for k in top_k)
    assert len(set(top_k) - {0, 1, 5, 17, 40, 100}) > 50   # "random below 500"
    assert _values(options, lambda o: o["diffusion"]["policy"]) == {"threshold", "low_confidence", "leftmost",
                                                                   "entropy_bound"}
    assert _values(options, lambda o: o["diffusion"]["mode"]) == {"diffusion", "ar"}
    assert all("logprobs" not in o for o in options if o.get("logprobs", "none") == "none")  # null: left out
    # DiffusionGemma: the same sampling options, no mode or policy (its one mode is diffusion)
    gemma = load_mix("diffusion-gemma").draw(500, np.random.default_rng(0))
    assert all(set(d.options) <= {"temperature", "top_k", "top_p", "logprobs"} for d in gemma)
    assert _values([d.options for d in gemma], lambda o: o["temperature"]) == {0, 0.7, 1}
    assert set(BUILTIN) == {"nemotron-ld", "diffusion-gemma"}


def test_a_mix_file_weights_nests_and_leaves_out_null(tmp_path):
    path = tmp_path / "mix.jsonl"
    path.write_text('{"weight": 3, "prompt_len": 8, "max_tokens": {"choice": [1, 2]}, "diffusion.mode": "ar", '
                    '"diffusion.policy": {"choice": ["leftmost", null]}, "stop": ["x", "y"]}\n\n'
                    '{"prompt_len": {"uniform": [2, 4]}, "max_tokens": 5, "temperature": {"uniform": [0.5, 1.5]}}\n')
    mix = load_mix(str(path))
    assert mix.source == str(path) and len(mix.lines) == 2 and mix.describe() == f"mix {path} (2 lines)"
    draws = mix.draw(2000, np.random.default_rng(3))
    first = [d for d in draws if d.prompt_len == 8]
    second = [d for d in draws if d.prompt_len != 8]
    assert 0.72 < len(first) / len(draws) < 0.78   # weight 3 : 1
    assert {d.max_tokens for d in first} == {1, 2} and {d.max_tokens for d in second} == {5}
    assert all(d.options["diffusion"]["mode"] == "ar" and d.options["stop"] == ["x", "y"] for d in first)
    assert {d.options["diffusion"].get("policy") for d in first} == {"leftmost", None}
    assert {d.prompt_len for d in second} == {2, 3, 4}
    assert all(0.5 <= d.options["temperature"] < 1.5 for d in second)
    assert len({d.options["temperature"] for d in second}) > 100   # floats: a continuous draw


@pytest.mark.parametrize("text, message", [
    ('{"prompt_len": 8, "max_tokens": 4}\n{"prompt_len": 8', "line 2: not JSON"),
    ('[1, 2]', "line 1: a line must be a JSON object, got list"),
    ('{"max_tokens": 4}', "line 1: prompt_len is required"),
    ('\n\n{"prompt_len": 0, "max_tokens": 4}', "line 3: prompt_len: must be a whole number >= 1, got 0"),
    ('{"prompt_len": {"uniform": [1.5, 9]}, "max_tokens": 4}', "line 1: prompt_len: uniform must give whole numbers"),
    ('{"prompt_len": 8, "max_tokens": {"choice": [4, null]}}',
     "line 1: max_tokens: must be a whole number >= 1, got null"),
    ('{"prompt_len": 8, "max_tokens": 4, "weight": 0}', "line 1: weight must be a number > 0, got 0"),
    ('{"prompt_len": 8, "max_tokens": 4, "top_k": {"uniform": [9, 1]}}', "line 1: top_k: uniform needs [lo, hi]"),
    ('{"prompt_len": 8, "max_tokens": 4, "top_k": {"choice": []}}', "line 1: top_k: choice needs a non-empty list"),
    ('{"prompt_len": 8, "max_tokens": 4, "diffusion": {"mode": "ar"}}', "line 1: diffusion: an object must be one of"),
    ('{"prompt_len": 8, "max_tokens": 4, "stream": true}', "line 1: field 'stream' cannot be drawn"),
    ('{"prompt_len": 8, "max_tokens": 4, "diffusion": null, "diffusion.mode": "ar"}',
     "line 1: 'diffusion' and a field"),
    ('', "no lines"),
])
def test_a_bad_mix_file_is_an_error_naming_its_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(MixError, match=re.escape(message)):
        load_mix(str(path))


def test_serve_bench_rejects_a_bad_mix_naming_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 8, "max_tokens": 4}\n{"prompt_len": -1, "max_tokens": 4}\n')
    with pytest.raises(SystemExit) as exit_:
        serve_bench.parse_args(["--mix", str(path)])
    assert exit_.value.code == 2
    assert f"--mix: {path} line 2: prompt_len: must be a whole number >= 1, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--mix", "no-such-mix"])
    assert "neither a built-in (nemotron-ld, diffusion-gemma) nor a file" in capsys.readouterr().err


# ---- chunk counting ----------------------------------------------------------------------------------

def _sse_transport(events: list[dict]) -> httpx.MockTransport:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ": a comment line\n\ndata: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, text=body,
                                                              headers={"content-type": "text/event-stream"}))


def _send(events: list[dict]) -> RequestResult:
    async def go():
        async with httpx.AsyncClient(transport=_sse_transport(events)) as client:
            return await serve_bench.send(client, "http://x/v1/completions", {}, 10, None)
    return asyncio.run(go())


def test_a_chunk_whose_tokens_decode_to_no_text_still_counts():
    """One canvas of tokens that decode to "" (special tokens of a dummy model), sent with the finish
    reason: the request's only output, so its TTFT (it had none: 2 of 12 requests on the dummy 26B-A4B)."""
    usage = {"prompt_tokens": 10, "completion_tokens": 64, "total_tokens": 74}
    res = _send([{"choices": [{"text": "", "finish_reason": "length"}]}, {"choices": [], "usage": usage}])
    assert res.ok and res.ttft is not None and len(res.chunk_times) == 1 and res.output_tokens == 64
    # every chunk with choices is an arrival, whatever its text; the usage chunk (no choices) is not
    res = _send([{"choices": [{"text": "", "finish_reason": None}]},
                 {"choices": [{"text": "a", "finish_reason": None}]},
                 {"choices": [{"text": "", "finish_reason": "length"}]}, {"choices": [], "usage": usage}])
    assert len(res.chunk_times) == 3 and len(res.itl) == 2 and res.tpot is not None


@pytest.fixture(scope="module")
def server(tiny_nemotron):
    with serving({"bench": build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "max_model_len": 256,
                                      "max_num_seqs": 4, "max_steps_per_command": 8})}) as port:
        yield f"http://127.0.0.1:{port}/bench"


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


def test_serve_bench_with_a_mix_file_against_the_serve_app(server, tiny_nemotron, tmp_path):
    """Each request's prompt length, max_tokens and options from a mix file: every request answered with
    its own max_tokens, text prompts of each drawn length, and the draws saved with the results."""
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"prompt_len": {"uniform": [4, 20]}, "max_tokens": {"choice": [8, 40]}, '
                   '"temperature": {"choice": [0, 0.7]}, "top_k": {"choice": [0, {"uniform": [1, 499]}]}, '
                   '"logprobs": {"choice": [null, 2]}, "diffusion.mode": {"choice": ["diffusion", "ar"]}}\n'
                   '{"prompt_len": 12, "max_tokens": 33, "diffusion.policy": "low_confidence"}\n')
    out = tmp_path / "mixed.json"
    args = ["--base-url", server, "--num-prompts", "8", "--max-concurrency", "4", "--mix", str(mix), "--ignore-eos",
            "--tokenizer", str(tiny_nemotron), "--save-result", str(out), "--disable-tqdm", "--seed", "5"]
    result = serve_bench.main(args)
    draws = result["mix"]["draws"]
    assert result["mix"]["source"] == str(mix) and len(draws) == 8 and len({d["prompt_len"] for d in draws}) > 1
    run = result["runs"][0]
    assert run["completed"] == 8 and run["failed"] == 0
    assert run["output_lens"] == [d["max_tokens"] for d in draws]   # ignore_eos: each its own max_tokens
    assert all(t is not None for t in run["ttfts"])
    assert result["prompts"].startswith("text, exactly ") and ".." in result["lengths"]
    assert json.loads(out.read_text())["mix"]["draws"] == draws
    assert out.with_suffix(".png").stat().st_size > 20_000   # the plot of a mixed run draws too
    # the same seed draws the same requests
    assert serve_bench.draw_mix(serve_bench.parse_args(args)) == serve_bench.draw_mix(serve_bench.parse_args(args))
