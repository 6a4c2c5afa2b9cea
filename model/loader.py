"""safetensors checkpoint -> this rank's parameter slices.

Tensors are opened lazily (`safe_open(...).get_slice`) from one `model.safetensors` or the shards its
index names, and every parameter's own `weight_loader` reads only this rank's rows or columns. The
family's `packed_modules` maps checkpoint projections onto fused ones (q/k/v, gate/up), and a parameter
fused from several tensors carries their names (`checkpoint_names`: the FP8 experts); nothing else is
per-model loading code. A tensor's dtype is checked before it is read (an FP8 parameter reads
float8_e4m3fn only, every other a float). Once every weight is in, a layer whose kernels read another
layout faster gets it rewritten (the FP8 experts, chunked: model.moe.GemmaExperts.chunk_for_kernels).
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Iterator, Literal

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from model.checkpoint import load_model_config
from model.config import ModelConfig
from model.families import FAMILIES
from model.moe import GemmaExperts
from model.parallel.group import TPGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' dtype names (its header) -> torch's; any other is reported by name
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class LazyTensor:
    """A checkpoint tensor whose slices are read on indexing (`.shape`, `.dtype`, `[...]`)."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        stored = self._slice.get_dtype()
        self.dtype = SAFETENSORS_DTYPES.get(stored, stored)

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update((name, file) for name in f.keys())
    return names


def expected_tensors(model: nn.Module) -> dict[str, tuple[str, object]]:
    """checkpoint tensor name -> (parameter name, shard id or None) for every parameter of model."""
    packed = getattr(model, "packed_modules", {})
    fused = {}
    for ckpt_module, (ours, shard) in packed.items():
        fused.setdefault(ours, []).append((ckpt_module, shard))
    expected = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        own = getattr(param, "checkpoint_names", None)
        if own is not None:
            # fused from several tensors under its own module (FP8 experts: experts.{e}.gate_proj.weight, ...)
            expected.update((".".join(parts[:-1] + [suffix]), (name, shard)) for suffix, shard in own.items())
        elif module in fused:
            # a fused module may hold only some of the projections (DiffusionGemma's full layers: q|k, K = V)
            shards = getattr(model.get_submodule(".".join(parts[:-1])), "checkpoint_shards", None)
            for ckpt_module, shard in fused[module]:
                if shards is None or shard in shards:
                    expected[".".join(parts[:-2] + [ckpt_module, parts[-1]])] = (name, shard)
        else:
            expected[name] = (name, None)
    return expected


def load_weights(model: nn.Module, model_dir: str | Path, show_progress: bool = True) -> None:
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    expected = expected_tensors(model)
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_tensors", ())]
    present = {n for n in files if not any(p.search(n) for p in ignored)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        lines = [f"checkpoint {model_dir} does not match the model:"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        scales = [n for n in missing + unexpected if n.endswith(SCALE_SUFFIXES)]
        if scales:
            lines.append(f"  ({len(scales)} of them quantization scales: {_quantization_hint(model)})")
        raise ValueError("\n".join(lines))
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_file.setdefault(files[name], []).append(name)
    with tqdm(total=len(expected), desc=f"loading {model_dir.name}", unit="tensor",
              disable=not show_progress) as bar:
        for file, names in sorted(by_file.items()):
            with safe_open(file, framework="pt") as handle:
                for name in names:
                    param_name, shard = expected[name]
                    param = params[param_name]
                    source = LazyTensor(handle, name)
                    check_dtype(name, param, source)
                    try:
                        if shard is None:
                            param.weight_loader(param, source)
                        else:
                            param.weight_loader(param, source, shard)
                    except ValueError as err:
                        raise ValueError(f"{name}: {err}") from None
                    bar.update()


SCALE_SUFFIXES = (".weight_scale", ".input_scale")


def _quantization_hint(model: nn.Module) -> str:
    scheme = model.config.quantization_config
    if scheme is None:
        return "config.json has no quantization_config, so this model expects none"
    return (f"config.json's quantization_config quantizes every Linear outside its ignore list "
            f"({len(scheme.ignore or ())} entries), and this model expects a weight_scale for each")


def check_dtype(name: str, param: torch.Tensor, source) -> None:
    """ValueError naming the tensor if its stored dtype is not what `param` reads."""
    wanted = (torch.float8_e4m3fn,) if param.dtype == torch.float8_e4m3fn else FLOATS
    if source.dtype not in wanted:
        quantized = "an FP8 weight" if param.dtype == torch.float8_e4m3fn else "an unquantized parameter"
        raise ValueError(f"{name}: dtype {source.dtype} in the checkpoint, but it loads into {quantized} "
                         f"(expected {' or '.join(str(d) for d in wanted)})")


# dummy FP8 weights: values ~ N(0, DUMMY_FP8_STD) well inside FP8's range, scales making them ~ N(0, 0.02)
DUMMY_FP8_STD = 64.0


def fill_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks of full-size shapes without a checkpoint: matrices ~ N(0, 0.02),
    norm weights 1 (a norm scaled by 0.02 would shrink every activation towards zero). FP8 weights
    dequantize to N(0, 0.02) too: values ~ N(0, 64) rounded to FP8, every scale 0.02 / 64."""
    gens: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if getattr(param, "fp8_scale", False):
            param.data.fill_(0.02 / DUMMY_FP8_STD)
            continue
        if param.dim() == 1:
            param.data.fill_(1.0)
            continue
        # drawn where the parameter lives: an 8B model's worth of CPU draws would take minutes
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.dtype == torch.float8_e4m3fn:
            values = torch.empty(param.shape, device=param.device).normal_(0.0, DUMMY_FP8_STD, generator=gen)
            param.data.copy_(values.clamp(-448, 448))
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    family = FAMILIES[cfg.model_type]
    cls = family.resolve(family.model_class)
    with _default_dtype(dtype), torch.device(device):
        model = cls(cfg, tp, dtype)
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, tp: TPGroup | None = None, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", load_format: Literal["safetensors", "dummy"] = "safetensors",
               show_progress: bool | None = None, seed: int = 0, config: ModelConfig | None = None) -> nn.Module:
    """The model of `model_dir` for one TP rank. `dtype` defaults to the checkpoint's; `config`: its
    config.json already read (model.checkpoint.Checkpoint), else read here."""
    tp = tp or TPGroup()
    cfg = config or load_model_config(model_dir)
    if dtype is None or isinstance(dtype, str):
        name = dtype or cfg.dtype
        if name not in DTYPES:
            raise ValueError(f"dtype={name!r}; supported: {', '.join(DTYPES)}")
        dtype = DTYPES[name]
    model = build_model(cfg, tp, dtype, device)
    if show_progress is None:
        show_progress = tp.rank == 0
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format == "safetensors":
        load_weights(model, model_dir, show_progress)
    else:
        raise ValueError(f"load_format={load_format!r}; supported: safetensors, dummy")
    for module in model.modules():   # layouts of the loaded weights for the kernels that will read them
        if isinstance(module, GemmaExperts):
            module.chunk_for_kernels(dtype)
    return model
