"""redact: what looks like a key, and messages that quote a peer's bytes (``unquoted``)."""

from __future__ import annotations

import pytest

from sessionpin.config.redact import unquoted


@pytest.mark.parametrize("message, said", [
    ("Invalid header line: b'x-api-key sk-ant-SECRET'", "Invalid header line: (23 bytes, not shown)"),
    ("illegal chunk header: bytearray(b'{\"a\": \"SECRET\"}\\r\\n')", "illegal chunk header: (17 bytes, not shown)"),
    ("Received invalid header name: b'SECRET x' from client, refusing",
     "Received invalid header name: (8 bytes, not shown) from client, refusing"),
    ("invalid content-length header: '1SECRET'", "invalid content-length header: (7 characters, not shown)"),
    ("Bad HTTP request line: b\"POST /?key=SECRET'x HTTP/1.1 y\"", "Bad HTTP request line: (30 bytes, not shown)"),
    ("a: b'SECRET\\'S' and b'SECRET'", "a: (8 bytes, not shown) and (6 bytes, not shown)"),   # an escaped quote ends nothing
    # h2 quotes the raw character, then the value: the character's quotes must not pair with the value's
    ("Illegal character '\n' in header value: b'sk-ant-SECRET\\n'",
     "Illegal character (1 characters, not shown) in header value: (14 bytes, not shown)"),
    ("b'" + "\\\\" * 5000 + "' then b'SECRET'", "(5000 bytes, not shown) then (6 bytes, not shown)"),
    ("header: b'SECRET", "header: (6 bytes, not shown)"),            # never closed (cut short?): hidden all the same
    ("Received header value surrounded by whitespace b' sk-ant-SECRET'",
     "Received header value surrounded by whitespace (14 bytes, not shown)"),
])
def test_a_quoted_value_is_said_by_its_size(message: str, said: str):
    assert unquoted(message) == said


@pytest.mark.parametrize("message", ["the server's answer isn't here", "no quotes at all", "",
                                     "server glm (127.0.0.1:8443) refused the connection"])
def test_a_message_quoting_nothing_is_left_as_it_is(message: str):
    assert unquoted(message) == message
