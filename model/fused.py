"""The layers' elementwise chains (norms, residual adds, rotary embeddings, gated activations), each one
function that runs as one fused kernel on CUDA: compiled by torch.compile (inductor, dynamic shapes), or
a hand-written triton kernel where that reads a row once (rotary, gemma_qkv, the FP8-quantizing ones).
Elsewhere each runs as written, which is the reference (transformers' order of operations and roundings).
Should inductor fail, a chain runs unfused from then on and says so once. In the batch-invariant mode a
norm's sum of squares is an opaque fixed-order row kernel inside the chain. Why: docs/kernels.md.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from model.batch_invariant import mean_square
from model.fp8 import Quantized, quantize_per_token

if TYPE_CHECKING:
    from model.attention import KVRows

log = logging.getLogger("dllm.fused")


def fused(fn):
    """fn as one compiled kernel on CUDA. Should inductor fail on this machine, the function runs
    unfused from then on (slower, same results), and says so once in the log."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if not args[0].is_cuda or compiled is False:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(*args)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not take the server down
            log.warning("could not fuse %s (%s: %s); running it unfused", fn.__name__, type(err).__name__, err)
            compiled = False
            return fn(*args)

    return call


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


# ---- Ministral-3 (Nemotron-Labs-Diffusion) --------------------------------------------------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / rms(x): normalised in fp32 (an fp64 model's in fp64), cast back before the weight
    (Ministral-3's order)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(mean_square(h) + eps)
    return weight * h.to(x.dtype)


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): a residual add and the next norm in one pass."""
    h = x + residual
    return h, _rms(h, weight, eps)


def _per_head_kernel(q: torch.Tensor) -> bool:
    """Whether model.kernels.qk_norm_rope takes these heads: CUDA, not fp64, a power-of-two head dim."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype != torch.float64 and d & (d - 1) == 0


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: torch.Tensor | None,
           v: torch.Tensor | None = None, cache: KVRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k, then the Llama-4 query scale (after RoPE); with `cache`, k' and v stored into its
    rows. On CUDA one triton kernel (model.kernels.qk_norm_rope, as gemma_qkv); elsewhere the reference
    below."""
    if _per_head_kernel(q):
        from model.kernels.qk_norm_rope import qk_rope

        return qk_rope(q, k, cos, sin, q_scale, v, cache)
    q, k = _rotary_qk(q, k, cos, sin, q_scale)
    if cache is not None:
        cache.store(k, v)
    return q, k


def _rotary_qk(q, k, cos, sin, q_scale):
    q = _rotary(q, cos, sin)
    if q_scale is not None:
        q = q * q_scale
    return q, _rotary(k, cos, sin)


@fused
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Gemma-4 (DiffusionGemma) ---------------------------------------------------------------------

def _gemma_rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 [* w], all in fp32 (an fp64 model's in fp64) and cast back once (the
    weight used as is)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.pow(mean_square(h) + eps, -0.5)
    if weight is not None:
        h = h * weight.to(h.dtype)
    return h.type_as(x)


@fused
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _gemma_rms(x, weight, eps)


def gemma_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              eps: float, cos: torch.Tensor, sin: torch.Tensor,
              cache: KVRows | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMS norms of q, k (scaled) and v (unscaled), and RoPE of q and k; with `cache`, k' and v'
    stored into its rows. On CUDA one triton kernel (model.kernels.qk_norm_rope: inductor's chains over
    these strided per-head rows took longer than their bytes need); elsewhere the reference below."""
    if _per_head_kernel(q):
        from model.kernels.qk_norm_rope import qkv_norm_rope

        return qkv_norm_rope(q, k, v, q_weight, k_weight, eps, cos, sin, cache)
    q, k, v = _gemma_qkv(q, k, v, q_weight, k_weight, eps, cos, sin)
    if cache is not None:
        cache.store(k, v)
    return q, k, v


def _gemma_qkv(q, k, v, q_weight, k_weight, eps, cos, sin):
    q = _rotary(_gemma_rms(q, q_weight, eps), cos, sin)
    k = _rotary(_gemma_rms(k, k_weight, eps), cos, sin)
    return q, k, _gemma_rms(v, None, eps)


@fused
def add_gemma_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h + norm(x): a sublayer's output normed onto the residual."""
    return h + _gemma_rms(x, weight, eps)


