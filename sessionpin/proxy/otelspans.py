"""OpenTelemetry spans of answered turns, when the operator turns an exporter on.

``--set sessionpin_otel=console`` (spans printed by the SDK's console exporter) or ``otlp``
(the OTLP/HTTP exporter, configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables;
``opentelemetry-exporter-otlp-proto-http`` must be installed); ``""`` (the default) is off and
imports nothing. Needs the ``otel`` extra (``opentelemetry-sdk``).

Rules it keeps:
- One span per answered turn (``LedgerWatch`` hands each one over), from the request's start
  to the answer's end, named and attributed by ``sessionpin.accounting.genai``; the routing decision is
  on it. A decided request that gave no turn (refused, failed, an error answer, no usage)
  has a span too, with its decision and how it ended. And the conventions' client metrics: ``gen_ai.client.token.usage`` (input and output
  tokens per turn, ``gen_ai.token.type``) and ``gen_ai.client.operation.duration``, with the
  operation, provider, models and server (no session: a metric's attributes stay few).
  Export runs on the SDK's threads (batch, periodic reader), never on the event loop.
- An exporter that cannot be built is refused with one line (the option's error); a failing
  export is the SDK's business (it logs and drops), never a flow's.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..accounting import genai
from ..accounting.ledger import Turn

log = logging.getLogger("sessionpin")
KINDS = ("", "console", "otlp")


class Spans:
    def __init__(self, provider: Any, meters: Any = None) -> None:
        self.provider = provider
        self.meters = meters
        self.tracer = provider.get_tracer("sessionpin")
        self.tokens = self.duration = None
        if meters is not None:
            meter = meters.get_meter("sessionpin")
            self.tokens = meter.create_histogram("gen_ai.client.token.usage", unit="{token}",
                                                 description="Tokens of each answered turn, by token type")
            self.duration = meter.create_histogram("gen_ai.client.operation.duration", unit="s",
                                                   description="From the request's start to the answer's end")
        self.emitted = 0

    @classmethod
    def build(cls, kind: str, processor: Any = None, metric_reader: Any = None) -> "Spans":
        """A span (and metrics) pipeline for ``kind`` (``processor``, ``metric_reader``: ready
        ones, for tests)."""
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            raise ValueError("needs opentelemetry-sdk (pip install 'sessionpin[otel]')") from None
        resource = Resource.create({"service.name": "sessionpin"})
        provider = TracerProvider(resource=resource)
        if processor is None:
            if kind == "console":
                exporter, metrics = ConsoleSpanExporter(), ConsoleMetricExporter()
            elif kind == "otlp":
                try:
                    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                except ImportError:
                    raise ValueError("otlp needs opentelemetry-exporter-otlp-proto-http installed") from None
                exporter, metrics = OTLPSpanExporter(), OTLPMetricExporter()
            else:
                raise ValueError(f"unknown exporter {kind!r} (known: console, otlp)")
            processor = BatchSpanProcessor(exporter)
            metric_reader = PeriodicExportingMetricReader(metrics)
        provider.add_span_processor(processor)
        meters = MeterProvider(resource=resource, metric_readers=[metric_reader]) if metric_reader is not None \
            else None
        return cls(provider, meters)

    def emit(self, turn: Turn, session: str, agent: str, started: float, ended: float,
             decision: Mapping[str, Any] | None, request_model: str | None) -> None:
        attributes = genai.attributes(turn, session, agent, decision, request_model)
        span = self.tracer.start_span(genai.span_name(turn), start_time=int(started * 1e9), attributes=attributes)
        span.end(end_time=int(max(ended, started) * 1e9))
        if self.tokens is not None:
            common = genai.metric_attributes(turn, request_model)
            self.tokens.record(turn.usage.input, {**common, "gen_ai.token.type": "input"})
            self.tokens.record(turn.usage.output, {**common, "gen_ai.token.type": "output"})
            self.duration.record(max(0.0, ended - started), common)
        self.emitted += 1

    def emit_request(self, decision: Mapping[str, Any], started: float, ended: float, status: int | None,
                     error: str | None) -> None:
        """A decided request that gave no turn: its span, with the decision and how it ended."""
        span = self.tracer.start_span("chat", start_time=int(started * 1e9),
                                      attributes=genai.request_attributes(decision, status))
        if error is not None or (status is not None and status >= 400):
            from opentelemetry.trace import Status, StatusCode
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end(end_time=int(max(ended, started) * 1e9))
        self.emitted += 1

    def shutdown(self) -> None:
        for p in (self.provider, self.meters):
            try:
                if p is not None:
                    p.shutdown()
            except Exception as e:
                log.warning("sessionpin: OpenTelemetry shutdown: %s", e)
