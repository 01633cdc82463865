"""The lineage reader: signals, the chain and the streamed answer, from the lineage recordings
(tests/fixtures/traffic/*/*lineage*, websocket-*) and by hand."""

from __future__ import annotations

import copy
import gzip
import json
import re
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts
from sessionpin.lineage import lineage
from sessionpin.lineage import lineage_wire as lw
from sessionpin.lineage.lineage_stream import MAX_EVENT, StreamReader

FIXTURES = Path(__file__).parent / "fixtures" / "traffic"
SCENARIOS = [("claude-code", "lineage"), ("opencode", "lineage"), ("opencode", "lineage-gpt"),
             ("codex", "exec-lineage"), ("pi", "lineage-chat"), ("pi", "lineage-messages"),
             ("pi", "lineage-responses")]
_FILE = re.compile(r"^(?P<scenario>.+)-(?P<nn>\d\d)-(?P<kind>[a-z-]+)\.json$")


def load(agent: str, scenario: str) -> list[dict]:
    out = []
    for path in sorted((FIXTURES / agent).glob(f"{scenario}-*.json")):
        m = _FILE.match(path.name)
        if m and m["scenario"] == scenario:
            out.append(json.loads(path.read_text()))
    assert out, f"no recordings {agent}/{scenario}"
    return out


def body_of(fx: dict) -> bytes:
    return json.dumps(fx["body"], separators=(",", ":"), ensure_ascii=False).encode()


def api_of(fx: dict) -> str:
    return facts.api_of(fx["method"], fx["url"])


def answer_of(fx: dict, step: int = 4096):
    reader = StreamReader(api_of(fx))
    raw = fx["response"]["body"].encode()
    for i in range(0, len(raw), step):
        assert reader(raw[i:i + step]) == raw[i:i + step]
    reader(b"")
    return reader.result()


def replay(fixtures: list[dict]):
    """Each inference request with its chain, and the index a router would have built from the
    earlier ones: every key an answer made (its request's head + the answer) -> conversation."""
    index: dict[str, str] = {}
    for fx in fixtures:
        if not isinstance(fx["body"], dict):
            continue
        chain = lineage.chain(body_of(fx), api_of(fx))
        yield fx, chain, dict(index)
        answer = answer_of(fx)
        assert answer.complete and not answer.overflow, fx["expect"]
        index[lineage.extend(chain.head, answer.digest)] = fx["expect"]["lineage"]["conversation"]


# ---------------------------------------------------------------- recordings


@pytest.mark.parametrize("agent,scenario", SCENARIOS)
def test_every_request_extends_its_own_conversation_and_a_fork_its_parent(agent, scenario):
    forks = continued = 0
    for fx, chain, index in replay(load(agent, scenario)):
        lin = fx["expect"]["lineage"]
        assert chain.parsed and not chain.partial and chain.head
        if fx["expect"]["turn"] == "opening" or fx["expect"]["kind"] == "title":
            assert chain.turns == 0
            continue
        # Every model run of the history is one the proxy saw answered (all were recorded)...
        owners = [index.get(key) for key in chain.keys]
        assert None not in owners, (fx["expect"]["kind"], owners)
        # ...by this conversation, or, up to the fork, by the one it was forked from.
        parent = lin.get("fork_of")
        if parent:
            assert set(owners) == {parent}, owners
            forks += 1
        else:
            own = lin["conversation"]  # (a fork's later turns still carry the parent's part: A)
            assert owners[-1] == own and set(owners) <= {own, "A"}, owners
            continued += 1
    assert forks == 1 and continued >= 2


@pytest.mark.parametrize("agent,scenario", SCENARIOS)
def test_the_root_key_is_the_first_key_and_costs_one_turn(agent, scenario):
    for fx in load(agent, scenario):
        if not isinstance(fx["body"], dict):
            continue
        whole = lineage.chain(body_of(fx), api_of(fx))
        root = lineage.chain(body_of(fx), api_of(fx), turns=1)
        assert root.keys == whole.keys[:1]
        if whole.turns == 0:  # an opening: read to its end, the head is known
            assert root == whole and root.head
        elif root.head is not None:  # it did not stop early only when there was nothing more
            assert root == whole


@pytest.mark.parametrize("scenario", ["lineage-chat", "lineage-messages", "lineage-responses"])
def test_pi_conversations_opened_alike_part_at_their_first_answer(scenario):
    fixtures = {(fx["expect"]["lineage"]["conversation"], fx["expect"]["kind"]): fx for fx in load("pi", scenario)}
    a_open, b_open = fixtures[("A", "opening")], fixtures[("B", "opening")]
    # The same opening: same fingerprint (on chat and messages, where pi sends no id), same head.
    assert lineage.chain(body_of(a_open), api_of(a_open)).head == lineage.chain(body_of(b_open), api_of(b_open)).head
    a = lineage.chain(body_of(fixtures[("A", "resume")]), api_of(a_open), turns=1)
    b = lineage.chain(body_of(fixtures[("B", "resume")]), api_of(a_open), turns=1)
    fork = lineage.chain(body_of(fixtures[("A-fork", "fork")]), api_of(a_open), turns=1)
    assert a.keys and b.keys and a.keys != b.keys
    assert fork.keys == a.keys


