"""Offline, deterministic byte-level BPE tokenizers for the tiny checkpoints.

`build_tiny_tokenizer` trains on the embedded `_CORPUS` (the random-weight test checkpoints) or on a
corpus it is given (the trained default model, model/train_tiny.py) and saves a directory that
`transformers.AutoTokenizer.from_pretrained` loads (tokenizer.json, tokenizer_config.json,
chat_template.jinja), without touching the HF hub.
"""

from __future__ import annotations

import os
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a lot from a little text,
as long as the text is ordinary and the words repeat. In the morning the city was quiet, and the
river moved slowly under the old stone bridge. People walked to work, talked about the weather,
and bought coffee and bread from the shop on the corner.

She asked him what he wanted to do with the rest of the day. He said that he would like to read a
book, write a letter to his friend, and then go for a long walk in the park before dinner. They
agreed to meet again at seven o'clock in the evening, when the sun was setting behind the hills.

Language models predict the next token given the previous tokens. A diffusion language model
instead starts from a sequence of masked tokens and fills them in over several steps. The server
receives a request, schedules it on a worker, and returns the generated text to the user.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2 * i))

class Config:
    def __init__(self, hidden_size=64, num_layers=2):
        self.hidden_size = hidden_size
        self.num_layers = num_layers

if __name__ == "__main__":
    result = {"id": 42, "name": "test", "values": [1, 2, 3, 4, 5]}
    print(f"result = {result}")

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 128 256 512 1024 2048 4096 2024 3.14 1,000 99% $20.
What is 12 + 30? The answer is 42. Hello world! How are you today? I am fine, thank you.
"""

MISTRAL_STYLE_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if bos_token %}{{- bos_token }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is not none %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user/assistant roles after an optional system message') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Expects bos_token "<bos>" and special tokens "<start_of_turn>" / "<end_of_turn>".
GEMMA_STYLE_CHAT_TEMPLATE = (
    "{%- if bos_token %}{{- bos_token }}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def _filler(i: int) -> str:
    return f"<SPECIAL_{i}>"


def build_tiny_tokenizer(outdir: str | os.PathLike, *, vocab_size: int, special_tokens: dict[int, str],
                         bos_token: str | None, eos_token: str, pad_token: str | None, mask_token: str | None,
                         chat_template: str, corpus: Iterable[str] | None = None) -> None:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` tokens on `corpus` (default: the embedded
    `_CORPUS`, line by line) and save it to `outdir`.

    `special_tokens` are placed at exactly their ids; gaps below the largest id and any room left
    after the learned merges are filled with reserved `<SPECIAL_{id}>` tokens.
    """
    from transformers import PreTrainedTokenizerFast  # alias of TokenizersBackend in transformers 5

    if not special_tokens or min(special_tokens) < 0:
        raise ValueError("special_tokens must be a non-empty dict with non-negative ids")
    n_special = max(special_tokens) + 1
    specials = [special_tokens.get(i, _filler(i)) for i in range(n_special)]
    if len(set(specials)) != n_special:
        raise ValueError(f"duplicate special token strings: {specials}")
    for name, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token), ("mask", mask_token)):
        if tok is not None and tok not in special_tokens.values():
            raise ValueError(f"{name}_token {tok!r} is not one of special_tokens")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < n_special + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} cannot hold {n_special} specials + {len(alphabet)} byte tokens")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The trainer puts the specials first (ids 0..n_special-1), then the byte alphabet, then merges.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=specials, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True) if corpus is None else corpus, trainer=trainer)
    if tokenizer.get_vocab_size() < n_special + len(alphabet):  # only if the trainer misbehaves
        raise RuntimeError("BPE training produced an incomplete byte alphabet")
    fillers = [_filler(i) for i in range(tokenizer.get_vocab_size(), vocab_size)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + fillers])
    assert tokenizer.get_vocab_size() == vocab_size and all(
        tokenizer.token_to_id(t) == i for i, t in special_tokens.items()
    )

    if bos_token is not None:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1",
            special_tokens=[(bos_token, bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # add_bos_token is deliberately not passed: transformers would then rebuild the post-processor.
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
        mask_token=mask_token, chat_template=chat_template, clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(os.fspath(outdir))
