"""Watching the server over real HTTP on tiny checkpoints (CPU): provisional streaming of drafts (raw SSE and
the real `openai` client; DiffusionGemma's are tests/test_http.py's, on its app of the same checkpoint and
settings), the playground page in headless Chromium, and the Prometheus metrics moving by exactly what a
known amount of traffic adds."""
import concurrent.futures as cf
import json
import os
import re
import signal

import httpx
import openai
import pytest
from ray import serve

from deployments.app import build_app
from deployments.drafts import PLACEHOLDER
from tests.serve_harness import raw_stream, serving, wait_until

pytestmark = pytest.mark.shared_serve

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def server(tiny_nemotron):
    with serving({"n": build_app({"model": str(tiny_nemotron), "served_model_name": "tiny", "max_model_len": 512,
                                  "max_num_seqs": 4, "max_steps_per_command": 8})}) as port:
        yield f"http://127.0.0.1:{port}"


def client(url: str, app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/{app}/v1", api_key="unused", max_retries=0, timeout=120)


def comparable(chunks) -> list:
    """What a client reads from openai's chunks (ids and timestamps aside)."""
    return [(c.choices[0].text, c.choices[0].finish_reason, c.choices[0].logprobs and c.choices[0].logprobs.tokens,
             c.choices[0].logprobs and c.choices[0].logprobs.token_logprobs) if c.choices else c.usage.model_dump()
            for c in chunks]


NEMOTRON = dict(model="tiny", prompt="Watch it think", max_tokens=64, temperature=0, logprobs=0,
                stream_options={"include_usage": True})
NEMOTRON_DIFFUSION = {"policy": "low_confidence", "max_denoising_steps": 8}


def test_masked_drafts_over_sse(server):
    body = dict(NEMOTRON, stream=True, ignore_eos=True,
                diffusion=dict(NEMOTRON_DIFFUSION, stream_drafts=True, draft_every=3))
    drafts, chunks = raw_stream(server, "n", body)
    committed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                 for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(committed) == 64 and chunks[-1]["usage"]["diffusion"]["canvases"] == 2
    # 8 steps per canvas: drafts after steps 3 and 6 of each
    assert [(d["canvas"], d["offset"], d["step"]) for d in drafts] == [(0, 0, 3), (0, 0, 6), (1, 32, 3), (1, 32, 6)]
    for d in drafts:
        assert d["object"] == "draft" and len(d["tokens"]) == len(d["cells"]) == len(d["known"]) == 32
        masked = [t is None for t in d["tokens"]]
        assert masked == [c is None for c in d["cells"]] == [not k for k in d["known"]] and any(masked)
        assert d["text"].count(PLACEHOLDER) == sum(masked)
        # what a draft shows as revealed is what the commit emits there (revealed tokens are absorbing)
        assert all(c == committed[d["offset"] + j] for j, c in enumerate(d["cells"]) if c is not None)
    assert drafts[1]["revealed"] == [j for j in range(32) if drafts[1]["known"][j] and not drafts[0]["known"][j]]
    assert drafts[2]["revealed"] == [j for j in range(32) if drafts[2]["known"][j]]


def test_openai_client_sees_the_same_chunks_with_drafts(server):
    """Drafts ride in SSE comments: the real client yields exactly the chunks it yields without them,
    and the committed tokens and logprobs are the same."""
    c = client(server, "n")
    kw = dict(NEMOTRON, stream=True)
    plain = list(c.completions.create(**kw, extra_body={"ignore_eos": True, "diffusion": NEMOTRON_DIFFUSION}))
    drafting = list(c.completions.create(**kw, extra_body={"ignore_eos": True, "diffusion": dict(
        NEMOTRON_DIFFUSION, stream_drafts=True, draft_every=2)}))
    assert comparable(drafting) == comparable(plain) and len(plain) >= 3


@pytest.mark.parametrize("diffusion,extra,param", [
    ({"draft_every": 0}, {"stream": True}, "diffusion.draft_every"),
    ({"stream_drafts": True, "draft_every": "x"}, {"stream": True}, "diffusion.draft_every"),
    ({"stream_drafts": True}, {}, "diffusion.stream_drafts"),
    ({"stream_drafts": True, "mode": "ar"}, {"stream": True}, "diffusion.stream_drafts"),
])
def test_bad_draft_options_are_400_naming_them(server, diffusion, extra, param):
    r = httpx.post(f"{server}/n/v1/completions", json={"model": "tiny", "prompt": "x", "diffusion": diffusion, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------------------------- metrics

def scrape(url: str, app: str) -> dict[str, float]:
    text = httpx.get(f"{url}/{app}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            values[name] = float(value)
    return values


def test_metrics_move_by_what_the_traffic_added(server):
    before = scrape(server, "n")
    c = client(server, "n")
    steps = {"policy": "low_confidence", "max_denoising_steps": 8}  # 9 steps a canvas: one commit per command
    usages = [c.completions.create(model="tiny", prompt="one", max_tokens=64, temperature=0,
                                   extra_body={"ignore_eos": True, "diffusion": steps}).usage,
              c.completions.create(model="tiny", prompt="two", max_tokens=32, temperature=0,
                                   extra_body={"ignore_eos": True, "diffusion": steps}).usage]
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "three"}],
                                            max_completion_tokens=96, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "diffusion": steps}))
    usages.append(chunks[-1].usage)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    after = scrape(server, "n")

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta('dllm_requests_total{endpoint="completions",status="200"}') == 2
    assert delta('dllm_requests_total{endpoint="chat_completions",status="200"}') == 1
    assert delta('dllm_requests_total{endpoint="completions",status="400"}') == 1
    assert delta('dllm_requests_total{endpoint="completions",status="404"}') == 1
    tokens = sum(u.completion_tokens for u in usages)
    diffusion = [u.model_extra["diffusion"] for u in usages]
    canvases = sum(d["canvases"] for d in diffusion)
    assert tokens == 192 and canvases == 6
    assert delta("dllm_committed_tokens_total") == tokens
    assert delta("dllm_canvases_total") == canvases
    assert delta("dllm_denoising_steps_total") == sum(d["denoising_steps"] for d in diffusion) == 6 * 8
    assert delta("dllm_canvas_positions_total") == 6 * 8 * 32
    assert delta('dllm_finished_requests_total{reason="length"}') == 3
    assert delta("dllm_time_to_first_token_seconds_count") == 3
    assert delta("dllm_e2e_request_latency_seconds_count") == 3
    assert delta("dllm_inter_block_latency_seconds_count") == canvases - 3   # one block per canvas
    assert delta("dllm_tokens_per_step_count") == 3
    assert delta("dllm_tokens_per_step_sum") == pytest.approx(3 * 32 / 8)
    assert delta('dllm_tokens_per_step_bucket{le="4.0"}') == 3 and delta('dllm_tokens_per_step_bucket{le="3.0"}') == 0
    assert after["dllm_free_slots"] == after["dllm_num_slots"] == 4 and after["dllm_waiting"] == 0
    assert delta("dllm_shard_restarts_total") == 0


