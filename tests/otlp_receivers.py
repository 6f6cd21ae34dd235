"""Real OTLP receivers on loopback, built on the official opentelemetry-proto
messages: gRPC (grpcio) and HTTP/protobuf (http.server). They keep every span
they receive, decoded to plain Python values."""

from __future__ import annotations

import gzip
import ssl
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(item) for item in value.array_value.values)
    if kind == "kvlist_value":
        return {item.key: any_value(item.value) for item in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "name": span.name,
                        "kind": span.kind,  # 2: SERVER
                        "trace_id": int.from_bytes(span.trace_id, "big"),
                        "span_id": int.from_bytes(span.span_id, "big"),
                        "parent_span_id": int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else 0,
                        "attributes": {kv.key: any_value(kv.value) for kv in span.attributes},
                        "links": [
                            (int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big"))
                            for link in span.links
                        ],
                        "events": [event.name for event in span.events],
                        "status": span.status.code,
                        "status_message": span.status.message,
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "scope": scope_spans.scope.name,
                        "resource": resource,
                    }
                )
    return spans


class _Store:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()

    def add(self, request) -> None:
        with self._lock:
            self.requests += 1
            self.spans.extend(decode(request))

    def wait_for(self, predicate, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"receiver: condition not met in {timeout} s; got {len(spans)} spans")


class GrpcReceiver(_Store):
    def __init__(self) -> None:
        super().__init__()
        self.metadata: list[dict] = []  # each export's gRPC metadata (its headers)
        store = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method's name
                store.metadata.append(dict(context.invocation_metadata()))
                store.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)


class HttpReceiver(_Store):
    """OTLP/HTTP on loopback; with `tls` (certificate, key files) over TLS;
    `status`: what it answers every export with (200: it takes them)."""

    def __init__(self, tls: "tuple[str, str] | None" = None, status: int = 200) -> None:
        super().__init__()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or "protobuf" not in self.headers.get("Content-Type", "") \
                        or status != 200:
                    self.send_response(404 if status == 200 else status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                store.add(request)
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
