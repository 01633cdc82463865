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


# ---- pi's openings: conversations that began alike ----------------------------------------

FP = "fp:0123abcd"


async def pi_pin(store, session, server):
    now = time.time()
    await pins.create(store, session, pins.Pin(agent="pi", server=server, since=now, renewed=now))


async def test_a_turn_whose_root_is_unknown_goes_to_the_one_conversation_that_began_so(store):
    await pi_pin(store, FP + ".a", "glm")
    await lineindex.remember_opening(store, "pi", FP, FP + ".a")
    assert await lineindex.find_conversation(store, "pi", ROOT_P, FP) == lineindex.Found(FP + ".a")


async def test_conversations_that_began_alike_on_one_server_give_the_latest(store):
    for s in ("a", "b", "c"):
        await pi_pin(store, f"{FP}.{s}", "glm")
        await lineindex.remember_opening(store, "pi", FP, f"{FP}.{s}")
    assert await lineindex.find_conversation(store, "pi", ROOT_P, FP) == lineindex.Found(FP + ".c")
    assert await store.get(lineindex.opening_key("pi", FP)) == f"{FP}.c {FP}.b {FP}.a"     # newest first


async def test_conversations_that_began_alike_pinned_apart_are_not_told_by_their_opening(store):
    """A on glm, then the agent switched: B on alt. A turn whose root is not known could be
    either: no session is given (before: B, the latest — moving A to alt)."""
    await pi_pin(store, FP + ".a", "glm")
    await lineindex.remember_opening(store, "pi", FP, FP + ".a")
    await pi_pin(store, FP + ".b", "alt")
    await lineindex.remember_opening(store, "pi", FP, FP + ".b")
    found = await lineindex.find_conversation(store, "pi", ROOT_P, FP)
    assert found == lineindex.Found(None, apart=((FP + ".b", "alt"), (FP + ".a", "glm")))
    await store.set(lineindex.root_key("pi", ROOT_P), FP + ".a")     # its root known: no doubt
    assert await lineindex.find_conversation(store, "pi", ROOT_P, FP) == lineindex.Found(FP + ".a", by_root=True)


async def test_pinned_apart_a_conversation_whose_known_root_is_another_is_not_this_one(store):
    """A's root was never recorded (its opening's answer not seen whole); B's was. A turn with
    A's history is not B's: A's. And B's turn, before B's root is written (its records follow its
    answer by a moment), while A's is known: B's."""
    await pi_pin(store, FP + ".a", "glm")
    await lineindex.remember_opening(store, "pi", FP, FP + ".a")
    await pi_pin(store, FP + ".b", "alt")
    await lineindex.remember_opening(store, "pi", FP, FP + ".b")
    await lineindex.record(store, "pi", FP + ".b", ROOT_Q)
    assert await lineindex.find_conversation(store, "pi", ROOT_P, FP) == lineindex.Found(FP + ".a")
    await store.delete(lineindex.root_of_key("pi", FP + ".b"))
    await store.delete(lineindex.root_key("pi", ROOT_Q))
    await lineindex.record(store, "pi", FP + ".a", ROOT_P)
    assert await lineindex.find_conversation(store, "pi", ROOT_Q, FP) == lineindex.Found(FP + ".b")


async def test_pinned_apart_and_every_known_root_another_none_is_told(store):
    await pi_pin(store, FP + ".a", "glm")
    await lineindex.remember_opening(store, "pi", FP, FP + ".a")
    await pi_pin(store, FP + ".b", "alt")
    await lineindex.remember_opening(store, "pi", FP, FP + ".b")
    await lineindex.record(store, "pi", FP + ".a", ROOT_P)
    await lineindex.record(store, "pi", FP + ".b", ROOT_Q)
    found = await lineindex.find_conversation(store, "pi", "c" * 32, FP)
    assert found == lineindex.Found(None, apart=((FP + ".b", "alt"), (FP + ".a", "glm")))


def test_only_a_conversation_keyed_by_a_fingerprint_records_its_root_by_session():
    keys = {w.key for w in lineindex.record_writes("pi", FP + ".a", ROOT_P)}
    assert keys == {lineindex.root_key("pi", ROOT_P), lineindex.root_of_key("pi", FP + ".a")}
    assert {w.key for w in lineindex.record_writes(AGENT, "P", ROOT_P)} == {lineindex.root_key(AGENT, ROOT_P)}
    assert lineindex.record_writes("pi", FP + ".f", ROOT_P, owns_root=False) == []      # a fork's root is its parent's


async def test_a_listed_conversation_without_a_pin_does_not_make_a_doubt(store):
    await lineindex.remember_opening(store, "pi", FP, FP + ".gone")    # its pin expired or was forgotten
    await pi_pin(store, FP + ".b", "alt")
    await lineindex.remember_opening(store, "pi", FP, FP + ".b")
    assert await lineindex.find_conversation(store, "pi", None, FP) == lineindex.Found(FP + ".b")


async def test_an_opening_entry_written_before_the_list_names_its_one_conversation(store):
    await store.set(lineindex.opening_key("pi", FP), FP + ".old")
    await lineindex.remember_opening(store, "pi", FP, FP + ".new")
    assert await store.get(lineindex.opening_key("pi", FP)) == f"{FP}.new {FP}.old"


async def test_the_openings_list_is_bounded_and_a_conversation_is_listed_once(store):
    for i in range(lineindex.OPENINGS_KEPT + 5):
        await lineindex.remember_opening(store, "pi", FP, f"{FP}.{i:02d}")
    await lineindex.remember_opening(store, "pi", FP, f"{FP}.{7:02d}")       # the same one again
    listed = (await store.get(lineindex.opening_key("pi", FP))).split()
    assert len(listed) == lineindex.OPENINGS_KEPT and listed[0] == f"{FP}.07" and len(set(listed)) == len(listed)


async def test_two_openings_at_once_on_one_store_both_stay_listed():
    """Two proxies on one store remember an opening at the same moment: compare-and-set keeps
    both (a plain write kept the newest only, and the other one could be taken for it)."""
    import asyncio
    s = open_store("memory:")
    try:
        await asyncio.gather(*(lineindex.remember_opening(s, "pi", FP, f"{FP}.{i}") for i in range(4)))
        assert sorted((await s.get(lineindex.opening_key("pi", FP))).split()) == [f"{FP}.{i}" for i in range(4)]
    finally:
        await s.close()


async def test_a_parent_whose_pin_was_lost_stops_the_lookup_and_one_never_pinned_does_not(store):
    """The root names P; P's pin is missing. Asked (``missing``): lost → the lookup says so and
    names P (before: P was skipped as if never pinned, and the fork had no parent); never
    pinned → the next candidate, as before."""
    await record(store, "P", ROOT_P)
    await store.delete(pins.key("P"))
    asked = []

    async def lost(session):
        asked.append(session)
        return f"the pin of {session} was lost"

    async def never(session):
        asked.append(session)
        return None

    found = await lineindex.find_parent(store, AGENT, "FORK", ["Q"], [], ROOT_P, SERVERS, never)
    assert found.session == "Q" and asked == []                     # Q pinned, named first: P not asked
    found = await lineindex.find_parent(store, AGENT, "FORK", [], [], ROOT_P, SERVERS, lost)
    assert (found.session, found.lost, found.lost_parent) == (None, "the pin of P was lost", "P") and asked == ["P"]
    found = await lineindex.find_parent(store, AGENT, "FORK", [], [], ROOT_P, SERVERS, never)
    assert (found.session, found.lost) == (None, None)
