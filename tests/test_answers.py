"""answers: the proxy's own answers in the agent's format, and which ones no agent retries."""

from __future__ import annotations

import json
import re

import pytest

from sessionpin.decision import answers
from sessionpin.reader import facts as F

# pi 0.73's auto-retry reads the error text (pi-coding-agent agent-session.ts, _isRetryableError):
PI_RETRY = re.compile(r"overloaded|rate.?limit|too many requests|429|500|502|503|504|service.?unavailable|"
                      r"server.?error|internal.?error|connection.?error|connection.?refused|other side closed|"
                      r"fetch failed|upstream.?connect|reset before headers|terminated|retry delay|timed? out|"
                      r"timeout|socket hang up|network.?error", re.IGNORECASE)
# what opencode's AI SDK, Codex, and the Anthropic/OpenAI SDKs retry by status alone
RETRIED_STATUSES = {401, 408, 409, 429} | set(range(500, 600))


@pytest.mark.parametrize("api", [F.ANTHROPIC_MESSAGES, F.ANTHROPIC_COUNT_TOKENS, F.OPENAI_CHAT, F.OPENAI_RESPONSES])
def test_the_no_retry_answer_has_no_signal_any_client_retries(api):
    store_error = ("redis://:***@127.0.0.1:6390/0: Error 111 connecting to 127.0.0.1:6390. Connection refused. "
                   "Timeout reading; internal error, service unavailable, overloaded, rate limit")
    body, headers = answers.refusal(api, answers.NO_RETRY_STATUS, "store", f"sessionpin cannot read ({store_error})")
    assert answers.NO_RETRY_STATUS not in RETRIED_STATUSES
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers
    text = body.decode()
    assert not PI_RETRY.search(text.replace("6390", "PORT")), text     # (a port is the operator's)
    assert "overloaded_error" not in text and "server_error" not in text and "rate_limit" not in text
    err = json.loads(body)["error"]
    assert "refused to connect" in err["message"] and "took too long" in err["message"]


def test_other_answers_keep_their_words_and_hints():
    body, headers = answers.refusal(F.OPENAI_CHAT, 503, "store", "Connection refused", retry_after=1)
    assert headers["retry-after"] == "1" and headers["x-should-retry"] == "true"
    assert json.loads(body)["error"]["message"] == "Connection refused"


def test_the_no_retry_answer_as_each_agent_shows_it_at_once():
    """Codex retries a 424 five times and stops at a 400, showing its body as it came (plain
    text, not JSON); a refused upgrade is a 426 (Codex goes to HTTPS at once); every other
    agent gets the 424 in its API's format."""
    message = "sessionpin: server alt (127.0.0.1:9) cannot be reached: connection refused"
    status, body, headers = answers.no_retry(F.CODEX, F.OPENAI_RESPONSES, "unreachable", message)
    assert status == answers.CODEX_NO_RETRY_STATUS == 400
    assert headers["content-type"].startswith("text/plain") and headers["x-should-retry"] == "false"
    assert "retry-after" not in headers and headers["x-sessionpin-refused"] == "unreachable"
    assert body.decode() == "sessionpin: server alt (127.0.0.1:9) cannot be reached: refused to connect"
    status, body, headers = answers.no_retry(F.CODEX, F.OPENAI_RESPONSES, "unreachable", message, upgrade=True)
    assert status == answers.NO_RETRY_UPGRADE_STATUS and json.loads(body)["error"]["code"] == "unreachable"
    for agent, api in ((F.CLAUDE_CODE, F.ANTHROPIC_MESSAGES), (F.OPENCODE, F.OPENAI_CHAT), (F.PI, F.OPENAI_RESPONSES),
                       (F.UNKNOWN_AGENT, F.OPENAI_RESPONSES)):
        status, body, headers = answers.no_retry(agent, api, "unreachable", message)
        assert status == answers.NO_RETRY_STATUS and headers["content-type"] == "application/json"
        assert "refused to connect" in body.decode()


@pytest.mark.parametrize("api", [F.ANTHROPIC_MESSAGES, F.OPENAI_CHAT, F.OPENAI_RESPONSES])
def test_pi_reads_no_status_in_the_numbers_of_a_no_retry_answer(api):
    """pi retries any error whose text holds 429 or 500-504, inside a longer number too: a port,
    a short id, a count. What pi is told holds none (a word joiner inside each run); what the
    other agents are told is unchanged."""
    message = ("sessionpin: conversation a5003f29 (4429 turns) is pinned to server local "
               "(http://127.0.0.1:5000), which cannot be reached; 50429 and 5504 stay")
    status, body, _ = answers.no_retry(F.PI, api, "unreachable", message)
    shown = json.loads(body)["error"]["message"]
    assert status == answers.NO_RETRY_STATUS
    assert not PI_RETRY.search(shown) and not PI_RETRY.search(body.decode()), shown
    assert shown.replace(answers.WORD_JOINER, "") == message
    for agent in (F.CLAUDE_CODE, F.OPENCODE, F.UNKNOWN_AGENT):
        _, body, _ = answers.no_retry(agent, api, "unreachable", message)
        assert json.loads(body)["error"]["message"] == message


def test_unnumbered_breaks_every_overlapping_run():
    for text in ("429", "500", "502", "503", "504", "5004", "50429", "4290", "505", "4500429", "x5029y"):
        out = answers.unnumbered(text)
        assert not re.search(r"429|50[0234]", out) and out.replace(answers.WORD_JOINER, "") == text
    assert answers.unnumbered("505 401 42 9") == "505 401 42 9"
