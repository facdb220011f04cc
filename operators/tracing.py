"""OpenTelemetry spans for a training step, a registration and a serving swap; off by default.

On with the environment of the process that runs the code (a Flink TaskManager's Python
worker, `streamtune serve`):

- `STREAMTUNE_OTLP_ENDPOINT=http://collector:4318`: spans go to an OTLP/HTTP collector
  (`/v1/traces` is appended unless the value already ends with it), batched;
- `STREAMTUNE_TRACE_CONSOLE=1`: spans are printed as JSON on stdout (tests, debugging).

Neither set, or `opentelemetry-sdk` not installed (the `tracing` extra): `span()` is a no-op
and costs a dictionary lookup. The tracer provider is this module's own, not the global one,
so it never clashes with another library's tracing (MLflow's).

>>> with span("streamtune.example", model_id="bot") as s:
...     s.set_attribute("samples", 3)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_LOCK = threading.Lock()
_UNSET = object()
_tracer = _UNSET  # an OpenTelemetry Tracer, None when tracing is off, _UNSET before the first span


class _NoSpan:
    def set_attribute(self, key: str, value) -> None:
        pass


def _exporter_from_env():
    endpoint = os.environ.get("STREAMTUNE_OTLP_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint), True
    if os.environ.get("STREAMTUNE_TRACE_CONSOLE", "") not in ("", "0"):
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stdout), False  # the stdout of now, not of the import
    return None, False


def configure(exporter=_UNSET, batch: bool = False):
    """Send spans to `exporter` (an OpenTelemetry SpanExporter; None: tracing off); without
    one, from the environment. Returns the tracer, or None when tracing is off."""
    global _tracer
    with _LOCK:
        if exporter is _UNSET:
            try:
                exporter, batch = _exporter_from_env()
            except ImportError:  # the tracing extra is not installed: stay off
                exporter = None
        if exporter is None:
            _tracer = None
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get(
            "OTEL_SERVICE_NAME", "streamtune")}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        _tracer = provider.get_tracer("streamtune")
        return _tracer


@contextlib.contextmanager
def span(name: str, **attributes):
    """A span around the block, with `attributes` (None values left out); the block gets an
    object with `set_attribute`. The span is not made current: it may enclose a generator's
    work without owning the caller's context."""
    tracer = configure() if _tracer is _UNSET else _tracer
    if tracer is None:
        yield _NoSpan()
        return
    s = tracer.start_span(name, attributes={k: v for k, v in attributes.items() if v is not None})
    try:
        yield s
    except BaseException as e:
        s.record_exception(e)
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        s.end()
