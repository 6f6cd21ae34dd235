"""Spans as an OTLP `ExportTraceServiceRequest`, written as protobuf bytes
here for OTLP/gRPC export: by the sidecar, `replay`, and in-process.

The SDK's encoder builds a message object for every attribute of every span,
which made it 60% of the sidecar's time (and, in-process, interpreter time
taken from the kernels); writing the wire format directly,
with the encoded form of an attribute that repeats (a kernel's dtypes,
devices, levels, names) kept, is about four times faster. The official gRPC
exporter sends the bytes as they are (its client is given a stub that takes
them), with its own retries, headers, TLS, compression and timeout. A span
holding what this encoder does not expect is encoded by the SDK's.
"""

from __future__ import annotations

import struct
from typing import Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from .core import native

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


_ONE_BYTE = tuple(bytes((value,)) for value in range(0x80))


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:  # lengths of attributes and spans: without the loop
        return bytes(((value & 0x7F) | 0x80, value >> 7))
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


def attribute_map(attributes) -> bytes:
    """A span's attributes, encoded (those that repeat, from the kept encodings)."""
    return _key_values(_SPAN_ATTRIBUTES, attributes)


def _remote_flags(context) -> bytes:
    return remote_flags(context is not None and context.is_remote)


def remote_flags(is_remote: bool) -> bytes:
    """A span's or link's flags value: whether its parent (or the linked
    span) is remote is known, and whether it is."""
    return _FIXED32(_HAS_IS_REMOTE | (_IS_REMOTE if is_remote else 0))


def span_flags(parent_remote: bool) -> bytes:
    """A span's encoded flags field."""
    return _FLAGS + remote_flags(parent_remote)


_NAME_KIND: dict = {}  # the encoded (name, kind) of a span, by both; bounded
_STATUSES: dict = {}  # the encoded status without a description, by code


def name_and_kind(name: str, kind: int) -> bytes:
    """The encoded name and kind (OpenTelemetry's SpanKind value) of a span."""
    encoded = _NAME_KIND.get((name, kind))
    if encoded is None:
        # The proto's kinds start at 1 (0: unspecified).
        encoded = _field(_SPAN_NAME, _text(name)) + _KIND + _varint(kind + 1)
        if len(_NAME_KIND) >= _ENCODED_LIMIT:
            _NAME_KIND.clear()
        _NAME_KIND[(name, kind)] = encoded
    return encoded


def status(code: int, description: "str | None") -> bytes:
    """The encoded status: its code (0 unset, 1 ok, 2 error) and description
    (an error's message, encoded each time: messages are many and may be long)."""
    encoded = None if description else _STATUSES.get(code)
    if encoded is None:
        message = _field(_STATUS_MESSAGE, _text(description)) if description else b""
        encoded = _field(_STATUS, message + (_STATUS_CODE + _varint(code) if code else b""))
        if not description and len(_STATUSES) < 16:
            _STATUSES[code] = encoded
    return encoded


_IDS = struct.Struct(">2sQQ2sQ")  # the tags of the trace id and span id, and the ids
_PARENT = struct.Struct(">2sQ").pack
_TIMES = struct.Struct("<cQcQ")
_IDS_SIZE, _TIMES_SIZE, _IDS, _TIMES = _IDS.size, _TIMES.size, _IDS.pack, _TIMES.pack


def span_bytes(trace_id: int, span_id: int, rest: bytes, start: int, end: int, *tail: bytes) -> bytes:
    """One encoded Span of the request: its ids, then `rest` (its trace
    state where it has one, its parent, its name and kind), its times, then
    the `tail` of parts after them: its encoded attributes, events and links,
    status and flags."""
    # One copy of the parts, the span's length computed: this runs once per span the sidecar sends.
    return b"".join((_SPANS, _varint(_IDS_SIZE + _TIMES_SIZE + len(rest) + sum(map(len, tail))),
                     _IDS(_TRACE_ID, trace_id >> 64, trace_id & _UINT64, _SPAN_ID, span_id), rest,
                     _TIMES(_START, start, _END, end), *tail))


def parent_field(parent_id: int) -> bytes:
    """A span's encoded parent span id."""
    return _PARENT(_PARENT_ID, parent_id)


def counter_key(key: str) -> bytes:
    """The encoded key of an int64 span attribute whose values never repeat
    (call numbers), for `counter_span`."""
    return _field(_KEY, _text(key))


