"""Batch-invariant mode's triton kernels (model/kernels/invariant.py, model/kernels/fp8.py) under
triton's CPU interpreter: they equal a float64 reference and give a row the same bits wherever it sits
in a batch; the mode's row sum compiles inside a fused chain. Run under TRITON_INTERPRET=1 only
(tests/test_interpreted_kernels.py); the rest of the mode is tests/test_batch_invariant.py's."""
import pytest
import torch

pytest.importorskip("triton")

from model.kernels import invariant as K


def test_invariant_kernels_in_the_interpreter():
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for n, k in ((160, 2048), (300, 96)):          # 8 K-splits; one split (K too short to split)
            w = torch.randn(n, k, dtype=dtype)
            x = torch.randn(70, k, dtype=dtype)
            assert K.k_splits(n, k, x.device) == (8 if k == 2048 else 1)
            y = K.matmul(x, w)
            ref = x.double() @ w.double().T
            assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol, (dtype, n, k)
            for splits in (1, 3):                        # fp8_gemm_bench's override of k_splits
                ys = K.matmul(x, w, splits=splits)
                assert ((ys.double() - ref).abs().max() / ref.abs().max()) < tol, (dtype, n, k, splits)
            for lo, hi in ((5, 6), (3, 40), (0, 70)):   # row 5 alone, at offset 2 of 37 rows, in all 70
                assert torch.equal(K.matmul(x[lo:hi], w)[5 - lo], y[5]), (dtype, n, k, lo, hi)
            wt = torch.randn(k, n, dtype=dtype)          # a transposed view (the self-conditioning table)
            ref = x.double() @ wt.double()
            assert ((K.matmul(x, wt.t()).double() - ref).abs().max() / ref.abs().max()) < tol
        E, N, D = 6, 40, 96
        w = torch.randn(E, N, D, dtype=dtype)
        counts = torch.tensor([3, 0, 37, 1, 7, 0])       # an empty expert, one spanning three 16-row tiles
        ends = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(int(counts.sum()), D, dtype=dtype)
        y = K.grouped_matmul(x, w, ends)
        group = torch.repeat_interleave(torch.arange(E), counts)
        ref = torch.einsum("ni,noi->no", x.double(), w.double()[group])
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol
        alone = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32)   # row 20 (expert 2's 18th) alone
        assert torch.equal(K.grouped_matmul(x[20:21], w, alone), y[20:21])
        source = torch.randn(11, D, dtype=dtype)                       # rows gathered in the kernel
        rows = torch.randint(0, 11, (len(x),))
        assert torch.equal(K.grouped_matmul(source, w, ends, rows), K.grouped_matmul(source[rows], w, ends))
        chunks = K.chunk_weight(w, K.GROUPED_TILES.n, K.GROUPED_TILES.k)   # N, K not multiples of the chunk
        assert torch.equal(K.grouped_matmul(source, chunks, ends, rows), K.grouped_matmul(source, w, ends, rows))
        h = torch.randn(33, 5000, dtype=dtype)
        s = K.row_sum(h, square=True)
        assert s.dtype == torch.float32 and torch.allclose(s.double(), h.double().pow(2).sum(-1), rtol=1e-5)
        assert torch.equal(K.row_sum(h[9:10], square=True), s[9:10])
        assert K.row_sum(h, fp64=True).dtype == torch.float64


def fp8_rows(rows, k):
    from model.fp8 import quantize_per_token

    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
    x[1] = 0                                         # a row of zeros: the scale's floor
    q, s = quantize_per_token(x)
    return q, s[:, 0]


def close(y, ref, what):   # the products are exact; fp32 sums in another order, then one rounding
    err = ((y.double() - ref).abs() / (ref.abs() + ref.abs().max() * 1e-3)).max().item()
    assert err < 2 ** -7, (what, err)


