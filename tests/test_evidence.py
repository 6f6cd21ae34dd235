"""Crash evidence that can be trusted: the recorder never kills or stalls its
host, never destroys an earlier run's or another process's file, and the
reader never reports a crash that did not happen or trusts a file's bytes.
Real processes, real files; OTLP to a real receiver on loopback."""

import glob
import json
import marshal
import os
import re
import resource
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch

import sglang_otel_kernels as sok
from conftest import clean_env, run_python
from otlp_receivers import GrpcReceiver
from sglang_otel_kernels.record import tracefile as fmt
from sglang_otel_kernels.live.follow import RingFollower
from sglang_otel_kernels.record.reader import GAP, Assembler, scan, with_gaps

K = "sglang.kernel."
BAD_PATH = os.fsdecode(b"/data/w\xff.bin")  # a file name that is not UTF-8, as os.listdir returns it


def cli(*args, cwd=None, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def receiver():
    server = GrpcReceiver()
    yield server
    server.stop()


# -- the host never dies or stalls because of us ---------------------------------

TWO_WRITERS = """
import os, sys, time, torch, sglang_otel_kernels as sok
path, who, calls, gate = sys.argv[1:]
sok.configure(level=3, log_dest="off", trace_file=path, trace_file_size=1 << 20)
k = sok.debug_kernel_api(op_name="k")(lambda x, who, i: x)
for i in range(int(calls)):
    k(torch.ones(2), who, i)
    if i == 5 and gate != "-":  # hold the file mapped until the other process is done
        open(who + ".ready", "w").close()
        while not os.path.exists(gate):
            time.sleep(0.01)
print(sok.trace_file_path())
"""


def test_a_second_process_on_a_fixed_path_gets_its_own_file_and_the_first_lives(tmp_path):
    path = str(tmp_path / "fixed.sgltrace")
    script = tmp_path / "writer.py"
    script.write_text(TWO_WRITERS)
    env = clean_env()
    gate = str(tmp_path / "second-done")
    first = subprocess.Popen([sys.executable, str(script), path, str(tmp_path / "first"), "40", gate],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "first.ready").exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.02)
    # The first holds the file mapped and waits; the second starts on the same path.
    second = subprocess.run([sys.executable, str(script), path, str(tmp_path / "second"), "30", "-"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    open(gate, "w").close()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err  # no SIGBUS: its file was never truncated
    assert second.returncode == 0, second.stderr
    own = second.stdout.strip()
    assert re.fullmatch(re.escape(str(tmp_path / "fixed.")) + r"\d+\.sgltrace", own) and out.strip() == path
    assert second.stderr.count("is being written by another live process") == 1
    assert f"writes {own}" in second.stderr
    firsts = [s.attributes[K + "input.arg1"] for s in sok.read_trace(path)]
    seconds = [s.attributes[K + "input.arg1"] for s in sok.read_trace(own)]
    assert firsts == [str(tmp_path / "first")] * 40 and seconds == [str(tmp_path / "second")] * 30
    assert not glob.glob(str(tmp_path / "fixed.prev-*"))  # nothing was taken for an earlier run


SPAWN_PARENT = """
import multiprocessing as mp, torch, sglang_otel_kernels as sok

def work(n, paths):
    import sglang_otel_kernels as sok, torch
    k = sok.debug_kernel_api(op_name="child.k")(lambda x: x)
    for _ in range(n):
        k(torch.ones(2))
    paths.put(sok.trace_file_path())

if __name__ == "__main__":
    k = sok.debug_kernel_api(op_name="parent.k")(lambda x: x)
    k(torch.ones(2))
    context = mp.get_context("spawn")  # as SGLang starts its schedulers
    paths = context.Queue()
    children = [context.Process(target=work, args=(10, paths)) for _ in range(2)]
    for child in children:
        child.start()
    found = [paths.get(timeout=120) for _ in children]
    for child in children:
        child.join()
    for _ in range(5):
        k(torch.ones(2))
    print(sok.trace_file_path(), *found)
"""


def test_spawned_children_of_a_fixed_path_write_their_own_files(tmp_path):
    (tmp_path / "app.py").write_text(SPAWN_PARENT)
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "server.sgltrace"))
    proc = subprocess.run([sys.executable, "app.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    parent, *children = proc.stdout.split()
    assert parent == str(tmp_path / "server.sgltrace")
    assert len(set(children)) == 2 and parent not in children
    assert [s.name for s in sok.read_trace(parent)] == ["parent.k"] * 6
    assert sorted(len(sok.read_trace(child)) for child in children) == [10, 10]


@pytest.mark.parametrize("variable, value", [
    ("SGLANG_KERNEL_API_TRACEFILE_SIZE", "inf"),
    ("SGLANG_KERNEL_API_TRACEFILE_SIZE", "1e400"),
    ("SGLANG_KERNEL_API_TRACEFILE_SIZE", "1e19"),
    ("SGLANG_KERNEL_API_TRACEFILE_SIZE", "nan"),
    ("SGLANG_KERNEL_API_DUMP_MAX_BYTES", "inf"),
    ("SGLANG_KERNEL_API_DUMP_MAX_BYTES", "1e400"),
    ("SGLANG_KERNEL_API_DUMP_MAX_BYTES", "-1"),
    ("SGLANG_KERNEL_API_DUMP_MAX_COUNT", "1e400"),
    ("SGLANG_KERNEL_API_LOGLEVEL", "1e400"),
])
def test_an_absurd_setting_is_one_warning_and_the_default(tmp_path, variable, value):
    script = (
        "import sglang_otel_kernels as sok\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda: 7)\n"
        "assert [k() for _ in range(3)] == [7, 7, 7]\n"
        "c = sok.get_config()\n"
        "print(c.trace_file_size, c.dump_max_bytes, c.dump_max_count, sok.trace_file_path() is not None)\n"
    )
    env = {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
           "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace", variable: value}
    proc = run_python(script, tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"cannot parse {variable}") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    size, dump_bytes, dump_count, has_file = proc.stdout.split()
    assert (int(size), int(dump_bytes), int(dump_count)) == (16 << 20, 20 << 30, 1000)
    assert has_file == ("False" if variable == "SGLANG_KERNEL_API_LOGLEVEL" else "True")
    assert (tmp_path / "t.sgltrace").exists() == (has_file == "True")


# A file-size limit makes the allocation itself fail half-way, as a disk that fills up does.
FILE_SIZE_LIMIT = (
    "import resource, signal\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))\n"
)


@pytest.mark.parametrize("size, prelude, message", [
    ("1T", "", "MiB free on its filesystem"),  # refused before anything is written
    ("64M", FILE_SIZE_LIMIT, "nothing was left on disk"),  # the allocation fails, what it made is removed
])
def test_a_capacity_the_disk_cannot_hold_leaves_nothing_and_says_so_once(tmp_path, size, prelude, message):
    script = prelude + (
        "import sglang_otel_kernels as sok\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda: 7)\n"
        "assert [k() for _ in range(3)] == [7, 7, 7]\n"
        "print(sok.trace_file_path())\n"
    )
    proc = run_python(script, tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                                         "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace",
                                         "SGLANG_KERNEL_API_TRACEFILE_SIZE": size})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert proc.stderr.count("cannot create the trace file") == 1
    assert message in proc.stderr
    assert os.listdir(tmp_path) == []  # neither the file nor its temporary


def test_distinct_span_names_keep_the_name_table_and_every_write_bounded(record, provider, tmp_path):
    record(level=1)
    sok.configure(trace_file=str(tmp_path / "t.sgltrace"), trace_file_size=256 * 1024)
    tracer = provider.get_tracer("server")
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    import threading
    from sglang_otel_kernels.record import processor

    for i in range(30_000):  # a name per request, as SGLang's "Req <rid>" root spans have
        with tracer.start_as_current_span(f"Req {i:08x}"):
            kernel()
    names = [f"thread-{i}" for i in range(300)]
    done = threading.Event()

    def work():
        kernel()
        done.wait()  # alive until all have run: each thread its own ident

    threads = [threading.Thread(target=work, name=name) for name in names]
    for thread in threads:
        thread.start()
        while thread.ident not in processor.current_writer().threads:
            time.sleep(0.001)
    done.set()
    for thread in threads:
        thread.join()
    writer = processor.current_writer()
    assert writer.wraps > 10
    assert len(writer.symbols) <= fmt.MAX_SYMBOLS
    assert sum(fmt._symbol_size(value) for value in writer.symbols) <= writer.capacity // 16
    assert len(writer.threads) == writer.max_threads == 256
    # What a wrap writes, the TABLE, is bounded by those: no stall that grows with the names.
    table = fmt.encode((fmt.TABLE, {n: v for v, n in writer.symbols.items()}, dict(writer.threads)))
    assert len(table) < writer.capacity // 8
    spans = sok.read_trace(tmp_path / "t.sgltrace")
    requests = [s.name for s in spans if s.name.startswith("Req ")]
    assert requests and requests == [f"Req {int(n[4:], 16):08x}" for n in requests]  # named inline, read back
    assert int(requests[-1][4:], 16) == 29_999
    assert {s.name for s in spans} - set(requests) == {"k"}
    assert [s.thread_name for s in spans[-50:]] == names[-50:]


# -- the evidence survives ----------------------------------------------------------

CRASHING_RUN = """
import os, signal, sys, torch, sglang_otel_kernels as sok
sok.configure(level=3, log_dest="off", trace_file="trace_1.sgltrace")

@sok.debug_kernel_api(op_name="sglang.custom_op.step")
def step(x, i):
    if i == int(sys.argv[1]):
        os.abort()
    return x + 1

for i in range(10):
    step(torch.ones(2), i)
"""


def test_a_restart_on_the_same_path_keeps_the_crashed_run(tmp_path):
    # Containers run the server as pid 1 on every restart: `trace_%i` names the same file.
    (tmp_path / "server.py").write_text(CRASHING_RUN)
    env = clean_env()
    crashed = subprocess.run([sys.executable, "server.py", "4"], cwd=tmp_path, env=env, capture_output=True,
                             timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    assert crashed.returncode == -signal.SIGABRT
    assert "server.py" in (tmp_path / "trace_1.sgltrace.traceback").read_text()
    restarted = subprocess.run([sys.executable, "server.py", "-1"], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    [kept] = glob.glob(str(tmp_path / "trace_1.prev-*.sgltrace"))
    assert restarted.stderr.count("a trace file that no live process writes (an earlier run's)") == 1 and kept in restarted.stderr
    assert "server.py" in open(kept + ".traceback").read()
    assert [s.in_flight for s in sok.read_trace(kept)] == [False] * 4 + [True]
    assert not any(s.in_flight for s in sok.read_trace(tmp_path / "trace_1.sgltrace"))
    # The report on the directory still shows the crash, beside the clean restart.
    report = cli("report", str(tmp_path))
    assert report.returncode == 1, report.stderr
    assert "CRASHED: 1 kernel call(s)" in report.stdout
    assert "arg1 = 4" in report.stdout and "Python traceback (" in report.stdout


def test_a_symlink_or_a_foreign_file_at_the_path_is_refused_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    (tmp_path / "link.sgltrace").symlink_to(victim)
    (tmp_path / "notes.sgltrace").write_text("not a trace file\n")
    (tmp_path / "ok.sgltrace.traceback").symlink_to(victim)
    script = (
        "import sys, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file=sys.argv[1])\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda: 7)\n"
        "assert [k() for _ in range(3)] == [7, 7, 7]\n"
        "print(sok.trace_file_path())\n"
    )
    for name, message in [("link.sgltrace", "is a symbolic link"), ("notes.sgltrace", "is not a trace file"),
                          ("ok.sgltrace", "cannot enable faulthandler")]:
        proc = subprocess.run([sys.executable, "-c", script, name], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count(message) == 1, proc.stderr
        assert proc.stdout.strip() == (str(tmp_path / "ok.sgltrace") if name == "ok.sgltrace" else "None")
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert (tmp_path / "notes.sgltrace").read_text() == "not a trace file\n"
    assert (tmp_path / "link.sgltrace").is_symlink() and (tmp_path / "ok.sgltrace.traceback").is_symlink()


# -- the evidence does not lie ----------------------------------------------------


def test_a_start_whose_end_a_later_lap_overwrote_is_not_in_flight(record, provider, tmp_path):
    """A span starts near the end of one lap and ends early in the next; that
    lap ends short (a big record does not fit), so the following lap
    overwrites the end while the start survives in the gap at the ring's end."""
    record(level=1)
    path = tmp_path / "t.sgltrace"
    sok.configure(trace_file=str(path), trace_file_size=64 * 1024)
    from sglang_otel_kernels.record import processor

    tracer = provider.get_tracer("server")
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    kernel()
    writer = processor.current_writer()
    capacity = writer.capacity
    while writer._core.offset < capacity - 600:
        kernel()
    long_span = tracer.start_span("long request")
    start_offset = writer._core.offset
    while writer.wraps == 0:
        kernel()
    kernel()
    long_span.end()  # its end record sits at the start of the second lap
    while writer._core.offset < start_offset - 8000:
        kernel()
    # Too big for what is left of the lap: the ring wraps early, and this
    # record covers the long span's end, not its start.
    with tracer.start_as_current_span("big", attributes={"blob": "x" * (capacity - writer._core.offset + 100)}):
        pass
    assert writer.wraps == 2
    sok.configure(trace_file="off")  # closes the file, a clean exit
    contents = sok.read_trace_file(path)
    assert not any(s.in_flight for s in contents.spans)
    assert any("from before a break in the ring" in problem for problem in contents.problems)
    report = cli("report", str(path))
    assert report.returncode == 0, report.stdout
    assert "No kernel call was running" in report.stdout and "Also unfinished" not in report.stdout
    # The old reading, every unmatched start in flight, would have said "long request" was running.
    raw = Assembler()
    entries, _ = scan(path.read_bytes(), fmt.HEADER_SIZE, fmt.HEADER_SIZE + capacity)
    for record_ in with_gaps(entries):
        if record_ is not GAP:
            raw.add(record_)
    assert "long request" in [s.name for s in raw.in_flight()]


def test_a_lapped_follower_resynchronises_names_first_and_invents_nothing(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, sglang_otel_kernels as sok
        from opentelemetry import trace
        sok.configure(level=3, log_dest="off", trace_file=sys.argv[1], trace_file_size=64 * 1024)
        k = sok.debug_kernel_api(op_name="sglang.custom_op.step")(lambda x, i: x)
        tracer = trace.get_tracer("app")
        for r in range(int(sys.argv[2])):
            with tracer.start_as_current_span(f"request {r % 7}"):
                for i in range(10):
                    k(torch.ones(2), i)
    """)
    path = str(tmp_path / "t.sgltrace")
    proc = subprocess.Popen([sys.executable, "-c", script, path, "1500"], cwd=tmp_path)
    while not os.path.exists(path):
        assert proc.poll() is None
        time.sleep(0.005)
    time.sleep(0.05)
    follower = RingFollower(path)
    assembler = Assembler()
    spans = []
    while True:
        running = proc.poll() is None
        for record_ in follower.poll():
            pair = assembler.add(record_)
            if pair is not None:
                spans.append(assembler.span(*pair))
        if not running:
            break
        time.sleep(0.3)  # slow on purpose: the writer laps it
    assert proc.returncode == 0
    assert follower.lost > 0
    assert assembler.in_flight() == []  # a clean exit: nothing in flight, whatever was lost
    assert spans and not any("not in the file" in s.name for s in spans)
    assert {s.name for s in spans} <= {"sglang.custom_op.step"} | {f"request {r}" for r in range(7)}


def test_a_sidecar_lapped_by_its_writer_exports_no_invented_span(tmp_path, receiver):
    script = textwrap.dedent("""
        import os, time, torch, sglang_otel_kernels as sok
        from opentelemetry import trace
        sok.configure()
        k = sok.debug_kernel_api(op_name="sglang.custom_op.step")(lambda x, i: x)
        tracer = trace.get_tracer("app")
        # Until the test says stop: once the sidecar is up and reading (which
        # takes seconds on a loaded machine), the writer laps it. Calls written
        # before it reads anything are not lapped, just not read yet.
        r, until = 0, time.monotonic() + 240
        while not os.path.exists("stop") and time.monotonic() < until:
            with tracer.start_as_current_span(f"request {r % 7}"):
                for i in range(10):
                    k(torch.ones(2), i)
            r += 1
    """)
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="1",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"), SGLANG_KERNEL_API_TRACEFILE_SIZE="64K",
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        receiver.wait_for(lambda got: len(got) > 0, timeout=120)  # the sidecar reads and exports
        time.sleep(3)  # while the writer laps it
    finally:
        (tmp_path / "stop").touch()
    _, stderr = proc.communicate(timeout=300)  # once the sidecar, which shares its stderr, has finished too
    assert proc.returncode == 0, stderr
    assert "records were overwritten before they were read" in stderr
    spans = receiver.wait_for(lambda got: len(got) > 100)
    assert not any("not in the file" in s["name"] for s in spans)
    assert not any(K + "in_flight" in s["attributes"] or s["status"] == 2 for s in spans)


# -- hostile bytes and names ----------------------------------------------------------

SURROGATE_APP = """
import sys, torch, sglang_otel_kernels as sok
from opentelemetry import trace
sok.configure()

@sok.debug_kernel_api(op_name="sglang.custom_op.load")
def load(x, i):
    if i == 2:
        raise FileNotFoundError("no such weights file: " + PATH)  # str() keeps the lone surrogate
    return x

with trace.get_tracer("app").start_as_current_span("request"):
    for i in range(6):
        try:
            load(torch.ones(2), i)
        except FileNotFoundError:
            pass
print(sok.trace_file_path())
""".replace("PATH", repr(BAD_PATH))


@pytest.mark.parametrize("mode", ["in-process", "sidecar", "blackbox-sidecar"])
def test_a_message_that_is_not_utf8_reaches_the_back_end_with_every_other_span(tmp_path, receiver, mode):
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="stdout",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, PYTHONIOENCODING="utf-8:strict")
    if mode != "in-process":
        env["SGLANG_KERNEL_API_EXPORT_SIDECAR"] = "1"
    if mode == "blackbox-sidecar":
        env.update(SGLANG_KERNEL_API_BLACKBOX="1", SGLANG_KERNEL_API_LOGDEST="off")
    proc = subprocess.run([sys.executable, "-c", SURROGATE_APP], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 7)
    time.sleep(0.5)
    kernels = sorted((s for s in receiver.spans if s["name"] == "sglang.custom_op.load"), key=lambda s: s["start"])
    assert len(kernels) == 6 and len(receiver.spans) == 7
    assert [s["status"] for s in kernels] == [0, 0, 2, 0, 0, 0]
    assert "/data/w\\udcff.bin" in kernels[2]["status_message"]
    trace_file = proc.stdout.strip().splitlines()[-1]
    report = cli("report", trace_file, env={**env, "PYTHONIOENCODING": "utf-8:strict"})
    assert report.returncode == 1 and "Traceback" not in report.stderr, report.stderr
    assert "/data/w\\udcff.bin" in report.stdout
    replayed = GrpcReceiver()
    try:
        again = cli("replay", trace_file, "--endpoint", replayed.endpoint)
        assert again.returncode == 0, again.stderr
        assert len(replayed.wait_for(lambda got: len(got) >= 7)) == 7
    finally:
        replayed.stop()


def _record(encoding: int, payload: bytes, sequence: int) -> bytes:
    framed = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, len(payload), sequence, zlib.crc32(payload), encoding) + payload
    return framed + bytes(-len(framed) % fmt.ALIGN)


def _hostile_file(path, records: list) -> None:
    ring = b"".join(_record(encoding, payload, n + 1) for n, (encoding, payload) in enumerate(records))
    meta = json.dumps({"pid": 1, "host": "h", "ranks": "not a dict", "argv": [BAD_PATH]}).encode()
    header = fmt.HEADER_PREFIX.pack(fmt.MAGIC, fmt.FORMAT_VERSION, fmt.HEADER_SIZE, 1 << 16, len(meta), len(ring))
    path.write_bytes((header + meta).ljust(fmt.HEADER_SIZE, b"\0") + ring.ljust(1 << 16, b"\0"))


def _start(span_id: int, name: int, data, flags: int = 0, parent: int = 0) -> tuple:
    fixed = fmt.SPAN_START.pack(0, 7, span_id, parent, 1_000 + span_id, 1, name, 0, 0, flags)
    return fmt.ENCODING_SPAN_START, fixed + marshal.dumps(data)


def test_valid_records_with_hostile_content_are_validated_not_trusted(tmp_path):
    code = compile("import os; os.system('touch pwned')", "x", "exec")
    records = [
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.SYMBOL, 1, "batch"))),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.SYMBOL, 2, ("scope", 3)))),  # not a (str, str) scope
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.THREAD, "not an ident", "t"))),
        # A batch whose request ids are numbers, with keys that are not strings and a code object.
        _start(1, 1, {"sglang.batch.request_ids": (1, 2), 5: "int key", ("t",): 1, "code": code,
                      "big": 1 << 80, "bad": BAD_PATH, "sglang.batch.size": 2}),
        # A kernel inside it whose events, links and inputs are malformed.
        _start(2, 0, (BAD_PATH, ({"sglang.kernel.name": "k", "sglang.kernel.input.arg0": {1: 2}},
                                 ((1, 2, {}), "link", (0, 0, {})))), fmt.FLAG_INLINE_NAME | fmt.FLAG_LINKS, parent=1),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.END, 7, 2, 5_000, 2, BAD_PATH,
                                              (("exception", 4_000, {"exception.type": 3}), "bad event", ("e", -1, {})),
                                              {"sglang.kernel.name": "k", 9: 9}))),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.END, 7, 3, "not a time", 2, "", (), {}))),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.FAILURE, 1, code, "x"))),
        (fmt.ENCODING_MARSHAL, marshal.dumps(code)),
        _start(4, 1, "not a dict"),
        _start(5, 1, {"sglang.kernel.name": "k", "sglang.kernel.seq": "three"}, parent=1),
    ]
    path = tmp_path / "hostile.sgltrace"
    _hostile_file(path, records)
    (tmp_path / "hostile.sgltrace.traceback").write_bytes(b"Fatal Python error: \xff\xfe\n")
    contents = sok.read_trace_file(path)
    by_id = {s.span_id: s for s in contents.spans}
    assert by_id[1].attributes == {"sglang.batch.request_ids": (1, 2), "big": str(1 << 80),
                                   "bad": "/data/w\\udcff.bin", "sglang.batch.size": 2, K + "in_flight": True,
                                   "sglang.process.fatal_signal": "none"}  # its traceback is not believed
    assert by_id[2].name == "/data/w\\udcff.bin" and by_id[2].links == [(1, 2, {})]
    assert by_id[2].status_description == "/data/w\\udcff.bin"
    assert by_id[2].events == [("exception", 4_000, {"exception.type": 3})]  # the malformed two left out
    assert set(by_id) == {1, 2, 5} and by_id[5].in_flight
    assert contents.metadata["argv"] == ["/data/w\\udcff.bin"]
    env = dict(os.environ, PYTHONIOENCODING="ascii:strict")
    for args in (["report", str(path)], ["report", "--json", str(path)], ["export", str(path)],
                 ["export", "--format", "chrome", str(path)]):
        proc = cli(*args, cwd=tmp_path, env=env)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.stdout
    report = cli("report", str(path), cwd=tmp_path).stdout
    assert "batch batch: requests 1, 2" in report and "Fatal Python error" in report
    assert not (tmp_path / "pwned").exists()


def _kernel(span_id: int, name: int, data=None) -> tuple:
    fixed = fmt.KERNEL_SPAN.pack(0, 7, span_id, 0, 1_000 + span_id, 1, name, 0, 1, span_id, 1)
    return fmt.ENCODING_KERNEL_SPAN, fixed + (marshal.dumps(data) if data is not None else b"")


def _end(span_id: int) -> tuple:
    return fmt.ENCODING_COMPACT_END, fmt.COMPACT_END.pack(span_id, 9_000 + span_id, 0)


def test_collectives_ranks_and_the_exit_record_are_validated_not_trusted(tmp_path):
    code = compile("import os; os.system('touch pwned')", "x", "exec")
    good = ("all_reduce", "tp", (0, 1), 5, False, ("(4,)",), ("torch.float32",), None, None, "SUM", None, None, None)
    records = [
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.SYMBOL, 1, "torch.distributed.all_reduce"))),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.IDENTITY, {"rank": 3, "job": BAD_PATH, "code": code, 7: 1}))),
        _kernel(1, 1, {fmt.PACKED_COLLECTIVE: good}), _end(1),
        # Packed collectives that are not what a writer packs: each whole record is ignored.
        _kernel(2, 1, {fmt.PACKED_COLLECTIVE: good[:5]}), _end(2),
        _kernel(3, 1, {fmt.PACKED_COLLECTIVE: (code, *good[1:])}), _end(3),
        _kernel(4, 1, {fmt.PACKED_COLLECTIVE: (*good[:2], ("zero", 1), *good[3:])}), _end(4),
        _kernel(5, 1, {fmt.PACKED_COLLECTIVE: (*good[:3], 1 << 70, *good[4:])}), _end(5),
        _kernel(6, 1, {fmt.PACKED_COLLECTIVE: (*good[:5], (BAD_PATH,), *good[6:])}), _end(6),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.TABLE, {1: "torch.distributed.all_reduce"}, {}, "not a dict"))),
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.EXIT, "not a time"))),
    ]
    path = tmp_path / "hostile.sgltrace"
    _hostile_file(path, records)
    with open(path, "r+b") as handle:  # a heartbeat no clock gives
        handle.seek(fmt.ALIVE_OFFSET)
        handle.write(struct.pack("<q", -5))
    contents = sok.read_trace_file(path)
    spans = {s.span_id: s for s in contents.spans}
    assert set(spans) == {1, 6}
    assert {k: v for k, v in spans[1].attributes.items() if k.startswith("sglang.collective.")} == {
        "sglang.collective.op": "all_reduce", "sglang.collective.group": "tp", "sglang.collective.group_ranks": (0, 1),
        "sglang.collective.seq": 5, "sglang.collective.async_op": False, "sglang.collective.input_shapes": ("(4,)",),
        "sglang.collective.input_dtypes": ("torch.float32",), "sglang.collective.reduce_op": "SUM"}
    assert spans[6].attributes["sglang.collective.input_shapes"] == ("/data/w\\udcff.bin",)  # text made valid
    assert contents.metadata["ranks"] == {"rank": 3, "job": "/data/w\\udcff.bin"}  # the code object dropped
    assert contents.heartbeat == 0 and contents.exited is False
    assert "6 record(s) with a valid checksum but malformed content were ignored" in contents.problems
    for args in (["report", str(path)], ["report", "--json", str(path)], ["export", str(path)]):
        proc = cli(*args, cwd=tmp_path)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "pwned").exists()


def test_ends_with_their_outputs_are_validated_not_trusted(tmp_path):
    code = compile("import os; os.system('touch pwned')", "x", "exec")

    def attributed(span_id: int, payload: bytes, end_time: int = 0) -> tuple:
        fixed = fmt.COMPACT_END.pack(span_id, end_time or 9_000 + span_id, 0)
        return fmt.ENCODING_ATTRIBUTED_END, fixed + payload

    output = {"sglang.kernel.output.shape": (2, 4), "sglang.kernel.output.dtype": "torch.float32"}
    records = [
        (fmt.ENCODING_MARSHAL, marshal.dumps((fmt.SYMBOL, 1, "k"))),
        _kernel(1, 1), attributed(1, marshal.dumps(output)),
        # The same payload again (read once, shared), then one with values and keys a writer never writes.
        _kernel(2, 1), attributed(2, marshal.dumps(output)),
        _kernel(3, 1), attributed(3, marshal.dumps({"code": code, 5: "int key", "big": 1 << 80, "bad": BAD_PATH})),
        # Not marshal data, not a dict, a negative time, no attributes at all: each whole record ignored.
        _kernel(4, 1), attributed(4, b"\xff\x00garbage"),
        _kernel(5, 1), attributed(5, marshal.dumps(("not", "a dict"))),
        _kernel(6, 1), attributed(6, marshal.dumps(output), end_time=-1),
        _kernel(7, 1), attributed(7, b""),
    ]
    path = tmp_path / "hostile.sgltrace"
    _hostile_file(path, records)
    contents = sok.read_trace_file(path)
    spans = {s.span_id: s for s in contents.spans}
    assert spans[1].attributes["sglang.kernel.output.shape"] == (2, 4) and spans[1].end_time == 9_001
    assert spans[2].attributes["sglang.kernel.output.dtype"] == "torch.float32" and not spans[2].in_flight
    assert {k: v for k, v in spans[3].attributes.items() if k in ("code", "big", "bad")} == {
        "big": str(1 << 80), "bad": "/data/w\\udcff.bin"}
    assert [span_id for span_id in sorted(spans) if spans[span_id].in_flight] == [4, 5, 6, 7]  # their ends unread
    assert "4 record(s) with a valid checksum but malformed content were ignored" in contents.problems
    assert not (tmp_path / "pwned").exists()


def test_fifos_are_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.sgltrace"
    os.mkfifo(fifo)
    for args in (["report", str(fifo)], ["export", str(fifo)], ["follow", str(fifo), "--endpoint", "http://127.0.0.1:9"],
                 ["replay", str(fifo), "--endpoint", "http://127.0.0.1:9"]):
        proc = cli(*args, timeout=30)
        assert proc.returncode == 2 and "is a FIFO, not a trace file" in proc.stderr, (args, proc.stderr)
    # A FIFO where the traceback would be: the report goes on without it.
    kernel_file = tmp_path / "real.sgltrace"
    _hostile_file(kernel_file, [(fmt.ENCODING_MARSHAL, marshal.dumps((fmt.SYMBOL, 1, "k"))),
                                _start(1, 1, {"sglang.kernel.name": "k"})])
    os.mkfifo(str(kernel_file) + ".traceback")
    proc = cli("report", str(kernel_file), timeout=30)
    assert proc.returncode == 1 and "CRASHED" in proc.stdout and "Python traceback" not in proc.stdout


@pytest.mark.parametrize("mark", ["high-water mark", "format 2, no high-water mark"])
def test_a_huge_sparse_file_is_read_only_as_far_as_it_was_written(record, tmp_path, mark):
    record(level=1)
    path = tmp_path / "t.sgltrace"
    sok.configure(trace_file=str(path), trace_file_size=64 * 1024)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    for _ in range(5):
        kernel()
    sok.configure(trace_file="off")
    data = bytearray(path.read_bytes())
    # The same records in a ring said to hold 20 GB: a sparse file, nothing allocated.
    struct.pack_into("<Q", data, 16, 20 << 30)
    if mark.startswith("format 2"):  # an older version's file (or a crafted one): its holes are skipped
        struct.pack_into("<I", data, 8, 2)
    with open(path, "wb") as handle:
        handle.write(data)
        handle.truncate(fmt.HEADER_SIZE + (20 << 30))
    started = time.monotonic()
    proc = cli("report", str(path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "k " in proc.stdout and "      5 " in proc.stdout
    assert time.monotonic() - started < 30  # 53 s when the whole ring was scanned (format 2: until this change)


# -- code a dump names runs only on the user's word -----------------------------------


def _dump(directory, metadata: dict, tensors: dict | None = None):
    directory.mkdir()
    (directory / "metadata.json").write_text(json.dumps(metadata))
    if tensors is not None:
        torch.save(tensors, directory / "inputs.pt")


def test_rerun_never_runs_what_a_dump_names_on_its_own(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef f(*a):\n    pass\n")
    _dump(tmp_path / "system", {"function": "os:system", "execution_status": "completed", "positional_count": 1,
                                "keyword_names": [], "input_tensor_keys": [],
                                "input_metadata": {"arg_0": f"touch {marker}"}})
    _dump(tmp_path / "script", {"function": f"{evil}:f", "execution_status": "completed", "positional_count": 0,
                                "keyword_names": [], "input_tensor_keys": []})
    # A script under the working directory is suggested by its relative path.
    for name, named, said in (("system", "os:system", "os:system"), ("script", f"{evil}:f", "evil.py:f")):
        proc = cli("rerun", str(tmp_path / name), cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"the dump names the function {named!r}" in proc.stderr
        assert proc.stderr.rstrip().endswith(f"--function {said}")  # what would run, and how to say yes
        assert not marker.exists()


@pytest.mark.parametrize("metadata, message", [
    ({"input_tensor_keys": ["arg_0"], "input_tensor_devices": {"arg_0": "no-such-device:7"},
      "input_metadata": {"arg_1": {"type": "torch.device", "value": "bogus"}}, "positional_count": 2},
     "'bogus' is not a device"),
    ({"input_tensor_keys": "arg_0"}, "input_tensor_keys is not a list of names"),
    ({"input_tensor_keys": [], "positional_count": 10**12}, "is not a count of arguments"),
    ({"input_tensor_keys": [], "positional_count": 1, "input_metadata": {"arg_0__container":
                                                                         {"type": "list", "length": 10**12}}},
     "bad length"),
    ({"input_tensor_keys": [], "keyword_names": [1, 2]}, "keyword_names is not a list of names"),
    ({"input_tensor_keys": [], "input_metadata": ["x"]}, "input_metadata is not an object"),
])
def test_rerun_of_malformed_metadata_is_one_line_and_exit_2(tmp_path, metadata, message):
    _dump(tmp_path / "d", dict(metadata, execution_status="inputs_saved", function="torch:add"),
          {"arg_0": torch.ones(2)})
    proc = cli("rerun", str(tmp_path / "d"), "--function", "torch:add", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_the_sidecar_runs_the_installed_package_not_one_in_the_working_directory(tmp_path, receiver):
    fake = tmp_path / "cwd" / "sglang_otel_kernels"
    fake.mkdir(parents=True)
    marker = tmp_path / "fake-ran"
    for name in ("__init__.py", "__main__.py"):
        (fake / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    app = tmp_path / "app" / "server.py"
    app.parent.mkdir()
    app.write_text(textwrap.dedent("""
        import torch, sglang_otel_kernels as sok
        k = sok.debug_kernel_api(op_name="sglang.custom_op.step")(lambda x: x)
        for _ in range(5):
            k(torch.ones(2))
    """))
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="1",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    proc = subprocess.run([sys.executable, str(app)], cwd=tmp_path / "cwd", env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(receiver.wait_for(lambda got: len(got) >= 5)) == 5
    assert not marker.exists()


def test_a_live_writer_is_reported_as_running_not_crashed(tmp_path):
    gate = tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, time, torch, sglang_otel_kernels as sok
        sok.configure(level=3, log_dest="off", trace_file="t.sgltrace")

        @sok.debug_kernel_api(op_name="sglang.custom_op.wait")
        def wait(x):
            open("inside", "w").close()
            while not os.path.exists({str(gate)!r}):
                time.sleep(0.01)
            return x

        wait(torch.ones(2))
    """)
    env = clean_env()
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "inside").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        running = cli("report", str(tmp_path / "t.sgltrace"))
        assert running.returncode == 0, running.stdout
        assert "RUNNING: the writing process is alive; 1 kernel call(s) running now:" in running.stdout
        assert "CRASHED" not in running.stdout and ", still running" in running.stdout
        assert json.loads(cli("report", "--json", str(tmp_path / "t.sgltrace")).stdout)["crashed"] is False
        proc.kill()  # now it dies inside the call
        proc.wait(timeout=30)
        crashed = cli("report", str(tmp_path / "t.sgltrace"))
        assert crashed.returncode == 1 and "CRASHED: 1 kernel call(s)" in crashed.stdout
        assert "RUNNING" not in crashed.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
