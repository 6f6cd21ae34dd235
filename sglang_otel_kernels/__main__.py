"""Command line: `sglang-otel-kernels` / `python -m sglang_otel_kernels`.

Exit status: 0 success; 2 bad usage or an unreadable input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys


class _Failure(Exception):
    """A clear one-line error for the user; exit status 2."""


def _export(options) -> int:
    from .recover.otlp_json import json_lines
    from .recover.reader import TraceFileError, read_trace_file

    try:
        contents = read_trace_file(options.file)
    except TraceFileError as exc:
        raise _Failure(str(exc)) from None
    for problem in contents.problems:
        print(f"sglang-otel-kernels: {options.file}: {problem}", file=sys.stderr)
    try:
        out = sys.stdout if options.output in (None, "-") else open(options.output, "w", encoding="utf-8")
    except OSError as exc:
        raise _Failure(f"cannot write {options.output}: {exc.strerror or exc}") from None
    try:
        for line in json_lines(contents):
            out.write(line + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _demo(options) -> int:
    from .demo import run

    return run(level=options.level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-otel-kernels",
        description="SGLang-compatible kernel API logging as OpenTelemetry spans, with a crash-safe trace file.",
        epilog="Exit status: 0 success; 2 bad usage or an input that cannot be read (one line on stderr).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a tiny decode step with a failing request and show what is recorded")
    demo.add_argument("--level", type=int, choices=(1, 3, 5), default=3, help="logging level (default 3)")
    demo.set_defaults(handler=_demo)
    export = commands.add_parser("export", help="write the spans of a trace file as OTLP JSON lines")
    export.add_argument("file", help="a trace file (SGLANG_KERNEL_API_TRACEFILE)")
    export.add_argument("--format", choices=("otlp-json",), default="otlp-json", help="output format (default otlp-json)")
    export.add_argument("-o", "--output", help="output file (default: standard output)")
    export.set_defaults(handler=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        return options.handler(options)
    except _Failure as exc:
        print(f"sglang-otel-kernels: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
