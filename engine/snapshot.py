"""Session snapshots: one session's state as a self-checking safetensors file (docs/design/architecture.md §6).

A snapshot holds every layer's state tensors of one session (as `StatePool.export` names them, `layers.{i}.{name}`)
and string metadata:

    format "kvfree-snapshot", version "1", fingerprint (the model's, see `model_fingerprint`), num_tokens,
    token_hash (16 hex digits), created, dtypes, optional session_id / session_created / owner,
    checksum (sha256 over the other metadata fields and every tensor's name, dtype, shape and bytes),
    hmac (HMAC-SHA256 over all the other fields, checksum included) when the server has a signing key.

The checksum catches corruption and naive edits (a flipped byte, a hand-edited `num_tokens`); anyone can recompute
it, so only the HMAC proves that a snapshot was issued by a server holding the key. Shapes and dtypes are checked
where the state is loaded (`StatePool.import_`), because only the pool knows what this server's model needs.

For a recurrent model the file has the same size at every context length: the tensors are fixed-size and the
numeric metadata fields are written at fixed width.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvfree.engine.model import HybridLM

SNAPSHOT_FORMAT = "kvfree-snapshot"
SNAPSHOT_VERSION = "1"
HASH_MOD = (1 << 61) - 1  # a Mersenne prime: token hashes are ints in [0, HASH_MOD)
_HASH_BASE = 0x2545F4914F6CDD1D % HASH_MOD  # fixed odd constant; collisions of two n-token lists ~ n / 2^61
_MAX_HEADER = 1 << 24  # safetensors headers of state snapshots are a few KB; refuse absurd lengths early
_FINGERPRINT_CHUNK = 1 << 22  # elements hashed per step, so fingerprinting never copies a whole weight to the host


class SnapshotError(ValueError):
    """A snapshot this server cannot restore. `code` is a short machine-readable reason:

    invalid_snapshot (not a snapshot, truncated, malformed metadata), unsupported_version, model_mismatch,
    checksum_mismatch, bad_signature, non_finite_state, state_mismatch (names, shapes or dtypes that do not fit
    this server's state pool; raised by the session manager).
    """

    def __init__(self, message: str, code: str = "invalid_snapshot") -> None:
        super().__init__(message)
        self.code = code


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
    it once at start-up.
    """
    # Fields left at their defaults are not hashed: a field added to a mixer's config later (with a default that
    # keeps the old function) then leaves existing checkpoints' fingerprints, and their snapshots, valid.
    dumped = model.config.model_dump(exclude_none=True, exclude_defaults=True)
    config = {k: v for k, v in dumped.items() if k != "notes"}
    h = hashlib.sha256(b"kvfree-model\0")
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
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

    tensors: CPU tensors named `layers.{i}.{name}` (as `StatePool.export`), per-session shapes (no slot axis).
    num_tokens / token_hash: the tokens the state has consumed (`token_hash` of them).
    created: when the snapshot was taken (time.time()); session_created: when its session was created.
    owner: the API key id that owns the session (kept in files a server writes for itself, so restarts keep
        ownership; snapshots handed to clients leave it out).
    """

    tensors: dict[str, torch.Tensor]
    fingerprint: str
    num_tokens: int
    token_hash: int
    created: float = field(default_factory=time.time)
    session_id: str | None = None
    session_created: float | None = None
    owner: str | None = None


# -- encoding -----------------------------------------------------------------------------------------------------
def _tensor_digest(h: Any, tensors: dict[str, torch.Tensor]) -> None:
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0{t.numel() * t.element_size()}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())


def _canonical(meta: dict[str, str], *drop: str) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k not in drop}, sort_keys=True, separators=(",", ":")).encode()


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over the metadata (without checksum and hmac) and the tensors, in a length-delimited framing."""
    h = hashlib.sha256(b"kvfree-snapshot\0")
    body = _canonical(meta, "checksum", "hmac")
    h.update(len(body).to_bytes(8, "little") + body)
    _tensor_digest(h, tensors)
    return h.hexdigest()


def _signature(meta: dict[str, str], key: bytes) -> str:
    return hmac.new(key, _canonical(meta, "hmac"), hashlib.sha256).hexdigest()


def _dtypes(tensors: dict[str, torch.Tensor]) -> str:
    return ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}))


