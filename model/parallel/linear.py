"""Linear layers built already sharded (Megatron-style), each parameter carrying its own
`weight_loader(param, source[, shard_id])` that checks the whole tensor's shape and reads only this
rank's slice (`source`: a tensor, or the loader's lazy safetensors slice, so no rank materialises a
whole checkpoint tensor). Built with `fp8=True` (model/quant_config.py says which), a linear holds
float8_e4m3fn weights and a `weight_scale` [out, 1], sharded as its rows are (split in column-parallel
layers, replicated KV heads included; whole in row-parallel ones), and multiplies through
model.kernels.fp8 where its activations allow (model.fp8.kernels_take), else through model.fp8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.batch_invariant import linear
from model.fp8 import FP8, Quantized, fp8_linear, kernels_take
from model.fused import as_quantized
from model.parallel.group import TPGroup, shard_range


def read_slice(source, dim: int, start: int, stop: int) -> torch.Tensor:
    index = [slice(None)] * len(source.shape)
    index[dim] = slice(start, stop)
    return source[tuple(index)]


def check_shape(source, shape: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(source.shape)} vs expected {tuple(shape)}")


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint slice {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def replicated_loader(param: nn.Parameter, source) -> None:
    check_shape(source, param.shape)
    copy_into(param, read_slice(source, 0, 0, source.shape[0]))


def new_param(*shape: int, loader=replicated_loader, dtype: torch.dtype | None = None) -> nn.Parameter:
    """dtype None: the default dtype (the model's, while load_model builds it)."""
    # torch.empty: weights come from a checkpoint (or the dummy filler); init work would be wasted.
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


def new_scale(*shape: int, loader) -> nn.Parameter:
    """The scales of an FP8 weight (one per output channel), in fp32: what an FP8 GEMM's epilogue reads
    (a bf16 checkpoint scale converts exactly)."""
    p = new_param(*shape, loader=loader, dtype=torch.float32)
    p.fp8_scale = True
    return p


def divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp}")
    return total // tp


