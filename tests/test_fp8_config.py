"""FP8 checkpoints, the config (model/quant_config.py): compressed-tensors' FP8-dynamic
`quantization_config` read for both families (and by compressed-tensors itself), every other scheme
refused with its field and value named, the ignore list's exact names and `re:` patterns, fused modules
split by it, and the application's `quantization` argument against the checkpoint."""
from __future__ import annotations

import copy
import json

import pytest

from model.checkpoint import Checkpoint, parse_model_config
from model.quant_config import QuantizationConfig, QuantScope
from model.tiny import DIFFUSION_GEMMA_TINY_TEXT_CONFIG, NEMOTRON_LD_TINY_CONFIG, fp8_dynamic_config


def args(strategy: str, dynamic: bool) -> dict:
    # as a RedHatAI FP8-dynamic config.json spells them (observers and nulls included)
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "float"}


# The description of RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic's quantization_config
# (layer names shortened to two layers)
REAL = {
    "config_groups": {"group_0": {"input_activations": args("token", True), "output_activations": None,
                                  "targets": ["Linear"], "weights": args("channel", False),
                                  "format": "float-quantized"}},
    "format": "float-quantized", "global_compression_ratio": None,
    "ignore": ["model.decoder.layers.0.router.proj", "model.decoder.layers.1.router.proj",
               "re:model[.]encoder[.]vision_tower[.].*", "model.encoder.embed_vision.embedding_projection",
               "model.decoder.self_conditioning.gate_proj", "model.decoder.self_conditioning.up_proj",
               "model.decoder.self_conditioning.down_proj", "lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "sparsity_config": {}, "transform_config": {}, "version": "0.12.3.a20251114",
}


def edited(path: str, value) -> dict:
    """REAL with the field at dotted `path` set to value (... deletes it)."""
    cfg = copy.deepcopy(REAL)
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return cfg


def gemma_config(quantization: dict | None) -> dict:
    data = {"model_type": "diffusion_gemma", "text_config": dict(DIFFUSION_GEMMA_TINY_TEXT_CONFIG), "canvas_length": 16}
    if quantization is not None:
        data["quantization_config"] = quantization
    return data


def test_the_real_checkpoints_config_is_read_for_both_families():
    for data in (gemma_config(REAL), {**NEMOTRON_LD_TINY_CONFIG, "quantization_config": REAL}):
        cfg = parse_model_config(data)
        q = cfg.quantization_config
        assert q is not None and q.ignore == REAL["ignore"]
        assert q.config_groups["group_0"].weights.resolved_strategy == "channel"
    # DiffusionGemma's quantization_config sits at the top of config.json, beside its text_config
    assert parse_model_config(gemma_config(None)).quantization_config is None


def test_compressed_tensors_reads_the_same_configs():
    from compressed_tensors.quantization import QuantizationConfig as CTConfig

    for data in (REAL, fp8_dynamic_config(["lm_head"])):
        theirs = CTConfig.model_validate(data)
        group = theirs.config_groups["group_0"]
        assert (group.weights.strategy, group.weights.dynamic, group.input_activations.strategy,
                group.input_activations.dynamic) == ("channel", False, "token", True)
        assert theirs.format == "float-quantized" and theirs.quantization_status == "compressed"
        assert QuantizationConfig.model_validate(data).ignore == theirs.ignore


@pytest.mark.parametrize("path, value, named", [
    # weights: block (DeepSeek-style FP8), group, per-tensor; int; 4 bits (NVFP4's); asymmetric; static
    # activations; a per-tensor or missing activation scheme (W8A16)
    ("config_groups.group_0.weights.strategy", "block", "weights.strategy='block'"),
    ("config_groups.group_0.weights.block_structure", [128, 128], "weights.block_structure=[128, 128]"),
    ("config_groups.group_0.weights.group_size", 128, "weights.group_size=128"),
    ("config_groups.group_0.weights.strategy", "tensor", "weights.strategy='tensor'"),
    ("config_groups.group_0.weights.type", "int", "weights.type='int'"),
    ("config_groups.group_0.weights.num_bits", 4, "weights.num_bits=4"),
    ("config_groups.group_0.weights.symmetric", False, "weights.symmetric=False"),
    ("config_groups.group_0.weights.dynamic", True, "weights.dynamic=True"),
    ("config_groups.group_0.input_activations.dynamic", False, "input_activations.dynamic=False"),
    ("config_groups.group_0.input_activations.strategy", "tensor", "input_activations.strategy='tensor'"),
    ("config_groups.group_0.input_activations.num_bits", 4, "input_activations.num_bits=4"),
    ("config_groups.group_0.input_activations", None, "input_activations=None"),
    ("config_groups.group_0.output_activations", args("token", True), "output_activations="),
    ("config_groups.group_0.targets", ["re:.*mlp.*"], "targets=['re:.*mlp.*']"),
    ("config_groups.group_0.format", "pack-quantized", "group_0.format='pack-quantized'"),
    # the checkpoint as a whole
    ("format", "nvfp4-pack-quantized", "format='nvfp4-pack-quantized'"),
    ("format", "pack-quantized", "format='pack-quantized'"),
    ("quantization_status", "frozen", "quantization_status='frozen'"),
    ("quant_method", "fp8", "quant_method='fp8'"),
    ("kv_cache_scheme", args("tensor", False), "kv_cache_scheme="),
    ("sparsity_config", {"format": "sparse-24-bitmask"}, "sparsity_config="),
    ("config_groups", {}, "config_groups={}"),
    ("config_groups", {"FP8_DYNAMIC": ["Linear"]}, "config_groups.FP8_DYNAMIC=['Linear']"),
    ("ignore", ["re:model.(layers"], "ignore[0]='re:model.(layers'"),
])
def test_every_other_scheme_is_refused_naming_its_field_and_value(path, value, named):
    for data in (gemma_config(edited(path, value)), {**NEMOTRON_LD_TINY_CONFIG, "quantization_config": edited(path, value)}):
        with pytest.raises(ValueError) as err:
            parse_model_config(data)
        msg = str(err.value)
        assert msg.startswith("config.json: quantization_config: "), msg
        assert named in msg and "Supported: compressed-tensors FP8-dynamic" in msg, msg


def test_an_nvfp4_checkpoint_names_each_unsupported_field():
    nvfp4 = edited("format", "nvfp4-pack-quantized")
    group = nvfp4["config_groups"]["group_0"]
    for kind in ("weights", "input_activations"):
        group[kind] |= {"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "dynamic": "local" if kind ==
                        "input_activations" else False}
    with pytest.raises(ValueError) as err:
        parse_model_config(gemma_config(nvfp4))
    msg = str(err.value)
    for named in ("format='nvfp4-pack-quantized'", "weights.num_bits=4", "weights.strategy='tensor_group'",
                  "weights.group_size=16", "input_activations.dynamic='local'"):
        assert named in msg, named


def test_a_missing_strategy_is_inferred_as_compressed_tensors_does():
    # group_size -1 means per channel; absent strategy and group_size mean per tensor (refused)
    ok = edited("config_groups.group_0.weights.strategy", ...)
    ok["config_groups"]["group_0"]["weights"]["group_size"] = -1
    assert QuantizationConfig.model_validate(ok)
    with pytest.raises(ValueError, match="weights.strategy='tensor'"):
        QuantizationConfig.model_validate(edited("config_groups.group_0.weights.strategy", ...))


def test_the_ignore_list_matches_exact_names_and_re_patterns_from_the_start():
    q = QuantizationConfig.model_validate(REAL)
    assert q.ignores("lm_head") and q.ignores("model.decoder.layers.1.router.proj")
    assert q.ignores("model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.linear")   # re:
    assert not q.ignores("model.decoder.layers.10.router.proj")      # exact: not a prefix match
    assert not q.ignores("model.decoder.layers.0.router")
    assert not q.ignores("x.model.encoder.vision_tower.y")           # re: anchored at the start (re.match)
    assert not q.ignores("model.decoder.layers.0.mlp.gate_proj")


def test_quant_scope_walks_checkpoint_paths():
    scope = QuantScope(QuantizationConfig.model_validate(REAL)) / "model" / "decoder"
    layer = scope / "layers.0"
    assert layer.name("router.proj") == "model.decoder.layers.0.router.proj"
    assert not (layer / "router").fp8("proj")
    assert (layer / "self_attn").fp8("q_proj", "k_proj", "v_proj")
    assert (layer / "experts").fp8(*(f"{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")))
    assert not scope.fp8("self_conditioning.gate_proj", "self_conditioning.up_proj")
    assert not QuantScope().fp8("anything")   # no quantization_config: nothing quantized


