"""BodyProcess: a large body's facts read in a child process, the event loop free meanwhile."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from sessionpin.reader import facts as F
from sessionpin.proxy.offprocess import BodyProcess
from test_bodyreader import HEADERS, URL, tiny


async def test_the_child_gives_the_readers_facts_and_is_started_once():
    reader = BodyProcess()
    try:
        for body in (tiny(50_000), tiny(3, answer=False), b"garbage"):
            got = await reader.facts("POST", URL, HEADERS, body, None, None)
            want = F.read("POST", URL, HEADERS, body, None)
            assert (got.turn, got.session, got.has_history, got.parsed, got.reason) == \
                (want.turn, want.session, want.has_history, want.parsed, want.reason)
        assert (reader.reads, reader.started, reader.failures) == (3, 1, 0)
    finally:
        reader.close()


async def test_the_event_loop_runs_while_a_body_of_two_million_messages_is_read():
    """Issue 20's body: 45 MiB of tiny messages before the first answer. The loop ticks every
    millisecond meanwhile; read inline it is held for the whole decode (a second or more)."""
    body = tiny(1_500_000)
    reader = BodyProcess()
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    try:
        await reader.facts("POST", URL, HEADERS, b"{}", None, None)     # the child started
        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        got = await reader.facts("POST", URL, HEADERS, body, None, None)
        took = time.perf_counter() - t0
        done.set()
        await ticker
    finally:
        reader.close()
    assert got.turn == "continuation" and got.has_history
    # the loop's worst gap is a small part of the read (a pipe write per 256 KiB), not all of it
    assert max(gaps) < max(0.25, took / 4), (max(gaps), took)


async def test_a_child_that_dies_gives_an_unread_body_and_is_replaced():
    reader = BodyProcess()
    real, reader.command = reader.command, (sys.executable, "-c", "import sys; sys.stdin.buffer.read(10)")
    try:
        lost = await reader.facts("POST", URL, HEADERS, tiny(200_000), None, None)   # dies mid-body
        reader.command = real
        assert not lost.parsed and lost.turn == "unknown" and "reader process failed" in lost.reason
        assert lost.session == "abcd1234-0000-4000-8000-000000000001"    # the header still says it
        again = await reader.facts("POST", URL, HEADERS, tiny(2), None, None)
        assert again.parsed and again.turn == "continuation"
        assert (reader.started, reader.failures) == (2, 1)
    finally:
        reader.close()


async def test_a_child_slower_than_the_timeout_is_killed():
    reader = BodyProcess(timeout=0.05)
    try:
        got = await reader.facts("POST", URL, HEADERS, tiny(1_000_000), None, None)
        assert not got.parsed and "longer than" in got.reason and reader._proc is None
    finally:
        reader.close()


async def test_a_shape_is_read_in_the_child_and_none_when_it_fails():
    from sessionpin.reader import promptshape
    reader = BodyProcess()
    try:
        body = tiny(30_000)
        assert await reader.shape(body, F.ANTHROPIC_MESSAGES, None) == promptshape.shape(body, F.ANTHROPIC_MESSAGES)
        reader.command = (sys.executable, "-c", "import sys; sys.stdin.buffer.read(10)")
        reader._kill()
        assert await reader.shape(body, F.ANTHROPIC_MESSAGES, None) is None and reader.failures == 1
    finally:
        reader.close()


async def test_a_child_that_answers_garbage_is_replaced_and_the_body_taken_as_unread():
    reader = BodyProcess()
    liar = "import sys; sys.stdin.buffer.read(20); sys.stdout.buffer.write(b'\\x00\\x00\\x00\\x03abc'); sys.stdout.flush()"
    real, reader.command = reader.command, (sys.executable, "-c", liar)
    try:
        got = await reader.facts("POST", URL, HEADERS, tiny(2), None, None)
        assert not got.parsed and "reader process failed (" in got.reason and reader._proc is None
        reader.command = real
        assert (await reader.facts("POST", URL, HEADERS, tiny(2), None, None)).parsed
    finally:
        reader.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd (Linux only)")
async def test_bodies_go_through_the_shared_memory_file_and_a_large_ones_pages_are_given_back(monkeypatch):
    """Issue 22: the body is copied into a memory file the child reads, not written down the
    pipe (~1 ms of the event loop per MB); the pipe carries the heads only. Bodies larger than
    a copy's chunk arrive whole; the file keeps no more than ``SHARED_KEEP`` after a body."""
    from sessionpin.proxy import offprocess
    monkeypatch.setattr(offprocess, "SHARED_CHUNK", 64 * 1024)          # several copies a body
    monkeypatch.setattr(offprocess, "SHARED_KEEP", 1024 * 1024)
    piped: list[int] = []
    real_write = asyncio.StreamWriter.write
    monkeypatch.setattr(asyncio.StreamWriter, "write", lambda self, data: piped.append(len(data)) or real_write(self, data))
    reader = BodyProcess()
    try:
        for body in (tiny(3), tiny(60_000), tiny(2), b"garbage"):
            got = await reader.facts("POST", URL, HEADERS, body, None, None)
            want = F.read("POST", URL, HEADERS, body, None)
            assert (got.turn, got.session, got.has_history, got.parsed, got.reason) == \
                (want.turn, want.session, want.has_history, want.parsed, want.reason)
            size = os.fstat(reader._shared).st_size
            assert size == (0 if len(body) > offprocess.SHARED_KEEP else max(size, len(body)))
        assert reader._shared is not None and (reader.reads, reader.started, reader.failures) == (4, 1, 0)
        assert len(piped) == 4 and max(piped) < 1024                    # a head a body, nothing more
        fd = reader._shared
    finally:
        reader.close()
    assert reader._shared is None
    with pytest.raises(OSError):
        os.fstat(fd)                                                     # closed with the reader


async def test_without_shared_memory_the_bodies_go_down_the_pipe(monkeypatch):
    def no_memfd(*a, **k):
        raise OSError("not here")
    monkeypatch.setattr(os, "memfd_create", no_memfd, raising=False)
    reader = BodyProcess()
    try:
        for body in (tiny(3), tiny(60_000)):
            got = await reader.facts("POST", URL, HEADERS, body, None, None)
            assert got.parsed and got.turn == F.read("POST", URL, HEADERS, body, None).turn
        assert reader._shared is None and reader.reads == 2
    finally:
        reader.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd (Linux only)")
async def test_a_shared_file_that_cannot_take_a_body_gives_the_pipe_to_the_next_child(monkeypatch):
    """A write into the shared file that fails (no memory for it) fails that body as a child
    failure does (read without it), and the bodies after it go down a new child's pipe."""
    from sessionpin.proxy import offprocess
    reader = BodyProcess()
    real = os.pwrite

    def full(*a):
        raise OSError(28, "No space left on device")
    try:
        assert (await reader.facts("POST", URL, HEADERS, tiny(2), None, None)).parsed and reader._shared is not None
        monkeypatch.setattr(offprocess.os, "pwrite", full)
        lost = await reader.facts("POST", URL, HEADERS, tiny(3), None, None)
        assert not lost.parsed and "reader process failed" in lost.reason and reader._shared is None
        monkeypatch.setattr(offprocess.os, "pwrite", real)
        again = await reader.facts("POST", URL, HEADERS, tiny(3), None, None)
        assert again.parsed and (reader.started, reader.failures) == (2, 1)
    finally:
        reader.close()
