"""Random prompts of given token lengths (one for all, or one per prompt) for `serve_bench`.

With a tokenizer (the model's, loaded offline) a prompt is text whose re-tokenization has exactly the
asked-for number of tokens, so it works against any OpenAI-compatible server. Without one, a prompt
is a list of random token ids, which completions endpoints that take token ids (dllm-serve, vLLM)
accept as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Token ids below this exist in every vocabulary the project serves: the tiny checkpoints have 997
# tokens, real ones far more. `--random-vocab-size` widens it for a server known to have more.
FALLBACK_VOCAB = 997


@dataclass(frozen=True)
class Prompts:
    prompts: list            # str (text) or list[int] (token ids), one per request
    lens: list[int]          # tokens in each prompt as we count them (the server's count is in usage)
    source: str              # what a reader of the report needs to know about how they were made


def load_tokenizer(name: str | None):
    """The tokenizer at a path or a cached hub name, never downloaded; None if there is none."""
    if not name:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):  # not a local directory nor in the hub cache
        return None


def text_prompts(tokenizer, n: int, length: int | list[int], rng: np.random.Generator) -> Prompts:
    """Random tokens decoded to text, re-tokenized and corrected until the text has exactly `length`
    tokens (merges across token boundaries shorten it: more tokens are appended; a longer one is cut).
    `length` is one for all, or one per prompt."""
    pool = _round_trip_tokens(tokenizer)
    wanted = _lengths(n, length)
    prompts, lens = [], []
    for k in wanted:
        ids = rng.choice(pool, k).tolist()
        for _attempt in range(20):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == k:
                break
            ids = ids[:k] if len(ids) > k else ids + rng.choice(pool, k - len(ids)).tolist()
        else:
            text = tokenizer.decode(ids)  # the last correction, unchecked: its length is measured below
        prompts.append(text)
        lens.append(len(tokenizer.encode(text, add_special_tokens=False)))
    exact = lens == wanted
    note = f"exactly {_span(wanted)}" if exact else f"{_span(lens)} (asked {_span(wanted)})"
    return Prompts(prompts, lens, f"text, {note} tokens each by the tokenizer `{tokenizer.name_or_path}` "
                                  "(the server may add special tokens)")


def _lengths(n: int, length: int | list[int]) -> list[int]:
    if isinstance(length, int):
        return [length] * n
    if len(length) != n:
        raise ValueError(f"{len(length)} lengths for {n} prompts")
    return list(length)


def _span(lens: list[int]) -> str:
    """"16" when every length is 16, else "16..300"."""
    lo, hi = min(lens), max(lens)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _round_trip_tokens(tokenizer) -> np.ndarray:
    """Ids of the learned vocabulary (not added: special, control or reserved tokens) that decode to
    text that encodes back to exactly themselves. A lone byte-level token of a multi-byte character
    decodes to U+FFFD, which re-encodes as other tokens."""
    added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in added]
    texts = tokenizer.batch_decode([[i] for i in ids])
    back = tokenizer(texts, add_special_tokens=False).input_ids
    pool = [i for i, b in zip(ids, back) if b == [i]]
    assert pool, f"no token of {tokenizer.name_or_path} survives decode -> encode"
    return np.array(pool)


def token_id_prompts(n: int, length: int | list[int], vocab: int, rng: np.random.Generator) -> Prompts:
    wanted = _lengths(n, length)
    if isinstance(length, int):  # one draw of the whole matrix: the prompts a fixed length always gave
        ids = rng.integers(0, vocab, size=(n, length)).tolist()
    else:
        ids = [rng.integers(0, vocab, size=k).tolist() for k in wanted]
    return Prompts(ids, wanted, f"token ids, {_span(wanted)} each, uniform over [0, {vocab}) "
                                "(no tokenizer: pass --tokenizer for text prompts)")
