"""Non-finite flags on every recorded call, with no host read in its path
(SGLANG_KERNEL_API_NAN_FLAGS, issue 63).

After a recorded call returns, its floating outputs are reduced where they
lie into a slot of a ring of flags on their device: one flag a row of its
first output (up to ROW_CAP rows; a longer one is one flag), one each of
up to OTHER_CAP other outputs (describe/statistics.py `finite_rows`: two
or three kernels a tensor), no synchronisation, nothing read back. At the end
of a step (a batch's end; every COPY_EVERY calls without one; at exit) the
slots written since the last are copied without blocking into the pages
of `<trace file>.nanflags` (record/flag_file.py), mapped shared (on CUDA
registered with the driver, so the copy is a DMA into the file's pages),
then the order of the newest of them (a device scalar copied behind
them: the file's confirmation), and the device slots are reset to
"finite". The host reads a copy only once it has landed (an event polled,
never waited on), outside any recorded call, and writes the first call of
the step that made NaN/Inf into the trace file (schema.NONFINITE_FLAG)
with the requests owning its flagged rows where its batch maps rows to
requests. A crash loses at most the calls since the last step's end;
`report` reads the rest from the file (record/reader.py).

Calls captured into a CUDA graph are flagged by the graph's NaN check
(capture/graphs.py), whose captured kernels reduce each replay's flags
(their arguments' too, where asked) to one slot's worth, copied into this
ring after the replay: a replay is a slot like a call, and survives a
crash the same way. A tensor watched
outside any call (`watch`: SGLang's logits) takes a slot too. So do the
arguments of a call whose name SGLANG_KERNEL_API_NAN_FLAGS_INPUTS matches,
before it runs (a flag an argument): its flagged mark then says whether the
NaN/Inf came in through an argument (from before the call: weights, a
cache, work no recorded call covers) or out of finite ones. One device a
process (the first flagged tensor's); tensors on another are not flagged.
torch.compile tracing and CUDA graph capture never reach this (the
decorator calls straight through; a graph's calls, their arguments among
them, are its NaN check's).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import fnmatch
import itertools
import os
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from ..describe.guards import is_graph_capturing
from ..describe.statistics import finite_rows, is_device_error
from ..describe.tensors import tensors_of
from ..notices import warn_failed_once, warn_once
from ..record import batches, processor
from ..record.flag_file import (CALL, INPUTS, NONFINITE_BYTE, REPLAY, SELF_FIRST, WATCH, FlagFile, argument_name,
                                decode_replay, flagged_attributes)
from ..record.setup import on_open
from ..record.tracefile import nan_flags_path
from ..record.spans import CALL_SEQ, NAME_, add_attributes, call_context
from ..schema import (MODULE, NONFINITE, NONFINITE_CALL, NONFINITE_FLAG, NONFINITE_INPUTS_CHECKED, NONFINITE_REQUESTS,
                      NONFINITE_SPAN, REQUEST_ID)

SLOTS = 4096
ROW_CAP = 256  # rows of a first output flagged one by one
OTHER_CAP = 4  # other floating outputs flagged, one flag each
WIDTH = ROW_CAP + OTHER_CAP
SCRATCH = WIDTH - 1  # an INPUTS slot's last byte: a list argument's further tensors, ANDed into its flag
COPY_EVERY = SLOTS // 4  # calls with no step's end between them: copied anyway, long before the ring laps
_MAX_FOUND = 8  # tensors of a result looked at


class FlagRing:
    """This process's flags: the device ring, the mapped file the ring's
    slots are copied into, and what each slot holds the flags of: a
    recorded call's outputs, a CUDA graph's replay (reduced by the graph
    itself: capture/graphs.py NanCheck), or a watched tensor."""

    def __init__(self, trace_path: "str | None") -> None:
        self.trace_path = trace_path
        self.file = self._file(trace_path)
        self.device: "torch.device | None" = None
        self.made = 0  # slots taken so far: the next one is made % SLOTS, its order made + 1
        self.watched: collections.deque = collections.deque()  # `made` of each watched tensor's slot, not read
        self.copied = 0  # slots copied
        # slot -> (its kind, its call or replay, its batch, its first output's rows, rows flagged, its module
        # path or None; for a CALL the order of its INPUTS slot or None, for a REPLAY its NanCheck, for a
        # WATCH its marks' name and attributes and the span it was watched in); an INPUTS slot's: its
        # positional arguments and all of them for the two counts, its keyword names and whether its first
        # argument is the call's self last
        self.slots: list = [None] * SLOTS
        self.marked = None  # the call marked last: its arguments' slot and its outputs' never mark it twice
        self.pending: collections.deque = collections.deque()  # (event or None, first slot, end) copied, not read
        self.lost = 0  # slots whose flags were dropped unread (the ring lapped them)

    @staticmethod
    def _file(trace_path: "str | None") -> FlagFile:
        if trace_path is not None:
            path = nan_flags_path(trace_path)
            try:
                return FlagFile(path, SLOTS, WIDTH)
            except FileExistsError:
                warn_once(f"nan flags file {path}", f"{path} exists (an earlier run's, kept): the NaN flags are "
                          "kept in memory alone, and a crash loses them")
            except OSError as exc:
                warn_failed_once(f"creating {path}", exc, "; the NaN flags are kept in memory alone")
        return FlagFile(None, SLOTS, WIDTH)

    def _bind(self, device: torch.device) -> None:
        """The ring on `device`, and the host side its copies land in."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = torch.frombuffer(self.file.flags, dtype=torch.uint8).view(SLOTS, WIDTH)
        self.landed = self.file.flags  # where the host reads the copies
        self.confirmed = torch.frombuffer(self.file.header, dtype=torch.int64)[3:4]  # bytes 24..32
        self.buffer = torch.ones(SLOTS, WIDTH, dtype=torch.bool, device=device)
        self.bytes = self.buffer.view(torch.uint8)  # copied as bytes: a replay's slot holds numbers
        if self.cuda:
            self.order = torch.zeros(1, dtype=torch.int64, device=device)
            self._register()

    def _register(self) -> None:
        """The mapped pages registered with the CUDA driver: the copies are
        DMAs into the file, never a synchronous copy through pageable memory.
        Where the driver refuses, pinned buffers of our own (lost at a crash)."""
        mapping = self.file.mapping
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        try:
            status = torch.cuda.cudart().cudaHostRegister(address, len(mapping), 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister returned {status}")
        except Exception as exc:
            warn_failed_once("registering the NaN flags file with the CUDA driver", exc,
                             "; its flags are copied into pinned memory, which a crash loses")
            self.host = torch.ones(SLOTS, WIDTH, dtype=torch.uint8, pin_memory=True)
            self.landed = host_view(self.host)
            self.confirmed = torch.zeros(1, dtype=torch.int64, pin_memory=True)

    def flag(self, call: "tuple | None", seq: int, result: Any, module: "str | None", inputs: "int | None") -> None:
        """After a recorded call returned `result`: its flags queued on its
        device (`inputs`: the order of its arguments' slot, if they were)."""
        found = [tensor for tensor in tensors_of(result, _MAX_FOUND) if tensor.is_floating_point() and tensor.numel()]
        if found and self._device_of(found[0]):
            self._rows(found, seq, CALL, call, module, inputs)

    def inputs(self, call: "tuple | None", seq: int, values: tuple, keywords: tuple, skip: int,
               module: "str | None") -> "int | None":
        """Before a recorded call runs with `values` (its positional arguments,
        then the keyword ones named `keywords`; the first `skip` its self):
        a flag each of its arguments (`arguments_of`: one for all the
        tensors of one) into the next slot. Its order, for its outputs'."""
        found, positional, count, self_first = arguments_of(values, keywords, skip, SCRATCH)
        if not found or not self._device_of(found[0][1][0]):
            return None
        slot = self.made % SLOTS
        for position, tensors in found:
            tensors = [tensor for tensor in tensors if tensor.device == self.device]
            if tensors:
                finite_rows(tensors[0], 1, self.buffer, slot, position)
            for tensor in tensors[1:]:
                finite_rows(tensor, 1, self.buffer, slot, SCRATCH)
                self.buffer[slot, position:position + 1].logical_and_(self.buffer[slot, SCRATCH:])
        self._taken(slot, seq, positional, count, INPUTS,
                    (INPUTS, call, batches.current(), positional, count, module, (keywords, self_first)),
                    SELF_FIRST if self_first else 0)
        return self.made

    def watch(self, tensor: torch.Tensor, name: str, marks: dict) -> None:
        """`tensor`'s rows flagged outside any recorded call (SGLang's logits
        before sampling): where they hold NaN/Inf, the requests owning them
        get a mark `name` with `marks`, whatever call came first."""
        if tensor.is_floating_point() and tensor.numel() and self._device_of(tensor):
            self._rows([tensor], 0, WATCH, None, None, (name, marks, trace.get_current_span().get_span_context()))
            self.watched.append(self.made - 1)

    def replayed(self, check: Any, call: tuple) -> None:
        """After a CUDA graph's replay (`call`): the summary its captured
        reductions wrote (`check.summary`, a slot's bytes) copied into the
        next slot, on the device: one copy, nothing read."""
        if not self._device_of(check.summary):
            return
        slot = self.made % SLOTS
        self.bytes[slot].copy_(check.summary)
        self._taken(slot, call[CALL_SEQ], 0, 0, REPLAY, (REPLAY, call, batches.current(), 0, 0, None, check))

    def _device_of(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the ring's device (the first one seen, which binds it)."""
        if self.device is None:
            self._bind(tensor.device)
        return tensor.device == self.device

    def _rows(self, found: list, seq: int, kind: int, call: "tuple | None", module: "str | None", extra) -> None:
        """`found`'s flags into the next slot: a row each of the first (up
        to ROW_CAP rows), one each of up to OTHER_CAP others."""
        first = found[0]
        slot = self.made % SLOTS
        leading = first.shape[0] if first.dim() else 0
        rows = leading if 0 < leading <= ROW_CAP else 1
        others = [tensor for tensor in found[1:1 + OTHER_CAP] if tensor.device == self.device]
        finite_rows(first, rows, self.buffer, slot, 0)
        for index, tensor in enumerate(others):
            finite_rows(tensor, 1, self.buffer, slot, rows + index)
        self._taken(slot, seq, rows, len(others), kind, (kind, call, batches.current(), leading, rows, module, extra))

    def _taken(self, slot: int, seq: int, rows: int, others: int, kind: int, entry: tuple, marks: int = 0) -> None:
        self.made += 1
        self.file.set_index(slot, seq, self.made, rows, others, kind, marks)
        self.slots[slot] = entry
        if self.made - self.copied >= COPY_EVERY:
            self.copy()

    def copy(self) -> None:
        """The slots written since the last copy, copied into the file without
        blocking, then reset; the newest one's order behind them."""
        start, end = self.copied, self.made
        if start == end:
            return
        for low, high in _ranges(start, end):
            self.host[low:high].copy_(self.bytes[low:high], non_blocking=self.cuda)
            self.buffer[low:high].fill_(True)
        if self.cuda:
            self.order.fill_(end)
            self.confirmed.copy_(self.order, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            self.file.confirm(end)
            event = None
        self.pending.append((event, start, end))
        self.copied = end

    def read(self, wait: bool = False) -> None:
        """The copies that have landed (all of them with `wait`, at exit):
        the first flagged call or replay of each, written into the trace
        file; each watched tensor's flagged rows, marked."""
        while self.pending:
            event, start, end = self.pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self.pending.popleft()
            watched = []
            while self.watched and self.watched[0] < end:
                watched.append(self.watched.popleft())
            if self.made - start > SLOTS:  # its slots hold later ones now
                self.lost += end - start
                continue
            self._first_flagged(start, end)
            for made in watched:
                self._annotate(made % SLOTS, end)

    def _first_flagged(self, start: int, end: int) -> None:
        """The first call or replay of `start..end` whose flags say NaN/Inf, marked (watched tensors' aside)."""
        for low, high in _ranges(start, end):
            cells = bytes(self.landed[low * WIDTH: high * WIDTH])  # host memory: no tensor is read
            at = cells.find(NONFINITE_BYTE)
            while at >= 0:
                slot = low + at // WIDTH
                if self.slots[slot][0] != WATCH and self._annotate(slot, end):
                    return
                at = cells.find(NONFINITE_BYTE, (slot - low + 1) * WIDTH)

    def _cells(self, slot: int) -> bytes:
        return bytes(self.landed[slot * WIDTH: (slot + 1) * WIDTH])  # host memory: no tensor is read

    def _annotate(self, slot: int, end: int) -> bool:
        """The flagged slot's call, replay or watched tensor marked (`end`:
        the order of the newest slot landed); False: nothing flagged there."""
        kind, call, batch, leading, rows, module, extra = self.slots[slot]
        cells = self._cells(slot)
        if kind == REPLAY:
            replay = decode_replay(cells)
            if replay is None:
                return False
            extra.flagged(call, batch, replay)
            return True
        if kind == INPUTS:
            fed = _fed(self.slots[slot], cells)
            if not fed:
                return False
            outputs = self._outputs_of(slot, end)
            if outputs is not None:  # its outputs' slot has landed too: their rows
                _, _, _, leading, rows, module, _ = self.slots[outputs]
                cells = self._cells(outputs)
        elif NONFINITE_BYTE not in cells:
            return False
        else:
            fed, outputs = self._inputs_of(extra) if kind == CALL else None, slot
        bad = [row for row in range(rows) if cells[row] == NONFINITE_BYTE] \
            if outputs is not None and rows == leading else []
        if kind == WATCH:
            _watched(*extra, batch, leading, bad)
        elif call is not None and call is not self.marked:  # not marked already by its other slot
            self.marked = call
            flagged(call, call[NAME_], module, batch, leading, bad, fed=fed,
                    output=outputs is not None and NONFINITE_BYTE in cells)
        return True

    def _inputs_of(self, order: "int | None") -> "tuple | None":
        """The arguments a CALL slot's INPUTS slot (taken `order`th) flagged, by
        name; None where there is none, or the ring has lapped it."""
        if order is None or self.made - order >= SLOTS:
            return None
        slot = (order - 1) % SLOTS
        return _fed(self.slots[slot], self._cells(slot))

    def _outputs_of(self, slot: int, end: int) -> "int | None":
        """The CALL slot of the call whose INPUTS slot is `slot`, where it has landed (`end`)."""
        order = self.made - (self.made - 1 - slot) % SLOTS
        for later in range(order + 1, min(end, order + SLOTS) + 1):
            entry = self.slots[(later - 1) % SLOTS]
            if entry[0] == CALL and entry[6] == order:
                return (later - 1) % SLOTS
        return None


def arguments_of(values: tuple, keywords: tuple, skip: int, cap: int) -> "tuple[list, int, int, bool]":
    """What of a call's arguments (`values`: positional then keyword ones,
    named `keywords`; the first `skip` its self) is flagged, up to `cap` of
    them: (position, its floating tensors) of each that has some (a tensor;
    a list, tuple or dict of them; a module, its own parameters and buffers:
    a weight is an input too, its self's where it is a module's method),
    how many of the `count` flagged are positional, whether the first is
    its self."""
    self_first = bool(skip) and isinstance(values[0], torch.nn.Module)
    arguments = values[skip - self_first:skip - self_first + cap]
    found = []
    for position, value in enumerate(arguments):
        group = (value,) if isinstance(value, torch.Tensor) else \
            value[:_MAX_FOUND] if isinstance(value, (list, tuple)) else \
            tuple(itertools.islice(value.values(), _MAX_FOUND)) if isinstance(value, dict) else \
            tuple(itertools.islice(itertools.chain(value._parameters.values(), value._buffers.values()),
                                   _MAX_FOUND)) if isinstance(value, torch.nn.Module) else ()
        tensors = [tensor for tensor in group
                   if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel()]
        if tensors:
            found.append((position, tensors))
    positional = min(max(len(values) - len(keywords) - skip + self_first, 0), len(arguments))
    return found, positional, len(arguments), self_first


def _fed(entry: tuple, cells: bytes) -> tuple:
    """The names of the arguments an INPUTS slot (`entry`, its `cells`) flagged non-finite."""
    _, _, _, positional, count, _, (keywords, self_first) = entry
    return tuple(argument_name(at, positional, self_first, keywords) for at in range(count)
                 if cells[at] == NONFINITE_BYTE)


def flagged(call: tuple, name: str, module: "str | None", batch: "batches.Batch | None", leading: int,
            bad_rows: list, fed: "tuple | None" = None, output: bool = True, **more) -> None:
    """The first call of a step whose flags said NaN/Inf (`name`: the call,
    or the captured call of a graph's replay; `module`: its module path,
    where it is known), found after it ended: marked
    in the trace file (`nonfinite_flag`, `more`), with the requests owning
    `bad_rows` of its first output's `leading` where its batch maps rows to
    requests; and where back ends see it, since exporters have sent its
    span: a NONFINITE_SPAN under it, and one under each request of its
    batch that those rows belong to (all of them where the rows map to
    none), tagged `nonfinite_flag` as a span with NaN is tagged `has_nan`.
    `fed`: where its arguments were flagged too, those that held NaN/Inf
    (`input.arg1`; empty: it made NaN/Inf out of finite ones), named in its
    `nonfinite` beside "output" (`output`: whether its outputs' flags said
    so), as level 5 names them."""
    attributes: dict = {**more, **flagged_attributes(fed, output)}
    owners = batch.owners(leading, bad_rows) if batch is not None and bad_rows else None
    if owners is not None:
        attributes[NONFINITE_REQUESTS] = tuple(owners)[: batches.MAX_NONFINITE_REQUESTS]
    add_attributes(call, attributes)
    marked = {NONFINITE_FLAG: True, NONFINITE_CALL: name}
    if module:  # the layer, on the mark and so on the alert (live/metrics.py)
        marked[MODULE] = module
    if owners is not None:
        marked[NONFINITE_REQUESTS] = attributes[NONFINITE_REQUESTS]
    if fed is not None:  # in back ends too: whether it came in or started here
        marked[NONFINITE], marked[NONFINITE_INPUTS_CHECKED] = attributes[NONFINITE], True
    parents = [(call_context(call), None)]
    if batch is not None:
        chosen = None if owners is None else set(owners)
        parents += [(context, request) for context, request in batch.requests
                    if chosen is None or request in chosen]
    _mark(parents, marked)


def _watched(name: str, marks: dict, context: SpanContext, batch: "batches.Batch | None", leading: int,
             bad_rows: list) -> None:
    """A watched tensor (FlagRing.watch) held NaN/Inf: a mark `name` with
    `marks` in the trace of each request owning its flagged rows (all of
    its batch's where the rows map to none): under the request's own span
    in a batch of several, else under the span it was watched in (a batch
    of one traced request: in that request's trace)."""
    if batch is None:
        return
    owners = batch.owners(leading, bad_rows) if bad_rows else None
    chosen = set(batch.names if owners is None else owners)
    if batch.requests:
        parents = [(span, request) for span, request in batch.requests if request in chosen]
    else:
        parents = [(context, request) for request in batch.names if request in chosen] if context.is_valid else []
    _mark(parents[:batches.MAX_NONFINITE_REQUESTS], {**marks, NONFINITE_FLAG: True, NONFINITE_CALL: name})


def _mark(parents: list, marked: dict) -> None:
    """A NONFINITE_SPAN with `marked` under each (span context, request id or None) of `parents`."""
    tracer = _tracer[0]() if _tracer else None
    if tracer is None:
        return
    for context, request in parents:
        tracer.start_span(NONFINITE_SPAN, context=trace.set_span_in_context(trace.NonRecordingSpan(context)),
                          attributes=marked if request is None else {**marked, REQUEST_ID: request}).end()


_tracer: list = []  # the kernel tracer's getter (capture/decorator.py gives it: it imports this module)


def use_tracer(getter) -> None:
    _tracer[:] = [getter]


def _ranges(start: int, end: int) -> list:
    """The slots of calls start..end-1, as contiguous ranges in call order."""
    low, high = start % SLOTS, (end - 1) % SLOTS + 1
    if end - start >= SLOTS:
        return [(low, SLOTS), (0, low)] if low else [(0, SLOTS)]
    return [(low, high)] if low < high else [(low, SLOTS), (0, high)]


def host_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, read without a tensor method
    (what a copy into it has landed; `tolist` and the like would count as
    reading a value in a recorded call)."""
    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


_ring: "FlagRing | None" = None


def _the_ring() -> FlagRing:
    """The ring of the trace file this process writes now, made at its first use."""
    global _ring
    if _ring is None:
        _ring = FlagRing(processor.trace_file_path())
    return _ring


def flag(call: "tuple | None", seq: int, result: Any, extra: "dict | None", inputs: "int | None" = None) -> None:
    """A recorded call's outputs flagged (the decorator's, after it returned,
    with SGLANG_KERNEL_API_NAN_FLAGS on; `extra`: the call's own attributes,
    its module path among them where known; `inputs`: what `flag_inputs`
    gave it): into the ring of the trace file this process writes now."""
    try:
        _the_ring().flag(call, seq, result, extra.get(MODULE) if extra else None, inputs)
    except Exception as exc:
        warn_failed_once("queueing a kernel call's NaN flags", exc, "; the call goes on unflagged")


def flag_native(call: Any, seq: int, result: Any, wrapper: Any, inputs: "int | None") -> None:
    """`flag`, as the compiled core calls it after a call it recorded
    returned (`wrapper`: the call's Python wrapper, which keeps the site's
    own attributes)."""
    flag(call, seq, result, getattr(wrapper, "_kernel_attributes", None), inputs)


_input_patterns: tuple = ()
_inputs_wanted: dict = {}  # kernel name -> whether its arguments are flagged


def ask_inputs(patterns: tuple) -> None:
    """The kernel names whose calls' arguments are flagged too (SGLANG_KERNEL_API_NAN_FLAGS_INPUTS)."""
    global _input_patterns
    if patterns != _input_patterns:
        _input_patterns = patterns
        _inputs_wanted.clear()


def inputs_wanted(name: str) -> bool:
    """Whether SGLANG_KERNEL_API_NAN_FLAGS_INPUTS names the kernel `name` (its patterns matched once a name)."""
    wanted = _inputs_wanted.get(name)
    if wanted is None:
        wanted = _inputs_wanted[name] = any(fnmatch.fnmatchcase(name, pattern) for pattern in _input_patterns)
    return wanted


def flag_inputs(call: "tuple | None", seq: int, values: tuple, keywords: tuple, skip: int,
                extra: "dict | None") -> "int | None":
    """Before a recorded call runs whose name SGLANG_KERNEL_API_NAN_FLAGS_INPUTS
    names (`inputs_wanted`, which its caller asked): its arguments flagged
    (FlagRing.inputs); what its outputs' `flag` is given."""
    try:
        return _the_ring().inputs(call, seq, values, keywords, skip, extra.get(MODULE) if extra else None)
    except Exception as exc:
        warn_failed_once("queueing a kernel call's inputs' NaN flags", exc, "; the call goes on, its inputs unflagged")
        return None


def flag_inputs_native(call: Any, seq: int, values: tuple, keywords: "tuple | None", wrapper: Any) -> "int | None":
    """`flag_inputs`, as the compiled core calls it before a call it records
    runs where `inputs_wanted` said so (`values`: its positional then keyword arguments)."""
    site = wrapper._kernel_site
    return flag_inputs(call, seq, values, keywords or (), 1 if site.skip_self and len(values) > len(keywords or ())
                       else 0, getattr(wrapper, "_kernel_attributes", None))


def replayed(check: Any, call: tuple) -> "Exception | None":
    """After a CUDA graph's replay `call` with the NaN check on (`check`,
    capture/graphs.py NanCheck): its summary into the ring; with no batch
    open (no step's end to wait for), copied and read at once, as far as
    the copies have landed. A device error met meanwhile (an earlier
    replay's kernels') is returned, for the replay's span."""
    try:
        ring = _the_ring()
        ring.replayed(check, call)
        if batches.current() is None:
            ring.copy()
            ring.read()
    except Exception as exc:
        if is_device_error(exc):
            return exc
        warn_failed_once("queueing a CUDA graph replay's NaN flags", exc, "; the replay goes on unflagged")
    return None


def watch(tensor: torch.Tensor, name: str, marks: dict) -> None:
    """`tensor`'s rows flagged now, outside any recorded call (FlagRing.watch);
    nothing while a CUDA graph is captured (it would be captured, not made)."""
    if is_graph_capturing("cuda"):
        return
    try:
        _the_ring().watch(tensor, name, marks)
    except Exception as exc:
        warn_failed_once(f"queueing the NaN flags of {name}", exc, "; it goes on unflagged")


def step_ended(wait: bool = False) -> None:
    """The end of a step (a batch): the step's flags copied, those landed
    read; with `wait` (at exit, before a new file), every copy read.
    Nothing while a CUDA graph is captured (a batch around a capture): a
    copy made then would be captured, not made."""
    if is_graph_capturing("cuda"):
        return
    ring = _ring
    if ring is not None:
        try:
            ring.copy()
            ring.read(wait)
        except Exception as exc:
            warn_failed_once("copying and reading the NaN flags", exc)


def _trace_file_opened(path: str) -> None:
    """A new trace file (configured anew, a forked child's): the ring of the
    one before read and let go; the next flagged call makes one beside it."""
    global _ring
    if _ring is not None and _ring.trace_path != path:
        step_ended(wait=True)
        _ring = None


def _after_fork_in_child() -> None:
    global _ring
    _ring = None  # the parent's file and device ring are the parent's


on_open(_trace_file_opened)
atexit.register(step_ended, True)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
