"""A request's prompt as token ids, without letting one request stall the API.

Text is tokenized in a worker thread (the tokenizers library releases the GIL: the event loop keeps
answering other requests meanwhile), and only after a character bound: a text longer than any prompt
of `max_model_len` tokens can be is a 400 at once, never tokenized. The bound is
`max_model_len x chars_per_token`, where chars_per_token is twice the longest entry of the vocabulary
(in characters; a token's text is never longer than its entry, byte-level entries being one character
a byte): the factor of 2 leaves room for normalizers that drop characters (e.g. accents). A chat's
bound counts its messages' characters, which its templated prompt only adds to.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from deployments.errors import APIError


class PromptTokenizer:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        self.chars_per_token = 2 * max(longest, 1)
        self.max_chars = max_model_len * self.chars_per_token

    async def text(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self._check_chars(len(text), param)
        return await asyncio.to_thread(
            lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids))

    async def chat(self, messages: list[dict], param: str, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, add_special_tokens: bool = False,
                   tools: list[dict] | None = None) -> list[int]:
        """The chat template applied to `messages` (the text it renders, tokenized without adding special
        tokens unless asked: the template writes them), as transformers' apply_chat_template(tokenize=True)
        does, with the request's `tools` where the template renders them; a 400 naming `param` if they do
        not fit the template."""
        self._check_chars(sum(len(v if isinstance(v, str) else json.dumps(v)) for m in messages for v in m.values())
                          + len(json.dumps(tools or [])), param)

        def apply() -> list[int]:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        try:
            return await asyncio.to_thread(apply)
        except Exception as err:  # a template's own raise_exception: the messages do not fit it
            raise APIError(400, f"messages do not fit the model's chat template: {err}", param=param) from None

    def ids(self, ids: Sequence[int], param: str) -> list[int]:
        """Token ids as given; a 400 naming `param` for any outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param=param)
        return list(ids)

    async def detokenize(self, ids: Sequence[int], param: str) -> str:
        """The text of token ids, special tokens included (in a worker thread: a body may hold a million)."""
        ids = self.ids(ids, param)
        return await asyncio.to_thread(
            lambda: self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise APIError(400, f"the prompt has {chars} characters, more than a prompt within max_model_len="
                                f"{self.max_model_len} tokens can have (at most {self.max_chars}: no token of this "
                                f"model is longer than {self.chars_per_token // 2} characters)", param=param)
