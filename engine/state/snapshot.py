"""Session snapshots: one session's state as a self-checking safetensors file (docs/design/architecture.md §6).

A snapshot is a safetensors file (any safetensors reader opens it) holding every state tensor of one session, named
as `StatePool.export` names them (`layers.{i}.{name}`), and string metadata:

    format "kvfree-snapshot", version "2", fingerprint (the model's, see `model_fingerprint`), num_tokens,
    token_hash (16 hex digits), created, dtypes, optional session_id / session_created / owner,
    checksum (BLAKE3 over the other metadata fields, the tensor table and the tensor bytes),
    hmac (HMAC-SHA256 over all the other fields, checksum included) when the server has a signing key.

Version 2 lays the file out for speed: the header is padded to a multiple of 64 bytes and the tensors follow back to
back in the pool's order, so the tensor bytes are exactly a `PackedState` buffer (engine/state/packed.py). Writing a
snapshot is a small header plus that buffer as it is; reading one is a read into a buffer, one hash pass, and views.
BLAKE3 hashes at memory speed (7 GB/s on one core, more with threads) where sha256 managed 2, and it is a
cryptographic hash, so the HMAC over the metadata, which holds the checksum, still covers every byte. Version 1
files (sha256 over each tensor, written by kvfree before this format) are still read.

The checksum catches corruption and naive edits (a flipped byte, a hand-edited `num_tokens`); anyone can recompute
it, so only the HMAC proves that a snapshot was issued by a server holding the key. Shapes and dtypes are checked
where the state is loaded (`StatePool.import_packed`), because only the pool knows what this server's model needs.

For a recurrent model the file has the same size at every context length: the tensors are fixed-size and the
numeric metadata fields are written at fixed width.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from safetensors.torch import load as st_load

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.tensor_parallel import unshard
from kvfree.engine.protocol import SnapshotError
from kvfree.engine.state.packed import PackedState, StateEntry, byte_view

SNAPSHOT_FORMAT = "kvfree-snapshot"
SNAPSHOT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
HEADER_ALIGN = 64  # the tensor bytes start at a multiple of this (8-byte length + header padded with spaces)
HASH_MOD = (1 << 61) - 1  # a Mersenne prime: token hashes are ints in [0, HASH_MOD)
_HASH_BASE = 0x2545F4914F6CDD1D % HASH_MOD  # fixed odd constant; collisions of two n-token lists ~ n / 2^61
_MAX_HEADER = 1 << 24  # safetensors headers of state snapshots are a few KB; refuse absurd lengths early
_FINGERPRINT_CHUNK = 1 << 22  # elements hashed per step, so fingerprinting never copies a whole weight to the host



# -- identities ---------------------------------------------------------------------------------------------------
def model_fingerprint(model: HybridLM) -> str:
    """sha256 hex identifying a model's config and weights, the same for fp32 and bf16 loads of one checkpoint.

    Hashes the canonical config JSON (sorted keys, without the free-form `notes` and fields at their defaults) and
    every state_dict tensor's name, shape and values in name order. Floating-point values are hashed rounded to
    bf16 (on the model's device, one chunk at a time, so memory stays bounded): an fp32 load and a bf16 load of the
    same checkpoint then agree, and a snapshot from one is rejected by the other only for its state dtypes (conv
    tails and KV caches are in the activation dtype), with a message saying so rather than "a different model".
    (An fp16 load of an fp32 checkpoint rounds twice and may differ.) Config overrides given at load time, e.g.
    solver iterations, are part of the config and so change the fingerprint. Costs one pass over the weights: compute
    it once at start-up. Under tensor parallelism every rank calls it at once (it gathers each tensor whole): the
    same fingerprint as one rank's.
    """
    # Fields left at their defaults are not hashed: a field added to a mixer's config later (with a default that
    # keeps the old function) then leaves existing checkpoints' fingerprints, and their snapshots, valid.
    dumped = model.config.model_dump(exclude_none=True, exclude_defaults=True)
    config = {k: v for k, v in dumped.items() if k != "notes"}
    h = hashlib.sha256(b"kvfree-model\0")
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    state = model.state_dict()
    splits = model.weight_splits()
    for name in sorted(state):
        t = state[name].detach()
        if model.tp.size > 1:  # the whole tensor, from every rank's part (every rank runs this, in step)
            parts = [torch.empty_like(t) for _ in range(model.tp.size)]
            dist.all_gather(parts, t.contiguous())
            t = unshard(parts, splits.get(name))
        canonical = torch.bfloat16 if t.is_floating_point() else t.dtype
        h.update(f"\0{name}\0{canonical}\0{list(t.shape)}\0".encode())
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), _FINGERPRINT_CHUNK):
            piece = flat[start : start + _FINGERPRINT_CHUNK].to(canonical).cpu().contiguous()
            h.update(piece.view(torch.uint8).numpy())
    return h.hexdigest()


def token_hash(tokens: list[int], start: int = 0) -> int:
    """Rolling polynomial hash of token ids mod 2^61-1, append-friendly:
    `token_hash(a + b) == token_hash(b, start=token_hash(a))` and `token_hash([]) == 0`.

    Horner's rule over `t + 1` (so that token 0 counts), unrolled by four to cut the Python-level modulo
    operations: 100K tokens take ~10 ms. It is not keyed: a client can craft two token lists with one hash, but a
    session only ever compares against its own owner's prompts, so a collision only misleads its author.
    """
    b = _HASH_BASE
    b2 = b * b % HASH_MOD
    b3 = b2 * b % HASH_MOD
    b4 = b3 * b % HASH_MOD
    p = HASH_MOD
    h = start % p
    n = len(tokens)
    whole = n - n % 4
    for i in range(0, whole, 4):
        h = (h * b4 + (tokens[i] + 1) * b3 + (tokens[i + 1] + 1) * b2 + (tokens[i + 2] + 1) * b + tokens[i + 3] + 1) % p
    for t in tokens[whole:]:
        h = (h * b + t + 1) % p
    return h


# -- the record ---------------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """One session's state and what it stands for.

    state: the state tensors packed in one buffer (`PackedState`); a dict of CPU tensors named `layers.{i}.{name}`
        (as `StatePool.export` gives them) is packed on construction.
    num_tokens / token_hash: the tokens the state has consumed (`token_hash` of them).
    created: when the snapshot was taken (time.time()); session_created: when its session was created.
    owner: the API key id that owns the session (kept in files a server writes for itself, so restarts keep
        ownership; snapshots handed to clients leave it out).
    """

    state: PackedState
    fingerprint: str
    num_tokens: int
    token_hash: int
    created: float = field(default_factory=time.time)
    session_id: str | None = None
    session_created: float | None = None
    owner: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.state, dict):
            self.state = PackedState.pack(self.state)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor, views of the packed buffer."""
        return self.state.tensors()


# -- safetensors dtype names --------------------------------------------------------------------------------------
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


# -- encoding -----------------------------------------------------------------------------------------------------
def _canonical(meta: dict[str, str], *drop: str) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k not in drop}, sort_keys=True, separators=(",", ":")).encode()


