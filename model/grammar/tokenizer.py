"""The served tokenizer as llguidance reads it: built from the checkpoint's own (transformers), over the
model's whole vocabulary, with the checkpoint's EOS ids as the ones that end a grammar's text."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llguidance
import llguidance.hf


def grammar_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """About a second for a vocabulary of 100k+ tokens: build it once per process."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
