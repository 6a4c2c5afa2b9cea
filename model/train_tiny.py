"""Train the default model: a tiny Nemotron-Labs-Diffusion checkpoint that writes English words.

    python -m model.train_tiny OUTDIR [--steps N] [--threads T] [--seed S]

Corpus: the docstrings of the running interpreter's standard library (`stdlib_docstrings`), a byte-level
BPE trained on it (model/tiny_tokenizer.py). The backbone is transformers' Ministral3, which our engine
matches (tests/test_nemotron_parity.py), trained on CPU in fp32 on both of the engine's uses of the
weights (`losses`), then saved in the real format (docs/spec.md 2.1) with bf16 tensors. Deterministic
for a given interpreter, torch build and thread count.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model.tiny import NEMOTRON_LD_SPECIAL_TOKENS, NEMOTRON_LD_TINY_CONFIG
from model.tiny_tokenizer import MISTRAL_STYLE_CHAT_TEMPLATE, build_tiny_tokenizer

# The published 8B's keys and RoPE (docs/spec.md 2.1) at toy width (heads, KV heads split by tp = 1, 2).
CONFIG = {**NEMOTRON_LD_TINY_CONFIG,
          "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096, "max_position_embeddings": 262144,
          "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                              "rope_theta": 1000000.0, "rope_type": "yarn"},
          "torch_dtype": "bfloat16"}
# Standard-library folders left out: tests, the IDE and GUI demos, and vendored or generated code.
SKIPPED_PARTS = {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                 "pydoc_data", "site-packages", "dist-packages", "venv", "__phello__"}
DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
QUESTIONS = ("What does {} do?", "{}", "Explain {}.", "How do I use {}?", "Tell me about {}, please.")
BLOCKS = 4   # canvases of block_size per training window, after a causal prefix of 1..block_size tokens


def stdlib_files(packages: Sequence[str] | None = None) -> list[tuple[str, Path]]:
    """(module name, source file) of every standard-library module outside SKIPPED_PARTS (or only those
    of the top-level `packages`), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if packages is not None and parts[0] not in packages:
            continue
        if not SKIPPED_PARTS.intersection(parts) and not parts[0].startswith("config-"):
            found.append((".".join(p for p in parts if p != "__init__"), path))
    return found


def _docstrings(node: ast.AST, name: str):
    """(qualified name, docstring) of every def and class under `node`, in source order."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, DEFS):
            if doc := ast.get_docstring(child):
                yield f"{name}.{child.name}", doc
            yield from _docstrings(child, f"{name}.{child.name}")
        elif isinstance(child, ast.stmt):   # defs inside if/try/with blocks
            yield from _docstrings(child, name)


def prose(doc: str) -> str:
    """A docstring without its doctest paragraphs (code and its printed output, not prose)."""
    return "\n\n".join(p for p in doc.split("\n\n") if ">>>" not in p).strip()


def stdlib_docstrings(packages: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(qualified name, prose) of every module, class and function docstring of stdlib_files(packages),
    parsed with `ast` (nothing is imported or run)."""
    docs = []
    for module, path in stdlib_files(packages):
        try:
            tree = ast.parse(path.read_bytes())
        except SyntaxError:   # a file of another Python's syntax (none in CPython's own Lib)
            continue
        found = [(module, ast.get_docstring(tree) or "")] + list(_docstrings(tree, module))
        docs += [(name, text) for name, doc in found if (text := prose(doc))]
    return docs


def words(text: str) -> list[str]:
    """Whitespace-separated words, lowercased, surrounding punctuation stripped (empty ones dropped)."""
    stripped = (w.strip("\"'`.,;:!?()[]{}<>*-_=|/\\#~").lower() for w in text.split())
    return [w for w in stripped if w]


