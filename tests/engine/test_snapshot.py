"""Session snapshot files: round trip, every rejection with its code, constant size, version 1 still read, token hash,
model fingerprint."""

from __future__ import annotations

import copy
import hashlib
import hmac
import io
import json
import struct
import time

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import SnapshotError, SnapshotMismatchError
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import (
    HASH_MOD,
    HEADER_ALIGN,
    Snapshot,
    _canonical,
    _checksum_v1,
    decode_snapshot,
    encode_snapshot,
    header_length,
    model_fingerprint,
    payload_hasher,
    peek_snapshot,
    token_hash,
    write_snapshot,
)
from tests.conftest import make_config, make_model, random_ids, randomize

KEY = b"server-signing-key"


pytestmark = pytest.mark.usefixtures("one_thread")


def feed(model: HybridLM, pool: StatePool, slot: int, tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `tokens` into `slot`, then greedy-decode `steps` tokens. Returns them and every logits row."""
    logits = [model.prefill(torch.tensor(tokens), pool.tensors, StepBatch.prefill([slot], [len(tokens)]))[0]]
    out = []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits.append(model.decode(torch.tensor(out[-1:]), pool.tensors, StepBatch.decode([slot]))[0])
    return out, torch.stack(logits)


def header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def assemble(meta: dict, table: dict, payload: bytes, fix_checksum: bool = True) -> bytes:
    """A version-2 file from its parts (header unpadded); by default with a recomputed checksum, as an attacker who
    knows the format would do, but without a valid HMAC."""
    meta = dict(meta)
    if fix_checksum:
        h = payload_hasher(meta, table)
        h.update(payload)
        meta["checksum"] = h.hexdigest()
    body = json.dumps({"__metadata__": meta, **table}).encode()
    return struct.pack("<Q", len(body)) + body + payload


def resave(data: bytes, drop: tuple[str, ...] = (), fix_checksum: bool = True, **changes: str) -> bytes:
    """The snapshot with edited metadata, re-serialised (see `assemble`)."""
    head = header(data)
    meta = {k: v for k, v in head["__metadata__"].items() if k not in drop and k != "hmac"}
    meta.update(changes)
    table = {k: v for k, v in head.items() if k != "__metadata__"}
    return assemble(meta, table, data[header_length(data) :], fix_checksum)


def version_1(snap: Snapshot, key: bytes | None = None) -> bytes:
    """The snapshot as kvfree wrote it before version 2: safetensors' own layout, sha256 over each tensor."""
    meta = {k: v for k, v in header(encode_snapshot(snap))["__metadata__"].items() if k not in ("checksum", "hmac")}
    meta["version"] = "1"
    meta["checksum"] = _checksum_v1(snap.tensors, meta)
    if key is not None:
        meta["hmac"] = hmac.new(key, _canonical(meta, "hmac"), hashlib.sha256).hexdigest()
    return st_save({k: v.clone() for k, v in snap.tensors.items()}, metadata=meta)


@pytest.fixture(scope="module")
def setup():
    """A tiny hybrid model and a snapshot of a session that consumed 29 tokens."""
    model = make_model(["mamba2", "attention", "swa"], seed=11, mlp=True)
    pool = StatePool(model, capacity=3, max_context=64)
    prompt = random_ids(25, 1)
    generated, _ = feed(model, pool, 1, prompt, 4)
    consumed = prompt + generated[:-1]  # the last generated token is sampled, not yet fed
    snap = Snapshot(pool.export(1), model_fingerprint(model), len(consumed), token_hash(consumed), session_id="s1")
    return model, pool, snap, generated[-1]


def expect(
    code: str, data: bytes, fingerprint: str, key: bytes | None = None, match: str | None = None
) -> SnapshotError:
    with pytest.raises(SnapshotError, match=match) as info:
        decode_snapshot(data, fingerprint, key)
    assert info.value.code == code, info.value
    return info.value


# -- round trip ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [["mamba2", "mamba2"], ["mamba2", "attention", "swa"]])
def test_round_trip_continues_bit_identically(layers) -> None:
    model = make_model(layers, seed=3)
    fp = model_fingerprint(model)
    pool = StatePool(model, capacity=2, max_context=64)
    prompt = random_ids(30, 2)
    generated, _ = feed(model, pool, 1, prompt, 3)
    snap = Snapshot(pool.export(1), fp, 32, token_hash(prompt + generated[:2]), session_id="abc", owner="key1")
    data = encode_snapshot(snap, KEY)
    expected, expected_logits = feed(model, pool, 1, generated[-1:], 12)

    back = decode_snapshot(data, fp, KEY)
    assert (back.num_tokens, back.token_hash, back.session_id, back.owner) == (32, snap.token_hash, "abc", "key1")
    assert back.created == pytest.approx(snap.created, abs=1e-5)
    assert back.tensors.keys() == snap.tensors.keys()
    other = StatePool(model, capacity=3, max_context=64)
    other.import_(2, back.tensors)
    got, got_logits = feed(model, other, 2, generated[-1:], 12)
    assert got == expected
    assert torch.equal(got_logits, expected_logits)


def test_peek_reads_only_the_header(tmp_path, setup) -> None:
    _, _, snap, _ = setup
    path = tmp_path / "s.safetensors"
    data = encode_snapshot(snap, KEY)
    path.write_bytes(data[: len(data) - 100])  # the tensors are cut short; the metadata is intact
    meta = peek_snapshot(path, snap.fingerprint, KEY)
    assert (meta.num_tokens, meta.token_hash, meta.session_id, meta.tensors) == (
        snap.num_tokens,
        snap.token_hash,
        "s1",
        {},
    )
    with pytest.raises(SnapshotError) as info:
        peek_snapshot(path, snap.fingerprint, b"another key")
    assert info.value.code == "bad_signature"
    expect("invalid_snapshot", path.read_bytes(), snap.fingerprint, KEY)  # decode reads the tensors: truncated


# -- rejections ---------------------------------------------------------------------------------------------------
def test_rejects_garbage_and_truncated_bytes(setup) -> None:
    _, _, snap, _ = setup
    data = encode_snapshot(snap)
    fp = snap.fingerprint
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    for bad in (b"", b"\x00" * 7, bytes(noise.tolist()), b"PK\x03\x04 a zip file, not a snapshot"):
        expect("invalid_snapshot", bad, fp, match="not a")
    for cut in (len(data) - 1, len(data) - 500, len(data) // 2, 40, 9):
        expect("invalid_snapshot", data[:cut], fp)
    # A plain safetensors file (e.g. a raw StatePool.export) is not a snapshot: no metadata.
    expect("invalid_snapshot", st_save(snap.tensors), fp, match="metadata")
    expect("invalid_snapshot", resave(data, format="something-else"), fp, match="format")
    expect("unsupported_version", resave(data, version="3"), fp, match="version")
    expect("invalid_snapshot", resave(data, drop=("token_hash",)), fp, match="token_hash")
    expect("invalid_snapshot", resave(data, num_tokens="-3"), fp, match="num_tokens")
    expect("invalid_snapshot", resave(data, token_hash="zz"), fp, match="malformed")
    expect("invalid_snapshot", resave(data, dtypes="float64"), fp, match="dtypes")


def test_flipped_tensor_byte_fails_the_checksum(setup) -> None:
    _, _, snap, _ = setup
    data = bytearray(encode_snapshot(snap))
    body = 8 + struct.unpack("<Q", data[:8])[0]
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        pos = body + int(torch.randint(0, len(data) - body, (1,), generator=gen))
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        expect("checksum_mismatch", bytes(flipped), snap.fingerprint, match="checksum")


def test_edited_metadata_is_caught(setup) -> None:
    _, _, snap, _ = setup
    for key in (None, KEY):
        data = encode_snapshot(snap, key)
        # A hand edit of num_tokens, same length so the file stays well-formed: the checksum covers metadata.
        old = f'"num_tokens":"{snap.num_tokens:020d}"'.encode()
        assert old in data
        edited = data.replace(old, f'"num_tokens":"{snap.num_tokens + 7:020d}"'.encode())
        expect("checksum_mismatch", edited, snap.fingerprint, key)
    # Someone who recomputes the checksum gets past it; only the HMAC stops them.
    forged = resave(encode_snapshot(snap, KEY), num_tokens=f"{snap.num_tokens + 7:020d}")
    assert decode_snapshot(forged, snap.fingerprint).num_tokens == snap.num_tokens + 7
    expect("bad_signature", forged, snap.fingerprint, KEY)
    # So do forged tensors with a recomputed checksum.
    signed = encode_snapshot(snap, KEY)
    payload = bytearray(signed[header_length(signed) :])
    payload[5] ^= 0x10
    head = header(signed)
    meta = {k: v for k, v in head["__metadata__"].items() if k != "hmac"}
    forged = assemble({**meta, "hmac": "00" * 32}, {k: v for k, v in head.items() if k != "__metadata__"}, payload)
    assert decode_snapshot(forged, snap.fingerprint).tensors.keys() == snap.tensors.keys()
    expect("bad_signature", forged, snap.fingerprint, KEY, match="signature is invalid")


def test_hmac_required_and_checked(setup) -> None:
    _, _, snap, _ = setup
    signed, unsigned = encode_snapshot(snap, KEY), encode_snapshot(snap)
    assert "hmac" in header(signed)["__metadata__"] and "hmac" not in header(unsigned)["__metadata__"]
    assert decode_snapshot(signed, snap.fingerprint, KEY).num_tokens == snap.num_tokens
    assert decode_snapshot(signed, snap.fingerprint).num_tokens == snap.num_tokens  # no key: not checked
    expect("bad_signature", unsigned, snap.fingerprint, KEY, match="not signed")
    expect("bad_signature", signed, snap.fingerprint, b"another server's key", match="invalid")


def test_other_model_is_refused_with_both_fingerprints(setup) -> None:
    _, _, snap, _ = setup
    other = model_fingerprint(make_model(["mamba2", "attention", "swa"], seed=12, mlp=True))
    assert other != snap.fingerprint
    err = expect("model_mismatch", encode_snapshot(snap), other, match="different model")
    assert snap.fingerprint[:16] in str(err) and other[:16] in str(err)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_state_is_refused(setup, value) -> None:
    _, _, snap, _ = setup
    tensors = {k: v.clone() for k, v in snap.tensors.items()}
    tensors["layers.1.k"].view(-1)[3] = value
    bad = Snapshot(tensors, snap.fingerprint, snap.num_tokens, snap.token_hash)
    expect("non_finite_state", encode_snapshot(bad, KEY), snap.fingerprint, KEY, match="layers.1.k")


def test_encode_refuses_impossible_counters(setup) -> None:
    _, _, snap, _ = setup
    with pytest.raises(ValueError, match="num_tokens"):
        encode_snapshot(Snapshot(snap.tensors, snap.fingerprint, -1, 0))
    with pytest.raises(ValueError, match="token_hash"):
        encode_snapshot(Snapshot(snap.tensors, snap.fingerprint, 1, HASH_MOD))


# -- size ---------------------------------------------------------------------------------------------------------
def test_size_is_constant_in_context_length() -> None:
    model = make_model(["mamba2", "mamba2"], seed=4)
    fp = model_fingerprint(model)
    pool = StatePool(model, capacity=2, max_context=64)
    sizes = []
    for slot, n in enumerate([10, 2_000]):
        prompt = random_ids(n, 7 + slot)
        feed(model, pool, slot, prompt, 0)
        data = encode_snapshot(Snapshot(pool.export(slot), fp, n, token_hash(prompt), session_id="sess_x"), KEY)
        assert len(data) - header_length(data) == pool.bytes_per_session()
        assert header_length(data) % HEADER_ALIGN == 0
        sizes.append(len(data))
    assert sizes[0] == sizes[1]


# -- the format ---------------------------------------------------------------------------------------------------
def test_a_snapshot_is_a_safetensors_file_with_the_state_packed_in_pool_order(setup) -> None:
    _, pool, snap, _ = setup
    data = encode_snapshot(snap, KEY)
    loaded = st_load(data)  # any safetensors reader opens it
    assert loaded.keys() == snap.tensors.keys()
    for name, t in snap.tensors.items():
        assert torch.equal(loaded[name], t), name
    # The tensor bytes are the packed buffer as it is: the pool's layout first, from offset 0, back to back.
    offsets = [tuple(spec["data_offsets"]) for name, spec in header(data).items() if name != "__metadata__"]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False))
    assert [e.name for e in snap.state.entries[: len(pool.layout)]] == [e.name for e in pool.layout]
    assert data[header_length(data) :] == snap.state.data.numpy().tobytes()
    # Written in two pieces (the header, then the buffer without a copy), the file is the same bytes.
    out = io.BytesIO()
    assert write_snapshot(out, snap, KEY) == len(data)
    header_a, header_b = header(out.getvalue()), header(data)
    assert header_a.keys() == header_b.keys()