def test_claude_code_resume_and_fork_name_the_previous_response():
    fixtures = load("claude-code", "lineage")
    seen = {}
    for fx in fixtures:
        sig = lineage.signals(fx["headers"], body_of(fx))
        if fx["expect"]["kind"] == "opening":
            assert sig.anchors == () and sig.sessions == ()
        else:
            prev = seen["last"]
            assert sig.anchors == (f"req:{prev['request_id']}", f"msg:{prev['message_id']}"), fx["expect"]
        headers = {k.lower(): v for k, v in fx["response"]["headers"]}
        seen["last"] = {"request_id": headers["request-id"], "message_id": answer_of(fx).id}
        seen[fx["expect"]["lineage"]["conversation"]] = seen["last"]
    # the fork's first request named the parent's last response: the router indexed it under A
    fork = next(fx for fx in fixtures if fx["expect"]["kind"] == "fork")
    assert lineage.signals(fork["headers"], body_of(fork)).anchors[1] == f"msg:{seen['A']['message_id']}"


def test_without_the_billing_line_the_previous_message_id_remains():
    fx = next(fx for fx in load("claude-code", "lineage") if fx["expect"]["kind"] == "fork")
    body = copy.deepcopy(fx["body"])
    body["system"] = body["system"][1:]
    anchors = lineage.signals(fx["headers"], json.dumps(body).encode()).anchors
    assert [a.split(":")[0] for a in anchors] == ["msg"]


@pytest.mark.parametrize("scenario,kind", [("exec-lineage", "fork"), ("exec-lineage", "websocket-upgrade"),
                                           ("websocket", "websocket-upgrade")])
def test_codex_fork_names_its_parent_thread_even_at_the_websocket_upgrade(scenario, kind):
    fixtures = load("codex", scenario)
    parent = next(fx for fx in load("codex", "exec-lineage") if fx["expect"]["kind"] == "opening")
    parent_session = parent["expect"]["session"] if scenario == "exec-lineage" else None
    forks = [fx for fx in fixtures if fx["expect"]["kind"] == kind and fx["expect"]["lineage"].get("fork_of")]
    assert forks
    for fx in forks:
        sig = lineage.signals(fx["headers"], body_of(fx) if isinstance(fx["body"], dict) else None)
        assert sig.fork and not sig.resume and len(sig.sessions) == 1
        if parent_session:
            assert sig.sessions == (parent_session,)
    for fx in fixtures:  # the conversation's own requests and upgrades name no parent
        if fx["expect"]["lineage"]["conversation"] == "A":
            assert lineage.signals(fx["headers"]).sessions == ()


def test_codex_websocket_messages_read_like_the_stream_and_their_history_is_partial():
    for fx in load("codex", "websocket"):
        reader, answers = None, []
        for m in fx["websocket"]:
            data = json.dumps(m["content"]).encode()
            if m["from_client"]:
                assert m["content"]["type"] == "response.create"
                chain = lineage.chain(data, facts.OPENAI_RESPONSES)
                # the warm-up (generate: false) opens the socket; each later one names its previous response
                assert chain.parsed and chain.partial == (m["content"].get("generate") is not False)
                reader = StreamReader(facts.OPENAI_RESPONSES)
            else:
                reader.message(data)
                if m["content"]["type"] == "response.completed":
                    answers.append(reader.result())
        assert len(answers) == 3 and all(a.complete and a.id.startswith("resp_") for a in answers)
        assert answers[0].tool_ids == () and answers[1].tool_ids  # warm-up, then the tool call


# ---------------------------------------------------------------- large bodies


