"""DiffusionGemma (docs/spec.md 2.2, 4.9): one Gemma-4 MoE text backbone, one tensor-parallel rank of it.

One stack of layers serves the causal "encoder" rows (prefill, commit: x = e) and the bidirectional
"decoder" rows (denoise: x = post_norm(e + selfcond_mlp(soft))), each row with its side's layer scalars,
e = embed(ids) * sqrt(hidden). Sliding layers attend within the window; full layers use K = V and
partial RoPE; q, k and v are RMS-normed and attention is unscaled. head_logits is this rank's raw slice
of the tied head (the sampler softcaps it); soft_embedding(probs) = probs @ W_embed * sqrt(hidden), one
all-reduce. Per layer one all-reduce after o_proj and one for the dense MLP (on a side stream,
model.side_stream) and the experts together. FP8 weights where the checkpoint's quantization_config says.
"""
from __future__ import annotations

import torch
from torch import nn

from model.attention import cached_attention, get_step_context, kv_rows
from model.batch_invariant import linear
from model.config import FULL, SLIDING, DiffusionGemmaConfig, LayerRope
from model.fp8 import Quantized
from model.fused import (add_gemma_rms_norm, gelu_mul, gelu_mul_quantized, gemma_feedforward_inputs,
                         gemma_feedforward_inputs_quantized, gemma_feedforward_out, gemma_qkv, gemma_rms_norm,
                         gemma_rms_norm_quantized)
from model.interface import KVLayout
from model.moe import GemmaExperts, GemmaRouter
from model.parallel.group import TPGroup
from model.parallel.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding, new_param)
from model.quant_config import QuantScope
from model.sampling.renoise import self_condition_embedding
from model.side_stream import side_branch


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


class DiffusionGemmaAttention(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_sliding = cfg.is_sliding(layer_idx)
        self.head_dim = cfg.layer_head_dim(layer_idx)
        self.total_num_heads = cfg.num_attention_heads
        self.total_num_kv_heads = cfg.layer_num_kv_heads(layer_idx)
        projections = ("q_proj", "k_proj", "v_proj") if self.is_sliding else ("q_proj", "k_proj")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, tp, with_v=self.is_sliding,
                                          fp8=quant.fp8(*projections))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, cfg.hidden_size, tp,
                                        fp8=quant.fp8("o_proj"))
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, *v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_kv_heads, self.head_dim)
        v = v[0].view(b, n, self.num_kv_heads, self.head_dim) if v else k  # K = V: the raw key projection
        cos, sin = rope
        q, k, v = gemma_qkv(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                            kv_rows(self.layer_idx))
        o = cached_attention(q, k, v, self.layer_idx, 1.0, sliding=self.is_sliding, stored=True)
        return self.o_proj(o.reshape(b, n, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), column/row parallel, -> this rank's partial sum: its down
    projection does not reduce, the layer's experts sum it with theirs in one collective."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp,
                                                       fp8=quant.fp8("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, reduce_results=False,
                                           fp8=quant.fp8("down_proj"))

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.down_proj.fp8_kernels(h):   # FP8: the gated activation quantized in its own kernel
            return self.down_proj(gelu_mul_quantized(h))
        return self.down_proj(gelu_mul(h))


class DiffusionGemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, tp: TPGroup, quant: QuantScope):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DiffusionGemmaAttention(cfg, layer_idx, tp, quant / "self_attn")
        self.mlp = GemmaMLP(h, cfg.intermediate_size, tp, quant / "mlp")
        self.router = GemmaRouter(cfg, quant / "router")
        self.experts = GemmaExperts(cfg, tp, quant / "experts")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.layer_scalar = new_param(1)  # the decoder's; the encoder's sits in DiffusionGemmaModel.encoder
        self.tp = tp

    def forward(self, h: torch.Tensor, rope, layer_scalar: torch.Tensor) -> torch.Tensor:
        eps = self.input_layernorm.eps
        # a norm that feeds FP8 kernels quantizes its output in its own kernel
        if self.self_attn.qkv_proj.fp8_kernels(h):
            x = gemma_rms_norm_quantized(h, self.input_layernorm.weight, eps)
        else:
            x = self.input_layernorm(h)
        h = add_gemma_rms_norm(h, self.self_attn(x, rope), self.post_attention_layernorm.weight, eps)
        # pre_ff_norm(h), pre_ff_norm_2(h) and the router's norm, in one kernel
        quantized = self.mlp.gate_up_proj.fp8_kernels(h) and self.experts.fp8_kernels(h)
        x_dense, x_moe, x_router = (gemma_feedforward_inputs_quantized if quantized else gemma_feedforward_inputs)(
            h.reshape(-1, h.shape[-1]), self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm_2.weight,
            self.router.scale, self.router.scalar_root_size, eps)
        branch = side_branch(h)
        with branch:   # the dense MLP beside the routing and the experts (model.side_stream)
            dense = self.mlp(x_dense)
        weights, ids = self.router(x_router)
        moe = self.experts(x_moe, weights, ids)
        branch.join()
        if self.tp.is_parallel:   # both branches' partial sums in one all-reduce
            dense, moe = self.tp.all_reduce(torch.stack([dense, moe]))
        # h = (h + post_ff_norm(post_ff_norm_1(dense) + post_ff_norm_2(moe))) * layer_scalar
        return gemma_feedforward_out(h, dense.view_as(h), moe.view_as(h), self.post_feedforward_layernorm_1.weight,
                                     self.post_feedforward_layernorm_2.weight, self.post_feedforward_layernorm.weight,
                                     layer_scalar, eps)