def test_an_ignore_list_that_splits_a_fused_module_is_refused_by_name():
    q = QuantizationConfig.model_validate(edited("ignore", ["model.decoder.layers.0.self_attn.k_proj"]))
    with pytest.raises(ValueError) as err:
        (QuantScope(q) / "model.decoder.layers.0.self_attn").fp8("q_proj", "k_proj", "v_proj")
    msg = str(err.value)
    assert "keeps model.decoder.layers.0.self_attn.k_proj unquantized but not" in msg
    assert "model.decoder.layers.0.self_attn.q_proj, model.decoder.layers.0.self_attn.v_proj" in msg


def test_the_quantization_argument_must_agree_with_the_checkpoint(tmp_path):
    for name, quantization in (("fp8", REAL), ("plain", None)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(gemma_config(quantization)))
    fp8, plain = Checkpoint.read(tmp_path / "fp8"), Checkpoint.read(tmp_path / "plain")
    assert (fp8.quantization, plain.quantization) == ("compressed-tensors", None)
    fp8.check_quantization(None)
    fp8.check_quantization("compressed-tensors")
    plain.check_quantization(None)
    with pytest.raises(ValueError, match=r"quantization='fp8'.*quantized with 'compressed-tensors'"):
        fp8.check_quantization("fp8")
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors'.*not quantized"):
        plain.check_quantization("compressed-tensors")
