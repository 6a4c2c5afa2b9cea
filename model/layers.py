"""Replicated building blocks shared by the families: RMSNorm's weights and the rotary embeddings'
tables. Their elementwise math is in model/fused.py (one kernel per chain on CUDA)."""
from __future__ import annotations

import torch
from torch import nn

from model.fused import rms_norm
from model.parallel.linear import new_param


class RMSNorm(nn.Module):
    """y = w * x / rms(x), normalised in fp32 (fp64 for an fp64 model) and cast back before the weight
    (as Ministral-3)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE (default or YaRN, frequencies from transformers' own rope initialisers) plus the
    Llama-4 query scale `1 + beta * log(1 + floor(pos / original_max_position_embeddings))`.

    `forward(positions)` returns what one step's layers share: cos, sin [B, L, 1, D] and the query
    scale [B, L, 1, 1] (None when the config has no beta).
    """

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = hf_config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = hf_config.head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        # on the device the model is being built on (torch.device context), not where rope was computed
        self.register_buffer("inv_freq", inv_freq.float().to(torch.empty(0).device), persistent=False)
        self.attention_scaling = float(scaling)
        self.dtype = dtype
        self.beta = params.get("llama_4_scaling_beta") or 0.0
        self.original_max = params.get("original_max_position_embeddings")

    def forward(self, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype).unsqueeze(-2)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype).unsqueeze(-2)
        q_scale = None
        if self.beta:
            q_scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original_max))
            q_scale = q_scale.to(self.dtype)[..., None, None]
        return cos, sin, q_scale
