"""SnapshotFiles: the in-memory files that carry snapshots between the HTTP front and the engine, kept for reuse.

A snapshot (tens of MB) crosses from the engine to a download, or from an upload to the engine, as a file that one
side writes and the other reads: written once and read once, never pushed through the engine's pipe. Where Linux
gives anonymous memory files (`memfd_create`), those are used and kept: a new file's pages are allocated as it is
written, one page fault per 4 KiB (a 51 MB write took 24 ms into a new file in /dev/shm, 7 ms into one whose pages
were already there), so a file goes back to the pool after its request, up to `keep` idle ones. The engine process
opens a memfd by its `/proc/{pid}/fd/{fd}` path. The kernel frees a memfd when the process ends, however it ends: a
file in /dev/shm would outlive a killed server. Elsewhere each snapshot gets a temporary file in `FAST_TEMP_DIR`
(else the default temporary directory), removed after its request.

Writers open the file without truncating it ("r+b") and truncate it to what they wrote when done: a snapshot of the
same model has the same size every time, so the pages stay.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from dataclasses import dataclass

FAST_TEMP_DIR = "/dev/shm"  # tmpfs: a temporary file there never waits on a disk
MEMFD = hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


@dataclass(frozen=True)
class SnapshotFile:
    """One carrier: `path` opens it in either process; `fd` is the memfd this process holds (None: a temp file)."""

    path: str
    fd: int | None


class SnapshotFiles:
    """A pool of snapshot carriers (see the module docstring). Safe from any thread.

    Args:
        keep: idle memfds kept for reuse (each holds one snapshot's pages: tens of MB each).
        memfd: use memfds (default: where the platform has them); False: temporary files.
    """

    def __init__(self, keep: int = 2, memfd: bool | None = None) -> None:
        self.keep = keep
        self.memfd = MEMFD if memfd is None else memfd
        self._idle: list[SnapshotFile] = []
        self._lock = threading.Lock()

    def take(self) -> SnapshotFile:
        """A carrier for one snapshot, empty or holding a previous one's bytes (writers truncate to what they wrote);
        `give_back` it when its request ends."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self.memfd:
            fd = os.memfd_create("kvfree-snapshot", os.MFD_CLOEXEC)
            return SnapshotFile(f"/proc/{os.getpid()}/fd/{fd}", fd)
        fast = os.path.isdir(FAST_TEMP_DIR) and os.access(FAST_TEMP_DIR, os.W_OK | os.X_OK)
        where = FAST_TEMP_DIR if fast else None
        fd, name = tempfile.mkstemp(prefix="kvfree-snapshot-", suffix=".safetensors", dir=where)
        os.close(fd)
        return SnapshotFile(name, None)

    def give_back(self, carrier: SnapshotFile) -> None:
        """The request is done with `carrier`: kept for the next one (a memfd, while fewer than `keep` are idle), or
        closed or removed."""
        if carrier.fd is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(carrier.path)
            return
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(carrier)
                return
        os.close(carrier.fd)

    def close(self) -> None:
        """Close the idle memfds (shutdown; the kernel would at exit anyway)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for carrier in idle:
            if carrier.fd is not None:
                os.close(carrier.fd)

    @property
    def idle(self) -> int:
        return len(self._idle)
