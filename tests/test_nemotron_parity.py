"""Nemotron-Labs-Diffusion against transformers' Ministral3ForCausalLM holding the same weights (fp32)."""
import pytest
import torch

from model.loader import load_model
from tests.reference import canvas_mask, hf_ministral3
from tests.tp_harness import new_cache
from tests.tp_harness import run_rows as run

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_nemotron):
    return load_model(tiny_nemotron, show_progress=False), hf_ministral3(tiny_nemotron)


def test_causal_logits_match_transformers(models):
    ours, ref = models
    # 150 positions: the Llama-4 query scale steps at multiples of original_max_position_embeddings (64).
    ids = torch.randint(0, 997, (150,), generator=torch.Generator().manual_seed(1))
    expected = ref(ids[None]).logits[0]
    got = run(ours, new_cache(ours), [(0, 0, True)], [ids.tolist()])[0]
    assert (got - expected).abs().max() < TOL
    assert expected.std() > 1.0  # peaked enough that the comparison means something


def test_canvas_logits_match_transformers_with_4d_mask(models):
    ours, ref = models
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 997, (70,), generator=gen)
    canvas = torch.randint(0, 997, (32,), generator=gen)
    canvas[5:20] = 100  # masks, as in a real canvas
    full = torch.cat([prompt, canvas])
    with torch.no_grad():
        expected = ref(full[None], attention_mask=canvas_mask(70, 32)).logits[0, 70:]
    kv = new_cache(ours)
    run(ours, kv, [(1, 0, True)], [prompt.tolist()])                     # prefill writes the prefix
    got = run(ours, kv, [(1, 70, False)], [canvas.tolist()])[0]          # denoise over it
    assert (got - expected).abs().max() < TOL
    # and bidirectional really differs from causal here
    causal = ref(full[None]).logits[0, 70:]
    assert (causal - expected).abs().max() > 1e-2


def test_mixed_step_kinds_in_one_batch_match_transformers(models):
    """prefill, denoise and commit rows of different slots and lengths in one forward."""
    ours, ref = models
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randint(0, 997, (40,), generator=gen)
    p1 = torch.randint(0, 997, (90,), generator=gen)
    c1 = torch.randint(0, 997, (32,), generator=gen)
    p2 = torch.randint(0, 997, (20,), generator=gen)
    c2 = torch.randint(0, 997, (32,), generator=gen)
    kv = new_cache(ours)
    run(ours, kv, [(1, 0, True), (2, 0, True)], [p1.tolist(), p2.tolist()])
    logits = run(ours, kv, [(0, 0, True), (1, 90, False), (2, 20, True)],
                 [p0.tolist(), c1.tolist(), c2.tolist()])
    with torch.no_grad():
        e0 = ref(p0[None]).logits[0]
        e1 = ref(torch.cat([p1, c1])[None], attention_mask=canvas_mask(90, 32)).logits[0, 90:]
        e2 = ref(torch.cat([p2, c2])[None]).logits[0, 20:]
    assert (logits[0, :40] - e0).abs().max() < TOL
    assert (logits[1, :32] - e1).abs().max() < TOL
    assert (logits[2, :32] - e2).abs().max() < TOL
