"""OpenTelemetry spans of answered turns, when the operator turns an exporter on.

``--set sessionpin_otel=console`` (spans printed by the SDK's console exporter) or ``otlp``
(the OTLP/HTTP exporter, configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables;
``opentelemetry-exporter-otlp-proto-http`` must be installed); ``""`` (the default) is off and
imports nothing. Needs the ``otel`` extra (``opentelemetry-sdk``).

Rules it keeps:
- One span per answered turn (``LedgerWatch`` hands each one over), from the request's start
  to the answer's end, named and attributed by ``sessionpin.genai``; the routing decision is
  on it. Export runs on the SDK's batch thread, never on the event loop.
- An exporter that cannot be built is refused with one line (the option's error); a failing
  export is the SDK's business (it logs and drops), never a flow's.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from .. import genai
from ..ledger import Turn

log = logging.getLogger("sessionpin")
KINDS = ("", "console", "otlp")


class Spans:
    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("sessionpin")
        self.emitted = 0

    @classmethod
    def build(cls, kind: str, processor: Any = None) -> "Spans":
        """A span pipeline for ``kind`` (``processor``: a ready span processor, for tests)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            raise ValueError("needs opentelemetry-sdk (pip install 'sessionpin[otel]')") from None
        provider = TracerProvider(resource=Resource.create({"service.name": "sessionpin"}))
        if processor is None:
            if kind == "console":
                exporter = ConsoleSpanExporter()
            elif kind == "otlp":
                try:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                except ImportError:
                    raise ValueError("otlp needs opentelemetry-exporter-otlp-proto-http installed") from None
                exporter = OTLPSpanExporter()
            else:
                raise ValueError(f"unknown exporter {kind!r} (known: console, otlp)")
            processor = BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider)

    def emit(self, turn: Turn, session: str, agent: str, started: float, ended: float,
             decision: Mapping[str, Any] | None, request_model: str | None) -> None:
        span = self.tracer.start_span(genai.span_name(turn), start_time=int(started * 1e9),
                                      attributes=genai.attributes(turn, session, agent, decision, request_model))
        span.end(end_time=int(max(ended, started) * 1e9))
        self.emitted += 1

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception as e:
            log.warning("sessionpin: OpenTelemetry shutdown: %s", e)
