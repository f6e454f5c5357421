"""Sampling: parameter validation, the batched sampler (greedy, seeds, filters, penalties, logprobs) and the
stop / length rules as seen through `LLM.generate` and `LLM.stream` on the embedded checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from kvfree.engine import LLM, SamplingParams
from kvfree.engine.core.sampling import SamplingRows, apply_penalties, filter_logits, sample
from kvfree.engine.core.sequence import Sequence
from kvfree.engine.protocol import MAX_TOP_LOGPROBS
from tests.paths import TINY_CHECKPOINT

# -- helpers -------------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _rows(
    params: list[SamplingParams],
    vocab: int,
    seeds: list[int | None] | None = None,
    counters: list[int] | None = None,
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> SamplingRows:
    """Sampling rows from Python values; a row without a seed draws one from torch's global RNG."""
    seeds = seeds or [p.seed for p in params]
    seeds = [s if s is not None else int(torch.randint(0, 2**62, ())) for s in seeds]
    return SamplingRows.build(
        params, seeds, counters or [0] * len(params), vocab, counts=counts, prompt_mask=prompt_mask
    )


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds=None, counters=None, counts=None, prompt_mask=None
):
    return sample(logits, _rows(params, logits.shape[-1], seeds, counters, counts, prompt_mask))


def _logits_from_probs(probs: list[float], perm: torch.Tensor, shift: float) -> torch.Tensor:
    """A `[V]` logit row whose softmax puts probs[i] at position perm[i] (so the best token is not at index 0)."""
    row = torch.empty(len(probs))
    row[perm] = torch.tensor(probs).log() + shift
    return row


def _draw(row: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """n independent draws from one logit row (as a batch of n identical rows, seeded global RNG)."""
    torch.manual_seed(seed)
    return _sample(row.expand(n, -1).contiguous(), [params] * n).token_ids


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


# -- SamplingParams validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", float("nan")),
        ("logprobs", MAX_TOP_LOGPROBS + 1),
        ("logprobs", -1),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_params_reject_bad_value_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_reject_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")


def test_params_accept_edges_and_wrap_single_stop_string():
    p = SamplingParams(stop="x")
    assert p.stop == ["x"]
    SamplingParams(temperature=0, top_p=1.0, min_p=1.0, logprobs=MAX_TOP_LOGPROBS, seed=0, presence_penalty=-2.0)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties


# -- greedy --------------------------------------------------------------------------------------------------------


def test_greedy_picks_argmax():
    logits = _randn(6, 40, seed=1, scale=3.0)
    out = _sample(logits, [SamplingParams(temperature=0)] * 6)
    assert out.token_ids.shape == (6,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_unaffected_by_other_rows():
    logits = _randn(5, 40, seed=2, scale=2.0)
    greedy = SamplingParams(temperature=0)
    others = [
        SamplingParams(temperature=1.5, top_k=2, seed=3),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
    ]
    params = [others[0], greedy, others[1], greedy, others[2]]
    torch.manual_seed(0)
    for step in range(10):
        out = _sample(logits, params, [3, None, None, None, None], counters=[step] * 5)
        assert out.token_ids[1] == logits[1].argmax()
        assert out.token_ids[3] == logits[3].argmax()


# -- seeds ---------------------------------------------------------------------------------------------------------

V_SEED = 50
STEPS = 20


def _step_logits() -> list[torch.Tensor]:
    # Flat-ish: scale 0.3 over 50 tokens, so two seeds almost surely diverge.
    return [_randn(V_SEED, seed=100 + i, scale=0.3) for i in range(STEPS)]


def _seeded_run(seed: int, row: int = 0, batch: int = 1, other_seeds: dict[int, int] | None = None) -> list[int]:
    """Sample STEPS tokens for a seeded row at `row` of a batch whose other rows are unseeded (or seeded from
    `other_seeds`) and use different filters and logits."""
    params = SamplingParams(temperature=0.9, seed=seed)
    seeds: list[int | None] = [None] * batch
    seeds[row] = seed
    for r, s in (other_seeds or {}).items():
        seeds[r] = s
    other_params = [SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0), SamplingParams(top_p=0.6)]
    batch_params = [params if r == row else other_params[r % 3] for r in range(batch)]
    tokens = []
    torch.manual_seed(1234 + batch + row)  # the unseeded rows' noise, different for each layout
    for i, logits in enumerate(_step_logits()):
        rows = _randn(batch, V_SEED, seed=999 + i, scale=2.0)
        rows[row] = logits
        tokens.append(int(_sample(rows, batch_params, seeds, counters=[i] * batch).token_ids[row]))
    return tokens


def test_seed_reproducible_alone_and_in_any_batch_position():
    ref = _seeded_run(42)
    assert len(ref) == STEPS
    assert _seeded_run(42) == ref
    assert _seeded_run(42, row=0, batch=4) == ref
    assert _seeded_run(42, row=3, batch=5) == ref
    assert _seeded_run(42, row=1, batch=3, other_seeds={0: 7, 2: 42}) == ref


def test_different_seeds_give_different_sequences():
    runs = {tuple(_seeded_run(s)) for s in (1, 2, 3, 4)}
    assert len(runs) == 4
    # And the draws really are spread out (not stuck on the argmax).
    assert len(set(_seeded_run(1))) > 5


def test_seeded_row_ignores_the_global_rng():
    logits = _randn(3, V_SEED, seed=100, scale=0.3)
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams(seed=6)]
    picks = []
    for global_seed in (99, 12345, 7):
        torch.manual_seed(global_seed)
        picks.append(_sample(logits, params, [5, None, 6]).token_ids[[0, 2]].tolist())
    assert picks[0] == picks[1] == picks[2]