class GemmaSelfConditioning(nn.Module):
    """x = post_norm(e + down(gelu(gate(pre_norm(soft))) * up(pre_norm(soft)))); post_norm has no scale."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp,
                                                       fp8=quant.fp8("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, fp8=quant.fp8("down_proj"))

    def forward(self, e: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # every row on its first step: the MLP of a zero signal is exactly zero
            return self.post_norm(e)
        return self.post_norm(e + self.down_proj(gelu_mul(self.gate_up_proj(self.pre_norm(soft)))))


class DiffusionGemmaDecoder(nn.Module):
    """transformers' DiffusionGemmaDecoderModel: embedding, layers, final norm, self-conditioning."""

    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, dtype: torch.dtype, quant: QuantScope):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # rounded to the model dtype, as transformers' embed_scale buffer (sqrt(2816) -> 53.0 in bf16)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(DiffusionGemmaDecoderLayer(cfg, i, tp, quant / f"layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = GemmaSelfConditioning(cfg, tp, quant / "self_conditioning")
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
    def __init__(self, cfg: DiffusionGemmaConfig, tp: TPGroup, dtype: torch.dtype, quant: QuantScope):
        super().__init__()
        self.encoder = DiffusionGemmaEncoderScalars(cfg.num_hidden_layers)
        self.decoder = DiffusionGemmaDecoder(cfg, tp, dtype, quant / "decoder")


class DiffusionGemmaForBlockDiffusion(nn.Module):
    """forward(ids [B, L], positions [B, L], soft [B, L, H] | None) -> hidden [B, L, H] inside a
    model.attention.step_context built with window=self.sliding_window over a PagedKVCache of
    self.kv_layer_shapes; head_logits(hidden) -> this rank's vocabulary slice of the raw head output
    (the sampler softcaps it by `logit_softcap`: model.sampling.stats.unscaled); soft_embedding(probs_r)
    -> the next step's self-conditioning input (one all-reduce)."""

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
        self.model = DiffusionGemmaModel(cfg, tp, dtype, cfg.quant_scope / "model")

    @property
    def decoder(self) -> DiffusionGemmaDecoder:
        return self.model.decoder

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(KV heads on this rank, head_dim) per layer: what a model.attention.PagedKVCache needs."""
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
        # every layer's scalar for every row in one kernel (not one a layer): [B, 1, 1, layers]
        encoder = torch.cat([layer.layer_scalar for layer in self.model.encoder.language_model.layers])
        scalars = torch.where(causal[..., None], encoder, torch.cat([layer.layer_scalar for layer in dec.layers]))
        for i, layer in enumerate(dec.layers):
            h = layer(h, rope[SLIDING if layer.self_attn.is_sliding else FULL], scalars[..., i])
        return dec.norm(h)

    @property
    def logit_softcap(self) -> float:
        return self.config.final_logit_softcapping

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's raw logits before the softcap, in the model's dtype (the sampler softcaps them in
        fp32 as it reads them)."""
        return linear(hidden, self.decoder.embed_tokens.weight)

    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., V_r]: this rank's slice of the globally normalised softmax(logits / T) ->
        softmax @ W_embed * sqrt(hidden) [..., H], identical on every rank."""
        weight = self.decoder.embed_tokens.weight
        return self_condition_embedding(probs.to(weight.dtype), weight, self.tp) * self.decoder.embed_scale
