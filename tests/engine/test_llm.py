"""engine.LLM: batched generation over sessions of different prompt lengths, continuous admission, bad input."""

from __future__ import annotations

import pytest

from kvfree.engine import LLM, SamplingParams
from kvfree.engine.model.presets import init_checkpoint


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    return init_checkpoint("tiny-hybrid", tmp_path_factory.mktemp("ckpt") / "hybrid", seed=11)


PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "a" * 70, "Once upon a time, in a land"]


@pytest.mark.parametrize("model", ["default", "hybrid"])
def test_batch_of_prompts_equals_each_alone(model, hybrid_path) -> None:
    llm = LLM(None if model == "default" else hybrid_path, max_sessions=8, max_context=512)
    params = SamplingParams(max_tokens=12, temperature=0)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        (alone,) = llm.generate(prompt, params)
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert llm.pool.used_slots == 0  # every slot is given back


def test_more_prompts_than_slots_are_admitted_as_slots_free(hybrid_path) -> None:
    llm = LLM(hybrid_path, max_sessions=2, max_context=512)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(7)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0) for i in range(7)]
    outs = llm.generate(prompts, params)
    roomy = LLM(hybrid_path, max_sessions=8, max_context=512)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert [len(o.token_ids) for o in outs] == [3 + 2 * i for i in range(7)]


def test_long_prompt_prefilled_in_chunks_equals_whole(hybrid_path) -> None:
    prompt = "kvfree keeps a fixed-size state per session. " * 12
    params = SamplingParams(max_tokens=10, temperature=0)
    whole = LLM(hybrid_path, prefill_chunk=4096).generate(prompt, params)[0]
    chunked = LLM(hybrid_path, prefill_chunk=37).generate(prompt, params)[0]
    assert chunked.token_ids == whole.token_ids


def test_token_id_prompts() -> None:
    llm = LLM(max_sessions=2)
    ids = llm.tokenizer.encode("Hello there")
    params = SamplingParams(max_tokens=5, temperature=0)
    assert llm.generate([ids], params)[0].token_ids == llm.generate("Hello there", params)[0].token_ids


def test_bad_prompts_are_refused_with_clear_errors(hybrid_path) -> None:
    llm = LLM(hybrid_path, max_sessions=2, max_context=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 99999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_context"):
        llm.generate("x" * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    # The engine is intact afterwards.
    assert llm.pool.used_slots == 0
    assert len(llm.generate("ok", SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_recurrent_model_has_no_context_limit() -> None:
    """The recurrent default model accepts prompts far past max_context: its state does not grow."""
    llm = LLM(max_sessions=1, max_context=16)
    out = llm.generate("y" * 300, SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4


TINY_PRESETS = [
    "tiny",
    "tiny-attention",
    "tiny-swa",
    "tiny-hybrid",
    "tiny-ska",
    "tiny-echo",
    "tiny-gka",
    "tiny-gdn",
    "tiny-lattice",
    "tiny-bmojo",
]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_tiny_preset_generates_through_the_engine(preset, tmp_path) -> None:
    """Each mixer kind end to end: checkpoint on disk -> LLM -> batched greedy generation equal to each prompt alone,
    and a prompt prefilled in small chunks (crossing chunk boundaries of SKA/GKA/B'MOJO) equal to one prefill."""
    path = init_checkpoint(preset, tmp_path / preset, seed=5)
    prompts = ["kvfree " * 20, "Hello there", "x" * 150]
    params = SamplingParams(max_tokens=6, temperature=0)
    llm = LLM(path, max_sessions=4, max_context=512)
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.token_ids == llm.generate(prompt, params)[0].token_ids
    chunked = LLM(path, max_sessions=1, max_context=512, prefill_chunk=23).generate(prompts[2], params)[0]
    assert chunked.token_ids == batched[2].token_ids
