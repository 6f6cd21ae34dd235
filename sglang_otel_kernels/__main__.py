"""Command line: `sglang-otel-kernels` / `python -m sglang_otel_kernels`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang-otel-kernels",
        description="SGLang-compatible kernel API logging as OpenTelemetry spans.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a tiny decode step with a failing request and show what is recorded")
    demo.add_argument("--level", type=int, choices=(1, 3, 5), default=3, help="logging level (default 3)")
    options = parser.parse_args(argv)
    if options.command == "demo":
        from .demo import run

        return run(level=options.level)
    parser.error(f"unknown command {options.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
