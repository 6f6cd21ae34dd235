"""SGLang's kernel API text log: the same lines, written cheaply.

Each side of a call (before: header and inputs; after: output or exception)
is rendered to one string and handed to the OS in one write, so the lines
written before a kernel runs are out of the process even if it dies inside
the kernel, and lines of concurrent calls never interleave.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable

from ..config import OFF
from ..notices import warn
from ..descriptions import Elided, Mapping, Opaque, Scalar, Sequence, TensorInfo, safe_str

SEPARATOR = "=" * 80
_ITEM_INDENT = " " * 6
_ENTRY_INDENT = " " * 4


# The metadata lines of a tensor, by (shape, dtype, device, requires_grad,
# contiguous, indent): a decode step logs the same few shapes over and over,
# and a lookup costs a third of formatting them. Bounded: new shapes past the
# bound are formatted each time.
_meta_texts: dict = {}
_META_TEXTS_LIMIT = 1024


def _tensor_text(info: TensorInfo, with_stats: bool, indent: str) -> str:
    key = (info.shape, info.dtype, info.device, info.requires_grad, info.contiguous, indent)
    try:
        text = _meta_texts.get(key)
    except TypeError:  # a shape of symbolic sizes, which do not hash
        text = key = None
    if text is None:
        text = (f"Tensor(\n{indent}  shape={info.shape}\n{indent}  dtype={info.dtype}\n{indent}  device={info.device}"
                f"\n{indent}  requires_grad={info.requires_grad}\n{indent}  is_contiguous={info.contiguous}")
        if key is not None and len(_meta_texts) < _META_TEXTS_LIMIT:
            _meta_texts[key] = text
    if with_stats:
        if info.stats is not None:
            low, high, mean, nans, infs = info.stats
            text += (f"\n{indent}  min={low:.6f}\n{indent}  max={high:.6f}\n{indent}  mean={mean:.6f}"
                     f"\n{indent}  nan_count={nans}\n{indent}  inf_count={infs}")
        elif info.stats_note is not None:
            text += f"\n{indent}  statistics=[{info.stats_note}]"
    return text + f"\n{indent})"


def node_text(node, with_stats: bool, indent: str = "") -> str:
    """A described value as SGLang renders it: its lines joined, every line
    after the first prefixed by `indent` (where the value sits in the log).
    One string built at once, not lines re-indented at each nesting level."""
    if isinstance(node, TensorInfo):
        return _tensor_text(node, with_stats, indent)
    if isinstance(node, Scalar):
        return node.text
    inner = indent + _ITEM_INDENT
    if isinstance(node, Sequence):
        text = "[" if node.is_list else "("
        for index, item in enumerate(node.items):
            text += f"\n{indent}  [{index}] {node_text(item, with_stats, inner)}"
        if node.more > 0:
            text += f"\n{indent}  ... ({node.more} more items)"
        return text + f"\n{indent}{']' if node.is_list else ')'}"
    if isinstance(node, Mapping):
        text = "{"
        for key_repr, _, item in node.items:
            text += f"\n{indent}  {key_repr}: {node_text(item, with_stats, inner)}"
        if node.more > 0:
            text += f"\n{indent}  ... ({node.more} more items)"
        return text + f"\n{indent}}}"
    if isinstance(node, Elided):
        return f"{node.type_name}(...)"
    if isinstance(node, Opaque):
        text = f"{node.type_name}("
        for name, value in node.fields:
            text += f"\n{indent}  {name}={value}"
        if node.repr is not None:
            text += f"\n{indent}  repr={node.repr}"
        return text + f"\n{indent})"
    raise TypeError(f"not a description node: {type(node).__name__}")


def section_lines(title: str, entries: Iterable[tuple[str, object]], with_stats: bool) -> list[str]:
    """The title, then one text per entry (each of one or more lines)."""
    return [title] + [f"  {name}={node_text(node, with_stats, _ENTRY_INDENT)}" for name, node in entries]


_stamp_second = -1
_stamp_text = ""


def timestamp() -> str:
    """`[YYYY-MM-DD HH:MM:SS]` in local time, formatted once per second."""
    global _stamp_second, _stamp_text
    now = int(time.time())
    if now != _stamp_second:
        _stamp_text = time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime(now))
        _stamp_second = now
    return _stamp_text


def call_header(name: str) -> list[str]:
    return [SEPARATOR, f"{timestamp()} SGLang Kernel API Call: {name}"]


def exception_line(name: str, exc: BaseException) -> str:
    return f"{timestamp()} SGLang Kernel API Exception: {name} ({type(exc).__name__}: {safe_str(exc)})"


class TextLog:
    """The destination of the text log: stdout, stderr, or a file opened on the
    first write (append, `%i` replaced by the pid then, reopened after fork)."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.enabled = dest != OFF
        self._fd: int | None = None
        self._lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        # The child gets its own file when the path holds %i; it must not
        # close the parent's descriptor number under someone else's feet.
        self._fd = None
        self._lock = threading.Lock()

    def path(self) -> str:
        return self.dest.replace("%i", str(os.getpid()))

    def write_lines(self, lines: list[str]) -> None:
        if not self.enabled:
            return
        text = "\n".join(lines) + "\n"
        try:
            with self._lock:
                if self.dest == "stdout":
                    _write_stream(sys.stdout, text)
                elif self.dest == "stderr":
                    _write_stream(sys.stderr, text)
                else:
                    if self._fd is None:
                        self._fd = os.open(self.path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    _write_all(self._fd, text.encode("utf-8", "backslashreplace"))
        except Exception as exc:
            self.enabled = False
            warn(f"text log to {self.dest!r} failed ({type(exc).__name__}: {exc}); text log turned off, spans go on")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _write_stream(stream, text: str) -> None:
    if stream is None:
        return
    try:
        stream.write(text)
    except UnicodeEncodeError:
        stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))
    stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
