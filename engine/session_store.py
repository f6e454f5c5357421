"""SessionStore: where sessions' snapshots live beyond one process (docs/design/architecture.md §6).

Two implementations of one interface: `DirectoryStore`, a directory of `{session_id}.safetensors` files (one
server, or replicas sharing a volume), and `RedisStore`, a Redis database that several replicas share. A store
holds each session's snapshot bytes (checksummed, fingerprinted, optionally signed: engine/snapshot.py) and its
metadata, and hands out short leases so that two replicas never run turns on one session at once; beside them it
keeps small records that belong with sessions (the server's stored responses). Sessions are stored from the engine
thread, records from the server's worker threads (both stores are safe for that); failures raise
`SessionStoreError` (the server answers 503).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfree.engine.snapshot import SnapshotError, peek_snapshot

SUFFIX = ".safetensors"


class SessionStoreError(RuntimeError):
    """The store cannot be reached or written now (HTTP 503); what it held is not lost."""


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

    @abstractmethod
    def read(self, session_id: str) -> bytes | None:
        """The snapshot bytes, or None when the store does not hold the session."""

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
    """One `{session_id}.safetensors` file per session in `path`; metadata is read from the file's header."""

    def __init__(self, path: str | Path, fingerprint: str, hmac_key: bytes | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.fingerprint, self.hmac_key = fingerprint, hmac_key
        # An interrupted write left a .tmp file; the old file, if any, is intact.
        for tmp in [*self.path.glob(f"sess_*{SUFFIX}.tmp"), *self.path.glob("records/*.json.tmp")]:
            tmp.unlink(missing_ok=True)

    def _file(self, session_id: str) -> Path:
        return self.path / f"{session_id}{SUFFIX}"

    def _write_file(self, path: Path, data: bytes, what: str) -> int:
        """Write `data` to `path` atomically (a crash never leaves half a file); returns its mtime, a version."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return path.stat().st_mtime_ns
        except OSError as e:
            raise SessionStoreError(f"cannot write {what} to {self.path}: {e}") from e

    def _read_file(self, path: Path, what: str) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionStoreError(f"cannot read {what} from {self.path}: {e}") from e

    def write(self, meta: StoredSession, data: bytes) -> StoredSession:
        version = self._write_file(self._file(meta.session_id), data, f"session {meta.session_id}")
        return StoredSession(**{**asdict(meta), "version": version})

    def read(self, session_id: str) -> bytes | None:
        return self._read_file(self._file(session_id), f"session {session_id}")

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
        self._write_file(self._record(key), data, f"record {key}")

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

    def write(self, meta: StoredSession, data: bytes) -> StoredSession:
        version = int(self._call(self.client.incr, f"{self.prefix}:version"))
        stored = StoredSession(**{**asdict(meta), "version": version})
        pipe = self.client.pipeline(transaction=True)  # snapshot and metadata change together
        pipe.set(self._key("snap", meta.session_id), data, px=self.ttl_ms)
        pipe.set(self._key("meta", meta.session_id), json.dumps(asdict(stored)), px=self.ttl_ms)
        self._call(pipe.execute)
        return stored

    def read(self, session_id: str) -> bytes | None:
        data = self._call(self.client.get, self._key("snap", session_id))
        if data is not None and self.ttl_ms:
            self._call(self.client.pexpire, self._key("snap", session_id), self.ttl_ms)
            self._call(self.client.pexpire, self._key("meta", session_id), self.ttl_ms)
        return data

    def meta(self, session_id: str) -> StoredSession | None:
        raw = self._call(self.client.get, self._key("meta", session_id))
        return StoredSession(**json.loads(raw)) if raw is not None else None

    def delete(self, session_id: str) -> None:
        self._call(self.client.delete, self._key("snap", session_id), self._key("meta", session_id))

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


def open_store(spec: str | Path, fingerprint: str, hmac_key: bytes | None = None, ttl_seconds: float | None = None,
               lease_seconds: float = 10.0) -> SessionStore:  # fmt: skip
    """A store from `--session-store`: `redis://host:port/db` (or rediss://) for Redis, else a directory path."""
    text = str(spec)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(text, fingerprint, ttl_seconds, lease_seconds)
    return DirectoryStore(text, fingerprint, hmac_key)


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
                version, error = self.store.write(meta, self.encode(snapshot)).version, None
            except Exception as exc:  # reported to the engine thread, which keeps the session in memory
                version, error = None, exc
            self._done.put(WriteDone(meta.session_id, version, error, time.monotonic() - submitted))
            self._todo.task_done()
