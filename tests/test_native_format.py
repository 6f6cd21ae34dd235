"""The compiled core's record format (sglang_otel_kernels/native/format.h)
is the trace file's (record/tracefile.py): each constant it defines, held
against its Python twin, so that neither changes alone. Read from the
header's text: it holds whether or not the core is built here."""

import os
import re
import struct

from sglang_otel_kernels.record import tracefile as fmt

HEADER = os.path.join(os.path.dirname(fmt.__file__), os.pardir, "native", "format.h")

# The header's names for what the Python side names otherwise.
TWINS = {
    "RECORD_MAGIC": fmt.RECORD_MAGIC,
    "RECORD_HEADER_SIZE": fmt.RECORD_HEADER.size,
    "KERNEL_SPAN_SIZE": fmt.KERNEL_SPAN.size,
    "COMPACT_END_SIZE": fmt.COMPACT_END.size,
    "SPAN_START_SIZE": fmt.SPAN_START.size,
}


def _defines() -> dict:
    with open(HEADER) as handle:
        text = handle.read()
    return {name: int(value.rstrip("uU"), 0)
            for name, value in re.findall(r"^#define (\w+) (0x[0-9A-Fa-f]+u?|\d+)\b", text, re.M)}


def test_every_constant_of_the_header_is_the_trace_files():
    defines = _defines()
    assert len(defines) >= 14, defines  # the header was read
    for name, value in defines.items():
        twin = TWINS[name] if name in TWINS else getattr(fmt, name)
        assert value == twin, (name, value, twin)


def test_the_structs_sizes_are_those_their_comments_name():
    with open(HEADER) as handle:
        text = handle.read()
    for name, layout in re.findall(r"^#define (\w+_SIZE) \d+\s*/\* (<[A-Za-z]+) \*/", text, re.M):
        assert struct.calcsize(layout) == _defines()[name], name


def test_the_compiled_core_includes_the_header_and_defines_no_format_constant_of_its_own():
    root = os.path.dirname(HEADER)
    names = set(_defines())
    for path in [os.path.join(root, os.pardir, "_native.c")] + [
            os.path.join(root, name) for name in os.listdir(root) if name.endswith(".c")]:
        with open(path) as handle:
            text = handle.read()
        own = set(re.findall(r"^#define (\w+)", text, re.M))
        assert not own & names, (path, own & names)
    with open(os.path.join(root, os.pardir, "_native.c")) as handle:
        assert '#include "native/format.h"' in handle.read()