# ------------------------------------------------------------------------------------------- playground

@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: `make` installs Debian's chromium for this test")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def test_playground_draws_the_canvas_filling_in(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1200, "height": 620})
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"error: {e}"))
    page.goto(f"{server}/n/playground")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')", timeout=30_000)
    settings = {"#prompt": "Once upon a time", "#steps": "16", "#max_tokens": "96", "#temperature": "1",
                "#seed": "7", "#draft_every": "2"}
    for selector, value in settings.items():
        page.fill(selector, value)
    page.select_option("#policy", "low_confidence")
    page.check("#ignore_eos")
    page.click("#go")
    try:
        page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                               timeout=120_000)
    finally:
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert page.inner_text("#status") == "done", console
    cells = page.eval_on_selector_all("#canvases .cell", "cs => cs.map(c => c.classList.contains('committed'))")
    assert cells == [True] * 96, "the grid never filled"
    drafts = page.evaluate("window.dllmPlayground.drafts")
    # drawn while the canvases were denoised: 8 drafts a canvas, the masks thinning out to none
    assert [(d["canvas"], d["step"]) for d in drafts] == [(k, s) for k in range(3) for s in range(2, 17, 2)]
    masked = [d["masked"] for d in drafts[:8]]
    assert masked == sorted(masked, reverse=True) and masked[0] > 0 and masked[-1] == 0
    text = page.evaluate("document.getElementById('text').textContent")
    expected = client(server, "n").completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=96, temperature=1, seed=7,
        extra_body={"ignore_eos": True, "diffusion": {"policy": "low_confidence", "max_denoising_steps": 16}}
    ).choices[0].text
    assert text == expected and text
    assert page.inner_text("#m-spc") == "16.00" and page.inner_text("#m-drafts") == "24"
    assert page.inner_text("#m-ttft").endswith(" ms")

    # the replay slider redraws the request as it was: after canvas 1's draft at step 8 (canvas 0
    # committed), its cells are part masked, part revealed
    events = page.evaluate("window.dllmPlayground.events.map(e => e.draft ? [e.draft.canvas, e.draft.step] : 'tokens')")
    at = events.index([1, 8]) + 1
    page.eval_on_selector("#replay", "(el, at) => { el.value = at; el.dispatchEvent(new Event('input')); }", at)
    states = page.eval_on_selector_all("#canvases .grid", "gs => gs.map(g => [...g.children].map(c => c.classList[1]))")
    assert len(states) == 2 and states[0] == ["committed"] * 32
    assert {"masked", "known", "revealed"} <= set(states[1])
    assert page.inner_text("#canvases .tag >> nth=1") == "canvas 1 · step 8"
    replayed = tmp_path / "playground-replay.png"
    page.screenshot(path=str(replayed), full_page=True)
    assert replayed.stat().st_size > 10_000
    page.close()


