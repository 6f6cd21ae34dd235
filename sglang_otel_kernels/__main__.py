"""Command line: `sglang-otel-kernels` / `python -m sglang_otel_kernels`."""

from __future__ import annotations

import argparse
import gc
import sys


class _Failure(Exception):
    """A clear one-line error for the user; exit status 2."""


def _load(path: str) -> list:
    """A trace file, or an OTLP JSON file (one contents per process in it)."""
    from .recover.otlp_json import looks_like_json, read_otlp_json
    from .record.reader import read_trace_file

    return read_otlp_json(path) if looks_like_json(path) else [read_trace_file(path)]


def _export(options) -> int:
    from .recover.chrome import chrome_json
    from .recover.otlp_json import json_lines

    files = _read_all(options.paths)
    for contents in files:
        for problem in contents.problems:
            print(f"sglang-otel-kernels: {contents.path}: {problem}", file=sys.stderr)
    try:
        out = sys.stdout if options.output in (None, "-") else open(options.output, "w", encoding="utf-8")
    except OSError as exc:
        raise _Failure(f"cannot write {options.output}: {exc.strerror or exc}") from None
    try:
        if options.format == "chrome":
            out.write(chrome_json(files) + "\n")
        else:
            for contents in files:
                for line in json_lines(contents):
                    out.write(line + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


_DUMP_PATTERNS = ("cuda_coredump_*", "*.nvcudmp")  # CUDA core dumps as record/coredumps.py and SGLang name them


def _files(paths: list[str], dumps: "list[tuple[str, bool]] | None" = None) -> list[tuple[str, bool]]:
    """(file, whether it was named) for each path: a directory stands for
    every `*.sgltrace`, `*.json` and `*.jsonl` in it (earlier runs' files
    kept aside and the Collector's rotated archives included). With `dumps`,
    the CUDA core dumps named or in a directory go there instead."""
    import fnmatch
    import glob
    import os

    from .recover.cuda_coredump import is_cuda_coredump

    files = []
    for path in paths:
        if not os.path.isdir(path):
            named_dump = any(fnmatch.fnmatch(os.path.basename(path), p) for p in _DUMP_PATTERNS)
            if dumps is not None and (named_dump or is_cuda_coredump(path)):
                dumps.append((path, True))
            else:
                files.append((path, True))
            continue
        found = sorted(name for pattern in ("*.sgltrace", "*.json", "*.jsonl")
                       for name in glob.glob(os.path.join(glob.escape(path), pattern)))
        in_dir = sorted({name for pattern in _DUMP_PATTERNS for name in glob.glob(os.path.join(glob.escape(path),
                                                                                                pattern))})
        if not found and not (dumps is not None and in_dir):
            raise _Failure(f"{path}: a directory without trace files (*.sgltrace) or OTLP JSON files")
        files.extend((name, False) for name in found)
        if dumps is not None:
            dumps.extend((name, False) for name in in_dir)
    return files


def _read_dumps(dumps: list[tuple[str, bool]]) -> list:
    """The CUDA core dumps read: one named that cannot be read is an error
    (one line, exit 2), one of a directory is skipped with a line on stderr."""
    from .recover.cuda_coredump import CoreDumpError, read_cuda_coredump

    read = []
    for path, named in dumps:
        try:
            read.append(read_cuda_coredump(path))
        except CoreDumpError as exc:
            if named:
                raise _Failure(str(exc)) from None
            print(f"sglang-otel-kernels: skipped {exc}", file=sys.stderr)
    return read


def _kept(results: list, files: list[tuple[str, bool]]) -> list:
    """What was read of each file: a file of a directory that cannot be read
    is skipped with a line on stderr, one named is an error."""
    kept = []
    for (path, named), result in zip(files, results):
        if not isinstance(result, Exception):
            kept.extend(result)
        elif named:
            raise _Failure(str(result))
        else:
            print(f"sglang-otel-kernels: skipped {result}", file=sys.stderr)
    if not kept:
        raise _Failure("no readable trace file")
    return kept


def _read_all(paths: list[str]) -> list:
    """The contents of the trace files and OTLP JSON files named (see `_files`)."""
    from .record.reader import TraceFileError

    files = _files(paths)
    results = []
    for path, _ in files:
        try:
            results.append(_load(path))
        except TraceFileError as exc:
            results.append(exc)
    return _kept(results, files)


def _report(options) -> int:
    import gc
    import json

    from .recover.digest import digest, merge_processes, read_digests
    from .recover.report import build_report, render_text

    if options.last < 0:
        raise _Failure("--last must be 0 or more")
    if not 0 <= options.hang_seconds < float("inf"):
        raise _Failure("--hang-seconds must be 0 or more")
    if not options.paths and not options.jaeger:
        raise _Failure("report: give trace files (PATH...), --jaeger URL, or both")
    if options.jaeger:
        from .recover.jaeger_source import jaeger_base

        try:
            _, named = jaeger_base(options.jaeger)
        except ValueError as exc:
            raise _Failure(str(exc)) from None
        options.service = options.service or named  # a search page's URL names its service
        if not options.service:
            raise _Failure("--jaeger needs --service: the service the job's spans were sent as (OTEL_SERVICE_NAME)")
    if options.limit <= 0:
        raise _Failure("--limit must be more than 0")
    # What is read lives until the command ends, millions of objects and no
    # cycle among them: collections would only walk them again and again.
    gc.disable()
    digests = []
    dumps: list = []
    if options.paths:
        files = _files(options.paths, dumps)
        dumps = _read_dumps(dumps)
        if files or not dumps:
            digests = merge_processes(_kept(read_digests(_load, [path for path, _ in files], options.last), files),
                                      options.last)
    if options.jaeger:
        import time

        from .recover.jaeger_source import parse_time, read_jaeger
        from .record.reader import TraceFileError

        try:
            now = time.time()
            start, end = parse_time(options.since, now), parse_time(options.until, now) if options.until else now
            if start >= end:
                raise ValueError(f"--since ({options.since}) is not before --until ({options.until or 'now'})")
            digests += [digest(contents, options.last) for contents in
                        read_jaeger(options.jaeger, options.service, start, end, options.limit)]
        except (ValueError, TraceFileError) as exc:
            raise _Failure(str(exc)) from None
    # An archive holds other services' spans too (Jaeger's own, where it traces itself): not a process of ours.
    ours = [item for item in digests
            if item.summary or item.contents.metadata.get("format") not in ("OTLP JSON", "Jaeger")]
    if not ours and not dumps:
        raise _Failure(f"no kernel calls in {len(digests)} process(es) of the OTLP JSON files or Jaeger traces given")
    report = build_report(ours, last=options.last, hang_seconds=options.hang_seconds, dumps=dumps,
                          skipped=len(digests) - len(ours))
    import os

    from .filesystems import slow_filesystem_note

    folders = [path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) for path in options.paths]
    for note in dict.fromkeys(filter(None, map(slow_filesystem_note, folders))):
        print(f"sglang-otel-kernels: {note}", file=sys.stderr)  # beside the report: its text stays as it was
    contents = [item.contents for item in ours]
    if options.html:
        from .recover.html import render_html

        try:
            with open(options.html, "w", encoding="utf-8") as out:
                out.write(render_html(contents, report))
        except OSError as exc:
            raise _Failure(f"cannot write {options.html}: {exc.strerror or exc}") from None
        print(f"wrote {options.html}")
    elif options.json:
        print(json.dumps(report, indent=2, default=repr))
    else:
        sys.stdout.write(render_text(report))
    return report["verdict"]["exit_status"]


