"""A gRPC OTLP receiver on loopback that accepts and discards, for benchmarks
that need a live back end."""

from __future__ import annotations

from concurrent import futures


def live_receiver():
    """(server, endpoint URL); call server.stop(grace=None) when done."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC method's name
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"
