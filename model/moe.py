"""DiffusionGemma's mixture of experts (docs/spec.md 2.2), one tensor-parallel rank of it: the router and
the routed experts of a layer.

    weights, ids = router(x)                   top-k experts per token, softmax-renormalised, scaled
    moe(x)       = sum_j weights_j * down_e(gelu_tanh(gate_e(x)) * up_e(x)),   e = ids_j

Every expert lives on every rank, split along its intermediate dim, so a rank's output is a partial sum
the layer adds to its dense MLP's in one all-reduce. The pairs are sorted by expert and each projection
is one grouped matmul: no host sync, no per-expert loop. FP8 experts, stored one per expert, are fused
at load into [E, 2I, H] and [E, H, I] with their scales, then chunked for the FP8 kernel (docs/kernels.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.batch_invariant import row_sum, softmax
from model.config import DiffusionGemmaConfig
from model.fp8 import FP8, Quantized, compute_dtype, dequantize, fake_quantize_per_token, kernels_take
from model.fused import as_quantized, gelu_mul, gelu_mul_quantized
from model.parallel.group import TPGroup
from model.parallel.linear import (ReplicatedLinear, check_shape, copy_into, divide, new_param, new_scale,
                                   read_slice)
from model.quant_config import QuantScope


class GemmaRouter(nn.Module):
    """Top-k experts per token from the un-normed residual: softmax in fp32, the k weights renormalised
    to sum 1, then each scaled by its expert's `per_expert_scale`. Replicated: every rank routes alike."""

    def __init__(self, cfg: DiffusionGemmaConfig, quant: QuantScope):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.scalar_root_size = cfg.hidden_size ** -0.5
        self.proj = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, fp8=quant.fp8("proj"))
        self.scale = new_param(cfg.hidden_size)
        self.per_expert_scale = new_param(cfg.num_experts)

    def forward(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """normed [T, H]: norm(x) * scale / sqrt(H) of the residual x (fused with the layer's other norms:
        model.fused.gemma_feedforward_inputs) -> weights [T, k] fp32, expert ids [T, k]."""
        scores = self.proj(normed)
        if scores.is_cuda and scores.dtype != torch.float64:   # one kernel (model.kernels.routing)
            from model.kernels.routing import route

            return route(scores, self.per_expert_scale, self.top_k)
        probs = softmax(scores, torch.promote_types(scores.dtype, torch.float32))
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / row_sum(weights).unsqueeze(-1)
        return weights * self.per_expert_scale[ids], ids


class GemmaExperts(nn.Module):
    """Every expert on every rank, each split along its intermediate dim (gate|up rows, down columns).
    Checkpoint layout: gate_up_proj [E, 2 * I, H] (gate rows first), down_proj [E, H, I]; FP8 (`quant`
    quantizes the checkpoint's `experts.{e}.*_proj`): per expert, fused here (the module docstring).
    The weights are applied in one place, `project`."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden = E, H = cfg.num_experts, cfg.hidden_size
        self.total_intermediate = cfg.moe_intermediate_size
        self.intermediate = divide(cfg.moe_intermediate_size, tp.world_size, "moe_intermediate_size")
        self.chunked = False   # the FP8 weights rewritten for the grouped kernel's tiles (chunk_for_kernels)
        if not quant.fp8(*(f"{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj"))):
            self.gate_up_proj = new_param(E, 2 * self.intermediate, H, loader=self.gate_up_loader)
            self.down_proj = new_param(E, H, self.intermediate, loader=self.down_loader)
            self.gate_up_proj_scale = self.down_proj_scale = None
            return
        i = self.intermediate
        self.gate_up_proj = new_param(E, 2 * i, H, loader=self.expert_gate_up_loader, dtype=FP8)
        self.gate_up_proj_scale = new_scale(E, 2 * i, loader=self.expert_gate_up_loader)
        self.down_proj = new_param(E, H, i, loader=self.expert_down_loader, dtype=FP8)
        self.down_proj_scale = new_scale(E, H, loader=self.expert_down_loader)
        # the checkpoint tensors each parameter is fused from, under this module, with their shard ids
        for suffix, param in (("weight", self.gate_up_proj), ("weight_scale", self.gate_up_proj_scale)):
            param.checkpoint_names = {f"{e}.{p}.{suffix}": (e, half) for e in range(E)
                                      for half, p in enumerate(("gate_proj", "up_proj"))}
        for suffix, param in (("weight", self.down_proj), ("weight_scale", self.down_proj_scale)):
            param.checkpoint_names = {f"{e}.down_proj.{suffix}": e for e in range(E)}

    def gate_up_loader(self, param: nn.Parameter, source) -> None:
        i, start = self.intermediate, self.tp.rank * self.intermediate
        check_shape(source, (self.num_experts, 2 * self.total_intermediate, self.hidden))
        for half in range(2):  # gate, then up
            offset = half * self.total_intermediate + start
            copy_into(param.data.narrow(1, half * i, i), read_slice(source, 1, offset, offset + i))

    def down_loader(self, param: nn.Parameter, source) -> None:
        start = self.tp.rank * self.intermediate
        check_shape(source, (self.num_experts, self.hidden, self.total_intermediate))
        copy_into(param, read_slice(source, 2, start, start + self.intermediate))

    def expert_gate_up_loader(self, param: nn.Parameter, source, shard: tuple[int, int]) -> None:
        """Expert e's gate (half 0) or up (half 1) projection [I, H], or its scales [I, 1]: this rank's rows."""
        e, half = shard
        i, start = self.intermediate, self.tp.rank * self.intermediate
        is_scale = param.dim() == 2
        check_shape(source, (self.total_intermediate, 1 if is_scale else self.hidden))
        rows = read_slice(source, 0, start, start + i)
        copy_into(param.data[e].narrow(0, half * i, i), rows[:, 0] if is_scale else rows)

    def expert_down_loader(self, param: nn.Parameter, source, e: int) -> None:
        """Expert e's down projection [H, I]: this rank's columns; or its scales [H, 1]: all of them."""
        if param.dim() == 2:
            check_shape(source, (self.hidden, 1))
            copy_into(param.data[e], read_slice(source, 0, 0, self.hidden)[:, 0])
            return
        start = self.tp.rank * self.intermediate
        check_shape(source, (self.hidden, self.total_intermediate))
        copy_into(param.data[e], read_slice(source, 1, start, start + self.intermediate))

    def chunk_for_kernels(self, dtype: torch.dtype) -> None:
        """After loading: where the FP8 kernels will run the experts (activations of `dtype` here take
        them), each weight is rewritten chunked for its projection's tiles, so that every tile's step of K
        is one contiguous read (docs/kernels.md). The parameter then holds the chunked bytes
        (the same count, where N is a multiple of the tiles' columns, as DiffusionGemma's is); the reference
        path, which reads the dense layout, is refused from then on."""
        if self.chunked or self.down_proj_scale is None or not self.fp8_kernels(
                torch.empty(0, dtype=dtype, device=self.down_proj.device)):
            return   # chunked already, BF16 experts, or the reference path will run them
        from model.kernels.fp8 import EXPERT_TILES   # triton: imported where CUDA runs it
        from model.kernels.invariant import chunk_weight

        for param, tiles in ((self.gate_up_proj, EXPERT_TILES.gate_up), (self.down_proj, EXPERT_TILES.down)):
            param.data = chunk_weight(param.data, tiles.n, tiles.k).data
        self.chunked = True

    def kernel_weights(self) -> tuple:
        """gate_up and down as the FP8 grouped kernel reads them: the parameters, or views of them as the
        ChunkedWeight they hold once chunked (the layout described from the parameter, not kept beside it)."""
        if not self.chunked:
            return self.gate_up_proj, self.down_proj
        from model.kernels.fp8 import EXPERT_TILES
        from model.kernels.invariant import ChunkedWeight

        g, d = EXPERT_TILES.gate_up, EXPERT_TILES.down
        return (ChunkedWeight(self.gate_up_proj, 2 * self.intermediate, self.hidden, g.n, g.k),
                ChunkedWeight(self.down_proj, self.hidden, self.intermediate, d.n, d.k))

    def project(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, pairs: SortedPairs,
                gather: bool = False) -> torch.Tensor:
        """grouped_linear with one of the two weights (FP8: fp8_grouped_linear with its scales)."""
        if self.chunked:
            raise RuntimeError(f"the experts' weights were chunked for the FP8 kernels at load, but these "
                               f"activations ({x.dtype} on {x.device}) do not take them")
        if scale is None:
            return grouped_linear(x, weight, pairs, gather)
        return fp8_grouped_linear(x, weight, scale, pairs, gather)

    def fp8_kernels(self, x: torch.Tensor) -> bool:
        """FP8 experts whose dims the FP8 kernels take (multiples of 16), activations they take."""
        return (self.down_proj_scale is not None and self.hidden % 16 == 0 and self.intermediate % 16 == 0
                and kernels_take(x))

    def scaled(self, x: torch.Tensor | Quantized, pairs: SortedPairs) -> torch.Tensor:
        """Both projections through model.kernels.fp8: the tokens quantized once (by their norm's kernel,
        or here; every pair of a token reads its row and scale), the gated activation quantized in its
        own kernel."""
        from model.kernels.fp8 import EXPERT_TILES, scaled_grouped   # triton: imported where CUDA runs it

        a = as_quantized(x)
        invariant = batch_invariant.enabled()
        gate_up_w, down_w = self.kernel_weights()
        gate_up = scaled_grouped(a.q, a.scale, gate_up_w, self.gate_up_proj_scale, pairs.ends, pairs.token,
                                 a.dtype, pairs.tile_map, invariant, EXPERT_TILES.gate_up)
        h = gelu_mul_quantized(gate_up)
        return scaled_grouped(h.q, h.scale, down_w, self.down_proj_scale, pairs.ends, None, a.dtype,
                              pairs.tile_map, invariant, EXPERT_TILES.down)

    def forward(self, x: torch.Tensor | Quantized, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] (or quantized by its norm, where fp8_kernels said so), weights/ids [T, k] (the
        router's) -> this rank's partial sum of the experts' output [T, H] (the layer sums it over the
        ranks with its dense MLP's, in one all-reduce)."""
        fp8 = isinstance(x, Quantized) or self.fp8_kernels(x)
        pairs = sort_pairs(ids, self.num_experts, fp8)
        if fp8:
            y = self.scaled(x, pairs)
        else:
            h = gelu_mul(self.project(x, self.gate_up_proj, self.gate_up_proj_scale, pairs, gather=True))
            y = self.project(h, self.down_proj, self.down_proj_scale, pairs)
        return combine_pairs(y, pairs, weights).to(x.dtype)


class SortedPairs(NamedTuple):
    """The (token, expert) pairs t * k + j sorted by expert (stably: within an expert, in pair order)."""
    token: torch.Tensor           # [P]: the token of the i-th sorted pair
    slot: torch.Tensor            # [P]: where pair t * k + j was sorted to
    ends: torch.Tensor            # [E] int32: cumulative pairs per expert
    tile_map: tuple[torch.Tensor, torch.Tensor] | None   # the triton grouped kernel's (CUDA), else None


def sort_pairs(ids: torch.Tensor, num_experts: int, fp8: bool = False) -> SortedPairs:
    """On CUDA three launches of model.kernels.routing (with the tile map of the grouped kernel that runs:
    the FP8 experts' tiles, `fp8`, or the BF16 ones); elsewhere a stable argsort, the reference."""
    if ids.is_cuda:
        from model.kernels import invariant, routing
        from model.kernels.fp8 import EXPERT_TILES

        block_m = EXPERT_TILES.m if fp8 else invariant.GROUPED_TILES.m
        token, slot, ends, *tile_map = routing.sort_pairs(ids, num_experts, block_m)
        return SortedPairs(token, slot, ends, tuple(tile_map))
    k, flat = ids.shape[-1], ids.flatten()
    # a radix sort's passes follow the key's bits: ids as the narrowest integer holding them
    order = torch.argsort(flat.to(_narrowest_int(num_experts)), stable=True)
    slot = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=order.device))
    # tokens per expert without bincount, whose output size depends on the data (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    return SortedPairs(order // k, slot, torch.cumsum(counts, 0).to(torch.int32), None)


