"""BodyProcess: a large body's facts read in a child process, the event loop free meanwhile."""

from __future__ import annotations

import asyncio
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


def test_a_large_body_of_few_objects_is_read_in_the_proxy_and_one_of_many_apart():
    """Issue 22 beside issue 20: what holds the loop is the objects a decode builds, not the
    bytes. A 1 MB history of long messages (a few thousand objects) is read in the proxy, while
    a compressed body, one of more than 20,000 objects, and any from 8 MiB go to the process."""
    from sessionpin.proxy.offprocess import read_apart
    head, tail = b'{"model":"m","messages":[', b'{"role":"user","content":"go"}]}'
    long = b'{"role":"user","content":"' + b"x" * 4000 + b'"},'
    few = head + long * 270 + tail
    assert len(few) >= 1024 * 1024 and not read_apart(few, None) and not read_apart(few, "identity")
    assert read_apart(few, "gzip") and read_apart(few, " GZIP ")
    assert read_apart(b'{"a":' + b" " * (8 * 1024 * 1024) + b"1}", None)
    many = head + b'{"role":"user","content":"x"},' * 20_001 + tail
    assert read_apart(many, None) and not read_apart(many[:200_000], None)
    assert not read_apart(b"{}" * 100_000, None)                       # under 256 KiB: never


@pytest.mark.parametrize("raw, limit", [
    (b"", 0), (b"{", 0), (b"{", 1), (b"{{", 1), (b"x{y{z{", 3), (b"x{y{z{", 2), (b'{"a":{}}' * 5000, 10_000),
    (b'{"a":{}}' * 5000, 9_999), (b"{}" * 30_000, 20_000), (b"no braces at all" * 1000, 0), (b"{" * 20_001, 20_000),
    (b"{" * 20_000, 20_000),
    # across the 64 KiB slices it counts in
    (b"x" * (64 * 1024 - 1) + b"{{" + b"y" * 70_000 + b"{", 2), (b"x" * (64 * 1024 - 1) + b"{{" + b"y" * 70_000 + b"{", 3),
    (b"{}" * 100_000, 99_999), (b"{}" * 100_000, 100_000), (b"x" * 300_000 + b"{", 0),
])
def test_more_than_counts_as_bytes_count_does(raw, limit):
    """Issue 22: the large-body test ``read_apart`` counts objects with ``replace`` (memchr,
    stopping after ``limit + 1``) instead of ``bytes.count``: the same answer at every boundary."""
    from sessionpin.proxy.offprocess import _more_than
    assert _more_than(raw, b"{", limit) is (raw.count(b"{") > limit)