# -- filters -------------------------------------------------------------------------------------------------------

V_FILTER = 10
PERM = torch.randperm(V_FILTER, generator=_gen(7))  # token order unrelated to probability order


def test_top_k_only_top_tokens_appear_with_renormalised_frequencies():
    row = _randn(V_FILTER, seed=11, scale=0.8)
    top3 = row.topk(3).indices
    tokens = _draw(row, SamplingParams(temperature=1.0, top_k=3), 4000, seed=0)
    assert set(tokens.tolist()) == set(top3.tolist())
    freq = _frequencies(tokens, V_FILTER)
    expect = torch.zeros(V_FILTER, dtype=torch.float64)
    expect[top3] = row[top3].double().softmax(-1)
    assert (freq - expect).abs().max() < 0.03


def test_top_k_at_least_vocab_is_a_no_op():
    row = _randn(V_FILTER, seed=12)
    for k in (V_FILTER, V_FILTER + 5, 0, -1):
        out = filter_logits(row[None], _rows([SamplingParams(top_k=k)], row[None].shape[-1]))
        assert torch.equal(out[0], row)


PROBS_P = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.7, 2), (0.85, 3), (0.97, 4), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    perm = torch.randperm(4, generator=_gen(3))
    row = _logits_from_probs(PROBS_P, perm, shift=1.7)
    tokens = _draw(row, SamplingParams(temperature=1.0, top_p=top_p), 3000, seed=1)
    assert set(tokens.tolist()) == set(perm[:kept].tolist())
    freq = _frequencies(tokens, 4)[perm[:kept]]
    expect = torch.tensor(PROBS_P[:kept], dtype=torch.float64)
    assert (freq - expect / expect.sum()).abs().max() < 0.03


@pytest.mark.parametrize(("min_p", "kept"), [(0.4, 3), (0.1, 6), (0.9, 1)])
def test_min_p_keeps_tokens_above_fraction_of_max(min_p, kept):
    probs = [0.35, 0.2, 0.15, 0.12, 0.1, 0.08]  # floors: 0.4 -> 0.14, 0.1 -> 0.035, 0.9 -> 0.315
    perm = torch.randperm(6, generator=_gen(4))
    row = _logits_from_probs(probs, perm, shift=-0.6)
    tokens = _draw(row, SamplingParams(temperature=1.0, min_p=min_p), 3000, seed=2)
    assert set(tokens.tolist()) == set(perm[:kept].tolist())


