"""Drafts on the wire (`diffusion.stream_drafts`): a canvas being denoised, as SSE comment lines.

    : draft {"object": "draft", "id": ..., "canvas": 1, "offset": 32, "step": 8, "tokens": [...], ...}

Why comments: the `openai` client yields every SSE event that carries data, a named `event: draft`
included, as a chunk of the response type (a Completion whose `choices` is None: `chunk.choices[0]`
raises), and an extra field would need extra chunks, which every client counts as output (and a
TTFT measured at the first chunk would move). A comment line (`:` first) is ignored by every
conforming SSE parser (WHATWG's event-stream rules; the openai client's decoder, browsers'
EventSource), so clients that did not opt in see exactly the chunks they see without drafts, while a
client that wants drafts reads lines starting with `: draft ` (the playground does).

A draft's fields:
    index            the choice it belongs to, as the chunks' `index`
    canvas, offset   which canvas of the output (0-based) and the output index of its first position
    step             denoising steps of the canvas so far
    tokens           per position: the token id, null where masked
    cells            per position: the token's text, null where masked
    text             the canvas's text, PLACEHOLDER for each masked position
    known            per position: revealed (masked diffusion) or accepted by the entropy bound at this
                     step (DiffusionGemma, whose uniform-noise canvas has no mask: the draft shows the
                     argmax canvas, what a commit would emit)
    revealed         positions known now that were not known at the previous draft of this canvas
"""
from __future__ import annotations

import json

from deployments.output import token_piece
from workers.request import CanvasDraft

PLACEHOLDER = "\u2591"   # light shade: a masked position in a draft's text
PREFIX = ": draft "


def draft_payload(tokenizer, draft: CanvasDraft, chunk_id: str, mask_id: int | None, canvas_length: int,
                  index: int = 0) -> dict:
    """`index`: the choice the draft belongs to (a request with n > 1 or several prompts)."""
    masked = [t == mask_id for t in draft.tokens]
    pieces, run = [], []
    for t, m in zip(draft.tokens, masked):   # runs of unmasked tokens decode together (spacing, bytes)
        if m:
            pieces += [_decode(tokenizer, run), PLACEHOLDER]
            run = []
        else:
            run.append(t)
    pieces.append(_decode(tokenizer, run))
    return {"object": "draft", "id": chunk_id, "index": index, "canvas": draft.offset // canvas_length,
            "offset": draft.offset, "step": draft.step,
            "tokens": [None if m else t for t, m in zip(draft.tokens, masked)],
            "cells": [None if m else token_piece(tokenizer, t)[0] for t, m in zip(draft.tokens, masked)],
            "text": "".join(pieces), "known": draft.known, "revealed": draft.revealed}


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) if ids else ""


def draft_event(payload: dict) -> str:
    """One SSE comment line (JSON escapes newlines, so the payload stays on it), then the blank line."""
    return PREFIX + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"
