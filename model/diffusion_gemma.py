"""DiffusionGemma (SPEC.md 2.2, 4.9): one Gemma-4 MoE text backbone, one tensor-parallel rank of it.

The same weights serve the causal "encoder" (prefill, commit) and the bidirectional "decoder"
(denoise); transformers' DiffusionGemmaModel ties them, so there is one stack of layers here. Per row:

    e   = embed(ids) * sqrt(hidden)
    x   = e                                                            (prefill / commit rows)
    x   = post_norm(e + down(gelu(gate(pre_norm(soft))) * up(pre_norm(soft))))   (denoise rows)
    for each layer (sliding or full, per layer_types):
        h += post_attn_norm(attn(input_norm(h)))           # q/k RMS-normed, RoPE; v RMS-normed without scale
        h += post_ff_norm(post_ff_norm_1(mlp(pre_ff_norm(h))) + post_ff_norm_2(experts(pre_ff_norm_2(h), router(h))))
        h *= layer_scalar                                  # the encoder's or the decoder's, per row
    logits_r = 30 * tanh(embed_r(norm(h)) / 30)            # fp32, this rank's vocabulary slice (tied head)

Sliding layers attend within the window (model.attention: anchored at the canvas start on denoise
rows); full layers attend to everything, with K = V (no v_proj: values are the raw key projection)
and proportional RoPE on a quarter of each head. Attention is unscaled (q_norm / k_norm do it).
`soft` is the previous denoise step's soft embedding `softmax(logits / T) @ W_embed * sqrt(hidden)`
(`soft_embedding`), zero on a canvas's first step, where post_norm still runs.

Tensor parallel: query heads split, KV heads split or (fewer than tp) replicated; dense MLP,
self-conditioning MLP and every expert split along their intermediate dims; embedding and tied head
vocabulary-sharded. Collectives per layer: o_proj's all-reduce and one for the dense MLP and the experts
together.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.attention import cached_attention, get_step_context, kv_rows
from model.batch_invariant import linear, row_sum, softmax
from model.config import FULL, SLIDING, DiffusionGemmaConfig, LayerRope
from model.fused import (add_gemma_rms_norm, gelu_mul, gemma_feedforward_inputs, gemma_feedforward_out,
                         gemma_qkv, gemma_rms_norm)
from model.interface import KVLayout
from model.parallel.group import TPGroup
from model.parallel.linear import (MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_into,
                                   divide, new_param, read_slice)
from model.sampling.renoise import self_condition_embedding


class GemmaRMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 [* w], all in fp32 (fp64 for an fp64 model) and cast back once
    (Gemma-4: weight used as is, not 1 + weight). with_scale=False: no parameter (v_norm, the router's
    and post_norm of self-cond)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = new_param(dim) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaRotaryEmbedding(nn.Module):
    """cos, sin [B, L, 1, head_dim] of one layer type. `proportional`: the first
    int(partial * head_dim // 2) frequencies of each half rotate (exponents over the whole head_dim),
    the rest have frequency 0 (cos 1, sin 0): transformers' _compute_proportional_rope_parameters."""

    def __init__(self, head_dim: int, rope: LayerRope, dtype: torch.dtype):
        super().__init__()
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        inv_freq = 1.0 / (rope.rope_theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float) / head_dim))
        inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - rotated)]) / rope.factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dtype = dtype

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype).unsqueeze(-2), emb.sin().to(self.dtype).unsqueeze(-2)


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.weight = new_param(output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class GemmaQKVParallelLinear(nn.Module):
    """q|k|v (sliding layers) or q|k (full layers, K = V) in one matmul. Each rank holds its query
    heads; KV heads are split when there are at least tp of them, else replicated: rank r holds the
    KV head its query heads read (the 26B's full layers have 2 KV heads, fewer than tp = 4 or 8)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 tp: TPGroup, with_v: bool):
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.world_size, "num_attention_heads")
        if total_num_kv_heads >= tp.world_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp.world_size, "num_key_value_heads")
            kv_start = tp.rank * self.num_kv_heads
        else:
            divide(tp.world_size, total_num_kv_heads, "tensor_parallel_size over KV heads")
            self.num_kv_heads, kv_start = 1, tp.rank * total_num_kv_heads // tp.world_size
        self.checkpoint_shards = ("q", "k", "v") if with_v else ("q", "k")  # which *_proj the loader expects
        kv = self.num_kv_heads * head_dim
        self.sizes = {"q": self.num_heads * head_dim, "k": kv, "v": kv}
        self.first_head = {"q": tp.rank * self.num_heads, "k": kv_start, "v": kv_start}
        self.weight = new_param(sum(self.sizes[s] for s in self.checkpoint_shards), hidden_size,
                                loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source, shard_id: str) -> None:
        offset = sum(self.sizes[s] for s in self.checkpoint_shards[: self.checkpoint_shards.index(shard_id)])
        start = self.first_head[shard_id] * self.head_dim
        rows = read_slice(source, 0, start, start + self.sizes[shard_id])
        copy_into(param.data.narrow(0, offset, self.sizes[shard_id]), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class DiffusionGemmaAttention(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_sliding = cfg.is_sliding(layer_idx)
        self.head_dim = cfg.layer_head_dim(layer_idx)
        self.total_num_heads = cfg.num_attention_heads
        self.total_num_kv_heads = cfg.layer_num_kv_heads(layer_idx)
        self.qkv_proj = GemmaQKVParallelLinear(cfg.hidden_size, self.head_dim, self.total_num_heads,
                                               self.total_num_kv_heads, tp, with_v=self.is_sliding)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, cfg.hidden_size, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, n, _ = x.shape
        sizes = [self.qkv_proj.sizes[s] for s in self.qkv_proj.checkpoint_shards]
        q, k, *v = self.qkv_proj(x).split(sizes, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_kv_heads, self.head_dim)
        v = v[0].view(b, n, self.num_kv_heads, self.head_dim) if v else k  # K = V: the raw key projection
        cos, sin = rope
        q, k, v = gemma_qkv(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                            kv_rows(self.layer_idx))
        o = cached_attention(q, k, v, self.layer_idx, 1.0, sliding=self.is_sliding, stored=True)
        return self.o_proj(o.reshape(b, n, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), column/row parallel. Only `partial` (before the all-reduce):
    a layer sums its dense MLP and its experts in one collective."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return linear(gelu_mul(self.gate_up_proj(x)), self.down_proj.weight)


class GemmaRouter(nn.Module):
    """Top-k experts per token from the un-normed residual: softmax in fp32, the k weights renormalised
    to sum 1, then each scaled by its expert's `per_expert_scale`. Replicated: every rank routes alike."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.scalar_root_size = cfg.hidden_size ** -0.5
        self.proj = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
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
    """Every expert on every rank, each split along its intermediate dim (gate|up rows, down columns),
    so a rank's output is a partial sum like a row-parallel linear's. Checkpoint layout:
    gate_up_proj [E, 2 * I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.num_experts = cfg.num_experts
        self.total_intermediate = cfg.moe_intermediate_size
        self.intermediate = divide(cfg.moe_intermediate_size, tp.world_size, "moe_intermediate_size")
        self.gate_up_proj = new_param(cfg.num_experts, 2 * self.intermediate, cfg.hidden_size,
                                      loader=self.gate_up_loader)
        self.down_proj = new_param(cfg.num_experts, cfg.hidden_size, self.intermediate, loader=self.down_loader)

    def gate_up_loader(self, param: nn.Parameter, source) -> None:
        i, start = self.intermediate, self.tp.rank * self.intermediate
        for half in range(2):  # gate, then up
            offset = half * self.total_intermediate + start
            copy_into(param.data.narrow(1, half * i, i), read_slice(source, 1, offset, offset + i))

    def down_loader(self, param: nn.Parameter, source) -> None:
        start = self.tp.rank * self.intermediate
        copy_into(param, read_slice(source, 2, start, start + self.intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> this rank's partial output [T, H]. (token, expert) pairs are
        sorted by expert and run as one grouped matmul per projection: no host sync, no per-expert loop.
        Each token's k outputs are combined by a weighted sum in slot order (not scattered with index_add_,
        whose atomics race and on an H200 took 2 ms of a 26 ms step): on CUDA one kernel that reads them
        where they lie (model.kernels.expert_combine), elsewhere a gather back to pair order and a bmm."""
        k = ids.shape[-1]
        pairs = sort_pairs(ids, self.num_experts)
        y = _grouped_linear(gelu_mul(_grouped_linear(x, self.gate_up_proj, pairs, gather=True)), self.down_proj, pairs)
        if y.is_cuda and y.dtype != torch.float64:
            from model.kernels.expert_combine import combine

            return combine(y, pairs.slot, weights).to(x.dtype)
        grouped = y[pairs.slot].view(-1, k, y.shape[-1])   # [T, k, H], each token's pairs in slot order
        if batch_invariant.enabled():  # slot by slot, in slot order
            return batch_invariant.sum_in_order((grouped * weights[..., None]).transpose(0, 1)).to(x.dtype)
        return torch.bmm(weights.unsqueeze(1).to(grouped.dtype), grouped).squeeze(1).to(x.dtype)


class SortedPairs(NamedTuple):
    """The (token, expert) pairs t * k + j sorted by expert (stably: within an expert, in pair order)."""
    token: torch.Tensor           # [P]: the token of the i-th sorted pair
    slot: torch.Tensor            # [P]: where pair t * k + j was sorted to
    ends: torch.Tensor            # [E] int32: cumulative pairs per expert
    tile_map: tuple[torch.Tensor, torch.Tensor] | None   # the triton grouped kernel's (CUDA), else None


def sort_pairs(ids: torch.Tensor, num_experts: int) -> SortedPairs:
    """On CUDA three launches of model.kernels.routing (with the grouped kernel's tile map); elsewhere a
    stable argsort, the reference."""
    if ids.is_cuda:
        from model.kernels import invariant, routing

        token, slot, ends, *tile_map = routing.sort_pairs(ids, num_experts, invariant.GROUPED_TILES.m)
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


# rows per expert (on average) up to which model.kernels.invariant's grouped kernel beats grouped_mm
# (H200, bf16: 0.89x its time at 16 rows per expert, 0.98x at 32, 1.2x at 64)
FEW_ROWS_PER_EXPERT = 32


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, pairs: SortedPairs, gather: bool = False) -> torch.Tensor:
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


