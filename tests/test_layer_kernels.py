"""The layer kernels against the torch references they replace on CUDA, natively in a gpu test: the
per-head q/k/v chains after the qkv projection (model/kernels/qk_norm_rope.py), DiffusionGemma's routing
(model/kernels/routing.py) and weighted combine of expert outputs (model/kernels/expert_combine.py). The
cases are tests/interpreted/layer_cases.py's; under triton's CPU interpreter they are
tests/interpreted/test_interpreted_layer_kernels.py's (run by tests/test_interpreted_kernels.py)."""
import pytest
import torch


@pytest.mark.gpu
def test_kernels_equal_torch_reference_on_cuda():
    from tests.interpreted.layer_cases import run

    run("cuda", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)])