@fused
def gemma_feedforward_inputs(h: torch.Tensor, dense_weight: torch.Tensor, moe_weight: torch.Tensor,
                             router_scale: torch.Tensor, router_root: float,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three norms of the residual a feed-forward block reads: the dense MLP's, the experts' and the
    router's (unscaled norm, then its scale vector and 1/sqrt(hidden))."""
    return (_gemma_rms(h, dense_weight, eps), _gemma_rms(h, moe_weight, eps),
            _gemma_rms(h, None, eps) * router_scale * router_root)


@fused
def gemma_feedforward_out(h: torch.Tensor, dense: torch.Tensor, moe: torch.Tensor, w1: torch.Tensor,
                          w2: torch.Tensor, w: torch.Tensor, layer_scalar: torch.Tensor, eps: float) -> torch.Tensor:
    """(h + norm(norm_1(dense) + norm_2(moe))) * layer_scalar."""
    out = _gemma_rms(_gemma_rms(dense, w1, eps) + _gemma_rms(moe, w2, eps), w, eps)
    return (h + out) * layer_scalar


@fused
def gelu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ---- FP8-dynamic activations (model/fp8.py): quantized per row in the kernel that produces them ----
# The FP8 kernels read activations as (rows, one scale a row). A norm or a gated activation that feeds
# an FP8 projection returns them so, from the same kernel: no separate pass over the activations.
# Each is the unquantized function's math, then model.fp8.quantize_per_token; on CUDA a row-per-program
# triton kernel (model/kernels/quantize.py), where rows are too wide for it inductor's chain below.

def _row_kernel(x: torch.Tensor, width: int, *others: torch.Tensor | None) -> bool:
    """Whether model.kernels.quantize takes rows x producing `width` values each, with `others` (a residual,
    a weight) of x's dtype (the kernel rounds to x's; the reference would promote to theirs)."""
    if not x.is_cuda or any(t is not None and t.dtype != x.dtype for t in others):
        return False
    from model.kernels.quantize import takes

    return takes(x, width)


def _quantize(x: torch.Tensor, **producer):
    from model.kernels.quantize import quantize

    return quantize(x, **producer)

def _per_row(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_per_token(y)
    return q, scale.squeeze(-1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@fused
def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_row(x)


@fused
def _silu_mul_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = x.chunk(2, dim=-1)
    return _per_row(F.silu(gate) * up)


@fused
def _gelu_mul_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = x.chunk(2, dim=-1)
    return _per_row(F.gelu(gate, approximate="tanh") * up)


@fused
def _rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_row(_rms(x, weight, eps))


@fused
def _add_rms_norm_quantized(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = x + residual
    return (h, *_per_row(_rms(h, weight, eps)))


@fused
def _gemma_rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_row(_gemma_rms(x, weight, eps))


@fused
def _gemma_feedforward_inputs_quantized(h: torch.Tensor, dense_weight: torch.Tensor, moe_weight: torch.Tensor,
                                        router_scale: torch.Tensor, router_root: float, eps: float):
    return (*_per_row(_gemma_rms(h, dense_weight, eps)), *_per_row(_gemma_rms(h, moe_weight, eps)),
            _gemma_rms(h, None, eps) * router_scale * router_root)


def _producer_quantized(x: torch.Tensor, chain, **producer) -> Quantized:
    """x's rows through `producer` and quantized per row: in the row kernel where it takes them, else in
    inductor's chain(rows)."""
    rows = _rows(x)
    width = rows.shape[1] // 2 if producer.get("gate") else rows.shape[1]
    q = _quantize(rows, **producer) if _row_kernel(rows, width, producer.get("weight")) else chain(rows)
    return Quantized(*q, x.dtype, x.shape[:-1])


def quantize_rows(x: torch.Tensor) -> Quantized:
    """x [..., K] quantized per row (one kernel reading x once): activations no kernel of ours produces
    (the attention's output)."""
    return _producer_quantized(x, _quantized_rows)


def as_quantized(x: torch.Tensor | Quantized) -> Quantized:
    """An FP8 kernel's input: as its producer's kernel quantized it, else quantize_rows(x)."""
    return x if isinstance(x, Quantized) else quantize_rows(x)


def silu_mul_quantized(x: torch.Tensor) -> Quantized:
    """silu_mul(x) quantized per row, in silu_mul's kernel: the FP8 down projection's input."""
    return _producer_quantized(x, _silu_mul_quantized, gate="silu")


def gelu_mul_quantized(x: torch.Tensor) -> Quantized:
    """gelu_mul(x) quantized per row, in gelu_mul's kernel: the FP8 down projection's input."""
    return _producer_quantized(x, _gelu_mul_quantized, gate="gelu")


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    """rms_norm(x) quantized per row, in the norm's kernel: an FP8 projection's input."""
    return _producer_quantized(x, lambda rows: _rms_norm_quantized(rows, weight, eps), weight=weight.contiguous(),
                               eps=eps, norm="ministral")


def add_rms_norm_quantized(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, Quantized]:
    """add_rms_norm with the norm quantized per row, in one kernel: (x + residual, an FP8 projection's input)."""
    rows, res = _rows(x), _rows(residual)
    if _row_kernel(rows, rows.shape[1], res, weight) and res.stride(-1) == 1:
        h, q, scale = _quantize(rows, residual=res, weight=weight.contiguous(), eps=eps, norm="ministral")
    else:
        h, q, scale = _add_rms_norm_quantized(rows, res, weight, eps)
    return h.view_as(x), Quantized(q, scale, x.dtype, x.shape[:-1])


def gemma_rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    """gemma_rms_norm(x) quantized per row, in the norm's kernel: an FP8 projection's input."""
    return _producer_quantized(x, lambda rows: _gemma_rms_norm_quantized(rows, weight, eps),
                               weight=weight.contiguous(), eps=eps, norm="gemma")


def gemma_feedforward_inputs_quantized(h: torch.Tensor, dense_weight: torch.Tensor, moe_weight: torch.Tensor,
                                       router_scale: torch.Tensor, router_root: float,
                                       eps: float) -> tuple[Quantized, Quantized, torch.Tensor]:
    """gemma_feedforward_inputs with the dense MLP's and the experts' inputs quantized per row, in the
    same kernel; the router's input stays unquantized (the router is BF16)."""
    qd, sd, qm, sm, router = _gemma_feedforward_inputs_quantized(_rows(h), dense_weight, moe_weight, router_scale,
                                                                 router_root, eps)
    lead = h.shape[:-1]
    return Quantized(qd, sd, h.dtype, lead), Quantized(qm, sm, h.dtype, lead), router.view_as(h)