def test_fp8_operands_in_the_interpreter():
    """The same kernels with FP8-dynamic operands (model.kernels.fp8 runs them for the experts at few rows
    per expert, and for every FP8 layer in the batch-invariant mode): the reference's products summed in
    fp32 and the two scales applied, a row's bits the same alone and in a batch, rows and scales gathered;
    the grouped kernel's swapped tiles (the tokens as the MMA's narrow side) too."""
    from model.fp8 import dequantize, quantize_per_channel
    from model.kernels import fp8

    torch.manual_seed(0)
    for n, k in ((160, 2048), (48, 256)):               # 4 K-splits of 128-deep chunks; one split
        w, sw = quantize_per_channel(torch.randn(n, k) * 0.02)
        xq, sx = fp8_rows(70, k)
        assert K.k_splits(n, k, xq.device, K.FP8_MATMUL_TILES) == (4 if k == 2048 else 1)
        y = fp8.scaled_linear(xq, sx, w, sw.float(), torch.bfloat16, invariant=True)
        assert y.dtype == torch.bfloat16 and y.shape == (70, n)
        ref = dequantize(xq, sx[:, None], torch.float64) @ dequantize(w, sw, torch.float64).T
        close(y, ref, ("dense", n, k))
        assert (y[1] == 0).all()
        for lo, hi in ((5, 6), (3, 40), (0, 70)):        # row 5 alone, among 37 rows, among all 70
            got = fp8.scaled_linear(xq[lo:hi], sx[lo:hi], w, sw.float(), torch.bfloat16, invariant=True)
            assert torch.equal(got[5 - lo], y[5]), ("dense", n, k, lo, hi)

    E, N, D = 6, 40, 256
    w, sw = quantize_per_channel(torch.randn(E, N, D) * 0.02)
    sw = sw[..., 0].float()
    counts = torch.tensor([3, 0, 70, 1, 7, 0])           # an empty expert, one spanning two 64-row tiles
    ends = torch.cumsum(counts, 0).to(torch.int32)
    xq, sx = fp8_rows(int(counts.sum()), D)
    y = fp8.grouped_in_triton(xq, sx, w, sw, ends, None, torch.bfloat16)
    group = torch.repeat_interleave(torch.arange(E), counts)
    ref = torch.einsum("ni,noi->no", dequantize(xq, sx[:, None], torch.float64),
                       dequantize(w, sw[..., None], torch.float64)[group])
    close(y, ref, "grouped")
    alone = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32)   # row 40 (expert 2's 38th) alone
    assert torch.equal(fp8.grouped_in_triton(xq[40:41], sx[40:41], w, sw, alone, None, torch.bfloat16), y[40:41])
    tokens = torch.randint(0, 11, (len(xq),))                      # rows (and their scales) gathered in the kernel
    source_q, source_s = fp8_rows(11, D)
    assert torch.equal(fp8.scaled_grouped(source_q, source_s, w, sw, ends, tokens, torch.bfloat16, invariant=True),
                       fp8.grouped_in_triton(source_q[tokens], source_s[tokens], w, sw, ends, None, torch.bfloat16))
    for tiles in (K.Tiles(16, 32, 128, 4, 2, True), K.Tiles(32, 64, 128, 4, 2, True)):   # y^T = W x^T
        ys = K.grouped_matmul(xq, w, ends, tiles=tiles, x_scale=sx, w_scale=sw, out_dtype=torch.bfloat16)
        close(ys, ref, ("swapped", tiles))
        assert torch.equal(K.grouped_matmul(xq[40:41], w, alone, tiles=tiles, x_scale=sx[40:41], w_scale=sw,
                                            out_dtype=torch.bfloat16), ys[40:41]), tiles
        assert torch.equal(K.grouped_matmul(source_q, w, ends, tokens, tiles=tiles, x_scale=source_s, w_scale=sw,
                                            out_dtype=torch.bfloat16),
                           K.grouped_matmul(source_q[tokens], w, ends, tiles=tiles, x_scale=source_s[tokens],
                                            w_scale=sw, out_dtype=torch.bfloat16)), tiles
    # the weight chunked for the tiles (ChunkedWeight): the same values, so the same bits; K and N not
    # multiples of the chunks' (the last chunk narrower, the last block padded), gathered rows, and swapped tiles
    for n, d, tiles in ((40, 208, K.Tiles(64, 32, 128, 4, 2)), (64, 256, K.Tiles(64, 64, 64, 4, 2)),
                        (40, 208, K.Tiles(16, 32, 128, 4, 2, True))):
        wc, swc = quantize_per_channel(torch.randn(E, n, d) * 0.02)
        swc = swc[..., 0].float()
        chunks = K.chunk_weight(wc, tiles.n, tiles.k)
        assert chunks.shape == (E, n, d) and chunks.data.shape == (E, -(-n // tiles.n), tiles.n * d)
        assert torch.equal(chunks.dense().view(torch.uint8), wc.view(torch.uint8))
        xc, sxc = fp8_rows(11, d)
        for rows in (None, tokens):
            a, sa = (xc, sxc) if rows is not None else fp8_rows(len(tokens), d)
            dense = K.grouped_matmul(a, wc, ends, rows, tiles=tiles, x_scale=sa, w_scale=swc,
                                     out_dtype=torch.bfloat16)
            got = K.grouped_matmul(a, chunks, ends, rows, tiles=tiles, x_scale=sa, w_scale=swc,
                                   out_dtype=torch.bfloat16)
            assert torch.equal(got, dense), (n, d, tiles, rows is None)
        other = K.Tiles(64, 2 * tiles.n, tiles.k, 4, 2)
        with pytest.raises(AssertionError, match="chunked for other tiles"):   # a weight chunked for other tiles
            K.grouped_matmul(xc, chunks, ends, tokens, tiles=other, x_scale=sxc, w_scale=swc,
                             out_dtype=torch.bfloat16)


def test_row_cumsum_in_the_interpreter():
    torch.manual_seed(0)
    for d in (32, 256, 3000):                       # one block; several, the carry crossing them
        x = torch.rand(7, d)
        c = K.row_cumsum(x)
        assert torch.allclose(c.double(), x.double().cumsum(-1), rtol=1e-5), d
        assert torch.equal(K.row_cumsum(x[3:4]), c[3:4])


def test_the_row_kernel_compiles_inside_a_fused_chain():
    """torch.compile (fullgraph, dynamic shapes) takes the mode's row sum as an opaque op inside a norm's
    chain, and the compiled chain gives a row the same bits at 9, 3 and 1 rows."""
    from model.batch_invariant import _row_sum_op

    def norm(x, w, eps: float):
        h = x.to(torch.float32)
        h = h * torch.rsqrt((_row_sum_op(h, True, False) / h.shape[-1]).unsqueeze(-1) + eps)
        return w * h.to(x.dtype)

    torch.manual_seed(0)
    compiled = torch.compile(norm, dynamic=True, fullgraph=True)   # as model.fused compiles its chains
    x, w = torch.randn(9, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    full = compiled(x, w, 1e-5)
    assert (full.float() - norm(x, w, 1e-5).float()).abs().max() <= 0.02 * full.float().abs().max()
    assert torch.equal(compiled(x[2:5], w, 1e-5)[1], full[3]) and torch.equal(compiled(x[3:4], w, 1e-5)[0], full[3])
