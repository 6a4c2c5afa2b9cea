"""benchmarks/attention_bench.py's CPU paths: libraries() times the problem the served kernel solves. Its
split combine, launched as the bench launches it, under triton's CPU interpreter is
tests/interpreted/test_interpreted_attention_bench.py's (run by tests/test_interpreted_kernels.py)."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("layer", ["sliding", "full_1280"])
def test_the_libraries_attend_over_the_keys_the_served_row_sees(layer):
    """libraries() hands SDPA the keys the bench's canvas row sees (a sliding layer's window: its last W - 1
    prefix positions and the canvas; the full layer's keys and the canvas's own), so its figures time the
    served problem: on the CPU (fp32, SDPA's CPU kernels) each backend that runs equals attention written
    out from the served kernel's mask rule (model/kernels/attention.py: key p visible iff p < start + C,
    and p > start - W on a sliding layer)."""
    import torch

    from benchmarks.attention_bench import LAYERS, C, libraries, problem

    torch.manual_seed(0)
    d, hkv, keys, window, _ = LAYERS[layer]
    q, k, v, _ = problem(d, hkv, keys, device="cpu")
    q, k, v = q.float(), k.float(), v.float()
    end = keys + C   # the row starts at `keys`, bidirectional
    positions = torch.arange(0, end)
    if window is not None:
        positions = positions[positions > keys - window]
    kk, vv = k[0, positions], v[0, positions]                   # [visible, hkv, d]
    g = q.shape[2] // hkv
    scores = torch.einsum("lhd,phd->hlp", q[0], kk.repeat_interleave(g, 1))
    expected = torch.einsum("hlp,phd->lhd", scores.softmax(-1), vv.repeat_interleave(g, 1))[None]
    row = libraries(expected, q, k, v, keys, window, timed=False, flex=False)
    ran = [name for name in row if name.endswith("_rel_diff")]
    assert ran, row
    for name in ran:
        assert row[name] < 1e-5, (name, row)
