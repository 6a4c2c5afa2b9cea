"""The layer kernels against the torch references they replace on CUDA (tests/interpreted/
layer_cases.py), under triton's CPU interpreter. Run under TRITON_INTERPRET=1 only
(tests/test_interpreted_kernels.py); the same cases on CUDA are tests/test_layer_kernels.py's."""
import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted.layer_cases import run


@pytest.mark.parametrize("dtypes,routing", [([(torch.float32, 1e-5)], False), ([(torch.bfloat16, 2 ** -6)], False),
                                            ([], True)], ids=["fp32", "bf16", "routing"])
def test_kernels_equal_torch_reference_interpreted(dtypes, routing):
    """fp32 to 1e-5; bf16 within two roundings of the fp32 result (DiffusionGemma's q and k round after
    the norm, as transformers does, and again at the end); the routing's tiles exactly."""
    # the route is one program a token, each on its own (~12 ms a token here): 32 tokens a case check it
    # as well as 1100 do; the sort takes every pair (its 1 and 2 SUBs a chunk need the 1100 tokens)
    run("cpu", dtypes, routing=routing, routed=32)
