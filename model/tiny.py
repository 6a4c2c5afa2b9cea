"""Write a tiny random checkpoint in a family's real format, for tests and `make serve`.

    python -m model.tiny OUTDIR --family nemotron-ld|diffusion-gemma [--seed N] [--shards K]
                         [--quantize fp8-dynamic]

The real config.json fields and safetensors tensor names (optionally sharded with an index), a
generation_config.json and an offline-built tokenizer whose special tokens sit at the ids the config
names; random weights scaled so that greedy decoding is well separated from ties. `--quantize
fp8-dynamic` writes the same weights as a compressed-tensors FP8-dynamic checkpoint laid out as the
published FP8 DiffusionGemma is (per-channel scales, experts one per expert, a like ignore list).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.fp8 import quantize_per_channel
from model.tiny_tokenizer import GEMMA_STYLE_CHAT_TEMPLATE, MISTRAL_STYLE_CHAT_TEMPLATE, build_tiny_tokenizer

# Divisible by tp = 1, 2, 3 (heads, kv heads, intermediate); the vocabulary (997, prime) is not.
NEMOTRON_LD_TINY_CONFIG = {
    "architectures": ["NemotronLabsDiffusionModel"],
    "model_type": "nemotron_labs_diffusion",
    "auto_map": {"AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "attention_bias": False, "attention_dropout": 0.0, "block_size": 32, "bos_token_id": 1,
    "dlm_paradigm": "bidirectional", "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 96, "intermediate_size": 192, "mask_token_id": 100,
    "max_position_embeddings": 1024, "mlp_bias": False, "num_attention_heads": 12,
    "num_hidden_layers": 2, "num_key_value_heads": 6, "rms_norm_eps": 1e-05,
    # original_max_position_embeddings 64 so that the Llama-4 query scale changes within short tests
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 997,
}
NEMOTRON_LD_SPECIAL_TOKENS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 100: "<|mask|>"}


def nemotron_ld_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def matrix(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (std if std is not None else 1 / math.sqrt(cols))

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(h, generator=gen)

    tensors = {"encoder.embed_tokens.weight": matrix(cfg["vocab_size"], h, 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(q, h), p + "self_attn.k_proj.weight": matrix(kv, h),
            p + "self_attn.v_proj.weight": matrix(kv, h), p + "self_attn.o_proj.weight": matrix(h, q),
            p + "mlp.gate_proj.weight": matrix(inter, h), p + "mlp.up_proj.weight": matrix(inter, h),
            p + "mlp.down_proj.weight": matrix(h, inter),
        }
    tensors["encoder.norm.weight"] = norm()
    tensors["diffusion_head.weight"] = matrix(cfg["vocab_size"], h, 0.3)
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], outdir: Path, shards: int) -> None:
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, outdir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::shards]}
        save_file(part, outdir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- FP8-dynamic (compressed-tensors) -------------------------------------------------------------

QUANTIZE = ("fp8-dynamic",)


def fp8_dynamic_config(ignore: list[str]) -> dict:
    """config.json's quantization_config as compressed-tensors (0.20) saves an FP8_DYNAMIC model (its
    QuantizationConfig.model_dump, plus what saving a compressed model adds: the group's format,
    sparsity and transform configs, the version)."""
    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
                "dynamic": dynamic}

    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": args("channel", False),
                                          "input_activations": args("token", True), "output_activations": None,
                                          "format": "float-quantized"}},
            "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ignore,
            "moe_sparsity_config": None, "sparsity_config": {}, "transform_config": {}, "version": "0.20.1"}


def quantize_linears(tensors: dict[str, torch.Tensor], linears: list[str], ignore: list[str]) -> dict[str, torch.Tensor]:
    """Each Linear module's `weight` (modules outside `ignore`) -> F8_E4M3 `weight` + BF16 `weight_scale`."""
    out = dict(tensors)
    for module in linears:
        if module not in ignore and f"{module}.weight" in out:
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = quantize_per_channel(out[f"{module}.weight"])
    return out


def write_nemotron_ld(outdir: Path, seed: int = 0, shards: int = 1, quantize: str | None = None,
                      **overrides) -> Path:
    cfg = {**NEMOTRON_LD_TINY_CONFIG, **overrides}
    tensors = nemotron_ld_tensors(cfg, seed)
    if quantize is not None:
        assert quantize in QUANTIZE, quantize
        ignore = ["diffusion_head"]   # the head stays unquantized, as llm-compressor's recipes keep lm_head
        linears = [n.removesuffix(".weight") for n, t in tensors.items() if t.dim() == 2 and "embed_tokens" not in n]
        tensors = quantize_linears(tensors, linears, ignore)
        cfg["quantization_config"] = fp8_dynamic_config(ignore)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "config.json").write_text(json.dumps(cfg, indent=2))
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_safetensors(tensors, outdir, shards)
    specials = NEMOTRON_LD_SPECIAL_TOKENS
    build_tiny_tokenizer(outdir, vocab_size=cfg["vocab_size"], special_tokens=specials,
                         bos_token=specials[cfg["bos_token_id"]], eos_token=specials[cfg["eos_token_id"]],
                         pad_token=None, mask_token=specials[cfg["mask_token_id"]],
                         chat_template=MISTRAL_STYLE_CHAT_TEMPLATE)
    return outdir


