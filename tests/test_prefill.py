"""Prefills padded to a CUDA graph's width (model/graphs.py) change no real row. On the CPU the runner
gets StepGraphs without captures, which runs every step eagerly, so it pads its prefills as it does
under CUDA graphs; real graphs (captured, replayed) are tests/test_gpu.py's."""
import pytest
import torch

from model import graphs as graphs_module
from model.graphs import KEY_BUCKET, MIN_PREFILL_WIDTH, PREFILL_GRAPH_TOKENS, StepGraphs, prefill_width
from model.sampling.params import MAX_LOGPROBS, DecodeParams
from tests import served
from workers.engine import Engine


def EagerGraphs() -> StepGraphs:
    return StepGraphs(torch.device("cpu"), capture=False)


def test_prefill_widths():
    assert [prefill_width(n, 1, 4096) for n in (1, 2, 16, 17, 33, 200, 256)] == [16, 16, 16, 32, 64, 256, 256]
    assert [prefill_width(n, 1, 4096) for n in (257, 384, 385, 1000, 4096)] == [384, 384, 512, 1024, 4096]
    # never past the cache, never short of the prompt; rows x width within PREFILL_GRAPH_TOKENS or None
    assert prefill_width(20, 1, 24) == 24 and prefill_width(300, 1, 300) == 300 and prefill_width(301, 1, 300) is None
    assert prefill_width(1000, 4, 4096) == 1024 and prefill_width(1000, 8, 4096) is None
    for n in range(1, 4097):
        w = prefill_width(n, 1, 4096)
        assert n <= w <= (max(16, 2 * n) if n <= KEY_BUCKET else 3 * n // 2 + 1), (n, w)


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_padded_prefill_equals_unpadded(family, tiny_nemotron, tiny_gemma):
    """In fp32, prompts of 5 and 9 tokens alone and together, each prefill padded to 16: the same tokens,
    logprobs and top alternatives as the runner that prefills at the prompts' own widths."""
    model_dir, bos = (tiny_nemotron, 1) if family == "nemotron" else (tiny_gemma, 2)
    prompts = [[bos, 50, 60, 70, 80], [bos] + list(range(300, 308))]
    params = DecodeParams(seed=3, max_tokens=24, ignore_eos=True, logprobs=2)

    def generate(graphs):
        with Engine(model_dir, num_slots=2, max_model_len=128, dtype="float32") as e:
            e.shards.runner.graphs = graphs
            alone = [served.generate(e, [p], [params])[0] for p in prompts]
            together = served.generate(e, prompts, [params, params])
        return alone + together

    padded = EagerGraphs()
    got, expected = generate(padded), generate(None)
    widths = {(key[1].rows, key[1].kv_len) for key in padded.graphs if key[0] == "prefill"}
    assert widths == {(1, 16), (2, 16)}
    for g, e in zip(got, expected):
        assert g.output == e.output and g.ranks == e.ranks
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-4
        assert g.top_ids == e.top_ids


def test_a_long_prefill_is_not_graphed(tiny_nemotron):
    """Past PREFILL_GRAPH_TOKENS (rows x width) a prefill runs eagerly (at whole 16-token tiles: below)."""
    rows = 2
    long = PREFILL_GRAPH_TOKENS // rows + 1
    with Engine(tiny_nemotron, num_slots=rows, max_model_len=long + 64, prefill_chunk=rows * long) as e:
        e.shards.runner.graphs = graphs = EagerGraphs()
        e.generate([[1] + [7] * (long - 1)] * rows, DecodeParams(max_tokens=1, ignore_eos=True))
    assert not [key for key in graphs.graphs if key[0] == "prefill"]


@pytest.mark.parametrize("graphed_past_prefix", [True, False], ids=["graphed", "eager"])
@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_prefills_past_a_prefix_on_a_graphed_runner(family, graphed_past_prefix, tiny_nemotron, tiny_gemma,
                                                   monkeypatch):
    """A graphed runner's prefills past a cached prefix and a long prompt's later chunks: up to
    PAST_PREFIX_GRAPH_WIDTH wide, graphs at a prefill width over the cache's whole length of keys;
    outside the graph set (here: with that width 0), eagerly at a multiple of MIN_PREFILL_WIDTH with the
    graphs' plan (every pass on): the kernel variants the warm-up compiled, never a new one mid-service
    (tests/test_gpu.py watches the compiles). In fp32 both give the tokens and logprobs of the runner
    without graphs."""
    if not graphed_past_prefix:
        monkeypatch.setattr(graphs_module, "PAST_PREFIX_GRAPH_WIDTH", 0)
    model_dir, bos = (tiny_nemotron, 1) if family == "nemotron" else (tiny_gemma, 2)
    base = [bos] + [40 + 3 * i for i in range(39)]
    prompts = [base, base + [7, 8, 9, 10, 11, 12, 13], base + list(range(300, 323)), [bos] + list(range(100, 250))]
    params = DecodeParams(seed=3, max_tokens=20, ignore_eos=True, logprobs=2)

    def generate(graphs):
        seen = []
        with Engine(model_dir, num_slots=2, max_model_len=256, dtype="float32", prefill_chunk=64) as e:
            runner = e.shards.runner
            runner.graphs, prefill = graphs, runner.causal.prefill

            def spy(plan, idx, scored, tokens, starts, lengths, modes, fresh=True):
                seen.append((fresh, tokens.shape[1], plan, lengths.max().item()))
                return prefill(plan, idx, scored, tokens, starts, lengths, modes, fresh=fresh)

            runner.causal.prefill = spy
            served_ = [served.generate(e, [p], [params])[0] for p in prompts]
            assert e.scheduler.pages.hits > 0
            max_len = runner.kv.max_len
        return served_, seen, max_len

    graphs = EagerGraphs()
    (got, seen, max_len), (expected, _, _) = generate(graphs), generate(None)
    past = [(width, plan, longest) for fresh, width, plan, longest in seen if not fresh]
    assert len(past) >= 4 and any(longest % MIN_PREFILL_WIDTH for _, _, longest in past)
    keys = [key for key in graphs.graphs if key[0] == "prefill_past"]
    for width, plan, longest in past:
        assert plan.filters and plan.sampling and plan.top_logprobs in (0, MAX_LOGPROBS)
        if graphed_past_prefix:   # a graph's width, over every key the cache holds
            assert width == prefill_width(longest, plan.rows, max_len, fresh=False) and plan.kv_len == max_len
            assert ("prefill_past", plan, width) in keys
        else:
            assert width % MIN_PREFILL_WIDTH == 0 and longest <= width < longest + MIN_PREFILL_WIDTH
    assert bool(keys) == graphed_past_prefix
    for g, e in zip(got, expected):   # logprobs within fp32 rounding: sums over more (masked) keys, as graphs
        assert g.output == e.output and g.ranks == e.ranks and g.top_ids == e.top_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-3


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_warm_ups_eager_prefill_changes_no_slots_state(family, tiny_nemotron, tiny_gemma):
    """The warm-up's prefill past a prefix (which compiles the key splits' combine on CUDA) runs on the
    padding row and leaves every slot's state, the padding slot's length included, as it found it."""
    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    with Engine(model_dir, num_slots=2, max_model_len=256, dtype="float32") as e:
        runner = e.shards.runner
        runner.graphs = EagerGraphs()
        served.generate(e, [[2, 50, 60, 70]], DecodeParams(max_tokens=8, ignore_eos=True))
        t = runner.slots
        tensors = lambda: {name: v.clone() for name, v in vars(t).items() if isinstance(v, torch.Tensor)}  # noqa: E731
        before, kv = tensors(), [x.clone() for x in runner.kv.k + runner.kv.v]
        runner._warm_eager_prefills()
        assert len(before) > 10 and before.keys() == tensors().keys()
        for name, value in tensors().items():   # every slot's state, the padding slot's too
            assert torch.equal(value, before[name]), name
        sink = [(g, runner.kv.sink(g)) for g in runner.kv.group_of]   # the KV cache: only the sink pages written
        for x, y, (g, first) in zip(runner.kv.k + runner.kv.v, kv, sink + sink):
            assert torch.equal(x[:first], y[:first])
