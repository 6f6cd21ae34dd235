"""A gRPC OTLP receiver on loopback that accepts, counts and discards, for
benchmarks that need a live back end."""

from __future__ import annotations

from concurrent import futures


def live_receiver():
    """(server, endpoint URL); `server.received()` is the number of spans
    received so far; call server.stop(grace=None) when done."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC method's name
            count[0] += sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.received = lambda: count[0]
    return server, f"http://127.0.0.1:{port}"
