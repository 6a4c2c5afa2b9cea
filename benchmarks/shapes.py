"""Full-size shapes without weights: checkpoint directories holding the published config.json and a
tokenizer of the same vocabulary size, for `load_format=dummy` benchmarks."""
from __future__ import annotations

import json
from pathlib import Path

from model.tiny import DIFFUSION_GEMMA_SPECIAL_TOKENS, DIFFUSION_GEMMA_TINY_VISION_CONFIG, NEMOTRON_LD_SPECIAL_TOKENS
from model.tiny_tokenizer import GEMMA_STYLE_CHAT_TEMPLATE, MISTRAL_STYLE_CHAT_TEMPLATE, build_tiny_tokenizer

# docs/spec.md 2.1: the published Nemotron-Labs-Diffusion-8B config.json
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

# docs/spec.md 2.2: DiffusionGemma 26B-A4B's text backbone (sliding layers 8 KV heads x 256, full layers
# 2 x 512 with K = V, window 1024, 128 experts top-8); the vision tower is the tiny one (never served)
DIFFUSION_GEMMA_26B_A4B_TEXT = {
    "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
    "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
    "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704, "max_position_embeddings": 131072,
    "use_bidirectional_attention": "vision", "pad_token_id": 0, "eos_token_id": [1, 5], "bos_token_id": 2,
}
DIFFUSION_GEMMA_GENERATION = {
    "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
}


def write_shapes(outdir: Path, config: dict = NEMOTRON_LD_8B, tokenizer: bool = True) -> Path:
    """`tokenizer=False`: config.json only (what building the model reads)."""
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer and not (outdir / "tokenizer.json").is_file():
        s = NEMOTRON_LD_SPECIAL_TOKENS
        build_tiny_tokenizer(outdir, vocab_size=config["vocab_size"], special_tokens=s, bos_token=s[1],
                             eos_token=s[2], pad_token=None, mask_token=s[100],
                             chat_template=MISTRAL_STYLE_CHAT_TEMPLATE)
    return outdir


def write_diffusion_gemma_shapes(outdir: Path, text: dict = DIFFUSION_GEMMA_26B_A4B_TEXT,
                                 canvas_length: int = 256, tokenizer: bool = True) -> Path:
    """config.json as transformers' DiffusionGemmaConfig writes it (so its own classes read it too);
    `tokenizer=False`: no tokenizer."""
    from transformers import DiffusionGemmaConfig

    outdir.mkdir(parents=True, exist_ok=True)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=DIFFUSION_GEMMA_TINY_VISION_CONFIG,
                               canvas_length=canvas_length, boi_token_id=6, eoi_token_id=7, image_token_id=8)
    cfg.to_json_file(outdir / "config.json")
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
                  "pad_token_id": text["pad_token_id"], **DIFFUSION_GEMMA_GENERATION}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer and not (outdir / "tokenizer.json").is_file():
        s = DIFFUSION_GEMMA_SPECIAL_TOKENS
        build_tiny_tokenizer(outdir, vocab_size=text["vocab_size"], special_tokens=s, bos_token=s[2], eos_token=s[1],
                             pad_token=s[0], mask_token=None, chat_template=GEMMA_STYLE_CHAT_TEMPLATE)
    return outdir


def fake_model(family: str):
    """(its ModelConfig, its model) of the full-size shape of `family` ("nemotron-ld" or "diffusion-gemma"),
    the model built as fake tensors: shapes without memory or weights, for what is counted from them."""
    import tempfile

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.checkpoint import load_model_config
    from model.loader import build_model
    from model.parallel.group import TPGroup

    with tempfile.TemporaryDirectory() as tmp:
        write = write_shapes if family == "nemotron-ld" else write_diffusion_gemma_shapes
        cfg = load_model_config(write(Path(tmp) / family, tokenizer=False))
    with FakeTensorMode(allow_non_fake_inputs=True):
        return cfg, build_model(cfg, TPGroup(), torch.bfloat16, "cpu")


# The modules an FP8-dynamic checkpoint keeps in BF16: RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic's
# ignore list (routers, the vision tower, self-conditioning, the head), as compressed-tensors patterns;
# for Nemotron-LD its head, as llm-compressor's recipes keep lm_head
FP8_IGNORE = {"diffusion_gemma": ["re:.*router\\.proj$", "re:.*vision_tower\\..*", "re:.*embed_vision\\..*",
                                  "re:.*self_conditioning\\..*", "lm_head"],
              "nemotron_labs_diffusion": ["re:.*diffusion_head$", "lm_head"]}


def write_fp8_dynamic(shapes: Path, outdir: Path) -> Path:
    """The shapes of `shapes` as a compressed-tensors FP8-dynamic checkpoint directory (config.json with its
    quantization_config; `load_format=dummy` fills FP8 weights and their scales)."""
    import shutil

    from model.tiny import fp8_dynamic_config

    outdir.mkdir(parents=True, exist_ok=True)
    for f in shapes.iterdir():
        if f.is_file():
            shutil.copy(f, outdir / f.name)
    cfg = json.loads((shapes / "config.json").read_text())
    cfg["quantization_config"] = fp8_dynamic_config(FP8_IGNORE[cfg["model_type"]])
    (outdir / "config.json").write_text(json.dumps(cfg, indent=2))
    return outdir
