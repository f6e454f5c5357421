"""The front's side of a request's text (server/detokenize.py): token ids from the engine become text, cut at the
first stop string; what the engine ran past a stop is dropped; the end-of-sequence token has no text."""

from __future__ import annotations

from kvfree.engine.protocol import RequestOutput, SamplingParams, TokenLogprob
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.detokenize import ChoiceTexts
from tests.paths import TINY_CHECKPOINT

TOK = Tokenizer(TINY_CHECKPOINT)  # bytes: token id = byte value, EOS 256


def out(index: int, text: str, finish: str | None = None, extra: list[int] = ()) -> RequestOutput:
    ids = [*TOK.encode(text), *extra]
    return RequestOutput("r", index, ids, "", [TokenLogprob(t, -1.0) for t in ids], finish, 3, 0, 0)


def test_text_is_cut_at_a_stop_string_that_spans_outputs_and_later_tokens_are_dropped():
    texts = ChoiceTexts(TOK, SamplingParams(stop=["END"]), n=1)
    first = texts.add(out(0, "Hello E"))
    assert first.text == "Hello" and first.finish_reason is None  # " E" may still become "END": held back
    second = texts.add(out(0, "NDing more"))
    assert second.text == " " and second.finish_reason == "stop" and texts.all_finished
    assert second.token_ids == TOK.encode("ND") and len(second.logprobs) == 2
    assert texts.add(out(0, " after")) is None  # what the engine decoded before its abort landed


def test_a_held_back_tail_goes_out_when_the_engine_ends_the_choice():
    texts = ChoiceTexts(TOK, SamplingParams(stop=["END"]), n=1)
    assert texts.add(out(0, "abcEN")).text == "abc"
    last = texts.add(out(0, "", "length"))
    assert (last.text, last.finish_reason) == ("EN", "length")


def test_the_end_of_sequence_token_has_no_text():
    texts = ChoiceTexts(TOK, SamplingParams(), n=1)
    last = texts.add(out(0, "hi", "stop", extra=[TOK.eos_token_id]))
    assert (last.text, last.finish_reason, last.token_ids) == ("hi", "stop", [*TOK.encode("hi"), TOK.eos_token_id])


def test_each_choice_has_its_own_text_and_the_request_ends_when_all_have():
    texts = ChoiceTexts(TOK, SamplingParams(stop=["\n"]), n=2)
    assert texts.add(out(0, "one\ntwo")).text == "one" and not texts.all_finished
    assert texts.add(out(1, "three")).text == "three" and texts.add(out(0, "more")) is None
    assert texts.add(out(1, " four\n")).finish_reason == "stop" and texts.all_finished


def test_token_bytes_are_what_the_tokenizer_decodes_for_the_embedded_model():
    """The bytes of each token (OpenAI's logprob `bytes`, and what a grammar engine matches) are those its text
    decodes to, for the embedded model's tokenizer too, whose ByteLevel decoder is one step of a Sequence (a token
    like 'Ġ"' stands for ' "', not for the UTF-8 of its symbols)."""
    from kvfree.checkpoints import default_checkpoint_path

    tok = Tokenizer(default_checkpoint_path())
    checked = 0
    for token_id in range(tok.vocab_size):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a UTF-8 character: its text cannot show its bytes
            continue
        assert tok.token_bytes(token_id) == text.encode("utf-8"), (token_id, text, tok.token_bytes(token_id))
        checked += 1
    assert checked > tok.vocab_size // 2