def test_a_decoded_snapshot_views_the_buffer_it_was_read_into(setup) -> None:
    _, _, snap, _ = setup
    data = encode_snapshot(snap)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    back = decode_snapshot(buffer, snap.fingerprint)
    assert back.state.data.data_ptr() == buffer.data_ptr() + header_length(data)  # a view, no copy
    for name, t in snap.tensors.items():
        assert torch.equal(back.tensors[name], t), name


def test_version_1_snapshots_still_load_and_are_still_checked(setup) -> None:
    model, _, snap, next_token = setup
    old = version_1(snap, KEY)
    back = decode_snapshot(old, snap.fingerprint, KEY)
    assert (back.num_tokens, back.token_hash, back.session_id) == (snap.num_tokens, snap.token_hash, "s1")
    other = StatePool(model, capacity=2, max_context=64)
    other.import_packed(1, back.state)  # packed in the order of the old file, repacked in the pool's layout
    for name, t in snap.tensors.items():
        assert torch.equal(other.export(1)[name], t), name
    flipped = bytearray(old)
    flipped[-3] ^= 1
    expect("checksum_mismatch", bytes(flipped), snap.fingerprint, KEY)
    expect("bad_signature", version_1(snap), snap.fingerprint, KEY, match="not signed")


def test_a_header_that_misplaces_its_tensors_is_refused(setup) -> None:
    _, _, snap, _ = setup
    data = encode_snapshot(snap)
    head = header(data)
    meta, table = head["__metadata__"], {k: v for k, v in head.items() if k != "__metadata__"}
    first = next(iter(table))
    start, end = table[first]["data_offsets"]
    moved = {**table, first: {**table[first], "data_offsets": [start + 4, end + 4]}}
    expect("invalid_snapshot", assemble(meta, moved, data[header_length(data) :]), snap.fingerprint, match=first)
    odd = {**table, first: {**table[first], "dtype": "Q99"}}
    expect("invalid_snapshot", assemble(meta, odd, data[header_length(data) :]), snap.fingerprint, match="malformed")
    expect("invalid_snapshot", data + b"extra", snap.fingerprint, match="bytes after its end")


