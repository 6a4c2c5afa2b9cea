"""FP8 checkpoints, loading (model/loader.py, model/parallel/linear.py, model/moe.py): the tiny FP8
checkpoints are in the real format; what the loader holds dequantizes to exactly compressed-tensors' own
decompression, at TP = 1 and in every rank's shard (scales split with their rows in column-parallel
layers, replicated KV heads included, whole in row-parallel ones; experts fused from their per-expert
tensors); bad checkpoints (a scale missing, of the wrong shape or dtype, an FP8 tensor where none is
expected, an unsupported scheme) fail at load naming the tensor or field; dummy FP8 weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.fp8 import FP8
from model.loader import checkpoint_files, load_model
from model.parallel.group import TPGroup
from model.parallel.linear import RowParallelLinear
from model.tiny import fp8_dynamic_config, save_safetensors
from tests.fp8_reference import FP8_DYNAMIC, dequantized_parameters, read_tensors, schedule
from tests.test_reductions import fake_rank


@pytest.fixture(scope="module")
def checkpoints(fp8_checkpoints):
    """family -> (FP8 checkpoint, its twin decompressed by compressed-tensors)."""
    return fp8_checkpoints


def header(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for name, file in checkpoint_files(model_dir).items():
        with safe_open(file, framework="pt") as f:
            s = f.get_slice(name)
            out[name] = (s.get_dtype(), s.get_shape())
    return out


# --------------------------------------------------------------------------------------------------
# The format

@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_tiny_fp8_checkpoints_are_in_the_real_format(checkpoints, family):
    from compressed_tensors.quantization import QuantizationConfig as CTConfig

    fp8_dir, _ = checkpoints[family]
    q = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert q == fp8_dynamic_config(q["ignore"])
    assert CTConfig.model_validate(q).config_groups["group_0"] == FP8_DYNAMIC.model_copy(
        update={"format": "float-quantized"})
    tensors = header(fp8_dir)
    weights = {n.removesuffix(".weight") for n, (dt, _) in tensors.items() if dt == "F8_E4M3"}
    assert weights and all(n.endswith(".weight") for n, (dt, _) in tensors.items() if dt == "F8_E4M3")
    for module in weights:
        out = tensors[f"{module}.weight"][1][0]
        assert tensors[f"{module}.weight_scale"] == ("BF16", [out, 1]), module
        assert module not in q["ignore"]
    scales = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
    assert scales == weights
    assert not any("input_scale" in n for n in tensors)   # dynamic activations: no input scales
    for module in q["ignore"]:
        assert tensors.get(f"{module}.weight", ("F32",))[0] == "F32", module   # kept unquantized
    if family == "nemotron":
        assert q["ignore"] == ["diffusion_head"] and len(weights) == 2 * 7
        return
    # DiffusionGemma: experts one per expert; every router.proj, the vision tower, embed_vision, the
    # self-conditioning MLP and lm_head ignored
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in tensors)
    experts = {m for m in weights if ".experts." in m}
    assert len(experts) == 3 * 4 * 3   # layers x experts x (gate, up, down)
    assert "model.decoder.layers.2.experts.3.down_proj" in experts
    ignore = set(q["ignore"])
    assert {f"model.decoder.layers.{i}.router.proj" for i in range(3)} <= ignore
    assert {f"model.decoder.self_conditioning.{p}" for p in ("gate_proj", "up_proj", "down_proj")} <= ignore
    assert {"lm_head", "model.encoder.embed_vision.embedding_projection"} <= ignore
    assert any("vision_tower" in n for n in ignore)
    assert tensors["model.decoder.embed_tokens.weight"][0] == "F32"


# --------------------------------------------------------------------------------------------------
# What the loader holds, against compressed-tensors' decompression

def test_compressed_tensors_decompresses_what_the_tiny_writer_quantized(tiny_fp8_nemotron):
    """Its decompression with the stored bf16 scale rounds to bf16; with the scale in fp32 it is exact,
    and within FP8's half step of the weights the writer started from: 2^-4 relative for normal values,
    half the subnormal step (2^-10 of the channel's scale) below 2^-6."""
    from compressed_tensors.compressors import FloatQuantizationCompressor

    from model.tiny import NEMOTRON_LD_TINY_CONFIG, nemotron_ld_tensors

    original = nemotron_ld_tensors(NEMOTRON_LD_TINY_CONFIG, seed=0)
    stored = read_tensors(tiny_fp8_nemotron)
    name = "encoder.layers.1.mlp.gate_proj"
    w, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
    exact = w.float() * scale.float()
    bf16 = FloatQuantizationCompressor.decompress({"weight": w, "weight_scale": scale}, FP8_DYNAMIC)["weight"]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, exact.to(torch.bfloat16))
    err = (exact - original[f"{name}.weight"]).abs()
    assert (err <= 2 ** -4 * original[f"{name}.weight"].abs() + 2 ** -10 * scale.float()).all()
    assert err.max() > 0


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_loaded_fp8_weights_are_compressed_tensors_decompression(checkpoints, family):
    """At TP = 1 every parameter of the FP8 model (FP8 weights dequantized) equals the twin's: the
    checkpoint decompressed by compressed-tensors, loaded through the unquantized path."""
    fp8_dir, twin_dir = checkpoints[family]
    model = load_model(fp8_dir, show_progress=False)
    twin = dict(load_model(twin_dir, show_progress=False).named_parameters())
    ours = dequantized_parameters(model)
    assert ours.keys() == twin.keys()
    fp8 = [n for n, p in model.named_parameters() if p.dtype == FP8]
    assert len(fp8) == (2 * 4 if family == "nemotron" else 3 * 6)   # qkv, o, gate_up, down (+ 2 experts)
    for name in ours:
        assert torch.equal(ours[name], twin[name]), name


