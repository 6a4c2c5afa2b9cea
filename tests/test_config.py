"""config.json / generation_config.json parsing and validation (model/config.py, docs/spec.md 2.1)."""
from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_model_config, parse_model_config
from model.families import FAMILIES
from model.config import NemotronLabsDiffusionConfig, load_generation_defaults

# The published 8B config.json, as quoted in docs/spec.md 2.1 (plus its auto_map, which is never run).
PUBLISHED_8B = {
    "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
    "auto_map": {"AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "attention_bias": False, "attention_dropout": 0.0, "block_size": 32, "bos_token_id": 1,
    "dlm_paradigm": "bidirectional", "eos_token_id": 11, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "mask_token_id": 100,
    "max_position_embeddings": 262144, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 34, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0,
                        "llama_4_scaling_beta": 0.1, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 16384, "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 131072,
}
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "llama_4_scaling_beta")


def variant(**changes) -> dict:
    cfg = json.loads(json.dumps(PUBLISHED_8B))
    for key, value in changes.items():
        if value is ...:
            del cfg[key]
        else:
            cfg[key] = value
    return cfg


def legacy_rope(type_key: str) -> dict:
    """The pre-transformers-v5 spelling: `rope_scaling` without rope_theta, which sits at top level."""
    rope = dict(PUBLISHED_8B["rope_parameters"])
    theta = rope.pop("rope_theta")
    rope[type_key] = rope.pop("rope_type")
    return variant(rope_parameters=..., rope_scaling=rope, rope_theta=theta)


def rope_dict(cfg) -> dict:
    return {k: v for k, v in cfg.rope_parameters.model_dump(exclude_none=True).items() if k in ROPE_KEYS}


def test_published_8b_config_parses(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_8B))
    cfg = load_model_config(tmp_path)
    assert isinstance(cfg, NemotronLabsDiffusionConfig)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (131072, 4096, 34)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size) == (32, 8, 128)
    assert (cfg.mask_token_id, cfg.canvas_length, cfg.eos_token_ids, cfg.bos_token_id) == (100, 32, (11,), 1)
    assert cfg.dtype == "bfloat16" and FAMILIES[cfg.model_type].name == "nemotron-ld"
    assert rope_dict(cfg) == PUBLISHED_8B["rope_parameters"]
    for tp in (1, 2, 4, 8):
        cfg.check_tensor_parallel(tp)
    with pytest.raises(Exception):  # immutable
        cfg.vocab_size = 5


@pytest.mark.parametrize("eos, ids", [(2, (2,)), (11, (11,)), ([2, 11], (2, 11))])
def test_eos_variants(eos, ids):
    assert parse_model_config(variant(eos_token_id=eos)).eos_token_ids == ids


def test_factor_8_variant():
    rope = {**PUBLISHED_8B["rope_parameters"], "factor": 8.0}
    cfg = parse_model_config(variant(rope_parameters=rope, max_position_embeddings=131072))
    assert cfg.rope_parameters.factor == 8.0 and cfg.max_position_embeddings == 131072


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_legacy_rope_scaling_key(type_key):
    cfg = parse_model_config(legacy_rope(type_key))
    assert rope_dict(cfg) == PUBLISHED_8B["rope_parameters"]
    hf = cfg.to_transformers()
    assert {k: hf.rope_parameters[k] for k in ROPE_KEYS} == PUBLISHED_8B["rope_parameters"]


def test_legacy_null_rope_scaling_means_default_rope():
    cfg = parse_model_config(variant(rope_parameters=..., rope_scaling=None, rope_theta=5e5))
    assert cfg.rope_parameters.rope_type == "default" and cfg.rope_parameters.rope_theta == 5e5


def test_dtype_key_alias():
    assert parse_model_config(variant(torch_dtype=..., dtype="float32")).dtype == "float32"


def test_to_transformers_has_the_same_rope():
    from transformers import Ministral3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = parse_model_config(PUBLISHED_8B)
    hf = cfg.to_transformers()
    assert isinstance(hf, Ministral3Config)
    assert {k: hf.rope_parameters[k] for k in ROPE_KEYS} == PUBLISHED_8B["rope_parameters"]
    assert (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (131072, 4096, 14336, 34)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (32, 8, 128)
    assert (hf.max_position_embeddings, hf.rms_norm_eps, hf.tie_word_embeddings) == (262144, 1e-5, False)
    # transformers derives the same YaRN frequencies and attention factor as from the raw dict
    direct = Ministral3Config(head_dim=128, hidden_size=4096, num_attention_heads=32, max_position_embeddings=262144,
                              rope_parameters=dict(PUBLISHED_8B["rope_parameters"]))
    ours_freq, ours_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](direct, "cpu")
    assert torch.equal(ours_freq, ref_freq) and ours_scale == ref_scale


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'") as err:
        parse_model_config(variant(model_type="llama"))
    assert "nemotron_labs_diffusion" in str(err.value)
    with pytest.raises(ValueError, match="unsupported model_type None"):
        parse_model_config(variant(model_type=...))


@pytest.mark.parametrize("changes, field", [
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"num_key_value_heads": 64}, "num_key_value_heads"),
    ({"mask_token_id": 131072}, "mask_token_id"),
    ({"mask_token_id": -1}, "mask_token_id"),
    ({"eos_token_id": 200000}, "eos_token_id"),
    ({"bos_token_id": 131072}, "bos_token_id"),
    ({"hidden_size": ...}, "hidden_size"),
    ({"vocab_size": ...}, "vocab_size"),
    ({"mask_token_id": ...}, "mask_token_id"),
    ({"eos_token_id": ...}, "eos_token_id"),
    ({"rope_parameters": ...}, "rope_parameters"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "factor"),
])
def test_invalid_field_is_named(changes, field):
    with pytest.raises(ValueError, match=field) as err:
        parse_model_config(variant(**changes), source="some/config.json")
    assert str(err.value).startswith("some/config.json: ")


def test_check_tensor_parallel_names_the_field():
    cfg = parse_model_config(PUBLISHED_8B)
    with pytest.raises(ValueError, match="num_attention_heads=32 is not divisible by tensor_parallel_size=3"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(ValueError, match="num_key_value_heads=8"):
        cfg.check_tensor_parallel(16)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        cfg.check_tensor_parallel(0)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)


def test_generation_config(tmp_path):
    assert load_generation_defaults(tmp_path).temperature is None  # no file: all defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 11], "temperature": 0.7, "top_p": 0.9, "top_k": 50,
         "max_new_tokens": 256, "block_size": 32, "threshold": 0.9}))
    gen = load_generation_defaults(tmp_path)
    assert (gen.eos_token_id, gen.temperature, gen.top_p, gen.top_k, gen.max_new_tokens) == ([2, 11], 0.7, 0.9, 50, 256)
    assert gen.model_extra == {"block_size": 32, "threshold": 0.9}  # family knobs are kept as given


@pytest.mark.parametrize("bad, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_generation_config_names_the_field(tmp_path, bad, field):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": 2, **bad}))
    with pytest.raises(ValueError, match=field) as err:
        load_generation_defaults(tmp_path)
    assert str(path) in str(err.value)
