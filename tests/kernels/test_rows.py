"""The row ops (kernels/rows): copy, gather to a flat buffer and scatter from one. Triton (under the interpreter on
the CPU) against the reference bit for bit, over tables of several dtypes and row shapes (every word width the kernel
picks, rows of several pieces, zero-filled tensors, empty rows), rows not named as dst untouched, one launch per call,
the dispatch, and the checks of the arguments."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.rows as rows_ops  # noqa: E402
from kvfree.kernels.rows import RowTable, copy_rows, gather_rows, reference, scatter_rows  # noqa: E402
from kvfree.kernels.rows import copy as rows_copy  # noqa: E402
from tests.kernel_checks import DEVICE, seed  # noqa: E402

f32, bf16, f16, i64, i32 = torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (row shape, dtype) per tensor, and the word the table must pick: the widest of 16/8/4/2/1 bytes dividing every row.
TABLES = {
    "16-byte words": ([((4, 1100), f32), ((3, 40), bf16), ((2, 6), i64)], 16),  # the fp32 row is two 16 KB pieces
    "8-byte words": ([((2, 2100), f32), ((), i64), ((8,), bf16)], 8),  # the int64 scalar row (a layer's length)
    "2-byte words": ([((3, 7), bf16), ((5, 5), f32), ((), i64)], 2),  # 42-byte rows
    "1-byte words": ([((5,), torch.uint8), ((3, 3), f32)], 1),
}


Spec = list[tuple[tuple[int, ...], torch.dtype]]


def random_tensors(g: torch.Generator, rows: int, spec: Spec) -> list[torch.Tensor]:
    """Random `[rows, *shape]` tensors, no element zero (a row copied from nowhere cannot pass for a copy)."""
    out = []
    for shape, dtype in spec:
        if dtype.is_floating_point:  # magnitudes in [0.5, 1.5), either sign
            sign = torch.randint(0, 2, (rows, *shape), generator=g) * 2 - 1
            t = (torch.rand(rows, *shape, generator=g) + 0.5) * sign
        else:
            high = {torch.uint8: 2**7, i32: 2**31 - 1}.get(dtype, 2**40)  # (no wrap to 0 in the cast)
            t = torch.randint(1, high, (rows, *shape), generator=g)
        out.append(t.to(dtype).to(DEVICE))
    return out


def pairs(g: torch.Generator, rows: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k (src, dst) pairs: distinct dst rows, none of them a src; srcs may repeat (a reset copies one row to many)."""
    perm = torch.randperm(rows, generator=g)
    dst = perm[:k]
    src = perm[k:][torch.randint(0, rows - k, (k,), generator=g)]
    return src.to(DEVICE, dtype), dst.to(DEVICE, dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, to compare floats bit for bit."""
    return t.view(torch.uint8) if t.dim() and t.element_size() > 1 else t


@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize("k, index_dtype", [(1, torch.int32), (5, torch.int64), (6, torch.int32)])
@pytest.mark.parametrize("zero_fill", [False, True])
def test_triton_copy_equals_the_reference_bit_for_bit(name, k, index_dtype, zero_fill):
    """With zero_fill, every other tensor's dst rows are zeroed instead of copied."""
    spec, word = TABLES[name]
    g = seed("rows", name, k, index_dtype, zero_fill)
    rows = 13
    original = random_tensors(g, rows, spec)
    flags = [zero_fill and i % 2 == 1 for i in range(len(spec))]
    ours, theirs = [t.clone() for t in original], [t.clone() for t in original]
    table = RowTable(ours, zero_fill=flags)
    assert table.word == word
    src, dst = pairs(g, rows, k, index_dtype)
    rows_copy.copy_rows(table, src, dst)
    reference.copy_rows(RowTable(theirs, zero_fill=flags), src, dst)
    untouched = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    untouched[dst.long()] = False
    for got, expect, before, zero in zip(ours, theirs, original, flags, strict=True):
        assert torch.equal(bits(got), bits(expect))
        copied = torch.zeros_like(before[src.long()]) if zero else before[src.long()]
        assert torch.equal(bits(got[dst.long()]), bits(copied))
        assert torch.equal(bits(got[untouched]), bits(before[untouched]))


def test_tables_hold_rows_of_any_count_and_size():
    """Row counts may differ (indices must fit the fewest), and tensors with empty rows are carried but not copied."""
    g = seed("rows", "counts")
    a, b = random_tensors(g, 9, [((4, 3), f32)])[0], random_tensors(g, 6, [((5,), i64)])[0]
    empty = torch.zeros(9, 0, 3, device=DEVICE)
    table = RowTable([a, empty, b])
    assert (table.rows, len(table), table.bases.shape[0]) == (6, 3, 2)
    expect_a, expect_b = a.clone(), b.clone()
    expect_a[[0, 2]], expect_b[[0, 2]] = a[[5, 5]], b[[5, 5]]
    rows_copy.copy_rows(table, torch.tensor([5, 5], device=DEVICE), torch.tensor([0, 2], device=DEVICE))
    assert torch.equal(a, expect_a) and torch.equal(b, expect_b)


@pytest.fixture
def launches(monkeypatch) -> list:
    """The grids of the row kernel's launches, the Triton path forced (interpreted on the CPU)."""
    grids: list = []
    launch = rows_copy.launch_kernel
    monkeypatch.setattr(
        rows_copy,
        "launch_kernel",
        lambda kernel, grid, *a, **kw: (grids.append(grid), launch(kernel, grid, *a, **kw)),
    )
    monkeypatch.setattr(rows_ops, "use_triton", lambda device: True)
    return grids


def test_one_launch_copies_every_tensor_for_every_pair(launches):
    g = seed("rows", "launches")
    tensors = random_tensors(g, 8, [((3, 5), f32), ((4, 1100), f32), ((), i64), ((6,), bf16)] * 5)  # 20 tensors
    before = [t.clone() for t in tensors]
    table = RowTable(tensors)
    copy_rows(table, torch.tensor([0, 1, 2], device=DEVICE), torch.tensor([5, 6, 7], device=DEVICE))
    assert launches == [(3 * table.pieces,)]
    assert all(torch.equal(t[5:], b[:3]) and torch.equal(t[:5], b[:5]) for t, b in zip(tensors, before, strict=True))
    copy_rows(table, torch.tensor([], dtype=i64, device=DEVICE), torch.tensor([], dtype=i64, device=DEVICE))
    assert len(launches) == 1  # nothing to copy: no launch


def test_kvfree_kernels_chooses_the_implementation(monkeypatch):
    calls = []
    monkeypatch.setattr(rows_copy, "copy_rows", lambda *a: calls.append("triton"))
    monkeypatch.setattr(reference, "copy_rows", lambda *a: calls.append("reference"))
    table = RowTable([torch.ones(4, 2)])
    src, dst = torch.tensor([0]), torch.tensor([1])
    for mode in ("reference", "auto", "triton"):
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        copy_rows(table, src, dst)
    assert calls == ["reference", "reference", "triton"]  # auto: Triton on CUDA devices only


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([0, 1], [1, 2], "both a src and a dst"),
        ([0, 0], [3, 3], "more than once"),
        ([0], [4], "out of range"),
        ([-1], [2], "out of range"),
    ],
)
def test_bad_pairs_are_refused_before_anything_is_copied(src, dst, message):
    t = torch.arange(8.0).view(4, 2)
    before = t.clone()
    with pytest.raises(ValueError, match=message):
        copy_rows(RowTable([t]), torch.tensor(src), torch.tensor(dst))
    assert torch.equal(t, before)


