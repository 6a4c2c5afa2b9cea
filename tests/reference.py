"""transformers' own classes holding our checkpoints' weights: the reference for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from model.config import load_model_config


def hf_ministral3(model_dir: Path, attn_implementation: str = "sdpa"):
    """Ministral3ForCausalLM with a Nemotron-Labs-Diffusion checkpoint's weights
    (`encoder.*` -> `model.*`, `diffusion_head` -> `lm_head`)."""
    from transformers import Ministral3ForCausalLM

    cfg = load_model_config(model_dir)
    hf_cfg = cfg.to_transformers()
    hf_cfg._attn_implementation = attn_implementation
    model = Ministral3ForCausalLM(hf_cfg).eval()
    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state |= load_file(file)
    renamed = {("model." + k[len("encoder."):]) if k.startswith("encoder.") else k.replace("diffusion_head", "lm_head"): v
               for k, v in state.items()}
    model.load_state_dict(renamed, strict=True)
    return model


def canvas_mask(prefix: int, canvas: int) -> torch.Tensor:
    """[1, 1, P + C, P + C] bool: causal over the prefix, canvas rows see the prefix and the whole canvas."""
    n = prefix + canvas
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[prefix:, prefix:] = True
    return mask[None, None]
