"""Structured output: grammars a request's output is held to, compiled by llguidance for the served tokenizer.

A `Grammar` says what the output must be (a JSON schema, any JSON object, a regex, one of some strings, or a Lark
grammar, which is also what tool calls are constrained by). A `GrammarCompiler` turns it into llguidance's form
for the model's vocabulary, once per distinct grammar (an LRU cache of compiled matchers, each request taking a
copy). A `GrammarMatcher` follows one sequence's output: it consumes each sampled token and says which tokens may
come next, as a bitmask of the vocabulary (`fill_masks`, 32 tokens per int32 word, bit `t % 32` of word `t // 32`)
that the sampler applies to the logits on the device (engine/core/sampling.py, `apply_allowed`).

Why llguidance (docs/design/structured-outputs.md): one 3 MB wheel with no dependencies, a JSON schema compiled in
under a millisecond; it serves vLLM, SGLang and llama.cpp. A row's mask over a 49K vocabulary costs 50-200 µs the
first time its state is met (llguidance caches it).

JSON is written as `json.dumps` writes it (`", "` and `": "`, no other whitespace): what models trained on
Python-made JSON (the embedded one) write, and no room for a weak model to loop on whitespace. A schema's own
`x-guidance` options take precedence.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark

from kvfree.engine.protocol import Grammar, GrammarError
from kvfree.engine.text.tokenizer import Tokenizer, byte_level_decoder

# How JSON is laid out (llguidance's JSON options; a schema's "x-guidance" overrides them).
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}



def llguidance_source(grammar: Grammar) -> str:
    """`grammar` in the form `LLMatcher` compiles. Raises GrammarError for a source that is not even
    well-formed (a schema that is not JSON, an empty choice list)."""
    if grammar.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object (or true/false)")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.source)
    if grammar.kind == "choice":
        try:
            options = json.loads(grammar.source)
        except ValueError:
            options = None
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(lark_string(o) for o in options))
    source = any_to_lark(grammar.source) if "::=" in grammar.source else grammar.source
    return LLMatcher.grammar_from_lark(source)


def check_grammar(grammar: Grammar) -> None:
    """Raise GrammarError if `grammar` cannot be compiled for any tokenizer (its syntax, its JSON-schema keywords);
    what depends on the vocabulary (a special token's name) is checked when it is compiled for one."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(llguidance_source(grammar))
    if is_error:
        raise GrammarError(_first_lines(messages[0]))


def lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def json_schema_rule(schema: dict[str, Any] | bool) -> str:
    """An inline `%json {...}` for a Lark grammar, laid out as `JSON_STYLE` unless the schema says otherwise."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's error on one line, without the grammar listing and parser state it appends (what a client can
    act on)."""
    kept = []
    for line in message.splitlines():
        if line.startswith("<state>") or re.match(r"\s*\d+ \|", line):
            break
        if line.strip() and set(line.strip()) != {"^"}:  # (a caret under the error's column)
            kept.append(line.strip())
    text = " ".join(kept)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the tokenizer llguidance sees --------------------------------------------------------------------------------
class _TokenBytes:
    """The vocabulary as llguidance's `TokenizerWrapper` takes it: every id's bytes, special tokens marked with a
    leading 0xFF (so text can never spell them: `<|im_end|>` inside a JSON string stays text), ids past the
    tokenizer's (a padded embedding) as unusable special tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        special = tokenizer.special_token_ids
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special | set(range(tokenizer.vocab_size, vocab_size)))
        self.tokens = [
            b"\xff" + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ] + [b"\xff<[%d]>" % i for i in range(tokenizer.vocab_size, vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def native_lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer | None:
    """llguidance's own tokenizer, read from the checkpoint's `tokenizer.json`, when it sees every token's bytes and
    special tokens as kvfree does (checked token by token); None otherwise.

    Preferred to `_TokenBytes`: where a grammar forces text, llguidance tokenizes it, and with its own tokenizer it
    does so in Rust, without a call back into Python each time. A ByteLevel decoder inside a Sequence (the embedded
    model's) is given to it alone: llguidance reads the pieces of such a vocabulary wrongly otherwise.
    """
    data = json.loads(tokenizer.backend_json)
    byte_level = byte_level_decoder(data.get("decoder"))
    if byte_level is not None:
        data["decoder"] = byte_level
    try:
        llt = LLTokenizer(json.dumps(data), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
    except Exception:  # a tokenizer llguidance cannot read: kvfree's own bytes are handed over instead
        return None
    special = tokenizer.special_token_ids
    for i in range(tokenizer.vocab_size):
        expected = tokenizer.token_bytes(i)
        if expected.startswith(b"\xff"):
            continue  # (byte 0xFF: llguidance's mark of a special token; never part of valid UTF-8 text)
        if llt.is_special_token(i) != (i in special) or (i not in special and llt.decode_bytes([i]) != expected):
            return None
    return llt


class GrammarCompiler:
    """Compiles grammars for one tokenizer, caching the results; thread-safe.

    The llguidance tokenizer (every token's bytes, a trie over them) is built on first use, 0.4-1.3 s for a 49K
    vocabulary, checks included (the development CPU; an H100's host): `warm_up` builds it ahead, on a thread, at an
    engine's start-up. `compile` runs on the caller's thread; `compile_async` on the compiler's own worker, so that
    a long grammar (a big tool list: milliseconds) never stalls the engine's steps.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[Grammar, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._llt: LLTokenizer | None = None
        self._worker: ThreadPoolExecutor | None = None

    @property
    def lltokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._llt is None:
                self._llt = native_lltokenizer(self.tokenizer, self.vocab_size) or LLTokenizer(
                    TokenizerWrapper(_TokenBytes(self.tokenizer, self.vocab_size))
                )
            return self._llt

    def warm_up(self) -> threading.Thread:
        """Build the llguidance tokenizer on a daemon thread (returned, for a caller that wants to wait)."""
        thread = threading.Thread(target=lambda: self.lltokenizer, name="kvfree-grammar-warm-up", daemon=True)
        thread.start()
        return thread

    def compile(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for `grammar` (compiled once, then copied). Raises GrammarError naming what is wrong."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
        if compiled is None:
            compiled = LLMatcher(self.lltokenizer, llguidance_source(grammar), log_level=0)
            if compiled.is_error():
                raise GrammarError(_first_lines(compiled.get_error()))
            with self._lock:
                self._cache[grammar] = compiled
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy())

    def compile_async(self, grammar: Grammar) -> Future[GrammarMatcher]:
        """`compile` on the compiler's worker thread (llguidance releases the interpreter lock while it works)."""
        if self._worker is None:
            with self._lock:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvfree-grammar")
        return self._worker.submit(self.compile, grammar)


class GrammarMatcher:
    """One sequence's place in its grammar: consumes sampled tokens, says what may come next."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher

    def consume(self, token_id: int) -> bool:
        """Advance by a sampled token. False (and `error` set) if the grammar forbids it."""
        return self._m.consume_token(token_id)

    @property
    def accepting(self) -> bool:
        """The output so far is complete: the sequence may end here."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing but the end may follow (the grammar is complete, or the matcher failed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return _first_lines(self._m.get_error()) if self._m.is_error() else None

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self._m.deep_copy())


# -- masks --------------------------------------------------------------------------------------------------------
def mask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def fill_masks(
    matchers: list[GrammarMatcher], end_tokens: list[frozenset[int]], out: torch.Tensor, rows: list[int]
) -> None:
    """Write each matcher's allowed next tokens into row `rows[i]` of `out` (`[R, mask_words(V)]` int32, contiguous,
    on the host); other rows are left as they are.

    llguidance sets the bits of the tokens the grammar allows, the tokenizer's EOS among them where the output may
    end; `end_tokens[i]` (the request's other stop tokens: a chat's end-of-turn) are allowed there too.

    Rows are filled one after another, not on llguidance's thread pool: on an H100's 16-core host, with 16 and with
    48 JSON rows of 64, the pool made the decode slower (16 rows: 11.6K against 20.0K tok/s with the embedded model,
    14.9K against 16.9K with a 370M one; 48 rows: 9.6K against 14.7K; docs/bench/structured-cuda-graphs-vs-eager-a.json,
    structured-cuda-48-rows.json).
    """
    row_bytes = out.shape[1] * out.element_size()
    words = out.numpy().view(np.uint32)  # (the same memory, so that bit 31 is an ordinary bit)
    for matcher, ends, row in zip(matchers, end_tokens, rows, strict=True):
        # (llguidance.torch would do this, but importing it imports torch.compile's machinery: 1.8 s per process)
        matcher._m.unsafe_compute_mask_ptr(out[row].data_ptr(), row_bytes)
        if ends and matcher.accepting:
            for token in ends:
                if token >> 5 < words.shape[1]:  # (a stop token id past the vocabulary can never be sampled)
                    words[row, token >> 5] |= np.uint32(1 << (token & 31))


def bitmask_to_bool(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[M, W]` int32 bitmasks -> `[M, vocab_size]` bool, True where a token is allowed (on the masks' device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
