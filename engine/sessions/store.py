"""SessionStore: where sessions' snapshots live beyond one process (docs/design/architecture.md §6).

Two implementations of one interface: `DirectoryStore`, a directory of `{session_id}.safetensors` files (one
server, or replicas sharing a volume), and `RedisStore`, a Redis database that several replicas share. A store
holds each session's snapshot bytes (checksummed, fingerprinted, optionally signed: engine/state/snapshot.py) and its
metadata, and hands out short leases so that two replicas never run turns on one session at once; beside them it
keeps small records that belong with sessions (the server's stored responses). Sessions are stored from the engine
thread, records from the server's worker threads (both stores are safe for that); failures raise
`SessionStoreError` (the server answers 503).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvfree.engine.protocol import SessionStoreError, SnapshotError
from kvfree.engine.state.packed import byte_view, read_file_into
from kvfree.engine.state.snapshot import peek_snapshot

SUFFIX = ".safetensors"
REDIS_CHUNK_BYTES = 4 << 20  # Redis values above this are stored as chunks of this size (see RedisStore)

BytesLike = bytes | bytearray | memoryview
Alloc = Callable[[int], torch.Tensor]  # nbytes -> a CPU uint8 tensor of that many elements to read into


def _bytes_view(data: BytesLike) -> memoryview:
    """`data` as a flat memoryview of bytes, without a copy."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")



@dataclass(frozen=True)
class StoredSession:
    """A stored session's metadata. version: rises with every write, so a replica can tell its copy is stale."""

    session_id: str
    owner: str | None
    num_tokens: int
    token_hash: int
    created: float
    version: int


RECORD_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_record_key(key: str) -> str:
    """`key` if it is a valid record key (letters, digits, `_`, `-`: safe as a file name), else ValueError."""
    if not RECORD_KEY.fullmatch(key):
        raise ValueError(f"record key {key!r}: expected 1-128 letters, digits, '_' or '-'")
    return key


