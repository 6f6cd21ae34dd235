"""What the export sidecar delivered from a trace file, so that `replay`
after it sends only the rest: `<trace file>.delivered`, beside the file.

    b"SOKDELIV", u32 version (1), u32 length of the identity, the identity
    (JSON: `file`, the host, pid and creation time of the trace file it
    belongs to, and `endpoint`, the back end the spans went to), then span
    ids (u64, little-endian), appended a batch at a time

A span id is added once the back end took the span and the copies made of
it (or once it was left to the application's own exporter, in kernels-only
mode). A replay to another endpoint sends everything: nothing reached that
back end (the same back end under another URL gets the spans twice). The sidecar makes a new list for each file it follows (replacing
whatever another file left at that path; an earlier run's list goes aside
with its trace file) and keeps it bounded: past twice `limit` ids it is
rewritten with the newest `limit`, more spans than the ring of the trace
file can hold. A list is read as hostile input: one that is malformed, or
belongs to another trace file, is ignored with a note, and replay then
sends everything (a span twice, never a span lost).
"""

from __future__ import annotations

import collections
import json
import os
import struct
import tempfile

from .. import files
from ..notices import warn
from .tracefile import delivered_path

MAGIC = b"SOKDELIV"
VERSION = 1
_HEAD = struct.Struct("<8sII")
_MAX_IDENTITY = 4096
MAX_BYTES = 64 << 20  # 8 million ids: far more than a ring holds spans
MIN_LIMIT = 4096


def _file(metadata: dict) -> dict:
    """What tells a trace file from every other: its host, pid and creation time."""
    return json.loads(json.dumps({key: metadata.get(key) for key in ("host", "pid", "created")}, default=str))


def _ids(span_ids) -> bytes:
    return struct.pack(f"<{len(span_ids)}Q", *span_ids)


class Ledger:
    """The list the sidecar keeps while it follows one trace file; it never
    raises: a list that cannot be written is given up with one warning (a
    later replay then sends those spans again)."""

    def __init__(self, trace_path: str, metadata: dict, endpoint: str, limit: int) -> None:
        self.path = delivered_path(trace_path)
        body = json.dumps({"file": _file(metadata), "endpoint": endpoint}).encode("ascii")
        self._head = _HEAD.pack(MAGIC, VERSION, len(body)) + body
        self.limit = max(limit, MIN_LIMIT)
        self._recent: collections.deque = collections.deque(maxlen=self.limit)
        self._written = 0  # ids in the file now
        self._fd: int | None = None
        self._rewrite_or_give_up()

    def add(self, span_ids: list[int]) -> None:
        if self._fd is None or not span_ids:
            return
        self._recent.extend(span_ids)
        if self._written + len(span_ids) > 2 * self.limit:
            self._rewrite_or_give_up()
            return
        try:
            _write_all(self._fd, _ids(span_ids))
            self._written += len(span_ids)
        except OSError as exc:
            self._give_up(exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rewrite_or_give_up(self) -> None:
        """The list made anew, under a temporary name renamed into place: a
        reader never sees half of one."""
        directory, name = os.path.split(self.path)
        try:
            fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
        except OSError as exc:
            self._give_up(exc)
            return
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, self._head + _ids(list(self._recent)))
            os.rename(temporary, self.path)
        except OSError as exc:
            os.close(fd)
            try:
                os.unlink(temporary)
            except OSError:
                pass
            self._give_up(exc)
            return
        self.close()
        self._fd, self._written = fd, len(self._recent)

    def _give_up(self, exc: OSError) -> None:
        self.close()
        warn(f"cannot keep {self.path} ({exc.strerror or exc}): a replay of the trace file will send again "
             "the spans this sidecar delivered")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_delivered(trace_path: str, metadata: dict, endpoint: str) -> tuple["set[int] | None", "str | None"]:
    """(the span ids the sidecar delivered to `endpoint` from the trace file
    at `trace_path`, whose header holds `metadata`; or None when there is no
    list for it), and a note when a list there was not taken."""
    path = delivered_path(trace_path)
    try:
        fd = files.open_regular(path)
    except FileNotFoundError:
        return None, None
    except (OSError, files.NotRegularFile) as exc:
        return None, f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc}), ignored"
    try:
        data = os.pread(fd, MAX_BYTES + 1, 0)
    except OSError as exc:
        return None, f"{path}: cannot be read ({exc.strerror or exc}), ignored"
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return None, f"{path}: larger than {MAX_BYTES} bytes, not a list the sidecar writes; ignored"
    if len(data) < _HEAD.size:
        return None, f"{path}: not a list of delivered spans, ignored"
    magic, version, length = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or length > _MAX_IDENTITY or _HEAD.size + length > len(data):
        return None, f"{path}: not a list of delivered spans (or of another version), ignored"
    try:
        theirs = json.loads(data[_HEAD.size:_HEAD.size + length].decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, f"{path}: its header is damaged, ignored"
    if not isinstance(theirs, dict) or theirs.get("file") != _file(metadata):
        return None, f"{path}: belongs to another trace file (an earlier run of the same path), ignored"
    if theirs.get("endpoint") != endpoint:
        return None, (f"the export sidecar delivered these spans to {str(theirs.get('endpoint'))[:200]}, "
                      f"not to {endpoint}: all of them are sent")
    body = data[_HEAD.size + length:]
    body = body[: len(body) - len(body) % 8]  # a write cut short by a crash: its whole ids count
    return {span_id for (span_id,) in struct.iter_unpack("<Q", body)}, None
