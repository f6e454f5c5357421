"""The shared-memory command channel of tensor parallelism (engine/parallel/command_channel.py): every reader gets every
message, in order; the writer waits for the slowest reader; a reader that has stopped is reported, not waited for."""

from __future__ import annotations

import multiprocessing

import pytest

from kvfree.engine.parallel.command_channel import CommandChannel


def _reader(path: str, index: int, readers: int, count: int, out) -> None:
    channel = CommandChannel(path, readers)
    got = [channel.get(index, lambda: None, timeout=30) for _ in range(count)]
    out.put((index, got))
    channel.close()


def _fine() -> None:
    """`alive` for a channel whose readers are all there."""


def test_every_reader_gets_every_message_in_order():
    """Three readers, 200 messages of varied sizes (one of 1 MB): each reader receives all of them, in order."""
    channel = CommandChannel.create(readers=3)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(channel.path, i, 3, 200, out)) for i in range(3)]
    for p in procs:
        p.start()
    messages = [[("step", list(range(i % 17)), "x" * (10**6 if i == 100 else i))] for i in range(200)]

    def alive() -> None:
        assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a reader died"

    try:
        for m in messages:
            channel.put(m, alive, timeout=60)
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
        channel.close(unlink=True)
    assert sorted(results) == [0, 1, 2]
    assert all(got == messages for got in results.values())


def test_a_reader_that_has_stopped_is_reported_and_a_message_too_large_is_refused():
    """The writer waits for every reader to take the last message: with one gone, `alive` is asked and its error
    comes out (rather than a wait without end)."""
    channel = CommandChannel.create(readers=1)
    try:
        channel.put(["first"], _fine, timeout=30)  # nobody takes it

        def gone() -> None:
            raise RuntimeError("reader 0 has stopped")

        with pytest.raises(RuntimeError, match="reader 0 has stopped"):
            channel.put(["second"], gone, timeout=30)
        with pytest.raises(ValueError, match="does not fit"):
            channel.put(b"x" * (65 * 1024 * 1024), _fine, timeout=30)
    finally:
        channel.close(unlink=True)
