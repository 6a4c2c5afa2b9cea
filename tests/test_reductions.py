"""Single-process (TP world size 1) checks of the tensor-parallel building blocks: the vocabulary
reductions against dense torch ops (ties, -inf), shard_range, and the vocab-parallel embedding / LM
head. The multi-process versions are in tests/test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.parallel import reductions as R
from model.parallel.group import TPGroup, shard_range
from model.parallel.linear import ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear
from model.parallel.linear import ReplicatedLinear, VocabParallelEmbedding
from tests import vocab_reductions as VR
from tests.tp_harness import dense_reductions, reduction_cases, sharded_reductions

TP1 = TPGroup()


class _FakeGroup:
    """Stands in for a process group so a rank > 0 layer can be built (and its weights loaded) in one
    process; its forward would need a real group and is never called."""


def fake_rank(rank: int, world_size: int) -> TPGroup:
    return TPGroup(rank=rank, world_size=world_size, group=_FakeGroup())


# --- reductions at world size 1 ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["mixed", "narrow"])
def test_reductions_equal_dense(case):
    c = reduction_cases()[case]
    got = sharded_reductions(c["x"], c["k"], c["ids"], TP1)
    expected = dense_reductions(c["x"], c["k"], c["ids"])
    assert set(got) == set(expected)
    for name, exp in expected.items():
        g = got[name]
        if name in ("logsumexp", "entropy"):
            torch.testing.assert_close(g, exp, atol=1e-5, rtol=1e-5, msg=name)
        elif name == "topk":
            assert torch.equal(g[0], exp[0]) and torch.equal(g[1], exp[1]), f"topk: {g} vs {exp}"
        else:
            assert g.shape == exp.shape and torch.equal(g.to(exp.dtype), exp), f"{name}: {g} vs {exp}"


def test_reductions_hand_checked():
    x = torch.tensor([[1.0, 3.0, -torch.inf, 3.0, 2.0],
                      [-torch.inf, -torch.inf, 0.0, -torch.inf, -torch.inf],
                      [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert VR.argmax(x, 0, TP1).tolist() == [1, 2, 0]
    assert VR.argmax(x, 10, TP1).tolist() == [11, 12, 10]  # vocab_start offsets the ids
    values, ids = VR.topk(x, 3, 0, TP1)
    assert ids.tolist() == [[1, 3, 4], [2, 0, 1], [0, 1, 2]]
    assert values[0].tolist() == [3.0, 3.0, 2.0] and values[1, 1:].tolist() == [-torch.inf] * 2
    assert VR.count_greater(x, torch.tensor([2.0, -torch.inf, 0.0]), TP1).tolist() == [2, 1, 0]
    assert VR.value_at(x, torch.tensor([2, 2, 4]), 0, TP1).tolist() == [-torch.inf, 0.0, 0.0]
    torch.testing.assert_close(VR.entropy(x, TP1), torch.tensor([
        torch.distributions.Categorical(logits=x[0]).entropy().item(), 0.0, torch.log(torch.tensor(5.0)).item()]))
    torch.testing.assert_close(R.logsumexp(x, TP1), torch.logsumexp(x, -1))
    assert R.global_max(x, TP1).tolist() == [3.0, 0.0, 0.0]


def test_logsumexp_and_entropy_do_not_overflow():
    x = torch.tensor([[1000.0, 999.0, -torch.inf], [-1000.0, -1001.0, -1002.0]])
    torch.testing.assert_close(R.logsumexp(x, TP1), torch.logsumexp(x, -1))
    p = torch.softmax(x.double(), -1)
    dense = -torch.where(p > 0, p * p.log(), 0).sum(-1).float()
    # m + log Z - A / Z cancels ~1000 against ~1000 in fp32 (docs/spec.md 7's formula): about 1e-4 absolute
    # here; what matters is that nothing overflows to inf / nan
    got = VR.entropy(x, TP1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense, atol=1e-3, rtol=0)


def test_topk_wider_than_the_vocabulary_pads():
    x = torch.tensor([[0.5, 2.0, 1.0]])
    values, ids = VR.topk(x, 5, 0, TP1)
    assert values.tolist() == [[2.0, 1.0, 0.5, -torch.inf, -torch.inf]]
    assert ids[0, :3].tolist() == [1, 2, 0]


def test_world_size_1_issues_no_collectives(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("collective issued at world size 1")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, boom)
    c = reduction_cases()["mixed"]
    sharded_reductions(c["x"], c["k"], c["ids"], TP1)
    emb = VocabParallelEmbedding(10, 4, TP1)
    emb.weight.data.normal_()
    emb(torch.tensor([[1, 9]]))
    row = RowParallelLinear(4, 3, TP1)
    row.weight.data.normal_()
    row(torch.ones(2, 4))
    assert TP1.broadcast(torch.ones(2)).tolist() == [1.0, 1.0]
    assert TP1.all_gather(torch.ones(2)).shape == (1, 2)


def test_gather_vocab_at_world_size_1_is_the_input():
    x = torch.randn(2, 7)
    assert VR.gather_vocab(x, 7, TP1) is x


# --- shard_range ----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 7, 96, 997, 131072, 262144])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16])
def test_shard_range_partitions(size, world):
    ranges = [shard_range(size, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
        assert a1 == b0  # contiguous, no overlap, no gap
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert all(s >= 0 for s in sizes)
    if size >= world:
        assert min(sizes) >= 1
    if size % world == 0:
        assert len(set(sizes)) == 1


def test_tp_group_validation():
    with pytest.raises(ValueError, match="outside world size"):
        TPGroup(rank=2, world_size=2, group=_FakeGroup())
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="process group"):
            TPGroup(rank=0, world_size=2)
        assert TPGroup.from_default_group() == TPGroup()
    assert not TP1.is_parallel


# --- vocab-parallel embedding and LM head ---------------------------------------------------------

def test_vocab_parallel_embedding_and_lm_head_equal_dense_at_tp1():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(997, 24, generator=gen)
    emb, head = VocabParallelEmbedding(997, 24, TP1), ParallelLMHead(997, 24, TP1)
    emb.weight.weight_loader(emb.weight, table)
    head.weight.weight_loader(head.weight, table)
    ids = torch.tensor([[0, 5, 996, 100], [3, 3, 500, 1]])
    assert torch.equal(emb(ids), F.embedding(ids, table))
    hidden = torch.randn(2, 4, 24, generator=gen)
    assert torch.equal(head(hidden), F.linear(hidden, table))
    assert (emb.vocab_start, emb.vocab_end) == (0, 997)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_vocab_shards_of_every_rank_reassemble_the_table(world):
    table = torch.randn(997, 8, generator=torch.Generator().manual_seed(1))
    parts = []
    for rank in range(world):
        head = ParallelLMHead(997, 8, fake_rank(rank, world))
        head.weight.weight_loader(head.weight, table)
        assert (head.vocab_start, head.vocab_end) == shard_range(997, rank, world)
        parts.append(head.weight.detach())
    assert torch.equal(torch.cat(parts), table)
    # per-rank logits are the column slices of the dense logits
    hidden = torch.randn(3, 8)
    for rank, part in enumerate(parts):
        v0, v1 = shard_range(997, rank, world)
        torch.testing.assert_close(F.linear(hidden, part), F.linear(hidden, table)[:, v0:v1])


@pytest.mark.parametrize("world", [2, 3])
def test_qkv_and_row_parallel_loaders_take_each_ranks_heads(world):
    h, d, nq, nkv = 12, 4, 12, 6
    q, k, v = (torch.randn(n * d, h) for n in (nq, nkv, nkv))
    o = torch.randn(h, nq * d)
    qs, ks, vs, os_ = [], [], [], []
    for rank in range(world):
        tp = fake_rank(rank, world)
        qkv = QKVParallelLinear(h, d, nq, nkv, tp)
        for shard, src in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, src, shard)
        nq_r, nkv_r = nq // world * d, nkv // world * d
        wq, wk, wv = qkv.weight.detach().split([nq_r, nkv_r, nkv_r])
        qs.append(wq), ks.append(wk), vs.append(wv)
        row = RowParallelLinear(nq * d, h, tp)
        row.weight.weight_loader(row.weight, o)
        os_.append(row.weight.detach())
    assert torch.equal(torch.cat(qs), q) and torch.equal(torch.cat(ks), k) and torch.equal(torch.cat(vs), v)
    assert torch.equal(torch.cat(os_, dim=1), o)


@pytest.mark.parametrize("with_v", [True, False])
def test_qkv_loader_replicates_kv_heads_fewer_than_tp(with_v):
    """2 KV heads at TP = 4: ranks 0-1 hold head 0, ranks 2-3 head 1 (the ones their query heads read);
    without v (values = keys) the fused weight is q|k."""
    h, d, nq, nkv, world = 12, 4, 8, 2, 4
    q, k, v = (torch.randn(n * d, h) for n in (nq, nkv, nkv))
    for rank in range(world):
        qkv = QKVParallelLinear(h, d, nq, nkv, fake_rank(rank, world), with_v=with_v)
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        assert qkv.checkpoint_shards == (("q", "k", "v") if with_v else ("q", "k"))
        for shard, src in zip(qkv.checkpoint_shards, (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, src, shard)
        parts = qkv.weight.detach().split(qkv.output_sizes)
        kv_head = rank * nkv // world
        assert torch.equal(parts[0], q[rank * 2 * d: (rank + 1) * 2 * d])
        assert torch.equal(parts[1], k[kv_head * d: (kv_head + 1) * d])
        if with_v:
            assert torch.equal(parts[2], v[kv_head * d: (kv_head + 1) * d])
    with pytest.raises(ValueError, match="num_key_value_heads=3 can be neither split nor replicated"):
        QKVParallelLinear(h, d, nq, 3, fake_rank(0, 4))


def test_row_parallel_without_reduce_returns_the_partial_sum(monkeypatch):
    """reduce_results=False: this rank's x_r W_r^T and no collective (its layer sums it with others)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("no collective with reduce_results=False")

    monkeypatch.setattr(dist, "all_reduce", forbidden)
    w, x = torch.randn(3, 8), torch.randn(2, 8)
    for rank in range(2):
        row = RowParallelLinear(8, 3, fake_rank(rank, 2), reduce_results=False)
        row.weight.weight_loader(row.weight, w)
        cols = slice(rank * 4, (rank + 1) * 4)
        torch.testing.assert_close(row(x[:, cols]), F.linear(x[:, cols], w[:, cols]))


def test_replicated_linear_loads_the_whole_weight():
    w = torch.randn(5, 8)
    lin = ReplicatedLinear(8, 5)
    lin.weight.weight_loader(lin.weight, w)
    assert torch.equal(lin.weight, w)
    x = torch.randn(2, 8)
    torch.testing.assert_close(lin(x), F.linear(x, w))


def test_parallel_linear_rejects_indivisible_sizes_and_wrong_shapes():
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        QKVParallelLinear(12, 4, 6, 3, fake_rank(0, 2))
    with pytest.raises(ValueError, match="input size"):
        RowParallelLinear(10, 4, fake_rank(0, 3))
    with pytest.raises(ValueError, match="smaller than tensor_parallel_size"):
        VocabParallelEmbedding(2, 4, fake_rank(0, 3))
    col = ColumnParallelLinear(8, [6], TP1)
    with pytest.raises(ValueError, match="shape mismatch"):
        col.weight.weight_loader(col.weight, torch.randn(6, 9))