def _replay(options) -> int:
    from .recover.resend import make_exporter, replay, terminal_progress

    if options.timeout <= 0:
        raise _Failure("--timeout must be more than 0")
    contents = _read_all(options.paths)
    try:
        exporter, target = make_exporter(options.endpoint, options.protocol, options.timeout)
    except ValueError as exc:
        raise _Failure(str(exc)) from None
    try:
        done = replay(contents, exporter, terminal_progress(), everything=options.all, endpoint=target)
    except ConnectionError as exc:
        raise _Failure(f"cannot replay to {target}: {exc}") from None
    finally:
        exporter.shutdown()
    for note in done.notes:
        print(f"sglang-otel-kernels: {note}", file=sys.stderr)
    print(f"replayed {done.sent} spans ({done.in_flight} in flight, {done.copies} copies into request traces) "
          f"from {len(contents)} file(s) to {target}")
    if done.delivered_before:
        print(f"including {done.delivered_before} spans the export sidecar had delivered already (--all)"
              if options.all else
              f"left out {done.delivered_before} spans the export sidecar had delivered already "
              "(--all sends them again)")
    return 0


def _rerun(options) -> int:
    import json

    from .recover.rerun import DumpError, render, render_header, rerun

    if options.rtol < 0 or options.atol < 0:
        raise _Failure("--rtol and --atol must be 0 or more")

    def header(report: dict) -> None:  # before the call runs: a crash of the child cannot take it
        if not options.json:
            sys.stdout.write(render_header(report))
            sys.stdout.flush()

    try:
        report = rerun(options.dump_dir, function=options.function, device=options.device,
                       rtol=options.rtol, atol=options.atol, on_start=header)
    except DumpError as exc:
        raise _Failure(str(exc)) from None
    if options.json:
        print(json.dumps(report, indent=2, default=repr))
    else:
        sys.stdout.write(render(report))
    return 0 if report["reproduced"] and not report.get("died") else 1


