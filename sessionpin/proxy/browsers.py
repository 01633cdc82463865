"""PageGuard: a web page's request never drives the proxy (issue 20).

A page's script can reach a listener on loopback: a no-cors ``text/plain`` POST needs no
preflight, so it arrives whole at a reverse-mode listener, which would route it as an
agent's turn with a server's key. A request with browser fetch metadata
(``headers.from_web_page``: an ``Origin``, or ``Sec-Fetch-Site`` other than ``none``) is
answered 403 here, in the API's error format, before the router or the status endpoints
see it, and reaches no server:

- on a reverse-mode listener: every such request (the listener stands for an API an
  agent was pointed at, not for a site to browse);
- on the other listeners (regular, upstream, …): a request addressed to a configured
  server (its origin and path prefix) and the proxy's own ``/__sessionpin/`` paths. A
  browser that uses the proxy to browse other sites keeps working: those requests pass
  untouched — and are marked so (``perflow.PAGE``), for the router never routes one: it
  follows a pin whatever origin a request addressed, so a page's request to its own host
  shaped as a turn of a pinned conversation (pi's are keyed by what they say) was sent to
  that conversation's server with the server's key, its answer the page's to read.

``sessionpin_allow_origins`` names the pages an operator lets through (their ``Origin``,
``https://app.example``). Each refusal is counted (``sessionpin_refusals_total{reason=
"web-page"}``) and logged with the header that gave it away.
"""

from __future__ import annotations

import logging

from collections.abc import Sequence

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ReverseMode

from ..decision import answers, headers
from . import perflow
from .configwatch import ConfigWatch
from .router import INTERNAL_PREFIX

log = logging.getLogger("sessionpin")

KIND = "web-page"


class PageGuard:
    def __init__(self, config: ConfigWatch, metrics=None) -> None:
        self.config = config
        self.metrics = metrics
        self.allowed: tuple[str, ...] = ()
        self.refused = 0

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_allow_origins", Sequence[str], [],
            "sessionpin: web page origins (https://app.example) whose requests may use the proxy. "
            "Without them, a request with browser fetch metadata (an Origin header, or Sec-Fetch-Site "
            "other than none) to a configured server or a reverse-mode listener is refused (403).",
        )

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_allow_origins" not in updated:
            return
        allowed = []
        for origin in ctx.options.sessionpin_allow_origins:
            o = headers.normal_origin(origin)
            scheme, sep, host = o.partition("://")
            if not sep or scheme not in ("http", "https") or not host or "/" in host:
                raise exceptions.OptionsError(
                    f"sessionpin_allow_origins: {origin!r} is not an origin (scheme://host[:port], "
                    "as a browser sends it in its Origin header)")
            allowed.append(o)
        self.allowed = tuple(allowed)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.request.stream:
            return
        req = flow.request
        why = headers.from_web_page(_page_headers(req.headers.fields), self.allowed)
        if why is None:
            return
        if not self._guarded(flow):
            flow.metadata[perflow.PAGE] = why       # browsing: passes untouched, never routed
            return
        # the error format its API reads, by the router's own rule (config.Config.scope)
        api = self.config.config.scope("POST", req.scheme, req.host, req.port, req.path)[1].api
        message = (f"sessionpin: a web page's request ({why}) may not use this proxy; it was not sent. "
                   "An operator who wants this page to use it adds its origin to sessionpin_allow_origins.")
        body, hs = answers.refusal(api, 403, KIND, message)
        flow.response = http.Response.make(403, body, hs)
        flow.metadata.setdefault("sessionpin", {}).update({"refused": 403, "refusal": KIND, "message": message})
        flow.comment = f"refused 403: {KIND} ({why})"
        self.refused += 1
        if self.metrics is not None:
            self.metrics.refusals[KIND] += 1
        log.warning("sessionpin: refused 403 (%s) %s %s: %s", KIND, req.pretty_host,
                    req.path.split("?", 1)[0][:200], why)

    def _guarded(self, flow: http.HTTPFlow) -> bool:
        """Whether this request is one a page may not send (see the module)."""
        if isinstance(getattr(flow.client_conn, "proxy_mode", None), ReverseMode):
            return True
        req = flow.request
        if req.path.startswith(INTERNAL_PREFIX):
            return True
        return self.config.config.server_for(req.scheme, req.host, req.port, req.path) is not None


def _page_headers(fields) -> list[tuple[str, str]]:
    """The headers ``from_web_page`` may read, decoded as mitmproxy decodes them; the rest of a
    request's ~25 headers are not decoded at all (a str per name and value, every request).
    A superset: every name that holds the bytes of one it reads, whatever surrounds them
    (``from_web_page`` strips and compares as before; no other character lowers to these)."""
    out = []
    for n, v in fields:
        low = n.lower()
        if b"origin" in low or b"sec-fetch-site" in low:
            out.append((n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")))
    return out