def _grown(fx: dict, size: int = 600_000) -> bytes:
    body = copy.deepcopy(fx["body"])
    items = body.get("messages") or body.get("input")
    filler = "x\\y \u00e9\"" * (size // 6)
    items.insert(0, {"role": "user", "content": [{"type": "text", "text": "<system-reminder>" + filler}]})
    return json.dumps(body).encode()


@pytest.mark.parametrize("agent,scenario", SCENARIOS)
def test_a_large_body_walked_item_by_item_gives_the_same_keys(agent, scenario):
    for fx in load(agent, scenario):
        if not isinstance(fx["body"], dict):
            continue
        data = _grown(fx)
        assert len(data) > lw.FAST_MIN
        whole = lineage.chain(data, api_of(fx))
        for turns in (1, 2):
            walked = lineage.chain(data, api_of(fx), turns=turns)
            assert walked.keys == whole.keys[:turns]
        assert lineage.chain(data, api_of(fx)).keys == lineage.chain(body_of(fx), api_of(fx)).keys


def test_a_large_body_with_a_look_alike_key_in_its_head_still_walks_the_real_array():
    body = {"metadata": {"note": {"messages": [{"role": "assistant", "content": "decoy"}]}},
            "model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "pad": "p" * 300_000}
    data = json.dumps(body).encode()
    small = json.dumps({k: v for k, v in body.items() if k != "pad"}).encode()
    assert lineage.chain(data, facts.ANTHROPIC_MESSAGES, turns=1).keys == lineage.chain(small, facts.ANTHROPIC_MESSAGES).keys


# ---------------------------------------------------------------- canonical forms


def _conversation() -> dict:
    return copy.deepcopy(next(fx for fx in load("claude-code", "lineage") if fx["expect"]["kind"] == "fork")["body"])


BASE = _conversation()
BASE_KEYS = lineage.chain(json.dumps(BASE).encode(), facts.ANTHROPIC_MESSAGES).keys


def _blocks(body: dict):
    for m in body["messages"]:
        if isinstance(m.get("content"), list):
            for block in m["content"]:
                yield m, block


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_chain_is_stable_under_what_clients_change_between_requests(data):
    body = copy.deepcopy(BASE)
    blocks = list(_blocks(body))
    for _, block in blocks:  # cache markers moved: any block may carry one, or none
        block.pop("cache_control", None)
        if data.draw(st.booleans()):
            block["cache_control"] = data.draw(st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}]))
    line = body["system"][0]["text"]  # the billing line changes per request
    body["system"][0]["text"] = re.sub(r"cch=\w+; cc_prev_req=\w+", data.draw(st.sampled_from(
        ["cch=00000; cc_prev_req=req_other", "cch=fffff"])), line)
    date = data.draw(st.dates()).isoformat()  # the system prompt and system entries carry dates
    for block in body["system"][1:]:
        block["text"] = re.sub(r"\d{4}-\d{2}-\d{2}", date, block["text"]) + f"\nToday's date is {date}."
    for m in body["messages"]:
        if m["role"] == "system":
            m["content"] = f"Today's date is {date}."
    for m in body["messages"]:  # a user text as a string or as one text block
        c = m["content"]
        if m["role"] == "user" and isinstance(c, list) and len(c) == 1 and c[0].get("type") == "text":
            if data.draw(st.booleans()):
                m["content"] = c[0]["text"]
        elif m["role"] == "user" and isinstance(c, str) and data.draw(st.booleans()):
            m["content"] = [{"type": "text", "text": c}]
    if data.draw(st.booleans()):  # a reminder injected into a user message
        user = next(m for m in body["messages"] if m["role"] == "user" and isinstance(m["content"], list))
        user["content"].insert(0, {"type": "text", "text": f"<system-reminder>\nIt is {date}.\n</system-reminder>"})
    indent = data.draw(st.sampled_from([None, 1]))
    assert lineage.chain(json.dumps(body, indent=indent).encode(), facts.ANTHROPIC_MESSAGES).keys == BASE_KEYS


@pytest.mark.parametrize("change", ["user text", "tool id", "answer text", "signature", "order"])
def test_what_identifies_a_message_changes_the_chain(change):
    body = copy.deepcopy(BASE)
    msgs = body["messages"]
    if change == "user text":
        next(m for m in msgs if m["role"] == "user" and isinstance(m["content"], str))["content"] += "!"
    elif change == "tool id":
        block = next(b for _, b in _blocks(body) if b.get("type") == "tool_use")
        block["id"] += "x"
    elif change == "answer text":
        next(b for _, b in _blocks(body) if b.get("type") == "text" and "Done" in b["text"])["text"] += "!"
    elif change == "signature":
        next(b for _, b in _blocks(body) if b.get("type") == "thinking")["signature"] += "x"
    else:
        i = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        j = next(j for j in range(i + 1, len(msgs)) if msgs[j]["role"] == "assistant")
        msgs[i], msgs[j] = msgs[j], msgs[i]
    keys = lineage.chain(json.dumps(body).encode(), facts.ANTHROPIC_MESSAGES).keys
    assert keys != BASE_KEYS and len(keys) == len(BASE_KEYS)


# ---------------------------------------------------------------- the stream


def _claude_fork():
    return next(fx for fx in load("claude-code", "lineage") if fx["expect"]["kind"] == "fork")


@pytest.mark.parametrize("agent,scenario", SCENARIOS)
def test_chunk_boundaries_do_not_change_the_answer(agent, scenario):
    for fx in load(agent, scenario):
        if isinstance(fx["body"], dict):
            one = answer_of(fx, step=1 << 30)
            assert answer_of(fx, step=1) == one == answer_of(fx, step=13)
            crlf = StreamReader(api_of(fx))
            crlf(fx["response"]["body"].replace("\n", "\r\n").encode())
            crlf(b"")
            assert crlf.result() == one


def test_an_empty_chunk_mid_stream_is_no_end():
    """mitmproxy hands an empty HTTP/2 DATA frame to the stream callable as b"", as it does the
    stream's end: taken for the end, the rest of the answer went unread (incomplete, its root
    never recorded). Anywhere in the stream, the answer reads as without it."""
    fx = _claude_fork()
    whole = answer_of(fx)
    raw = fx["response"]["body"].encode()
    assert whole.complete
    for cut in (1, len(raw) // 3, len(raw) // 2, len(raw) - 1):
        reader = StreamReader(api_of(fx))
        reader(raw[:cut]), reader(b""), reader(raw[cut:])
        assert reader.result() == whole, cut


def test_a_compressed_stream_reads_like_the_plain_one():
    fx = _claude_fork()
    plain = answer_of(fx)
    packed = gzip.compress(fx["response"]["body"].encode())
    reader = StreamReader(api_of(fx), content_encoding="gzip")
    for i in range(0, len(packed), 50):
        assert reader(packed[i:i + 50]) == packed[i:i + 50]
    reader(b"")
    assert reader.result() == plain


def test_an_event_too_large_is_dropped_not_kept():
    fx = _claude_fork()
    raw = fx["response"]["body"].encode()
    huge = b"event: ping\ndata: {\"type\":\"ping\",\"pad\":\"" + b"z" * (MAX_EVENT + 10) + b"\"}\n\n"
    reader = StreamReader(api_of(fx))
    for i in range(0, len(huge), 65536):
        reader(huge[i:i + 65536])
        assert len(reader._pending) <= MAX_EVENT
    reader(raw)
    reader(b"")
    result = reader.result()
    assert result.overflow and result.digest == answer_of(fx).digest and result.complete


def test_an_unfinished_stream_is_not_complete():
    fx = _claude_fork()
    raw = fx["response"]["body"]
    reader = StreamReader(api_of(fx))
    reader(raw[: raw.index("event: message_stop")].encode())
    reader(b"")
    assert not reader.result().complete


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(facts.INFERENCE_APIS) + ["other"]), st.lists(st.binary(max_size=300), max_size=8),
       st.sampled_from(["", "gzip", "br", "zstd", "bogus", "gzip, br"]))
