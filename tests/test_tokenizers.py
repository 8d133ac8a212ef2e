"""Character-level and GPT-2 tokenizers: encodings, chat templates, save/load round trips."""
import json

import pytest
from transformers import AutoTokenizer, LlamaConfig, Qwen2Config

from roles.tokenizers import (CHAR_ALPHABET, LOADER_KWARGS, QWEN2_SPLIT, build_char_tokenizer, build_gpt2_tokenizer,
                              build_tokenizer, save_tokenizer)

TEXT = "((12+7)*3)-5\n12+7=19\n19*3=57\n57-5=52\n#### 52 Hello, world!"
# Spaces, runs of spaces, newlines and blank lines, as in task prompts and solutions.
SPACED = "3+5+7\n3+5=8 #### 15\n\n  two  spaces \n trailing \n"
CHAT = [
    {"role": "system", "content": "Solve step by step."},
    {"role": "user", "content": "(12+7)*3"},
    {"role": "assistant", "content": "12+7=19\n19*3=57\n#### 57"},
]


@pytest.fixture(scope="module")
def gpt2():
    return build_gpt2_tokenizer()


def test_char_tokenizer_one_token_per_character():
    tok = build_char_tokenizer()
    ids = tok(TEXT)["input_ids"]
    assert len(ids) == len(TEXT)
    assert tok.decode(ids) == TEXT
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    # Every character of the alphabet has its own id; anything else maps to <unk>.
    ids = [tok(c)["input_ids"] for c in CHAR_ALPHABET]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(CHAR_ALPHABET)
    assert tok.unk_token_id not in sum(ids, [])
    # "é" is two bytes, each outside the alphabet.
    assert tok("é")["input_ids"] == [tok.unk_token_id] * 2
    # Role markers are single tokens even inside text.
    assert len(tok("<|user|>")["input_ids"]) == 1


def test_char_chat_template_renders_and_masks_the_reply():
    tok = build_char_tokenizer()
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<bos><|system|>Solve step by step.<eos><|user|>(12+7)*3<eos>"
                    "<|assistant|>12+7=19\n19*3=57\n#### 57<eos>")
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>")
    enc = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    learned = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(learned) == CHAT[2]["content"] + "<eos>"
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_gpt2_tokenizer_is_gpt2_bpe(gpt2):
    # Known GPT-2 ids: "Hello" 15496, " world" 995, "\n" 198, <|endoftext|> 50256.
    assert gpt2("Hello world\n")["input_ids"] == [15496, 995, 198]
    assert gpt2.convert_tokens_to_ids("<|endoftext|>") == 50256
    assert len(gpt2) == 50260
    assert gpt2.eos_token == "<|im_end|>" and gpt2.pad_token_id != gpt2.eos_token_id
    ids = gpt2(TEXT + " é ü")["input_ids"]
    assert gpt2.decode(ids) == TEXT + " é ü"
    # Qwen2's pre-tokenizer: numbers one digit per token.
    assert gpt2.convert_ids_to_tokens(gpt2(" 1234")["input_ids"]) == ["Ġ", "1", "2", "3", "4"]
    text = gpt2.apply_chat_template(CHAT, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n12+7=19\n19*3=57\n#### 57<|im_end|>\n")
    enc = gpt2.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    learned = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert gpt2.decode(learned) == CHAT[2]["content"] + "<|im_end|>"


def test_pre_tokenizer_is_the_one_qwen2_tokenizer_rebuilds():
    # AutoTokenizer builds Qwen2Tokenizer with this split next to any qwen2 config.json.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    assert QWEN2_SPLIT == PRETOKENIZE_REGEX


# Beside the tokenizer: nothing, or the config.json of a model type; AutoTokenizer picks its
# class from the model type (Qwen2Tokenizer for qwen2, whatever tokenizer_config.json says).
MODEL_CONFIGS = {"none": None, "qwen2": Qwen2Config, "llama": LlamaConfig}


@pytest.mark.parametrize("beside", sorted(MODEL_CONFIGS))
@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_save_pretrained_round_trip(kind, beside, tmp_path, request):
    tok = request.getfixturevalue("gpt2") if kind == "gpt2" else build_tokenizer(kind)
    if MODEL_CONFIGS[beside] is not None:
        MODEL_CONFIGS[beside](vocab_size=len(tok)).save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, SPACED):
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=False) == text
    # A tokenizer loaded by from_pretrained and saved again keeps no loader flags.
    save_tokenizer(loaded, tmp_path / "again")
    again = AutoTokenizer.from_pretrained(tmp_path / "again")
    assert again.decode(again(SPACED)["input_ids"], skip_special_tokens=False) == SPACED
    for folder in (tmp_path, tmp_path / "again"):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert not set(LOADER_KWARGS) & set(config), config
    batch = ["1+1=2", TEXT]
    assert loaded(batch, padding=True)["input_ids"] == tok(batch, padding=True)["input_ids"]
    assert loaded.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)
    assert loaded.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == \
        (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert len(loaded) == len(tok)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown tokenizer"):
        build_tokenizer("sentencepiece")
