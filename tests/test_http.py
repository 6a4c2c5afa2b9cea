"""The Serve app over real HTTP with the real `openai` client, on a tiny checkpoint on CPU. (Shard
faults: test_http_faults.py; overload and disconnects: test_http_load.py; bad input, each named by its
`param`: test_http_fuzz.py.)"""
import concurrent.futures as cf

import httpx
import openai
import pytest

from deployments.app import build_app
from model.tiny import write_diffusion_gemma
from tests.serve_harness import serving

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_nemotron, tmp_path_factory):
    common = dict(model=str(tiny_nemotron), served_model_name=MODEL, max_model_len=512, max_steps_per_command=8)
    gemma = write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma-http"), seed=0)
    with serving({"tp1": build_app({**common, "max_num_seqs": 4, "max_queue": 2, "api_key": KEY}),
                  "tp2": build_app({**common, "max_num_seqs": 4, "tensor_parallel_size": 2}),
                  "gemma": build_app({"model": str(gemma), "served_model_name": "gemma", "max_model_len": 256})}
                 ) as port:
        yield port


def client(server, app="tp1", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/{app}/v1", api_key=KEY, max_retries=0,
                         timeout=120, **kw)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_completion_with_logprobs(server):
    r = client(server).completions.create(model=MODEL, prompt="Hello world", max_tokens=40, logprobs=3, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 40
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset) == 40
    assert all(x <= 0 for x in lp.token_logprobs)
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) >= sampled - 1e-6
    assert r.usage.model_extra["diffusion"]["canvases"] == 2  # 40 tokens: two 32-token canvases


def test_streamed_completion_equals_unstreamed(server):
    c = client(server)
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=70, logprobs=1, **GREEDY)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert text == whole.choices[0].text
    assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert chunks[-1].usage.completion_tokens == 70
    assert len([ch for ch in chunks if ch.choices]) >= 3  # one chunk per committed block


def test_chat_with_top_logprobs_streamed_and_not(server):
    c = client(server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=20,
              logprobs=True, top_logprobs=2, **GREEDY)
    whole = c.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 20 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    streamed = [t.logprob for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-6)


def test_alone_equals_among_concurrent_neighbours(server):
    c = client(server)
    probe = dict(model=MODEL, prompt=[1, 300, 301, 302], max_tokens=45, logprobs=2, **GREEDY)
    alone = c.completions.create(**probe).choices[0]
    neighbours = [dict(model=MODEL, prompt=[1, 400 + i], max_tokens=10 + 13 * i, temperature=0.8, seed=i,
                       logprobs=[None, 0, 5][i % 3]) for i in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(c.completions.create, **kw) for kw in neighbours]
        mine = pool.submit(c.completions.create, **probe)
        together = mine.result().choices[0]
        for f in futures:
            f.result()
    assert together.text == alone.text
    assert together.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
    assert together.logprobs.top_logprobs == alone.logprobs.top_logprobs or all(
        a.keys() == b.keys() for a, b in zip(together.logprobs.top_logprobs, alone.logprobs.top_logprobs))


def test_tp2_over_ray_actors_equals_tp1(server):
    kw = dict(model=MODEL, prompt="Tensor parallel", max_tokens=50, logprobs=2, **GREEDY)
    a = client(server, "tp1").completions.create(**kw).choices[0]
    b = client(server, "tp2").completions.create(**kw).choices[0]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
    assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-4)
    sampled = dict(kw, temperature=1.0, seed=11, extra_body={"ignore_eos": True, "top_k": 50})
    a = client(server, "tp1").completions.create(**sampled).choices[0]
    b = client(server, "tp2").completions.create(**sampled).choices[0]
    assert a.logprobs.tokens == b.logprobs.tokens


def test_conflicts_unknown_model_auth_and_long_prompts(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="linear_spec.*temperature"):
        c.completions.create(model=MODEL, prompt="x", temperature=0.7, extra_body={"diffusion": {"mode": "linear_spec"}})
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server}/tp1/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=[1] + [300] * 600, max_tokens=4)
    assert err.value.body["param"] == "prompt"
    assert [m.id for m in c.models.list()] == [MODEL]


def test_health_and_metrics(server):
    """The counters count this test's own request (run alone, no earlier test's has), and /health shows
    its slot free again."""
    def committed_tokens() -> float:
        text = httpx.get(f"http://127.0.0.1:{server}/tp1/metrics", timeout=30).text
        for name in ("dllm_committed_tokens_total", "dllm_denoising_steps_total", "dllm_canvas_positions_total",
                     "dllm_canvases_total", "dllm_free_slots"):
            assert name in text
        (line,) = [line for line in text.splitlines() if line.startswith("dllm_committed_tokens_total")]
        return float(line.split()[-1])

    before = committed_tokens()
    r = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=8, **GREEDY)
    assert r.usage.completion_tokens == 8
    assert committed_tokens() - before >= 8   # a whole canvas is committed, of which 8 tokens are kept
    assert httpx.get(f"http://127.0.0.1:{server}/tp1/health", timeout=30).json() == {
        "status": "ok", "num_slots": 4, "free_slots": 4, "running": 0, "waiting": 0, "shard_failures": 0}


def test_diffusion_gemma_served_by_the_same_app(server):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/gemma/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="gemma", prompt="Hello", max_tokens=32, logprobs=2, seed=3, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    assert whole.usage.completion_tokens == 32 and whole.usage.model_extra["diffusion"]["canvases"] == 2
    assert len(whole.choices[0].logprobs.token_logprobs) == 32
    chunks = list(c.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    chat = c.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                     seed=1, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="gemma", prompt="x", max_tokens=4, extra_body={"diffusion": {"mode": "ar"}})
    assert err.value.body["param"] == "diffusion.mode" and "DiffusionGemma" in err.value.body["message"]
    fixed = c.completions.create(model="gemma", prompt="x", max_tokens=32, seed=2, extra_body={
        "ignore_eos": True, "diffusion": {"max_denoising_steps": 3, "confidence_threshold": 0, "t_min": 0.2}})
    assert fixed.usage.model_extra["diffusion"]["denoising_steps"] == 6  # 3 per canvas, per-request knobs
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="gemma", prompt="x", extra_body={"diffusion": {"t_min": 0.9, "t_max": 0.5}})
    assert "t_max" in err.value.body["message"]