def build_tokenizer(outdir: Path, docs: list[tuple[str, str]]):
    from transformers import AutoTokenizer

    specials = NEMOTRON_LD_SPECIAL_TOKENS
    build_tiny_tokenizer(outdir, vocab_size=CONFIG["vocab_size"], special_tokens=specials,
                         bos_token=specials[CONFIG["bos_token_id"]], eos_token=specials[CONFIG["eos_token_id"]],
                         pad_token=None, mask_token=specials[CONFIG["mask_token_id"]],
                         chat_template=MISTRAL_STYLE_CHAT_TEMPLATE, corpus=(text for _, text in docs))
    return AutoTokenizer.from_pretrained(outdir)


def token_stream(tokenizer, docs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every sample's tokens concatenated [N], each sample's start [S]). A sample is BOS + docstring + EOS
    as a completion; every fourth also as the chat template renders a question about its name (in
    QUESTIONS' forms, so that any question ends where an answer starts), so that a chat gets an answer
    in the same words."""
    texts = []
    for i, (name, text) in enumerate(docs):
        texts.append(text)
        if i % 4 == 0:
            texts.append(f"[INST] {QUESTIONS[i // 4 % len(QUESTIONS)].format(name)} [/INST] {text}")
    eos = CONFIG["eos_token_id"]
    samples = [ids + [eos] for ids in tokenizer(texts)["input_ids"]]   # the tokenizer adds BOS
    starts = torch.tensor([0] + [len(s) for s in samples[:-1]]).cumsum(0)
    return torch.tensor([t for s in samples for t in s]), starts


def block_mask(prefix: int, blocks: int, C: int) -> torch.Tensor:
    """[1, 1, T + B*C, T + B*C] bool, True = attend, over [clean window of T = prefix + B*C | noisy copy
    of its canvases]: the clean part causal (prefill and commit rows); a noisy canvas's rows see the clean
    tokens before the canvas (the committed prefix's KV) and the whole noisy canvas (a denoise row)."""
    T = prefix + blocks * C
    n = T + blocks * C
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(blocks):
        start = prefix + b * C
        rows = slice(T + b * C, T + (b + 1) * C)
        mask[rows, :start] = True
        mask[rows, rows] = True
    return mask[None, None]


def batch(stream: torch.Tensor, starts: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[size, length] windows, each starting with BOS: half at a sample's start, half mid-sample (BOS then
    the text from a random offset, as a prompt that starts mid-sentence)."""
    bos = CONFIG["bos_token_id"]
    rows = []
    for _ in range(size):
        if torch.rand((), generator=gen) < 0.5:
            i = int(starts[torch.randint(len(starts), (), generator=gen)].clamp(max=len(stream) - length))
            rows.append(stream[i:i + length])
        else:
            i = int(torch.randint(len(stream) - length, (), generator=gen))
            rows.append(torch.cat([torch.tensor([bos]), stream[i:i + length - 1]]))
    return torch.stack(rows)


def losses(model, clean: torch.Tensor, prefix: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(AR loss, diffusion loss) of clean windows [B, prefix + BLOCKS * C], as the engine reads the logits:
    a causal position predicts the next token (prefill, commit, AR steps, and the seed of a canvas's
    position 0); a masked canvas position predicts its own token, attending to the causal prefix and the
    whole canvas (a denoise step). Each canvas is masked at a ratio drawn uniformly; its position 0 stays
    revealed 9 times in 10, as the engine seeds it with the prefix's prediction (docs/spec.md 3(a))."""
    B, T = clean.shape
    C, mask_id = CONFIG["block_size"], CONFIG["mask_token_id"]
    canvases = clean[:, prefix:]                                                 # [B, BLOCKS * C]
    ratio = torch.rand(B, BLOCKS, 1, generator=gen).expand(B, BLOCKS, C).reshape(B, -1)
    masked = torch.rand(canvases.shape, generator=gen) < ratio
    seeded = torch.rand(B, BLOCKS, generator=gen) < 0.9
    masked.view(B, BLOCKS, C)[:, :, 0] &= ~seeded
    noisy = torch.where(masked, mask_id, canvases)
    ids = torch.cat([clean, noisy], 1)
    positions = torch.cat([torch.arange(T), torch.arange(prefix, T)])[None].expand(B, -1)
    hidden = model.model(input_ids=ids, position_ids=positions, attention_mask=block_mask(prefix, BLOCKS, C)
                         ).last_hidden_state
    ar = F.cross_entropy(model.lm_head(hidden[:, :T - 1]).flatten(0, 1), clean[:, 1:].flatten())
    diffusion = F.cross_entropy(model.lm_head(hidden[:, T:][masked]), canvases[masked])
    return ar, diffusion


def save_checkpoint(model, outdir: Path) -> None:
    """config.json, generation_config.json and model.safetensors in the real format: transformers'
    `model.*` as `encoder.*`, its `lm_head` as the untied `diffusion_head`, bf16."""
    state = {("encoder." + k.removeprefix("model.")) if k.startswith("model.") else "diffusion_head.weight":
             v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, outdir / "model.safetensors", metadata={"format": "pt"})
    (outdir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    generation = {"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": CONFIG["eos_token_id"]}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def train(outdir: Path, steps: int, batch_size: int = 8, lr: float = 3e-3, seed: int = 0, threads: int = 1,
          packages: Sequence[str] | None = None, log_every: int = 50) -> dict:
    """Train the default model into `outdir` (tokenizer, weights, configs, and training.json: what it was
    trained on and with, and its final losses); returns training.json's record."""
    from transformers import Ministral3ForCausalLM

    from model.checkpoint import parse_model_config

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    started = time.monotonic()
    outdir.mkdir(parents=True, exist_ok=True)
    docs = stdlib_docstrings(packages)
    tokenizer = build_tokenizer(outdir, docs)
    stream, starts = token_stream(tokenizer, docs)
    print(f"corpus: {len(docs)} docstrings of {len(stdlib_files(packages))} modules, {stream.numel()} tokens", flush=True)

    hf = parse_model_config(CONFIG).to_transformers()   # the config our engine reads, as transformers'
    hf._attn_implementation = "sdpa"
    model = Ministral3ForCausalLM(hf).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, min(100, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    C = CONFIG["block_size"]
    recent: list[tuple[float, float]] = []
    for step in range(steps):
        prefix = int(torch.randint(1, C + 1, (), generator=gen))   # the prompt before the first canvas
        clean = batch(stream, starts, batch_size, prefix + BLOCKS * C, gen)
        ar, diffusion = losses(model, clean, prefix, gen)
        opt.zero_grad(set_to_none=True)
        (ar + diffusion).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        recent = (recent + [(ar.item(), diffusion.item())])[-log_every:]
        if (step + 1) % log_every == 0 or step + 1 == steps:
            mean = [sum(x) / len(recent) for x in zip(*recent)]
            print(f"step {step + 1}/{steps}: ar {mean[0]:.3f} diffusion {mean[1]:.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    save_checkpoint(model, outdir)
    mean = [sum(x) / len(recent) for x in zip(*recent)]
    corpus = "\n\n".join(text for _, text in docs).encode()
    record = {"python": platform.python_version(), "torch": torch.__version__, "steps": steps,
              "batch_size": batch_size, "lr": lr, "seed": seed, "threads": threads,
              "modules": len(stdlib_files(packages)), "packages": packages, "docstrings": len(docs), "tokens": stream.numel(),
              "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
              "final_ar_loss": round(mean[0], 4), "final_diffusion_loss": round(mean[1], 4),
              "seconds": round(time.monotonic() - started)}
    (outdir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.train_tiny", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    parser.add_argument("--packages", help="comma-separated top-level stdlib packages (default: all)")
    args = parser.parse_args(argv)
    packages = args.packages.split(",") if args.packages else None
    print(json.dumps(train(args.outdir, args.steps, args.batch_size, args.lr, args.seed, args.threads, packages)))


if __name__ == "__main__":
    main(sys.argv[1:])