def test_the_stream_reader_never_raises_and_never_changes_a_chunk(api, chunks, coding):
    reader = StreamReader(api, content_encoding=coding)
    for chunk in chunks + [b""]:
        assert reader(chunk) is chunk
    reader.message(b"".join(chunks))
    assert isinstance(reader.result().digest, str)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["role", "type", "content", "text", "id", "tool_calls", "call_id", "messages",
                                         "input", "system", "diagnostics", "previous_message_id", "signature",
                                         "tool_use_id", "encrypted_content", "previous_response_id"]),
                        inner, max_size=5), max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(facts.INFERENCE_APIS) + ["other"]), JSON, st.booleans(), st.integers(0, 3))
def test_chain_and_signals_never_raise(api, value, pad, turns):
    data = json.dumps(value).encode()
    if pad and isinstance(value, dict):
        data = json.dumps(dict(value, pad="p" * lw.FAST_MIN)).encode()
    c = lineage.chain(data, api, turns=turns or None)
    assert isinstance(c.keys, tuple)
    s = lineage.signals([("x-codex-turn-metadata", json.dumps(value))], data)
    assert isinstance(s.anchors, tuple)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["", "gzip", "zstd", "nope"]))
def test_chain_never_raises_on_bytes(data, coding):
    assert isinstance(lineage.chain(data, facts.ANTHROPIC_MESSAGES, content_encoding=coding).parsed, bool)
    assert isinstance(lineage.signals({"x-codex-turn-metadata": data}, data).sessions, tuple)


def test_extend_refuses_what_is_not_hex():
    assert lineage.extend("zz", "00") is None and lineage.extend(None, "00") is None


@pytest.mark.parametrize("agent,scenario,kind", [("claude-code", "lineage", "fork"), ("codex", "exec-lineage", "fork")])
def test_a_large_body_gives_the_same_signals_from_its_head_and_tail(agent, scenario, kind):
    fx = next(fx for fx in load(agent, scenario) if fx["expect"]["kind"] == kind)
    data = _grown(fx)
    small = lineage.signals(fx["headers"], body_of(fx))
    assert lineage.signals(fx["headers"], data) == small == lineage.signals(fx["headers"], data, api=api_of(fx))
    # a look-alike of a link inside the history is not taken for it
    body = json.loads(data)
    items = body.get("messages") or body.get("input")
    items.insert(1, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "x": {"diagnostics": {"previous_message_id": "msg_decoy"}}}]})
    if "diagnostics" in body:
        body["diagnostics"] = {"previous_message_id": None}
    decoy = lineage.signals(fx["headers"], json.dumps(body).encode())
    assert all("decoy" not in a for a in decoy.anchors)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=" \t\n\u00a0ab\u00e9\u2028", max_size=8), max_size=8))
def test_the_text_digest_fed_in_pieces_is_the_digest_of_the_stripped_whole(pieces):
    d = lineage.TextDigest()
    for piece in pieces:
        d.feed(piece)
    assert d.digest() == lineage.text_digest("".join(pieces)) == lineage._blake("".join(pieces).strip().encode())


# ---------------------------------------------------------------- the root read's budget (issue 20)


def _pathological(first: list[bytes]) -> bytes:
    """A history whose first answer comes after ``first`` (encoded items)."""
    return (b'{"model":"m","max_tokens":5,"messages":[' + b",".join(first) +
            b',{"role":"assistant","content":"ok"},{"role":"user","content":"more"}]}')


def _steps(fn) -> int:
    from sessionpin.reader import wire
    wire.STEPS.n = 0
    fn()
    return wire.STEPS.n


