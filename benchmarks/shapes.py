"""Full-size shapes without weights: a checkpoint directory holding the published config.json and a
tokenizer of the same vocabulary size, for `load_format=dummy` benchmarks."""
from __future__ import annotations

import json
from pathlib import Path

from model.tiny import NEMOTRON_LD_SPECIAL_TOKENS
from model.tiny_tokenizer import MISTRAL_STYLE_CHAT_TEMPLATE, build_tiny_tokenizer

# SPEC.md 2.1: the published Nemotron-Labs-Diffusion-8B config.json
NEMOTRON_LD_8B = {
    "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
    "attention_bias": False, "attention_dropout": 0.0, "block_size": 32, "bos_token_id": 1,
    "dlm_paradigm": "bidirectional", "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "mask_token_id": 100,
    "max_position_embeddings": 262144, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 34, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 131072,
}


def write_shapes(outdir: Path, config: dict = NEMOTRON_LD_8B) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "config.json").write_text(json.dumps(config, indent=2))
    if not (outdir / "tokenizer.json").is_file():
        s = NEMOTRON_LD_SPECIAL_TOKENS
        build_tiny_tokenizer(outdir, vocab_size=config["vocab_size"], special_tokens=s, bos_token=s[1],
                             eos_token=s[2], pad_token=None, mask_token=s[100],
                             chat_template=MISTRAL_STYLE_CHAT_TEMPLATE)
    return outdir
