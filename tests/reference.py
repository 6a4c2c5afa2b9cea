"""transformers' own classes holding our checkpoints' weights: the reference for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from model.checkpoint import load_model_config


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


def gemma_generate_with_our_draws(ref, prompt: torch.Tensor, seed: torch.Tensor, steps: int, canvases: int,
                                  knobs: dict, monkeypatch) -> tuple[list[int], int]:
    """transformers' DiffusionGemma `generate`, its torch.multinomial and canvas initialisation drawing
    our counter-based noise in the order our runner draws it (one counter per canvas start and per
    denoise step: the step's Gumbel sample and its renoise, which transformers draws through
    initialize_canvas, share it). Returns (generated tokens, draws used)."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

    from model.sampling import renoise as RN
    from model.sampling.noise import gumbel

    vocab = ref.config.get_text_config().vocab_size
    canvas = ref.config.canvas_length
    state = {"counter": 0}
    one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731

    def multinomial(probs, num_samples):
        g = gumbel(seed, one(state["counter"]), probs.shape[0], 0, vocab)[0]
        return torch.argmax(torch.log(probs) + g, dim=-1, keepdim=True)

    def initialize_canvas(self, batch_size, device):
        out = RN.random_tokens(seed, one(state["counter"]), canvas, vocab)
        state["counter"] += 1
        return out

    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", multinomial)
        m.setattr(G.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
        with torch.no_grad():
            out = ref.generate(prompt[None], max_new_tokens=canvases * canvas, max_denoising_steps=steps,
                               t_min=knobs["t_min"], t_max=knobs["t_max"],
                               sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=knobs["entropy_bound"]),
                               stability_threshold=knobs["stability_threshold"],
                               confidence_threshold=knobs["confidence_threshold"], eos_token_id=None,
                               pad_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), state["counter"]