def test_filter_logits_positions_per_row():
    """Each row has its own filter; -inf lands on the right (unsorted) token ids and kept logits are only scaled."""
    probs = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005, 0.0, 0.0]
    probs = [p if p else 1e-4 for p in probs]
    base = _logits_from_probs(probs, PERM, shift=0.3)
    rows = torch.stack([base, base, base, base, base, base])
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.7),  # 0.4 + 0.25 = 0.65 < 0.7 -> 3 tokens
        SamplingParams(min_p=0.3),  # floor 0.12 -> 3 tokens
        SamplingParams(),
        SamplingParams(top_k=5, top_p=0.5),  # top-p over the top-5: 0.4/0.95 < 0.5 -> 2 tokens
        SamplingParams(temperature=0.5, top_k=2),
    ]
    out = filter_logits(rows, _rows(params, rows.shape[-1]))
    kept_counts = [3, 3, 3, V_FILTER, 2, 2]
    for r, n in enumerate(kept_counts):
        keep = torch.zeros(V_FILTER, dtype=torch.bool)
        keep[PERM[:n]] = True
        assert torch.equal(torch.isinf(out[r]), ~keep), f"row {r}"
        assert (out[r][~keep] == float("-inf")).all()
        scale = 2.0 if r == 5 else 1.0
        torch.testing.assert_close(out[r][keep], base[keep] * scale)


def test_filter_logits_always_keeps_the_best_token():
    row = _logits_from_probs([0.9, 0.05, 0.03, 0.02], torch.tensor([2, 0, 3, 1]), shift=0.0)
    for p in (SamplingParams(top_p=0.01), SamplingParams(top_k=1), SamplingParams(min_p=1.0)):
        out = filter_logits(row[None], _rows([p], row.shape[-1]))[0]
        assert torch.isfinite(out).tolist() == [False, False, True, False]


def test_top_p_boundary_is_inclusive_and_ties_are_cut():
    # Exact binary probabilities: 4 tied tokens of 0.25. The smallest prefix reaching 0.5 is two tokens.
    for top_p, kept in [(0.5, 2), (0.25, 1), (0.26, 2), (0.75, 3), (0.76, 4)]:
        out = filter_logits(torch.full((1, 4), 0.7), _rows([SamplingParams(top_p=top_p)], 4))
        assert int(torch.isfinite(out).sum()) == kept, top_p


def test_top_p_applies_to_the_renormalised_top_k():
    perm = torch.randperm(4, generator=_gen(8))
    row = _logits_from_probs(PROBS_P, perm, shift=0.2)
    # Over the top 2 (0.5, 0.3 -> 0.625, 0.375) top_p=0.6 is reached by the first token alone.
    out = filter_logits(row[None], _rows([SamplingParams(top_k=2, top_p=0.6)], row[None].shape[-1]))[0]
    assert torch.isfinite(out).nonzero()[:, 0].tolist() == [perm[0].item()]
    out = filter_logits(row[None], _rows([SamplingParams(top_k=3, top_p=0.6)], row[None].shape[-1]))[0]
    assert sorted(torch.isfinite(out).nonzero()[:, 0].tolist()) == sorted(perm[:2].tolist())


# -- temperature and the empirical distribution --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_tempered_softmax(temperature):
    row = _randn(4, seed=21, scale=1.0)
    want = (row.double() / temperature).softmax(-1)
    tokens = _draw(row, SamplingParams(temperature=temperature), 20000, seed=3)
    freq = _frequencies(tokens, 4)
    assert (freq - want).abs().max() < 0.02, (freq, want)
    if temperature != 1.0:
        # The prediction differs from the untempered one by more than the tolerance, so the test can tell.
        assert (want - row.double().softmax(-1)).abs().max() > 0.05
    if temperature < 1.0:
        assert freq[row.argmax()] > row.double().softmax(-1)[row.argmax()] + 0.03


# -- penalties -----------------------------------------------------------------------------------------------------