def test_bad_tables_and_indices_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        RowTable([torch.zeros(4, 6)[:, ::2]])
    with pytest.raises(ValueError, match="contiguous"):
        RowTable([torch.zeros(())])
    with pytest.raises(ValueError, match="zero_fill"):
        RowTable([torch.zeros(4, 2)], zero_fill=[True, False])
    table = RowTable([torch.zeros(4, 2)])
    with pytest.raises(ValueError, match="int32/int64"):
        copy_rows(table, torch.tensor([0.0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"\[K\]"):
        copy_rows(table, torch.tensor([0, 1]), torch.tensor([2]))


# Tables for the flat ops: every dtype, odd row sizes, and a tensor of empty rows (which takes no bytes of a flat row).
FLAT_TABLES = {
    "16-byte words": ([((3, 1400), f32), ((2, 8), bf16), ((0, 3), f32), ((2,), i64), ((4,), i32), ((8,), f16)], 16),
    "8-byte words": ([((2, 5), f32), ((), i64), ((3, 4), f16), ((6,), i32), ((4,), bf16)], 8),
    "4-byte words": ([((3, 7), f32), ((5,), i32), ((2, 3), bf16), ((), i64), ((2,), f16)], 4),
    "2-byte words": ([((3, 7), bf16), ((5,), f16), ((0,), i64), ((), i32), ((2, 3), f32)], 2),
    "1-byte words": ([((5,), torch.uint8), ((3, 3), f32), ((3,), f16), ((), i64)], 1),
}


def random_bytes(g: torch.Generator, k: int, n: int) -> torch.Tensor:
    """A `[k, n]` uint8 flat buffer of random non-zero bytes (a byte never written cannot pass for a copied one)."""
    return torch.randint(1, 256, (k, n), generator=g, dtype=torch.uint8).to(DEVICE)


def flat_of(tensors: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """What gather_rows must give, built independently of the code under test: each tensor's rows as bytes, side by
    side in table order."""
    k = rows.shape[0]
    return torch.cat([t[rows.long()].reshape(k, -1).view(torch.uint8) for t in tensors if t[0].numel()], dim=1)


def distinct_rows(g: torch.Generator, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randperm(rows, generator=g)[:k].to(DEVICE, dtype)


@pytest.mark.parametrize("name", list(FLAT_TABLES))
@pytest.mark.parametrize("k, index_dtype", [(1, i32), (3, i64)])
def test_triton_gather_and_scatter_equal_the_reference_bit_for_bit(name, k, index_dtype):
    """Every other tensor is marked zero_fill, which gather and scatter ignore: they move every tensor's bytes."""
    spec, word = FLAT_TABLES[name]
    g = seed("rows", "flat", name, k, index_dtype)
    n_rows = 7
    original = random_tensors(g, n_rows, spec)
    flags = [i % 2 == 1 for i in range(len(spec))]
    ours, theirs = [t.clone() for t in original], [t.clone() for t in original]
    table, ref_table = RowTable(ours, zero_fill=flags), RowTable(theirs, zero_fill=flags)
    assert table.word == word
    rows = distinct_rows(g, n_rows, k, index_dtype)

    flat = random_bytes(g, k, table.row_bytes)
    expect = flat.clone()
    rows_copy.gather_rows(table, rows, flat)
    reference.gather_rows(ref_table, rows, expect)
    assert torch.equal(flat, expect)
    assert torch.equal(flat, flat_of(original, rows))
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip(ours, original, strict=True))  # gather writes no row

    flat = random_bytes(g, k, table.row_bytes)
    rows_copy.scatter_rows(table, flat, rows)
    reference.scatter_rows(ref_table, flat, rows)
    assert torch.equal(flat_of(ours, rows), flat)
    untouched = torch.ones(n_rows, dtype=torch.bool, device=DEVICE)
    untouched[rows.long()] = False
    for got, expect_t, before in zip(ours, theirs, original, strict=True):
        assert torch.equal(bits(got), bits(expect_t))
        assert torch.equal(bits(got[untouched]), bits(before[untouched]))


def test_gather_then_scatter_into_other_rows_round_trips_in_one_launch_each(launches):
    g = seed("rows", "round trip")
    spec, _ = FLAT_TABLES["16-byte words"]
    tensors = random_tensors(g, 9, spec)
    before = [t.clone() for t in tensors]
    table = RowTable(tensors)
    src, dst = torch.tensor([4, 0, 7], device=DEVICE), torch.tensor([2, 8, 5], dtype=i32, device=DEVICE)
    flat = random_bytes(g, 3, table.row_bytes)
    gather_rows(table, src, flat)
    scatter_rows(table, flat, dst)
    assert launches == [(3 * table.pieces,)] * 2
    kept = [0, 1, 3, 4, 6, 7]
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(bits(t[dst.long()]), bits(b[src]))
        assert torch.equal(bits(t[kept]), bits(b[kept]))
    copied = [b.clone() for b in before]
    copy_rows(RowTable(copied), src, dst)  # the same as a row copy
    assert all(torch.equal(bits(t), bits(c)) for t, c in zip(tensors, copied, strict=True))


def test_a_flat_row_holds_every_tensor_at_its_offset():
    a, b, c = torch.ones(4, 3, 4), torch.ones(4, 0, 2), torch.ones(5, 5, dtype=i64)
    table = RowTable([a, b, c, torch.ones(4, dtype=f16)])
    assert (table.row_bytes, table.offsets, table.word) == (48 + 40 + 2, (0, 48, 48, 88), 2)
    assert table.flat_start.tolist() == [0, 24, 44]  # in 2-byte words, the empty tensor left out
    assert RowTable([]).row_bytes == 0 and RowTable([]).offsets == ()


def test_bad_flats_and_rows_are_refused_before_anything_is_moved():
    t = torch.arange(12.0).view(4, 3)
    table = RowTable([t, torch.ones(4, 2, dtype=i64)])  # 28-byte rows, 4-byte words
    rows = torch.tensor([0, 2])
    good = torch.full((2, 28), 7, dtype=torch.uint8)
    sevens = good.clone()
    misaligned = torch.full((2 * 28 + 2,), 7, dtype=torch.uint8)[2:].view(2, 28)
    bad_flats = [
        (good.view(torch.int8), "uint8"),
        (good[:1], r"\[2, 28\]"),
        (torch.full((2, 32), 7, dtype=torch.uint8), r"\[2, 28\]"),
        (torch.empty(2, 28, dtype=torch.uint8, device="meta"), "flat on meta"),
        (torch.full((28, 2), 7, dtype=torch.uint8).t(), "contiguous"),
        (misaligned, "4-byte word"),
    ]
    for flat, message in bad_flats:
        with pytest.raises(ValueError, match=message):
            gather_rows(table, rows, flat)
        with pytest.raises(ValueError, match=message):
            scatter_rows(table, flat, rows)
    bad_rows = {
        "int32/int64": torch.tensor([0.0, 2.0]),
        r"\[K\]": torch.tensor([[0, 2]]),
        "out of range": torch.tensor([0, 4]),
    }
    for message, bad in bad_rows.items():
        flat = good[: bad.shape[0]]
        with pytest.raises(ValueError, match=message):
            gather_rows(table, bad, flat)
        with pytest.raises(ValueError, match=message):
            scatter_rows(table, flat, bad)
    with pytest.raises(ValueError, match="more than once"):
        scatter_rows(table, good, torch.tensor([1, 1]))
    assert torch.equal(t, torch.arange(12.0).view(4, 3)) and torch.equal(good, sevens)
    gather_rows(table, torch.tensor([1, 1]), good)  # a gather may name a row twice
    assert torch.equal(good[0], good[1])


@cuda
def test_a_mamba2_370m_state_gathers_and_scatters_on_the_gpu():
    """48 layers of a conv state `[3, 2304]` bf16 and an SSM state `[32, 64, 128]` float32 (51 MB a row), 3 rows."""
    g = seed("rows", "mamba2-370m")
    tensors = random_tensors(g, 6, [((3, 2304), bf16), ((32, 64, 128), f32)] * 48)
    before = [t.clone() for t in tensors]
    table = RowTable(tensors)
    assert table.word == 16 and table.row_bytes == 48 * (3 * 2304 * 2 + 32 * 64 * 128 * 4)
    src, dst = torch.tensor([5, 0, 3], device=DEVICE), torch.tensor([1, 4, 2], device=DEVICE)
    flat = random_bytes(g, 3, table.row_bytes)
    gather_rows(table, src, flat)
    assert torch.equal(flat, flat_of(before, src))
    scatter_rows(table, flat, dst)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(bits(t[dst]), bits(b[src])) and torch.equal(bits(t[[0, 3, 5]]), bits(b[[0, 3, 5]]))
