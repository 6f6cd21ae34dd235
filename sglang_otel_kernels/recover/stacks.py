"""Python's fatal-error dump (faulthandler's `.traceback` file), as a person
reads it: the thread that crashed first, threads waiting in the same place
as one entry with a count, long lines wrapped. The file itself is never
changed: `report --json` keeps its text as written."""

from __future__ import annotations

import re
import textwrap

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
WIDTH = 120  # longer lines but frames (the extension modules list) are wrapped


def _blocks(text: str) -> list[list[str]]:
    """The dump's paragraphs: runs of lines between blank lines."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            blocks[-1].append(line.rstrip())
        elif blocks[-1]:
            blocks.append([])
    return [block for block in blocks if block]


def _threads(run: list[list[str]]) -> list[list[str]]:
    """One dump's thread stacks: the current thread first, then each distinct
    stack once, in the order first seen, with how many threads share it."""
    current = [block for block in run if block[0].startswith("Current thread")]
    groups: dict[tuple, list] = {}
    for block in run:
        if not block[0].startswith("Current thread"):
            groups.setdefault(tuple(block[1:]), []).append(_THREAD.match(block[0]).group(2))
    tidy = list(current)
    for frames, idents in groups.items():
        more = len(idents) - 1
        same = f" and {more} more thread{'s' if more > 1 else ''} with the same stack" if more else ""
        tidy.append([f"Thread {idents[0]}{same} (most recent call first):", *frames])
    return tidy


def tidy_stacks(text: str) -> list[str]:
    """The lines of a fatal-error dump for the text report (see the module)."""
    out: list[list[str]] = []
    run: list[list[str]] = []  # consecutive thread stacks: one dump
    for block in _blocks(text):
        if _THREAD.match(block[0]):
            run.append(block)
            continue
        if run:
            out += _threads(run)
            run = []
        out.append(block)
    if run:
        out += _threads(run)
    lines: list[str] = []
    for block in out:
        for line in block:
            if line.lstrip().startswith('File "'):  # a frame stays one line, whatever its length
                lines.append(line)
                continue
            indent = line[: len(line) - len(line.lstrip())]
            lines += textwrap.wrap(line, WIDTH, subsequent_indent=indent + "    ", break_on_hyphens=False) or [line]
        lines.append("")
    return lines[:-1]