# -- token hash ---------------------------------------------------------------------------------------------------
def test_token_hash_is_append_friendly_and_discriminating() -> None:
    gen = torch.Generator().manual_seed(8)
    assert token_hash([]) == 0
    assert len({token_hash([]), token_hash([0]), token_hash([0, 0]), token_hash([1]), token_hash([0, 1])}) == 5
    for trial in range(20):
        tokens = torch.randint(0, 200_000, (int(torch.randint(1, 300, (1,), generator=gen)),), generator=gen).tolist()
        h = token_hash(tokens)
        assert 0 <= h < HASH_MOD
        for cut in torch.randint(0, len(tokens) + 1, (3,), generator=gen).tolist():
            assert token_hash(tokens[cut:], start=token_hash(tokens[:cut])) == h
        # A chain of appends (as a session extends turn by turn) gives the same hash.
        running = 0
        for i in range(0, len(tokens), 7):
            running = token_hash(tokens[i : i + 7], start=running)
        assert running == h
        # Any single change, or a swap of two different neighbours, changes the hash.
        i = int(torch.randint(0, len(tokens), (1,), generator=gen))
        changed = list(tokens)
        changed[i] = (changed[i] + 1 + trial) % 200_000
        assert token_hash(changed) != h
        if len(tokens) > 1 and tokens[0] != tokens[1]:
            assert token_hash([tokens[1], tokens[0], *tokens[2:]]) != h