@pytest.mark.parametrize("shape", ["a million tiny messages", "one huge message", "an unwalkable head"])
def test_the_root_read_of_a_pathological_history_stops_at_its_budget(shape):
    """Before the first answer: 200,000 tiny messages (over the item budget), or one message larger
    than the byte budget, or a body that cannot be walked item by item and is larger than the
    budget. The root read gives up (no keys) after reading at most about its budget, never the
    whole body; the whole chain is still read whole when asked for."""
    budget = lineage.TURNS_BUDGET
    if shape == "a million tiny messages":
        body = _pathological([b'{"role":"user","content":"x"}'] * 200_000)
    elif shape == "one huge message":
        body = _pathological([json.dumps({"role": "user", "content": "y" * (budget.size + 1024)}).encode()])
    else:
        body = b'{' + b"".join(b'"k%d":0,' % i for i in range(100)) + _pathological(
            [json.dumps({"role": "user", "content": "z" * (budget.size + 1024)}).encode()])[1:]
    n = _steps(lambda: lineage.chain(body, facts.ANTHROPIC_MESSAGES, turns=1))
    root = lineage.chain(body, facts.ANTHROPIC_MESSAGES, turns=1)
    assert (root.keys, root.parsed, root.reason) == ((), False, lineage.OVER_BUDGET)
    assert n <= 3 * budget.size, f"{n} bytes scanned for a {len(body)} byte body"
    assert lineage.chain(body, facts.ANTHROPIC_MESSAGES).turns == 1        # the whole read is not bounded


def test_a_history_within_the_budget_has_the_root_it_had():
    first = [b'{"role":"user","content":"x"}'] * 5_000 + [json.dumps({"role": "user", "content": "y" * 300_000}).encode()]
    body = _pathological(first)
    assert len(body) > lw.FAST_MIN
    walked = lineage.chain(body, facts.ANTHROPIC_MESSAGES, turns=1)
    assert walked.keys and walked.keys[0] == lineage.chain(body, facts.ANTHROPIC_MESSAGES).keys[0]


def test_a_chain_from_the_raw_members_is_the_chain_of_the_body():
    """``members`` (the facts reader's decode of the body's top level, issue 22): every recorded
    request's chain, whole and its first turn, as from the body; a history of the wrong type
    read leniently the same way."""
    from sessionpin.reader import wire
    n = 0
    for path in sorted((Path(__file__).parent / "fixtures" / "traffic").glob("*/*.json")):
        fx = json.loads(path.read_text())
        if not isinstance(fx.get("body"), dict):
            continue
        api = facts.api_of(fx["method"], fx["url"])
        data = json.dumps(fx["body"], separators=(",", ":")).encode()
        members = wire.loose_decoder.decode(data)
        for turns in (1, None):
            assert lineage.chain(data, api, turns, members=members) == lineage.chain(data, api, turns), path.name
        n += 1
    assert n > 50
    odd = b'{"model":"m","messages":[{"role":"user","content":"hi"},7,{"role":"assistant","content":"ok"}]}'
    got = lineage.chain(odd, facts.ANTHROPIC_MESSAGES, members=wire.loose_decoder.decode(odd))
    assert got == lineage.chain(odd, facts.ANTHROPIC_MESSAGES) and got.keys


def test_a_history_padded_with_spaces_between_its_items_has_the_same_chain():
    """A large body's items are walked past their spaces by a regular expression (in C; a Python
    step per byte was 0.6 s for 8 MiB of them)."""
    pad = b" \n" * (150 * 1024)
    items = [b'{"role":"user","content":"hi"}', b'{"role":"assistant","content":"ok"}', b'{"role":"user","content":"go"}']
    plain = b'{"model":"m","messages":[' + b",".join(items) + b"]}"
    padded = b'{"model":"m","messages":[' + pad + (b"," + pad).join(items) + pad + b"]}"
    assert len(padded) >= lw.FAST_MIN
    for turns in (1, None):
        assert lineage.chain(padded, facts.ANTHROPIC_MESSAGES, turns).keys == lineage.chain(plain, facts.ANTHROPIC_MESSAGES, turns).keys


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=40) | st.sampled_from(["", " ", "\n\t", "é" * 70_000, "x" * 70_000 + " ",
                                                         "a" * 65_536, " " + "b" * 140_000 + "\n", "\ud800" * 3]),
                max_size=5), st.sampled_from([b"u", b"r"]))
def test_texts_hashed_in_pieces_give_the_digests_of_the_whole(texts, tag):
    """Issue 22: a long text is hashed in pieces (no copy of the whole); the digests (kept in
    stores for 30 days) are those of the whole text, as before."""
    import hashlib
    want = hashlib.blake2b(digest_size=16)
    got = hashlib.blake2b(digest_size=16)
    for t in texts:
        data = t.encode("utf-8", "surrogatepass")
        want.update(tag + len(data).to_bytes(4, "big") + data)
        lineage._update_tagged(got, tag, t)
    assert got.digest() == want.digest()
    old = hashlib.blake2b(digest_size=16)          # TextDigest as it was: held + body in one update
    started, held = False, ""
    for t in texts:
        if not t:
            continue
        if not started:
            t = t.lstrip()
            if not t:
                continue
            started = True
        body = t.rstrip()
        if body:
            old.update((held + body).encode("utf-8", "surrogatepass"))
            held = t[len(body):]
        else:
            held += t
        if len(held) > lineage.TextDigest.HOLD:
            old.update(held.encode("utf-8", "surrogatepass"))
            held = ""
    d = lineage.TextDigest()
    for t in texts:
        d.feed(t)
    assert d.digest() == old.digest()


def _history_body(items: list[dict], pad: int = 0, sep: str = ",") -> bytes:
    big = {"role": "user", "content": "p" * pad} if pad else None
    msgs = ([big] if big else []) + items
    return (b'{"model":"m","messages":[' + sep.join(json.dumps(m) for m in msgs).encode() + b'],"stream":true}')


