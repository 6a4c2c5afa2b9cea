"""Multi-process tensor-parallel test harness for CPU (gloo), plus the helpers the TP, KV-cache and
reduction tests share.

    spawn_tp(fn, world_size, workdir, *args, timeout=...)

starts `world_size` processes with torch.multiprocessing (forked from a forkserver that has imported
the model once; spawned for NCCL), joins them into one gloo process group through a `file://` rendezvous
in `workdir`, and calls `fn(rank, world_size, *args)` in each (backend="nccl": one GPU per rank,
cuda:rank, multicast off as in a shard).
Every wait is bounded: a rank that hangs (a collective another rank never issues, a deadlock) makes
`spawn_tp` kill the group and raise TimeoutError instead of hanging the test session; a rank that
raises makes it raise RuntimeError carrying every failed rank's traceback. `fn` must be importable
(defined at module level).

`tp_worker` is the rank body of tests/test_tensor_parallel.py: it loads the tiny checkpoint as one
TP rank, runs a mixed prefill / denoise / commit schedule in fp32 and in fp64, gathers full-vocabulary
logits, runs the vocabulary-sharded reductions on its slice of shared random inputs, and saves
everything to `out_dir/rank{r}.pt` for the parent to compare against TP=1 and dense references
(`assert_tp_matches` says how close TP = N must come to TP = 1, and why).
"""
from __future__ import annotations

import datetime
import gc
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.attention import PagedKVCache, StepContext, step_context
from model.parallel import reductions as R
from model.parallel.group import TPGroup, shard_range
from model.parallel.small_allreduce import disable_multicast
from model.sampling.filters import keep_threshold
from tests import vocab_reductions as VR

MASK = 100


# --------------------------------------------------------------------------------------------------
# Process-group plumbing

