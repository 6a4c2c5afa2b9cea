"""The canvas steps' state updates compiled by torch.compile (model/steps/compiled.py): the runner's
results bit for bit as written, for both families over a batch that exercises every phase, reveal
policy, filter, score and draft, and compiled whole (a fallback to the written update fails the test).

Here dynamo traces the update and AOTAutograd functionalises it (backend aot_eager: what breaks a
whole-graph compile shows up), and the graph runs as torch ops; inductor's own kernels are CUDA's, where
the runner compiles the updates by default: test_gpu.py runs the same batches compiled against written,
and every GPU engine and parity test goes through them."""
import logging

import pytest
import torch

from model.sampling.params import DecodeParams
from model.steps.compiled import CompiledUpdate, compile_updates_enabled
from tests import served
from workers.engine import Engine


def engine(model_dir, device: str = "cpu", dtype: str = "float32") -> Engine:
    return Engine(str(model_dir), num_slots=4, max_model_len=256, device=device, dtype=dtype)


def run(e: Engine, prompts, params) -> list[tuple]:
    """Each request's tokens, scores, steps and finish reason as its outputs carry them, run to its end by
    the in-process engine."""
    return [(r.output, r.logprobs, r.ranks, r.top_ids, r.top_logprobs, r.denoising_steps, r.canvases,
             r.finish_reason) for r in served.generate(e, prompts, params)]


NEMOTRON = [
    DecodeParams(max_tokens=40, temperature=0.7, seed=3, logprobs=2, policy="threshold", threshold=0.5),
    DecodeParams(max_tokens=33, policy="low_confidence", max_denoising_steps=8, top_k=5, stream_drafts=True,
                 draft_every=2),
    DecodeParams(max_tokens=20, policy="leftmost", max_denoising_steps=4, ignore_eos=True, logprobs=0),
    DecodeParams(max_tokens=50, policy="entropy_bound", entropy_bound=1.0, temperature=1.3, top_p=0.9, seed=8),
    DecodeParams(max_tokens=30, mode="linear_spec", logprobs=1),
]
GEMMA = [
    DecodeParams(max_tokens=40, seed=3, logprobs=2),
    DecodeParams(max_tokens=24, seed=4, top_k=5, stream_drafts=True, draft_every=2, max_denoising_steps=6),
    DecodeParams(max_tokens=16, seed=5, ignore_eos=True, top_p=0.9, entropy_bound=0.5),
]

BATCHES = {"nemotron": NEMOTRON, "gemma": GEMMA}


