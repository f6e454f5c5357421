"""An fp8 (e4m3) KV cache (`--kv-cache-dtype fp8`): a quarter of an fp32 cache's bytes, a scale per session and KV
head, answers that follow the unquantized model's, snapshots that keep the setting, calibrated scales from the
checkpoint, and the same at TP=2."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfree.engine.llm import LLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import SamplingParams, SnapshotMismatchError
from tests.engine.test_tensor_parallel import HYBRID, PROMPTS, assert_two_ranks_match_one, hybrid_checkpoint

# HYBRID with more KV-cache layers: full attention twice (one with a single KV head), a sliding window, Mamba-2.
FP8_MODEL = dict(HYBRID, layers=["attention", "mamba2", "attention", "swa"])
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return hybrid_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", FP8_MODEL)


def _llm(path: str, kv: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_sessions=4, max_context=128, kv_cache_dtype=kv, **kw)


def test_an_fp8_cache_holds_a_quarter_of_an_fp32_one_and_its_answers_follow_the_unquantized_model(checkpoint):
    """Per token: 2 x Hkv x D bytes per attention layer instead of 4 times that; greedy completions of prompts of
    several lengths keep nearly every token, and the log-probability of the chosen token moves by little."""
    exact, fp8 = _llm(checkpoint, "auto"), _llm(checkpoint, "fp8")
    heads = [FP8_MODEL["attention"]["num_kv_heads"]] * 2  # the two full-attention layers (swa's ring is fixed-size)
    per_token = sum(2 * h * FP8_MODEL["attention"]["head_dim"] for h in heads)
    assert fp8.pool.bytes_per_token() == per_token and exact.pool.bytes_per_token() == 4 * per_token
    prompts = [*PROMPTS, list(range(40, 100))]
    a, b = exact.generate(prompts, GREEDY), fp8.generate(prompts, GREEDY)
    same = sum(x == y for u, v in zip(a, b, strict=True) for x, y in zip(u.token_ids, v.token_ids, strict=True))
    assert same >= 0.9 * sum(len(u.token_ids) for u in a)
    # The prefill's token attends to the prompt unquantized (a chunk's own keys are not read back): equal. Each
    # decode step reads the quantized cache: close, not equal, while the two completions agree.
    assert all(u.logprobs[0].logprob == v.logprobs[0].logprob for u, v in zip(a, b, strict=True))
    pairs = [(x.logprob, y.logprob) for u, v in zip(a, b, strict=True)
             for x, y in zip(u.logprobs[1:], v.logprobs[1:], strict=True) if x.token_id == y.token_id]  # fmt: skip
    assert all(abs(x - y) < 0.1 for x, y in pairs) and any(x != y for x, y in pairs)


def test_an_fp8_session_restores_into_an_fp8_pool_and_is_refused_by_an_unquantized_one(checkpoint):
    """A session's state, its (non-default) scales included, moves to another fp8 pool and decodes on exactly as it
    would have; a pool that keeps its cache unquantized refuses it, naming the setting."""
    src, dst, other = _llm(checkpoint, "fp8"), _llm(checkpoint, "fp8"), _llm(checkpoint, "auto")
    slot = src.pool.alloc()
    ids = torch.tensor(PROMPTS[0])
    src.model.prefill(ids, src.pool.tensors, StepBatch.prefill([slot], [len(ids)], src.model.device))
    # Scales away from the pools' 1.0 (as calibration would leave them), so that a restore that dropped or ignored
    # them would decode differently.
    scaled = [t for layer in src.pool.tensors for n, t in layer.items() if n.endswith("_scale")]
    assert scaled
    for t in scaled:
        t[slot] = 0.5 + torch.rand(t[slot].shape, generator=torch.Generator().manual_seed(t.numel()))
    state = src.pool.export_packed(slot).wait()
    there = dst.pool.alloc()
    dst.pool.import_packed(there, state)
    for layer_src, layer_dst in zip(src.pool.tensors, dst.pool.tensors, strict=True):
        for n, t in layer_src.items():
            if n.endswith("_scale"):
                assert torch.equal(layer_dst[n][there], t[slot]), n

    def steps(llm: LLM, s: int) -> list[int]:
        token, out = torch.tensor([7]), []
        for _ in range(6):
            token = llm.model.decode(token, llm.pool.tensors, StepBatch.decode([s], llm.model.device)).argmax(-1)
            out.append(int(token))
        return out

    assert steps(src, slot) == steps(dst, there)
    with pytest.raises(SnapshotMismatchError, match="--kv-cache-dtype fp8, this server keeps it with --kv-cache"):
        other.pool.import_packed(other.pool.alloc(), state)


def test_calibrated_scales_in_the_checkpoint_start_each_session_and_bad_ones_are_refused(checkpoint, tmp_path):
    """`layers.0.mixer.k_scale` / `v_scale` ([Hkv], as vLLM's fp8 checkpoints) become every new session's scales;
    a scale that is not a finite positive number is refused with the tensor's name."""
    import shutil

    from kvfree.checkpoints import CheckpointError

    path = tmp_path / "scaled"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["layers.0.mixer.k_scale"] = torch.tensor([0.5])
    tensors["layers.0.mixer.v_scale"] = torch.tensor([2.0])
    save_file(tensors, path / "model.safetensors")
    llm = _llm(str(path), "fp8")
    slot = llm.pool.alloc()
    state = llm.pool.tensors[0]
    assert state["k_scale"][slot].tolist() == [0.5] and state["v_scale"][slot].tolist() == [2.0]
    assert llm.pool.tensors[3]["k_scale"][slot].tolist() == [1.0, 1.0]  # the swa layer: none shipped
    tensors["layers.0.mixer.k_scale"] = torch.tensor([-1.0])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.0.mixer.k_scale.*finite positive"):
        _llm(str(path), "fp8")


def test_an_fp8_cache_split_over_two_ranks_gives_one_ranks_logits(tmp_path):
    """KV heads (and their scales) by rank, one KV head held by both: the logits of one rank. (A state byte may
    differ by one e4m3 step where the ranks' projections round differently: states compared to e4m3's rounding.)"""
    assert_two_ranks_match_one(tmp_path, FP8_MODEL, rtol=0.07, atol=1e-3, kv_cache_dtype="fp8")


@pytest.mark.parametrize("fixture", ["gka_fp32", "m2_fp32", "gka_lowrank_fp32"])
def test_on_hmfs_fixtures_an_fp8_cache_keeps_the_greedy_tokens_and_logits_close(fixture, tmp_path):
    """hmf's own small random hybrids (Qwen3 attention with GKA or Mamba-2 between, converted): teacher-forced decode
    over an fp8 cache against an fp32 one (kvfree/bench/kv_cache_quality.py). The figures of a full run are in
    BENCHMARKS.md; these are floors."""
    from kvfree.bench.kv_cache_quality import compare
    from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
    from kvfree.checkpoints.hf_hmf import convert_hmf
    from kvfree.engine.model.loader import load_model
    from tests.paths import ROOT

    write_byte_tokenizer(tmp_path / "tok")
    path = convert_hmf(ROOT / "tests/fixtures/hmf" / fixture, tmp_path / "m", tokenizer_from=tmp_path / "tok")
    row = compare(load_model(path, device="cpu", dtype="float32"), prompts=4, prompt_tokens=48, steps=12)
    assert row["kv_bytes_per_token"]["fp8"] * 4 == row["kv_bytes_per_token"]["auto"]
    # Random weights leave the top logits close together, so a small error flips some greedy choices.
    assert 1e-5 < row["logit_rel_error_median"] < 0.05 and row["greedy_agreement"] >= 0.8