def test_apply_penalties_exact_values():
    B, V = 3, 8
    logits = _randn(B, V, seed=31, scale=2.0)
    logits[:, 0], logits[:, 1] = 1.5, -1.5  # both signs present on seen tokens for sure
    counts = torch.zeros(B, V)
    counts[:, 0] = 2
    counts[:, 1] = 1
    counts[:, 4] = 3
    prompt_mask = torch.zeros(B, V, dtype=torch.bool)
    prompt_mask[:, 2] = True
    prompt_mask[:, 4] = True
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-0.75),
    ]
    out = apply_penalties(logits, _rows(params, V, counts=counts, prompt_mask=prompt_mask))
    expect = logits.clone()
    for v in range(V):
        x = logits[0, v].item()
        if counts[0, v] > 0 or prompt_mask[0, v]:
            expect[0, v] = x / 1.5 if x > 0 else x * 1.5
        expect[1, v] = logits[1, v] - 0.5 * counts[1, v]  # generated only: the prompt does not count
        expect[2, v] = logits[2, v] + 0.75 * (counts[2, v] > 0).float()
    torch.testing.assert_close(out, expect)
    # unseen tokens are untouched in every row
    unseen = (counts == 0) & ~prompt_mask
    assert torch.equal(out[unseen], logits[unseen])
    assert out[0, 0] == pytest.approx(1.0) and out[0, 1] == pytest.approx(-2.25)
    assert out[1, 4] == pytest.approx(logits[1, 4].item() - 1.5)
    assert out[2, 2] == logits[2, 2]  # prompt-only token: presence penalty does not apply


def test_apply_penalties_combined_in_one_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    prompt_mask = torch.tensor([[False, False, True, False]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    out = apply_penalties(logits, _rows([p], logits.shape[-1], counts=counts, prompt_mask=prompt_mask))
    # token 0: 2/2 - 0.25*1 - 0.5; token 1: -1*2 - 0.25*2 - 0.5; token 2 (prompt): 0.5/2; token 3 unseen
    torch.testing.assert_close(out, torch.tensor([[0.25, -3.0, 0.25, 3.0]]))


def test_sample_with_penalties_changes_greedy_choice_and_needs_counts():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0], [3.0, 2.9, 0.0, -1.0]])
    counts = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    prompt_mask = torch.zeros(2, 4, dtype=torch.bool)
    params = [SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0)]
    out = _sample(logits, params, counts=counts, prompt_mask=prompt_mask)
    assert out.token_ids.tolist() == [1, 0]
    with pytest.raises(ValueError, match="counts"):
        _sample(logits, params)


# -- logprobs ------------------------------------------------------------------------------------------------------


def test_logprobs_of_sampled_token_and_top_alternatives():
    B, V = 6, 30
    raw = _randn(B, V, seed=41, scale=2.0)
    counts = torch.zeros(B, V)
    counts[:, :5] = 1
    prompt_mask = torch.zeros(B, V, dtype=torch.bool)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, seed=1),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.2, top_k=4, logprobs=1, repetition_penalty=1.3, seed=2),
        SamplingParams(temperature=0, logprobs=2, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=3),
    ]
    torch.manual_seed(0)
    out = _sample(raw.clone(), params, [1, None, None, 2, None, None], counts=counts, prompt_mask=prompt_mask)
    ref = raw.log_softmax(-1)  # the model's distribution: before penalties, temperature and filters
    assert out.logprobs.shape == (B,)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    top_lp, top_ids = ref.topk(3, dim=-1)
    assert out.top_ids.shape == (B, 3) and out.top_logprobs.shape == (B, 3)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_lp)
    assert (out.logprobs <= out.top_logprobs[:, 0] + 1e-6).all()
    assert out.token_ids[1] == raw[1].argmax()


def test_logprobs_zero_gives_no_top_alternatives():
    raw = _randn(2, 12, seed=42)
    out = _sample(raw, [SamplingParams(temperature=0, logprobs=0)] * 2)
    torch.testing.assert_close(out.logprobs, raw.log_softmax(-1).max(-1).values)
    assert out.top_ids is None and out.top_logprobs is None