class LinearBase(nn.Module):
    """y = x W^T with this rank's W [output_size, input_size], built already sharded: `weight` with its
    `weight_loader(param, source[, shard_id])` (what a rank stores, and how a checkpoint slice gets there;
    each subclass defines its loader), and `matmul`, the one place the weight is applied
    (model.batch_invariant.linear, which the batch-invariant mode routes; model.fp8.fp8_linear for an FP8
    weight). `fp8`: W is float8_e4m3fn and its `weight_scale` [output_size, 1] is loaded by `scale_loader`."""

    def __init__(self, input_size: int, output_size: int, fp8: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size   # this rank's
        self.weight = new_param(output_size, input_size, loader=self.weight_loader, dtype=FP8 if fp8 else None)
        self.weight_scale = new_scale(output_size, 1, loader=self.scale_loader) if fp8 else None

    def scale_loader(self, param: nn.Parameter, source, *shard_id) -> None:
        """Per-output-channel scales go where their weight rows go (row-parallel layers override)."""
        self.weight_loader(param, source, *shard_id)

    def fp8_kernels(self, x: torch.Tensor) -> bool:
        """Whether this layer multiplies x with the FP8 kernels (model.kernels.fp8): an FP8 weight whose
        dims the FP8 GEMM takes (multiples of 16), activations model.fp8.kernels_take."""
        return (self.weight_scale is not None and self.input_size % 16 == 0 and self.output_size % 16 == 0
                and kernels_take(x))

    def matmul(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """x [..., in] -> [..., out]; x may be activations already quantized in their producer (only where
        `fp8_kernels` said so)."""
        if isinstance(x, Quantized) or self.fp8_kernels(x):
            from model.kernels.fp8 import scaled_linear   # triton: imported where CUDA runs it

            a = as_quantized(x)
            y = scaled_linear(a.q, a.scale, self.weight, self.weight_scale, a.dtype, batch_invariant.enabled())
            return y.view(*a.lead, self.output_size)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale)
        return linear(x, self.weight)

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        return self.matmul(x)


class ReplicatedLinear(LinearBase):
    """The whole W on every rank (DiffusionGemma's router): every rank computes the same output."""

    def weight_loader(self, param: nn.Parameter, source) -> None:
        replicated_loader(param, source)


class ColumnParallelLinear(LinearBase):
    """W's output rows split across ranks; the output stays sharded (no collective)."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TPGroup, fp8: bool = False):
        shards = [divide(n, tp.world_size, "output size") for n in output_sizes]
        super().__init__(input_size, sum(shards), fp8)
        self.tp, self.output_sizes = tp, shards

    def weight_loader(self, param: nn.Parameter, source, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        check_shape(source, (size * self.tp.world_size, param.shape[1]))
        rows = read_slice(source, 0, self.tp.rank * size, (self.tp.rank + 1) * size)
        copy_into(param.data.narrow(0, offset, size), rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate|up)."""


class QKVParallelLinear(LinearBase):
    """q|k|v in one matmul, or q|k (`with_v=False`: DiffusionGemma's full layers, whose values are their
    raw keys). Each rank holds its query heads; KV heads are split when there are at least tp of them,
    else replicated: rank r holds the one KV head its query heads read (the 26B's full layers have 2 KV
    heads, fewer than tp = 4 or 8). shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 tp: TPGroup, with_v: bool = True, fp8: bool = False):
        num_heads = divide(total_num_heads, tp.world_size, "num_attention_heads")
        if total_num_kv_heads >= tp.world_size:
            num_kv_heads = divide(total_num_kv_heads, tp.world_size, "num_key_value_heads")
            kv_start = tp.rank * num_kv_heads
        elif tp.world_size % total_num_kv_heads == 0:
            num_kv_heads, kv_start = 1, tp.rank * total_num_kv_heads // tp.world_size
        else:
            raise ValueError(f"num_key_value_heads={total_num_kv_heads} can be neither split nor replicated "
                             f"tensor_parallel_size={tp.world_size} ways")
        shards = ("q", "k", "v") if with_v else ("q", "k")
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, sum(sizes[s] for s in shards), fp8)
        self.tp = tp
        self.checkpoint_rows = {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim,
                                "v": total_num_kv_heads * head_dim}
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.checkpoint_shards = shards   # which *_proj the loader expects
        self.sizes = sizes
        self.first_head = {"q": tp.rank * num_heads, "k": kv_start, "v": kv_start}

    @property
    def output_sizes(self) -> list[int]:
        """This rank's q, k (and v) widths, in the fused weight's order: how to split the output."""
        return [self.sizes[s] for s in self.checkpoint_shards]

    def weight_loader(self, param: nn.Parameter, source, shard_id: str = "q") -> None:
        offset = sum(self.sizes[s] for s in self.checkpoint_shards[: self.checkpoint_shards.index(shard_id)])
        start = self.first_head[shard_id] * self.head_dim
        check_shape(source, (self.checkpoint_rows[shard_id], param.shape[1]))
        rows = read_slice(source, 0, start, start + self.sizes[shard_id])
        copy_into(param.data.narrow(0, offset, self.sizes[shard_id]), rows)


class RowParallelLinear(LinearBase):
    """W's input columns split across ranks, so each rank's output is a partial sum: one all-reduce sums
    them, unless `reduce_results=False`, where the caller's layer sums them together with others in one
    collective (DiffusionGemma's dense MLP, with its experts: model.moe.GemmaExperts)."""

    def __init__(self, input_size: int, output_size: int, tp: TPGroup, reduce_results: bool = True,
                 fp8: bool = False):
        super().__init__(divide(input_size, tp.world_size, "input size"), output_size, fp8)
        self.tp, self.reduce_results = tp, reduce_results

    def weight_loader(self, param: nn.Parameter, source) -> None:
        n = self.input_size
        check_shape(source, (self.output_size, n * self.tp.world_size))
        copy_into(param, read_slice(source, 1, self.tp.rank * n, (self.tp.rank + 1) * n))

    def scale_loader(self, param: nn.Parameter, source) -> None:
        """Every rank computes all output channels (partial sums over its columns): all the scales."""
        replicated_loader(param, source)

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        y = self.matmul(x)
        return self.tp.all_reduce(y) if self.reduce_results else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [vocab_start, vocab_end) of the table (a vocabulary not divisible by tp
    gives slices one row apart); ids outside the slice contribute zeros to one all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        if vocab_size < tp.world_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than tensor_parallel_size={tp.world_size}")
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp.rank, tp.world_size)
        self.weight = new_param(self.vocab_end - self.vocab_start, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source) -> None:
        check_shape(source, (self.vocab_size, param.shape[1]))
        copy_into(param, read_slice(source, 0, self.vocab_start, self.vocab_end))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        return self.tp.all_reduce(F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice only: [tokens, vocab_end - vocab_start]. They stay
    sharded; model.parallel.reductions computes global statistics from them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)