def _entry(rank: int, world_size: int, init_file: str, error_dir: str, collective_timeout_s: float, backend: str,
           fn, args) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores
    try:
        if backend == "nccl":
            disable_multicast()
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            fn(rank, world_size, *args)
        finally:
            # What fn left in reference cycles (a TorchDispatchMode that saw collectives does) is freed
            # now, while the group and the interpreter live: freed at interpreter exit instead, gloo's
            # worker threads aborted the process ("terminate called without an active exception") in
            # about 1 run in 10.
            gc.collect()
            dist.destroy_process_group()
    except BaseException:
        # Written before this rank's sockets close, so before its peers fail because of it.
        (Path(error_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


# Gloo ranks are forked from one server process (multiprocessing's forkserver, started by the first call)
# that has imported torch, the model and these helpers once: a spawned rank imported them itself, ~3 s of a
# core each (~4 s with compressed-tensors), for the ~25 ranks of a suite. The server never touches CUDA;
# NCCL ranks are spawned as before. A rank imports its own test module (under pytest's name for it), whose
# imports are then these, already loaded.
FORKSERVER_PRELOAD = ["tests.tp_harness", "tests.fp8_reference"]


def _start_method(backend: str) -> str:
    if backend != "gloo":
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)   # read when the server starts: the first call's
    return "forkserver"


def spawn_tp(fn, world_size: int, workdir: str | Path, *args, timeout: float = 120.0,
             collective_timeout_s: float = 60.0, backend: str = "gloo") -> None:
    """Run fn(rank, world_size, *args) on world_size ranks; raise on any failure or on timeout."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"tp{world_size}-{time.monotonic_ns()}"
    init_file = workdir / f"rendezvous-{tag}"  # must not exist yet
    error_dir = workdir / f"errors-{tag}"
    error_dir.mkdir()
    ctx = mp.start_processes(_entry, args=(world_size, str(init_file), str(error_dir), collective_timeout_s, backend,
                                           fn, args), nprocs=world_size, join=False, start_method=_start_method(backend))
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic()), grace_period=5):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise TimeoutError(f"tp={world_size}: ranks {alive} still running after {timeout:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        # join reports whichever rank died first, often a peer that lost its connection: show every
        # rank's traceback, the root cause included
        reports = [f"-- rank {f.stem[4:]}:\n{f.read_text()}" for f in sorted(error_dir.glob("rank*.txt"))]
        raise RuntimeError(f"tp={world_size}: {len(reports)} rank(s) failed\n" + "\n".join(reports)) from err
    finally:
        for p in ctx.processes:  # only the processes this call started
            if p.is_alive():
                p.kill()
                p.join(5)


def hang_worker(rank: int, world_size: int) -> None:
    """Harness self-test: rank 0 waits in a collective that the other ranks never join."""
    if rank == 0:
        dist.barrier()
    else:
        time.sleep(600)


def raise_worker(rank: int, world_size: int) -> None:
    """Harness self-test: the last rank fails while the others wait for it in a collective."""
    if rank == world_size - 1:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()


# --------------------------------------------------------------------------------------------------
# How close TP = N comes to TP = 1 (docs/spec.md 7): bounds derived from the arithmetic, not picked
#
# A rank sums its partial products in another order than TP = 1 does (the row-parallel K split, then
# gloo's all-reduce), so in fp32 both results carry a rounding error of the same size. The tiny random
# models amplify it from ~1 ulp per op to tens of ulps of the logits (sandwich norms after small
# branches, unscaled attention: x2 to x3 per layer), and TP = 1's own error changes with the thread
# count and the CPU's kernels. No fixed fp32 tolerance on |TPN - TP1| holds on every machine. Instead:
#   fp64: |TPN - TP1| <= FP64_TOL. fp64 rounds 2^29 (5e8) times finer than fp32, so fp32 differences
#         of up to 1e-4 become ~2e-13 (measured: <= 4e-13); 1e-9 leaves a margin of 1e3 for other
#         kernels and is 8 orders of magnitude below what a sharding error does (O(0.1) and up).
#   fp32: |TPN_fp32 - TP1_fp64| <= FP32_ERROR_RATIO * |TP1_fp32 - TP1_fp64|: a rank's fp32 result is as
#         accurate as TP = 1's own fp32 result on the same machine, within a factor 4 (the ratio measured
#         over forwards, seeds and world sizes: 0.5 to 1.8); never asked to be closer than a few ulps.
FP64_TOL = 1e-9
FP32_ERROR_RATIO = 4.0
FP32_ULPS_FLOOR = 4


def assert_tp_matches(tpn: dict, tp1: dict, what: str) -> None:
    """tpn, tp1: {torch.float32: tensor, torch.float64: tensor}, the same computation on the same inputs
    (tp1[float64] is the reference of both fp32 results)."""
    f32, f64 = torch.float32, torch.float64
    ref = tp1[f64]
    d64 = (tpn[f64] - ref).abs().max().item()
    assert d64 <= FP64_TOL, f"{what}: fp64 max |TPN - TP1| = {d64:.3g} > {FP64_TOL:g}"
    err1 = (tp1[f32].double() - ref).abs().max().item()
    errn = (tpn[f32].double() - ref).abs().max().item()
    floor = FP32_ULPS_FLOOR * torch.finfo(f32).eps * ref.abs().max().item()
    assert errn <= FP32_ERROR_RATIO * max(err1, floor), \
        f"{what}: fp32 error of TPN {errn:.3g} vs TP = 1's own {err1:.3g} (against fp64)"


# --------------------------------------------------------------------------------------------------
# One batched forward of mixed rows (tests/test_nemotron_parity.py and the TP ranks share it)

def new_cache(model, slots: int = 4, max_len: int = 256, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    layers, hkv, d = model.kv_shape
    return PagedKVCache.per_slot([(hkv, d)] * layers, slots, max_len, dtype, "cpu")


def run_rows(model, kv: PagedKVCache, rows, ids_rows) -> torch.Tensor:
    """rows: (slot, start, causal); ids_rows: token lists. One batched forward; this rank's logits
    [B, L, V_r] (L = longest row; shorter rows are padded)."""
    width = max(len(t) for t in ids_rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, t in enumerate(ids_rows):
        ids[b, : len(t)] = torch.as_tensor(t)
    starts = [s for _, s, _ in rows]
    positions = torch.tensor(starts)[:, None] + torch.arange(width)[None]
    ctx = StepContext.build(kv, [s for s, _, _ in rows], starts, [len(t) for t in ids_rows],
                            [c for _, _, c in rows], width, "cpu")
    with step_context(ctx), torch.no_grad():
        return model.head_logits(model(ids, positions))


# --------------------------------------------------------------------------------------------------
# The mixed schedule run at TP = 1 (in the test process) and TP > 1 (in each rank)

def mixed_schedule(vocab_size: int = 997, seed: int = 7):
    """Forwards of (kind, slot, start, tokens) rows; every forward after the first mixes step kinds."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n, masks=()):
        t = torch.randint(0, vocab_size, (n,), generator=gen)
        for a, b in masks:
            t[a:b] = MASK
        return t.tolist()

    p0, p1, p2 = toks(40), toks(70), toks(20)
    c1_draft, c2_final = toks(32, [(3, 30)]), toks(32)
    c0_draft = toks(32, [(1, 32)])
    c1_final, c2b_draft = toks(32), toks(32, [(0, 12), (20, 32)])
    return [
        [("prefill", 1, 0, p1), ("prefill", 2, 0, p2)],
        [("prefill", 0, 0, p0), ("denoise", 1, 70, c1_draft), ("commit", 2, 20, c2_final)],
        [("denoise", 0, 40, c0_draft), ("commit", 1, 70, c1_final), ("denoise", 2, 52, c2b_draft)],
    ]


def run_mixed_schedule(model, tp: TPGroup) -> list[list[tuple[str, torch.Tensor]]]:
    """Full-vocabulary logits (gathered) of every real token of every row: [[(kind, [n, V]), ...], ...]."""
    kv = new_cache(model, slots=3, max_len=160, dtype=next(model.parameters()).dtype)
    out = []
    for forward in mixed_schedule(model.config.vocab_size):
        rows = [(slot, start, kind != "denoise") for kind, slot, start, _ in forward]
        local = run_rows(model, kv, rows, [t for *_, t in forward])
        full = VR.gather_vocab(local, model.config.vocab_size, tp)
        out.append([(kind, full[b, : len(t)].clone()) for b, (kind, _, _, t) in enumerate(forward)])
    return out


# --------------------------------------------------------------------------------------------------
# Inputs of the vocabulary-sharded reductions: ties across shards, ties at the top-k boundary, -inf

def reduction_cases() -> dict[str, dict]:
    """name -> {"x": full logits [..., V], "k": top-k size, "ids": list of [...] id tensors}.
    The same on every rank (fixed seed, built on CPU)."""
    gen = torch.Generator().manual_seed(1234)
    V = 997
    x = torch.randn(8, V, generator=gen) * 3
    # row 0: the maximum at four ids spread over every rank's slice (tp 2, 3, 4); lowest is on rank 0
    x[0, [950, 700, 5, 400]] = 50.0
    # row 1: tied maxima whose lowest id is not on rank 0 (tp 2: rank 1; tp 3: rank 1; tp 4: rank 2)
    x[1, [950, 700, 520]] = 40.0
    # row 2: equal values straddling the top-5 boundary: 2 larger values, then 15.0 at six ids on
    # different ranks of which only the three lowest (100, 300, 480) make the top 5
    x[2, [10, 900]] = torch.tensor([20.0, 19.0])
    x[2, [990, 300, 650, 100, 800, 480]] = 15.0
    # row 3: a top-k/top-p filtered row: only 3 finite entries, so the top 5 reaches into -inf
    x[3] = -torch.inf
    x[3, [600, 20, 900]] = torch.tensor([1.0, 3.0, 2.0])
    # row 4: about a third -inf, plus tied maxima on the last shards
    x[4, torch.rand(V, generator=gen) < 0.33] = -torch.inf
    x[4, [996, 680]] = 30.0
    # row 5: a single surviving token, in the last rank's slice
    x[5] = -torch.inf
    x[5, 996] = -2.5
    # row 6: only two equal survivors, on different ranks (tp 2, 3, 4)
    x[6] = -torch.inf
    x[6, [700, 300]] = 0.5
    # row 7: random, with a tie between the second-best values
    x[7, [17, 811]] = 25.0
    x[7, 444] = 26.0
    x = x.view(2, 4, V)  # leading batch dims, like [slots, canvas, V]
    top5 = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :5]
    ids = [
        torch.tensor([[5, 520, 480, 0], [996, 996, 300, 811]]),  # maxima, a -inf entry (row 3, id 0)
        torch.tensor([[996, 0, 650, 5], [3, 500, 2, 17]]),       # arbitrary, incl. -inf (row 5, id 500)
        top5[..., 4],                                            # the top-k boundary entries
        torch.randint(0, V, (2, 4), generator=gen),
    ]
    cases = {"mixed": {"x": x, "k": 5, "ids": ids}}
    # A vocabulary narrower than k * tp: shards narrower than k are padded by _local_topk. Row 1 has a
    # single finite entry, so the top 5 must name four -inf entries (the lowest ids: 0, 1, 2, 3).
    small = torch.randn(3, 7, generator=gen)
    small[1] = -torch.inf
    small[1, 6] = 1.0
    small[2, [1, 5]] = -torch.inf
    cases["narrow"] = {"x": small, "k": 5, "ids": [torch.tensor([6, 6, 1]), torch.tensor([0, 3, 5])]}
    return cases


