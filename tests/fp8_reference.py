"""compressed-tensors' reading of an FP8-dynamic checkpoint: the reference tests/test_fp8*.py hold our
FP8 models to.

    twin_checkpoint(fp8_dir, out_dir)   the unquantized twin: every FP8 weight decompressed by
                                        compressed-tensors (FloatQuantizationCompressor.decompress, with
                                        its scale in fp32: exact), scales dropped, experts fused back into
                                        the layout transformers saves, no quantization_config
    fp8_modules(fp8_dir, model)         our modules whose checkpoint weights are FP8 (read from the
                                        safetensors header, not from our config code)
    ct_activation_rounding(twin, modules, tp)
                                        while active, the twin's modules in `modules` round their inputs
                                        to FP8 by compressed-tensors' dynamic quantization: per token, or
                                        for row-parallel inputs at TP = tp per token and rank slice (each
                                        rank scales its own slice of K), in fp32 as the served path does
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors import safe_open

from model.fp8 import FP8
from model.loader import checkpoint_files
from model.moe import GemmaExperts, grouped_linear
from model.parallel.linear import LinearBase, RowParallelLinear
from model.tiny import save_safetensors
from tests.test_diffusion_gemma_tp import forward as gemma_forward   # the same forward, full-vocabulary logits

FP8_DYNAMIC: QuantizationScheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(set(checkpoint_files(Path(model_dir)).values())):
        with safe_open(file, framework="pt") as f:
            tensors |= {n: f.get_tensor(n) for n in f.keys()}
    return tensors


def ct_decompress(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's FP8 weight, its scale taken in fp32 so that
    the product is exact (with the stored bf16 scale it rounds the result to bf16)."""
    out = FloatQuantizationCompressor.decompress({"weight": weight, "weight_scale": scale.float()}, FP8_DYNAMIC)
    return out["weight"]


