"""A trace file's plain kernel calls straight into OTLP's wire form, for the
sidecar (live/follow.py): the bulk of what it exports, at level 3 and
above, is kernel calls that ended well, each made of the same few parts as
the calls of its site before it. Their attributes are encoded once per
distinct reading of their records; record/otlp_encode.py's `counter_span`
(compiled where the recording core is) then joins ids, times, the call
number and those bytes, with no RecoveredSpan, ReadableSpan or
per-attribute work; every other span takes the general path (reader ->
`readable` -> encoder), which gives the same bytes.
"""

from __future__ import annotations

from ..record.otlp_encode import EncodedSpan, attribute_map, counter_key, counter_span, name_and_kind, span_flags
from ..record.otlp_encode import status as status_field
from ..schema import (BLACKBOX, COPY_OF, HAS_INF, HAS_NAN, HUNG, IN_FLIGHT, LEVEL, NAME, NONFINITE, SEQ, THREAD_ID,
                      THREAD_NAME)
from ..record.tracefile import CALL_END
from ..record.reader import COMPACT_END_RECORD, KERNEL_SCOPE, SPAN_START_RECORD, Assembler, symbol_name
from ..recover.resend import instrumentation_scope

# Keys a plain call's attribute readings never hold: those made apart from
# them (and so placed apart), and those that send a call down the general path
# (NaN/Inf flags: it may be copied into request traces).
_APART = frozenset((NAME, LEVEL, SEQ, BLACKBOX, THREAD_ID, THREAD_NAME, HAS_NAN, HAS_INF, NONFINITE, IN_FLIGHT, HUNG,
                    COPY_OF))
_LIMIT = 4096
_ERROR = 2
_EXTRA, _FIELDS = 14, 15  # where a kernel call's start record holds its attribute reading; its length
_NONE_ADDED: dict = {}  # what a COMPACT_END adds
_SEQ_KEY = counter_key(SEQ)


class KernelWire:
    """Takes the (start, end) records of a kernel call that ended and, when
    it is plain, queues it encoded: a kernel span (not a CUDA graph's replay,
    nothing added while it ran), ended without error, events or a
    description, none of its attributes among `_APART`, its start's and end's
    attributes apart; what the export sampler does not keep is not sent. It
    is counted for the metrics as `KernelMetrics.count` would, sent or not."""

    def __init__(self, assembler: Assembler, resource, sampler, queue, counted) -> None:
        self.assembler = assembler
        self.resource = resource  # follow sets a new one when the process's ranks become known
        self._scope = instrumentation_scope(*KERNEL_SCOPE)  # the object `readable` gives its spans
        self._sampler = sampler
        self._queue = queue  # (encoded span, the span id it delivers)
        self._counted = counted
        # What the calls of one site, thread and outcome share, by `_shape`'s key; bounded, emptied when full.
        self._shapes: dict[tuple, tuple] = {}

    def take(self, start: tuple, end: tuple) -> bool:
        if start[0] is not SPAN_START_RECORD or len(start) != _FIELDS or start[_EXTRA] is None:
            return False
        if end[0] is COMPACT_END_RECORD:
            added = _NONE_ADDED
        elif end[0] == CALL_END and not end[4] and not end[5]:
            added = end[6]
        else:
            return False
        status = end[3]
        if status == _ERROR:
            return False
        (_, trace_id, span_id, parent_id, number, kind, start_time, thread, _, attributes, _, _, remote,
         parent_sampled, extra) = start
        remote = bool(parent_id) and remote
        name = symbol_name(self.assembler.symbols, number)
        key = (id(extra), id(added), name, kind, attributes[LEVEL], attributes.get(BLACKBOX), thread,
               self.assembler.threads.get(thread), status, remote)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= _LIMIT:
                self._shapes.clear()
            shape = self._shapes[key] = self._shape(extra, added, key)
        if shape[2] is None:
            return False
        if self._counted is not None:  # a call that ended, sampled out or not
            self._counted.call(name, False, False)
        if not self._sampler.keep_ids(trace_id, name, remote, parent_sampled):
            return True  # sampled out: nothing to send, as the general path would decide
        _, _, name_kind, head, tail = shape
        self._queue(EncodedSpan(self.resource, self._scope, counter_span(
            trace_id, span_id, parent_id, name_kind, start_time, end[2], head, _SEQ_KEY, attributes[SEQ], tail)),
            span_id)
        return True

    @staticmethod
    def _shape(extra: dict, added: dict, key: tuple) -> tuple:
        """(the start's reading, the end's, then the encoded name and kind,
        the attributes before the call number and those after it, with the
        status and flags; None for those three when the readings are not
        plain). Readings are dicts the reader never changes and shares
        between the records that hold them: kept here, so that their ids are
        not another's."""
        _, _, name, kind, level, blackbox, thread, thread_name, status, remote = key
        if not (_APART.isdisjoint(extra) and _APART.isdisjoint(added) and extra.keys().isdisjoint(added)):
            return extra, added, None, None, None
        threads = {THREAD_ID: thread, THREAD_NAME: thread_name} if thread_name else {THREAD_ID: thread}
        tail = attribute_map({BLACKBOX: blackbox}) if blackbox is not None else b""
        tail += attribute_map(extra) + attribute_map(added) + attribute_map(threads)
        return (extra, added, name_and_kind(name, kind), attribute_map({NAME: name, LEVEL: level}),
                tail + status_field(status, None) + span_flags(remote))