def filter_rows(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the top-k and top-p of the filters' thresholds: top-k k with no top-p, top-k 2 with top-p
    0.7, top-p 0.4 alone, in turn."""
    top_k = torch.tensor([(k, 2, 0)[r % 3] for r in range(rows)])
    top_p = torch.tensor([(1.0, 0.7, 0.4)[r % 3] for r in range(rows)])
    return top_k, top_p


def sharded_reductions(x_full: torch.Tensor, k: int, ids: list[torch.Tensor], tp: TPGroup) -> dict:
    """Every reduction of model.parallel.reductions and tests/vocab_reductions.py on this rank's slice of
    x_full, and the filters' thresholds (model/sampling/filters.py: count and mass all-reduces)."""
    v0, v1 = shard_range(x_full.shape[-1], tp.rank, tp.world_size)
    x = x_full[..., v0:v1].contiguous()
    out = {
        "threshold": keep_threshold(x, v0, tp, *filter_rows(x.shape[0], k)),
        "global_max": R.global_max(x, tp),
        "logsumexp": R.logsumexp(x, tp),
        "entropy": VR.entropy(x, tp),
        "argmax": VR.argmax(x, v0, tp),
        "topk": VR.topk(x, k, v0, tp),
        "gather_vocab": VR.gather_vocab(x, x_full.shape[-1], tp),
    }
    thresholds = []
    for i, idx in enumerate(ids):
        out[f"value_at{i}"] = VR.value_at(x, idx, v0, tp)
        thresholds.append(out[f"value_at{i}"])
    thresholds += [torch.full(x.shape[:-1], -torch.inf), torch.full(x.shape[:-1], torch.inf),
                   out["global_max"]]
    for i, thr in enumerate(thresholds):
        out[f"count_greater{i}"] = VR.count_greater(x, thr, tp)
    return out


def dense_reductions(x: torch.Tensor, k: int, ids: list[torch.Tensor]) -> dict:
    """The same statistics computed on the full tensor with plain torch ops (the thresholds: the filters'
    own at TP = 1, which tests/test_sampling.py checks against sorting)."""
    V = x.shape[-1]
    m = x.amax(dim=-1)
    p = torch.softmax(x.double(), dim=-1)
    ent = -torch.where(p > 0, p * torch.log(p), 0).sum(dim=-1)
    arange = torch.arange(V).expand_as(x)
    srt = torch.sort(x, dim=-1, descending=True, stable=True)
    out = {
        "threshold": keep_threshold(x, 0, TPGroup(), *filter_rows(x.shape[0], k)),
        "global_max": m,
        "logsumexp": torch.logsumexp(x.double(), dim=-1).float(),
        "entropy": ent.float(),
        "argmax": torch.where(x == m.unsqueeze(-1), arange, V).amin(dim=-1),  # lowest id of the maxima
        "topk": (srt.values[..., :k], srt.indices[..., :k]),
        "gather_vocab": x,
    }
    thresholds = []
    for i, idx in enumerate(ids):
        out[f"value_at{i}"] = torch.gather(x, -1, idx.unsqueeze(-1)).squeeze(-1)
        thresholds.append(out[f"value_at{i}"])
    thresholds += [torch.full(x.shape[:-1], -torch.inf), torch.full(x.shape[:-1], torch.inf), m]
    for i, thr in enumerate(thresholds):
        out[f"count_greater{i}"] = (x > thr.unsqueeze(-1)).sum(dim=-1)
    return out


# --------------------------------------------------------------------------------------------------
# The rank body

SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "diffusion_head")