@pytest.mark.parametrize("family, world", [("nemotron", 2), ("nemotron", 3), ("gemma", 2), ("gemma", 4)])
def test_every_ranks_fp8_shard_is_the_twins_shard(checkpoints, family, world):
    """Each rank's FP8 weights and scales, dequantized, equal that rank's shard of the twin (the
    unquantized path's sharding, which tests/test_tensor_parallel.py checks): scales went with their
    rows. DiffusionGemma at TP = 4 replicates its KV heads (2 sliding, 1 full), scales with them.
    Row-parallel scales (o_proj, down_proj, the experts' down) are whole and the same on every rank."""
    fp8_dir, twin_dir = checkpoints[family]
    whole = {}
    for rank in range(world):
        tp = fake_rank(rank, world)
        model = load_model(fp8_dir, tp, show_progress=False)
        twin = dict(load_model(twin_dir, tp, show_progress=False).named_parameters())
        for name, p in dequantized_parameters(model).items():
            assert torch.equal(p, twin[name]), f"rank {rank}/{world}: {name}"
        for name, m in model.named_modules():
            if isinstance(m, RowParallelLinear) and m.weight_scale is not None:
                assert m.weight_scale.shape == (m.output_size, 1)
                assert torch.equal(whole.setdefault(name, m.weight_scale.detach()), m.weight_scale), name
            if getattr(m, "down_proj_scale", None) is not None:
                assert torch.equal(whole.setdefault(name, m.down_proj_scale.detach()), m.down_proj_scale), name
    assert whole


# --------------------------------------------------------------------------------------------------
# Bad checkpoints fail at load, naming the tensor or field

