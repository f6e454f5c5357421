"""Tokenizer: a `tokenizers` tokenizer from `tokenizer.json` plus the chat template of `tokenizer_config.json`."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from kvfree.checkpoints import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, CheckpointError
from kvfree.checkpoints.byte_tokenizer import byte_symbols

# GPT-2's byte-level alphabet, read backwards: the printable stand-in of each byte value -> the byte.
_BYTE_OF_SYMBOL = {symbol: byte for byte, symbol in enumerate(byte_symbols())}


LONG_TEXT_CHARS = 16_384  # texts longer than this are encoded without holding the interpreter lock (`encode`)

def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


def byte_level_decoder(decoder: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ByteLevel decoder of a `tokenizer.json` decoder (GPT-2's symbols for bytes), alone or as one step of a
    Sequence (the embedded model's: byte fallback, fuse, "▁" to space, then ByteLevel); None when it has none."""
    decoder = decoder or {}
    chain = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
    return next((d for d in chain if isinstance(d, dict) and d.get("type") == "ByteLevel"), None)


class Tokenizer:
    """Encode/decode text and render chat messages with the checkpoint's template."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise CheckpointError(f"{path / TOKENIZER_FILE}: cannot load tokenizer ({e})") from None
        cfg_path = path / TOKENIZER_CONFIG_FILE
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._byte_level = byte_level_decoder(json.loads(self.backend_json).get("decoder")) is not None
        self._bytes_cache: dict[int, bytes] = {}
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest entry of the vocabulary, added tokens included
        (a byte-level entry spells one byte per character, and a character is at least one byte). A text of C
        characters is therefore at least C / max_token_chars tokens, known before tokenizing it."""
        return max(1, max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1))

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (special-token strings in the text are recognised as special tokens).

        A long text goes through `encode_batch`, which releases the interpreter lock while it works (`encode` holds
        it: a 3.9 MB text held it for 1.9 s on the development CPU, so a server's event loop, encoding it on a worker
        thread, still stalled); the ids are the same."""
        if len(text) > LONG_TEXT_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON (what `tokenizer.json` holds, added tokens included)."""
        return self._tok.to_str()

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (`<|im_end|>`, and the tool-call tags of kvfree's byte-level tokenizers):
        tokens text never encodes to unless it spells them whole, and a grammar's text never matches."""
        return frozenset(i for i, added in self._tok.get_added_tokens_decoder().items() if added.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob `bytes`), which its text may not show: a byte-level
        token in the middle of a UTF-8 character decodes to U+FFFD, whatever the byte."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        added = self._tok.get_added_tokens_decoder().get(token_id)
        if added is not None:  # special and added tokens stand for their content
            return added.content.encode("utf-8")
        if self._byte_level and all(ch in _BYTE_OF_SYMBOL for ch in piece):
            return bytes(_BYTE_OF_SYMBOL[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word-start marker is a space

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render a chat as the prompt text the model was trained on."""
        if not self.chat_template:
            raise CheckpointError("this checkpoint's tokenizer_config.json has no chat_template")
        template = self._env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas at O(new characters) per token.

    A `tokenizers` DecodeStream keeps just enough of the previous tokens to decode the next one in context (merges,
    byte fallback, a leading-space marker). A byte-level token can end in the middle of a UTF-8 character; such a
    tail gives no text (None from the stream) until the token that completes it arrives.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly empty)."""
        return self._stream.step(self._tok, token_id) or ""
