"""DiffusionGemma under tensor parallelism on CPU (gloo, docs/spec.md 7): the self-conditioning embedding
`sum_r P_r W_r = P W` with one all-reduce and nothing vocabulary-wide on any rank; and TP = 2 and 4
logits, sampler decisions and self-conditioning inputs equal to TP = 1 over a prefill / denoise /
commit schedule, in fp64 (decisions exact) and in fp32 (as accurate as TP = 1; tests/tp_harness.py
says why no fixed fp32 tolerance would do). (The tiny model's KV heads, 2 sliding and 1 full, are
replicated at TP = 4, and the full layers' single head at TP = 2.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model.attention import PagedKVCache, StepContext, step_context
from model.loader import load_model
from model.parallel.group import TPGroup, shard_range
from model.sampling import renoise as RN
from model.sampling.stats import unscaled
from tests import vocab_reductions as VR
from tests.tp_harness import FP64_TOL, assert_tp_matches, spawn_tp

DTYPES = (torch.float32, torch.float64)
SC_V, SC_H = 997, 24  # the self-conditioning case: a vocabulary divisible by neither 2 nor 4


class Allocations(TorchDispatchMode):
    """Shapes of every tensor with new storage that an op creates while active (views are not counted)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.shapes += [tuple(t.shape) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


class CountAllReduce:
    """Counts torch.distributed.all_reduce calls (TPGroup looks it up at call time)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self._orig = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def sc_case():
    """In fp64: one matmul's sum order (TP = 1) against partial sums plus an all-reduce (TP > 1) then
    differs by ~1e-16, and the checks can be as strict as FP64_TOL."""
    gen = torch.Generator().manual_seed(17)
    f64 = torch.float64
    probs = torch.softmax(torch.randn(2, 5, SC_V, generator=gen, dtype=f64) * 4, dim=-1)  # [slots, canvas, V]
    return probs, torch.randn(SC_V, SC_H, generator=gen, dtype=f64)


def sc_on_rank(tp: TPGroup) -> dict:
    probs, embed = sc_case()
    v0, v1 = shard_range(SC_V, tp.rank, tp.world_size)
    p_r, w_r = probs[..., v0:v1].contiguous(), embed[v0:v1].contiguous()
    with CountAllReduce() as count, Allocations() as alloc:
        out = RN.self_condition_embedding(p_r, w_r, tp)
    return {"out": out, "all_reduces": count.calls, "shapes": alloc.shapes, "width": v1 - v0, "rank": tp.rank}


# --------------------------------------------------------------------------------------------------
# The schedule run at TP = 1 (here) and TP > 1 (in each rank)

def forward(model, kv, rows, soft=None):
    width = max(len(r[3]) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(torch.as_tensor(t), (0, width - len(t))) for *_, t in rows])
    starts = [r[1] for r in rows]
    ctx = StepContext.build(kv, [r[0] for r in rows], starts, [len(r[3]) for r in rows], [r[2] for r in rows],
                            width, "cpu", window=model.sliding_window)
    with step_context(ctx), torch.no_grad():
        h = model(ids, torch.tensor(starts)[:, None] + torch.arange(width), soft)
        return unscaled(model.head_logits(h), model.logit_softcap)


def run_schedule(model, tp: TPGroup, forced: list | None = None) -> dict:
    """Prefill two slots; three denoise steps of both (self-conditioned after the first), sampled with
    renoise_step on this rank's logits; slot 0 commits its argmax canvas while slot 1 denoises; slot 0
    denoises its next canvas (its sliding layers' window now inside the committed canvas).

    `forced`: TP = 1's recorded fp32 forward inputs (rows, soft), used instead of this run's own (in
    either dtype). The random tiny model amplifies an input change of 1e-5 in the self-conditioning
    signal ~30x per forward, so chained runs drift apart by fp32 rounding alone; each forward is
    compared on identical inputs."""
    cfg = model.config
    V, C = cfg.vocab_size, cfg.canvas_length
    gen = torch.Generator().manual_seed(3)
    p0, p1 = torch.randint(0, V, (20,), generator=gen), torch.randint(0, V, (9,), generator=gen)
    dtype = model.decoder.embed_tokens.weight.dtype
    kv = PagedKVCache.per_slot(model.kv_layer_shapes, 2, 96, dtype, "cpu")
    out = {"logits": [], "steps": [], "soft": [], "inputs": [], "forward_all_reduces": []}

    def fwd(rows, soft=None):
        if forced is not None:
            rows, soft = forced[len(out["inputs"])]
            soft = None if soft is None else soft.to(dtype)
        out["inputs"].append((rows, soft))
        with CountAllReduce() as count:
            local = forward(model, kv, rows, soft)
        out["forward_all_reduces"].append(count.calls)
        out["logits"].append(VR.gather_vocab(local, V, tp))
        return local

    fwd([(0, 0, True, p0), (1, 0, True, p1)])
    seed, R2 = torch.tensor([5, 2**33 + 6]), 2
    canvas = RN.random_tokens(seed, torch.zeros(R2, dtype=torch.int64), C, V)
    prev, run, soft = torch.full((R2, C), -1), torch.zeros(R2, dtype=torch.int64), None
    alloc = Allocations()
    for n in range(3):
        local = fwd([(0, 20, False, canvas[0]), (1, 9, False, canvas[1])], soft)
        full = lambda v: torch.full((R2,), v)  # noqa: E731
        with alloc:
            step = RN.renoise_step(local, n=full(n), steps=full(4), t_min=full(0.4), t_max=full(0.8),
                                   entropy_bound=full(0.5), stability_threshold=full(1),
                                   confidence_threshold=full(0.005), seed=seed, counter=full(n + 1),
                                   prev_argmax=prev, run=run, vocab_start=model.vocab_start, vocab_size=V, tp=tp)
            with CountAllReduce() as count:
                soft = model.soft_embedding(step.probs)
        out["steps"].append({k: getattr(step, k) for k in ("canvas", "sample", "argmax", "accepted", "converged")})
        out["soft"].append(soft)
        out["soft_all_reduces"] = count.calls
        canvas, prev, run = step.canvas, step.argmax, step.run
    mixed_soft = torch.stack([torch.zeros_like(soft[0]), soft[1]])
    fwd([(0, 20, True, prev[0]), (1, 9, False, canvas[1])], mixed_soft)
    fwd([(0, 36, False, canvas[0])], soft[:1])
    out["shapes"] = alloc.shapes
    out["vocab_width"] = model.vocab_end - model.vocab_start
    out["layers"] = cfg.num_hidden_layers
    return out


def worker(rank: int, world_size: int, model_dir: str, out_dir: str) -> None:
    tp = TPGroup.from_default_group()
    result = {"sc": sc_on_rank(tp)}
    forced = torch.load(Path(out_dir) / "tp1_inputs.pt", weights_only=False)
    for dtype in DTYPES:
        result[dtype] = run_schedule(load_model(model_dir, tp, dtype=dtype, show_progress=False), tp, forced)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from model.tiny import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("tiny-diffusion-gemma-tp"), seed=1)


@pytest.fixture(scope="module")
def tp1(tiny_dir):
    """{dtype: schedule}; the fp64 run on the fp32 run's inputs is the reference of both dtypes."""
    fp32 = run_schedule(load_model(tiny_dir, show_progress=False), TPGroup())
    fp64 = run_schedule(load_model(tiny_dir, dtype=torch.float64, show_progress=False), TPGroup(), fp32["inputs"])
    return {torch.float32: fp32, torch.float64: fp64}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def ranks(request, tiny_dir, tp1, tmp_path_factory):
    n = request.param
    work = tmp_path_factory.mktemp(f"dg-tp{n}")
    torch.save(tp1[torch.float32]["inputs"], work / "tp1_inputs.pt")
    spawn_tp(worker, n, work, str(tiny_dir), str(work), timeout=240)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(n)]


def test_self_conditioning_at_tp1_is_one_matmul_without_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("no collective at TP = 1")

    monkeypatch.setattr(dist, "all_reduce", forbidden)
    probs, embed = sc_case()
    with Allocations() as alloc:
        out = RN.self_condition_embedding(probs, embed, TPGroup())
    assert (out - probs @ embed).abs().max() <= FP64_TOL
    assert all(s[-1] == SC_H for s in alloc.shapes)   # only [.., H] results: no copy of P or of W


def test_self_conditioning_sums_vocab_shards_with_one_all_reduce(ranks):
    probs, embed = sc_case()
    expected = probs @ embed
    for r in ranks:
        sc = r["sc"]
        assert (sc["out"] - expected).abs().max() <= FP64_TOL
        assert sc["all_reduces"] == 1
        assert sc["width"] < SC_V and all(SC_V not in s for s in sc["shapes"])


def test_no_rank_materialises_full_vocabulary_tensors(ranks):
    """Over the whole sampler step and the soft embedding on the model: no tensor spans the vocabulary
    (only [.., V_r] shards) and none is as large as the embedding table; the soft embedding costs one
    all-reduce."""
    for r in ranks:
        s = r[torch.float32]
        V, width = 997, s["vocab_width"]
        assert width < V
        assert s["shapes"] and all(V not in shape for shape in s["shapes"])
        assert max(torch.Size(shape).numel() for shape in s["shapes"]) < V * 64
        assert s["soft_all_reduces"] == 1


def test_a_forward_has_two_all_reduces_per_layer(ranks, tp1):
    """A forward's all-reduces: the embedding's, the self-conditioning MLP's where a step has its input,
    and two per layer: attention's output projection and ONE for the dense MLP and the experts together
    (each branch reducing its own would be three)."""
    layers = tp1[torch.float32]["layers"]
    assert layers > 1
    with_soft = [soft is not None for _, soft in tp1[torch.float32]["inputs"]]
    assert with_soft == [False, False, True, True, True, True]
    expected = [1 + soft + 2 * layers for soft in with_soft]
    for r in ranks:
        for dt in DTYPES:
            assert r[dt]["forward_all_reduces"] == expected
    assert tp1[torch.float32]["forward_all_reduces"] == [0] * len(with_soft)   # TP = 1: none


def test_logits_and_self_conditioning_equal_tp1(ranks, tp1):
    """Every forward's logits and every step's self-conditioning input, in both dtypes."""
    for r in ranks:
        for key, count in (("logits", 6), ("soft", 3)):
            for i in range(count):
                assert_tp_matches({dt: r[dt][key][i] for dt in DTYPES}, {dt: tp1[dt][key][i] for dt in DTYPES},
                                  f"rank {r['sc']['rank']}/{len(ranks)} {key} {i}")
    assert min(x.std() for x in tp1[torch.float64]["logits"]) > 1.0  # logits are not trivially small


def test_sampler_decisions_equal_tp1_in_fp64(ranks, tp1):
    """Exact: in fp64 the ranks' logits differ from TP = 1's by ~1e-13, too little to flip a decision.
    (In fp32 the decisions take the inputs checked above through the same code.)"""
    expected = tp1[torch.float64]["steps"]
    for r in ranks:
        for step, (got, want) in enumerate(zip(r[torch.float64]["steps"], expected, strict=True)):
            for key in want:
                assert torch.equal(got[key], want[key]), f"step {step} {key}"
    assert any(0 < st["accepted"].sum() < st["accepted"].numel() for st in expected)  # accepts and renoises
