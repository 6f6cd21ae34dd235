"""Spans as an OTLP `ExportTraceServiceRequest`, written as protobuf bytes
here for OTLP/gRPC export: by the sidecar, `replay`, and in-process.

The SDK's encoder builds a message object for every attribute of every span,
which made it 60% of the sidecar's time (and, in-process, interpreter time
taken from the kernels); writing the wire format directly,
with the encoded form of an attribute that repeats (a kernel's dtypes,
devices, levels, names) kept, is about four times faster. The bytes are
parsed back into the official message (in C) so that the official gRPC
exporter sends them with its own retries, headers, TLS, compression and
timeout. Anything this encoder does not expect falls back to the SDK's.
"""

from __future__ import annotations

import struct
from typing import Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_UINT64 = (1 << 64) - 1

# Field tags (field number << 3 | wire type), by message.
_RESOURCE_SPANS, _RESOURCE, _SCOPE_SPANS = b"\x0a", b"\x0a", b"\x12"
_SCOPE, _SPANS, _SCHEMA_URL = b"\x0a", b"\x12", b"\x1a"  # also ResourceSpans' schema_url
_NAME, _VERSION = b"\x0a", b"\x12"  # InstrumentationScope
_KEY, _VALUE = b"\x0a", b"\x12"  # KeyValue
_STRING, _ARRAY, _KVLIST = b"\x0a", b"\x2a", b"\x32"  # AnyValue
_STATUS_MESSAGE, _STATUS_CODE = b"\x12", b"\x18"
# Span
_TRACE_ID, _SPAN_ID, _TRACE_STATE, _PARENT_ID = b"\x0a\x10", b"\x12\x08", b"\x1a", b"\x22\x08"
_SPAN_NAME, _KIND, _START, _END = b"\x2a", b"\x30", b"\x39", b"\x41"
_SPAN_ATTRIBUTES, _EVENTS, _LINKS, _STATUS, _FLAGS = b"\x4a", b"\x5a", b"\x6a", b"\x7a", b"\x85\x01"
# Event and Link
_EVENT_TIME, _EVENT_NAME, _EVENT_ATTRIBUTES = b"\x09", b"\x12", b"\x1a"
_LINK_TRACE_ID, _LINK_SPAN_ID, _LINK_ATTRIBUTES, _LINK_FLAGS = b"\x0a\x10", b"\x12\x08", b"\x22", b"\x35"
# SpanFlags: whether the parent is remote is known, and whether it is.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _text(value: str) -> bytes:
    return value.encode("utf-8")


def _any_value(value) -> bytes:
    kind = type(value)
    if kind is str:
        return _field(_STRING, _text(value))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + _varint(value & _UINT64)  # int64: two's complement
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if kind is tuple or kind is list:
        return _field(_ARRAY, b"".join(_field(b"\x0a", _any_value(item)) for item in value))
    if kind is dict:
        return _field(_KVLIST, _key_values(b"\x0a", value))
    raise TypeError(f"no OTLP encoding here for a {kind.__name__} attribute")


# The encoded KeyValue of an attribute that repeats, by (tag, key, type,
# value): the type too, since 1 == True; for a flat tuple (a shape, a
# stride, dtypes) its items' types. Other values (floats, where -0.0 == 0.0;
# lists, nested tuples) are encoded each time. Emptied when full, so that
# values that never repeat (call numbers) cannot keep out those that do.
_encoded: dict = {}
_ENCODED_LIMIT = 16384
_CACHED_TYPES = (str, int, bool)
_SCALARS = frozenset(_CACHED_TYPES)


def _key_values(tag: bytes, attributes) -> bytes:
    parts = []
    for key, value in attributes.items():
        kind = type(value)
        entry = None
        if kind in _CACHED_TYPES:
            entry = (tag, key, kind, value)
        elif kind is tuple:
            types = tuple(map(type, value))
            if _SCALARS.issuperset(types):
                entry = (tag, key, types, value)
        if entry is not None:
            encoded = _encoded.get(entry)
            if encoded is None:
                encoded = _field(tag, _field(_KEY, _text(key)) + _field(_VALUE, _any_value(value)))
                if len(_encoded) >= _ENCODED_LIMIT:
                    _encoded.clear()
                _encoded[entry] = encoded
        else:
            encoded = _field(tag, _field(_KEY, _text(key)) + _field(_VALUE, _any_value(value)))
        parts.append(encoded)
    return b"".join(parts)


