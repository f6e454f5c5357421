"""CommandChannel: rank 0's commands to the other tensor-parallel ranks, through shared memory on one host.

Every engine step sends the workers one small message (the step's slots and prompt tokens). Through gloo's
`broadcast_object_list` (two TCP sends to each worker, one after another), a small model's step on an H100 host
took 0.60 / 1.10 / 2.18 ms at TP=1 / 2 / 4 (BENCHMARKS.md). Here rank 0 pickles the message once into a
memory-mapped file that every rank maps; the readers poll its sequence number. One message is in the channel at a
time: rank 0 writes the next only after every reader has taken the last (they take it as soon as they are idle,
which a worker is between steps).

Layout of the file (little-endian u64 words, then the message): [0] sequence number of the message in the buffer,
[1] its length in bytes, [2 + i] the last sequence number reader i took; the message from byte DATA_OFFSET.
The sequence number is written last (x86 keeps stores in order, and each word is one aligned 8-byte store), so a
reader that sees it sees the message.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

DATA_OFFSET = 4096
CAPACITY = 64 * 1024 * 1024  # the largest message (a step's prompt tokens are well under 1 MB)
IDLE_SLEEP_S = 0.0005  # the longest a waiting reader sleeps between polls, once it has been idle a while
SPIN_S = 0.002  # how long a waiter polls without sleeping first (a step's command follows the last within ms)


def _wait(ready: Callable[[], bool], alive: Callable[[], None], timeout: float) -> None:
    """Poll `ready` until it holds: spinning at first, then sleeping a little longer each time (to IDLE_SLEEP_S);
    `alive` is called about once a second and raises when the other side is gone; TimeoutError after `timeout`."""
    start = last_check = time.monotonic()
    sleep = 0.0
    while not ready():
        now = time.monotonic()
        if now - start > SPIN_S:
            sleep = min(IDLE_SLEEP_S, sleep + 1e-5)
            time.sleep(sleep)
        if now - last_check > 1.0:
            alive()
            last_check = now
            if now - start > timeout:
                raise TimeoutError(f"no answer through the command channel in {timeout:.0f} s")


class CommandChannel:
    """One writer (rank 0) and `readers` readers of pickled messages in a memory-mapped file at `path`."""

    def __init__(self, path: str, readers: int) -> None:
        self.path = path
        self.readers = readers
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), DATA_OFFSET + CAPACITY)
        self._words = np.ndarray((2 + readers,), dtype=np.uint64, buffer=self._map)
        self._taken = 0  # (a reader's) last sequence number taken

    @classmethod
    def create(cls, readers: int) -> CommandChannel:
        """A new channel file (in /dev/shm where there is one: memory, not disk), zeroed."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="kvfree-commands-", dir=folder)
        os.ftruncate(fd, DATA_OFFSET + CAPACITY)
        os.close(fd)
        return cls(path, readers)

    def put(self, message: Any, alive: Callable[[], None], timeout: float) -> None:
        """(Rank 0) hand `message` to every reader, once each has taken the previous one."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > CAPACITY:
            raise ValueError(f"a command of {len(data)} bytes does not fit the channel's {CAPACITY}")
        words = self._words
        seq = int(words[0])
        _wait(lambda: all(int(w) == seq for w in words[2:]), alive, timeout)
        self._map[DATA_OFFSET : DATA_OFFSET + len(data)] = data
        words[1] = len(data)
        words[0] = seq + 1

    def get(self, reader: int, alive: Callable[[], None], timeout: float) -> Any:
        """(Reader `reader`, 0-based) the next message, waiting for it."""
        words = self._words
        _wait(lambda: int(words[0]) > self._taken, alive, timeout)
        seq, length = int(words[0]), int(words[1])
        message = pickle.loads(self._map[DATA_OFFSET : DATA_OFFSET + length])
        self._taken = seq
        words[2 + reader] = seq
        return message

    def close(self, unlink: bool = False) -> None:
        """Unmap (and, the writer at the end, remove the file)."""
        self._words = None  # type: ignore[assignment]  (a view of the map: it must go before the map closes)
        self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
