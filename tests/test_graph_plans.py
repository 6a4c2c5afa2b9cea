"""Request options are device data (model/steps/plan.py): a CUDA graph's plan, with every pass on and its
rows padded to a capture size, gives every request what the exact plan of its batch gives, whatever
options its neighbours asked for; and the closed set of graphs (model/graphs.py) serves every mix of
options with no step outside it. On the CPU the runner gets StepGraphs without captures: every step
runs eagerly through the keys, padding and plans it would replay on CUDA (tests/test_gpu.py captures)."""
import pytest
import torch

from model.graphs import (PAST_PREFIX_GRAPH_WIDTH, PREFILL_GRAPH_TOKENS, StepGraphs, capture_sizes, key_buckets, prefill_widths)
from model.sampling.params import DecodeParams
from tests import served
from workers.engine import Engine
from workers.coordinator import describe_warm_up

NEMOTRON_MIX = [
    DecodeParams(max_tokens=40, temperature=0.7, seed=1, logprobs=5, top_k=17),
    DecodeParams(max_tokens=30, policy="leftmost", top_p=0.5, logprobs=0),
    DecodeParams(max_tokens=20, policy="entropy_bound", ignore_eos=True),
    DecodeParams(max_tokens=30, mode="linear_spec", logprobs=20),
    DecodeParams(max_tokens=12, mode="ar", temperature=1.0, seed=4, top_k=5, top_p=0.9, logprobs=2),
    DecodeParams(max_tokens=40, policy="low_confidence", max_denoising_steps=8, stream_drafts=True, draft_every=2,
                 temperature=0.7, seed=9, eos_early_stop=False),
    DecodeParams(max_tokens=24, temperature=0, top_k=1, logprobs=1, seed_first_position=False),
]
GEMMA_MIX = [
    DecodeParams(max_tokens=20, seed=3, logprobs=2, top_k=40),
    DecodeParams(max_tokens=24, seed=4, top_p=0.5, stream_drafts=True, draft_every=2, max_denoising_steps=6),
    DecodeParams(max_tokens=16, seed=5, ignore_eos=True, entropy_bound=0.5),
    DecodeParams(max_tokens=30, seed=6, logprobs=20, top_k=5, top_p=0.9, confidence_threshold=0),
    DecodeParams(max_tokens=10, seed=7),
]


def outcome(e: Engine, prompts, params) -> list[tuple]:
    return [(r.output, r.logprobs, r.ranks, r.top_ids, r.top_logprobs, r.denoising_steps, r.canvases,
             r.finish_reason, [(d.offset, d.step, d.tokens, d.known) for d in r.drafts])
            for r in served.generate(e, prompts, params)]


def prompts_of(n: int, vocab: int) -> list[list[int]]:
    return [[2] + [(37 * i + 11 * j) % vocab + 10 for j in range(3 + 7 * i)] for i in range(n)]


def assert_same(got, expected, tol=1e-4):
    for g, e in zip(got, expected, strict=True):
        assert (g[0], g[2], g[3], g[5:]) == (e[0], e[2], e[3], e[5:])
        for a, b in ((g[1], e[1]), (g[4], e[4])):
            assert (a is None) == (b is None)
            if a is not None:
                flat = lambda v: [x for row in v for x in (row if isinstance(row, list) else [row])]  # noqa: E731
                assert max((abs(x - y) for x, y in zip(flat(a), flat(b))), default=0) < tol


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_graph_plans_equal_exact_plans(family, tiny_nemotron, tiny_gemma):
    """In fp32, a mix of every option (temperatures, top-k, top-p, logprobs 0-20, policies, modes, drafts,
    early stops) over 4 slots with a queue: the padded graph plans and the exact plans give the same
    tokens, ranks, alternatives, steps, finish reasons and drafts, and logprobs within 1e-4. Then the
    same mix after a warm-up: every step's key was warmed, none ran outside the set."""
    model_dir, mix, vocab = (tiny_nemotron, NEMOTRON_MIX, 900) if family == "nemotron" else (tiny_gemma, GEMMA_MIX, 500)
    prompts = prompts_of(len(mix), vocab)

    def engine(graphs: bool) -> Engine:
        e = Engine(model_dir, num_slots=4, max_model_len=256, dtype="float32")
        if graphs:
            e.shards.runner.graphs = StepGraphs(torch.device("cpu"), capture=False)
        return e

    exact = outcome(engine(False), prompts, mix)
    with engine(True) as e:
        runner = e.shards.runner
        report = runner.warm_up()
        warmed = set(runner.graphs.graphs)
        # DiffusionGemma's random tiny model amplifies fp32 rounding through twelve renoised, self-conditioned
        # steps: the graph plans' padded prefills sum in another order (5e-5 with the sliding layers' old
        # rings, 1.3e-4 over their window's pages); a wrong key would move a logprob by O(1)
        assert_same(outcome(e, prompts, mix), exact, tol=1e-4 if family == "nemotron" else 2e-4)
        assert set(runner.graphs.graphs) == warmed and runner.graphs.eager_steps == 0
        assert sum(report["graphs"].values()) == len(warmed)