def _narrowest_int(n: int) -> torch.dtype:
    """The narrowest integer dtype holding 0..n-1."""
    return torch.uint8 if n <= 256 else torch.int16 if n <= 1 << 15 else torch.int32


# rows per expert (on average) up to which model.kernels.invariant's grouped kernel, which reads each
# pair's token row in place, beats grouped_mm (docs/kernels.md)
FEW_ROWS_PER_EXPERT = 32


def grouped_linear(x: torch.Tensor, w: torch.Tensor, pairs: SortedPairs, gather: bool = False) -> torch.Tensor:
    """The sorted pairs' rows (x's rows in pair order; `gather`: x [T, in] is per token, row i of the
    problem is x[pairs.token[i]]) times their expert's weight: -> [P, out] (w [E, out, in])."""
    rows = pairs.token if gather else None
    n = pairs.token.shape[0]
    if x.is_cuda and x.dtype != torch.float64 and (batch_invariant.enabled() or n <= FEW_ROWS_PER_EXPERT * w.shape[0]):
        return batch_invariant.grouped_matmul(x, w, pairs.ends, rows, pairs.tile_map)
    if gather:
        x = x[rows]
    if _grouped_mm_takes(x):
        return F.grouped_mm(x, w.transpose(1, 2), offs=pairs.ends)
    # every row with its own group's weight: dtypes grouped_mm lacks (fp32 on CUDA, the tests' float64);
    # no host sync, but N weight copies, so only for the small models those run
    group = torch.searchsorted(pairs.ends, torch.arange(n, device=x.device, dtype=pairs.ends.dtype), right=True)
    return torch.einsum("ni,noi->no", x, w[group])


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, pairs: SortedPairs,
                       gather: bool = False) -> torch.Tensor:
    """grouped_linear of FP8 expert weights w [E, out, in] with their scales [E, out] -> [P, out] in x's
    dtype: the reference (model/fp8.py; GemmaExperts.scaled runs model.kernels.fp8 where it can): x
    rounded to FP8 per token (per pair row: a gathered row is its token's), weights dequantized, the
    matmul in fp32 (fp64 for an fp64 model)."""
    dtype = compute_dtype(x.dtype)
    xq, wq = fake_quantize_per_token(x, dtype), dequantize(w, scale.unsqueeze(-1), dtype)
    return grouped_linear(xq, wq, pairs, gather).to(x.dtype)


def _grouped_mm_takes(x: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    return x.dtype == torch.bfloat16 or (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16))


def combine_pairs(y: torch.Tensor, pairs: SortedPairs, weights: torch.Tensor) -> torch.Tensor:
    """y [P, H] in sorted pair order, weights [T, k] -> each token's weighted sum of its k outputs [T, H],
    in slot order (not scattered with index_add_, whose atomics race and were slower): on CUDA one
    kernel that reads them where they lie (model.kernels.expert_combine), elsewhere a gather back to
    pair order and a bmm."""
    k = weights.shape[-1]
    if y.is_cuda and y.dtype != torch.float64:
        from model.kernels.expert_combine import combine

        return combine(y, pairs.slot, weights)
    grouped = y[pairs.slot].view(-1, k, y.shape[-1])   # [T, k, H], each token's pairs in slot order
    if batch_invariant.enabled():  # slot by slot, in slot order
        return batch_invariant.sum_in_order((grouped * weights[..., None]).transpose(0, 1))
    return torch.bmm(weights.unsqueeze(1).to(grouped.dtype), grouped).squeeze(1)