def test_playground_sends_a_schema_and_shows_the_constrained_canvas(server, browser):
    """A schema in the playground constrains its request (the answer validates, as the API's does) while the
    canvas draws; a schema that is not JSON is an error on the page, not a request."""
    import jsonschema

    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}}, "required": ["k"],
              "additionalProperties": False}
    page = browser.new_page(viewport={"width": 1200, "height": 620})
    page.goto(f"{server}/n/playground")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')", timeout=30_000)
    for selector, value in {"#prompt": "A key:", "#max_tokens": "32", "#temperature": "1", "#seed": "3",
                            "#draft_every": "1", "#schema": json.dumps(schema)}.items():
        page.fill(selector, value)
    page.click("#go")
    page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                           timeout=120_000)
    assert page.inner_text("#status") == "done"
    text = page.evaluate("document.getElementById('text').textContent")
    jsonschema.validate(json.loads(text), schema)
    assert page.evaluate("window.dllmPlayground.drafts.length") > 0
    page.fill("#schema", "{not json")
    page.click("#go")
    page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=30_000)
    assert "not JSON" in page.inner_text("#status")
    page.close()


# ----------------------------------------------------------------- a failure (last: it rebuilds the shards)

def test_a_shard_restart_and_its_503_are_counted(server):
    before = scrape(server, "n")
    # in a thread: playwright's sync API keeps an event loop running in this one, where handles refuse to block
    with cf.ThreadPoolExecutor(1) as pool:
        pids = pool.submit(lambda: serve.get_deployment_handle("Coordinator", app_name="n").stats.remote().result()
                           ).result()["shard_pids"]
    body = {"model": "tiny", "prompt": "doomed", "max_tokens": 320, "ignore_eos": True, "stream": True,
            "diffusion": {"policy": "low_confidence"}}
    with httpx.stream("POST", f"{server}/n/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and "error" not in line:
                os.kill(pids[0], signal.SIGKILL)   # the request is running: kill its only shard
                break
        rest = list(lines)
    assert any('"error"' in line for line in rest)
    wait_until(lambda: scrape(server, "n").get("dllm_shard_restarts_total", 0) > before["dllm_shard_restarts_total"],
               60, "the shard group to be rebuilt")
    after = scrape(server, "n")
    assert after["dllm_shard_restarts_total"] - before["dllm_shard_restarts_total"] == 1
    assert after["dllm_shard_failures_total"] - before["dllm_shard_failures_total"] == 1
    assert after.get('dllm_requests_total{endpoint="completions",status="503"}', 0) - \
        before.get('dllm_requests_total{endpoint="completions",status="503"}', 0) == 1
