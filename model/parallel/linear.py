"""Linear layers built already sharded (Megatron-style), each parameter carrying its own
`weight_loader(param, source[, shard_id])` that reads only this rank's slice of a checkpoint tensor.

`source` is anything indexable with a tuple of slices and carrying `.shape` (a torch tensor, or the
loader's lazy safetensors slice), so a rank never materialises a whole checkpoint tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.batch_invariant import linear
from model.parallel.group import TPGroup, shard_range


def read_slice(source, dim: int, start: int, stop: int) -> torch.Tensor:
    index = [slice(None)] * len(source.shape)
    index[dim] = slice(start, stop)
    return source[tuple(index)]


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint slice {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def replicated_loader(param: nn.Parameter, source) -> None:
    copy_into(param, read_slice(source, 0, 0, source.shape[0]))


def new_param(*shape: int, loader=replicated_loader) -> nn.Parameter:
    # torch.empty: weights come from a checkpoint (or the dummy filler); init work would be wasted.
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp}")
    return total // tp


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; output stays sharded (no collective)."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.output_sizes = [divide(n, tp.world_size, "output size") for n in output_sizes]
        self.weight = new_param(sum(self.output_sizes), input_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        rows = read_slice(source, 0, self.tp.rank * size, (self.tp.rank + 1) * size)
        copy_into(param.data.narrow(0, offset, size), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate|up)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v in one matmul; each rank holds its heads of each. shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 tp: TPGroup):
        divide(total_num_heads, tp.world_size, "num_attention_heads")
        divide(total_num_kv_heads, tp.world_size, "num_key_value_heads")
        kv = total_num_kv_heads * head_dim
        super().__init__(hidden_size, [total_num_heads * head_dim, kv, kv], tp)

    def weight_loader(self, param: nn.Parameter, source, shard_id: str = "q") -> None:
        super().weight_loader(param, source, "qkv".index(shard_id))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; one all-reduce sums the partial outputs."""

    def __init__(self, input_size: int, output_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.input_size = divide(input_size, tp.world_size, "input size")
        self.weight = new_param(output_size, self.input_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source) -> None:
        n = self.input_size
        copy_into(param, read_slice(source, 1, self.tp.rank * n, (self.tp.rank + 1) * n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight))


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
