"""Prefill steps padded to a bucket for CUDA graphs: the device-metadata path of the Mamba-2 and conv prefill kernels
(interpreted on the CPU), the bucket and padding logic, the padded prefill through a whole model, and (on a GPU only)
graph-replayed prefill against eager through `LLM.generate`.

A padded step is the real sequences, then one sequence of padding tokens on the pool's scratch row, then sentinel
sequences of length 0 on the scratch row (engine/model/step_batch.py, `pad_prefill`).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvfree.engine.core.cuda_graphs import prefill_bucket, prefill_token_sizes  # noqa: E402
from kvfree.engine.core.model_runner import ModelRunner, graph_blockers  # noqa: E402
from kvfree.engine.model.step_batch import StepBatch, pad_prefill  # noqa: E402
from kvfree.engine.state.pool import StatePool  # noqa: E402
from kvfree.kernels.conv import chunk as conv_chunk  # noqa: E402
from kvfree.kernels.conv import reference as conv_ref  # noqa: E402
from kvfree.kernels.dispatch import DeviceChunks, chunk_metadata, device_chunk_metadata  # noqa: E402
from kvfree.kernels.mamba2 import chunk as m2_chunk  # noqa: E402
from kvfree.kernels.mamba2 import reference as m2_ref  # noqa: E402
from tests.conftest import make_model, random_ids, rel_err  # noqa: E402
from tests.kernel_checks import DEVICE, cu_of, rel, seed, untouched  # noqa: E402
from tests.kernels.test_mamba2 import TOL, as64, make_pool, mamba_inputs, ssd_args, ssd_params  # noqa: E402

f64 = torch.float64
REAL = [1, 37, 2, 16, 5]  # 61 tokens: one token, several chunks, a partial chunk


def padded_lens(pad_tokens: int, sentinels: int) -> list[int]:
    """The real lengths, a padding sequence of `pad_tokens` (0 when the step fills its bucket), empty sentinels."""
    return [*REAL, pad_tokens, *[0] * sentinels]


def padded_rows(g: torch.Generator, S: int, shape: tuple[int, ...], dtype: torch.dtype, n_seqs: int):
    """A random pool, distinct rows for the real sequences and one scratch row named by every other sequence."""
    pool, rows = make_pool(g, S, shape, dtype, len(REAL) + 1)
    scratch = rows[len(REAL) :]
    idx = torch.cat([rows[: len(REAL)], scratch.expand(n_seqs - len(REAL))])
    return pool, idx


# -- the device metadata ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [[1, 37, 2, 0, 16, 5, 50], [0], [64, 0, 0], [3], [16, 16]])
@pytest.mark.parametrize("chunk", [4, 16])
def test_device_chunk_metadata_is_the_host_metadata_then_skipped_entries(lens, chunk):
    cu = cu_of(lens)
    indices, offsets, bound = device_chunk_metadata(cu, chunk, sum(lens))
    host, host_offsets, count = chunk_metadata(tuple(cu.tolist()), chunk, DEVICE)
    assert bound == (sum(lens) + len(lens) * (chunk - 1)) // chunk >= count
    assert indices.shape == (bound, 2) and indices.dtype == torch.int32
    assert torch.equal(indices[:count], host) and torch.equal(offsets, host_offsets)
    assert (indices[count:] == torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)).all()


def test_device_chunks_compute_once_per_chunk_size_and_refuse_other_boundaries():
    cu = cu_of([5, 0, 9])
    chunks = DeviceChunks(cu, 14)
    assert chunks.get(4) is chunks.get(4) and chunks.get(8) is not chunks.get(4)
    chunks.check(cu, 14)
    with pytest.raises(ValueError, match="device_chunks describe"):
        chunks.check(cu.clone(), 14)
    with pytest.raises(ValueError, match="device_chunks describe"):
        chunks.check(cu, 15)


# -- the kernels on a padded step ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, H, P, N, G, chunk, pad_tokens, sentinels",
    [
        (torch.float32, 2, 8, 16, 2, 8, 3, 2),  # the test models' odd sizes (P=8 < a block, chunk 8 -> 16)
        (torch.float32, 4, 16, 16, 1, 16, 0, 3),  # a step that fills its bucket: the padding sequence is empty too
        (torch.bfloat16, 2, 16, 16, 1, 32, 19, 1),
    ],
)
def test_chunk_mamba2_with_device_metadata_matches_reference_on_a_padded_step(
    poison, dtype, H, P, N, G, chunk, pad_tokens, sentinels
):
    g = seed("padded", dtype, H, P, N, G, chunk, pad_tokens)
    lens = padded_lens(pad_tokens, sentinels)
    T = sum(lens)
    inp = mamba_inputs(g, T, H, P, N, G, dtype)
    pool, idx = padded_rows(g, 11, (H, P, N), torch.float32, len(lens))
    cu = cu_of(lens)
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)

    y = m2_chunk.chunk_mamba2(
        *ssd_args(inp), pool, idx, cu, *ssd_params(inp), None, chunk, device_chunks=DeviceChunks(cu, T)
    )
    y_ref = m2_ref.chunk_mamba2(*ssd_args(as64(inp)), ref_pool, idx, cu, *ssd_params(as64(inp)), None, chunk)
    assert y.dtype == dtype and y.shape == inp["x"].shape
    assert rel(y, y_ref) <= TOL[dtype]
    named = idx.unique().long()  # the real rows and the scratch row (the padding sequence's final state, if any)
    assert rel(pool[named], ref_pool[named]) <= TOL[dtype]
    assert torch.equal(untouched(pool, idx), rest)


@pytest.mark.parametrize("pad_tokens, sentinels", [(3, 2), (0, 1), (40, 4)])
def test_conv_with_device_metadata_matches_reference_on_a_padded_step(poison, pad_tokens, sentinels):
    g = seed("padded conv", pad_tokens, sentinels)
    C, K = 40, 4
    lens = padded_lens(pad_tokens, sentinels)
    T = sum(lens)
    cu = cu_of(lens)
    x = torch.randn(T, C + 5, generator=g)[:, 2 : C + 2].to(DEVICE)  # a strided view, as the layer's split
    w, b = torch.randn(C, K, generator=g).to(DEVICE), torch.randn(C, generator=g).to(DEVICE)
    pool, idx = padded_rows(g, 9, (K - 1, C), torch.float32, len(lens))
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)

    y = conv_chunk.chunk_causal_conv1d(x, pool, idx, cu, w, b, "silu", device_chunks=DeviceChunks(cu, T))
    y_ref = conv_ref.chunk_causal_conv1d(x.to(f64), ref_pool, idx, cu, w.to(f64), b.to(f64), "silu")
    assert rel(y, y_ref) <= TOL[torch.float32]
    assert torch.equal(pool.to(f64), ref_pool)  # tails are copies: the named rows exact, the others untouched
    assert torch.equal(untouched(pool, idx), rest)


# -- buckets and padding (pure Python) -------------------------------------------------------------------------------
def test_prefill_token_buckets():
    assert prefill_token_sizes(1) == [64, 128, 256]
    assert prefill_token_sizes(2048) == [64, 128, *range(256, 2049, 256)]
    assert prefill_token_sizes(1000)[-1] == 1024  # the budget rounded up to a bucket
    with pytest.raises(ValueError):
        prefill_token_sizes(0)


def test_prefill_bucket_holds_the_tokens_and_one_more_sequence():
    sizes = prefill_token_sizes(1024)
    assert prefill_bucket(1, 1, sizes) == (64, 2)
    assert prefill_bucket(64, 1, sizes) == (64, 2)  # a full token bucket still gets its (empty) padding sequence
    assert prefill_bucket(65, 2, sizes) == (128, 4)  # 2 sequences + the padding one
    assert prefill_bucket(300, 3, sizes) == (512, 4)
    assert prefill_bucket(1024, 63, sizes) == (1024, 64)
    assert prefill_bucket(1025, 1, sizes) is None  # more tokens than the largest bucket: eager
    assert prefill_bucket(100, 64, sizes) is None  # more sequences than the largest bucket: eager
    assert prefill_bucket(100, 5, sizes, seq_sizes=(4, 6)) == (128, 6)


def test_pad_prefill_lays_out_sentinels_on_the_scratch_slot():
    layout = pad_prefill([4, 1, 7], [5, 1, 3], tokens=64, seqs=8, scratch_slot=9)
    assert (layout.real, layout.tokens, layout.seqs) == (3, 64, 8)
    assert layout.slots == (4, 1, 7, 9, 9, 9, 9, 9)
    assert layout.cu_seqlens == (0, 5, 6, 9, 64, 64, 64, 64, 64)  # the padding sequence holds tokens 9..63
    assert layout.last_token_indices == (4, 5, 8, 63, 63, 63, 63, 63)
    assert layout.host_buffer([11] * 9) == [*[11] * 9, *[0] * 55, *layout.slots, *layout.cu_seqlens,
                                            *layout.last_token_indices]  # fmt: skip
    full = pad_prefill([2], [64], tokens=64, seqs=2, scratch_slot=9)  # fills its bucket: an empty padding sequence
    assert (full.slots, full.cu_seqlens, full.last_token_indices) == ((2, 9), (0, 64, 64), (63, 63))
    with pytest.raises(ValueError):
        pad_prefill([1, 2], [3, 4], tokens=64, seqs=2, scratch_slot=9)  # no room for the padding sequence
    with pytest.raises(ValueError):
        pad_prefill([1], [65], tokens=64, seqs=2, scratch_slot=9)
    with pytest.raises(ValueError):
        pad_prefill([1], [0], tokens=64, seqs=2, scratch_slot=9)
    with pytest.raises(ValueError):
        full.host_buffer([1] * 3)


def test_padded_step_batch_views_one_buffer():
    layout = pad_prefill([3, 0], [2, 4], tokens=64, seqs=4, scratch_slot=5)
    buffer = torch.tensor(layout.host_buffer([7, 8, 9, 10, 11, 12]), dtype=torch.int32)
    ids, batch = StepBatch.padded(buffer, layout.tokens, layout.seqs)
    assert ids.tolist() == [7, 8, 9, 10, 11, 12, *[0] * 58]
    assert batch.state_indices.tolist() == [3, 0, 5, 5] and batch.cu_seqlens.tolist() == [0, 2, 6, 64, 64]
    assert batch.last_token_indices.tolist() == [1, 5, 63, 63]
    assert batch.cu_seqlens_cpu is None and not batch.is_decode  # as captured: no host boundaries
    assert batch.device_chunks.cu_seqlens is batch.cu_seqlens and batch.device_chunks.total == 64
    assert all(t.data_ptr() >= buffer.data_ptr() for t in (ids, batch.state_indices, batch.last_token_indices))


# -- the padded prefill through a whole model ------------------------------------------------------------------------
def _random_pool(model, capacity: int, seed_: int) -> StatePool:
    pool = StatePool(model, capacity=capacity)
    g = torch.Generator().manual_seed(seed_)
    for state in pool.tensors:
        for t in state.values():
            if t.is_floating_point():
                t[: capacity + 1].copy_(torch.randn(t[: capacity + 1].shape, generator=g).to(t.device))  # +scratch
    return pool


def _padded_prefill_matches_unpadded(model, slots: list[int], prompts: list[list[int]], bucket, tol: float) -> None:
    """Prefill `prompts` into `slots` unpadded (host metadata) and padded to `bucket` (device metadata, no host
    boundaries, as a graph runs it) from the same pool: the same logits, the same real rows, and no other row but
    the scratch slot touched."""
    lens = [len(p) for p in prompts]
    device = model.device
    pools = [_random_pool(model, 6, 0), _random_pool(model, 6, 0)]
    before = [{k: t.clone() for k, t in state.items()} for state in pools[1].tensors]
    ids = [t for p in prompts for t in p]
    plain = model.prefill(torch.tensor(ids, device=device), pools[0].tensors, StepBatch.prefill(slots, lens, device))

    layout = pad_prefill(slots, lens, *bucket, scratch_slot=pools[1].scratch_slot)
    buffer = torch.tensor(layout.host_buffer(ids), dtype=torch.int32, device=device)
    padded_ids, batch = StepBatch.padded(buffer, layout.tokens, layout.seqs)
    padded = model.prefill(padded_ids, pools[1].tensors, batch)[: len(slots)]

    assert rel_err(padded, plain) <= tol
    others = [s for s in range(6) if s not in slots]
    for unpadded, state, saved in zip(pools[0].tensors, pools[1].tensors, before, strict=True):
        for name, t in state.items():
            assert rel_err(t[slots], unpadded[name][slots]) <= tol, name
            assert torch.equal(t[others], saved[name][others]), name  # sessions outside the step: untouched
            assert torch.equal(t[pools[1].template_slot], saved[name][pools[1].template_slot]), name


@pytest.mark.parametrize("bucket", [(64, 4), (128, 8)])
def test_padded_prefill_gives_the_unpadded_logits_and_states_on_the_reference_path(monkeypatch, bucket):
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    model = make_model(["mamba2", "mamba2"], mlp=True)
    prompts = [random_ids(n, seed=n) for n in (23, 1, 17)]
    _padded_prefill_matches_unpadded(model, [4, 0, 2], prompts, bucket, tol=1e-5)


def test_padded_prefill_gives_the_unpadded_logits_and_states_through_the_interpreted_kernels(monkeypatch):
    """The same through the Triton kernels (interpreted on the CPU): the device-metadata path of the conv and SSD
    kernels inside the model, the padding sequence and a sentinel on the scratch slot."""
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    model = make_model(["mamba2"]).to(DEVICE)
    prompts = [random_ids(n, seed=n) for n in (21, 2)]
    _padded_prefill_matches_unpadded(model, [3, 1], prompts, (64, 4), tol=1e-5)


def test_only_all_mamba2_models_on_the_triton_kernels_capture_their_prefill(monkeypatch):
    monkeypatch.setenv("KVFREE_KERNELS", "triton")  # without a GPU, under the interpreter (conftest)
    assert graph_blockers(make_model(["mamba2", "mamba2"], mlp=True).to(DEVICE), prefill=True) == []
    model = make_model(["mamba2", "gka", "attention"]).to(DEVICE)
    kinds = [b.split(":")[0] for b in graph_blockers(model, prefill=True)]
    assert kinds == ["gka", "attention"]
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    assert "reference" in graph_blockers(make_model(["mamba2"]), prefill=True)[0]


def test_cpu_runner_prefills_eagerly():
    model = make_model(["mamba2"])
    runner = ModelRunner(model, StatePool(model, capacity=2))
    assert runner.prefill_graphs is None


# -- on a GPU: graph-replayed prefill through the engine -------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_prefill_gives_the_eager_tokens_through_llm_generate():
    """Prompt mixes that hit a token bucket exactly, pad one, pad the sequences, need the largest sequence bucket,
    and exceed the graphs (eager): each run twice through the graphs (the first meets its buckets: an eager step on
    the graph's buffers, then the capture; the second replays), every time the eager engine's greedy tokens."""
    from kvfree import LLM, SamplingParams
    from tests.paths import TINY_CHECKPOINT

    params = SamplingParams(max_tokens=12, temperature=0)
    graphed = LLM(TINY_CHECKPOINT, max_sessions=72, prefill_chunk=1024)
    eager = LLM(TINY_CHECKPOINT, max_sessions=72, prefill_chunk=1024, enforce_eager=True)
    graphs = graphed.runner.prefill_graphs
    assert graphs is not None and eager.runner.prefill_graphs is None
    byte = list(range(32, 127))
    mixes = {
        "one short prompt": ["hello"],
        "one prompt filling a bucket": [byte[:64]],
        "five prompts": [f"prompt {i}: " + "abc" * (5 * i) for i in range(5)],
        "37 prompts (the 64-sequence bucket)": [f"p{i} " + "xy" * (i % 9) for i in range(37)],
        "a long prompt (several chunks of 1024 tokens)": ["long " * 500],
        "70 prompts (beyond the sequence buckets: eager)": [f"{i}" for i in range(70)],
    }
    for name, prompts in mixes.items():
        want = [o.token_ids for o in eager.generate(prompts, params)]
        for attempt in ("capture", "replay"):
            got = [o.token_ids for o in graphed.generate(prompts, params)]
            assert got == want, (name, attempt)
    captured = {key for key, entry in graphs.graphs.items() if entry.graph is not None}
    assert (64, 2) in captured and (1024, 2) in captured and any(n == 64 for _, n in captured), captured

    # A bucket captured ahead of its first step (a warm-up on the scratch slot) serves it by replay alone.
    prompts = [f"{i:02d} " + "mn" * 16 for i in range(20)]  # 20 prompts of ~35 tokens: the (768, 32) bucket
    assert (768, 32) not in graphs.graphs
    graphs.capture(768, 32)
    assert graphs.graphs[(768, 32)].graph is not None
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert set(graphs.graphs) - captured == {(768, 32)}  # no other bucket met


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_server_captures_every_bucket_of_its_step_budget_before_its_first_request():
    """`capture_up_to` (what a serving engine calls at start-up) captures each (token, sequence) bucket a step of the
    budget can meet, once; steps then replay without a capture, and give the eager tokens."""
    from kvfree import LLM, SamplingParams
    from kvfree.engine.core.cuda_graphs import PREFILL_SEQ_SIZES
    from tests.paths import TINY_CHECKPOINT

    graphed = LLM(TINY_CHECKPOINT, max_sessions=16, prefill_chunk=512)
    eager = LLM(TINY_CHECKPOINT, max_sessions=16, prefill_chunk=512, enforce_eager=True)
    graphs = graphed.runner.prefill_graphs
    assert graphs.capture_up_to(300) == 4 * len(PREFILL_SEQ_SIZES)  # tokens 64, 128, 256, 512
    buckets = {(t, n) for t in (64, 128, 256, 512) for n in PREFILL_SEQ_SIZES}
    assert {key for key in graphs.graphs if graphs.captured(key)} == buckets
    assert graphs.capture_up_to(300) == 0  # nothing new
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [f"prompt {i}: " + "ab" * (7 * i) for i in range(9)]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert set(graphs.graphs) == buckets  # every step was a replay of a bucket captured ahead
