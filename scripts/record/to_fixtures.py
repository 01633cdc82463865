"""Turn recorded flows (``mitmdump -w``) into redacted request fixtures for the request reader.

usage: python scripts/record/to_fixtures.py FLOWDIR OUTDIR [SCENARIO...]
       python scripts/record/to_fixtures.py --flow IN.flow OUT.flow   (redacted copy of a raw flow file)

Each scenario in ``scenarios.py`` names a flow file, the agent that made it, and — in flow order —
what every inference request in it IS, as known from how the recording was produced (which prompt
was typed, which tool call the fake returned). That list is the ground truth written to ``expect``;
nothing here classifies. The converter checks the list against the flow (same number of inference
requests, same endpoint kind) and refuses to write a scenario that does not match.

Rules it keeps:
- A fixture is ``{"method", "url", "headers": [[name, value], ...], "body", "expect", "note"}``.
  Header order, case and duplicates are kept; the body is the parsed JSON value (or a string when it is
  not JSON, or null when empty), decoded from its content-encoding, which stays in the headers and is
  named in ``body_encoding``.
- Every credential is replaced by a fixed fake: credential headers (x-api-key, authorization, cookies,
  ...), ``key=``/``token=`` query parameters, and any fake key string used while recording that shows up
  elsewhere (body included).
- Sessions are the agent's own ids, read from the agent's own header and cross-checked (a subagent's
  parent must be a session of the same scenario).
- A scenario with ``"responses": True`` also keeps what the fake answered: ``response`` =
  ``{"status", "headers", "body"}`` (body as text: the SSE stream, or JSON as the fake sent it), and for
  an accepted WebSocket ``websocket`` = the messages both ways, ``[{"from_client", "content"}]`` (content
  parsed when it is JSON). A label's ``lineage`` goes to ``expect.lineage``.
- A WebSocket the fake relayed to its local server (FAKE_WEBSOCKET=1) is stored under the URL and
  Host the client used (``flow.metadata["fake_original_url"]``).
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from mitmproxy import io as mio

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import SCENARIOS, TURN_OF_KIND  # noqa: E402

CREDENTIAL_HEADERS = {
    "x-api-key", "authorization", "proxy-authorization", "cookie", "set-cookie", "api-key",
    "x-goog-api-key", "openai-api-key", "x-anthropic-api-key", "anthropic-api-key", "x-auth-token",
    "chatgpt-account-id", "statsig-api-key", "x-stainless-api-key", "openai-organization", "openai-project",
}
# The fake keys used while recording (scripts/record/README in docs/traffic.md): any of them left in a
# header, URL or body is replaced too.
FAKE_KEY_RE = re.compile(r"(sk-ant-api03-|sk-proj-|sk-)?FAKE[A-Za-z0-9_\-]*")
SECRET_QUERY = {"key", "api_key", "apikey", "token", "access_token"}


def redact_value(name: str, value: str) -> str:
    low = name.lower()
    if low in ("cookie", "set-cookie"):
        return "REDACTED=REDACTED"
    if low == "chatgpt-account-id":
        return "00000000-0000-0000-0000-000000000000"
    scheme, _, token = value.partition(" ")
    if token and scheme.lower() in ("bearer", "basic", "token"):
        return f"{scheme} {_fake_for(token)}"
    return _fake_for(value)


def _fake_for(secret: str) -> str:
    if secret.startswith("sk-ant-"):
        return "sk-ant-REDACTED"
    if secret.startswith("sk-"):
        return "sk-REDACTED"
    return "REDACTED"


def redact_text(text: str) -> str:
    return FAKE_KEY_RE.sub(lambda m: _fake_for(m.group(0)), text)


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if not parts.query:
        return redact_text(url)
    query = [(k, "REDACTED" if k.lower() in SECRET_QUERY else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    if query == parse_qsl(parts.query, keep_blank_values=True):
        return redact_text(url)  # keep the query byte-exact when nothing in it is secret
    return redact_text(urlunsplit(parts._replace(query=urlencode(query))))


def redact_body(body):
    """The same JSON value with every fake key string replaced (strings only; structure untouched)."""
    if isinstance(body, str):
        return redact_text(body)
    if isinstance(body, list):
        return [redact_body(v) for v in body]
    if isinstance(body, dict):
        return {k: redact_body(v) for k, v in body.items()}
    return body


def api_of(method: str, path: str) -> str:
    path = path.split("?", 1)[0].rstrip("/")
    if method == "POST" and path.endswith("/messages/count_tokens"):
        return "anthropic-count-tokens"
    if method == "POST" and path.endswith("/messages"):
        return "anthropic-messages"
    if method == "POST" and path.endswith("/chat/completions"):
        return "openai-chat"
    if method == "POST" and path.endswith("/responses"):
        return "openai-responses"
    return "other"


def read_body(flow):
    raw = flow.request.get_content(strict=False)
    encoding = flow.request.headers.get("content-encoding")
    if not raw:
        return None, encoding
    try:
        return json.loads(raw), encoding
    except ValueError:
        pass
    try:
        return raw.decode("utf-8"), encoding
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode()}, encoding  # binary: see body_base64


def header(flow, name: str) -> str | None:
    return flow.request.headers.get(name)


def own_session(agent: str, flow, body) -> str | None:
    """The session id the agent itself put on the request (None when it sent none)."""
    names = {
        "claude-code": ["x-claude-code-session-id"],
        "opencode": ["x-opencode-session", "x-session-id", "x-session-affinity"],
        "codex": ["session-id", "session_id"],
        "pi": ["session_id", "session-id"],
    }[agent]
    for name in names:
        if header(flow, name):
            return header(flow, name)
    return None


def expect_for(scn: dict, label: dict, flow, body, api: str) -> dict:
    agent = scn["agent"]
    kind = label["kind"]
    inference = api != "other"
    turn = TURN_OF_KIND[kind] if inference else None
    session = None
    exp: dict = {"agent": agent, "api": api}
    if inference:
        session = own_session(agent, flow, body)
        if agent == "opencode" and header(flow, "x-parent-session-id"):
            session = header(flow, "x-parent-session-id")  # the subagent follows its parent's pin
        if session is None:
            session = "fingerprint"
            exp["conversation"] = label.get("conversation", scn.get("conversation", scn["name"]))
    exp["session"] = session
    exp["turn"] = turn
    exp["model"] = body.get("model") if isinstance(body, dict) and inference else None
    exp["stream"] = bool(body.get("stream")) if isinstance(body, dict) and inference else None
    exp["kind"] = kind
    if label.get("lineage"):
        exp["lineage"] = label["lineage"]
    if label.get("identifiable") is False:
        exp["identifiable"] = False  # nothing in the request (User-Agent, headers) names the agent
    return exp


def convert(scn: dict, flowdir: Path, outdir: Path) -> list[Path]:
    with open(flowdir / scn["flow"], "rb") as f:
        flows = [fl for fl in mio.FlowReader(f).stream() if hasattr(fl, "request")]
    labels = list(scn["requests"])
    inference = [fl for fl in flows if api_of(fl.request.method, fl.request.path) != "other"
                 and fl.request.host not in scn.get("ignore_hosts", ())]
    if len(inference) != len(labels):
        raise SystemExit(f"{scn['name']}: {len(inference)} inference requests in the flow, {len(labels)} labelled")
    picked = []
    for fl, label in zip(inference, labels):
        if label.get("api") and label["api"] != api_of(fl.request.method, fl.request.path):
            raise SystemExit(f"{scn['name']}: label {label} does not match {fl.request.path}")
        if not label.get("skip"):
            picked.append((fl, label))
    for rule in scn.get("other", []):
        hits = [fl for fl in flows if re.search(rule["match"], original_url(fl))
                and api_of(fl.request.method, fl.request.path) == "other"]
        each = rule.get("each") or [{}] * rule.get("max", 1)
        picked += [(fl, dict(rule, **extra)) for fl, extra in zip(hits[: rule.get("max", 1)], each)]
    picked.sort(key=lambda p: p[0].request.timestamp_start)

    sessions = {own_session(scn["agent"], fl, None) for fl, _ in picked}
    written = []
    for nn, (fl, label) in enumerate(picked, 1):
        body, encoding = read_body(fl)
        api = api_of(fl.request.method, fl.request.path)
        exp = expect_for(scn, label, fl, body, api)
        parent = header(fl, "x-parent-session-id")
        if parent and parent not in sessions:
            raise SystemExit(f"{scn['name']}: subagent parent {parent} is not a session of this scenario")
        fixture = {
            "method": fl.request.method,
            "url": redact_url(original_url(fl)),
            "headers": [[k, redact_value(k, v) if k.lower() in CREDENTIAL_HEADERS else redact_text(v)]
                        for k, v in original_headers(fl)],
            "body": redact_body(body),
            "expect": exp,
            "note": label.get("note", scn.get("note", "")),
        }
        if isinstance(body, dict) and set(body) == {"base64"} and not isinstance(read_body(fl)[0], str):
            fixture["body"], fixture["body_base64"] = body["base64"], True
        if fl.request.http_version:
            fixture["http_version"] = fl.request.http_version
        if scn.get("responses"):
            fixture.update(response_of(fl))
        if encoding and encoding != "identity":
            fixture["body_encoding"] = encoding
            fixture["note"] = (fixture["note"] + f" Body stored decoded; the client sent it {encoding}-compressed"
                               " (content-encoding kept in headers, content-length is of the compressed body).").strip()
        out = outdir / scn["agent"] / f"{scn['scenario']}-{nn:02d}-{label['kind']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(fixture, indent=1, ensure_ascii=False) + "\n"
        if FAKE_KEY_RE.search(text) or re.search(r"sk-(ant-)?(api\d\d-)?(?!REDACTED)[A-Za-z0-9]{16,}", text):
            hit = FAKE_KEY_RE.search(text) or re.search(r"sk-(ant-)?(api\d\d-)?(?!REDACTED)[A-Za-z0-9]{16,}", text)
            raise SystemExit(f"{out}: something that looks like a key survived redaction: {text[hit.start() - 40:hit.end()]!r}")
        out.write_text(text)
        written.append(out)
    return written


def original_url(flow) -> str:
    """The URL the client asked for (the fake may have relayed a WebSocket to its local server)."""
    return flow.metadata.get("fake_original_url") or flow.request.pretty_url


def original_headers(flow) -> list[tuple[str, str]]:
    pairs = list(flow.request.headers.items(multi=True))
    if "fake_original_url" in flow.metadata:  # mitmproxy rewrote Host when the fake relayed it
        netloc = urlsplit(flow.metadata["fake_original_url"]).netloc
        pairs = [(k, netloc if k.lower() == "host" else v) for k, v in pairs]
    return pairs


def _json_or_text(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def response_of(flow) -> dict:
    """``response`` (and ``websocket``) of a fixture: what the fake answered, redacted like requests."""
    out: dict = {}
    resp = flow.response
    if resp is not None:
        raw = resp.get_content(strict=False) or b""
        ctype = resp.headers.get("content-type", "")
        body = None if not raw else _json_or_text(raw) if "json" in ctype else raw.decode("utf-8", "replace")
        out["response"] = {
            "status": resp.status_code,
            "headers": [[k, redact_text(v)] for k, v in resp.headers.items(multi=True)],
            "body": redact_body(body),
        }
    ws = getattr(flow, "websocket", None)
    if ws is not None:
        out["websocket"] = [{"from_client": m.from_client, "content": redact_body(_json_or_text(m.content))}
                            for m in ws.messages]
    return out


def redact_flow_file(src: Path, dst: Path) -> int:
    """Copy a flow file with every credential header replaced; bodies stay byte-exact (still compressed)."""
    n = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        writer = mio.FlowWriter(out)
        for fl in mio.FlowReader(f).stream():
            for msg in (fl.request, getattr(fl, "response", None)):
                if msg is None:
                    continue
                for name in list(msg.headers.keys()):
                    values = msg.headers.get_all(name)
                    if name.lower() in CREDENTIAL_HEADERS:
                        msg.headers.set_all(name, [redact_value(name, v) for v in values])
                    else:
                        msg.headers.set_all(name, [redact_text(v) for v in values])
                if FAKE_KEY_RE.search((msg.get_content(strict=False) or b"").decode("utf-8", "replace")):
                    raise SystemExit(f"{src}: a key string is inside a body; refusing to copy it")
            fl.request.url = redact_url(fl.request.pretty_url)
            writer.add(fl)
            n += 1
    return n


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--flow":
        print(f"{argv[3]}: {redact_flow_file(Path(argv[2]), Path(argv[3]))} flows")
        return 0
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    flowdir, outdir = Path(argv[1]), Path(argv[2])
    names = argv[3:] or list(SCENARIOS)
    for name in names:
        scn = dict(SCENARIOS[name], name=name)
        for path in convert(scn, flowdir, outdir):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
