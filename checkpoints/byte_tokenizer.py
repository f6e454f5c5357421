"""The byte-level tokenizer shipped with kvfree's small checkpoints.

256 byte tokens plus a few special tokens, no merges: enough for demo and test checkpoints of any width, and it
round-trips every string. Tool calls are written by the model as a JSON object between `<tool_call>` tags.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML, with tools listed in the system turn and tool results as their own role.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    'You can call these tools. To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in the ByteLevel pre-tokenizer uses for each byte value 0..255 (GPT-2's mapping):
    printable Latin-1 bytes stand for themselves, the others are shifted to code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shift = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer() -> Tokenizer:
    """A byte-level BPE whose token id i is byte value i (0..255), then the special tokens from 256."""
    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_byte_tokenizer(path: str | Path) -> int:
    """Write tokenizer.json and tokenizer_config.json into directory `path`; returns the vocabulary size."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "tool_call_start": "<tool_call>",
        "tool_call_end": "</tool_call>",
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)
