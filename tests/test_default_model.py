"""The default model (deployments/args.py:default_model_dir, trained by model/train_tiny.py): a checkpoint
in the real format that our loader and engine read, and whose greedy output is words of its training
text (the standard library's docstrings) in both modes, where a random-weight checkpoint's is not."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from deployments.args import AppArgs, default_model_dir
from model import train_tiny
from model.checkpoint import Checkpoint
from model.loader import load_model
from model.sampling.params import DecodeParams
from model.tiny import write_nemotron_ld
from workers.engine import Engine

PROMPTS = ["Return the number of items in the", "Open the file and", "This module provides"]
# The published 8B's config.json keys (docs/spec.md 2.1)
SPEC_KEYS = {"architectures", "model_type", "attention_bias", "attention_dropout", "block_size", "bos_token_id",
             "dlm_paradigm", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
             "mask_token_id", "max_position_embeddings", "mlp_bias", "num_attention_heads", "num_hidden_layers",
             "num_key_value_heads", "rms_norm_eps", "rope_parameters", "sliding_window", "tie_word_embeddings",
             "torch_dtype", "vocab_size"}


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    return {w for _, text in train_tiny.stdlib_docstrings() for w in train_tiny.words(text)}


def greedy_texts(model_dir, mode: str, max_tokens: int = 32) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with Engine(str(model_dir), num_slots=4, max_model_len=256) as engine:
        done = engine.generate([tokenizer(p)["input_ids"] for p in PROMPTS],
                               DecodeParams(mode=mode, temperature=0, max_tokens=max_tokens, ignore_eos=True))
    # ignore_eos: past an EOS comes the next docstring (BOS, text); each special token reads as a space
    space = tokenizer.encode(" ", add_special_tokens=False)
    specials = set(tokenizer.added_tokens_decoder)
    return [tokenizer.decode([u for t in r.output for u in (space if t in specials else [t])]) for r in done]


def writes_words(texts: list[str], vocabulary: set[str]) -> bool:
    """At least 12 words a prompt, and 70% of them words of the training text."""
    found = [w for text in texts for w in train_tiny.words(text)]
    return len(found) >= 12 * len(texts) and sum(w in vocabulary for w in found) >= 0.7 * len(found)


def test_the_default_model_is_a_nemotron_ld_checkpoint_in_the_real_format():
    path = default_model_dir()
    assert AppArgs().model_dir() == str(path) and AppArgs().model_name() == "tiny-docstrings"
    config = json.loads((path / "config.json").read_text())
    assert SPEC_KEYS <= set(config)
    assert (config["model_type"], config["mask_token_id"], config["block_size"]) == ("nemotron_labs_diffusion", 100, 32)
    layers = config["num_hidden_layers"]
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {f"encoder.layers.{i}.{m}.weight" for i in range(layers) for m in per_layer}
    expected |= {"encoder.embed_tokens.weight", "encoder.norm.weight", "diffusion_head.weight"}
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == expected
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
        assert f.get_slice("diffusion_head.weight").get_shape() == [config["vocab_size"], config["hidden_size"]]
    assert (path / "model.safetensors").stat().st_size < 8e6   # committed to the repository: a few MB
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == (1, 2, 100)
    assert len(tokenizer) == config["vocab_size"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat == "<s>[INST] Hi [/INST]"
    checkpoint = Checkpoint.read(path)   # our own reading of it
    assert checkpoint.config.canvas_length == 32 and checkpoint.config.dtype == "bfloat16"
    model = load_model(path, show_progress=False)
    assert model.kv_shape == (layers, config["num_key_value_heads"], config["head_dim"])


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_greedy_output_is_words_of_the_training_text(mode, corpus_words):
    texts = greedy_texts(default_model_dir(), mode)
    assert writes_words(texts, corpus_words), texts


def test_random_weights_fail_the_same_check(tmp_path, corpus_words):
    """The check can fail: the random-weight tiny checkpoint (same format) writes bytes and specials."""
    texts = greedy_texts(write_nemotron_ld(tmp_path / "random"), "diffusion")
    assert not writes_words(texts, corpus_words), texts


def test_train_tiny_writes_a_checkpoint_our_engine_serves(tmp_path):
    record = train_tiny.train(tmp_path, steps=2, batch_size=2, packages=["textwrap"], log_every=1)
    assert record["modules"] == 1 and record["steps"] == 2
    assert torch.isfinite(torch.tensor([record["final_ar_loss"], record["final_diffusion_loss"]])).all()
    with Engine(str(tmp_path), num_slots=1, max_model_len=128) as engine:
        done = engine.generate([[1, 400, 500]], DecodeParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(done[0].output) == 8