def twin_checkpoint(fp8_dir: Path, out_dir: Path) -> Path:
    shutil.copytree(fp8_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = read_tensors(fp8_dir)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        weight = name.removesuffix("_scale")
        tensors[weight] = ct_decompress(tensors[weight], tensors.pop(name))
    for p in sorted({n.rsplit(".", 3)[0] for n in tensors if ".experts." in n and n.endswith("_proj.weight")}):
        n = sum(1 for k in tensors if k.startswith(f"{p}.") and k.endswith(".down_proj.weight"))
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(n)]
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(n)])
    assert not any(t.dtype == FP8 for t in tensors.values())
    save_safetensors(tensors, out_dir, 1)
    cfg = json.loads((out_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def dequantized_parameters(model) -> dict[str, torch.Tensor]:
    """What the FP8 model holds, in its twin's terms: every parameter but the scales, each FP8 weight times
    its per-output-channel scales (exact in fp32)."""
    params = dict(model.named_parameters())
    out = {}
    for name, p in params.items():
        if getattr(p, "fp8_scale", False):
            continue
        if p.dtype != FP8:
            out[name] = p.detach()
            continue
        scale = params[f"{name}_scale"]   # linears: weight_scale [out, 1]; experts: gate_up_proj_scale [E, 2I]
        scale = scale.unsqueeze(-1) if scale.dim() < p.dim() else scale
        dtype = torch.promote_types(model.decoder.embed_tokens.weight.dtype if hasattr(model, "decoder")
                                    else model.encoder.embed_tokens.weight.dtype, torch.float32)
        out[name] = p.to(dtype) * scale.to(dtype)
    return out


def fp8_modules(fp8_dir: Path, model) -> set[str]:
    """Names of `model`'s modules whose checkpoint weights are stored as F8_E4M3."""
    ours = {ckpt: fused for ckpt, (fused, _) in model.packed_modules.items()}
    names = set()
    for name, file in checkpoint_files(Path(fp8_dir)).items():
        with safe_open(file, framework="pt") as f:
            if not name.endswith(".weight") or f.get_slice(name).get_dtype() != "F8_E4M3":
                continue
        parts = name.split(".")[:-1]
        if "experts" in parts:   # experts.{e}.gate_proj -> experts
            parts = parts[: parts.index("experts") + 1]
        else:
            parts[-1] = ours.get(parts[-1], parts[-1])
        names.add(".".join(parts))
    return names


def ct_round(x: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """x rounded to FP8 by compressed-tensors (dynamic, symmetric, in fp32) per row, or per group of
    `group_size` along the last dim; dequantized into x's dtype."""
    k = x.shape[-1]
    if group_size is None or group_size == k:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        xf = x.float().reshape(-1, 1, k)   # its token strategy keeps the first two dims
    else:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=group_size,
                                dynamic=True)
        xf = x.float().reshape(-1, k)
    scale, zero_point = compute_dynamic_scales_and_zp(xf, args, module=None)
    q = quantize(xf, scale, zero_point, args, dtype=FP8)
    if group_size is not None and group_size != k:
        q, scale = q.unflatten(-1, (k // group_size, group_size)), scale.unsqueeze(-1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (q.to(dtype) * scale.to(dtype)).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def ct_activation_rounding(twin, modules: set[str], tp: int = 1):
    handles, patched = [], []
    for name, module in twin.named_modules():
        if name not in modules:
            continue
        if isinstance(module, LinearBase):
            group = module.input_size // tp if isinstance(module, RowParallelLinear) else None
            handles.append(module.register_forward_pre_hook(
                lambda m, args, group=group: (ct_round(args[0], group),) + args[1:]))
        elif isinstance(module, GemmaExperts):
            down_group = module.intermediate // tp

            def project(x, weight, scale, pairs, gather=False, module=module, down_group=down_group):
                assert scale is None   # the twin is unquantized
                group = down_group if weight is module.down_proj else None
                return grouped_linear(ct_round(x, group), weight, pairs, gather)

            module.project = project
            patched.append(module)
        else:
            raise AssertionError(f"{name}: FP8 in the checkpoint, but {type(module).__name__} is not a linear")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module in patched:
            del module.project


# --------------------------------------------------------------------------------------------------
# A prefill / denoise / commit schedule of either family, full-vocabulary logits per forward

def gemma_schedule(model, tp) -> list[torch.Tensor]:
    """Prefill two slots; both denoise a self-conditioned canvas; slot 0 commits while slot 1 denoises;
    slot 0 denoises its next canvas. Each forward's logits of its real tokens [n, V]."""
    from model.attention import PagedKVCache
    from tests.vocab_reductions import gather_vocab

    cfg = model.config
    V, C = cfg.vocab_size, cfg.canvas_length
    gen = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(0, V, (n,), generator=gen).tolist()

    dtype = model.decoder.embed_tokens.weight.dtype
    soft = (torch.randn(2, C, cfg.hidden_size, generator=gen, dtype=torch.float64) * 3).to(dtype)
    kv = PagedKVCache.per_slot(model.kv_layer_shapes, 2, 96, dtype, "cpu")
    forwards = [([(0, 0, True, toks(20)), (1, 0, True, toks(9))], None),
                ([(0, 20, False, toks(C)), (1, 9, False, toks(C))], soft),
                ([(0, 20, True, toks(C)), (1, 9, False, toks(C))], soft),
                ([(0, 20 + C, False, toks(C))], soft[:1])]
    out = []
    for rows, s in forwards:
        logits = gather_vocab(gemma_forward(model, kv, rows, s), V, tp)
        out.append(torch.cat([logits[b, : len(row[3])] for b, row in enumerate(rows)]))
    return out


def schedule(model, tp) -> list[torch.Tensor]:
    """Every forward's full-vocabulary logits of its real tokens [n, V]."""
    if model.config.model_type == "diffusion_gemma":
        return gemma_schedule(model, tp)
    from tests.tp_harness import run_mixed_schedule

    return [torch.cat([logits for _, logits in forward]) for forward in run_mixed_schedule(model, tp)]