_ITEMS = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant"]),
    "content": st.one_of(st.text(max_size=30), st.just([{"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}}]),
                         st.just([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]))}),
    min_size=1, max_size=6)


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_ITEMS, _ITEMS, st.sampled_from(["append", "edit", "role", "space", "none", "head"]), st.integers(0, 10), st.sampled_from([",", ", "]),
       st.sampled_from([0, lw.FAST_MIN]))
def test_a_root_proven_by_its_first_bytes_is_the_chains_root(first, more, change, at, sep, pad):
    """``root_of`` with the previous request's proof (``FirstRun``) gives exactly the root
    ``chain`` reads, whatever the next request changed: appended items, an item edited or given
    another role, spaces added, a member before the history changed — the proof is taken only
    when the history's first bytes through the item that ended the first model run are the
    same (the body's own first bytes then, or the history's found anew). A small history (read at once by
    ``chain``) is proven the same as a walked one, and ``proven_root`` (the check alone, for the
    event loop) proves nothing ``root_of`` would not."""
    api = facts.ANTHROPIC_MESSAGES
    body = _history_body(first, pad=pad, sep=sep)
    root, proof = lineage.root_of(body, api)
    assert root == (lineage.chain(body, api, turns=1).keys or (None,))[0]
    items = list(first)
    if change == "append":
        items += more
    elif change == "edit" and items:
        k = at % len(items)
        items[k] = {**items[k], "content": "edited"}
    elif change == "role" and items:
        k = at % len(items)
        items[k] = {**items[k], "role": "assistant" if items[k]["role"] == "user" else "user"}
    nxt = _history_body(items, pad=pad, sep=sep)
    if change == "space":
        nxt = nxt.replace(b"},{", b"}, {", 1 + at % 3)
    if change == "head":
        nxt = nxt.replace(b'{"model":"m",', b'{"model":"' + b"n" * (1 + at) + b'",', 1)
    got, again = lineage.root_of(nxt, api, known=proof)
    assert got == (lineage.chain(nxt, api, turns=1).keys or (None,))[0]
    if proof is not None:
        quick = lineage.proven_root(nxt, api, proof)
        assert quick is None or quick == got
        assert (quick is not None) == (again is proof)
    if proof is not None and nxt.startswith(body[:len(body) - 16]) and change in ("append", "none"):
        assert again is proof                    # taken: nothing read again
    if proof is not None and change == "head":
        assert again is proof                    # the history's own bytes: the same


def test_a_proof_is_made_only_for_a_history_whose_first_run_ended():
    api = facts.ANTHROPIC_MESSAGES
    user, model = {"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}
    assert lineage.root_of(_history_body([model, user], pad=lw.FAST_MIN), api)[1] is not None
    assert lineage.root_of(_history_body([model, user]), api)[1] is not None   # a small one too
    assert lineage.root_of(_history_body([model]), api)[1] is None
    root, proof = lineage.root_of(_history_body([model], pad=lw.FAST_MIN), api)
    assert root is not None and proof is None                               # its first run has not ended
    assert lineage.root_of(_history_body([user], pad=lw.FAST_MIN), api) == (None, None)


def test_a_small_history_whose_first_run_is_past_the_walks_budget_still_has_its_root():
    """A small history is walked for its proof; one whose first model run ends past the walk's
    budget of items is read at once, as before, and has its root (unproven), not none."""
    api = facts.ANTHROPIC_MESSAGES
    body = _history_body([{"role": "user"}] * (lineage.TURNS_BUDGET.items + 1)
                         + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}])
    assert len(body) < lw.FAST_MIN
    expected = lineage.chain(body, api, turns=1).keys[0]
    assert lineage.root_of(body, api) == (expected, None)


@pytest.mark.parametrize("agent,scenario", SCENARIOS)
def test_a_small_bodys_root_walked_for_its_proof_is_the_request_paths_root(agent, scenario):
    """The lineage watch's root of a small request (walked for its proof, twelfth round) is the
    root the request path reads at once (``chain(turns=1)``) — of every recorded request, from
    its bytes or from the facts reader's members — or a fork's parent could not be found by it."""
    for fx in load(agent, scenario):
        if not isinstance(fx["body"], dict):
            continue
        data, api = body_of(fx), api_of(fx)
        assert len(data) < lw.FAST_MIN
        expected = (lineage.chain(data, api, turns=1).keys or (None,))[0]
        assert lineage.root_of(data, api)[0] == expected
        members = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
        assert lineage.root_of(data, api, members=members)[0] == expected


_JUNK = st.one_of(st.integers(), st.none(), st.text(max_size=5), st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(lineage._FLAVOUR)), JSON,
       st.lists(st.one_of(_ITEMS.map(lambda items: items[0]), _JUNK), min_size=1, max_size=8))
def test_root_of_any_small_body_is_the_chains_root(api, value, history):
    """Whatever a small body holds — any JSON, or a history with items that are not objects
    among its messages — ``root_of`` (walked for its proof) and ``chain(turns=1)`` (read at
    once, as the request path reads it) name the same root, or both none; a proof proves it."""
    key = "input" if api == facts.OPENAI_RESPONSES else "messages"
    for data in (json.dumps(value).encode(), json.dumps({"model": "m", key: history}).encode()):
        root, proof = lineage.root_of(data, api)
        assert root == (lineage.chain(data, api, turns=1).keys or (None,))[0]
        assert proof is None or lineage.proven_root(data, api, proof) == root