# DiffusionGemma: the 26B-A4B's structure at toy size. Layers sliding, sliding, full (the last layer is
# always full); full layers K = V with one KV head (replicated under TP, as the 26B's 2 heads at TP 4/8)
# and a wider head; heads, intermediate sizes split by tp = 1, 2, 4; the vocabulary (997, prime) does not.
# The window (8) is shorter than test prompts so that it matters.
DIFFUSION_GEMMA_TINY_TEXT_CONFIG = {
    "vocab_size": 997, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 8,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
    "max_position_embeddings": 1024, "use_bidirectional_attention": "vision",
    "pad_token_id": 0, "eos_token_id": [1, 5], "bos_token_id": 2,
}
DIFFUSION_GEMMA_TINY_VISION_CONFIG = {  # present in the checkpoint like the real one's; never served
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 128, "position_embedding_size": 64,
    "patch_size": 4, "pooling_kernel_size": 1,
}
DIFFUSION_GEMMA_SPECIAL_TOKENS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<start_of_turn>",
                                  5: "<end_of_turn>", 6: "<start_of_image>", 7: "<end_of_image>",
                                  8: "<image_soft_token>"}
# generation_config.json knobs (docs/spec.md 4), in transformers' DiffusionGemmaGenerationConfig spelling
DIFFUSION_GEMMA_TINY_GENERATION = {
    "max_denoising_steps": 12, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
}


def _randomize_diffusion_gemma(model, seed: int) -> None:
    """Weights of useful scale instead of transformers' N(0, 0.02): peaked logits, decisive routing, and
    encoder and decoder layer scalars that differ (transformers keeps them as separate buffers)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 3 / math.sqrt(p.shape[-1]))
            elif p.dim() >= 2:  # linears [out, in] and experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
                if "self_conditioning.down_proj" in name:
                    # at unit gain the random self-conditioning loop is expansive (~2.5x per step), and
                    # would amplify fp32 rounding of batch shapes past any tolerance; 0.3 keeps the
                    # signal well visible (parity tests check it) and the loop contractive
                    p.mul_(0.3)
            else:  # norm weights, router scales
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=gen))


def _diffusion_gemma_to_fp8(model, outdir: Path, shards: int) -> None:
    """Rewrite the checkpoint save_pretrained wrote in outdir as the FP8-dynamic one: experts split one
    per expert (the quantizer's per-expert Linears), every Linear outside the ignore list quantized."""
    files = sorted(outdir.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors |= {n: f.get_tensor(n) for n in f.keys()}
        file.unlink()
    (outdir / "model.safetensors.index.json").unlink(missing_ok=True)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        experts = name.removesuffix(".gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(f"{experts}.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            for proj, w in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]), ("down_proj", down[e])):
                tensors[f"{experts}.{e}.{proj}.weight"] = w.contiguous()
                linears.append(f"{experts}.{e}.{proj}")
    kept = ("router.proj", "vision_tower.", "embed_vision.", "self_conditioning.")
    ignore = [n for n in linears if n == "lm_head" or any(k in n for k in kept)]
    save_safetensors(quantize_linears(tensors, linears, ignore), outdir, shards)
    cfg = json.loads((outdir / "config.json").read_text())
    cfg["quantization_config"] = fp8_dynamic_config(ignore)
    (outdir / "config.json").write_text(json.dumps(cfg, indent=2))


def write_diffusion_gemma(outdir: Path, seed: int = 0, shards: int = 1, canvas_length: int = 16,
                          quantize: str | None = None, **text_overrides) -> Path:
    """Built with transformers' own DiffusionGemma classes and save_pretrained, so config.json and the
    tensor names are exactly what transformers writes (tied weights once, under model.decoder.*)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = {**DIFFUSION_GEMMA_TINY_TEXT_CONFIG, **text_overrides}
    specials = DIFFUSION_GEMMA_SPECIAL_TOKENS
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=DIFFUSION_GEMMA_TINY_VISION_CONFIG,
                               canvas_length=canvas_length, boi_token_id=6, eoi_token_id=7, image_token_id=8)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    _randomize_diffusion_gemma(model, seed)
    outdir.mkdir(parents=True, exist_ok=True)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}  # tied once
    model.save_pretrained(outdir, max_shard_size=sum(unique.values()) // shards + 1 if shards > 1 else "50GB")
    if quantize is not None:
        assert quantize in QUANTIZE, quantize
        _diffusion_gemma_to_fp8(model, outdir, shards)
    eos = text["eos_token_id"]
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": eos, "pad_token_id": text["pad_token_id"],
                  **DIFFUSION_GEMMA_TINY_GENERATION}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    build_tiny_tokenizer(outdir, vocab_size=text["vocab_size"], special_tokens=specials,
                         bos_token=specials[text["bos_token_id"]],
                         eos_token=specials[eos[0] if isinstance(eos, list) else eos],
                         pad_token=specials[text["pad_token_id"]], mask_token=None,
                         chat_template=GEMMA_STYLE_CHAT_TEMPLATE)
    return outdir


FAMILIES = {"nemotron-ld": write_nemotron_ld, "diffusion-gemma": write_diffusion_gemma}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="nemotron-ld")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--quantize", choices=QUANTIZE, default=None,
                        help="write a compressed-tensors FP8-dynamic checkpoint")
    args = parser.parse_args(argv)
    FAMILIES[args.family](args.outdir, seed=args.seed, shards=args.shards, quantize=args.quantize)
    quantized = f" ({args.quantize})" if args.quantize else ""
    print(f"wrote a tiny {args.family} checkpoint{quantized} to {args.outdir}")


if __name__ == "__main__":
    main()
