"""DiffusionGemma against transformers' own DiffusionGemmaForBlockDiffusion holding the same tiny
checkpoint (fp32, docs/spec.md 2.2 and 4.9): causal prefill / commit logits (the encoder, plus the tied head
and softcap) and bidirectional denoise logits (the decoder, with and without self-conditioning, its
sliding layers windowed from the canvas start), through our per-slot cache and step context; and a
whole generation against transformers' generate drawing our noise."""
from __future__ import annotations

import pytest
import torch

from model.attention import PagedKVCache, StepContext, step_context
from model.checkpoint import parse_model_config
from model.families import FAMILIES
from model.config import DiffusionGemmaConfig, RenoiseDefaults, load_generation_defaults
from model.loader import expected_tensors, load_model
from model.sampling.stats import unscaled
from tests.reference import gemma_generate_with_our_draws

TOL = 1e-4
V, C, W = 997, 16, 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from model.tiny import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("tiny-diffusion-gemma"), seed=0, shards=2)


@pytest.fixture(scope="module")
def ours(tiny_dir):
    return load_model(tiny_dir, show_progress=False)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(tiny_dir, attn_implementation="eager").eval()


# --------------------------------------------------------------------------------------------------
# transformers' side: encoder calls write its DynamicCache (sliding layers keep W - 1 tokens), decoder
# calls read it

def ref_cache(ref):
    from transformers import DynamicCache

    return DynamicCache(config=ref.config.get_text_config(decoder=True))