def _run(options) -> int:
    import os
    import shutil

    from . import bootstrap

    command = options.command_line[1:] if options.command_line[:1] == ["--"] else options.command_line
    if not command:
        raise _Failure("run: no command given (sglang-otel-kernels run [options] -- COMMAND [ARGS...])")
    executable = shutil.which(command[0])
    if executable is None:
        raise _Failure(f"run: command not found: {command[0]}")
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(bootstrap.__file__))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if options.level is not None:
        env["SGLANG_KERNEL_API_LOGLEVEL"] = str(options.level)
    level = env.get("SGLANG_KERNEL_API_LOGLEVEL", "").strip() or "0"
    if level == "0":
        print("sglang-otel-kernels: the level is 0 (SGLANG_KERNEL_API_LOGLEVEL unset or 0), so nothing is recorded; "
              "set it, or run with --level 1 (3, 5 or 10)", file=sys.stderr)
    if options.cuda_coredump:
        from .config import config_from_env
        from .record.coredumps import prepare

        env["SGLANG_KERNEL_API_CUDA_COREDUMP"] = "1"
        # Set before the command starts, so that CUDA reads them however early it initialises.
        env.update(prepare(env, config_from_env(env).trace_file))
    if options.instrument:
        env["SGLANG_KERNEL_API_INSTRUMENT"] = ",".join(
            [p for p in env.get("SGLANG_KERNEL_API_INSTRUMENT", "").split(",") if p.strip()] + options.instrument)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, command, env)
    return 0  # not reached


def _follow(options) -> int:
    from .record.export import otlp_protocol
    from .live.follow import follow, parent_watch
    from .live.metrics import metric_exporter
    from .record.reader import TraceFileError
    from .recover.resend import make_exporter

    if options.interval <= 0 or options.timeout <= 0:
        raise _Failure("--interval and --timeout must be more than 0")
    # A follower makes a few dicts and tuples per record, none in a cycle: what
    # is loaded now is never collected, and collections come 30 times less
    # often than by default (they took a third of its time).
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    # Its sending threads take the GIL back after each wait on the network: held
    # by a reading thread for the default 5 ms each time, sending would starve.
    sys.setswitchinterval(0.0005)
    if not 0 <= options.hang_seconds < float("inf"):
        raise _Failure("--hang-seconds must be 0 or more")
    try:
        exporter, target = make_exporter(options.endpoint, options.protocol, options.timeout)
    except ValueError as exc:
        raise _Failure(str(exc)) from None
    try:
        # Without --pid the file's writer is followed until it ends (the lock it holds while it lives).
        watch = parent_watch(options.pid) if options.pid is not None else None
        sent, in_flight, dropped = follow(options.file, exporter, alive=watch,
                                          interval=options.interval, wait_s=options.wait,
                                          kernels_only=options.kernels_only, ending_only=options.ending_only,
                                          hang_seconds=options.hang_seconds,
                                          delivered_to=target,
                                          metrics=metric_exporter(target, options.protocol or otlp_protocol(),
                                                                  options.timeout))
    except TraceFileError as exc:
        raise _Failure(str(exc)) from None
    except KeyboardInterrupt:
        return 0
    finally:
        exporter.shutdown()
    summary = (f"followed {options.file} until its writer ended: {sent} spans sent to {target} "
               f"({in_flight} in flight when the process ended, {dropped} dropped)")
    if options.pid is None:
        print(summary)  # run by hand: the result, on stdout
    elif in_flight or dropped:
        print(f"sglang-otel-kernels: {summary}", file=sys.stderr)  # the sidecar: a note beside the application's output
    return 1 if dropped and not sent else 0  # it tried and delivered nothing: the cause was said on stderr