# -- logit bias ----------------------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens_in_its_own_rows_only():
    """+100 on a token makes it the pick of a greedy and of a sampled row; -100 on each row's best token bans it;
    rows without a bias pick exactly what they pick alone; the reported logprobs stay the model's."""
    logits = _randn(5, 40, seed=21, scale=2.0)
    best = logits.argmax(-1)
    forced, banned = 7 if int(best[0]) != 7 else 8, int(best[2])
    params = [
        SamplingParams(temperature=0, logit_bias={forced: 100}, logprobs=0),
        SamplingParams(temperature=0.9, seed=4, logit_bias={forced: 100.0}),
        SamplingParams(temperature=0, logit_bias={banned: -100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, seed=5, top_k=5),
    ]
    out = _sample(logits, params)
    assert out.token_ids[:2].tolist() == [forced, forced]
    assert int(out.token_ids[2]) != banned and int(out.token_ids[2]) == int(logits[2].topk(2).indices[1])
    free = _sample(logits[3:], params[3:])
    assert out.token_ids[3:].tolist() == free.token_ids.tolist()
    torch.testing.assert_close(out.logprobs[0], logits[0].log_softmax(-1)[forced])  # the model's, not the biased


@pytest.mark.parametrize("bias", [{-1: 5.0}, {3: 100.5}, {3: -101}, {3: float("nan")}, {"3": 1.0}])
def test_params_reject_bad_logit_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


# -- through LLM on the embedded checkpoint ------------------------------------------------------------------------

PROMPT = "Hello, world"
GREEDY_LEN = 30


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY_CHECKPOINT, device="cpu")


@pytest.fixture(scope="module")
def greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == GREEDY_LEN
    return out


def test_llm_greedy_is_deterministic(llm, greedy):
    again = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True))[0]
    assert again.token_ids == greedy.token_ids and again.text == greedy.text


def _stop_string(text: str) -> str:
    mid = len(text) // 2
    for start in [*range(mid, len(text) - 1), *range(mid - 1, 0, -1)]:
        cand = text[start : start + 2]
        if "\ufffd" not in cand and text.index(cand) > 0:
            return cand
    pytest.skip(f"no 2-character stop string candidate in {text!r}")


def test_llm_stop_string_cuts_output(llm, greedy):
    stop = _stop_string(greedy.text)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPT, params)[0]
    cut = greedy.text.index(stop)
    assert out.finish_reason == "stop"
    assert out.text == greedy.text[:cut]
    assert stop not in out.text
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < GREEDY_LEN
    # Streaming holds back a possible stop-string prefix and must end with the same text.
    streamed = "".join(llm.stream(PROMPT, params))
    assert streamed == out.text
    assert llm.last_sequence.finish_reason == "stop"


def test_llm_stop_token_ids_stop_right_there(llm, greedy):
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)  # where it first occurs (<= 4)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: first + 1]
    # The stop token's text is not part of the output: it is the text of the tokens before it.
    if first:
        before = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=first, ignore_eos=True))[0]
        assert out.text == before.text
    else:
        assert out.text == ""


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_llm_max_tokens_gives_length(llm, greedy, max_tokens):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == greedy.token_ids[:max_tokens]
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True))
    assert sampled[0].finish_reason == "length" and len(sampled[0].token_ids) == max_tokens


def _sequence(llm: LLM, params: SamplingParams) -> Sequence:
    return Sequence.create(llm.encode("hi"), params, llm.tokenizer)


def _feed(llm: LLM, seq: Sequence, text: str) -> list[str]:
    """Append the (byte-level) tokens of `text` one by one until finished; returns take_delta() after each."""
    deltas = []
    for tok in llm.tokenizer.encode(text):
        if seq.finished:
            break
        seq.append(tok)
        deltas.append(seq.take_delta())
    return deltas


def test_sequence_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    assert eos is not None
    seq = _sequence(llm, SamplingParams(max_tokens=10))
    _feed(llm, seq, "ab")
    seq.append(eos)
    assert seq.finish_reason == "stop" and seq.text == "ab" and seq.output_token_ids[-1] == eos
    seq = _sequence(llm, SamplingParams(max_tokens=4, ignore_eos=True))
    _feed(llm, seq, "ab")
    seq.append(eos)
    assert not seq.finished
    seq.append(llm.tokenizer.encode("c")[0])
    assert seq.finish_reason == "length" and seq.text == "abc"


