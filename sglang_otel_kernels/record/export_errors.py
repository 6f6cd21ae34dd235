"""Why an OTLP back end did not take a batch, in a few words a person can
act on. OpenTelemetry's exporters catch their errors, retry, log what went
wrong and return FAILURE: the cause is only in their log. While a batch is
exported here, their log is kept instead of printed, and its words are
matched: the exporters' sentences differ across SDK versions and between
gRPC and HTTP, the causes under them (an errno's text, an HTTP code, a gRPC
status) do not. The caller then says the failure once per cause."""

from __future__ import annotations

import logging
import re
import threading

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# Where the official exporters log each failed or retried batch.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
)
_KEPT = 16  # messages of one export kept to read (a retry loop logs one per attempt)

# (words of the exporters' log, lowercase; the cause said)
_CAUSES = [
    (("certificate_verify_failed", "certificate verify failed"),
     "TLS certificate verification failed{detail} (OTEL_EXPORTER_OTLP_CERTIFICATE names the CA that signed the "
     "back end's certificate; with http/protobuf, REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE overrides it)"),
    (("wrong version number", "tls handshake failed", "ssl handshake failed", "sslerror", "ssl_error"),
     "the TLS handshake failed (TLS to a plain-text port, or the reverse? OTEL_EXPORTER_OTLP_INSECURE, https://)"),
    (("connection refused",), "connection refused: nothing listens there (is the Collector running?)"),
    (("connection reset by peer", "connection reset"),
     "the connection was reset: what listens there closed it (not an OTLP receiver, or one restarting?)"),
    (("name or service not known", "domain name not found", "failed to resolve", "errors resolving",
      "nodename nor servname", "temporary failure in name resolution", "name resolution"),
     "the host name is not resolved"),
    (("unauthenticated",), "UNAUTHENTICATED: the back end wants credentials (OTEL_EXPORTER_OTLP_HEADERS)"),
    (("permission_denied",), "PERMISSION_DENIED: the credentials were refused (OTEL_EXPORTER_OTLP_HEADERS)"),
    (("resource_exhausted", "exceeds max_request_size"), "the batch is too large for the back end"),
    (("unimplemented",), "UNIMPLEMENTED: no OTLP/gRPC trace service there (an HTTP port? OTEL_EXPORTER_OTLP_PROTOCOL)"),
    (("deadline_exceeded", "timed out", "timeout"), "no answer within the timeout"),
    (("network is unreachable", "no route to host"), "the network does not reach the host"),
]
_HTTP = {401: "the back end wants credentials (OTEL_EXPORTER_OTLP_HEADERS)",
         403: "the credentials were refused (OTEL_EXPORTER_OTLP_HEADERS)",
         404: "no OTLP/HTTP trace service at that path (the endpoint's /v1/traces)",
         413: "the batch is too large for the back end",
         429: "the back end is overloaded (too many requests)"}
_CODE = re.compile(r"\bcode:? (\d{3})\b")
_VERIFY = re.compile(r"certificate[ _]verify[ _]failed: ([^(\]':\n]+)", re.IGNORECASE)


class _ExporterLogs(logging.Filter):
    """On the exporters' loggers: while this thread exports a batch here,
    their messages go to its list instead of being printed (an exporter
    logs in the thread that calls it); else they pass until `quiet` (a
    caller that says failures itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = False
        self.exporting = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        kept = getattr(self.exporting, "kept", None)
        if kept is not None:
            if len(kept) < _KEPT:
                try:
                    kept.append(record.getMessage())
                except Exception:  # noqa: BLE001 - a message that cannot be formatted says nothing
                    pass
            return False
        return not self.quiet


_logs = _ExporterLogs()
for _name in _EXPORTER_LOGGERS:
    logging.getLogger(_name).addFilter(_logs)


def quiet_exporter_logs() -> None:
    """For a caller that says failures itself, in its words (`cause`)."""
    _logs.quiet = True


def cause(messages: list[str]) -> str:
    """The cause the exporter's log messages name, in a few words."""
    text = "\n".join(messages)
    lowered = text.lower()
    code = _CODE.search(text)
    if code is not None:
        number = int(code.group(1))
        return f"HTTP {number}" + (f": {_HTTP[number]}" if number in _HTTP else "")
    for words, said in _CAUSES:
        if any(word in lowered for word in words):
            detail = _VERIFY.search(text)
            detail = detail.group(1).strip() if detail else ""
            return said.format(detail=f" ({detail})" if detail else "")
    if messages:
        return f"the exporter said: {messages[-1][:300]}"
    return "the exporter gave no reason"


def export_batch(exporter: SpanExporter, batch: list) -> "str | None":
    """Exports `batch`; None when the back end took it, else why not. An
    exporter that raises has not taken it (OpenTelemetry 1.29's HTTP
    exporter raises on a refused connection)."""
    kept: list[str] = []
    _logs.exporting.kept = kept
    try:
        if exporter.export(batch) is SpanExportResult.SUCCESS:
            return None
        return cause(kept)
    except Exception as exc:  # noqa: BLE001 - any failure to send is the same to the caller
        return cause(kept + [f"{type(exc).__name__}: {exc}"])
    finally:
        _logs.exporting.kept = None