def _framed(h: Any, body: bytes) -> None:
    h.update(len(body).to_bytes(8, "little") + body)


def _table(entries: tuple[StateEntry, ...]) -> dict[str, dict[str, Any]]:
    """The safetensors tensor table of packed entries."""
    return {
        e.name: {"dtype": _DTYPE_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [e.offset, e.end]}
        for e in entries
    }


def payload_hasher(meta: dict[str, str], table: dict[str, Any]) -> Any:
    """A BLAKE3 hasher primed with a version-2 snapshot's metadata and tensor table: feed it the tensor bytes
    (`update`, in pieces if they arrive in pieces) and compare `hexdigest()` with the checksum."""
    h = blake3.blake3(b"kvfree-snapshot\0v2\0", max_threads=blake3.blake3.AUTO)
    _framed(h, _canonical(meta, "checksum", "hmac"))
    _framed(h, json.dumps(table, sort_keys=True, separators=(",", ":")).encode())
    return h


def _checksum_v1(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """Version 1's checksum: sha256 over the metadata (without checksum and hmac) and each tensor, framed."""
    h = hashlib.sha256(b"kvfree-snapshot\0")
    _framed(h, _canonical(meta, "checksum", "hmac"))
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0{t.numel() * t.element_size()}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _signature(meta: dict[str, str], key: bytes) -> str:
    return hmac.new(key, _canonical(meta, "hmac"), hashlib.sha256).hexdigest()


def _dtypes(entries: tuple[StateEntry, ...]) -> str:
    return ",".join(sorted({str(e.dtype).removeprefix("torch.") for e in entries}))


def encode_header(snap: Snapshot, hmac_key: bytes | None = None) -> bytes:
    """The snapshot's header: 8-byte length, then the safetensors JSON header, padded so that the tensor bytes
    (`snap.state.data`, written right after it as they are) start at a multiple of `HEADER_ALIGN`. Hashes the tensor
    bytes (the checksum is in the header), so their copy from the device must have run (`PackedState.wait`)."""
    if snap.num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {snap.num_tokens}")
    if not 0 <= snap.token_hash < HASH_MOD:
        raise ValueError(f"token_hash {snap.token_hash} is outside [0, 2^61-1)")
    state = snap.state.wait()
    # Fixed-width numbers: the file of a recurrent model has the same size at every context length.
    meta = {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "fingerprint": snap.fingerprint,
        "num_tokens": f"{snap.num_tokens:020d}",
        "token_hash": f"{snap.token_hash:016x}",
        "created": f"{snap.created:.6f}",
        "dtypes": _dtypes(state.entries),
    }
    if snap.session_id is not None:
        meta["session_id"] = snap.session_id
    if snap.session_created is not None:
        meta["session_created"] = f"{snap.session_created:.6f}"
    if snap.owner is not None:
        meta["owner"] = snap.owner
    table = _table(state.entries)
    h = payload_hasher(meta, table)
    h.update(byte_view(state.data))
    meta["checksum"] = h.hexdigest()
    if hmac_key is not None:
        meta["hmac"] = _signature(meta, hmac_key)
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body


def encode_snapshot(snap: Snapshot, hmac_key: bytes | None = None) -> bytes:
    """The whole snapshot file as bytes (`encode_header` and the tensor bytes joined: one copy of the state; a
    writer that can take the two pieces apart should, see `write_snapshot`)."""
    return encode_header(snap, hmac_key) + byte_view(snap.state.data).tobytes()


def snapshot_parts(snap: Snapshot, hmac_key: bytes | None = None) -> list[bytes | memoryview]:
    """The snapshot file in two pieces, the header and the tensor bytes (a view of the state's buffer, no copy):
    written one after the other, they are `encode_snapshot`'s bytes."""
    return [encode_header(snap, hmac_key), byte_view(snap.state.data)]


def write_snapshot(f: Any, snap: Snapshot, hmac_key: bytes | None = None) -> int:
    """Write the snapshot to the binary file `f`: the header, then the tensor bytes straight from their buffer (no
    copy in between). Returns the bytes written."""
    parts = snapshot_parts(snap, hmac_key)
    for part in parts:
        f.write(part)
    return sum(len(part) for part in parts)


# -- decoding -----------------------------------------------------------------------------------------------------
def header_length(prefix: bytes | memoryview) -> int:
    """Bytes the header takes (8 + its JSON), from at least the file's first 8 bytes; SnapshotError when absurd."""
    if len(prefix) < 8:
        raise SnapshotError(f"not a snapshot: {len(prefix)} bytes is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > _MAX_HEADER:
        raise SnapshotError("not a snapshot (not a safetensors file, or truncated): its header length is invalid")
    return 8 + n


def parse_header(head: bytes | memoryview) -> dict[str, Any]:
    """The JSON header of the file starting with `head` (the first `header_length` bytes or more), checked only for
    being readable."""
    end = header_length(head)
    if end > len(head):
        raise SnapshotError("not a snapshot (not a safetensors file, or truncated): its header length is invalid")
    try:
        header = json.loads(bytes(head[8:end]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SnapshotError("not a snapshot: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise SnapshotError("not a snapshot: the safetensors header is not a JSON object")
    return header


def metadata(header: dict[str, Any]) -> dict[str, str]:
    """The kvfree metadata of a parsed header, after checking the format, version and required fields."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotError("not a kvfree snapshot: the safetensors file has no string metadata")
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"not a kvfree snapshot: metadata format is {meta.get('format')!r}, expected {SNAPSHOT_FORMAT!r}"
        )
    if meta.get("version") not in READABLE_VERSIONS:
        raise SnapshotError(
            f"snapshot version {meta.get('version')!r} is not supported by this server (it reads versions "
            f"{', '.join(READABLE_VERSIONS)}); restore it on the kvfree version that wrote it",
            "unsupported_version",
        )
    required = ("fingerprint", "num_tokens", "token_hash", "created", "dtypes", "checksum")
    missing = [k for k in required if k not in meta]
    if missing:
        raise SnapshotError(f"invalid snapshot: metadata field(s) {missing} missing")
    return meta


def entries(header: dict[str, Any]) -> tuple[StateEntry, ...]:
    """A version-2 header's tensors as packed entries, checked to lie back to back from offset 0 (SnapshotError)."""
    out, offset = [], 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SnapshotError(f"invalid snapshot: tensor {name!r} has a malformed entry") from None
        entry = StateEntry(name, dtype, shape, start)
        if start != offset or end != entry.end or min(shape, default=0) < 0:
            raise SnapshotError(f"invalid snapshot: tensor {name!r} is not packed where a version-2 snapshot puts it")
        out.append(entry)
        offset = end
    return tuple(out)


def check_signature(meta: dict[str, str], hmac_key: bytes | None) -> None:
    """SnapshotError("bad_signature") unless the metadata carries this key's HMAC (nothing to check without a key)."""
    if hmac_key is None:
        return  # this server does not require signed snapshots; a signature it cannot check is ignored
    if "hmac" not in meta:
        raise SnapshotError(
            "snapshot is not signed, and this server only restores snapshots signed with its key; "
            "use a snapshot exported by this server (or one sharing its signing key)",
            "bad_signature",
        )
    if not hmac.compare_digest(meta["hmac"], _signature(meta, hmac_key)):
        raise SnapshotError(
            "snapshot signature is invalid: it was modified, or signed with another server's key",
            "bad_signature",
        )


def record(meta: dict[str, str], expected_fingerprint: str, state: PackedState) -> Snapshot:
    """Check the fingerprint and parse the fields (after the checksum or HMAC vouched for them)."""
    if meta["fingerprint"] != expected_fingerprint:
        raise SnapshotError(
            f"snapshot was taken from a different model (fingerprint {meta['fingerprint'][:16]}...), this server "
            f"serves {expected_fingerprint[:16]}...; restore it on a server running the same checkpoint and config",
            "model_mismatch",
        )
    try:
        num_tokens = int(meta["num_tokens"])
        hash_value = int(meta["token_hash"], 16)
        created = float(meta["created"])
        session_created = float(meta["session_created"]) if "session_created" in meta else None
    except ValueError as e:
        raise SnapshotError(f"invalid snapshot: malformed metadata number ({e})") from None
    if num_tokens < 0:
        raise SnapshotError(f"invalid snapshot: num_tokens is {num_tokens}, must be >= 0")
    if not 0 <= hash_value < HASH_MOD:
        raise SnapshotError("invalid snapshot: token_hash is out of range")
    return Snapshot(
        state=state,
        fingerprint=meta["fingerprint"],
        num_tokens=num_tokens,
        token_hash=hash_value,
        created=created,
        session_id=meta.get("session_id"),
        session_created=session_created,
        owner=meta.get("owner"),
    )


def _as_tensor(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """The bytes as a CPU uint8 tensor, without a copy (a read-only buffer is only ever read)."""
    if isinstance(data, torch.Tensor):
        return data.view(-1).view(torch.uint8)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # torch warns that a read-only buffer (bytes) is not writable: we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def check_finite_state(tensors: dict[str, torch.Tensor]) -> None:
    """SnapshotError("non_finite_state") naming the first floating-point tensor that holds a NaN or Inf (the tensors
    may be on any device: one flag per tensor, then one read of them all)."""
    floats = {name: t for name, t in tensors.items() if t.is_floating_point()}
    if not floats:
        return
    finite = torch.stack([torch.isfinite(t).all() for t in floats.values()]).tolist()
    for name, ok in zip(floats, finite, strict=True):
        if not ok:
            raise SnapshotError(
                f"snapshot state {name} holds NaN or Inf values; the session it came from diverged and cannot be "
                "continued: start a new session",
                "non_finite_state",
            )


def decode_snapshot(
    data: bytes | bytearray | memoryview | torch.Tensor,
    expected_fingerprint: str,
    hmac_key: bytes | None = None,
    check_finite: bool = True,
) -> Snapshot:
    """Parse and verify a snapshot file's bytes: format, version, checksum, HMAC (when `hmac_key` is set), model
    fingerprint, metadata fields and (with `check_finite`) finite state values. Raises SnapshotError (with `code`) on
    any problem. Tensor names, shapes and dtypes are left to `StatePool.check`.

    `data` may be a CPU uint8 tensor (a file read into pinned memory, say): a version-2 snapshot's state is then a
    view of it, not a copy. `check_finite=False` is for the server's own files, whose state it wrote itself, and for
    a caller that checks the values where it is faster (`SessionTiers.check_finite`, on the GPU).
    """
    buf = _as_tensor(data)
    view = byte_view(buf)
    header = parse_header(view[: min(len(view), 8 + _MAX_HEADER)])
    meta = metadata(header)
    if meta["version"] == "1":
        state = _decode_v1(view, meta)
    else:
        packed = entries(header)
        start = header_length(view)
        size = packed[-1].end if packed else 0
        if len(view) != start + size:
            raise SnapshotError(
                f"not a snapshot (truncated, or with bytes after its end): its header says {start + size} bytes, "
                f"it has {len(view)}"
            )
        h = payload_hasher(meta, {k: v for k, v in header.items() if k != "__metadata__"})
        h.update(view[start:])
        if not hmac.compare_digest(meta["checksum"], h.hexdigest()):
            raise SnapshotError(
                "snapshot checksum mismatch: the file was corrupted or edited after it was written; export it again",
                "checksum_mismatch",
            )
        payload = buf[start:]
        if start % HEADER_ALIGN:  # a file not written by kvfree: its tensors may sit where they cannot be viewed
            payload = payload.clone()
        state = PackedState(payload, packed)
    check_signature(meta, hmac_key)
    snap = record(meta, expected_fingerprint, state)
    if meta["dtypes"] != _dtypes(state.entries):
        raise SnapshotError(f"invalid snapshot: metadata dtypes {meta['dtypes']!r} do not match its tensors")
    if check_finite:
        check_finite_state(state.tensors())
    return snap


def _decode_v1(view: memoryview, meta: dict[str, str]) -> PackedState:
    """A version-1 file's tensors (generic safetensors, sha256 checksum), verified and packed."""
    try:
        tensors = st_load(bytes(view))
    except Exception as e:  # untrusted bytes: whatever the parser raises means the same thing
        raise SnapshotError(f"not a snapshot (corrupt or truncated safetensors data): {e}") from None
    if not hmac.compare_digest(meta["checksum"], _checksum_v1(tensors, meta)):
        raise SnapshotError(
            "snapshot checksum mismatch: the file was corrupted or edited after it was written; export it again",
            "checksum_mismatch",
        )
    return PackedState.pack(tensors)


def peek_snapshot(path: str | Path, expected_fingerprint: str, hmac_key: bytes | None = None) -> Snapshot:
    """A snapshot file's metadata without reading its tensors (`state` is empty): checks format, version, HMAC and
    fingerprint, but not the checksum or values (`decode_snapshot` does that when the state is loaded)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        end = header_length(prefix)
        head = prefix + f.read(end - 8)
    if len(head) < end:
        raise SnapshotError("not a snapshot (not a safetensors file, or truncated): its header length is invalid")
    meta = metadata(parse_header(head))
    check_signature(meta, hmac_key)
    return record(meta, expected_fingerprint, PackedState.empty())


def check_header(head: bytes | bytearray, fingerprint: str, hmac_key: bytes | None) -> int | None:
    """Refuse a snapshot from its header alone (an upload, before the rest arrives), with the SnapshotError codes the
    engine would give: not a kvfree
    snapshot (invalid_snapshot), a version this server cannot read (unsupported_version), a missing or wrong
    signature when the server has a key (bad_signature), another model (model_mismatch).

    head: the file's first bytes, at least `header_length(head)` of them. Returns the file size the header implies
    (a version-2 header places every tensor), None for a version-1 file (the engine checks its length). The
    checksum over the tensors, and whether they fit the pool, are the engine's to check once the file is whole.
    """
    header = parse_header(head)
    meta = metadata(header)
    check_signature(meta, hmac_key)
    record(meta, fingerprint, PackedState.empty())
    if meta["version"] == "1":
        return None
    packed = entries(header)
    return header_length(head) + (packed[-1].end if packed else 0)