def python_counter_span(trace_id: int, span_id: int, parent_id: int, name_and_kind: bytes, start: int, end: int,
                        head: bytes, key: bytes, counter: int, tail: bytes) -> bytes:
    """`span_bytes` of a span whose parent (0: none), name and kind come
    encoded, and whose attributes are `head`, then the int64 `counter` under
    the encoded `key` (`counter_key`), then `tail`: a plain kernel call as
    the sidecar sends it (live/wire.py). The compiled core's
    `counter_span` gives the same bytes, faster."""
    number = _varint(counter & _UINT64)
    pair = key + _VALUE + _ONE_BYTE[1 + len(number)] + b"\x18" + number
    return span_bytes(trace_id, span_id, parent_field(parent_id) + name_and_kind if parent_id else name_and_kind,
                      start, end, head, _SPAN_ATTRIBUTES + _varint(len(pair)) + pair, tail)


counter_span = native.counter_span if native is not None else python_counter_span


def _span(span) -> bytes:
    context = span.context
    parent = span.parent
    rest = b""
    trace_state = context.trace_state
    if trace_state:
        rest = _field(_TRACE_STATE, _text(",".join(f"{key}={value}" for key, value in trace_state.items())))
    if parent is not None:
        rest += parent_field(parent.span_id)
    out = [_key_values(_SPAN_ATTRIBUTES, span.attributes) if span.attributes else b""]
    for event in span.events:
        out.append(_field(_EVENTS, _EVENT_TIME + _FIXED64(event.timestamp) + _field(_EVENT_NAME, _text(event.name))
                          + _key_values(_EVENT_ATTRIBUTES, event.attributes or {})))
    for link in span.links:
        linked = link.context
        out.append(_field(_LINKS, _LINK_TRACE_ID + linked.trace_id.to_bytes(16, "big") + _LINK_SPAN_ID
                          + linked.span_id.to_bytes(8, "big") + _key_values(_LINK_ATTRIBUTES, link.attributes or {})
                          + _LINK_FLAGS + _remote_flags(linked)))
    state = span.status
    return span_bytes(context.trace_id, context.span_id, rest + name_and_kind(span.name, span.kind.value),
                      span.start_time, span.end_time, b"".join(out),
                      status(state.status_code.value, state.description)
                      + span_flags(parent is not None and parent.is_remote))


def _scope(scope) -> bytes:
    if scope is None:
        return _field(_SCOPE, b"")
    out = _field(_NAME, _text(scope.name)) if scope.name else b""
    if scope.version:
        out += _field(_VERSION, _text(scope.version))
    if scope.attributes:
        out += _key_values(b"\x1a", scope.attributes)
    return _field(_SCOPE, out)


class EncodedSpan:
    """A span in OTLP's wire form already (`span_bytes`), with the resource
    and scope it goes under: how the sidecar hands over a plain kernel call
    without building the SDK's objects for it (live/wire.py)."""

    __slots__ = ("resource", "instrumentation_scope", "encoded")

    def __init__(self, resource, instrumentation_scope, encoded: bytes) -> None:
        self.resource = resource
        self.instrumentation_scope = instrumentation_scope
        self.encoded = encoded


_ENCODING_ERRORS = (TypeError, ValueError, AttributeError, UnicodeError, OverflowError, struct.error)


def _span_or_sdks(span) -> bytes:
    """A span encoded here, or by the SDK's encoder where this one does not
    expect what it holds (that span alone)."""
    if type(span) is EncodedSpan:
        return span.encoded
    try:
        return _span(span)
    except _ENCODING_ERRORS:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # rarely needed

        request = encode_spans([span])
        return _field(_SPANS, request.resource_spans[0].scope_spans[0].spans[0].SerializeToString())


def encode_request(spans: Sequence) -> bytes:
    """`ExportTraceServiceRequest` bytes for ReadableSpans (and EncodedSpans):
    grouped by resource, then scope, in the order first seen (by identity:
    the sidecar and replay make one object per file and per scope name, a
    provider one resource and a tracer one scope)."""
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
        entry[1].append(_span_or_sdks(span))
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


_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _serialized(request) -> bytes:
    return request if type(request) is bytes else request.SerializeToString()


class _WireStub:
    """The trace service's client, taking a request already serialized (or
    a message): what `encode_request` writes goes out as it is, unparsed."""

    def __init__(self, channel) -> None:
        self.Export = channel.unary_unary(  # noqa: N815 - the gRPC method's name
            _EXPORT, request_serializer=_serialized, response_deserializer=ExportTraceServiceResponse.FromString)


class DirectGrpcExporter(GrpcExporter):
    """The official OTLP/gRPC exporter (its retries, headers, TLS,
    compression and timeout), sending the request `encode_request` wrote.
    It takes EncodedSpans beside ReadableSpans (`takes_encoded`)."""

    takes_encoded = True
    _stub = _WireStub  # the stub OpenTelemetry up to 1.3x makes its client with

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_stub", None) is not _WireStub:  # later versions take the stub as an argument
            self._stub = _WireStub
            self._client = _WireStub(self._channel)

    def _translate_data(self, data) -> bytes:
        return encode_request(data)
