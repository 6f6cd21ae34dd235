"""The trace file outside crashes: contents, format damage, bounds, threads,
processes, permissions, and the OTLP JSON export."""

import json
import os
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import sglang_otel_kernels as sok
from conftest import clean_env, run_python
from sglang_otel_kernels.record import tracefile as fmt

K = "sglang.kernel."


@pytest.fixture
def traced(record, tmp_path):
    """Spans into memory and into a trace file in tmp_path; returns the exporter."""

    def setup(level=3, **settings):
        exporter = record(level=level)
        sok.configure(trace_file=str(tmp_path / "trace_%i.sgltrace"), **settings)
        return exporter

    return setup


def trace_path(tmp_path):
    return tmp_path / f"trace_{os.getpid()}.sgltrace"


def test_round_trip_agrees_with_the_exporter(traced, provider, tmp_path):
    exporter = traced(level=5)
    kernel = sok.debug_kernel_api(op_name="rmsnorm")(lambda x, eps=1e-6: x / 0)
    with provider.get_tracer("server").start_as_current_span("Req 1", attributes={"rid": "r1"}):
        kernel(torch.tensor([1.0, 0.0]), eps=1e-5)
    assert sok.trace_file_path() == str(trace_path(tmp_path))
    spans = sok.read_trace(trace_path(tmp_path))
    exported = {s.context.span_id: s for s in exporter.get_finished_spans()}
    assert [s.name for s in spans] == ["Req 1", "rmsnorm"]
    for span in spans:
        original = exported[span.span_id]
        assert span.trace_id == original.context.trace_id
        assert span.parent_span_id == (original.parent.span_id if original.parent else 0)
        assert (span.start_time, span.end_time) == (original.start_time, original.end_time)
        assert repr(span.attributes) == repr(dict(original.attributes))  # repr: NaN == NaN
        assert [e[0] for e in span.events] == [e.name for e in original.events]
        assert span.thread_name == threading.current_thread().name
        assert not span.in_flight
    assert spans[1].attributes[K + "output.nan_count"] == 1
    assert spans[1].scope_name == "sglang_otel_kernels"


def test_kernels_called_alike_keep_their_own_names_and_arguments(traced, tmp_path):
    """The reader keeps the reading of an attribute payload that repeats: two
    kernels called with the same arguments still read back as themselves,
    and a call with other arguments as its own."""
    traced()
    first = sok.debug_kernel_api(op_name="sglang.custom_op.first")(lambda x, eps=1e-6: x)
    second = sok.debug_kernel_api(op_name="sglang.custom_op.second")(lambda x, eps=1e-6: x)
    x = torch.ones(4, 8)
    for _ in range(3):
        first(x, eps=1e-5)
        second(x, eps=1e-5)
    second(torch.ones(2, 8, dtype=torch.float16), eps=1e-5)
    spans = sok.read_trace_file(str(trace_path(tmp_path))).spans
    assert [s.name.rsplit(".", 1)[1] for s in spans] == ["first", "second"] * 3 + ["second"]
    assert [s.attributes[K + "input.arg0.shape"] for s in spans] == [(4, 8)] * 6 + [(2, 8)]
    assert [s.attributes[K + "input.arg0.dtype"] for s in spans][-2:] == ["torch.float32", "torch.float16"]
    assert [s.attributes[K + "seq"] for s in spans] == sorted({s.attributes[K + "seq"] for s in spans})


def test_file_and_traceback_are_private(tmp_path):
    script = (
        "import os, sglang_otel_kernels as sok\n"
        "os.umask(0)\n"
        "sok.configure(level=1, log_dest='off', trace_file='t.sgltrace')\n"
        "sok.debug_kernel_api(op_name='k')(lambda: None)()\n"
        "print(oct(os.stat('t.sgltrace.traceback').st_mode & 0o777))\n"  # while it runs: an empty one goes at exit
    )
    proc = run_python(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE((tmp_path / "t.sgltrace").stat().st_mode) == 0o600
    assert proc.stdout.split() == ["0o600"]


def test_capacity_bounds_the_file_and_keeps_the_newest(traced, tmp_path):
    traced(level=3, trace_file_size=64 * 1024)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x, i: x)
    for i in range(3000):
        kernel(torch.ones(2), i=i)
    path = trace_path(tmp_path)
    assert path.stat().st_size == fmt.HEADER_SIZE + 64 * 1024
    contents = sok.read_trace_file(path)
    calls = [s.attributes[K + "input.i"] for s in contents.spans if not s.in_flight]
    assert 30 < len(calls) < 3000
    assert calls == list(range(3000 - len(calls), 3000))  # the newest, none missing
    assert all(not s.in_flight for s in contents.spans[1:])
    # Names and threads were written once, long overwritten: the table written
    # after each wrap still resolves them.
    assert {(s.name, s.scope_name, s.thread_name) for s in contents.spans} == {
        ("k", "sglang_otel_kernels", threading.current_thread().name)}