def encode_snapshot(snap: Snapshot, hmac_key: bytes | None = None) -> bytes:
    """The snapshot as safetensors bytes with checksum (and HMAC when `hmac_key` is given) in its metadata."""
    if snap.num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {snap.num_tokens}")
    if not 0 <= snap.token_hash < HASH_MOD:
        raise ValueError(f"token_hash {snap.token_hash} is outside [0, 2^61-1)")
    tensors = {k: v.detach().cpu().contiguous() for k, v in snap.tensors.items()}
    # Fixed-width numbers: the file of a recurrent model has the same size at every context length.
    meta = {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "fingerprint": snap.fingerprint,
        "num_tokens": f"{snap.num_tokens:020d}",
        "token_hash": f"{snap.token_hash:016x}",
        "created": f"{snap.created:.6f}",
        "dtypes": _dtypes(tensors),
    }
    if snap.session_id is not None:
        meta["session_id"] = snap.session_id
    if snap.session_created is not None:
        meta["session_created"] = f"{snap.session_created:.6f}"
    if snap.owner is not None:
        meta["owner"] = snap.owner
    meta["checksum"] = _checksum(tensors, meta)
    if hmac_key is not None:
        meta["hmac"] = _signature(meta, hmac_key)
    return st_save(tensors, metadata=meta)


# -- decoding -----------------------------------------------------------------------------------------------------
def _header(data: bytes) -> dict[str, Any]:
    """The safetensors JSON header (tensor entries and `__metadata__`), checked only for being readable."""
    if len(data) < 8:
        raise SnapshotError(f"not a snapshot: {len(data)} bytes is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > len(data):
        raise SnapshotError("not a snapshot (not a safetensors file, or truncated): its header length is invalid")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SnapshotError("not a snapshot: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise SnapshotError("not a snapshot: the safetensors header is not a JSON object")
    return header


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotError("not a kvfree snapshot: the safetensors file has no string metadata")
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"not a kvfree snapshot: metadata format is {meta.get('format')!r}, expected {SNAPSHOT_FORMAT!r}"
        )
    if meta.get("version") != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"snapshot version {meta.get('version')!r} is not supported by this server (it reads version "
            f"{SNAPSHOT_VERSION!r}); restore it on the kvfree version that wrote it",
            "unsupported_version",
        )
    required = ("fingerprint", "num_tokens", "token_hash", "created", "dtypes", "checksum")
    missing = [k for k in required if k not in meta]
    if missing:
        raise SnapshotError(f"invalid snapshot: metadata field(s) {missing} missing")
    return meta


def _check_signature(meta: dict[str, str], hmac_key: bytes | None) -> None:
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


def _record(meta: dict[str, str], expected_fingerprint: str, tensors: dict[str, torch.Tensor]) -> Snapshot:
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
        tensors=tensors,
        fingerprint=meta["fingerprint"],
        num_tokens=num_tokens,
        token_hash=hash_value,
        created=created,
        session_id=meta.get("session_id"),
        session_created=session_created,
        owner=meta.get("owner"),
    )


def decode_snapshot(data: bytes, expected_fingerprint: str, hmac_key: bytes | None = None) -> Snapshot:
    """Parse and verify snapshot bytes: format, version, checksum, HMAC (when `hmac_key` is set), model
    fingerprint, metadata fields and finite state values. Raises SnapshotError (with `code`) on any problem.
    Tensor names, shapes and dtypes are left to `StatePool.import_`.
    """
    meta = _metadata(_header(data))
    try:
        tensors = st_load(data)
    except Exception as e:  # untrusted bytes: whatever the parser raises means the same thing
        raise SnapshotError(f"not a snapshot (corrupt or truncated safetensors data): {e}") from None
    if not hmac.compare_digest(meta["checksum"], _checksum(tensors, meta)):
        raise SnapshotError(
            "snapshot checksum mismatch: the file was corrupted or edited after it was written; export it again",
            "checksum_mismatch",
        )
    _check_signature(meta, hmac_key)
    snap = _record(meta, expected_fingerprint, tensors)
    if meta["dtypes"] != _dtypes(tensors):
        raise SnapshotError(f"invalid snapshot: metadata dtypes {meta['dtypes']!r} do not match its tensors")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SnapshotError(
                f"snapshot state {name} holds NaN or Inf values; the session it came from diverged and cannot be "
                "continued: start a new session",
                "non_finite_state",
            )
    return snap


def peek_snapshot(path: str | Path, expected_fingerprint: str, hmac_key: bytes | None = None) -> Snapshot:
    """A snapshot file's metadata without reading its tensors (`tensors` is empty): checks format, version,
    HMAC and fingerprint, but not the checksum or values (`decode_snapshot` does that when the state is loaded).
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        body = f.read(min(n, _MAX_HEADER + 1)) if len(prefix) == 8 else b""
    if n > _MAX_HEADER or len(body) < n:
        raise SnapshotError("not a snapshot (not a safetensors file, or truncated): its header length is invalid")
    meta = _metadata(_header(prefix + body))
    _check_signature(meta, hmac_key)
    return _record(meta, expected_fingerprint, {})
