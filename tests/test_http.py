"""The Serve app over real HTTP with the real `openai` client, on a tiny checkpoint on CPU. (Shard
faults: test_http_faults.py; overload and disconnects: test_http_load.py; bad input, each named by its
`param`: test_http_fuzz.py.)"""
import asyncio
import concurrent.futures as cf
import json
import shutil
import threading
import time

import httpx
import openai
import pytest
from ray import serve

from deployments.app import build_app
from deployments.ingress import OpenAIIngress
from deployments.args import AppArgs
from deployments.choices import choice_seed
from deployments.drafts import PLACEHOLDER
from model.checkpoint import Checkpoint
from model.tiny import write_diffusion_gemma
from tests.serve_harness import assert_openai_error, raw_stream, serving, sse_payloads, wait_until
from workers.request import RequestOutput

pytestmark = pytest.mark.shared_serve

KEY = "test-key"
MODEL = "tiny"
TP1_BODY_LIMIT = 2**20
# tp2's checkpoint: the same weights, a generation_config.json with sampling defaults (greedy) and a length
TP2_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 40}


FAILING_SEED = 41   # the stand-in coordinator fails choice 1 of a request with this seed


@serve.deployment(name="Coordinator")
class StandInCoordinator:
    """Answers like the real coordinator (an admission output, then a block), then holds each request open
    (up to 60 s) without finishing it, except choice 1 of a request seeded FAILING_SEED, which then fails
    as a shard failure does; it counts the requests whose stream the ingress cancelled."""

    def __init__(self):
        self.cancelled = 0

    def stats(self) -> dict:
        return {"state": "ready", "num_slots": 8, "free_slots": 8, "running": 0, "waiting": 0, "shard_failures": 0}

    async def check_health(self) -> None:
        pass

    def cancellations(self) -> int:
        return self.cancelled

    async def generate(self, prompt, params, request_id=None):
        ended = False
        try:
            yield {"output": RequestOutput(request_id)}
            yield {"output": RequestOutput(request_id, new_tokens=[300, 301, 302])}
            if params.seed == choice_seed(FAILING_SEED, 1):
                await asyncio.sleep(0.5)
                ended = True
                yield {"error": "shard_failure", "message": "model shard failed: injected", "param": None}
                return
            await asyncio.sleep(60)
            ended = True
        finally:
            if not ended:
                self.cancelled += 1