def _resident_kib(path) -> int:
    """How much of the mapping of the file at `path` is in this process's
    memory (smaps' Rss; the mapping is found by inode: the file was made
    under a temporary name)."""
    inode, total, inside = str(os.stat(path).st_ino), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
                inside = fields[4] == inode
            elif inside and line.startswith("Rss:"):
                total += int(fields[1])
    return total


def _resident_past(path, kib: int, timeout: float = 60) -> int:
    """The mapping's resident KiB once past `kib` (or when `timeout` is over)."""
    wait_until = time.monotonic() + timeout
    while _resident_kib(path) < kib and time.monotonic() < wait_until:
        time.sleep(0.05)
    return _resident_kib(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_the_rings_pages_are_made_present_ahead_of_the_first_lap(tmp_path):
    """The calls of the first lap take no page fault each: a thread keeps
    the ring's pages present and writable (MADV_POPULATE_WRITE) 512 KiB and
    more ahead of the writer, changing no byte; a process that wrote little
    has not had its whole ring made resident."""
    path = tmp_path / "t.sgltrace"
    capacity, ahead = 16 << 20, fmt._AHEAD // 1024
    writer = fmt.TraceFileWriter(str(path), capacity=capacity)
    try:
        writer.append((fmt.THREAD, 1, "main"))
        assert _resident_past(path, ahead) >= ahead
        time.sleep(1.0)  # the thread looks again: nothing more was written, nothing more is populated
        assert _resident_kib(path) < (capacity // 1024) // 2
        record = (fmt.THREAD, 2, "x" * 4000)
        while writer._core.offset < 6 << 20:
            writer.append(record)
        assert _resident_past(path, (fmt.HEADER_SIZE + writer._core.offset) // 1024 + ahead) >= \
            (fmt.HEADER_SIZE + writer._core.offset) // 1024 + ahead
        end = fmt.HEADER_SIZE + writer._core.offset + 4096
        with open(path, "rb") as handle:
            handle.seek(end)
            assert handle.read(capacity + fmt.HEADER_SIZE - end) == bytes(capacity + fmt.HEADER_SIZE - end)
    finally:
        writer.close()


def test_a_closed_file_is_unlocked_even_while_the_populating_thread_holds_its_mapping(tmp_path):
    """The populating thread holds an export of the mapping while madvise
    runs, so `close` cannot unmap then, and the mapping keeps the open file
    (and with it the flock) alive: a closed file must still read as no live
    writer's at once, and the next writer at its path must take it, not
    write beside it."""
    import ctypes

    from sglang_otel_kernels.record.reader import writer_alive

    path = str(tmp_path / "t.sgltrace")
    first = fmt.TraceFileWriter(path, capacity=64 * 1024)
    first.append((fmt.THREAD, 1, "main"))
    export = ctypes.c_char.from_buffer(first._map)  # what the populating thread holds during madvise
    try:
        first.close()
        assert not writer_alive(path)
        second = fmt.TraceFileWriter(path, capacity=64 * 1024)
        second.append((fmt.THREAD, 1, "main"))
        assert second.path == path
        assert [name for name in os.listdir(tmp_path) if ".prev-" in name]  # the first run's file, moved aside
        second.close()
    finally:
        del export


def test_a_record_after_close_never_creates_the_file_again(tmp_path):
    writer = fmt.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((fmt.THREAD, 1, "main"))
    writer.close()
    os.unlink(tmp_path / "t.sgltrace")
    writer.append((fmt.THREAD, 2, "late"))  # a span ending after its file was replaced
    writer.append_end(1, 2, 0)
    assert not (tmp_path / "t.sgltrace").exists()


def test_torn_and_damaged_records_are_skipped(traced, tmp_path):
    traced(level=3)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x, i: x)
    for i in range(10):
        kernel(torch.ones(2), i=i)
    path = trace_path(tmp_path)
    data = bytearray(path.read_bytes())
    magic = struct.pack("<I", fmt.RECORD_MAGIC)
    offsets = [i for i in range(fmt.HEADER_SIZE, len(data), 8) if data[i : i + 4] == magic]
    # Records: the thread's name and the span name, then start and end of
    # each call. Damage tears the end record of call 4 and the start record
    # of call 6; a crash in mid-copy tears the newest, call 9's end.
    for torn in (offsets[3 + 2 * 4], offsets[2 + 2 * 6], offsets[-1]):
        length = struct.unpack_from("<I", data, torn + 4)[0]
        data[torn + 24 + length // 2 : torn + 24 + length] = bytes(length - length // 2)
    # In place, the size kept: truncating a file this process still maps (its writer's heartbeat
    # stores into the header) would kill it with SIGBUS if the heartbeat came in between.
    with open(path, "r+b") as out:
        out.write(data)
    contents = sok.read_trace_file(path)
    assert contents.skipped == 3
    assert "3 record(s) torn" in contents.problems[0]
    assert "1 span end(s) whose start is not in the file" in contents.problems[1]
    # Call 4 started before the break in the records that call 6's lost start
    # makes: its end may be what was lost, so it is no call in flight.
    assert "1 span start(s) from before a break" in contents.problems[2]
    by_call = {s.attributes[K + "input.i"]: s for s in contents.spans}
    # Call 6 lost its start record, which holds its name and inputs.
    assert sorted(by_call) == [0, 1, 2, 3, 5, 7, 8, 9]
    assert by_call[9].in_flight  # its start record survived, its end was torn by the "crash"
    assert not any(s.in_flight for i, s in by_call.items() if i != 9)


def test_truncated_file_keeps_what_is_there(traced, tmp_path):
    traced(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    for _ in range(50):
        kernel()
    path = trace_path(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.sgltrace"
    cut.write_bytes(data[: fmt.HEADER_SIZE + 3000])
    contents = sok.read_trace_file(cut)
    assert "file truncated" in contents.problems[0]
    assert 5 < len(contents.spans) < 50


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        (b"", "empty file"),
        (b"hello, world\n" * 100, "not a sglang-otel-kernels trace file"),
        (b"SOKTRACE\x01", "truncated inside its header"),
        (fmt.HEADER_PREFIX.pack(fmt.MAGIC, 99, fmt.HEADER_SIZE, 1024, 0, 0), "format 99"),
    ],
)
def test_unreadable_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.sgltrace"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(sok.TraceFileError, match=message):
        sok.read_trace(path)
    for command in (["export"], ["report"], ["replay", "--endpoint", "http://127.0.0.1:9"]):
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_otel_kernels", *command, str(path)],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 2, command
        assert proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and message in proc.stderr


def test_random_garbage_never_crashes_the_reader(tmp_path):
    import random

    rng = random.Random(7)
    header = fmt.HEADER_PREFIX.pack(fmt.MAGIC, fmt.FORMAT_VERSION, fmt.HEADER_SIZE, 1 << 16, 2, 1 << 16) + b"{}"
    magic = struct.pack("<I", fmt.RECORD_MAGIC)
    for _ in range(30):
        ring = bytearray(rng.randbytes(1 << 16))
        for offset in range(0, len(ring), 512):  # plausible-looking record headers
            ring[offset : offset + 4] = magic
        path = tmp_path / "garbage.sgltrace"
        path.write_bytes(header.ljust(fmt.HEADER_SIZE, b"\0") + bytes(ring))
        contents = sok.read_trace_file(path)
        assert contents.spans == [] and contents.skipped > 0


def test_many_threads_never_corrupt_records(traced, tmp_path):
    traced(level=3)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x, t, i: x)
    barrier = threading.Barrier(8)

    def work(t):
        barrier.wait()
        for i in range(250):
            kernel(torch.ones(3), t=t, i=i)

    threads = [threading.Thread(target=work, args=(t,), name=f"worker-{t}") for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    contents = sok.read_trace_file(trace_path(tmp_path))
    assert contents.skipped == 0
    seen = {(s.attributes[K + "input.t"], s.attributes[K + "input.i"]) for s in contents.spans}
    assert seen == {(t, i) for t in range(8) for i in range(250)}
    assert all(s.thread_name == f"worker-{s.attributes[K + 'input.t']}" for s in contents.spans)


def test_fork_child_writes_its_own_file(traced, tmp_path):
    traced(level=3)
    kernel = sok.debug_kernel_api(op_name="k")(lambda who: None)
    kernel("parent-before")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(20):
                kernel("child")
            os.write(write_fd, (sok.trace_file_path() or "").encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    child_path = os.read(read_fd, 4096).decode()
    os.close(read_fd)
    os.waitpid(pid, 0)
    kernel("parent-after")
    parent = sok.read_trace_file(trace_path(tmp_path))
    assert parent.skipped == 0
    assert [s.attributes[K + "input.arg0"] for s in parent.spans] == ["parent-before", "parent-after"]
    assert child_path == str(tmp_path / f"trace_{pid}.sgltrace")
    child = sok.read_trace_file(child_path)
    assert child.metadata["pid"] == pid and child.metadata["forked_from"] == os.getpid()
    assert [s.attributes[K + "input.arg0"] for s in child.spans] == ["child"] * 20
    # The child's file has its own names: the parent's were written to the parent's file.
    assert {(s.name, s.scope_name, s.thread_name) for s in child.spans} == {("k", "sglang_otel_kernels", "MainThread")}


def test_fork_child_of_a_fixed_path_gets_a_suffixed_file(record, tmp_path):
    record(level=1)
    sok.configure(trace_file=str(tmp_path / "fixed.sgltrace"))
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    kernel()
    pid = os.fork()
    if pid == 0:
        kernel()
        os._exit(0)
    os.waitpid(pid, 0)
    assert len(sok.read_trace(tmp_path / "fixed.sgltrace")) == 1
    assert len(sok.read_trace(tmp_path / f"fixed.{pid}.sgltrace")) == 1


def test_ranks_get_their_own_files(tmp_path):
    script = (
        "import torch, sglang_otel_kernels as sok\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda x: x)\n"
        "for _ in range(5): k(torch.ones(1))\n"
        "print(sok.trace_file_path())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
            env={**clean_env("SGLANG_"), "SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                 "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3"},
        )
        for rank in range(3)
    ]
    paths = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert len(set(paths)) == 3
    for rank, path in enumerate(paths):
        contents = sok.read_trace_file(path)
        assert contents.metadata["ranks"] == {"rank": rank, "local_rank": rank, "world_size": 3}
        assert contents.metadata["resource"]["sglang.rank"] == rank
        assert os.path.basename(path) == f"sglang_kernel_trace_{contents.metadata['pid']}.sgltrace"
        assert len(contents.spans) == 5


@pytest.mark.parametrize("where", ["a-file/below/t.sgltrace", "a-file/t.sgltrace", "."])
def test_unwritable_path_warns_once_and_calls_go_on(traced, tmp_path, capsys, where):
    (tmp_path / "a-file").write_text("not a directory")
    exporter = traced(level=3)
    sok.configure(trace_file=str(tmp_path / where))
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x * 2)
    assert [kernel(i) for i in range(5)] == [0, 2, 4, 6, 8]
    err = capsys.readouterr().err
    assert err.count("cannot create the trace file") == 1
    assert len(exporter.get_finished_spans()) == 5
    assert sok.trace_file_path() is None


def test_full_disk_warns_once_and_calls_go_on(traced, tmp_path, capsys, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    exporter = traced(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: 42)
    assert [kernel() for _ in range(3)] == [42, 42, 42]
    err = capsys.readouterr().err
    assert err.count("No space left on device") == 1
    assert len(exporter.get_finished_spans()) == 3


def test_fsync_option_writes_readable_records(traced, tmp_path):
    traced(level=1, trace_file_fsync=True)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    for _ in range(20):
        kernel()
    assert len(sok.read_trace(trace_path(tmp_path))) == 20


def test_trace_file_off_writes_nothing(record, tmp_path):
    record(level=3)
    sok.configure(trace_file="off")
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    assert sok.trace_file_path() is None
    assert list(tmp_path.iterdir()) == []


def test_default_path_is_per_process_in_the_working_directory(tmp_path):
    script = (
        "import os, sglang_otel_kernels as sok\n"
        "sok.debug_kernel_api(op_name='k')(lambda: None)()\n"
        "print(os.getpid(), sok.trace_file_path())\n"
    )
    proc = run_python(script, tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off"})
    pid, path = proc.stdout.split()
    assert path == str(tmp_path / f"sglang_kernel_trace_{pid}.sgltrace")
    assert len(sok.read_trace(path)) == 1


def test_export_writes_otlp_json_lines(traced, provider, tmp_path):
    traced(level=5)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x / 0)
    with provider.get_tracer("server").start_as_current_span("Req"):
        kernel(torch.tensor([1.0, -1.0]))
    path = trace_path(tmp_path)
    out = tmp_path / "spans.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_otel_kernels", "export", str(path), "--format", "otlp-json", "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = out.read_text().splitlines()
    request = json.loads(line)
    (resource_spans,) = request["resourceSpans"]
    resource = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
    assert resource["process.pid"] == {"intValue": str(os.getpid())}
    spans = {s["name"]: s for scope in resource_spans["scopeSpans"] for s in scope["spans"]}
    recovered = {s.name: s for s in sok.read_trace(path)}
    kernel_span = spans["k"]
    assert kernel_span["traceId"] == f"{recovered['k'].trace_id:032x}"
    assert kernel_span["parentSpanId"] == spans["Req"]["spanId"]
    assert kernel_span["kind"] == 1 and kernel_span["startTimeUnixNano"] == str(recovered["k"].start_time)
    attributes = {a["key"]: a["value"] for a in kernel_span["attributes"]}
    assert attributes[K + "output.max"] == {"stringValue": "inf"}  # Jaeger cannot show a non-finite number
    assert attributes[K + "input.arg0.shape"] == {"arrayValue": {"values": [{"intValue": "2"}]}}
    assert kernel_span["events"][0]["name"] == "nonfinite_output"
    # Apart from OTLP's hex ids, it is the protobuf JSON mapping of the OTLP messages.
    for scope in resource_spans["scopeSpans"]:
        for span in scope["spans"]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in span:
                    span[key] = __import__("base64").b64encode(bytes.fromhex(span[key])).decode()
    message = json_format.ParseDict(request, ExportTraceServiceRequest())
    assert len(message.resource_spans[0].scope_spans[0].spans) + len(message.resource_spans[0].scope_spans) >= 2


def test_export_marks_in_flight_spans(tmp_path):
    script = (
        "import os, sglang_otel_kernels as sok\n"
        "sok.configure(level=3, log_dest='off', trace_file='t.sgltrace')\n"
        "sok.debug_kernel_api(op_name='dies')(lambda x: os._exit(1))(5)\n"
    )
    run_python(script, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_otel_kernels", "export", "t.sgltrace"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    span = json.loads(proc.stdout)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["name"] == "dies"
    assert span["status"]["code"] == 2 and "process ended" in span["status"]["message"]
    attributes = {a["key"]: a["value"] for a in span["attributes"]}
    assert attributes["sglang.kernel.in_flight"] == {"boolValue": True}
    assert attributes["sglang.kernel.input.arg0"] == {"intValue": "5"}
    assert int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"])


def test_a_file_configured_later_still_gets_the_resource(record, provider, tmp_path):
    record(level=1)
    sok.configure(trace_file=str(tmp_path / "first.sgltrace"))
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    sok.configure(trace_file=str(tmp_path / "second.sgltrace"))
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    for name in ("first", "second"):
        contents = sok.read_trace_file(tmp_path / f"{name}.sgltrace")
        assert contents.metadata["resource"] == dict(provider.resource.attributes)
        assert len(contents.spans) == 1


def test_threads_that_reuse_an_ident_keep_their_own_names(traced, tmp_path):
    traced(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    names = ["loader-a", "loader-b", "loader-c"]
    idents = set()
    for name in names:  # one after the other: Python hands a finished thread's ident to the next
        thread = threading.Thread(target=kernel, name=name)
        thread.start()
        thread.join()
        idents.add(thread.ident)
    spans = sok.read_trace(trace_path(tmp_path))
    assert [s.thread_name for s in spans] == names
    assert len({s.thread_id for s in spans}) == len(idents)


def test_a_missing_directory_of_the_trace_file_is_made_private(tmp_path):
    """SGLANG_KERNEL_API_TRACEFILE=/data/crash/trace_%i.sgltrace before
    /data/crash exists: the directory is made (0700), not the run lost."""
    script = (
        "import torch, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file='job/7/trace_%i.sgltrace')\n"
        "sok.debug_kernel_api(op_name='k')(lambda x: x)(torch.ones(1))\n"
    )
    proc = run_python(script, tmp_path)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    [path] = (tmp_path / "job" / "7").glob("trace_*.sgltrace")
    assert [span.name for span in sok.read_trace(path)] == ["k"]
    assert stat.S_IMODE((tmp_path / "job" / "7").stat().st_mode) == 0o700