def test_sequence_stop_string_across_tokens_and_holdback(llm):
    seq = _sequence(llm, SamplingParams(max_tokens=50, stop=["o w", "zz"]))
    deltas = _feed(llm, seq, "hello world")
    assert seq.finish_reason == "stop"
    assert seq.text == "hell"
    assert len(seq.output_token_ids) == len("hello w")
    # While running, the last len(longest stop) - 1 = 2 characters are held back; nothing is emitted twice.
    assert deltas[:4] == ["", "", "h", "e"]
    assert "".join(deltas) == "hell"


def test_sequence_earliest_stop_string_wins_and_multibyte_text(llm):
    seq = _sequence(llm, SamplingParams(max_tokens=50, stop=["d", "b c"]))
    deltas = _feed(llm, seq, "éa b cd")
    assert seq.finish_reason == "stop" and seq.text == "éa "
    assert "".join(deltas) == "éa "
    # Two stop strings completed by the same token: the text is cut at the earlier one.
    seq = _sequence(llm, SamplingParams(max_tokens=50, stop=["d", "cd"]))
    _feed(llm, seq, "abcde")
    assert seq.finish_reason == "stop" and seq.text == "ab"
    seq = _sequence(llm, SamplingParams(max_tokens=3))
    deltas = _feed(llm, seq, "é!x")  # é is two byte tokens: the first one alone gives no text
    assert deltas == ["", "é", "!"]
    assert seq.finish_reason == "length" and seq.text == "é!"


def test_llm_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    a = llm.generate(PROMPT, params)[0]
    b = llm.generate(PROMPT, params)[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    batch = llm.generate(
        ["The quick brown fox", PROMPT, "abc"],
        [
            SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True),
            params,
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert batch[1].token_ids == a.token_ids
    other = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=20))[0]
    assert other.token_ids != a.token_ids


def test_llm_seeded_outputs_do_not_depend_on_admission_order():
    """More prompts than state slots: later prompts wait and join a running batch; seeded and greedy outputs are
    the same as when each prompt runs alone."""
    small = LLM(device="cpu", max_sessions=2)
    prompts = ["one", "two two", "three three three", "four", "five!"]
    params = [
        SamplingParams(temperature=0.8, seed=10 + i, max_tokens=6 + 3 * i, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=12 - i, ignore_eos=True)
        for i in range(5)
    ]
    together = small.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = small.generate(prompt, p)[0]
        assert out.token_ids == alone.token_ids, prompt
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"


def test_llm_logprobs(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 10
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 2
        (id0, lp0), (id1, lp1) = lp.top
        assert id0 != id1 and lp0 >= lp1
        assert lp.logprob <= lp0 + 1e-5
        assert lp.logprob <= 0 and math.isfinite(lp.logprob)
        if tok == id0:
            assert lp.logprob == pytest.approx(lp0, abs=1e-5)
    none = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0]
    assert none.logprobs is None


def test_llm_greedy_logprob_is_top(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))[0]
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.top[0][0] == tok
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-5)


def test_llm_stream_matches_generate(llm, greedy):
    params = SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True)
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(deltas) == greedy.text
    assert len(deltas) > 1
    assert llm.last_sequence.output_token_ids == greedy.token_ids
    assert llm.last_sequence.finish_reason == "length"


# -- the batch as a whole ------------------------------------------------------------------------------------------


