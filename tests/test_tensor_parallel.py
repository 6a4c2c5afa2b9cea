"""Tensor parallelism on CPU: TP = 2 and 3 ranks (and 4 for the reductions) in separate processes joined by gloo (docs/spec.md 7).

One spawn per world size (module fixture) runs every TP check of that world size in its ranks
(tests/tp_harness.py: tp_worker); the tests here compare what the ranks saved against TP = 1 and
dense references computed in this process.
"""
from __future__ import annotations

import time

import pytest
import torch

from model.loader import load_model
from model.parallel.group import TPGroup, shard_range
from tests.tp_harness import SHARDED, assert_tp_matches, dense_reductions, hang_worker, raise_worker
from tests.tp_harness import reduction_cases, run_mixed_schedule, run_tp_worker, spawn_tp

VOCAB = 997


@pytest.fixture(scope="module")
def tp1(tiny_nemotron):
    model = load_model(tiny_nemotron, TPGroup(), show_progress=False)
    return {
        "model": model,
        "params": {name: (tuple(p.shape), p.numel() * p.element_size()) for name, p in model.named_parameters()},
        "schedule": {torch.float32: run_mixed_schedule(model, TPGroup()),
                     torch.float64: run_mixed_schedule(load_model(tiny_nemotron, TPGroup(), dtype=torch.float64,
                                                                  show_progress=False), TPGroup())},
    }


@pytest.fixture(scope="module")
def spawned(tiny_nemotron, tmp_path_factory):
    """world size -> every rank's saved results; one spawn of the whole group per world size. The
    tiny model (12 heads, 6 KV heads) splits 2 and 3 ways; TP = 4 runs the reductions only."""
    cache: dict[int, list[dict] | BaseException] = {}

    def get(n: int) -> list[dict]:
        if n not in cache:
            model_dir = tiny_nemotron if n in (2, 3) else None
            try:
                cache[n] = run_tp_worker(n, tmp_path_factory.mktemp(f"tp{n}"), model_dir, timeout=150)
            except Exception as err:  # a failed or hung group is not spawned (and waited for) twice
                cache[n] = err
        if isinstance(cache[n], BaseException):
            raise cache[n]
        return cache[n]

    return get


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"tp{n}")
def ranks(request, spawned):
    return spawned(request.param)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"tp{n}")
def reduction_ranks(request, spawned):
    return spawned(request.param)


@pytest.fixture(scope="module")
def dense():
    return {name: dense_reductions(c["x"], c["k"], c["ids"]) for name, c in reduction_cases().items()}


def test_ranks_ran_as_one_group(ranks):
    n = len(ranks)
    assert [r["rank"] for r in ranks] == list(range(n))
    assert all(r["world_size"] == n for r in ranks)
    assert [r["vocab_range"] for r in ranks] == [shard_range(VOCAB, i, n) for i in range(n)]


@pytest.mark.parametrize("kind", ["prefill", "denoise", "commit"])
def test_logits_match_tp1_for_each_step_kind(ranks, tp1, kind):
    """Mixed batches of prefill, denoise and commit rows over several slots: the gathered full-vocabulary
    logits of every rank equal TP = 1's, in fp64 and in fp32 (tests/tp_harness.py: assert_tp_matches)."""
    expected = tp1["schedule"]
    checked = 0
    for r in ranks:
        got = r["schedule"]
        for f in range(len(expected[torch.float32])):
            for b, (k_exp, exp) in enumerate(expected[torch.float32][f]):
                if k_exp != kind:
                    continue
                assert all(got[dt][f][b][0] == kind for dt in got)
                rows = {dt: got[dt][f][b][1] for dt in got}
                assert all(x.shape == exp.shape == (exp.shape[0], VOCAB) for x in rows.values())
                assert not any(x.isnan().any() for x in rows.values()), "gather_vocab left padding in the logits"
                assert_tp_matches(rows, {dt: expected[dt][f][b][1] for dt in expected},
                                  f"rank {r['rank']} forward {f} row {b} ({kind})")
                checked += 1
    assert checked >= len(ranks) * 2
    assert max(e.std().item() for rows in expected[torch.float32] for _, e in rows) > 1.0  # not trivially small


