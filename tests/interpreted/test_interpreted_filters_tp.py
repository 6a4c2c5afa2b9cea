"""The filters' triton passes at TP = 2 under triton's CPU interpreter (the spawned ranks inherit it),
against torch at TP = 1. Run under TRITON_INTERPRET=1 only (tests/test_interpreted_kernels.py)."""
import pytest
import torch

pytest.importorskip("triton")

from model.parallel.group import TPGroup
from model.sampling.filters import torch_threshold

TP1 = TPGroup()


def test_triton_thresholds_at_tp2_equal_tp1_in_the_interpreter(tmp_path):
    """The filters' passes with tensor parallelism: each rank reads its own slice (its own tile maxima and
    top-k bound) and the counts and masses are all-reduced between passes over gloo; both ranks find the
    thresholds torch finds over the whole vocabulary at TP = 1: top-k alone (k = 5: past a rank's 3
    tiles at the kernel's tiling, within its 8 at the small one), top-p alone, both, neither,
    survivors on one rank only, fp32 / T and bf16 softcapped (tests/interpreted/filters_tp_cases.py)."""
    import tests.interpreted.filters_tp_cases as cases
    from tests.tp_harness import spawn_tp

    # every setting in one spawn of the ranks (each spawn imports torch and triton in both ranks again)
    spawn_tp(cases.triton_filters_worker, 2, tmp_path, str(tmp_path), timeout=240)
    for n, (settings, V) in enumerate(cases.SETTINGS):
        c = cases.filter_case(V)
        ranks = [torch.load(tmp_path / f"s{n}-rank{r}.pt") for r in range(2)]
        for i, (dtype, softcap, on_scaled) in enumerate(c["kinds"]):
            ref = torch_threshold(c["x"].to(dtype), c["temperature"], c["top_k"], c["top_p"], 0, TP1,
                                  softcap=softcap, on_scaled=on_scaled)
            tol = 0 if softcap is None else 1e-5   # the interpreter's tanh is not torch's to the last bit
            for r in range(2):
                got = ranks[r][i]
                assert torch.equal(torch.isinf(ref), torch.isinf(got)), (settings, dtype, r, ref, got)
                assert torch.allclose(ref, got, rtol=tol, atol=0), (settings, dtype, r, ref, got)
            assert torch.isinf(ref[3]).all() and torch.isfinite(ref[[0, 1, 2, 4]]).all()
