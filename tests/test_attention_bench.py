"""The split combine as benchmarks/attention_bench.py launches it (model.kernels.attention.split_combine
on the bench's partial states), on the CPU in triton's interpreter: at its served tiles and at the
attention program's it gives the same bits, and both equal the combined softmax state computed in torch
(so a GPU session does not spend its time on a wrong launch)."""
from __future__ import annotations

import pytest

from tests.interpreter import run_marked

CODE = r"""
import torch
from benchmarks.attention_bench import C, HEADS, combine_problem
from model.kernels.attention import split_combine
torch.manual_seed(0)
for d, hkv, splits, tiles in [(256, 8, 3, [(16, 4), (128, 8)]), (512, 2, 4, [(8, 4), (64, 8)])]:
    part, ml = combine_problem(d, hkv, splits, device="cpu")
    outs = []
    for rows, warps in tiles:
        out = torch.zeros(1, C, HEADS, d, dtype=torch.bfloat16)
        split_combine(part, ml, out, rows, warps)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), d
    m = ml[..., 0].amax(0)
    w = torch.exp2(ml[..., 0] - m)
    ref = (w[..., None] * part).sum(0) / (w * ml[..., 1]).sum(0)[..., None]   # [hkv, C * G, d]
    g = HEADS // hkv
    ref = ref.view(hkv, C, g, d).permute(1, 0, 2, 3).reshape(C, HEADS, d)   # row r: query r // g, head h * g + r % g
    err = (outs[0][0].float() - ref).abs().max().item()
    assert err <= 2 ** -7 * ref.abs().max().item(), (d, err)   # one bf16 ulp: the interpreter's cast truncates
print("bench combine ok")
"""


@pytest.mark.interpreted(CODE, "bench combine ok", timeout=300)
def test_the_benchs_combine_gives_the_combined_state_at_both_tiles(request):
    run_marked(request)


@pytest.mark.parametrize("layer", ["sliding", "full_1280"])
def test_the_libraries_attend_over_the_keys_the_served_row_sees(layer):
    """libraries() hands SDPA the keys the bench's canvas row sees (a full ring's every position, in ring
    order; the full layer's keys and the canvas's own), so its figures time the served problem: on the
    CPU (fp32, SDPA's CPU kernels) each backend that runs equals attention written out from the served
    kernel's mask rule (model/kernels/attention.py: key p at cache[p mod R], visible iff
    start + C - R <= p < start + C, and p > start - W on a sliding layer)."""
    import torch

    from benchmarks.attention_bench import LAYERS, WINDOW, C, libraries, problem

    torch.manual_seed(0)
    d, hkv, keys, ring, _ = LAYERS[layer]
    q, k, v, _ = problem(d, hkv, keys, ring, device="cpu")
    q, k, v = q.float(), k.float(), v.float()
    end = keys + C   # the row starts at `keys`, bidirectional
    positions = torch.arange(0, end)
    if ring is not None:
        positions = positions[(positions > keys - WINDOW) & (positions >= end - ring)]
    index = positions % ring if ring is not None else positions
    kk, vv = k[0, index], v[0, index]                          # [visible, hkv, d]
    g = q.shape[2] // hkv
    scores = torch.einsum("lhd,phd->hlp", q[0], kk.repeat_interleave(g, 1))
    expected = torch.einsum("hlp,phd->lhd", scores.softmax(-1), vv.repeat_interleave(g, 1))[None]
    row = libraries(expected, q, k, v, keys, ring, timed=False, flex=False)
    ran = [name for name in row if name.endswith("_rel_diff")]
    assert ran, row
    for name in ran:
        assert row[name] < 1e-5, (name, row)