def ref_encode(ref, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Causal logits of ids at positions [start, start + n), appended to cache: softcap(head(encoder))."""
    with torch.no_grad():
        out = ref.model.encoder(input_ids=ids[None], past_key_values=cache,
                                position_ids=torch.arange(start, start + len(ids))[None])
        cap = ref.config.text_config.final_logit_softcapping
        return (torch.tanh(ref.lm_head(out.last_hidden_state).float() / cap) * cap)[0]


def ref_denoise(ref, cache, canvas: torch.Tensor, sc_logits: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        sc = None if sc_logits is None else sc_logits[None]
        return ref(decoder_input_ids=canvas[None], past_key_values=cache, self_conditioning_logits=sc).logits[0]


# --------------------------------------------------------------------------------------------------
# ours: one batched forward of (slot, start, causal, tokens, soft | None) rows

def new_cache(model, slots: int = 4, max_len: int = 128) -> PagedKVCache:
    return PagedKVCache.per_slot(model.kv_layer_shapes, slots, max_len, torch.float32, "cpu")


def run(model, kv, rows, window: int | None = None) -> torch.Tensor:
    width = max(len(r[3]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    soft = None
    if any(r[4] is not None for r in rows):
        soft = torch.zeros(len(rows), width, model.config.hidden_size, dtype=next(model.parameters()).dtype)
    for b, (_, _, _, tokens, s) in enumerate(rows):
        ids[b, : len(tokens)] = torch.as_tensor(tokens)
        if s is not None:
            soft[b, : len(tokens)] = s
    starts = [r[1] for r in rows]
    positions = torch.tensor(starts)[:, None] + torch.arange(width)[None]
    ctx = StepContext.build(kv, [r[0] for r in rows], starts, [len(r[3]) for r in rows], [r[2] for r in rows],
                            width, "cpu", window=window or model.sliding_window)
    with step_context(ctx), torch.no_grad():
        return unscaled(model.head_logits(model(ids, positions, soft)), model.logit_softcap)


def soft_of(model, sc_logits: torch.Tensor) -> torch.Tensor:
    """Our self-conditioning input from the logits transformers takes: softmax @ W * sqrt(H)."""
    with torch.no_grad():
        return model.soft_embedding(torch.softmax(sc_logits, dim=-1))


def tokens(gen, n):
    return torch.randint(0, V, (n,), generator=gen)


# --------------------------------------------------------------------------------------------------

def test_config_reads_the_tiny_checkpoint(tiny_dir, ours):
    cfg = ours.config
    assert isinstance(cfg, DiffusionGemmaConfig) and FAMILIES[cfg.model_type].name == "diffusion-gemma"
    assert cfg.layer_type_list == ("sliding_attention", "sliding_attention", "full_attention")
    assert [cfg.layer_head_dim(i) for i in range(3)] == [16, 16, 32]
    assert [cfg.layer_num_kv_heads(i) for i in range(3)] == [2, 2, 1]
    assert (cfg.canvas_length, cfg.sliding_window, cfg.final_logit_softcapping) == (C, W, 30.0)
    assert cfg.mask_token_id is None and cfg.eos_token_ids == (1, 5) and cfg.vocab_size == V
    knobs = RenoiseDefaults.from_generation(load_generation_defaults(tiny_dir))
    assert (knobs.max_denoising_steps, knobs.entropy_bound, knobs.stability_threshold) == (12, 0.1, 1)
    assert (tiny_dir / "model.safetensors.index.json").is_file()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (len(tok), tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (V, 0, 1, 2)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_config_of_the_published_26b_shapes():
    """The 26B-A4B's text config spelled with global_head_dim / num_global_key_value_heads (no
    per_layer_config), transformers' defaults for absent keys; null generation knobs take the defaults."""
    text = {"model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816,
            "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
            "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "sliding_window": 1024, "use_bidirectional_attention": "vision",
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}
    cfg = parse_model_config({"model_type": "diffusion_gemma", "text_config": text, "vision_config": {},
                              "canvas_length": 256, "torch_dtype": "bfloat16"})
    kinds = cfg.layer_type_list
    assert kinds.count("full_attention") == 5 and kinds[5] == kinds[-1] == "full_attention"
    assert (cfg.layer_head_dim(0), cfg.layer_num_kv_heads(0)) == (256, 8)
    assert (cfg.layer_head_dim(5), cfg.layer_num_kv_heads(5)) == (512, 2)
    for tp in (1, 2, 4, 8):
        cfg.check_tensor_parallel(tp)  # 2 full-layer KV heads replicated at tp 4 and 8
    with pytest.raises(ValueError, match="num_attention_heads=16"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        parse_model_config({"model_type": "diffusion_gemma",
                            "text_config": text | {"use_bidirectional_attention": "all"}})
    from model.config import GenerationDefaults

    nulls = GenerationDefaults.model_validate({"max_denoising_steps": None, "sampler_config": None, "t_min": None})
    assert RenoiseDefaults.from_generation(nulls) == RenoiseDefaults()
    with pytest.raises(ValueError, match="t_max"):
        RenoiseDefaults.from_generation(GenerationDefaults.model_validate({"t_min": 0.9, "t_max": 0.8}))


def test_loader_skips_vision_and_tied_copies(tiny_dir, ours):
    from safetensors import safe_open

    names = set()
    for f in tiny_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            names |= set(h.keys())
    expected = expected_tensors(ours)
    assert any("vision_tower" in n for n in names) and not any("vision" in n for n in expected)
    assert "model.decoder.layers.2.self_attn.k_proj.weight" in expected           # K = V: no v_proj
    assert "model.decoder.layers.2.self_attn.v_proj.weight" not in expected
    assert "model.encoder.language_model.layers.0.layer_scalar" in expected
    layers = ours.model
    assert not torch.equal(layers.encoder.language_model.layers[0].layer_scalar, layers.decoder.layers[0].layer_scalar)


def test_prefill_denoise_commit_match_transformers(ours, ref):
    """A request's life: prefill, two denoise steps (no self-conditioning, then with it), commit, and a
    denoise step of the next canvas, whose sliding layers now see only the last W - 1 committed keys."""
    gen = torch.Generator().manual_seed(1)
    P = 20
    prompt, canvas1, canvas2, final = tokens(gen, P), tokens(gen, C), tokens(gen, C), tokens(gen, C)
    sc1, sc2 = torch.randn(C, V, generator=gen) * 3, torch.randn(C, V, generator=gen) * 3
    cache, kv = ref_cache(ref), new_cache(ours)

    expected = ref_encode(ref, cache, prompt, 0)
    got = run(ours, kv, [(1, 0, True, prompt, None)])[0]
    assert (got - expected).abs().max() < TOL and expected.std() > 1.0

    first = ref_denoise(ref, cache, canvas1)
    assert (run(ours, kv, [(1, P, False, canvas1, None)])[0] - first).abs().max() < TOL
    second = ref_denoise(ref, cache, canvas2, sc1)
    assert (run(ours, kv, [(1, P, False, canvas2, soft_of(ours, sc1))])[0] - second).abs().max() < TOL
    assert (second - ref_denoise(ref, cache, canvas2)).abs().max() > 1e-1  # self-conditioning matters

    expected = ref_encode(ref, cache, final, P)                            # commit: causal at P..P+C
    assert (run(ours, kv, [(1, P, True, final, None)])[0] - expected).abs().max() < TOL

    expected = ref_denoise(ref, cache, canvas1, sc2)                       # next canvas at P + C
    got = run(ours, kv, [(1, P + C, False, canvas1, soft_of(ours, sc2))])[0]
    assert (got - expected).abs().max() < TOL
    # the window is live: without it the sliding layers would see the whole prefix
    unwindowed = run(ours, kv, [(1, P + C, False, canvas1, soft_of(ours, sc2))], window=10_000)[0]
    assert (unwindowed - expected).abs().max() > 1e-2


def test_mixed_rows_in_one_forward_match_transformers(ours, ref):
    """prefill, commit and two denoise rows (one on its first step, one self-conditioned) of different
    slots and lengths in one forward: causal rows skip self-conditioning and use the encoder's layer
    scalars, denoise rows the decoder's."""
    gen = torch.Generator().manual_seed(2)
    # pa is short: its padding queries lie more than W past its last token
    pa, pb, pc, pd = tokens(gen, 3), tokens(gen, 30), tokens(gen, 5), tokens(gen, 14)
    cb, cc, cd = tokens(gen, C), tokens(gen, C), tokens(gen, C)
    sc_d = torch.randn(C, V, generator=gen) * 2
    kv = new_cache(ours, slots=4)
    run(ours, kv, [(1, 0, True, pb, None), (2, 0, True, pc, None), (3, 0, True, pd, None)])
    logits = run(ours, kv, [(0, 0, True, pa, None), (1, 30, False, cb, None), (2, 5, True, cc, None),
                            (3, 14, False, cd, soft_of(ours, sc_d))])
    assert torch.isfinite(logits).all()
    caches = [ref_cache(ref) for _ in range(4)]
    assert (logits[0, :3] - ref_encode(ref, caches[0], pa, 0)).abs().max() < TOL
    ref_encode(ref, caches[1], pb, 0)
    assert (logits[1] - ref_denoise(ref, caches[1], cb)).abs().max() < TOL
    ref_encode(ref, caches[2], pc, 0)
    assert (logits[2] - ref_encode(ref, caches[2], cc, 5)).abs().max() < TOL
    ref_encode(ref, caches[3], pd, 0)
    assert (logits[3] - ref_denoise(ref, caches[3], cd, sc_d)).abs().max() < TOL


def test_paged_sliding_layers_that_give_back_pages_behind_the_window_equal_every_page_kept(tiny_dir):
    """Pages of 4 positions in shuffled order, and the sliding layers' pages wholly behind the window of
    the step's earliest row given back (their table entries the sink, as the scheduler does), give the
    logits of every page kept in order, over a prefill longer than the window and canvases that carry
    the window on, with rows of two slots denoising and committing together. In float64: the two attend
    to the same keys in another order, so they differ by rounding only (a wrong key would be O(1))."""
    ours = load_model(tiny_dir, dtype=torch.float64, show_progress=False)
    W, C, P, max_len = ours.sliding_window, ours.config.canvas_length, 4, 160
    layout = ours.kv_layout
    in_order = PagedKVCache.per_slot(ours.kv_layer_shapes, 2, max_len, torch.float64, "cpu", page_size=P)
    kinds = sorted(set(layout.sliding))
    paged = PagedKVCache(list(layout.shapes), [kinds.index(x) for x in layout.sliding], [100, 100],
                         layout.group_windows, 2, max_len, torch.float64, "cpu", page_size=P)
    assert paged.windows == [None, W]
    order = torch.randperm(100, generator=torch.Generator().manual_seed(3))   # slot s's page i: order[s * 40 + i]
    gen = torch.Generator().manual_seed(7)
    p0, p1 = tokens(gen, 3 * W + 2), tokens(gen, 5)
    steps = [[(0, 0, True, p0, None)], [(1, 0, True, p1, None)]]
    starts = [len(p0), len(p1)]
    for _ in range(4):   # per canvas: two denoise steps of both slots, then both commit
        canvases = [tokens(gen, C), tokens(gen, C)]
        steps.append([(s, starts[s], False, canvases[s], None) for s in (0, 1)])
        steps.append([(s, starts[s], False, tokens(gen, C),
                       torch.randn(C, ours.config.hidden_size, generator=gen, dtype=torch.float64)) for s in (0, 1)])
        steps.append([(s, starts[s], True, canvases[s], None) for s in (0, 1)])
        starts = [n + C for n in starts]
    released = 0
    for rows in steps:
        for slot, start, *_ in rows:
            for group in (0, 1):
                pages = order[slot * 40: slot * 40 + paged.max_pages].clone()
                if group == 1:   # behind every query of this step's window: given back
                    behind = torch.arange(paged.max_pages) < max(start - W + 1, 0) // P
                    pages[behind] = -1
                    released = max(released, int(behind.sum()))
                flat = slot * paged.max_pages + torch.arange(paged.max_pages)
                paged.write_pages(group, flat, pages)
        a, b = run(ours, in_order, rows), run(ours, paged, rows)
        assert (a - b).abs().max() < 1e-10
    assert released >= 3   # the test did give pages back


def test_sliding_window_masks():
    """Causal rows: keys (q - W, q]; a denoise row: the last W - 1 prefix keys and the whole canvas."""

    kv = PagedKVCache.per_slot([(1, 4)], 2, 40, torch.float32, "cpu")
    ctx = StepContext.build(kv, [0, 1], [10, 12], [6, 6], [True, False], 6, "cpu", window=4)
    causal, bidir = ctx.window_mask[0, 0], ctx.window_mask[1, 0]
    for i in range(6):
        assert causal[i].nonzero().flatten().tolist() == list(range(10 + i - 3, 10 + i + 1))
        assert bidir[i].nonzero().flatten().tolist() == list(range(12 - 3, 12 + 6))
    assert ctx.causal_rows.tolist() == [True, False]
    assert torch.equal(StepContext.build(kv, [0], [10], [6], [True], 6, "cpu").mask, ctx.mask[:1, ..., :16])


def test_generation_matches_transformers_generate_with_our_draws(ours, ref, monkeypatch):
    """End to end, the loop the runner will run: prefill; per canvas, uniform random tokens, denoise
    steps (renoise_step, self-conditioning from the previous step, reset per canvas) until converged,
    then a causal commit of the argmax canvas. transformers' generate draws through our counter-based
    noise (its torch.multinomial and torch.randint replaced); both must emit the same tokens."""
    from model.sampling import renoise as RN

    N, canvases, seed = 6, 2, torch.tensor([77])
    # a random model's argmax never settles, so early stopping here comes from confidence alone
    # (stability 0); stability streaks are checked against transformers in tests/test_renoise.py
    knobs = dict(t_min=0.4, t_max=0.8, entropy_bound=0.5, stability_threshold=0, confidence_threshold=0.9)
    prompt = tokens(torch.Generator().manual_seed(3), 20)

    # ours
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)  # noqa: E731
    kv, length, counter, emitted, steps_taken = new_cache(ours), len(prompt), 0, [], []
    run(ours, kv, [(0, 0, True, prompt, None)])
    for _ in range(canvases):
        canvas = RN.random_tokens(seed, one(counter, torch.int64), C, V)[0]
        counter += 1
        prev, streak, soft = torch.full((1, C), -1), torch.zeros(1, dtype=torch.int64), None
        for n in range(N):
            logits = run(ours, kv, [(0, length, False, canvas, soft)])
            step = RN.renoise_step(
                logits, n=one(n, torch.int64), steps=one(N, torch.int64), t_min=one(knobs["t_min"]),
                t_max=one(knobs["t_max"]), entropy_bound=one(knobs["entropy_bound"]),
                stability_threshold=one(knobs["stability_threshold"], torch.int64),
                confidence_threshold=one(knobs["confidence_threshold"]), seed=seed,
                counter=one(counter, torch.int64), prev_argmax=prev, run=streak, vocab_start=0, vocab_size=V,
                tp=ours.tp)
            counter += 1
            with torch.no_grad():
                soft = ours.soft_embedding(step.probs)[0]
            canvas, prev, streak = step.canvas[0], step.argmax, step.run
            if step.converged[0]:
                break
        steps_taken.append(n + 1)
        run(ours, kv, [(0, length, True, prev[0], None)])          # commit: the argmax canvas, causal
        emitted += prev[0].tolist()
        length += C

    # transformers, drawing our noise in the same order
    out, draws = gemma_generate_with_our_draws(ref, prompt, seed, N, canvases, knobs, monkeypatch)
    assert draws == counter
    assert out == emitted
    assert min(steps_taken) < N  # a canvas stopped early (confidence), not only at the step limit
