import pytest
from transformers import AutoTokenizer

from model.tiny_tokenizer import GEMMA_STYLE_CHAT_TEMPLATE, MISTRAL_STYLE_CHAT_TEMPLATE, build_tiny_tokenizer

VOCAB_SIZE = 997
SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 100: "<|mask|>"}
MISTRAL_KW = dict(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, bos_token="<s>", eos_token="</s>",
                  pad_token="</s>", mask_token="<|mask|>", chat_template=MISTRAL_STYLE_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("mistral_tok")
    build_tiny_tokenizer(outdir, **MISTRAL_KW)
    return outdir


@pytest.fixture(scope="module")
def tok(mistral_dir):
    return AutoTokenizer.from_pretrained(mistral_dir)


def test_special_tokens_at_exact_ids(tok):
    for i, s in SPECIALS.items():
        assert tok.convert_tokens_to_ids(s) == i
        assert tok.convert_ids_to_tokens(i) == s
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (1, 2, 2, 100)
    assert tok.convert_ids_to_tokens(37) == "<SPECIAL_37>"


def test_exact_vocab_size_and_every_id_decodes(tok):
    assert len(tok) == VOCAB_SIZE
    assert len(tok.get_vocab()) == VOCAB_SIZE
    assert sorted(tok.get_vocab().values()) == list(range(VOCAB_SIZE))
    for i in range(VOCAB_SIZE):
        assert isinstance(tok.decode([i]), str)
    # the byte alphabet and merges come right after the specials, the padding fillers at the end
    assert tok.convert_ids_to_tokens(101) == "!"
    assert tok.convert_ids_to_tokens(VOCAB_SIZE - 1) == f"<SPECIAL_{VOCAB_SIZE - 1}>"


@pytest.mark.parametrize("text", ["Hello world, 123!", "def add(a, b):\n    return a + b\n", "  odd  spacing\t~`|"])
def test_round_trip_and_bos(tok, text):
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_merges_were_learned(tok):
    assert len(tok("the weather").input_ids) < 1 + len("the weather")


def test_mistral_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "42"}, {"role": "user", "content": "Thanks"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>[INST] Be brief.\n\nWhat is 12 + 30? [/INST] 42</s>[INST] Thanks [/INST]"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 1  # BOS comes from the template only, not doubled
    assert ids.count(3) == 2 and ids.count(4) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == text


def test_gemma_chat_template_without_mask(tmp_path):
    specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<start_of_turn>", 5: "<end_of_turn>"}
    build_tiny_tokenizer(tmp_path, vocab_size=300, special_tokens=specials, bos_token="<bos>", eos_token="<eos>",
                         pad_token="<pad>", mask_token=None, chat_template=GEMMA_STYLE_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 300 and tok.mask_token_id is None and tok.bos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [2, 4] and ids.count(4) == 2 and ids.count(5) == 1


def test_no_bos(tmp_path):
    build_tiny_tokenizer(tmp_path, vocab_size=260, special_tokens={0: "<|endoftext|>"}, bos_token=None,
                         eos_token="<|endoftext|>", pad_token=None, mask_token=None,
                         chat_template=MISTRAL_STYLE_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 260 and tok.bos_token_id is None and tok.eos_token_id == 0
    assert 0 not in tok("hi").input_ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "[INST] hi [/INST]"


def test_deterministic(tmp_path, mistral_dir):
    build_tiny_tokenizer(tmp_path, **MISTRAL_KW)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (mistral_dir / name).read_bytes()


def test_minimal_vocab_fits(tmp_path):
    build_tiny_tokenizer(tmp_path, **{**MISTRAL_KW, "vocab_size": 101 + 256})
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 101 + 256


@pytest.mark.parametrize("kw", [{"vocab_size": 101 + 255}, {"vocab_size": 50},
                                {"mask_token": "<not-a-special>"}])
def test_invalid_args_raise(tmp_path, kw):
    with pytest.raises(ValueError):
        build_tiny_tokenizer(tmp_path, **{**MISTRAL_KW, **kw})