def _watch(options) -> int:
    import os
    import signal
    import socket
    import threading

    from opentelemetry.sdk.resources import Resource

    from .record.export import otlp_endpoint, otlp_protocol
    from .live.metrics import JobMetrics, metric_exporter
    from .recover.resend import make_exporter
    from .live.watch import watch

    if not 0 < options.interval < float("inf") or options.timeout <= 0:
        raise _Failure("--interval and --timeout must be more than 0")
    if not 0 <= options.hang_seconds < float("inf"):
        raise _Failure("--hang-seconds must be 0 or more")
    missing = [path for path in options.paths if not os.path.exists(path)]
    if missing:
        raise _Failure(f"{missing[0]}: no such file or directory")
    exporter = target = metrics = None
    # Which host and process watch runs on (the suspects' own are on each verdict span).
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "sglang",
                                "host.name": socket.gethostname(), "process.pid": os.getpid()})
    if options.endpoint or otlp_endpoint():
        try:
            exporter, target = make_exporter(options.endpoint, options.protocol, options.timeout)
        except ValueError as exc:
            raise _Failure(str(exc)) from None
        measured = metric_exporter(target, options.protocol or otlp_protocol(), options.timeout)
        metrics = None if measured is None else JobMetrics(measured, resource)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    print(f"watching {', '.join(options.paths)}: the verdict every {options.interval:g} s, "
          + (f"each new one exported to {target}" if exporter else "printed only (no OTLP endpoint)"), flush=True)
    try:
        watch(options.paths, interval=options.interval, hang_seconds=options.hang_seconds, stop=stop,
              exporter=exporter, resource=resource, say=lambda line: print(line, flush=True),
              on_verdicts=None if metrics is None else metrics.verdicts)
    finally:
        if exporter is not None:
            exporter.shutdown()
        if metrics is not None:
            metrics.close()
    return 0


def _demo(options) -> int:
    from .demo import run

    return run(level=options.level, crash=options.crash)


def _default_hang_seconds() -> float:
    from .config import get_config

    return get_config().hang_seconds


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit status 2, like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


_EXIT_USAGE = "2 bad usage, or an input that cannot be read (one line on stderr)."


