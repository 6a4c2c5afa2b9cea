"""FP8-dynamic arithmetic (compressed-tensors' FP8_DYNAMIC scheme, model/quant_config.py): weights stored
as float8_e4m3fn with one scale per output channel, activations quantized per token as they arrive.

    sx = max(absmax(x_t) / 448, 1 / (448 * 512)),  xq = fp8(clamp(x_t / sx, +-448)),  y_t = (xq sx)(Wq sw)^T

The functions here are the reference every device without FP8 tensor cores runs (the CPU; CUDA for fp32
and fp64 models), and model/kernels/fp8.py reproduces them up to summation order: compressed-tensors'
rounding, vLLM's floor on the scale, dequantized math in fp32 rounded once. Under tensor parallelism each
rank scales its own K-slice of a row-parallel input. The reasons for each choice: docs/kernels.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from model.batch_invariant import linear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # torch.finfo(float8_e4m3fn).max
# The floor of a dynamic per-token scale: vLLM's _FP8_MIN_SCALING_FACTOR = 1 / (FP8_MAX * 512)
# (vllm/model_executor/layers/quantization/input_quant_fp8.py, and its CUDA per-token kernel), so a
# row of zeros quantizes to zeros rather than 0 / 0. (compressed-tensors' own calibration only replaces
# a zero scale, by 0.125 for FP8; a served model's activations follow vLLM's rule.)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an FP8 matmul of a `dtype` model accumulates in: fp32 (fp64 for an fp64 model)."""
    return torch.promote_types(dtype, torch.float32)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq [..., K] float8_e4m3fn, sx [..., 1] fp32): symmetric, one scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_channel(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's weight [..., out, in] -> (Wq float8_e4m3fn, sw [..., out, 1] in `scale_dtype`): the
    scale absmax / 448 per output channel (compressed-tensors' calculate_qparams for a symmetric float8),
    rounded to its stored dtype first so that Wq is what that stored scale dequantizes."""
    wf = w.float()
    scale = (wf.abs().amax(-1, keepdim=True) / FP8_MAX).to(scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)   # an all-zero channel: any scale
    return (wf / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in `dtype` (exact in fp32 and fp64); scale broadcasts over q's last dim."""
    return q.to(dtype) * scale.to(dtype)


def fake_quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to FP8 per token as the served path rounds it, dequantized into `dtype`."""
    return dequantize(*quantize_per_token(x), dtype)


def kernels_take(x: torch.Tensor) -> bool:
    """Whether activations x go through the FP8 kernels (model.kernels.fp8; in the batch-invariant mode,
    its fixed-order ones): 16-bit activations on a GPU with FP8 tensor cores (compute capability 8.9+).
    Elsewhere the reference below runs."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


class Quantized(NamedTuple):
    """Activations [..., K] quantized per row, as the FP8 kernels read them (model.fused makes them in the
    kernel that produces the activations: a norm or a gated activation)."""
    q: torch.Tensor             # [rows, K] float8_e4m3fn
    scale: torch.Tensor         # [rows] fp32
    dtype: torch.dtype          # the activations' own dtype: the matmul's output's
    lead: tuple[int, ...]       # the activations' leading dims: the matmul's output is [*lead, N]

    @property
    def shape(self) -> torch.Size:
        """The activations' shape [*lead, K], as a layer that reads them sees it."""
        return torch.Size((*self.lead, self.q.shape[-1]))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] W^T for an FP8 weight [out, in] with its scales [out, 1] -> [..., out] in x's dtype: the
    reference (model.parallel.linear sends activations the kernels take to them instead), through
    batch_invariant.linear as the unquantized path goes."""
    dtype = compute_dtype(x.dtype)
    return linear(fake_quantize_per_token(x, dtype), dequantize(weight, weight_scale, dtype)).to(x.dtype)