def _reference_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, the plain way: scale, then drop what min-p, top-k and top-p each reject, in that order."""
    row = row.double() / (p.temperature if p.temperature > 0 else 1.0)
    keep = torch.ones_like(row, dtype=torch.bool)
    if p.min_p > 0:
        probs = row.softmax(-1)
        keep &= probs >= p.min_p * probs.max()
    order = [int(i) for i in row.argsort(descending=True) if keep[i]]
    if 0 < p.top_k < len(row):
        order = order[: p.top_k]
    if p.top_p < 1:
        mass = row[order].softmax(-1)
        kept, total = [], 0.0
        for token, m in zip(order, mass.tolist(), strict=True):
            if total >= p.top_p:
                break
            kept.append(token)
            total += m
        order = kept
    out = torch.full_like(row, float("-inf"))
    out[order] = row[order]
    return out


def _mixed_params(count: int, seed: int) -> list[SamplingParams]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        r = torch.rand(6, generator=gen).tolist()
        out.append(
            SamplingParams(
                temperature=0.0 if i % 7 == 0 else 0.3 + 1.5 * r[0],
                top_k=int(r[1] * 12) if i % 3 else 0,
                top_p=0.3 + 0.7 * r[2] if i % 2 else 1.0,
                min_p=0.2 * r[3] if i % 5 == 1 else 0.0,
                presence_penalty=1.0 if i % 4 == 3 else 0.0,
                repetition_penalty=1.3 if i % 6 == 5 else 1.0,
                seed=1000 + i if i % 2 == 0 else None,
            )
        )
    return out


def test_filters_match_a_per_row_reference():
    params = _mixed_params(64, seed=3)
    logits = _randn(64, 40, seed=51, scale=2.0)
    out = filter_logits(logits, _rows(params, 40))
    for i, p in enumerate(params):
        want = _reference_filter(logits[i], p)
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(want)), (i, p)
        finite = torch.isfinite(want)
        torch.testing.assert_close(out[i][finite].double(), want[finite], rtol=1e-6, atol=1e-6)


def test_seeded_rows_identical_alone_and_in_a_batch_of_64_mixed_requests():
    V = 40
    params = _mixed_params(64, seed=4)
    counts = torch.randint(0, 3, (64, V), generator=_gen(5)).float()
    prompt_mask = torch.rand(64, V, generator=_gen(6)) < 0.2
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    for step in range(8):
        logits = _randn(64, V, seed=60 + step, scale=1.5)
        batch = _sample(logits, params, counters=[step] * 64, counts=counts, prompt_mask=prompt_mask)
        for i in seeded:
            alone = _sample(
                logits[i : i + 1],
                [params[i]],
                counters=[step],
                counts=counts[i : i + 1],
                prompt_mask=prompt_mask[i : i + 1],
            )
            assert int(alone.token_ids[0]) == int(batch.token_ids[i]), (step, i)


def test_counter_based_uniforms_are_uniform_and_independent():
    from kvfree.engine.core.sampling import uniform

    seeds = torch.arange(200).repeat_interleave(500)
    counters = torch.arange(500).repeat(200)
    u = uniform(seeds, counters)
    assert u.min() > 0 and u.max() < 1
    hist = torch.histc(u.float(), bins=20, min=0, max=1) / u.numel()
    assert (hist - 0.05).abs().max() < 0.003  # 100,000 draws: ~0.0007 standard deviation per bin
    # Neighbouring counters and neighbouring seeds are uncorrelated.
    grid = u.view(200, 500)
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(corr)) < 0.02


def test_degenerate_rows_never_pick_outside_the_vocabulary():
    """Found by fuzzing the server: a temperature of 1e-300 overflowed the logits to NaN, and the draw returned an
    index one past the vocabulary. Temperatures below 1e-5 are greedy; a row without positive mass gets its argmax."""
    from kvfree.engine.core.sampling import draw

    logits = _randn(3, 30, seed=71, scale=2.0)
    out = _sample(logits[:2], [SamplingParams(temperature=1e-300, seed=1), SamplingParams(temperature=5e-6, seed=2)])
    assert torch.equal(out.token_ids, logits[:2].argmax(-1))
    probs = torch.full((2, 30), float("nan"))
    probs[1] = 0.0
    picks = draw(probs, torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert ((picks >= 0) & (picks < 30)).all()


def test_llm_logit_bias_steers_generation(llm):
    """Through the engine: a banned token never appears where greedy decoding chose it, and a +100 token is all
    that is generated."""
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    banned = free.token_ids[0]
    steered = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={banned: -100}))[0]  # fmt: skip
    assert banned not in steered.token_ids
    forced = llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True,
                                                 logit_bias={65: 100}))[0]  # fmt: skip
    assert forced.token_ids == [65] * 5