def _remote_flags(context) -> bytes:
    return _FIXED32(_HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0))


def _span(span) -> bytes:
    context = span.context
    parent = span.parent
    out = [_TRACE_ID + context.trace_id.to_bytes(16, "big"), _SPAN_ID + context.span_id.to_bytes(8, "big")]
    trace_state = context.trace_state
    if trace_state:
        out.append(_field(_TRACE_STATE, _text(",".join(f"{key}={value}" for key, value in trace_state.items()))))
    if parent is not None:
        out.append(_PARENT_ID + parent.span_id.to_bytes(8, "big"))
    out.append(_field(_SPAN_NAME, _text(span.name)))
    out.append(_KIND + _varint(span.kind.value + 1))  # the proto's kinds start at 1 (0: unspecified)
    out.append(_START + _FIXED64(span.start_time) + _END + _FIXED64(span.end_time))
    if span.attributes:
        out.append(_key_values(_SPAN_ATTRIBUTES, span.attributes))
    for event in span.events:
        out.append(_field(_EVENTS, _EVENT_TIME + _FIXED64(event.timestamp) + _field(_EVENT_NAME, _text(event.name))
                          + _key_values(_EVENT_ATTRIBUTES, event.attributes or {})))
    for link in span.links:
        linked = link.context
        out.append(_field(_LINKS, _LINK_TRACE_ID + linked.trace_id.to_bytes(16, "big") + _LINK_SPAN_ID
                          + linked.span_id.to_bytes(8, "big") + _key_values(_LINK_ATTRIBUTES, link.attributes or {})
                          + _LINK_FLAGS + _remote_flags(linked)))
    status = span.status
    message = _field(_STATUS_MESSAGE, _text(status.description)) if status.description else b""
    code = status.status_code.value
    out.append(_field(_STATUS, message + (_STATUS_CODE + _varint(code) if code else b"")))
    out.append(_FLAGS + _remote_flags(parent))
    return _field(_SPANS, b"".join(out))


def _scope(scope) -> bytes:
    if scope is None:
        return _field(_SCOPE, b"")
    out = _field(_NAME, _text(scope.name)) if scope.name else b""
    if scope.version:
        out += _field(_VERSION, _text(scope.version))
    if scope.attributes:
        out += _key_values(b"\x1a", scope.attributes)
    return _field(_SCOPE, out)


def encode_request(spans: Sequence) -> bytes:
    """`ExportTraceServiceRequest` bytes for ReadableSpans: grouped by
    resource, then scope, in the order first seen (by identity: the sidecar
    and replay make one object per file and per scope name, a provider one
    resource and a tracer one scope)."""
    groups: dict = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope
        group = groups.get(id(resource))
        if group is None:
            group = groups[id(resource)] = (resource, {})
        scopes = group[1]
        entry = scopes.get(id(scope))
        if entry is None:
            entry = scopes[id(scope)] = (scope, [])
        entry[1].append(_span(span))
    out = []
    for resource, scopes in groups.values():
        body = _field(_RESOURCE, _key_values(b"\x0a", resource.attributes)) if resource is not None else b""
        for scope, encoded in scopes.values():
            schema = scope.schema_url if scope is not None else None
            body += _field(_SCOPE_SPANS, _scope(scope) + b"".join(encoded)
                           + (_field(_SCHEMA_URL, _text(schema)) if schema else b""))
        if resource is not None and resource.schema_url:
            body += _field(_SCHEMA_URL, _text(resource.schema_url))
        out.append(_field(_RESOURCE_SPANS, body))
    return b"".join(out)


class DirectGrpcExporter(GrpcExporter):
    """The official OTLP/gRPC exporter, with the request encoded by
    `encode_request`; a batch it cannot encode goes through the SDK's encoder."""

    def _translate_data(self, data) -> ExportTraceServiceRequest:
        try:
            return ExportTraceServiceRequest.FromString(encode_request(data))
        except (TypeError, ValueError, AttributeError, UnicodeError, OverflowError, struct.error):
            return super()._translate_data(data)