def test_a_small_history_the_walk_reads_otherwise_is_not_proven():
    """An item that is not an object ends a walk where the whole read skips it: the root is
    the whole read's (the request path's), and no proof is made from a walk that disagrees."""
    api = facts.ANTHROPIC_MESSAGES
    body = _history_body([{"role": "assistant", "content": "b"}]).replace(b"]", b', 3, {"role": "assistant", "content": "b2"}, '
                                                                             b'{"role": "user", "content": "c"}]', 1)
    body = body.replace(b'"messages":[', b'"messages":[{"role": "user", "content": "a"}, ', 1)
    expected = lineage.chain(body, api, turns=1).keys[0]
    assert lineage.root_of(body, api) == (expected, None)


# ---------------------------------------------------------------- a hostile server's answers

BOMB_DECODED = 80 * 1024 * 1024       # past MAX_DECODED: the old bound alone would make 64 MiB of it


def _bomb(coding: str, payload: bytes = b"\0" * BOMB_DECODED) -> bytes:
    import zlib

    if coding == "br":
        import brotli
        return brotli.compress(payload, quality=5)
    if coding == "zstd":
        from backports import zstd
        return zstd.compress(payload)
    c = zlib.compressobj(9, zlib.DEFLATED, 31 if coding == "gzip" else zlib.MAX_WBITS)
    return c.compress(payload) + c.flush()


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_a_decompression_bomb_makes_no_more_than_its_room(coding):
    """A few hundred bytes that inflate to 80 MiB: the decompressor is asked for at most one
    byte past 1 MiB + 128 times the compressed bytes fed (brotli's ``process`` made it all in
    one call before: 512 MiB from 809 bytes), and the answer says ``overflow``."""
    bomb = _bomb(coding)
    reader = StreamReader(facts.ANTHROPIC_MESSAGES, content_encoding=coding)
    for i in range(0, len(bomb), 4096):
        assert reader(bomb[i:i + 4096]) == bomb[i:i + 4096]
        assert reader._inflate.total <= (1 << 20) + 128 * (i + 4096)
    reader(b"")
    assert reader.result().overflow


def _python_calls(fn) -> int:
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("payload", [b"\n" * (1 << 20), b"data:\n" * (1 << 17), b": comment\n\n" * (1 << 16),
                                     b"event: ping\n\n" * (1 << 16)])
def test_lines_and_events_without_data_cost_no_python_step_each(payload):
    """Blank lines, comments and events without data are cut by C scans: a megabyte of them is a
    few Python calls, not one per line (463 ms per MiB of newlines before, all on the event loop)."""
    reader = StreamReader(facts.ANTHROPIC_MESSAGES)
    assert _python_calls(lambda: reader(payload)) < 50


def test_a_compressed_flood_of_tiny_events_is_read_only_within_its_budget():
    """``data:{}`` events gzip ~500:1: 8 MiB of them is 16 KB on the wire. At most 4,096 events
    and one per two compressed bytes are read; then the answer is not read further."""
    bomb = _bomb("gzip", b"data:{}\n\n" * ((8 << 20) // 9))
    reader = StreamReader(facts.ANTHROPIC_MESSAGES, content_encoding="gzip")
    calls = 0
    event = reader._event

    def counted(data):
        nonlocal calls
        calls += 1
        event(data)
    reader._event = counted
    for i in range(0, len(bomb), 4096):
        reader(bomb[i:i + 4096])
    reader(b"")
    assert calls <= 4096 + len(bomb) // 2
    assert reader.result().overflow


def test_a_long_compressed_answer_is_read_whole():
    """A real answer compressed whole (its events' boilerplate repeated) is far under the bounds:
    the same answer as plain."""
    import random
    import string

    fx = _claude_fork()
    body = fx["response"]["body"].encode()
    head, rest = body.split(b"event: content_block_delta", 1)
    rnd = random.Random(7)
    deltas = b"".join(b"event: content_block_delta\ndata: " + json.dumps(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " " + "".join(
            rnd.choice(string.ascii_lowercase) for _ in range(rnd.randint(1, 7)))}}).encode() + b"\n\n"
        for _ in range(20_000))
    long_body = head + deltas + b"event: content_block_delta" + rest
    plain = StreamReader(api_of(fx))
    plain(long_body)
    plain(b"")
    packed = _bomb("gzip", long_body)
    reader = StreamReader(api_of(fx), content_encoding="gzip")
    for i in range(0, len(packed), 1024):
        reader(packed[i:i + 1024])
    reader(b"")
    assert not reader.result().overflow and reader.result() == plain.result() and plain.result().complete