def broken(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """A copy of src with its tensors (rewritten as one file) and config.json edited."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = read_tensors(src)
    save_safetensors(edit(tensors) if edit else tensors, dst, 1)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def load_error(model_dir: Path) -> str:
    with pytest.raises(ValueError) as err:
        load_model(model_dir, show_progress=False)
    return str(err.value)


def replaced(name: str, value):
    def edit(t):
        return {**t, name: value(t[name])}
    return edit


def dropped(name: str):
    def edit(t):
        assert name in t
        return {n: v for n, v in t.items() if n != name}
    return edit


NL = "encoder.layers.1.mlp.down_proj"
DG = "model.decoder.layers.0.experts.2.up_proj"


@pytest.mark.parametrize("family, edit, named, expected", [
    ("nemotron", dropped(f"{NL}.weight_scale"), f"{NL}.weight_scale", "missing tensors (1)"),
    ("gemma", dropped(f"{DG}.weight_scale"), f"{DG}.weight_scale", "missing tensors (1)"),
    # shape: one scale per tensor, per channel without its trailing 1, half the channels
    ("nemotron", replaced(f"{NL}.weight_scale", lambda s: s[:1]), f"{NL}.weight_scale",
     "shape mismatch: checkpoint tensor (1, 1) vs expected (96, 1)"),
    ("nemotron", replaced(f"{NL}.weight_scale", lambda s: s[:, 0]), f"{NL}.weight_scale", "shape mismatch"),
    ("gemma", replaced(f"{DG}.weight_scale", lambda s: s[:16]), f"{DG}.weight_scale",
     "shape mismatch: checkpoint tensor (16, 1) vs expected (32, 1)"),
    ("gemma", replaced("model.decoder.layers.1.experts.0.down_proj.weight_scale", lambda s: s.T.contiguous()),
     "model.decoder.layers.1.experts.0.down_proj.weight_scale", "shape mismatch"),
    # dtype: an FP8 scale, an unquantized weight where the scheme quantizes, the other FP8 format
    ("nemotron", replaced(f"{NL}.weight_scale", lambda s: s.to(FP8)), f"{NL}.weight_scale",
     "dtype torch.float8_e4m3fn in the checkpoint, but it loads into an unquantized parameter"),
    ("nemotron", replaced(f"{NL}.weight", lambda w: w.to(torch.bfloat16)), f"{NL}.weight",
     "dtype torch.bfloat16 in the checkpoint, but it loads into an FP8 weight"),
    ("gemma", replaced(f"{DG}.weight", lambda w: w.to(torch.float8_e5m2)), f"{DG}.weight",
     "dtype torch.float8_e5m2 in the checkpoint"),
    # an FP8 tensor in a module the ignore list keeps unquantized
    ("gemma", replaced("model.decoder.layers.1.router.proj.weight", lambda w: w.to(FP8)),
     "model.decoder.layers.1.router.proj.weight", "loads into an unquantized parameter"),
    # static activation scales the (dynamic) scheme does not read
    ("nemotron", lambda t: {**t, f"{NL}.input_scale": torch.ones(1, dtype=torch.bfloat16)}, f"{NL}.input_scale",
     "unexpected tensors (1)"),
])
def test_a_bad_tensor_fails_at_load_naming_it(checkpoints, tmp_path, family, edit, named, expected):
    msg = load_error(broken(checkpoints[family][0], tmp_path / "ckpt", edit))
    assert named in msg and expected in msg, msg
    if "tensors (1)" in expected:
        assert "1 of them quantization scales" in msg and "ignore list" in msg


def test_scales_without_a_quantization_config_are_named(checkpoints, tmp_path):
    msg = load_error(broken(checkpoints["nemotron"][0], tmp_path / "ckpt",
                            config_edit=lambda cfg: cfg.pop("quantization_config")))
    assert "unexpected tensors (14): encoder.layers.0.mlp.down_proj.weight_scale" in msg
    assert "14 of them quantization scales: config.json has no quantization_config" in msg


def test_an_unsupported_scheme_fails_at_load_naming_the_field(checkpoints, tmp_path):
    def block(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"] |= {"strategy": "block",
                                                                              "block_structure": [128, 128]}
    msg = load_error(broken(checkpoints["gemma"][0], tmp_path / "ckpt", config_edit=block))
    assert "quantization_config" in msg and "weights.strategy='block'" in msg


# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_dummy_fp8_weights(checkpoints, family, tmp_path):
    """load_format=dummy for an FP8 config (benchmarks of full-size FP8 shapes): FP8 weights, experts
    included, that dequantize to ~ N(0, 0.02) like the unquantized dummy, and a forward that runs."""
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    shutil.copy(checkpoints[family][0] / "config.json", model_dir)
    model = load_model(model_dir, load_format="dummy", show_progress=False)
    params = dict(model.named_parameters())
    fp8 = [n for n, p in params.items() if p.dtype == FP8]
    assert len(fp8) == (8 if family == "nemotron" else 18)
    weights = dequantized_parameters(model)
    for name in fp8:
        w = weights[name]
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002, name
    forward = schedule(model, TPGroup())
    assert all(torch.isfinite(logits).all() for logits in forward)