@pytest.mark.parametrize("slots,sizes", [(1, (1,)), (6, (1, 2, 3, 4, 5, 6)), (8, (1, 2, 3, 4, 5, 6, 7, 8)),
                                          (9, (1, 2, 3, 4, 5, 6, 7, 8, 9)), (17, (1, 2, 3, 4, 5, 6, 7, 8, 16, 17)),
                                          (40, (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40))])
def test_capture_sizes_are_every_size_to_8_then_steps_of_8(slots, sizes):
    """A batch pads to the next capture size; up to 8 rows it pads to none (a padding row costs a whole
    row's experts and attention), past 8 to the next multiple of 8 or to max_num_seqs."""
    assert capture_sizes(slots) == sizes


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_graph_set_is_a_formula_of_sizes_and_buckets(family, tiny_nemotron, tiny_gemma):
    """canvas and ar: sizes x buckets x 2; prefill: sizes x widths (rows x width within the budget) x 2, x 1
    for a family whose prefill samples nothing; prefill_past (past a cached prefix) the same, of the widths
    up to PAST_PREFIX_GRAPH_WIDTH; DiffusionGemma has no ar."""
    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    with Engine(model_dir, num_slots=6, max_model_len=600, dtype="float32") as e:
        runner = e.shards.runner
        runner.graphs = StepGraphs(torch.device("cpu"), capture=False)
        report = runner.warm_up()
    C = runner.C
    sizes, buckets = capture_sizes(6), key_buckets(600 + C)
    assert sizes == (1, 2, 3, 4, 5, 6) and report["capture_sizes"] == list(sizes)
    prefills = sum(1 for b in sizes for w in prefill_widths(600 + C) if b * w <= PREFILL_GRAPH_TOKENS)
    tiers = 2 if family == "nemotron" else 1
    past = sum(1 for b in sizes for w in prefill_widths(600 + C) if b * w <= PREFILL_GRAPH_TOKENS
               and w <= PAST_PREFIX_GRAPH_WIDTH)
    assert 0 < past < prefills
    expected = {"canvas": len(sizes) * len(buckets) * 2, "prefill": prefills * tiers, "prefill_past": past * tiers}
    if family == "nemotron":
        expected["ar"] = len(sizes) * len(buckets) * 2
    assert report["graphs"] == expected
    # the warm-up's seconds by kind, with each kind's longest capture, in the ready line
    by_kind, longest = report["seconds_by_kind"], report["longest_by_kind"]
    assert set(by_kind) == set(longest) == set(expected)
    assert all(0 < longest[k] <= by_kind[k] for k in expected) and sum(by_kind.values()) <= report["seconds"]
    line = describe_warm_up(report)
    assert all(f"{k} {by_kind[k]:.1f} s, the longest {longest[k]:.1f}" in line for k in expected)


def test_a_step_outside_the_set_runs_eagerly_and_is_counted(tiny_nemotron):
    """After the warm-up froze the set, a prefill too wide for a graph runs eagerly at its own width (the
    same results) and is counted; graphs are never added while serving."""
    rows = 2
    long = PREFILL_GRAPH_TOKENS // rows + 1
    params = DecodeParams(max_tokens=4, ignore_eos=True, temperature=0, logprobs=1)
    prompts = [[1] + [7] * (long - 1), [1] + [9] * (long - 2)]
    with Engine(tiny_nemotron, num_slots=rows, max_model_len=long + 64, dtype="float32") as e:
        expected = outcome(e, prompts, [params] * 2)
    with Engine(tiny_nemotron, num_slots=rows, max_model_len=long + 64, dtype="float32",
                prefill_chunk=rows * long) as e:   # both prompts in one command's prefill
        runner = e.shards.runner
        runner.graphs = StepGraphs(torch.device("cpu"), capture=False)
        runner.warm_up()
        warmed = set(runner.graphs.graphs)
        assert_same(outcome(e, prompts, [params] * 2), expected)
    assert runner.graphs.eager_steps == 1 and set(runner.graphs.graphs) == warmed


def test_the_pool_is_sized_on_each_kinds_largest_step(tiny_nemotron):
    """size_pool runs, of each kind, the step of the most tokens: with 48 slots a prefill's most rows
    (48 x 64) are not its most tokens (16 x 256 and 32 x 128 hold 4096)."""
    from model.runner import largest_steps

    with Engine(tiny_nemotron, num_slots=48, max_model_len=600, dtype="float32") as e:
        runner = e.shards.runner
        runner.graphs = StepGraphs(torch.device("cpu"), capture=False)
        items = list(runner._graph_set())
    largest = largest_steps((kind, key, None, key) for kind, key, _, _ in items)
    assert largest["prefill"][0] == largest["prefill_past"][0] == PREFILL_GRAPH_TOKENS
    assert largest["prefill"][2][1].rows < 48 and largest["prefill_past"][2][1].rows < 48
    top = max(key[1].kv_len for kind, key, _, _ in items if kind == "canvas")
    assert largest["canvas"][2][1].rows == 48 and largest["canvas"][2][1].kv_len == top
