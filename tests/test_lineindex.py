"""The lineage index: what a fork finds its parent by, and which claims of a server count
(issue 20: an anchor belongs to the one server that issued it, and counts only when the
request's history agrees with the conversation it names)."""

from __future__ import annotations

import time

import pytest

from sessionpin.records import lineindex, pins
from sessionpin.store import open_store

AGENT = "claude-code"
ROOT_P, ROOT_Q = "a" * 32, "b" * 32
SERVERS = ("anthropic", "evil", "glm")


@pytest.fixture
async def store():
    s = open_store("memory:")
    now = time.time()
    for session, server in (("P", "anthropic"), ("Q", "evil"), ("F", "anthropic")):
        await pins.create(s, session, pins.Pin(agent=AGENT, server=server, since=now, renewed=now))
    yield s
    await s.close()


async def record(store, session, root, anchors=(), server=None, owns_root=True):
    await lineindex.record(store, AGENT, session, root, anchors, server, owns_root)


async def find(store, root, anchors=(), sessions=(), own="FORK"):
    return await lineindex.find_parent(store, AGENT, own, sessions, anchors, root, SERVERS)


async def test_an_anchor_of_one_server_whose_history_agrees_names_its_conversation(store):
    await record(store, "P", ROOT_P)
    await record(store, "F", ROOT_P, ["req:R"], "anthropic", owns_root=False)   # a fork of P, same root
    found = await find(store, ROOT_P, ["req:R"])
    assert found.session == "F" and found.loaded.pin.server == "anthropic"      # the anchor, before the root
    assert (await find(store, ROOT_P)).session == "P"                          # the root alone: P


async def test_an_anchor_naming_a_conversation_whose_history_disagrees_does_not_count(store):
    """A server echoed the id it was sent: its claim names its own conversation Q, whose root is not
    the request's. The request goes by its own root, to P."""
    await record(store, "P", ROOT_P)
    await record(store, "Q", ROOT_Q, ["req:R"], "evil")
    found = await find(store, ROOT_P, ["req:R"])
    assert found.session == "P" and found.refuted == (("req:R", "Q"),)
    assert (await find(store, None, ["req:R"])).session is None       # no history to agree with: nothing


async def test_an_anchor_issued_by_two_servers_is_void(store):
    """Both claims agree with the history, yet the id was issued twice: it names nothing (and
    is reported, for the log)."""
    await record(store, "F", ROOT_P, ["req:R"], "anthropic", owns_root=False)
    await record(store, "Q", ROOT_P, ["req:R"], "evil", owns_root=False)
    found = await find(store, ROOT_P, ["req:R"])
    assert found.session is None and found.voided == (("req:R", ("anthropic", "evil")),)
    await record(store, "P", ROOT_P)
    assert (await find(store, ROOT_P, ["req:R"])).session == "P"      # the root still finds its owner


async def test_a_claim_of_a_server_not_configured_is_not_seen(store):
    await record(store, "Q", ROOT_P, ["req:R"], "gone", owns_root=False)
    assert (await find(store, ROOT_P, ["req:R"])).session is None


async def test_parent_ids_the_client_names_count_as_named(store):
    """Codex's thread ids are the client's own, not a server's claim: no history is needed."""
    assert (await find(store, None, sessions=["Q"])).session == "Q"
    assert (await find(store, None, sessions=["Q"], own="Q")).session is None     # never its own parent


async def test_nothing_is_recorded_that_could_not_be_corroborated():
    assert lineindex.record_writes(AGENT, "P", None, ["req:R"], "anthropic") == []        # no root
    assert lineindex.record_writes(AGENT, "P", ROOT_P, ["req:R"], None) == [
        lineindex.Set(lineindex.root_key(AGENT, ROOT_P), "P", lineindex.ROOT_TTL)]       # no issuer: no anchor
    assert lineindex.record_writes(AGENT, "F", ROOT_P, ["req:R"], "glm", owns_root=False) == [
        lineindex.Set(lineindex.anchor_key(AGENT, "req:R", "glm"), f"{ROOT_P} F", lineindex.ANCHOR_TTL)]