def batch_prompts(family: str) -> list[list[int]]:
    vocab = 900 if family == "nemotron" else 500   # below the tiny models' vocabularies
    return [[2] + [(37 * i + 11 * j) % vocab + 10 for j in range(5 + 3 * i)] for i in range(len(BATCHES[family]))]


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_compiled_update_equals_written(family, tiny_nemotron, tmp_path):
    from torch._dynamo.utils import counters

    if family == "nemotron":
        model_dir = tiny_nemotron
    else:
        from model.tiny import write_diffusion_gemma

        model_dir = write_diffusion_gemma(tmp_path / "gemma", seed=0)
    params = BATCHES[family]
    prompts = batch_prompts(family)

    written = engine(model_dir)
    assert written.shards.runner.canvas_step.update.compiled is None   # the CPU's default: as written
    torch._dynamo.reset()   # a fresh limit of variants
    compiled = engine(model_dir)
    step = compiled.shards.runner.canvas_step
    step.update = CompiledUpdate(step._update, on=True, backend="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    expected = run(written, prompts, params)
    got = run(compiled, prompts, params)
    assert step.update.compiled is not None, "the update fell back to running as written"
    assert counters["stats"]["unique_graphs"] > graphs
    assert got == expected
    assert sum(len(r[0]) for r in expected) >= 80


def test_warm_up_compiles_the_graph_plans_then_freezes(tiny_nemotron):
    """A shard's warm-up runs every graph of the closed set once (model/graphs.py; here without CUDA, so
    each runs eagerly through the same keys, padding and plans), which compiles the canvas step's update
    for one row and for several, unscored and scored (4 variants), and leaves no slot in use. Those serve
    every batch and every mix of options afterwards (graph plans compute every pass for every row):
    nothing compiles, even unfrozen, no step runs outside the set, and the results are as written."""
    from torch._dynamo.utils import counters

    from model.graphs import StepGraphs

    written = engine(tiny_nemotron)
    assert written.shards.runner.warm_up()["graphs"] == {}   # no graphs on the CPU by default: nothing to warm
    written.shards.runner.graphs = StepGraphs(torch.device("cpu"), capture=False)   # the same plans, as written
    torch._dynamo.reset()
    served_engine = engine(tiny_nemotron)
    runner = served_engine.shards.runner
    runner.graphs = StepGraphs(torch.device("cpu"), capture=False)
    update = runner.canvas_step.update = CompiledUpdate(runner.canvas_step._update, on=True, backend="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    report = runner.warm_up()
    assert counters["stats"]["unique_graphs"] - graphs == 4
    assert update.frozen and runner.graphs.frozen and not runner.slots.info
    assert sum(report["graphs"].values()) == len(runner.graphs.graphs)
    prompts = batch_prompts("nemotron")[:4]

    update.frozen = False
    graphs = counters["stats"]["unique_graphs"]
    mixed = [DecodeParams(max_tokens=40, logprobs=5, temperature=0.7, seed=1),
             DecodeParams(max_tokens=30, policy="leftmost", top_k=5, logprobs=3),
             DecodeParams(max_tokens=20, policy="entropy_bound", ignore_eos=True, logprobs=2),
             DecodeParams(max_tokens=30, mode="linear_spec", logprobs=4)]
    assert run(served_engine, prompts, mixed) == run(written, prompts, mixed)
    assert run(served_engine, prompts[:1], [DecodeParams(max_tokens=40, policy="low_confidence")]) == \
        run(written, prompts[:1], [DecodeParams(max_tokens=40, policy="low_confidence")])
    others = [DecodeParams(max_tokens=40, logprobs=1, temperature=0.7, seed=1, top_p=0.5),
              DecodeParams(max_tokens=30, stream_drafts=True, draft_every=2, mode="ar")]
    assert run(served_engine, prompts[:2], others) == run(written, prompts[:2], others)
    assert counters["stats"]["unique_graphs"] == graphs
    assert runner.graphs.eager_steps == 0 and len(runner.graphs.graphs) == sum(report["graphs"].values())


def test_compile_failure_runs_the_update_as_written(caplog):
    calls = []

    def update(x: torch.Tensor) -> None:
        calls.append(1)
        torch._dynamo.graph_break()   # what a host read or an untraceable call does: no whole graph
        x += 1

    step = CompiledUpdate(update, on=True)
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="dllm.compiled"):
        step(x)
        step(x)
    assert step.compiled is None and calls == [1, 1] and torch.equal(x, torch.full((3,), 3.0))
    assert len([r for r in caplog.records if "could not compile" in r.message]) == 1


def test_an_error_from_running_the_update_propagates_without_a_second_run():
    """Only compiling falls back: an update that fails while it runs (its writes partly done) must not
    run again on top of them, nor turn compiling off."""
    def update(x: torch.Tensor, i: torch.Tensor) -> None:
        x += 1
        x[i] = 5.0

    step = CompiledUpdate(update, on=True, backend="eager")
    x = torch.zeros(3)
    step(x, torch.tensor([0]))
    assert torch.equal(x, torch.tensor([5.0, 1.0, 1.0]))
    with pytest.raises((IndexError, RuntimeError)):
        step(x, torch.tensor([7]))
    assert torch.equal(x, torch.tensor([6.0, 2.0, 2.0])) and step.compiled is not None


def test_the_limit_of_variants_freezes_compiling_and_keeps_what_compiled():
    torch._dynamo.reset()

    def update(x: torch.Tensor) -> None:
        x += 1

    step = CompiledUpdate(update, on=True, backend="eager")
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.complex64]   # each a variant: past dynamo's 8
    xs = [torch.zeros(4, dtype=d) for d in dtypes]
    for x in xs:
        step(x)
    assert step.frozen and step.compiled is not None
    assert all(torch.equal(x, torch.ones(4, dtype=x.dtype)) for x in xs)
    step(xs[0])
    assert torch.equal(xs[0], torch.full((4,), 2.0))


def test_compiling_is_on_for_cuda_unless_turned_off(monkeypatch):
    assert compile_updates_enabled(torch.device("cuda"))
    assert not compile_updates_enabled(torch.device("cpu"))
    monkeypatch.setenv("DLLM_COMPILE_UPDATES", "0")
    assert not compile_updates_enabled(torch.device("cuda"))


def test_the_reveals_float_ops_stay_torch_kernels_when_compiled():
    """Whether a step's update runs compiled depends on the batch's plan; a row's reveal must not. Its
    float scan (entropy_bound) and log (threshold) reach inductor as opaque ops calling torch's kernels,
    not as aten.cumsum/aten.log, which inductor would generate its own way."""
    from torch._dynamo.backends.common import aot_autograd

    from model.sampling.reveal import POLICIES, reveal

    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    masked = torch.rand(3, 8, generator=gen) < 0.7
    args = dict(confidence=torch.randn(3, 8, generator=gen).clamp(max=0), entropy=torch.rand(3, 8, generator=gen),
                tau=torch.tensor([0.5, 0.9, 0.3]), gamma=torch.tensor([0.1, 1.0, 0.5]))
    policy, n, N = torch.tensor([0, 1, 3]), torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4])

    def f(policy, masked, n, N, confidence, entropy, tau, gamma):
        return reveal(policy, list(POLICIES), masked, n, N, confidence=confidence, entropy=entropy, tau=tau,
                      gamma=gamma)

    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    assert torch.equal(compiled(policy, masked, n, N, **args), f(policy, masked, n, N, **args))
    calls = [(str(node.target), node.meta["val"].dtype) for g in graphs for node in g.graph.nodes
             if node.op == "call_function" and "val" in node.meta and hasattr(node.meta["val"], "dtype")]
    names = {name for name, _ in calls}
    assert {"dllm.reveal_cumsum.default", "dllm.reveal_log.default"} <= names, names
    assert not [c for c in calls if c[0] in ("aten.cumsum.default", "aten.log.default") and c[1].is_floating_point]
