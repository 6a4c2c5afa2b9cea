"""Nemotron-Labs-Diffusion (docs/spec.md 2.1): a Ministral-3 backbone (`encoder.*`) and an untied
`diffusion_head`, one tensor-parallel rank of it.

    h = embed(ids); per layer: h += o(attn(rope(q(n1(h))) * s(pos), rope(k(n1(h))), v(n1(h))))
                               h += down(silu(gate(n2(h))) * up(n2(h)))
    logits_r = diffusion_head_r(norm(h))          # this rank's vocabulary slice

s(pos) is the Llama-4 query scale. Each residual add is fused with the norm after it (model/fused.py).
Whether attention is causal or bidirectional, and which KV it reads and writes, is the step context's
business (model.attention). Linear layers hold FP8 weights where the checkpoint's quantization_config says.
"""
from __future__ import annotations

import torch
from torch import nn

from model.attention import cached_attention, kv_rows
from model.config import NemotronLabsDiffusionConfig
from model.fp8 import Quantized
from model.fused import (add_rms_norm, add_rms_norm_quantized, rms_norm_quantized, rotary, silu_mul,
                         silu_mul_quantized)
from model.interface import KVLayout
from model.layers import RMSNorm, RotaryEmbedding
from model.parallel.group import TPGroup
from model.parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model.parallel.linear import ParallelLMHead, VocabParallelEmbedding
from model.quant_config import QuantScope


class NemotronLDAttention(nn.Module):
    def __init__(self, cfg: NemotronLabsDiffusionConfig, layer_idx: int, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_size
        self.total_num_heads = cfg.num_attention_heads
        self.total_num_kv_heads = cfg.num_key_value_heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, tp, fp8=quant.fp8("q_proj", "k_proj", "v_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, cfg.hidden_size, tp,
                                        fp8=quant.fp8("o_proj"))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_kv_heads, self.head_dim)
        v = v.view(b, n, self.num_kv_heads, self.head_dim)
        cos, sin, q_scale = rope
        q, k = rotary(q, k, cos, sin, q_scale, v, kv_rows(self.layer_idx))
        o = cached_attention(q, k, v, self.layer_idx, self.scale, stored=True)
        return self.o_proj(o.reshape(b, n, self.num_heads * self.head_dim))


class NemotronLDMLP(nn.Module):
    def __init__(self, cfg: NemotronLabsDiffusionConfig, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp,
                                                       fp8=quant.fp8("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, fp8=quant.fp8("down_proj"))

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.down_proj.fp8_kernels(h):   # FP8: the gated activation quantized in its own kernel
            return self.down_proj(silu_mul_quantized(h))
        return self.down_proj(silu_mul(h))


class NemotronLDDecoderLayer(nn.Module):
    def __init__(self, cfg: NemotronLabsDiffusionConfig, layer_idx: int, tp: TPGroup, quant: QuantScope):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = NemotronLDAttention(cfg, layer_idx, tp, quant / "self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = NemotronLDMLP(cfg, tp, quant / "mlp")

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream; delta: the previous sublayer's output, not yet added (None before the
        first layer) -> (h, delta) for the next layer."""
        # a norm that feeds FP8 kernels quantizes its output in its own kernel
        into_attn = self.self_attn.qkv_proj.fp8_kernels(h)
        w, eps = self.input_layernorm.weight, self.input_layernorm.eps
        if delta is None:
            x = rms_norm_quantized(h, w, eps) if into_attn else self.input_layernorm(h)
        else:
            h, x = (add_rms_norm_quantized if into_attn else add_rms_norm)(h, delta, w, eps)
        add_norm = add_rms_norm_quantized if self.mlp.gate_up_proj.fp8_kernels(h) else add_rms_norm
        h, x = add_norm(h, self.self_attn(x, rope), self.post_attention_layernorm.weight,
                        self.post_attention_layernorm.eps)
        return h, self.mlp(x)


class NemotronLDEncoder(nn.Module):
    def __init__(self, cfg: NemotronLabsDiffusionConfig, tp: TPGroup, dtype: torch.dtype, quant: QuantScope):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(NemotronLDDecoderLayer(cfg, i, tp, quant / f"layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.to_transformers(), dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rotary_emb(positions)
        h, delta = self.embed_tokens(ids), None
        for layer in self.layers:
            h, delta = layer(h, delta, rope)
        return add_rms_norm(h, delta, self.norm.weight, self.norm.eps)[1]


class NemotronLabsDiffusionModel(nn.Module):
    """forward(ids [B, L], positions [B, L]) -> hidden [B, L, H] inside a model.attention.step_context;
    head_logits(hidden [..., H]) -> this rank's logits [..., vocab_end - vocab_start]."""

    # checkpoint module name -> (our fused module, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    ignored_checkpoint_tensors = (r"\.rotary_emb\.inv_freq$",)

    def __init__(self, cfg: NemotronLabsDiffusionConfig, tp: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg.check_tensor_parallel(tp.world_size)
        self.config = cfg
        self.tp = tp
        self.encoder = NemotronLDEncoder(cfg, tp, dtype, cfg.quant_scope / "encoder")
        self.diffusion_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads on this rank, head_dim): what a PagedKVCache for this rank needs."""
        attn = self.encoder.layers[0].self_attn
        return len(self.encoder.layers), attn.num_kv_heads, attn.head_dim

    @property
    def kv_layout(self) -> KVLayout:
        layers, kv_heads, head_dim = self.kv_shape
        return KVLayout(((kv_heads, head_dim),) * layers, (False,) * layers)

    @property
    def vocab_start(self) -> int:
        return self.diffusion_head.vocab_start

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, soft: None = None) -> torch.Tensor:
        """soft: None (masked diffusion has no self-conditioning; the runner calls every family alike)."""
        return self.encoder(ids, positions)

    logit_softcap = None

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's raw logits, in the model's dtype (the sampler reads them once, in fp32)."""
        return self.diffusion_head(hidden)