def _grouped_mm_takes(x: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    return x.dtype == torch.bfloat16 or (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16))


class DiffusionGemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DiffusionGemmaAttention(cfg, layer_idx, tp)
        self.mlp = GemmaMLP(h, cfg.intermediate_size, tp)
        self.router = GemmaRouter(cfg)
        self.experts = GemmaExperts(cfg, tp)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.layer_scalar = new_param(1)  # the decoder's; the encoder's sits in DiffusionGemmaModel.encoder

    def forward(self, h: torch.Tensor, rope, layer_scalar: torch.Tensor) -> torch.Tensor:
        eps = self.input_layernorm.eps
        h = add_gemma_rms_norm(h, self.self_attn(self.input_layernorm(h), rope), self.post_attention_layernorm.weight,
                               eps)
        flat = h.reshape(-1, h.shape[-1])
        x_dense, x_moe, x_router = gemma_feedforward_inputs(
            flat, self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm_2.weight,
            self.router.scale, self.router.scalar_root_size, eps)
        weights, ids = self.router(x_router)
        dense = self.mlp.partial(x_dense)
        moe = self.experts(x_moe, weights, ids)
        if self.tp.is_parallel:   # one collective for both partial sums (alone: no copy into a stack)
            dense, moe = self.tp.all_reduce(torch.stack([dense, moe]))
        return gemma_feedforward_out(h, dense.view_as(h), moe.view_as(h), self.post_feedforward_layernorm_1.weight,
                                     self.post_feedforward_layernorm_2.weight, self.post_feedforward_layernorm.weight,
                                     layer_scalar, eps)