def test_token_hash_prefix_check() -> None:
    history = random_ids(50, 9)
    h = token_hash(history)
    prompt = history + random_ids(20, 10)
    assert token_hash(prompt[: len(history)]) == h
    edited = list(prompt)
    edited[17] = (edited[17] + 1) % 256
    assert token_hash(edited[: len(history)]) != h


def test_token_hash_of_100k_tokens_is_fast() -> None:
    tokens = torch.randint(0, 150_000, (100_000,), generator=torch.Generator().manual_seed(11)).tolist()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        h = token_hash(tokens)
        best = min(best, time.perf_counter() - start)
    assert h == token_hash(tokens[1:], start=token_hash(tokens[:1]))
    assert best < 0.05, f"token_hash of 100K tokens took {best * 1000:.1f} ms"


# -- model fingerprint --------------------------------------------------------------------------------------------
def test_fingerprint_identifies_config_and_weights() -> None:
    layers = ["mamba2", "swa"]
    model = make_model(layers, seed=21, mlp=True)
    fp = model_fingerprint(model)
    assert len(fp) == 64 and fp == model_fingerprint(make_model(layers, seed=21, mlp=True))
    assert fp != model_fingerprint(make_model(layers, seed=22, mlp=True))
    # One weight moved by a few percent.
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        param = next(p for n, p in nudged.named_parameters() if n.startswith("layers.1."))
        param.view(-1)[5] *= 1.05
    assert model_fingerprint(nudged) != fp
    # A config change that leaves the weights as they are (the SSD chunk size).
    data = make_config(layers, mlp=True).to_dict()
    data["mamba2"]["chunk_size"] = 16
    rechunked = HybridLM(ModelConfig.from_dict(data))
    rechunked.load_state_dict(model.state_dict())
    assert model_fingerprint(rechunked) != fp
    # Provenance notes are not part of the identity.
    data = make_config(layers, mlp=True).to_dict()
    data["notes"] = {"source": "converted from somewhere"}
    annotated = HybridLM(ModelConfig.from_dict(data))
    annotated.load_state_dict(model.state_dict())
    assert model_fingerprint(annotated) == fp


def test_fingerprint_is_independent_of_the_load_dtype() -> None:
    model = make_model(["mamba2", "attention"], seed=23)
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert model_fingerprint(half) == model_fingerprint(model)
    other = HybridLM(model.config)
    randomize(other, 24)
    assert model_fingerprint(other.to(torch.bfloat16)) != model_fingerprint(model)
    # The same model at another dtype keeps some state (conv tails, KV) in that dtype: the pool refuses it by dtype.
    state = StatePool(model, capacity=1, max_context=16).export(0)
    with pytest.raises(SnapshotMismatchError, match="dtype"):
        StatePool(half, capacity=1, max_context=16).import_(0, state)