@pytest.fixture(scope="module")
def server(tiny_nemotron, tmp_path_factory):
    common = dict(served_model_name=MODEL, max_model_len=512, max_steps_per_command=8)
    gemma = write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma-http"), seed=0)
    greedy = shutil.copytree(tiny_nemotron, tmp_path_factory.mktemp("tiny-nemotron-greedy") / "ckpt")
    (greedy / "generation_config.json").write_text(json.dumps(TP2_GENERATION))
    with serving({"tp1": build_app({**common, "model": str(tiny_nemotron), "max_num_seqs": 4, "max_queue": 2,
                                    "api_key": KEY, "max_body_bytes": TP1_BODY_LIMIT}),
                  "tp2": build_app({**common, "model": str(greedy), "max_num_seqs": 4, "tensor_parallel_size": 2,
                                    "max_body_bytes": 64 * 2**20}),
                  "gemma": build_app({"model": str(gemma), "served_model_name": "gemma", "max_model_len": 256}),
                  "standin": OpenAIIngress.bind(StandInCoordinator.bind(), AppArgs(
                      model=str(tiny_nemotron), served_model_name=MODEL).model_dump(), Checkpoint.read(tiny_nemotron))}
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
    # its pages given back: the KV cache holds 4 x (512 + a canvas) positions, none of them held
    assert httpx.get(f"http://127.0.0.1:{server}/tp1/health", timeout=30).json() == {
        "status": "ok", "num_slots": 4, "free_slots": 4, "running": 0, "waiting": 0, "shard_failures": 0,
        "kv_cache_tokens": 4 * (512 + 32), "kv_cache_usage": 0.0}


def test_a_conversations_next_turn_is_served_from_the_cache(server):
    """A chat's second turn resends the first and its answer: OpenAI's usage.prompt_tokens_details.
    cached_tokens counts what the prefix cache served, streamed and not (the same answer), and /metrics
    counts the lookups and hits in tokens. (A cached answer against a cold one: tests/test_prefix_cache.py.)"""
    def scrape() -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{server}/tp1/metrics", timeout=30).text
        return {name: float(line.split()[-1]) for line in text.splitlines() for name in
                ("dllm_prefix_cache_queries_total", "dllm_prefix_cache_hits_total") if line.startswith(name)}

    c = client(server)
    system = {"role": "system", "content": "You answer in the words of Python's documentation. " * 12}
    turn1 = [system, {"role": "user", "content": "Hello"}]
    kw = dict(model=MODEL, max_completion_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    first = c.chat.completions.create(messages=turn1, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    before = scrape()
    second = c.chat.completions.create(messages=turn2, **kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    after = scrape()
    assert after["dllm_prefix_cache_queries_total"] - before["dllm_prefix_cache_queries_total"] == \
        second.usage.prompt_tokens
    assert after["dllm_prefix_cache_hits_total"] - before["dllm_prefix_cache_hits_total"] == cached
    chunks = list(c.chat.completions.create(messages=turn2, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == second.choices[0].message.content


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


def test_uniform_noise_drafts_over_sse(server):
    """DiffusionGemma's drafts over raw SSE (Nemotron-LD's: tests/test_watch_http.py), on this module's gemma
    app rather than an app of its own with the same checkpoint and settings."""
    base = {"model": "gemma", "prompt": "noise", "max_tokens": 32, "seed": 4, "logprobs": 0, "stream": True,
            "ignore_eos": True}
    fixed = {"max_denoising_steps": 4, "confidence_threshold": 0}
    host = f"http://127.0.0.1:{server}"
    drafts, chunks = raw_stream(host, "gemma", {**base, "diffusion": {**fixed, "stream_drafts": True, "draft_every": 2}})
    _, plain = raw_stream(host, "gemma", {**base, "diffusion": fixed})
    assert [ch["choices"] for ch in chunks] == [ch["choices"] for ch in plain]
    committed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert [(d["offset"], d["step"]) for d in drafts] == [(0, 2), (0, 4), (16, 2), (16, 4)]
    for d in drafts:  # no mask token: the argmax canvas, every position shown; `known` = accepted
        assert None not in d["tokens"] and PLACEHOLDER not in d["text"] and any(d["known"])
        if d["step"] == 4:  # the converged step: the canvas the commit emits
            assert d["cells"] == committed[d["offset"]:d["offset"] + 16]


def url(server, app: str, path: str) -> str:
    return f"http://127.0.0.1:{server}/{app}/v1{path}"


def test_chat_length_defaults_to_the_rest_of_the_context_in_whole_canvases(server):
    """A chat request without a length writes what the prompt leaves of max_model_len, in whole canvases
    (vLLM's default; canvas modes write whole canvases), or what generation_config.json's max_new_tokens
    says; a completion without one keeps OpenAI's 16."""
    messages = [{"role": "user", "content": "Tell me everything"}]
    for app, canvas, max_model_len in [("tp1", 32, 512), ("gemma", 16, 256)]:
        c = client(server, app)
        r = c.chat.completions.create(model=MODEL if app == "tp1" else "gemma", messages=messages, seed=1,
                                      extra_body={"ignore_eos": True})
        room = (max_model_len - r.usage.prompt_tokens) // canvas * canvas
        assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length", (app, r.usage)
    ar = client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={
        "ignore_eos": True, "diffusion": {"mode": "ar"}})
    assert ar.usage.completion_tokens == 512 - ar.usage.prompt_tokens   # no canvas: every position
    capped = client(server, "tp2").chat.completions.create(model=MODEL, messages=messages,
                                                          extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == TP2_GENERATION["max_new_tokens"]
    assert client(server).completions.create(model=MODEL, prompt="x", extra_body={
        "ignore_eos": True}).usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as err:   # a prompt that leaves less than a canvas
        client(server).completions.create(model=MODEL, prompt=[1] + [300] * 490)
    assert err.value.body["param"] == "prompt" and "canvas of 32" in err.value.body["message"]


def test_sampling_defaults_come_from_generation_config(server):
    """tp2's generation_config.json says temperature 0: a request naming none is greedy (the same as one
    saying 0, whatever its seed), and a request's own temperature wins."""
    c = client(server, "tp2")
    kw = dict(model=MODEL, prompt="Defaults from the checkpoint", max_tokens=40, extra_body={"ignore_eos": True})
    silent = [c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2)]
    greedy = c.completions.create(temperature=0, **kw).choices[0].text
    assert silent == [greedy, greedy]
    assert c.completions.create(temperature=1.0, seed=1, **kw).choices[0].text != greedy
    # tp1's checkpoint names no temperature: OpenAI's 1, so seeds differ
    plain = client(server)
    assert len({plain.completions.create(seed=s, **kw).choices[0].text for s in (1, 2)}) == 2


def test_models_retrieve(server):
    c = client(server)
    card = c.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model") and card.model_extra["max_model_len"] == 512
    assert card == c.models.list().data[0]
    for unknown in ("nope", "org/tiny"):
        with pytest.raises(openai.NotFoundError) as err:
            c.models.retrieve(unknown)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url(server, "tp1", ""), api_key="wrong", max_retries=0).models.retrieve(MODEL)


AUTH = {"authorization": f"Bearer {KEY}"}


def test_request_id_is_echoed_and_names_the_response(server):
    body = {"model": MODEL, "prompt": "id", "max_tokens": 4}
    r = httpx.post(url(server, "tp1", "/completions"), json=body, headers=AUTH | {"x-request-id": "trace-7"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-7"
    assert r.headers.get_list("x-request-id") == ["trace-7"]   # Serve's proxy echoes it, once
    made = httpx.post(url(server, "tp1", "/completions"), json=body, headers=AUTH, timeout=60)
    (made_id,) = made.headers.get_list("x-request-id")
    assert made.json()["id"] == f"cmpl-{made_id}"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
    r = httpx.post(url(server, "tp1", "/chat/completions"), json=chat, headers=AUTH | {"x-request-id": "s-1"},
                   timeout=60)
    chunks = [json.loads(p) for p in sse_payloads(r.text.splitlines()) if p != "[DONE]"]
    assert r.headers["x-request-id"] == "s-1" and len(chunks) >= 3 and {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    r = httpx.post(url(server, "tp1", "/completions"), json={**body, "max_tokens": 0}, headers=AUTH | {
        "x-request-id": "bad-1"}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"   # errors carry it too

    # one id for requests in flight together: each is served, with that id
    slow = {"model": MODEL, "prompt": "same id", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "diffusion": {"policy": "low_confidence"}}
    with cf.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: httpx.post(url(server, "tp1", "/completions"), json=slow, timeout=120,
                                                     headers=AUTH | {"x-request-id": "dup"}), range(3)))
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert {a.json()["id"] for a in answers} == {"cmpl-dup"} and len({a.json()["choices"][0]["text"]
                                                                      for a in answers}) == 1


def test_key_before_body_and_body_size_limit(server):
    """No key: a 401 whatever the body (no detail of it is judged). With the key, a body over
    max_body_bytes is a 413 from its Content-Length, or as a chunked upload streams in."""
    completions = url(server, "tp1", "/completions")
    for content in (b"{not json", b'{"model": 5}', b"x" * (TP1_BODY_LIMIT + 1)):
        r = httpx.post(completions, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 401, r.text[:200]
        assert_openai_error(r.json(), 401)
    big = json.dumps({"model": MODEL, "prompt": "x" * TP1_BODY_LIMIT}).encode()
    r = httpx.post(completions, content=big, headers=AUTH | {"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and str(TP1_BODY_LIMIT) in assert_openai_error(r.json(), 413)["message"]

    def chunked():
        for i in range(0, len(big), 2**16):
            yield big[i:i + 2**16]
    r = httpx.post(completions, content=chunked(), headers=AUTH | {"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:200]
    assert_openai_error(r.json(), 413)
    r = client(server).completions.create(model=MODEL, prompt="still fine", max_tokens=4)
    assert r.usage.completion_tokens >= 1


def test_a_huge_prompt_does_not_stall_the_api(server):
    """A 16 MB prompt is refused from its length in characters, untokenized (the tiny tokenizer takes ~8 s
    for it on a 2-core machine, on the event loop it would hold every request that long); a small request
    sent beside it is answered in about its usual time."""
    completions = url(server, "tp2", "/completions")
    small = {"model": MODEL, "prompt": "small", "max_tokens": 4, "temperature": 0}
    start = time.monotonic()
    assert httpx.post(completions, json=small, timeout=60).status_code == 200
    alone = time.monotonic() - start
    huge = json.dumps({"model": MODEL, "prompt": "hello world " * (16 * 2**20 // 12), "max_tokens": 4}).encode()
    result = {}

    def send_huge():
        result["r"] = httpx.post(completions, content=huge, headers={"content-type": "application/json"}, timeout=120)
    sender = threading.Thread(target=send_huge)
    sender.start()
    time.sleep(0.3)   # its upload under way
    start = time.monotonic()
    r = httpx.post(completions, json=small, timeout=60)
    beside = time.monotonic() - start
    sender.join(120)
    assert r.status_code == 200 and beside < alone + 2.5, (alone, beside)
    big = result["r"]
    assert big.status_code == 400 and "characters" in assert_openai_error(big.json(), 400, "prompt")["message"]


def test_openai_defaults_at_their_no_op_values_are_accepted(server):
    """What SDKs and chat front-ends send by default changes nothing; a value that would change the output
    and is not implemented is a 400 naming the field and saying why."""
    c = client(server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=20, **GREEDY)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    noops = c.chat.completions.create(presence_penalty=0, frequency_penalty=0, logit_bias={}, top_p=1,
                                      response_format={"type": "text"}, parallel_tool_calls=False, store=False,
                                      user="someone", n=1, **kw)
    assert noops.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(presence_penalty=0.5, **kw)
    assert err.value.body["param"] == "presence_penalty" and "in parallel" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(functions=[{"name": "f"}], **kw)
    assert err.value.body["param"] == "functions" and "use tools" in err.value.body["message"]


# ---- n, prompt lists, /tokenize and /detokenize, DiffusionGemma's temperature ------------------------

def test_n_choices_have_their_own_seeds_and_each_equals_its_seed_alone(server):
    """n = 3 with a seed: three distinct choices, index 0..2, usage summed (the prompt counted once); the
    same request answers the same; choice j equals the request sent alone with n = 1 and choice j's seed;
    at temperature 0 masked diffusion's choices are equal."""
    c = client(server)
    kw = dict(model=MODEL, prompt="Choices", max_tokens=32, temperature=1.0, logprobs=1,
              extra_body={"ignore_eos": True})
    r = c.completions.create(n=3, seed=5, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len({ch.text for ch in r.choices}) == 3
    assert r.usage.completion_tokens == 3 * 32 and r.usage.total_tokens == r.usage.prompt_tokens + 96
    assert r.usage.model_extra["diffusion"]["canvases"] == 3
    with cf.ThreadPoolExecutor(4) as pool:
        again = pool.submit(c.completions.create, n=3, seed=5, **kw)
        alone = list(pool.map(lambda j: c.completions.create(n=1, seed=choice_seed(5, j), **kw), range(3)))
        assert [ch.text for ch in again.result().choices] == [ch.text for ch in r.choices]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    for j, a in enumerate(alone):
        assert a.choices[0].text == r.choices[j].text
        assert a.choices[0].logprobs.token_logprobs == pytest.approx(r.choices[j].logprobs.token_logprobs, abs=1e-4)
    greedy = c.completions.create(n=2, **(kw | {"temperature": 0}))
    assert greedy.choices[0].text == greedy.choices[1].text


def test_prompt_lists_streamed_and_not_and_tokenize(server):
    """A list of prompts with n = 2: choice index = prompt_index * n + j, in order; streamed, every chunk
    carries its index, each choice ends with its own finish chunk, and the usage chunk sums them all;
    the prompts as token-id lists (from /tokenize) answer the same."""
    c = client(server)
    texts = ["First prompt", "Second one"]
    kw = dict(model=MODEL, max_tokens=40, n=2, seed=9, temperature=0.9, extra_body={"ignore_eos": True})
    whole = c.completions.create(prompt=texts, **kw)
    assert [ch.index for ch in whole.choices] == [0, 1, 2, 3]
    tokenize = httpx.post(f"http://127.0.0.1:{server}/tp1/tokenize", headers=AUTH, timeout=60,
                          json={"model": MODEL, "prompt": texts[1]}).json()
    ids = [httpx.post(f"http://127.0.0.1:{server}/tp1/tokenize", headers=AUTH, json={"prompt": t}, timeout=60
                      ).json()["tokens"] for t in texts]
    assert tokenize == {"count": len(ids[1]), "max_model_len": 512, "tokens": ids[1], "token_strs": None}
    assert whole.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and whole.usage.completion_tokens == 4 * 40
    by_ids = c.completions.create(prompt=ids, **kw)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in whole.choices]
    # the prompts one by one: the same seeds, so the same choices
    second = c.completions.create(prompt=texts[1], **kw)
    assert [ch.text for ch in second.choices] == [ch.text for ch in whole.choices[2:]]

    chunks = list(c.completions.create(prompt=texts, stream=True, stream_options={"include_usage": True}, **kw))
    streamed, finishes = {}, {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert streamed == {ch.index: ch.text for ch in whole.choices} and finishes == dict.fromkeys(range(4), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 160
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    chat = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, seed=1,
                                          max_completion_tokens=20, stream=True, extra_body={"ignore_eos": True}))
    roles = [ch.choices[0].index for ch in chat if ch.choices[0].delta.role == "assistant"]
    ends = [ch.choices[0].index for ch in chat if ch.choices[0].finish_reason is not None]
    assert sorted(roles) == [0, 1] and sorted(ends) == [0, 1]


def test_choice_limits(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="x", n=9)
    assert err.value.body["param"] == "n" and "max_n=8" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=["x"] * 9, n=8)
    assert err.value.body["param"] == "n" and "max_choices=64" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=[[1, 300], [1] + [300] * 600])
    assert err.value.body["param"] == "prompt[1]"


def test_tokenize_and_detokenize(server):
    """vLLM's shapes: a chat's tokens are what /v1/chat/completions counts as its prompt; detokenize gives
    the text back; the key is asked first; bad token ids are a 400 naming `tokens`."""
    base = f"http://127.0.0.1:{server}/tp1"
    messages = [{"role": "user", "content": "Say hi"}]
    chat = httpx.post(f"{base}/tokenize", headers=AUTH, timeout=60, json={"messages": messages}).json()
    used = client(server).chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    assert chat["count"] == len(chat["tokens"]) == used.usage.prompt_tokens and chat["max_model_len"] == 512
    gemma = f"http://127.0.0.1:{server}/gemma/tokenize"   # its template writes a generation prompt
    turn, bare = (httpx.post(gemma, timeout=60, json={"messages": messages, "add_generation_prompt": g,
                                                       "return_token_strs": True}).json() for g in (True, False))
    assert bare["count"] < turn["count"] and bare["tokens"] == turn["tokens"][:bare["count"]]
    assert "".join(turn["token_strs"][bare["count"]:]).replace("\u2581", " ").startswith("<start_of_turn>")
    text = httpx.post(f"{base}/tokenize", headers=AUTH, timeout=60, json={"prompt": "Hello world",
                                                                        "add_special_tokens": False}).json()
    back = httpx.post(f"{base}/detokenize", headers=AUTH, timeout=60, json={"model": MODEL, "tokens": text["tokens"]})
    assert back.json() == {"prompt": "Hello world"}
    for path, body, status, param in [
            ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"), ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
            ("/detokenize", {"tokens": "1"}, 400, "tokens"), ("/tokenize", {"prompt": "x", "model": "nope"}, 404,
                                                              "model"),
            ("/tokenize", {"messages": messages, "continue_final_message": True}, 400, "continue_final_message"),
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt")]:
        r = httpx.post(base + path, headers=AUTH, json=body, timeout=60)
        assert_openai_error(r.json(), status, param)
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(base + path, json={"bogus": 1}, timeout=60)   # no key: 401 whatever the body
        assert r.status_code == 401, r.text


def test_diffusion_gemma_temperature_over_http(server):
    """temperature 0 without a seed: the same text streamed or not, alone or among concurrent neighbours;
    another temperature scales the schedule (0.5 = t_min, t_max halved: the tiny checkpoint's 0.4, 0.8);
    with n = 2 at temperature 0 two distinct choices, the same every time."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/gemma/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="gemma", prompt="Reproducible", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    alone = c.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
    neighbours = [dict(model="gemma", prompt=f"neighbour {i}", max_tokens=16 + 16 * i, temperature=1.0,
                       extra_body={"ignore_eos": True}) for i in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(c.completions.create, **n) for n in neighbours]
        beside = pool.submit(c.completions.create, **kw).result().choices[0].text
        [f.result() for f in others]
    assert streamed == alone == beside
    half = dict(kw, temperature=0.5, seed=3)
    scaled = dict(kw, temperature=None, seed=3, extra_body={"ignore_eos": True, "diffusion": {"t_min": 0.2,
                                                                                             "t_max": 0.4}})
    assert c.completions.create(**half).choices[0].text == c.completions.create(**scaled).choices[0].text
    assert c.completions.create(**half).choices[0].text != c.completions.create(**dict(half, temperature=1.0)
                                                                               ).choices[0].text
    two = [ch.text for ch in c.completions.create(n=2, **kw).choices]
    assert two[0] == alone and two[1] != alone and [ch.text for ch in c.completions.create(n=2, **kw).choices] == two


def test_a_failing_choice_ends_the_stream_and_cancels_the_others(server):
    """Choice 1 of 3 fails after the stream began: the stream ends with an error event and [DONE] (never a
    hang), and the other two choices' requests are cancelled; unstreamed, a 503 and the same; a client
    that goes away mid-stream cancels every choice."""
    base = f"http://127.0.0.1:{server}/standin/v1/completions"
    coordinator = serve.get_deployment_handle("Coordinator", app_name="standin")
    cancellations = lambda: coordinator.cancellations.remote().result(timeout_s=30)  # noqa: E731
    body = {"model": MODEL, "prompt": "x", "n": 3, "seed": FAILING_SEED, "max_tokens": 64}
    start = time.monotonic()
    r = httpx.post(base, json=body | {"stream": True}, timeout=30)
    payloads = sse_payloads(r.text.splitlines())
    assert time.monotonic() - start < 20 and payloads[-1] == "[DONE]"
    assert_openai_error(json.loads(payloads[-2]), 503)
    assert {json.loads(p)["choices"][0]["index"] for p in payloads[:-2]} == {0, 1, 2}
    wait_until(lambda: cancellations() == 2, 20, "the other two choices to be cancelled")
    r = httpx.post(base, json=body, timeout=30)
    assert_openai_error(r.json(), 503)
    wait_until(lambda: cancellations() == 4, 20, "the other two choices to be cancelled")
    with httpx.stream("POST", base, json=body | {"seed": 1, "n": 2, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break   # the first chunk, then hang up
    wait_until(lambda: cancellations() == 6, 20, "both choices to be cancelled after the client left")


# ---- structured output ---------------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_over_http(server):
    """response_format on chat, streamed and not, at TP = 1 and 2; structured_outputs on completions with n
    choices; the tiny model writes noise, so the valid answers are the constraint's doing."""
    import jsonschema

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON"}], max_completion_tokens=64,
              temperature=1.0, seed=4, response_format={"type": "json_schema", "json_schema": {
                  "name": "person", "schema": PERSON, "strict": True}})
    whole = client(server).chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    chunks = list(client(server).chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert client(server, "tp2").chat.completions.create(**kw).choices[0].message.content == text
    r = client(server).completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=16, n=3, temperature=1.0,
                                          seed=1, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    assert all(c.text in ("red", "green", "blue") for c in r.choices)


def test_structured_output_errors_name_the_field(server):
    c = client(server)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}, **chat)
    assert err.value.body["param"] == "response_format.json_schema.schema" and "strin" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={
            "structured_outputs": {"regex": "(a"}})
    assert err.value.body["param"] == "structured_outputs.regex", err.value.body
    # a stop would cut a constrained answer short of a whole valid text, yet end it with "stop"
    for extra, param in (({"stop": ["}"]}, "stop"), ({"extra_body": {"stop_token_ids": [7]}}, "stop_token_ids")):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(response_format={"type": "json_object"}, **chat, **extra)
        assert err.value.body["param"] == param and "response_format" in err.value.body["message"], err.value.body


def test_diffusion_gemma_structured_output_over_http(server):
    import jsonschema

    gemma = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/gemma/v1", api_key="x", max_retries=0, timeout=60)
    r = gemma.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "A person"}], seed=3,
                                      max_tokens=48, temperature=1.0, response_format={
                                          "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