class GemmaSelfConditioning(nn.Module):
    """x = post_norm(e + down(gelu(gate(pre_norm(soft))) * up(pre_norm(soft)))); post_norm has no scale."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, e: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # every row on its first step: the MLP of a zero signal is exactly zero
            return self.post_norm(e)
        return self.post_norm(e + self.down_proj(gelu_mul(self.gate_up_proj(self.pre_norm(soft)))))


class DiffusionGemmaDecoder(nn.Module):
    """transformers' DiffusionGemmaDecoderModel: embedding, layers, final norm, self-conditioning."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # rounded to the model dtype, as transformers' embed_scale buffer (sqrt(2816) -> 53.0 in bf16)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(DiffusionGemmaDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = GemmaSelfConditioning(cfg, tp)
        self.rotary = nn.ModuleDict({
            SLIDING: GemmaRotaryEmbedding(cfg.head_dim, cfg.rope_parameters[SLIDING], dtype),
            FULL: GemmaRotaryEmbedding(cfg.layer_head_dim(cfg.layer_type_list.index(FULL)),
                                       cfg.rope_parameters[FULL], dtype),
        })


class _LayerScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = new_param(1)


class DiffusionGemmaEncoderScalars(nn.Module):
    """The only encoder tensors transformers does not tie to the decoder: each layer's `layer_scalar`
    (a buffer there, so saved twice). Kept under the checkpoint's own names; used by causal rows."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.layers = nn.ModuleList(_LayerScalar() for _ in range(num_layers))


class DiffusionGemmaModel(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.encoder = DiffusionGemmaEncoderScalars(cfg.num_hidden_layers)
        self.decoder = DiffusionGemmaDecoder(cfg, tp, dtype)


class DiffusionGemmaForBlockDiffusion(nn.Module):
    """forward(ids [B, L], positions [B, L], soft [B, L, H] | None) -> hidden [B, L, H] inside a
    model.attention.step_context built with window=self.sliding_window over a LayeredKVCache of
    self.kv_layer_shapes; compute_logits(hidden) -> softcapped fp32 logits of this rank's vocabulary
    slice; soft_embedding(probs_r) -> the next step's self-conditioning input (one all-reduce)."""

    # checkpoint module name -> (our fused module, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    ignored_checkpoint_tensors = (
        r"^model\.encoder\.vision_tower\.", r"^model\.encoder\.embed_vision\.",  # text serving only
        r"^lm_head\.weight$",                                                      # tied to the embedding
        # an untied save also writes the encoder's copies of the shared weights: the decoder's are used
        r"^model\.encoder\.language_model\.(?!layers\.\d+\.layer_scalar$)",
    )

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg.check_tensor_parallel(tp.world_size)
        self.config = cfg
        self.tp = tp
        self.model = DiffusionGemmaModel(cfg, tp, dtype)

    @property
    def decoder(self) -> DiffusionGemmaDecoder:
        return self.model.decoder

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(KV heads on this rank, head_dim) per layer: what a model.attention.LayeredKVCache needs."""
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.decoder.layers]

    @property
    def kv_layer_sliding(self) -> list[bool]:
        return [layer.self_attn.is_sliding for layer in self.decoder.layers]

    @property
    def sliding_window(self) -> int:
        return self.config.sliding_window

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(tuple(self.kv_layer_shapes), tuple(self.kv_layer_sliding), self.sliding_window)

    @property
    def vocab_start(self) -> int:
        return self.decoder.embed_tokens.vocab_start

    @property
    def vocab_end(self) -> int:
        return self.decoder.embed_tokens.vocab_end

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, soft: torch.Tensor | None = None) -> torch.Tensor:
        """soft: the self-conditioning input of denoise rows (zeros, or None for all, where there is none
        yet: exactly the same result); ignored on causal rows. Device ops only: CUDA-graph capturable."""
        causal = get_step_context().causal_rows[:, None, None]  # [B, 1, 1]: device flags, no host branch
        dec = self.decoder
        e = dec.embed_tokens(ids) * dec.embed_scale
        # denoise rows take the self-conditioning path, causal rows keep e
        h = torch.where(causal, e, dec.self_conditioning(e, soft))
        rope = {kind: rotary(positions) for kind, rotary in dec.rotary.items()}
        for layer, encoder in zip(dec.layers, self.model.encoder.language_model.layers):
            scalar = torch.where(causal, encoder.layer_scalar, layer.layer_scalar)
            h = layer(h, rope[SLIDING if layer.self_attn.is_sliding else FULL], scalar)
        return dec.norm(h)

    @property
    def logit_softcap(self) -> float:
        return self.config.final_logit_softcapping

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's raw logits before the softcap, in the model's dtype (the sampler softcaps them in
        fp32 as it reads them)."""
        return linear(hidden, self.decoder.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        cap = self.logit_softcap
        logits = self.head_logits(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return torch.tanh(logits / cap) * cap

    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., V_r]: this rank's slice of the globally normalised softmax(logits / T) ->
        softmax @ W_embed * sqrt(hidden) [..., H], identical on every rank."""
        weight = self.decoder.embed_tokens.weight
        return self_condition_embedding(probs.to(weight.dtype), weight, self.tp) * self.decoder.embed_scale