def _command(commands, name: str, summary: str, description: str, exits: str) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with what it does and ends with its exit codes."""
    return commands.add_parser(name, help=summary, description=description, epilog=f"Exit status: {exits}",
                               formatter_class=argparse.RawDescriptionHelpFormatter)


class _Version(argparse.Action):
    """--version: the version, and the formats this build writes and reads, one a line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from ._version import __version__
        from .record import core
        from .record.tracefile import FORMAT_VERSION
        from .record.reader import READ_FORMATS
        from .recover.report import REPORT_SCHEMA

        print(f"{parser.prog} {__version__}\n"
              f"trace file format: writes {FORMAT_VERSION}, reads {', '.join(map(str, READ_FORMATS))}\n"
              f"report --json schema: {REPORT_SCHEMA}\n"
              f"recording core: {core.describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sglang-otel-kernels",
        description="SGLang-compatible kernel API logging as OpenTelemetry spans, with a crash-safe trace file. "
                    "Each command's --help says what it does and its exit codes.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show the version, the trace-file and JSON formats it reads and writes, and the recording core in use, and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = _command(
        commands, "demo", "run the example service with a request that makes a kernel fail, then print the crash report",
        "Runs the example service with five requests, one of which makes a kernel fail (--crash: kill the\n"
        "service process), then prints the crash report from its trace file. No collector needed.",
        "0 the demo ran and printed its report; " + _EXIT_USAGE)
    demo.add_argument("--level", type=int, choices=(1, 3, 5), default=3, help="logging level (default 3)")
    demo.add_argument("--crash", action="store_true",
                      help="the failing kernel kills the service process (run as a child), as a GPU crash does")
    demo.set_defaults(handler=_demo)
    report = _command(
        commands, "report", "what the trace files say about a crash: calls in flight, their inputs and requests",
        "Prints what trace files (or OTLP JSON archives, or the spans Jaeger holds: --jaeger) say about\n"
        "how their processes ended: the kernel calls in flight at a crash with their inputs and requests,\n"
        "failed calls, the first NaN/Inf producer, the last calls, and a verdict over the ranks of a job;\n"
        "with CUDA core dumps (named, or cuda_coredump_* / *.nvcudmp in a directory), the device fault\n"
        "each records, placed in the call or CUDA graph replay its process was running. The first line\n"
        "says what happened; --json's verdict, --html's banner and the exit status say the same.",
        "0 nothing found: no process died, none failed or hangs, no NaN/Inf producer (calls running\n"
        "in a live process under the hang threshold are no crash); 1 a process died (in a call, in a\n"
        "batch, or idle), failed calls or batches, an exception no code caught, a hang (a collective, a\n"
        "call or a frozen process past --hang-seconds), a mismatch across ranks, or a device fault;\n"
        "2 bad usage, or an input that cannot be read (one line on stderr);\n"
        "3 a call made NaN/Inf from finite inputs (level 5, or the NaN flags), nothing worse: a gate can\n"
        "tell numerics from crashes.")
    report.add_argument("paths", nargs="*", metavar="PATH",
                        help="trace files (one per rank merge by time), OTLP JSON files, CUDA core dumps, or "
                             "directories of them")
    report.add_argument("--last", type=int, default=10, metavar="N", help="completed calls to list (default 10)")
    report.add_argument("--hang-seconds", type=float, default=_default_hang_seconds(), metavar="S",
                        help="in a live process, a collective waited on, a call running, or a frozen heartbeat "
                             "this long is a hang (default: "
                             "SGLANG_KERNEL_API_HANG_SECONDS, else 60; in a dead job every wait counts)")
    report.add_argument("--jaeger", metavar="URL",
                        help="also (or instead) read the spans Jaeger holds: its address, e.g. "
                             "http://127.0.0.1:16686, or any page of its UI (a search, a trace) "
                             "(every node's ranks in one verdict, no file needed)")
    report.add_argument("--service", metavar="NAME", help="with --jaeger: the service the spans were sent as "
                                                          "(default: the one a search page's URL names)")
    report.add_argument("--since", default="1h", metavar="WHEN",
                        help="with --jaeger: from how long ago (30m, 2h, 1d) or from when (2026-12-03 06:30, "
                             "local time unless it names its zone, e.g. 2026-12-03T06:30Z) (default 1h)")
    report.add_argument("--until", metavar="WHEN", help="with --jaeger: until when, as --since (default now)")
    report.add_argument("--limit", type=int, default=1000, metavar="N",
                        help="with --jaeger: the newest N traces at most (default 1000)")
    report.add_argument("--json", action="store_true", help="print the report as one JSON document")
    report.add_argument("--html", metavar="OUT",
                        help="write the report as one self-contained HTML page (timeline per thread, "
                             "the crash highlighted; no network needed to view it)")
    report.set_defaults(handler=_report)
    replay = _command(
        commands, "replay", "send the spans of trace files to an OTLP back end, with their original ids",
        "Sends the spans of trace files (calls in flight at a crash included) to an OTLP back end,\n"
        "with their original trace and span ids, so they land inside their request traces; a batched\n"
        "call that failed, hung, died in flight or made NaN/Inf also goes, as a copy, into the trace\n"
        "of each request it hit. Spans the export sidecar already delivered to the same endpoint\n"
        "(listed beside the file, FILE.delivered) are left out, and both counts are printed; a call\n"
        "whose NaN flags came after it was delivered (a crash left them in FILE.nanflags) still goes,\n"
        "as copies, into the traces of its requests.",
        "0 the spans were sent; " + _EXIT_USAGE[:-1] + ", or a back end that cannot be reached.")
    replay.add_argument("paths", nargs="+", metavar="PATH",
                        help="trace files, OTLP JSON files, or directories of them")
    replay.add_argument("--endpoint", help="OTLP endpoint URL (default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT)")
    replay.add_argument("--protocol", choices=("grpc", "http/protobuf"),
                        help="default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc")
    replay.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the back end (default 10)")
    replay.add_argument("--all", action="store_true",
                        help="also send the spans the export sidecar already delivered (a back end that lost them)")
    replay.set_defaults(handler=_replay)
    export = _command(
        commands, "export", "write the spans of trace files as OTLP JSON lines or a Chrome/Perfetto timeline",
        "Writes the spans of trace files (or OTLP JSON archives) as OTLP JSON lines, or as one\n"
        "Chrome/Perfetto trace-event timeline of them all. OTLP JSON holds the copies of the batched\n"
        "calls that matter in the traces of their requests, as replay sends them; a timeline draws each\n"
        "call once.",
        "0 written; " + _EXIT_USAGE)
    export.add_argument("paths", nargs="+", metavar="PATH",
                        help="trace files (SGLANG_KERNEL_API_TRACEFILE), OTLP JSON files (a Collector file "
                             "exporter archive, our own export), or directories of them")
    export.add_argument("--format", choices=("otlp-json", "chrome"), default="otlp-json",
                        help="otlp-json: OTLP JSON lines (default); chrome: trace-event JSON for chrome://tracing or Perfetto")
    export.add_argument("-o", "--output", help="output file (default: standard output)")
    export.set_defaults(handler=_export)
    rerun = _command(
        commands, "rerun", "run a call dumped at level 10 again and compare with what the dump recorded",
        "Runs a call dumped at level 10 again, in a child process, on the dumped inputs, and compares\n"
        "what happens with what the dump recorded (outputs, exception, or a call that never finished).\n"
        "A call that kills its process is reported as such (reproduced: the call died with SIGABRT).\n"
        "\n"
        "--function path/to/script.py:name loads the script's imports, definitions and top-level\n"
        "assignments only: its bare calls (main(), print(...)), loops, with-blocks and its\n"
        "`if __name__ == \"__main__\":` block do not run. MODULE:QUALNAME imports the module, which runs\n"
        "its top level as any import does.",
        "0 the recorded outcome reproduced; 1 the outcome differs, or the call killed the re-run's\n"
        "process; " + _EXIT_USAGE)
    rerun.add_argument("dump_dir", metavar="DUMP_DIR", help="one call's dump directory (sglang.kernel.dump_dir)")
    rerun.add_argument("--function", metavar="MODULE:QUALNAME",
                       help="the function to call: MODULE:QUALNAME, path/to/script.py:name or "
                            "torch.ops.<ns>:<op>. Required: the import path a dump records is shown, "
                            "never run on the dump's word")
    rerun.add_argument("--device", help="put every input tensor here (default: the device each was on, if present)")
    rerun.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for outputs (default 1e-5)")
    rerun.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance for outputs (default 1e-8)")
    rerun.add_argument("--json", action="store_true", help="print the comparison as one JSON document")
    rerun.set_defaults(handler=_rerun)
    follow = _command(
        commands, "follow", "export the spans of a live trace file to an OTLP back end as they end (the export sidecar)",
        "Exports the spans of a trace file being written to an OTLP back end as they end, and the calls\n"
        "in flight when its process dies (the export sidecar), until the writer ends.",
        "0 the writer ended (or Ctrl-C); 1 the back end took none of the spans sent to it (each cause\n"
        "said once on stderr: connection refused, TLS verification, HTTP 401/403/413, name not resolved...);\n"
        + _EXIT_USAGE)
    follow.add_argument("file", metavar="FILE", help="a trace file being written")
    follow.add_argument("--pid", type=int, help="stop when this process ends, after exporting its in-flight calls")
    follow.add_argument("--endpoint", help="OTLP endpoint URL (default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT)")
    follow.add_argument("--protocol", choices=("grpc", "http/protobuf"),
                        help="default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc")
    follow.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the back end (default 10)")
    follow.add_argument("--interval", type=float, default=0.2, help="seconds between polls of the file (default 0.2)")
    reading = follow.add_mutually_exclusive_group()
    reading.add_argument("--kernels-only", action="store_true",
                         help="export only kernel spans that ended (the application exports its own), "
                              "and every span in flight when the process ends")
    reading.add_argument("--ending-only", action="store_true",
                         help="read nothing while the process lives (the application exports every span it ends, "
                              "kernel calls included): once it ends, export the spans in flight then and gauge how "
                              "it ended (a crash pages)")
    follow.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the file to appear (default 60)")
    follow.add_argument("--hang-seconds", type=float, default=_default_hang_seconds(), metavar="S",
                        help="export a kernel call running this long, marked hung, while the process lives; "
                             "0: never (default: SGLANG_KERNEL_API_HANG_SECONDS, else 60)")
    follow.set_defaults(handler=_follow)
    watch = _command(
        commands, "watch", "follow a live job's trace files and say each new cross-rank verdict, also through OTLP",
        "Follows the trace files of a live job (files, or directories of them: one node's, or a shared\n"
        "one), makes the cross-rank verdict again every --interval seconds, prints each new verdict as\n"
        "one line and exports it through OTLP (a span sglang.verdict, ERROR when it names a suspect,\n"
        "linked to the suspect's call in flight; the standard OTEL_* variables, or --endpoint). Files\n"
        "no live process writes are left alone. Stops on SIGTERM or Ctrl-C.",
        "0 stopped by SIGTERM or Ctrl-C; " + _EXIT_USAGE)
    watch.add_argument("paths", nargs="+", metavar="PATH", help="trace files, or directories of them")
    watch.add_argument("--interval", type=float, default=5.0, help="seconds between verdicts (default 5)")
    watch.add_argument("--hang-seconds", type=float, default=_default_hang_seconds(), metavar="S",
                       help="a collective waited on this long is a hang (default: SGLANG_KERNEL_API_HANG_SECONDS, "
                            "else 60)")
    watch.add_argument("--endpoint", help="OTLP endpoint URL (default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT; "
                                          "neither: the verdicts are printed only)")
    watch.add_argument("--protocol", choices=("grpc", "http/protobuf"),
                       help="default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc")
    watch.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the back end (default 10)")
    watch.set_defaults(handler=_watch)
    run = _command(
        commands, "run", "run a command with SGLang's kernel logging (and SGLANG_KERNEL_API_INSTRUMENT) recorded by "
                         "this package in all its Python processes",
        "Runs a command with SGLang's kernel logging recorded by this package in all its Python\n"
        "processes (and the functions of SGLANG_KERNEL_API_INSTRUMENT / --instrument). Nothing is\n"
        "recorded at level 0: set SGLANG_KERNEL_API_LOGLEVEL or pass --level.",
        "the command's own; " + _EXIT_USAGE)
    run.add_argument("--level", type=int, choices=(0, 1, 3, 5, 10),
                     help="set SGLANG_KERNEL_API_LOGLEVEL for the command (default: as set in the environment)")
    run.add_argument("--instrument", action="append", metavar="MODULE:QUALNAME", default=[],
                     help="also record this function or method (repeatable; added to SGLANG_KERNEL_API_INSTRUMENT)")
    run.add_argument("--cuda-coredump", action="store_true",
                     help="the CUDA driver writes a core dump on a device exception, beside the trace files "
                          "(CUDA_ENABLE_COREDUMP_ON_EXCEPTION and the lightweight set; CUDA_* already set are kept)")
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run.set_defaults(handler=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A file's text is made valid, but a terminal may take less than UTF-8.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
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