class SessionStore(ABC):
    """Snapshots and metadata of sessions, by session id, for one model (the fingerprint is in every snapshot)."""

    shared = False  # other replicas may write it (check versions and take leases)
    lease_seconds: float | None = None  # how long a claim lasts unless its holder renews it (None: no leases)

    @abstractmethod
    def write(self, meta: StoredSession, data: bytes) -> StoredSession:
        """Store a session's snapshot (atomically: readers see the old one or the new one); returns its metadata
        with the new version."""

    def write_parts(self, meta: StoredSession, parts: Sequence[BytesLike]) -> StoredSession:
        """`write` of the snapshot whose bytes are `parts` one after the other (a header and the state buffer, say),
        for stores that can take them apart without joining them into one copy; this default joins them."""
        return self.write(meta, b"".join(parts))

    @abstractmethod
    def read(self, session_id: str) -> bytes | bytearray | None:
        """The snapshot bytes, or None when the store does not hold the session."""

    def read_into(self, session_id: str, alloc: Alloc) -> torch.Tensor | None:
        """The snapshot read into `alloc(nbytes)` (a CPU uint8 tensor `[nbytes]`, pinned on a GPU server, so that
        the state then crosses to the device in one DMA), or None when the store does not hold the session. This
        default copies `read()` into it; stores that can fill the buffer directly do."""
        data = self.read(session_id)
        if data is None:
            return None
        buffer = alloc(len(data))
        byte_view(buffer)[:] = data
        return buffer

    @abstractmethod
    def meta(self, session_id: str) -> StoredSession | None: ...

    @abstractmethod
    def delete(self, session_id: str) -> None: ...

    @abstractmethod
    def ids(self) -> list[str]:
        """Every stored session id."""

    # Small documents that belong with the sessions (a stored response's record), by key: `RECORD_KEY` characters.
    @abstractmethod
    def write_record(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def read_record(self, key: str) -> bytes | None: ...

    @abstractmethod
    def delete_record(self, key: str) -> None: ...

    @abstractmethod
    def ping(self) -> None:
        """Raise SessionStoreError when the store cannot be reached now (a readiness probe asks)."""

    def acquire_lease(self, session_id: str, holder: str) -> bool:
        """Claim the session for one turn; False when another holder has it (one process: always True)."""
        return True

    def renew_lease(self, session_id: str, holder: str) -> bool:
        """Extend the holder's claim by another `lease_seconds`; False when the claim is no longer the holder's."""
        return True

    def release_lease(self, session_id: str, holder: str) -> None:  # noqa: B027 (one process: nothing to release)
        """Give the claim back (only the holder's own)."""

    def close(self) -> None:  # noqa: B027 (files hold no connection)
        """Release connections."""


class DirectoryStore(SessionStore):
    """One `{session_id}.safetensors` file per session in `path`; metadata is read from the file's header.

    Every write goes to a `.tmp` file renamed over the old one, so a crash leaves the old file or the new one, never
    half of either. Without `fsync` a write is durable across a crash of the process (the kernel's page cache holds
    it) but not across a power loss or a crash of the machine, and costs no disk flush: right for spills and for the
    sessions persisted at shutdown, where the server itself is what may crash. With `fsync` the file is fsynced
    before its rename and the directory after it, so a write that returned survives the machine too: the server
    asks for it with write-through (`--session-write through`), whose promise is that a turn the client saw
    complete is never lost; records (stored responses) are then fsynced as well.
    """

    def __init__(self, path: str | Path, fingerprint: str, hmac_key: bytes | None = None, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.fingerprint, self.hmac_key = fingerprint, hmac_key
        self.fsync = fsync
        # An interrupted write left a .tmp file; the old file, if any, is intact.
        for tmp in [*self.path.glob(f"sess_*{SUFFIX}.tmp"), *self.path.glob("records/*.json.tmp")]:
            tmp.unlink(missing_ok=True)

    def _file(self, session_id: str) -> Path:
        return self.path / f"{session_id}{SUFFIX}"

    def _write_file(self, path: Path, parts: Sequence[BytesLike], what: str) -> int:
        """Write `parts`, one after the other, to `path` atomically (a crash never leaves half a file; with `fsync`,
        nor does a power loss lose it once this returns); returns the file's mtime, a version."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)  # each piece from its own buffer: a header and a state are never joined
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            os.replace(tmp, path)
            if self.fsync:
                _fsync_directory(path.parent)  # ... and the rename itself is on disk
            return path.stat().st_mtime_ns
        except OSError as e:
            with contextlib.suppress(OSError):  # (its folder may be what failed: a file where it should be, say)
                tmp.unlink(missing_ok=True)
            raise SessionStoreError(f"cannot write {what} to {self.path}: {e}") from e

    def _read_file(self, path: Path, what: str) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionStoreError(f"cannot read {what} from {self.path}: {e}") from e

    def write(self, meta: StoredSession, data: bytes) -> StoredSession:
        return self.write_parts(meta, [data])

    def write_parts(self, meta: StoredSession, parts: Sequence[BytesLike]) -> StoredSession:
        version = self._write_file(self._file(meta.session_id), parts, f"session {meta.session_id}")
        return StoredSession(**{**asdict(meta), "version": version})

    def read(self, session_id: str) -> bytes | None:
        return self._read_file(self._file(session_id), f"session {session_id}")

    def read_into(self, session_id: str, alloc: Alloc) -> torch.Tensor | None:
        try:
            return read_file_into(self._file(session_id), alloc)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionStoreError(f"cannot read session {session_id} from {self.path}: {e}") from e

    def meta(self, session_id: str) -> StoredSession | None:
        path = self._file(session_id)
        try:
            snap = peek_snapshot(path, self.fingerprint, self.hmac_key)
            version = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionStoreError(f"cannot read session {session_id} from {self.path}: {e}") from e
        if snap.session_id != session_id:
            raise SnapshotError(f"snapshot file {path} holds session {snap.session_id}")
        created = snap.session_created if snap.session_created is not None else snap.created
        return StoredSession(session_id, snap.owner, snap.num_tokens, snap.token_hash, created, version)

    def delete(self, session_id: str) -> None:
        self._file(session_id).unlink(missing_ok=True)

    def ping(self) -> None:
        # A directory that is gone or read-only (a lost volume) can hold no new turn.
        if not (self.path.is_dir() and os.access(self.path, os.W_OK | os.X_OK)):
            raise SessionStoreError(f"the session store directory {self.path} is missing or not writable")

    def ids(self) -> list[str]:
        return sorted(p.name.removesuffix(SUFFIX) for p in self.path.glob(f"sess_*{SUFFIX}"))

    def _record(self, key: str) -> Path:
        return self.path / "records" / f"{check_record_key(key)}.json"

    def write_record(self, key: str, data: bytes) -> None:
        self._write_file(self._record(key), [data], f"record {key}")

    def read_record(self, key: str) -> bytes | None:
        return self._read_file(self._record(key), f"record {key}")

    def delete_record(self, key: str) -> None:
        try:
            self._record(key).unlink(missing_ok=True)
        except OSError as e:
            raise SessionStoreError(f"cannot delete record {key} from {self.path}: {e}") from e


class RedisStore(SessionStore):
    """Sessions in Redis, shared by replicas: `{prefix}:snap:{id}` (snapshot bytes), `{prefix}:meta:{id}` (JSON
    metadata with its version), `{prefix}:lease:{id}` (the holder of the running turn, expiring after
    `lease_seconds` unless its holder renews it: a crashed replica's claim lapses). The prefix holds the model
    fingerprint, so models never share sessions. `ttl_seconds` (None: none) expires sessions not used for that long.

    A snapshot over `REDIS_CHUNK_BYTES` is stored as chunks `{prefix}:snap:{id}:{k}` of that size instead (the meta
    records `"chunks": n`): one huge value blocks Redis's single thread while it is copied, and holds the whole
    value in one client-side buffer, where 4 MiB chunks go through one pipeline back to back. Chunks and meta are
    written in one transaction, so a reader sees one version whole; a value written before chunking (one `snap`
    key, no "chunks" in its meta) still reads.
    """

    shared = True

    def __init__(self, url: str, fingerprint: str, ttl_seconds: float | None = None, lease_seconds: float = 10.0,
                 timeout: float = 5.0) -> None:  # fmt: skip
        import redis

        self._redis_errors = (redis.RedisError, OSError)
        self.url = url
        self.prefix = f"kvfree:{fingerprint}"
        self.ttl_ms = int(ttl_seconds * 1000) if ttl_seconds else None
        self.lease_seconds = lease_seconds
        self.lease_ms = int(lease_seconds * 1000)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._call(self.client.ping)  # fail at start-up, with the URL in the message, rather than on a request

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as e:
            raise SessionStoreError(f"the session store at {self.url} is unavailable: {e}") from e

    def _key(self, kind: str, session_id: str) -> str:
        return f"{self.prefix}:{kind}:{session_id}"

    def _chunk_key(self, session_id: str, k: int) -> str:
        return f"{self.prefix}:snap:{session_id}:{k}"

    @staticmethod
    def _parse_meta(raw: bytes | None) -> tuple[StoredSession | None, int]:
        """The stored metadata and its chunk count (0: the snapshot is one `snap` value, as before chunking)."""
        if raw is None:
            return None, 0
        fields = json.loads(raw)
        chunks = int(fields.pop("chunks", 0))
        return StoredSession(**fields), chunks

    def write(self, meta: StoredSession, data: bytes) -> StoredSession:
        return self.write_parts(meta, [data])

    def write_parts(self, meta: StoredSession, parts: Sequence[BytesLike]) -> StoredSession:
        sid = meta.session_id
        views = [_bytes_view(p) for p in parts]
        total = sum(v.nbytes for v in views)
        # One round trip: the new version, and how many chunks the old one has (those beyond ours are deleted).
        ask = self.client.pipeline(transaction=False)
        ask.incr(f"{self.prefix}:version")
        ask.get(self._key("meta", sid))
        version, old_raw = self._call(ask.execute)
        _, old_chunks = self._parse_meta(old_raw)
        stored = StoredSession(**{**asdict(meta), "version": int(version)})
        fields = asdict(stored)
        pipe = self.client.pipeline(transaction=True)  # snapshot and metadata change together
        if total <= REDIS_CHUNK_BYTES:
            chunks = 0
            pipe.set(self._key("snap", sid), views[0] if len(views) == 1 else b"".join(views), px=self.ttl_ms)
        else:
            pieces = _split(views, REDIS_CHUNK_BYTES)
            chunks = len(pieces)
            fields["chunks"] = chunks
            for k, piece in enumerate(pieces):
                pipe.set(self._chunk_key(sid, k), piece, px=self.ttl_ms)
            pipe.delete(self._key("snap", sid))  # a one-value version before this one
        pipe.set(self._key("meta", sid), json.dumps(fields), px=self.ttl_ms)
        stale = [self._chunk_key(sid, k) for k in range(chunks, old_chunks)]
        if stale:
            pipe.delete(*stale)
        self._call(pipe.execute)
        return stored

    def _fetch(self, session_id: str) -> list[bytes] | None:
        """The stored snapshot's pieces (one value, or its chunks in order), all of one version; None: not held."""
        for _attempt in range(3):
            first = self.client.pipeline(transaction=True)
            first.get(self._key("meta", session_id))
            first.get(self._key("snap", session_id))
            raw, single = self._call(first.execute)
            meta, chunks = self._parse_meta(raw)
            if not chunks:
                pieces = None if single is None else [single]
                break
            pipe = self.client.pipeline(transaction=True)  # the meta again: a write in between is seen, and retried
            pipe.get(self._key("meta", session_id))
            for k in range(chunks):
                pipe.get(self._chunk_key(session_id, k))
            again, *got = self._call(pipe.execute)
            if again != raw:
                continue  # another replica wrote a new version between the two reads: read that one
            if any(piece is None for piece in got):
                raise SessionStoreError(f"session {session_id} in {self.url} has lost chunks of its snapshot")
            pieces = got
            break
        else:
            raise SessionStoreError(f"session {session_id} in {self.url} changed under three reads in a row")
        if pieces is not None and self.ttl_ms:
            self._refresh(session_id, chunks)
        return pieces

    def _refresh(self, session_id: str, chunks: int) -> None:
        """Reading a session renews the TTL of all its keys (meta, value or chunks), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for name in [self._key("snap", session_id), self._key("meta", session_id)]:
            pipe.pexpire(name, self.ttl_ms)
        for k in range(chunks):
            pipe.pexpire(self._chunk_key(session_id, k), self.ttl_ms)
        self._call(pipe.execute)

    def read(self, session_id: str) -> bytes | bytearray | None:
        pieces = self._fetch(session_id)
        if pieces is None or len(pieces) == 1:
            return None if pieces is None else pieces[0]
        out = bytearray(sum(len(p) for p in pieces))  # one allocation, the chunks copied in at their offsets
        offset = 0
        for piece in pieces:
            out[offset : offset + len(piece)] = piece
            offset += len(piece)
        return out

    def read_into(self, session_id: str, alloc: Alloc) -> torch.Tensor | None:
        pieces = self._fetch(session_id)
        if pieces is None:
            return None
        buffer = alloc(sum(len(p) for p in pieces))
        view, offset = byte_view(buffer), 0
        for piece in pieces:  # each chunk straight into its place: no joined copy in between
            view[offset : offset + len(piece)] = piece
            offset += len(piece)
        return buffer

    def meta(self, session_id: str) -> StoredSession | None:
        return self._parse_meta(self._call(self.client.get, self._key("meta", session_id)))[0]

    def delete(self, session_id: str) -> None:
        _, chunks = self._parse_meta(self._call(self.client.get, self._key("meta", session_id)))
        names = [self._key("snap", session_id), self._key("meta", session_id)]
        self._call(self.client.delete, *names, *(self._chunk_key(session_id, k) for k in range(chunks)))

    def ids(self) -> list[str]:
        start = len(self._key("meta", ""))
        keys = self._call(lambda: list(self.client.scan_iter(match=self._key("meta", "sess_*"), count=1000)))
        return sorted(k.decode()[start:] for k in keys)

    def write_record(self, key: str, data: bytes) -> None:
        self._call(self.client.set, self._key("record", check_record_key(key)), data, px=self.ttl_ms)

    def read_record(self, key: str) -> bytes | None:
        name = self._key("record", check_record_key(key))
        data = self._call(self.client.get, name)
        if data is not None and self.ttl_ms:
            self._call(self.client.pexpire, name, self.ttl_ms)
        return data

    def delete_record(self, key: str) -> None:
        self._call(self.client.delete, self._key("record", check_record_key(key)))

    def ping(self) -> None:
        self._call(self.client.ping)

    def acquire_lease(self, session_id: str, holder: str) -> bool:
        return bool(self._call(self.client.set, self._key("lease", session_id), holder, nx=True, px=self.lease_ms))

    def renew_lease(self, session_id: str, holder: str) -> bool:
        # Extend only our own lease (compare and extend in one step), as release deletes only our own.
        script = (
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
        )
        return bool(self._call(self.client.eval, script, 1, self._key("lease", session_id), holder, self.lease_ms))

    def release_lease(self, session_id: str, holder: str) -> None:
        # Delete only our own lease (compare and delete in one step): an expired one may be another holder's now.
        script = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
        self._call(self.client.eval, script, 1, self._key("lease", session_id), holder)

    def close(self) -> None:
        self.client.close()


def _split(views: Sequence[memoryview], size: int) -> list[memoryview | bytes]:
    """The bytes of `views`, one after the other, cut into pieces of `size` (the last one shorter): views of the
    parts where a piece lies within one part, joined only where a piece spans two."""
    out: list[memoryview | bytes] = []
    pending: list[memoryview] = []
    filled = 0
    for view in views:
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            pending.append(view[:take])
            filled += take
            view = view[take:]
            if filled == size:
                out.append(pending[0] if len(pending) == 1 else b"".join(pending))
                pending, filled = [], 0
    if pending:
        out.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return out


def _fsync_directory(path: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_store(spec: str | Path, fingerprint: str, hmac_key: bytes | None = None, ttl_seconds: float | None = None,
               lease_seconds: float = 10.0, fsync: bool = False) -> SessionStore:  # fmt: skip
    """A store from `--session-store`: `redis://host:port/db` (or rediss://) for Redis, else a directory path
    (`fsync`: see `DirectoryStore`; Redis makes writes durable as its own `appendfsync` says)."""
    text = str(spec)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(text, fingerprint, ttl_seconds, lease_seconds)
    return DirectoryStore(text, fingerprint, hmac_key, fsync=fsync)


def new_holder() -> str:
    """A lease holder id for this process (unique across replicas and restarts)."""
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}:{time.time():.0f}"


@dataclass
class WriteDone:
    """A finished background write: the stored version (or the error), and how long after its turn it landed."""

    session_id: str
    version: int | None
    error: Exception | None
    lag_seconds: float


class BackgroundWriter:
    """`--session-write async`: encodes and stores snapshots on a thread of its own, off the engine's step.

    The engine thread copies a finished turn's state to the host (a consistent copy) and `submit`s it; the last
    event of the turn goes out at once, and the write lands within the queue's drain time. At most `max_pending`
    writes wait: beyond that `submit` blocks the engine thread, which bounds the delay, and so what a crash can
    lose, to that many writes. Results come back through `done()`, read by the engine thread.
    """

    def __init__(self, store: SessionStore, encode, max_pending: int = 16) -> None:
        import queue
        import threading

        self.store, self.encode = store, encode
        self._todo: queue.Queue = queue.Queue(maxsize=max_pending)
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvfree-session-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._todo.unfinished_tasks

    def submit(self, meta: StoredSession, snapshot) -> None:
        self._todo.put((meta, snapshot, time.monotonic()))

    def done(self) -> list[WriteDone]:
        out = []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out

    def flush(self) -> None:
        """Wait until every submitted write has landed (shutdown)."""
        self._todo.join()

    def _run(self) -> None:
        while True:
            meta, snapshot, submitted = self._todo.get()
            try:
                version, error = self.store.write_parts(meta, self.encode(snapshot)).version, None
            except Exception as exc:  # reported to the engine thread, which keeps the session in memory
                version, error = None, exc
            self._done.put(WriteDone(meta.session_id, version, error, time.monotonic() - submitted))
            self._todo.task_done()
