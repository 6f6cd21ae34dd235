"""Text we emit must be valid UTF-8: a lone surrogate (a file name decoded with
`surrogateescape`, a message from a C extension) makes the OTLP exporter fail
the whole batch it sits in and a strict stdout raise. Torch-free, for the
recorder and the reader alike."""

from __future__ import annotations


def utf8(text: str) -> str:
    """`text`, with what UTF-8 cannot encode written as backslash escapes."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