def tp_worker(rank: int, world_size: int, model_dir: str | None, out_dir: str) -> None:
    tp = TPGroup.from_default_group()
    assert (tp.rank, tp.world_size) == (rank, world_size)
    result: dict = {"rank": rank, "world_size": world_size}
    if model_dir is not None:
        from model.loader import load_model

        model = load_model(model_dir, tp, show_progress=False)
        result["vocab_range"] = (model.vocab_start, model.diffusion_head.vocab_end)
        result["params"] = {name: (tuple(p.shape), p.dtype, p.numel() * p.element_size())
                            for name, p in model.named_parameters()}
        result["norms"] = {name: p.detach().clone() for name, p in model.named_parameters()
                           if "norm" in name}
        result["schedule"] = {torch.float32: run_mixed_schedule(model, tp),
                              torch.float64: run_mixed_schedule(load_model(model_dir, tp, dtype=torch.float64,
                                                                           show_progress=False), tp)}
    result["reductions"] = {name: sharded_reductions(c["x"], c["k"], c["ids"], tp)
                            for name, c in reduction_cases().items()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_tp_worker(world_size: int, workdir: Path, model_dir: Path | None, timeout: float = 150.0) -> list[dict]:
    """Spawn tp_worker on world_size ranks; every rank's saved results, in rank order."""
    out_dir = Path(workdir) / f"out-tp{world_size}"
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_tp(tp_worker, world_size, workdir, None if model_dir is None else str(model_dir), str(out_dir),
             timeout=timeout)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
