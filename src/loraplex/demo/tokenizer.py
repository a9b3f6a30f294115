"""The demo's byte-level tokenizer: token id = byte value for 0-255, then four special tokens.

Prompt format: `<s>TEXT<sep>`; the model answers `OUTPUT</s>`. The tokenizer adds nothing on its own
(no post-processor), so the prompt text carries its `<s>`; the special tokens are parsed out of
plain text, so a client that sends `"<s>hello<sep>"` to a completions API gets them as single
tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS, SEP, EOS, PAD = "<s>", "<sep>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, SEP, EOS, PAD)
BOS_ID, SEP_ID, EOS_ID, PAD_ID = 256, 257, 258, 259
VOCAB_SIZE = 260

# Renders the last user message into the completion prompt format; system and earlier turns are
# ignored because the demo model only knows the one format.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(text='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.text = message['content'] -%}{%- endif -%}"
    "{%- endfor -%}<s>{{ ns.text }}<sep>"
)


def make_prompt(text: str) -> str:
    """The completion prompt for `text`: the model (with an adapter) continues it with the output
    and `</s>`."""
    return f"{BOS}{text}{SEP}"


def encode_text(text: str) -> list[int]:
    """Token ids of plain text (no special tokens): its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer():
    """A `tokenizers.Tokenizer` with one token per byte (id = byte) and the special tokens after
    them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    return tokenizer


def write_tokenizer_files(model_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json."""
    tokenizer = build_tokenizer()
    assert [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS] == [
        BOS_ID,
        SEP_ID,
        EOS_ID,
        PAD_ID,
    ]
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "sep_token": SEP,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 128,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "sep_token": SEP}
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
