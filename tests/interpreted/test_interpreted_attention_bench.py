"""The split combine as benchmarks/attention_bench.py launches it (model.kernels.attention.split_combine
on the bench's partial states), under triton's CPU interpreter: at its served tiles and at the attention
program's it gives the same bits, and both equal the combined softmax state computed in torch (so a GPU
session does not spend its time on a wrong launch). Run under TRITON_INTERPRET=1 only
(tests/test_interpreted_kernels.py)."""
import pytest
import torch

pytest.importorskip("triton")

import benchmarks.attention_bench as bench
from benchmarks.attention_bench import HEADS, combine_problem
from model.kernels.attention import split_combine


def test_the_benchs_combine_gives_the_combined_state_at_both_tiles(monkeypatch):
    # a canvas of 64 positions, not the bench's 256 (the interpreter's time goes by the programs, one per
    # tile of rows and kv head): its 128 and 512 rows a kv head are still whole tiles at both tile sizes,
    # several of them at all but 128 rows a program, as the bench's 512 and 2048 are
    monkeypatch.setattr(bench, "C", 64)
    C = bench.C
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
        # row r: query r // g, head h * g + r % g
        ref = ref.view(hkv, C, g, d).permute(1, 0, 2, 3).reshape(C, HEADS, d)
        err = (outs[0][0].float() - ref).abs().max().item()
        assert err <= 2 ** -7 * ref.abs().max().item(), (d, err)   # one bf16 ulp: the interpreter's cast truncates