def test_sharded_parameters_hold_a_tp_fraction(ranks, tp1):
    n = len(ranks)
    full = tp1["params"]
    for r in ranks:
        assert set(r["params"]) == set(full), f"rank {r['rank']} has different parameters"
        for name, (shape, dtype, nbytes) in r["params"].items():
            full_shape, full_bytes = full[name]
            assert dtype == torch.float32
            if "norm" in name:
                assert shape == full_shape, f"{name}: norms are replicated"
            elif any(s in name for s in ("embed_tokens", "diffusion_head")):
                v0, v1 = shard_range(VOCAB, r["rank"], n)
                assert shape == (v1 - v0, full_shape[1]), name
                assert VOCAB // n <= shape[0] <= -(-VOCAB // n), name  # one row apart at most
                assert abs(nbytes * n - full_bytes) < n * full_bytes / VOCAB, name
            else:
                assert any(s in name for s in SHARDED), f"unexpected parameter {name}"
                assert nbytes * n == full_bytes, f"{name}: {nbytes} B on rank {r['rank']} vs {full_bytes} B at TP=1"
    for name, (_, full_bytes) in full.items():  # the ranks together hold each tensor exactly once
        total = sum(r["params"][name][2] for r in ranks)
        assert total == (full_bytes * n if "norm" in name else full_bytes), name


def test_norms_are_replicated(ranks, tp1):
    model = tp1["model"]
    params = dict(model.named_parameters())
    for r in ranks:
        assert set(r["norms"]) == {n for n in params if "norm" in n}
        for name, value in r["norms"].items():
            assert torch.equal(value, params[name]), f"rank {r['rank']}: {name} differs from TP=1"


def _assert_same(got, exp, what):
    if isinstance(exp, tuple):
        for g, e, part in zip(got, exp, ("values", "ids"), strict=True):
            _assert_same(g, e, f"{what} {part}")
        return
    assert got.shape == exp.shape, what
    if exp.is_floating_point() and what.split()[0] in ("logsumexp", "entropy"):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5, msg=what)
    else:  # exact: maxima, picked values, ids, counts
        assert got.dtype == exp.dtype or not exp.is_floating_point(), what
        assert torch.equal(got.to(exp.dtype), exp), f"{what}:\n got {got}\nwant {exp}"


def test_vocab_sharded_reductions_equal_dense(reduction_ranks, dense):
    """global max / logsumexp / entropy / argmax / topk / value_at / count_greater and the top-k / top-p
    thresholds on each rank's slice equal the dense statistic of the full tensor (the thresholds: TP = 1's,
    exactly), on every rank, including tied maxima across ranks, ties at the top-k boundary and -inf
    entries."""
    ranks, expected = reduction_ranks, dense["mixed"]
    for r in ranks:
        got = r["reductions"]["mixed"]
        assert set(got) == set(expected)
        for name, exp in expected.items():
            _assert_same(got[name], exp, f"{name} (rank {r['rank']} of {len(ranks)})")
    for name in expected:  # bitwise identical on every rank
        for r in ranks[1:]:
            a, b = ranks[0]["reductions"]["mixed"][name], r["reductions"]["mixed"][name]
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert torch.equal(x, y), f"{name} differs between rank 0 and rank {r['rank']}"


def test_topk_with_shards_narrower_than_k(reduction_ranks, dense):
    expected = dense["narrow"]["topk"]
    for r in reduction_ranks:
        values, ids = r["reductions"]["narrow"]["topk"]
        assert torch.equal(values, expected[0])
        assert torch.equal(ids, expected[1]), f"rank {r['rank']}: {ids.tolist()} vs {expected[1].tolist()}"


def test_other_reductions_with_shards_narrower_than_k(reduction_ranks, dense):
    for r in reduction_ranks:
        got = r["reductions"]["narrow"]
        for name, exp in dense["narrow"].items():
            if name != "topk":
                _assert_same(got[name], exp, f"{name} narrow (rank {r['rank']} of {len(reduction_ranks)})")


def test_harness_bounds_a_hung_rank(tmp_path):
    """A rank stuck in a collective fails the test within the harness timeout instead of hanging it."""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        spawn_tp(hang_worker, 2, tmp_path, timeout=2)
    assert time.monotonic() - t0 < 20


def test_harness_reports_a_failing_rank(tmp_path):
    with pytest.raises(RuntimeError, match="deliberate failure on rank 1"):
        spawn_tp(raise_worker, 2, tmp_path, timeout=60)