@pytest.mark.parametrize("end,complete", [("response.incomplete", True), ("response.failed", False)])
def test_a_responses_answer_stopped_at_its_token_limit_is_whole(end, complete):
    """``response.incomplete`` (max_output_tokens reached) ends an answer the client keeps, as chat's
    finish_reason "length" and Anthropic's message_stop after max_tokens do; ``response.failed``
    ends none."""
    fx = next(fx for fx in load("pi", "lineage-responses") if fx["expect"]["turn"] == "opening")
    raw = fx["response"]["body"]
    assert raw.count('"type":"response.completed"') == 1
    cut = raw.replace('"type":"response.completed"', f'"type":"{end}"') \
             .replace("event: response.completed", f"event: {end}")
    reader = StreamReader(api_of(fx))
    reader(cut.encode())
    reader(b"")
    got = reader.result()
    assert got.complete is complete
    if complete:
        assert got.digest == answer_of(fx).digest


_LARGE = "JVBERi0x" + "A" * (lineage.TURNS_BUDGET.size + 1024 * 1024)     # a PDF read as base64: over the budget


def _after_first_answer(api: str, big: dict, before: list[dict] | None = None) -> tuple[bytes, bytes]:
    """(a history whose first answer is followed by ``big``, the same first exchange followed by a
    small item of the same kind): their first exchange is the same few hundred bytes."""
    if api == facts.OPENAI_RESPONSES:
        first = [{"role": "user", "content": [{"type": "input_text", "text": "read the pdf"}]},
                 {"type": "reasoning", "encrypted_content": "gAAA-enc", "summary": []},
                 {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": "{}"}]
        small = {"type": "function_call_output", "call_id": "call_1", "output": "x"}
        key = "input"
    else:
        first = [{"role": "user", "content": "read the pdf"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "sig-1"},
                                                   {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]}]
        small = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}
        key = "messages"
    tail = [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]

    def body(item: dict) -> bytes:
        return json.dumps({"model": "m", key: (before or []) + first + [item] + tail}).encode()
    return body(big), body(small)


@pytest.mark.parametrize("api", [facts.ANTHROPIC_MESSAGES, facts.OPENAI_RESPONSES])
def test_a_first_answer_followed_by_an_item_over_the_budget_has_its_root(api):
    """Claude Code: the first answer is a tool call and the tool result right after it holds a
    9 MB PDF, as every later request of the conversation and of its forks carries it (Responses:
    a function_call_output). The first exchange is a few hundred bytes: the root is read, the
    same as with a small item there, and the large item is read for its kind only (a bounded
    prefix), not past the budget. Before, the walk met the budget inside that item: no root."""
    if api == facts.OPENAI_RESPONSES:
        big = {"type": "function_call_output", "call_id": "call_1", "output": _LARGE}
    else:
        big = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": _LARGE}}]}]}
    large, small = _after_first_answer(api, big)
    want = lineage.chain(small, api, turns=1).keys
    assert want and want[0] == lineage.chain(large, api).keys[0]          # the whole read's root
    n = _steps(lambda: lineage.chain(large, api, turns=1))
    got = lineage.chain(large, api, turns=1)
    assert got.parsed and got.keys == want and got.head is None
    assert n <= 3 * lineage.TURNS_BUDGET.size, f"{n} bytes scanned for a {len(large)} byte body"
    assert lineage.root_of(large, api) == (want[0], None)               # read again next time, within the budget


@pytest.mark.parametrize("shape", ["role after the large member", "a model item", "no role nor type",
                                   "first answer over the budget", "a second turn asked for"])
def test_an_item_over_the_budget_read_for_its_kind_alone_ends_only_a_model_run(shape):
    """What the bounded prefix of an item past the budget cannot tell gives no root, as before:
    its role written after its large member, an item that continues the model run, an item with
    neither role nor type, a first answer itself over the budget, or turns past the first."""
    api = facts.ANTHROPIC_MESSAGES
    turns = 1
    if shape == "role after the large member":
        big = {"content": _LARGE, "role": "user"}
    elif shape == "a model item":
        big = {"role": "assistant", "content": _LARGE}
    elif shape == "no role nor type":
        big = {"content": _LARGE}
    elif shape == "first answer over the budget":
        big = {"role": "assistant", "content": [{"type": "text", "text": _LARGE}]}
    else:
        big, turns = {"role": "user", "content": _LARGE}, 2
    large, _ = _after_first_answer(api, big)
    if shape == "first answer over the budget":
        large = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, big,
                                                       {"role": "user", "content": "go"}]}).encode()
    n = _steps(lambda: lineage.chain(large, api, turns=turns))
    got = lineage.chain(large, api, turns=turns)
    assert (got.keys, got.parsed, got.reason) == ((), False, lineage.OVER_BUDGET)
    assert n <= 3 * lineage.TURNS_BUDGET.size


def test_an_items_kind_is_read_from_a_bounded_prefix():
    big = json.dumps({"role": "user", "content": "x" * 200_000}).encode()
    assert lw.kind_of_prefix(big, 0) == lw.KindOnly(role="user")
    typed = json.dumps({"type": "function_call_output", "call_id": "c", "output": "x" * 200_000}).encode()
    assert lw.kind_of_prefix(typed, 0) == lw.KindOnly(type="function_call_output")
    late = b'{"pad":"' + b"p" * lw.KIND_PREFIX + b'","role":"user"}'
    assert lw.kind_of_prefix(late, 0) is None                     # past the prefix: not read
    assert lw.kind_of_prefix(b'{"role":7,"content":"' + b"y" * 100 + b'"}', 0) is None
    assert lw.kind_of_prefix(b'[1,2]', 0) is None
