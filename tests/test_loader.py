"""Checkpoint loading (model/loader.py): sharded and single-file checkpoints, mismatch errors that name
the tensors, dummy weights, progress bar, dtype and load_format validation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.loader import checkpoint_files, load_model, load_weights
from model.tiny import write_nemotron_ld
from tests.tp_harness import new_cache, run_rows

INDEX = "model.safetensors.index.json"


def logits_of(model) -> torch.Tensor:
    ids = torch.randint(0, 997, (2, 40), generator=torch.Generator().manual_seed(5))
    kv = new_cache(model, slots=2, max_len=64)
    return run_rows(model, kv, [(0, 0, True), (1, 0, False)], ids.tolist())


@pytest.fixture(scope="module")
def reference(tiny_nemotron):
    model = load_model(tiny_nemotron, show_progress=False)
    return model, logits_of(model)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(model_dir: Path, edit) -> None:
    """Apply edit(name -> tensor dict) to the shard holding tensors, and fix the index json."""
    files = checkpoint_files(model_dir)
    index = json.loads((model_dir / INDEX).read_text())
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        edited = edit(dict(tensors))
        if edited.keys() != tensors.keys() or any(edited[n] is not tensors[n] for n in edited):
            save_file(edited, file, metadata={"format": "pt"})
            for name in set(tensors) - set(edited):
                del index["weight_map"][name]
            for name in set(edited) - set(tensors):
                index["weight_map"][name] = file.name
    (model_dir / INDEX).write_text(json.dumps(index, indent=2))


# --- sharded vs single file ------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 3])
def test_sharded_and_single_file_checkpoints_load_the_same(tmp_path, reference, shards):
    model_dir = write_nemotron_ld(tmp_path / f"shards{shards}", seed=0, shards=shards)
    assert (model_dir / INDEX).is_file() == (shards > 1)
    assert len(list(model_dir.glob("*.safetensors"))) == shards
    ref_model, ref_logits = reference  # the session checkpoint: 2 shards, same seed
    model = load_model(model_dir, show_progress=False)
    ref_state = ref_model.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, ref_state[name]), name
    assert torch.equal(logits_of(model), ref_logits)


def test_a_different_seed_gives_different_logits(tmp_path, reference):
    model = load_model(write_nemotron_ld(tmp_path / "seed1", seed=1, shards=1), show_progress=False)
    assert (logits_of(model) - reference[1]).abs().max() > 1e-2


# --- mismatches ------------------------------------------------------------------------------------

def test_missing_tensor_is_named(tmp_path, tiny_nemotron):
    model_dir = copy_checkpoint(tiny_nemotron, tmp_path / "ckpt")
    gone = "encoder.layers.1.mlp.up_proj.weight"
    rewrite(model_dir, lambda t: {n: v for n, v in t.items() if n != gone})
    assert gone not in checkpoint_files(model_dir)
    with pytest.raises(ValueError, match="missing tensors") as err:
        load_model(model_dir, show_progress=False)
    msg = str(err.value)
    assert gone in msg
    assert "missing tensors (1)" in msg and "unexpected" not in msg
    assert "encoder.layers.0.mlp.up_proj.weight" not in msg


def test_renamed_tensor_names_missing_and_unexpected(tmp_path, tiny_nemotron):
    model_dir = copy_checkpoint(tiny_nemotron, tmp_path / "ckpt")
    old, new = "encoder.layers.0.self_attn.k_proj.weight", "encoder.layers.0.self_attn.key_proj.weight"
    rewrite(model_dir, lambda t: {(new if n == old else n): v for n, v in t.items()})
    with pytest.raises(ValueError) as err:
        load_model(model_dir, show_progress=False)
    msg = str(err.value)
    missing, unexpected = (line for line in msg.splitlines()[1:])
    assert "missing tensors (1)" in missing and old in missing
    assert "unexpected tensors (1)" in unexpected and new in unexpected


def test_wrong_shape_names_the_tensor(tmp_path, tiny_nemotron):
    model_dir = copy_checkpoint(tiny_nemotron, tmp_path / "ckpt")
    name = "encoder.layers.1.self_attn.o_proj.weight"
    rewrite(model_dir, lambda t: {n: (v[:, :-16].contiguous() if n == name else v) for n, v in t.items()})
    with pytest.raises(ValueError, match="shape mismatch") as err:
        load_model(model_dir, show_progress=False)
    assert str(err.value).startswith(name + ":")


def test_rotary_inv_freq_in_a_checkpoint_is_ignored(tmp_path, tiny_nemotron, reference):
    model_dir = copy_checkpoint(tiny_nemotron, tmp_path / "ckpt")
    extra = "encoder.layers.0.self_attn.rotary_emb.inv_freq"
    rewrite(model_dir, lambda t: t if extra in t or "encoder.norm.weight" not in t else {**t, extra: torch.ones(8)})
    assert extra in checkpoint_files(model_dir)
    assert torch.equal(logits_of(load_model(model_dir, show_progress=False)), reference[1])


def test_no_safetensors_is_an_error(tmp_path, tiny_nemotron):
    model_dir = tmp_path / "empty"
    model_dir.mkdir()
    shutil.copy(tiny_nemotron / "config.json", model_dir)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(model_dir, show_progress=False)


# --- dummy weights ---------------------------------------------------------------------------------

def test_dummy_load_format_needs_no_safetensors(tmp_path, tiny_nemotron):
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    shutil.copy(tiny_nemotron / "config.json", model_dir)
    model = load_model(model_dir, load_format="dummy", show_progress=False)
    params = dict(model.named_parameters())
    assert params, "no parameters"
    for name, p in params.items():
        assert not p.isnan().any(), name
        if p.dim() == 1:
            assert "norm" in name and torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, f"{name}: std {p.std().item():.4f}"
            assert abs(p.mean().item()) < 0.002, name
    # the same seed gives the same weights, another seed different ones
    again = load_model(model_dir, load_format="dummy", show_progress=False)
    other = load_model(model_dir, load_format="dummy", show_progress=False, seed=1)
    w = "encoder.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(dict(again.named_parameters())[w], params[w])
    assert not torch.equal(dict(other.named_parameters())[w], params[w])
    logits = logits_of(model)  # and it runs
    assert torch.isfinite(logits).all()


# --- progress, dtype, load_format ------------------------------------------------------------------

def test_progress_bar_enabled_and_disabled(tiny_nemotron, reference, capsys):
    quiet = load_model(tiny_nemotron, show_progress=False)
    captured = capsys.readouterr()
    assert "loading" not in captured.err + captured.out
    assert torch.equal(logits_of(quiet), reference[1])
    load_model(tiny_nemotron, show_progress=True)
    captured = capsys.readouterr()
    assert f"loading {Path(tiny_nemotron).name}" in captured.err


def test_load_weights_into_a_built_model_without_progress(tiny_nemotron, reference):
    ref_model, ref_logits = reference
    model = load_model(tiny_nemotron, load_format="dummy", show_progress=False)
    assert not torch.equal(logits_of(model), ref_logits)
    load_weights(model, tiny_nemotron, show_progress=False)
    assert torch.equal(logits_of(model), ref_logits)


def test_bfloat16(tiny_nemotron, reference):
    ref_model, ref_logits = reference
    model = load_model(tiny_nemotron, dtype="bfloat16", show_progress=False)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, ref_params[name].to(torch.bfloat16)), name
    assert all(p.dtype == torch.float32 for p in ref_model.parameters())  # config's torch_dtype: float32
    assert load_model(tiny_nemotron, dtype=torch.bfloat16, show_progress=False).diffusion_head.weight.dtype \
        == torch.bfloat16
    logits = logits_of_dtype(model, torch.bfloat16)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref_logits).abs().max() < 0.03 * ref_logits.abs().max()  # bf16 rounding only


def logits_of_dtype(model, dtype):
    ids = torch.randint(0, 997, (2, 40), generator=torch.Generator().manual_seed(5))
    kv = new_cache(model, slots=2, max_len=64, dtype=dtype)
    return run_rows(model, kv, [(0, 0, True), (1, 0, False)], ids.tolist())


@pytest.mark.parametrize("kwargs, named", [
    ({"load_format": "pt"}, "'pt'"),
    ({"load_format": "gguf"}, "'gguf'"),
    ({"dtype": "float64"}, "'float64'"),
    ({"dtype": "fp8"}, "'fp8'"),
])
def test_unsupported_load_format_or_dtype(tiny_nemotron, kwargs, named):
    with pytest.raises(ValueError, match=named) as err:
        load_model(tiny_nemotron, show_progress=False, **kwargs)
    key = next(iter(kwargs))
    assert key in str(err.value) and "supported" in str(err.value)
