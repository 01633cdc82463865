"""The usage reader: the tokens an answer cost, read as it streams, equal to what the server said."""

import gzip
import json
import random
from pathlib import Path

import pytest

from sessionpin.reader import facts as F
from sessionpin.accounting.usage import Diagnostic, Usage, UsageReader

FLOWS = Path(__file__).parent / "fixtures" / "traffic" / "flows"


def sse(*events: dict, named: bool = True) -> bytes:
    out = b""
    for ev in events:
        if named and "type" in ev:
            out += f"event: {ev['type']}\n".encode()
        out += b"data: " + json.dumps(ev).encode() + b"\n\n"
    return out


def fed(api: str, data: bytes, sizes=(1, 2, 3, 5, 8, 13, 64, 4096), encoding: str = "", seed: int = 0):
    """Feed ``data`` in chunks of random sizes; check every chunk comes back unchanged."""
    r = UsageReader(api, encoding)
    rnd = random.Random(seed)
    i, back = 0, b""
    while i < len(data):
        n = rnd.choice(sizes)
        chunk = data[i:i + n]
        back += r(chunk)
        i += n
    assert r(b"") == b""
    assert back == data
    return r.result()


# ---------------------------------------------------------------- Anthropic

def anthropic_stream(start_usage: dict, delta_usage: dict, diagnostics: dict | None = None) -> bytes:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-opus-5-5", "content": [],
               "usage": start_usage}
    if diagnostics is not None:
        message["diagnostics"] = diagnostics
    return sse({"type": "message_start", "message": message},
               {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
               {"type": "ping"},
               {"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": 'a text naming "usage" and {"usage": 1}'}},
               {"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta_usage},
               {"type": "message_stop"})


def test_anthropic_input_is_the_sum_of_uncached_and_cache_fields_and_the_1h_write_is_apart():
    data = anthropic_stream(
        {"input_tokens": 3, "cache_creation_input_tokens": 500, "cache_read_input_tokens": 90_000,
         "cache_creation": {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 300}, "output_tokens": 1},
        {"output_tokens": 420})
    for seed in range(5):
        read = fed(F.ANTHROPIC_MESSAGES, data, seed=seed)
        assert read.usage == Usage(input=90_503, output=420, cache_read=90_000, cache_write_5m=200,
                                   cache_write_1h=300)
        assert read.model == "claude-opus-5-5" and read.id == "msg_1" and read.diagnostic is None
        assert read.usage.uncached == 3


def test_anthropic_delta_restates_cumulative_fields_it_does_not_add():
    data = anthropic_stream({"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                             "output_tokens": 1},
                            {"input_tokens": 12, "cache_read_input_tokens": 7, "output_tokens": 30})
    read = fed(F.ANTHROPIC_MESSAGES, data)
    assert read.usage == Usage(input=19, output=30, cache_read=7)


def test_anthropic_thinking_tokens_are_the_reasoning_part_of_output():
    data = anthropic_stream({"input_tokens": 4, "output_tokens": 1},
                            {"output_tokens": 2820, "output_tokens_details": {"thinking_tokens": 1240}})
    assert fed(F.ANTHROPIC_MESSAGES, data).usage == Usage(input=4, output=2820, reasoning=1240)


def test_anthropic_write_without_its_split_counts_as_5_minutes():
    data = anthropic_stream({"input_tokens": 1, "cache_creation_input_tokens": 800, "cache_read_input_tokens": 0,
                             "output_tokens": 1}, {"output_tokens": 2})
    assert fed(F.ANTHROPIC_MESSAGES, data).usage == Usage(input=801, output=2, cache_write_5m=800)


def test_anthropic_cache_miss_diagnostic_on_message_start():
    data = anthropic_stream({"input_tokens": 5000, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                             "output_tokens": 1}, {"output_tokens": 2},
                            {"cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 4990}})
    assert fed(F.ANTHROPIC_MESSAGES, data).diagnostic == Diagnostic(reason="tools_changed", missed=4990)
    none = anthropic_stream({"input_tokens": 5, "output_tokens": 1}, {"output_tokens": 2}, {"cache_miss_reason": None})
    assert fed(F.ANTHROPIC_MESSAGES, none).diagnostic is None


def test_crlf_lines_and_data_without_a_space():
    data = anthropic_stream({"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 1},
                            {"output_tokens": 9}).replace(b"\n", b"\r\n").replace(b"data: ", b"data:")
    assert fed(F.ANTHROPIC_MESSAGES, data).usage == Usage(input=10, output=9, cache_read=6)


def test_a_gzip_stream_is_read_and_passed_on_compressed():
    data = anthropic_stream({"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 1},
                            {"output_tokens": 9})
    assert fed(F.ANTHROPIC_MESSAGES, gzip.compress(data), encoding="gzip").usage == \
        Usage(input=10, output=9, cache_read=6)


def test_an_event_over_the_bound_is_dropped_and_said():
    big = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x" * 5000}}
    data = sse(big) + anthropic_stream({"input_tokens": 4, "output_tokens": 1}, {"output_tokens": 9})
    r = UsageReader(F.ANTHROPIC_MESSAGES, max_event=1000)
    for i in range(0, len(data), 100):             # the big event comes in pieces: never held whole
        assert r(data[i:i + 100]) == data[i:i + 100]
    r(b"")
    read = r.result()
    assert read.overflow and read.usage == Usage(input=4, output=9)


def test_an_error_event_or_garbage_reads_as_no_usage_and_never_raises():
    r = UsageReader(F.ANTHROPIC_MESSAGES)
    for chunk in (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n',
                  b'data: {"usage": [1,2\n\n', b"\xff\xfe\n\n", b'data: {"type":"message_delta","usage":"no"}\n\n'):
        assert r(chunk) == chunk
    r(b"")
    assert r.result().usage is None
    assert UsageReader("other")(b"abc") == b"abc"


# ---------------------------------------------------------------- OpenAI chat and Responses

def test_chat_usage_in_the_last_chunk_with_cached_and_reasoning_tokens():
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-6",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}], "usage": None}
    last = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-6", "choices": [],
            "usage": {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
                      "prompt_tokens_details": {"cached_tokens": 1536},
                      "completion_tokens_details": {"reasoning_tokens": 256}}}
    data = sse(chunk, last, named=False) + b"data: [DONE]\n\n"
    read = fed(F.OPENAI_CHAT, data)
    assert read.usage == Usage(input=2000, output=300, cache_read=1536, reasoning=256)
    assert read.model == "gpt-6" and read.id == "chatcmpl-1"


@pytest.mark.parametrize("usage,cached", [({"prompt_tokens": 100, "completion_tokens": 5,
                                            "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36}, 64),
                                           ({"prompt_tokens": 100, "completion_tokens": 5, "cached_tokens": 80}, 80)])
def test_chat_cache_fields_of_deepseek_and_moonshot(usage, cached):
    data = sse({"id": "c", "model": "m", "choices": [], "usage": usage}, named=False)
    assert fed(F.OPENAI_CHAT, data).usage == Usage(input=100, output=5, cache_read=cached)


def responses_completed(usage: dict, diagnostics: dict | None = None, rid: str = "resp_1") -> dict:
    response = {"id": rid, "object": "response", "model": "gpt-6.2", "status": "completed",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": '"usage": 1'}]}],
                "usage": usage}
    if diagnostics is not None:
        response["prompt_cache_diagnostics"] = diagnostics
    return {"type": "response.completed", "sequence_number": 9, "response": response}


R_USAGE = {"input_tokens": 12_000, "input_tokens_details": {"cached_tokens": 11_520}, "output_tokens": 800,
           "output_tokens_details": {"reasoning_tokens": 640}, "total_tokens": 12_800}


def test_responses_usage_and_the_providers_diagnostic():
    created = {"type": "response.created", "response": {"id": "resp_1", "model": "gpt-6.2", "usage": None}}
    data = sse(created, {"type": "response.output_text.delta", "delta": "hi"},
               responses_completed(R_USAGE, {"type": "cache_miss", "reason": "tools_changed",
                                             "cache_missed_tokens": 9000}))
    read = fed(F.OPENAI_RESPONSES, data)
    assert read.usage == Usage(input=12_000, output=800, cache_read=11_520, reasoning=640)
    assert read.diagnostic == Diagnostic(reason="tools_changed", missed=9000) and read.id == "resp_1"


def test_responses_socket_messages_give_one_read_per_answer():
    r = UsageReader(F.OPENAI_RESPONSES)
    got = []
    for i in range(2):
        for ev in ({"type": "response.created", "response": {"id": f"resp_{i}", "usage": None}},
                   {"type": "response.output_text.delta", "delta": "x"},
                   responses_completed({**R_USAGE, "output_tokens": 10 + i}, rid=f"resp_{i}")):
            read = r.message(json.dumps(ev))
            if read is not None:
                got.append(read)
    assert [(g.id, g.usage.output) for g in got] == [("resp_0", 10), ("resp_1", 11)]


@pytest.mark.parametrize("api,body,want", [
    (F.ANTHROPIC_MESSAGES, {"id": "msg_2", "model": "claude-haiku-5", "content": [],
                            "usage": {"input_tokens": 7, "cache_read_input_tokens": 3, "output_tokens": 4}},
     Usage(input=10, output=4, cache_read=3)),
    (F.OPENAI_CHAT, {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
     Usage(input=9, output=2)),
    (F.OPENAI_RESPONSES, responses_completed(R_USAGE)["response"],
     Usage(input=12_000, output=800, cache_read=11_520, reasoning=640)),
])
def test_a_whole_json_answer(api, body, want):
    r = UsageReader(api)
    r.body(json.dumps(body).encode())
    assert r.result().usage == want


# ---------------------------------------------------------------- the recorded answers

def _recorded():
    from mitmproxy.io import FlowReader

    for path in sorted(FLOWS.glob("*.flow")):
        with path.open("rb") as f:
            for flow in FlowReader(f).stream():
                resp = getattr(flow, "response", None)
                api = F.api_of(flow.request.method, flow.request.url) if hasattr(flow, "request") else None
                if resp is not None and api in (F.ANTHROPIC_MESSAGES, F.OPENAI_CHAT, F.OPENAI_RESPONSES):
                    yield path.name, api, resp.raw_content, resp.headers.get("content-encoding", "")


def expected(api: str, data: bytes) -> Usage:
    """The usage a recorded stream states, read the plain way: every event parsed."""
    events = [json.loads(line[5:]) for line in data.decode().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    if api == F.ANTHROPIC_MESSAGES:
        u = {}
        for ev in events:
            if ev["type"] == "message_start":
                u.update(ev["message"]["usage"])
            elif ev["type"] == "message_delta":
                u.update(ev["usage"])
        read, write = u.get("cache_read_input_tokens", 0), u.get("cache_creation_input_tokens", 0)
        return Usage(input=u["input_tokens"] + read + write, output=u["output_tokens"], cache_read=read,
                     cache_write_5m=write)
    if api == F.OPENAI_CHAT:
        u = [ev["usage"] for ev in events if ev.get("usage")][-1]
        return Usage(input=u["prompt_tokens"], output=u["completion_tokens"],
                     cache_read=(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    u = [ev["response"]["usage"] for ev in events if ev.get("type") == "response.completed"][-1]
    return Usage(input=u["input_tokens"], output=u["output_tokens"],
                 cache_read=u["input_tokens_details"]["cached_tokens"],
                 reasoning=u["output_tokens_details"]["reasoning_tokens"])


def test_every_recorded_answer_reads_as_the_usage_it_states():
    seen = 0
    for name, api, data, encoding in _recorded():
        assert not encoding
        for seed in range(3):
            assert fed(api, data, seed=seed).usage == expected(api, data), name
        seen += 1
    assert seen >= 12


def test_a_json_answer_passing_as_a_stream_is_read_at_its_end_within_the_bound():
    body = json.dumps({"id": "msg_3", "model": "m", "content": [],
                       "usage": {"input_tokens": 7, "cache_read_input_tokens": 3, "output_tokens": 4}}).encode()
    r = UsageReader(F.ANTHROPIC_MESSAGES, whole=True)
    for i in range(0, len(body), 10):
        assert r(body[i:i + 10]) == body[i:i + 10]
    r(b"")
    assert r.result().usage == Usage(input=10, output=4, cache_read=3)
    small = UsageReader(F.ANTHROPIC_MESSAGES, whole=True, max_event=20)
    assert small(body) == body
    small(b"")
    assert small.result().usage is None and small.result().overflow


def test_an_empty_chunk_mid_stream_is_no_end():
    """mitmproxy hands an empty HTTP/2 DATA frame to the stream callable as b"", as it does the
    stream's end: inside an event, that event was read as two broken halves (its usage lost);
    in a JSON answer, the body was read at it, half. The end is ``result()``."""
    data = anthropic_stream({"input_tokens": 11, "output_tokens": 1}, {"output_tokens": 77})
    want = fed(F.ANTHROPIC_MESSAGES, data).usage
    at = data.index(b'"output_tokens": 77')
    for cut in (at, data.index(b"message_stop"), 1, len(data) - 1):
        r = UsageReader(F.ANTHROPIC_MESSAGES)
        assert r(data[:cut]) == data[:cut] and r(b"") == b"" and r(b"") == b"" and r(data[cut:]) == data[cut:]
        assert r.result().usage == want == Usage(input=11, output=77), cut
    body = json.dumps({"id": "msg_3", "model": "m", "content": [], "usage": {"input_tokens": 7, "output_tokens": 4}})
    r = UsageReader(F.ANTHROPIC_MESSAGES, whole=True)
    r(body[:20].encode()), r(b""), r(body[20:].encode())
    assert r.result().usage == Usage(input=7, output=4)


def test_the_last_event_without_its_blank_line_is_read_when_the_result_is_taken():
    data = anthropic_stream({"input_tokens": 11, "output_tokens": 1}, {"output_tokens": 77})
    data = data[:data.index(b"event: message_stop")].rstrip(b"\n")      # message_delta last, unended
    r = UsageReader(F.ANTHROPIC_MESSAGES)
    r(data)
    assert r.result().usage == r.result().usage == Usage(input=11, output=77)


# ---------------------------------------------------------------- a hostile server's answers


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_a_decompression_bomb_makes_no_more_than_its_room(coding):
    """809 bytes of br made 512 MiB in one ``process`` call before (no ``output_buffer_limit``):
    every decompressor is asked for at most one byte past 1 MiB + 128 times what was fed."""
    import zlib

    payload = b"\0" * (80 << 20)
    if coding == "br":
        import brotli
        bomb = brotli.compress(payload, quality=5)
    elif coding == "zstd":
        from backports import zstd
        bomb = zstd.compress(payload)
    else:
        c = zlib.compressobj(9, zlib.DEFLATED, 31 if coding == "gzip" else zlib.MAX_WBITS)
        bomb = c.compress(payload) + c.flush()
    for whole in (False, True):
        r = UsageReader(F.ANTHROPIC_MESSAGES, coding)
        if whole:
            r.body(bomb)
        else:
            assert r(bomb) is bomb
            r(b"")
            assert r.result().overflow
        assert r._inflate.total <= (1 << 20) + 128 * len(bomb)


def test_a_flood_of_usage_events_parses_only_the_first_and_last_of_each_chunk():
    """A usage object is restated, never added to: of a million events holding ``"usage"`` in
    one chunk (a gzip answer of 61 KB made 24 MiB of them, parsed one by one: other clients
    waited 1.6-2.7 s) the first and the last eight are parsed; the answer reads the same."""
    first = {"id": "chatcmpl-1", "model": "gpt-6", "choices": [], "usage": None}
    events = [{"id": "chatcmpl-1", "model": "gpt-6", "choices": [],
               "usage": {"prompt_tokens": n, "completion_tokens": 1}} for n in range(1, 20_001)]
    data = sse(first, *events, named=False) + b"data: [DONE]\n\n"
    r = UsageReader(F.OPENAI_CHAT)
    calls = 0
    event = r._event

    def counted(d):
        nonlocal calls
        calls += 1
        event(d)
    r._event = counted
    r(data)
    r(b"")
    assert calls <= 16
    assert r.result().usage == Usage(input=20_000, output=1) and r.result().id == "chatcmpl-1"
    # every chunking reads the same (events straddling chunks, CRLF)
    assert fed(F.OPENAI_CHAT, data, sizes=(1000, 4096, 65536)).usage == Usage(input=20_000, output=1)
    assert fed(F.OPENAI_CHAT, data.replace(b"\n", b"\r\n"), sizes=(999, 65536)).usage == \
        Usage(input=20_000, output=1)


@pytest.mark.parametrize("absurd", [18446744073709551615, 2**63 - 1, 10**9 + 1, -5])
def test_a_figure_no_turn_can_have_is_not_stated(absurd):
    """One absurd number failed a Redis batch of every conversation's turns (``HINCRBY`` takes
    int64), and 2**63-1 made the conversation's every later batch overflow. Above 10**9 tokens
    (a thousand times the largest context window) a figure reads as not stated."""
    data = anthropic_stream({"input_tokens": absurd, "cache_read_input_tokens": absurd,
                             "cache_creation_input_tokens": 10**9, "output_tokens": 1},
                            {"output_tokens": absurd},
                            {"cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": absurd}})
    read = fed(F.ANTHROPIC_MESSAGES, data)
    assert read.usage == Usage(input=10**9, cache_write_5m=10**9)
    assert read.diagnostic == Diagnostic(reason="messages_changed")
    chat = sse({"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": absurd, "completion_tokens": 3}},
               named=False)
    assert fed(F.OPENAI_CHAT, chat).usage == Usage(output=3)


def test_a_name_the_server_gives_is_cut():
    """A server naming a 1 MB model (or id, or cache-miss reason) in every answer grew the
    ledger's store records, Prometheus' labels and the proxy without bound."""
    huge = "glm-" + "x" * 1_000_000
    data = anthropic_stream({"input_tokens": 5, "output_tokens": 1}, {"output_tokens": 2},
                            {"cache_miss_reason": {"type": huge}}).replace(b'"msg_1"', json.dumps(huge).encode())
    data = data.replace(b'"claude-opus-5-5"', json.dumps(huge).encode())
    read = fed(F.ANTHROPIC_MESSAGES, data, sizes=(65536,))
    assert read.model == huge[:200] and read.id == huge[:200] and read.diagnostic.reason == huge[:200]
    assert read.usage == Usage(input=5, output=2)
