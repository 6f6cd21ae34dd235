"""Following a live trace file (`sglang-otel-kernels follow`), and sidecar
export: the application's spans exported by another process, over a real
gRPC socket on loopback, including the call in flight when it was killed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from otlp_receivers import GrpcReceiver
import sglang_otel_kernels as sok
from sglang_otel_kernels.record import tracefile
from sglang_otel_kernels.live.follow import RingFollower
from conftest import clean_env

K = "sglang.kernel."


@pytest.fixture
def receiver():
    server = GrpcReceiver()
    yield server
    server.stop()


def test_the_follower_reads_every_record_once_in_order_across_wraps(tmp_path):
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.THREAD, 1, "first"))  # creates the file
    follower = RingFollower(writer.path)
    seen = []
    number = 0
    for burst in range(300):  # about 6 laps of the ring
        for _ in range(burst % 7 + 1):
            number += 1
            writer.append((tracefile.FAILURE, number, "E", "x" * 300))
        seen.extend(r[1] for r in follower.poll() if r[0] == tracefile.FAILURE)
    assert writer.wraps >= 4
    assert seen == list(range(1, number + 1))
    assert follower.lost == 0


def test_a_record_with_no_room_for_the_names_beside_it_is_no_loss(tmp_path):
    """A lap begins with the names table; a record too big to share the
    ring with it goes alone, and the follower counts nothing lost."""
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.FAILURE, 1, "E", ""))
    follower = RingFollower(writer.path)
    assert [r[1] for r in follower.poll()] == [1]
    writer.append((tracefile.FAILURE, 2, "E", "x" * (writer.capacity - 70)))  # laps, and fills the ring
    assert writer.wraps == 1
    assert [r[1] for r in follower.poll() if r[0] == tracefile.FAILURE] == [2]
    assert follower.lost == 0


def test_a_follower_lapped_by_the_writer_counts_what_it_lost_and_goes_on(tmp_path):
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.FAILURE, 0, "E", ""))
    follower = RingFollower(writer.path)
    assert [r[1] for r in follower.poll()] == [0]
    for number in range(1, 1001):  # 1000 x ~330 bytes: five times the ring, unread
        writer.append((tracefile.FAILURE, number, "E", "x" * 300))
    caught_up = [r[1] for r in follower.poll() if r[0] == tracefile.FAILURE]
    assert caught_up == list(range(caught_up[0], 1001)) and caught_up[0] > 1  # the newest, contiguous
    assert follower.lost >= caught_up[0] - 1
    writer.append((tracefile.FAILURE, 1001, "E", ""))
    assert [r[1] for r in follower.poll()] == [1001]


def test_a_half_written_record_is_read_once_it_is_whole(tmp_path):
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.FAILURE, 1, "E", ""))
    follower = RingFollower(writer.path)
    follower.poll()
    offset = writer._core.offset
    writer.append((tracefile.FAILURE, 2, "E", "y" * 100))
    whole = bytes(writer._view[tracefile.HEADER_SIZE + offset : tracefile.HEADER_SIZE + writer._core.offset])
    # As a reader sees it in the middle of the copy: the header there, the payload not yet.
    writer._view[tracefile.HEADER_SIZE + offset + 40 : tracefile.HEADER_SIZE + writer._core.offset] = \
        bytes(len(whole) - 40)
    assert follower.poll() == []
    writer._view[tracefile.HEADER_SIZE + offset : tracefile.HEADER_SIZE + writer._core.offset] = whole
    assert [r[1] for r in follower.poll()] == [2]


APP = """
import os, signal, sys, torch
from opentelemetry import trace
import sglang_otel_kernels as sok

sok.configure()  # tracing set up now, so that the request span below is recorded too

@sok.debug_kernel_api(op_name="sglang.custom_op.step")
def step(x, i):
    if i == DIE_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    return x + 1

tracer = trace.get_tracer("app")
with tracer.start_as_current_span("request"):
    for i in range(CALLS):
        step(torch.ones(2), i)
processors = trace.get_tracer_provider()._active_span_processor._span_processors
print("done", [type(p).__name__ for p in processors], flush=True)
"""


def run_app(tmp_path, receiver, calls: int, die_at: int, **extra_env: str) -> subprocess.CompletedProcess:
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="1",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="sidecar-test")
    env.update(extra_env)
    env = {key: value for key, value in env.items() if value is not None}  # None: unset it
    script = APP.replace("DIE_AT", str(die_at)).replace("CALLS", str(calls))
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_sidecar_exports_the_spans_and_the_call_that_was_running_when_the_process_was_killed(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=30, die_at=20)
    assert proc.returncode == -9, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 22, timeout=30)
    time.sleep(0.5)  # nothing more, and nothing twice
    spans = receiver.spans
    kernels = [s for s in spans if s["name"] == "sglang.custom_op.step"]
    assert sorted(s["attributes"][K + "input.arg1"] for s in kernels) == list(range(21))
    [dying] = [s for s in kernels if s["attributes"][K + "input.arg1"] == 20]
    assert dying["attributes"][K + "in_flight"] is True and dying["status"] == 2
    assert dying["attributes"][K + "input.arg0.shape"] == (2,)
    [request] = [s for s in spans if s["name"] == "request"]
    assert request["attributes"][K + "in_flight"] is True
    assert all(k["trace_id"] == request["trace_id"] and k["parent_span_id"] == request["span_id"] for k in kernels)
    assert all(s["resource"]["service.name"] == "sidecar-test" for s in spans)
    assert len(spans) == 22


def test_sidecar_exports_a_normal_run_once_and_exits_after_it(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=50, die_at=-1)
    # The only processor in the application writes the trace file: no exporter there.
    assert proc.returncode == 0 and proc.stdout.strip() == "done ['TraceFileProcessor']", proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 51, timeout=30)
    time.sleep(0.5)
    assert len(receiver.spans) == 51
    assert not any(K + "in_flight" in s["attributes"] for s in receiver.spans)
    # The sidecar is gone once it has sent everything.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _followers(tmp_path):
        time.sleep(0.1)
    assert _followers(tmp_path) == []


def test_sidecar_samples_as_otel_traces_sampler_says_and_always_sends_the_crash(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=10, die_at=5, OTEL_TRACES_SAMPLER="always_off")
    assert proc.returncode == -9, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 2, timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _followers(tmp_path):
        time.sleep(0.1)
    # Only the calls in flight: the kernel and the request around it; no ended call.
    assert sorted(s["name"] for s in receiver.spans) == ["request", "sglang.custom_op.step"]
    assert all(s["attributes"][K + "in_flight"] is True for s in spans)


def test_black_box_calls_reach_the_back_end_as_spans_built_by_the_sidecar(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=12, die_at=-1, SGLANG_KERNEL_API_BLACKBOX="1",
                   SGLANG_KERNEL_API_LOGLEVEL="1")
    assert proc.returncode == 0, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 13, timeout=30)
    [request] = [s for s in spans if s["name"] == "request"]
    calls = [s for s in spans if s["name"] == "sglang.custom_op.step"]
    assert sorted(s["attributes"][K + "seq"] for s in calls) == list(range(1, 13))
    assert all(s["attributes"][K + "blackbox"] is True for s in calls)
    assert all(s["trace_id"] == request["trace_id"] and s["parent_span_id"] == request["span_id"] for s in calls)


def test_sidecar_mode_without_a_trace_file_exports_in_process(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=5, die_at=-1, SGLANG_KERNEL_API_TRACEFILE="off")
    assert proc.returncode == 0, proc.stderr
    assert "the trace file is off, so there is no export sidecar: spans are exported from this process" in proc.stderr
    receiver.wait_for(lambda got: len(got) == 6)


def test_sidecar_mode_with_an_unwritable_trace_file_exports_in_process(tmp_path, receiver):
    proc = run_app(tmp_path, receiver, calls=5, die_at=-1, SGLANG_KERNEL_API_TRACEFILE="/proc/no/such/dir/t.sgltrace")
    assert proc.returncode == 0, proc.stderr
    assert "cannot create the trace file" in proc.stderr
    assert "without a trace file there is no export sidecar: spans are exported from this process" in proc.stderr
    receiver.wait_for(lambda got: len(got) == 6)


def test_the_sidecar_is_the_default_exporter_with_an_endpoint_and_absent_without(tmp_path, receiver):
    env = {"SGLANG_KERNEL_API_EXPORT_SIDECAR": None}
    proc = run_app(tmp_path, receiver, calls=5, die_at=3, **env)
    assert proc.returncode == -9, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) >= 5)
    [dying] = [s for s in spans if s["attributes"].get(K + "in_flight") and s["name"] != "request"]
    assert dying["attributes"][K + "input.arg1"] == 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _followers(tmp_path):
        time.sleep(0.1)
    assert _followers(tmp_path) == []
    # Without an endpoint: no sidecar at all, and the application says nothing about it.
    proc = run_app(tmp_path, receiver, calls=5, die_at=-1, OTEL_EXPORTER_OTLP_ENDPOINT=None, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "done ['TraceFileProcessor']"
    assert _followers(tmp_path) == []


def test_the_sidecar_runs_niced_beside_its_application(tmp_path, receiver):
    # Export is background work: it yields the cores to the application's.
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    app = subprocess.Popen(
        [sys.executable, "-c", "import sys, sglang_otel_kernels as sok\n"
         "sok.debug_kernel_api(op_name='k')(lambda: None)(); print('called', flush=True); sys.stdin.read()"],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert app.stdout.readline() == "called\n"
        [line] = _followers(tmp_path)
        niceness = lambda pid: int(subprocess.run(["ps", "-o", "ni=", "-p", str(pid)], capture_output=True,
                                                  text=True).stdout.strip() or -100)
        wanted = min(niceness(app.pid) + 10, 19)
        deadline = time.monotonic() + 30  # it renices itself as its first statement
        while niceness(line.split()[0]) != wanted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert niceness(line.split()[0]) == wanted
    finally:
        app.communicate("", timeout=60)
    receiver.wait_for(lambda got: any(span["name"] == "k" for span in got))


def _followers(tmp_path) -> list:
    # -ww: whole command lines, whatever COLUMNS says (pytest sets it)
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " follow " in line and str(tmp_path) in line]


def test_follow_command_for_a_process_already_gone(tmp_path, receiver):
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.THREAD, 1, "main"))
    writer.write_record(tracefile.ENCODING_KERNEL_START,
                        tracefile.KERNEL_START.pack(writer.symbol("k"), 1, 1_000, 1, 0, 0, 0))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "follow", writer.path, "--pid", str(gone.pid),
                           "--endpoint", receiver.endpoint], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [span] = receiver.wait_for(lambda got: len(got) == 1)
    assert span["name"] == "k" and span["attributes"][K + "in_flight"] is True
    assert "1 spans sent" in proc.stderr and "1 in flight" in proc.stderr


def test_a_process_gone_with_nothing_in_flight_reaches_the_back_end_as_a_death(tmp_path, receiver):
    """Killed idle (the OOM killer between requests), a process leaves no
    call in flight to carry how it ended: its sidecar sends a death span, so
    that what the back end holds reads "died", as the file does, not "ended"."""
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.THREAD, 1, "main"))
    writer.write_record(tracefile.ENCODING_KERNEL_START,
                        tracefile.KERNEL_START.pack(writer.symbol("k"), 1, 1_000, 1, 0, 0, 0))
    writer.write_record(tracefile.ENCODING_KERNEL_END, tracefile.KERNEL_END.pack(1, 2_000, 1))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "follow", writer.path, "--pid", str(gone.pid),
                           "--endpoint", receiver.endpoint], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    spans = receiver.wait_for(lambda got: len(got) == 2)
    [death] = [span for span in spans if span["name"] == "sglang.process.death"]
    assert death["status"] == 2 and death["attributes"]["sglang.process.fatal_signal"] == "none"
    assert death["resource"] == next(span["resource"] for span in spans if span["name"] == "k")
    # Read back as a back end holds it (an archive here; Jaeger's spans the same way): died, not ended.
    from sglang_otel_kernels.live.follow import death_span
    from sglang_otel_kernels.recover.otlp_json import json_lines

    script = ("import os, signal, torch, sglang_otel_kernels as sok\n"
              "sok.configure(level=1, log_dest='off', trace_file='idle.sgltrace')\n"
              "sok.debug_kernel_api(op_name='sglang.custom_op.k')(lambda x: x)(torch.ones(1))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    contents = sok.read_trace_file(tmp_path / "idle.sgltrace")
    contents.spans.append(death_span(contents.last_alive, ""))
    archive = tmp_path / "archive.json"
    archive.write_text("".join(line + "\n" for line in json_lines(contents)))
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(archive)], capture_output=True,
                          text=True, timeout=60, env=clean_env())
    assert text.returncode == 1, text.stdout + text.stderr
    assert text.stdout.startswith("the process died with no kernel call or batch running at "), text.stdout


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, as psutil's children(recursive=True) finds them."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            children = [int(child) for child in handle.read().split()]
    except OSError:
        children = []
    return [pid] + [found for child in children for found in _tree(child)]


def test_the_sidecar_outlives_a_kill_of_its_applications_process_tree(tmp_path, receiver):
    """SGLang's cleanup after a crash kills the whole process tree
    (kill_process_tree): a sidecar in that tree died with it, and what the
    crash left never reached the back end."""
    env = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="1",
                    SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
                    OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="tree-test")
    script = ("import time, torch, sglang_otel_kernels as sok\n"
              "@sok.debug_kernel_api(op_name='sglang.custom_op.stuck')\n"
              "def stuck(x):\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(60)\n"
              "stuck(torch.ones(1))\n")
    app = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        assert app.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not _followers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _followers(tmp_path), "no sidecar started"
        tree = _tree(app.pid)
        for pid in tree:  # as kill_process_tree does: every descendant, then the process
            os.kill(pid, signal.SIGKILL)
    finally:
        app.kill()
        app.wait(timeout=60)
    [span] = receiver.wait_for(lambda got: len(got) >= 1, timeout=60)
    assert span["name"] == "sglang.custom_op.stuck" and span["attributes"][K + "in_flight"] is True
    assert span["attributes"]["sglang.process.fatal_signal"] == "none"


def test_follow_command_errors(tmp_path):
    from sglang_otel_kernels.__main__ import main

    (tmp_path / "junk").write_bytes(b"not a trace file at all")
    env_before = os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    try:
        assert main(["follow", str(tmp_path / "junk"), "--pid", "1"]) == 2
    finally:
        if env_before is not None:
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = env_before
    assert main(["follow", str(tmp_path / "junk"), "--endpoint", "http://127.0.0.1:9", "--pid", "1"]) == 2
    assert main(["follow", str(tmp_path / "never"), "--endpoint", "http://127.0.0.1:9", "--wait", "0.3"]) == 2


APP_WITH_PROVIDER = """
import sys, torch
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1], insecure=True)))
trace.set_tracer_provider(provider)  # the application's own, as SGLang's --enable-trace installs
import sglang_otel_kernels as sok
step = sok.debug_kernel_api(op_name="sglang.custom_op.step")(lambda x: x + 1)
with trace.get_tracer("app").start_as_current_span("request"):
    for _ in range(5):
        step(torch.ones(2))
provider.shutdown()
"""


@pytest.mark.parametrize("sidecar", ["1", "kernels"])
def test_an_application_provider_gets_kernel_spans_or_leaves_them_to_the_sidecar(tmp_path, receiver, sidecar):
    """The application exports to its own back end; OTEL_EXPORTER_OTLP_ENDPOINT (the sidecar's) is
    another receiver: where the kernel spans land says who sent them."""
    application = GrpcReceiver()
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR=sidecar,
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    try:
        proc = subprocess.run([sys.executable, "-c", APP_WITH_PROVIDER, application.endpoint], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _followers(tmp_path):
            time.sleep(0.1)
        assert _followers(tmp_path) == []
        own = application.wait_for(lambda got: len(got) >= (6 if sidecar == "1" else 1))
        time.sleep(0.5)
        by_sidecar = receiver.spans
    finally:
        application.stop()
    [request] = [s for s in own if s["name"] == "request"]
    kernels = [s for s in own + by_sidecar if s["name"] == "sglang.custom_op.step"]
    assert len(kernels) == 5 and len(own) + len(by_sidecar) == 6  # each span once
    assert all(k["trace_id"] == request["trace_id"] and k["parent_span_id"] == request["span_id"] for k in kernels)
    if sidecar == "1":  # handed to the application's processors, no sidecar
        assert by_sidecar == []
        # The application's resource names no process; the kernel spans carry this one's under it (the
        # application's own span keeps its resource): a report read from the back end tells processes apart.
        [pid] = {k["resource"]["process.pid"] for k in kernels}
        assert all(k["resource"]["service.name"] == request["resource"]["service.name"] for k in kernels)
        assert "host.name" in kernels[0]["resource"] and "process.pid" not in request["resource"]
        assert [p.name for p in tmp_path.glob("trace_*.sgltrace")] == [f"trace_{pid}.sgltrace"]
    else:  # exported by the sidecar, the application's request span by the application alone
        assert [s["name"] for s in own] == ["request"] and len(by_sidecar) == 5
        # Listed as delivered: a replay to the sidecar's endpoint sends none of them again. (The file holds
        # the five kernel spans and the request span, begun before the first kernel call and recorded when
        # that call attached the trace file; the application exported it itself.)
        [path] = [str(p) for p in tmp_path.glob("trace_*.sgltrace")]
        again = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--endpoint",
                                receiver.endpoint], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert "replayed 0 spans" in again.stdout and "left out 6 spans" in again.stdout, again.stdout


def test_an_application_provider_that_exports_its_kernel_spans_leaves_the_sidecar_only_what_its_death_left(
        tmp_path, receiver):
    """The application's provider exports every span it ends, kernel calls
    included (SGLANG_KERNEL_API_EXPORT_SIDECAR=1, the default): a sidecar
    reads the file once the process has ended (`follow --ending-only`) and
    sends what the application never could, the call it died in and the
    request span around it, and nothing the application sent."""
    application = GrpcReceiver()
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    program = APP_WITH_PROVIDER.replace("provider.shutdown()", "").replace(
        "        step(torch.ones(2))\n",
        "        step(torch.ones(2))\n"
        "    provider.force_flush()  # what the application exported before it died\n"
        "    import os, signal\n"
        "    sok.debug_kernel_api(op_name='sglang.custom_op.die')(lambda x: os.kill(os.getpid(), signal.SIGKILL))(x)\n")
    program = program.replace("with trace.get_tracer", "x = torch.ones(2)\nwith trace.get_tracer")
    try:
        proc = subprocess.run([sys.executable, "-c", program, application.endpoint], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        by_sidecar = receiver.wait_for(lambda got: len(got) >= 2)
        own = application.wait_for(lambda got: len(got) >= 5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _followers(tmp_path):
            time.sleep(0.1)
        assert _followers(tmp_path) == []
        time.sleep(0.5)
    finally:
        application.stop()
    assert sorted(s["name"] for s in own) == ["sglang.custom_op.step"] * 5
    assert sorted(s["name"] for s in receiver.spans) == ["request", "sglang.custom_op.die"]
    [died] = [s for s in by_sidecar if s["name"] == "sglang.custom_op.die"]
    [request] = [s for s in by_sidecar if s["name"] == "request"]
    assert died["attributes"][K + "in_flight"] is True and died["status"] == 2
    assert died["parent_span_id"] == request["span_id"] == own[0]["parent_span_id"]


def test_batch_spans_on_an_application_provider_carry_the_process_as_kernel_spans_do(tmp_path):
    """SGLang's --enable-trace provider names no process in its resource: the
    batch span and the kernel calls this package makes through it carry this
    process's pid and host under the application's resource, so a report
    read from the back end puts the batch with its calls; the application's
    own span keeps its resource."""
    application = GrpcReceiver()
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="0",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    program = APP_WITH_PROVIDER.replace("    for _ in range(5):\n        step(torch.ones(2))",
                                        "    with sok.forward_batch([{}], name='decode_batch'):\n        step(torch.ones(2))")
    try:
        proc = subprocess.run([sys.executable, "-c", program, application.endpoint], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = application.wait_for(lambda spans: len(spans) >= 3)
    finally:
        application.stop()
    by_name = {span["name"]: span for span in got}
    [path] = tmp_path.glob("trace_*.sgltrace")
    for name in ("decode_batch", "sglang.custom_op.step"):
        assert path.name == f"trace_{by_name[name]['resource']['process.pid']}.sgltrace", by_name[name]["resource"]
        assert by_name[name]["resource"]["service.name"] == by_name["request"]["resource"]["service.name"]
    assert "process.pid" not in by_name["request"]["resource"]


class _ScriptedBackEnd:
    """An exporter that refuses the batches starting with a span of `refuse`
    (once each), and answers the first batch only once the second arrived
    and `release` is set."""

    def __init__(self, refuse: set, held: bool = False) -> None:
        import threading

        self.refuse, self.got, self.second, self.release = set(refuse), [], threading.Event(), threading.Event()
        if not held:
            self.release.set()

    def export(self, batch):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.got.append(list(batch))
        if len(self.got) == 1:
            assert self.second.wait(10)  # answered out of order: settled in order all the same
        else:
            self.second.set()
        assert self.release.wait(10)
        if batch[0] in self.refuse:
            self.refuse.discard(batch[0])
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def _sender(back_end, spans: int):
    from sglang_otel_kernels.live.follow import _Outbox, _Sender

    outbox = _Outbox(None)
    for span in range(spans):
        outbox.queue(span, span + 1)
    sender = _Sender(back_end, outbox, "t.sgltrace")
    sender._FLYING = 2  # the mechanism, with two on their way (the sidecar has more)
    return outbox, sender


def test_the_sender_has_two_batches_on_their_way_and_sends_again_what_was_not_taken(capsys):
    from sglang_otel_kernels.recover.resend import BATCH

    back_end = _ScriptedBackEnd(refuse={BATCH})  # the second batch, answered before the first
    outbox, sender = _sender(back_end, 3 * BATCH + 10)
    try:
        sender.pump()  # two whole batches go at once; the rest waits for a whole one, or a drain
        assert [batch[0] for batch in back_end.got] == [0, BATCH] and len(outbox.spans) == 3 * BATCH + 10
        for future, _ in list(sender._flights):
            future.result()
        sender.pump()  # both answered: the first is taken, the second not; nothing more goes until a retry
        assert outbox.spans[:2] == [BATCH, BATCH + 1] and len(outbox.spans) == 2 * BATCH + 10
        assert len(back_end.got) == 2 and "did not take 512 spans" in capsys.readouterr().err
        sender.retry()
        sender.drain()
    finally:
        sender.close()
    assert outbox.spans == [] and sender.sent == 3 * BATCH + 10
    assert [batch[0] for batch in back_end.got] == [0, BATCH, BATCH, 2 * BATCH, 3 * BATCH]


def test_the_sender_drops_the_oldest_spans_past_its_bound_but_not_those_on_their_way():
    from sglang_otel_kernels.recover.resend import BATCH

    back_end = _ScriptedBackEnd(refuse={0}, held=True)
    outbox, sender = _sender(back_end, 4 * BATCH)
    try:
        sender.pump()  # two on their way, the back end holding them
        assert sender.trim(BATCH) == 2 * BATCH  # only those not on their way can go
        assert outbox.spans == list(range(2 * BATCH))
        back_end.release.set()
        for future, _ in list(sender._flights):
            future.result()
        sender.pump()  # the first refused, kept to be sent again; the second taken
        for span in range(4 * BATCH, 5 * BATCH):
            outbox.queue(span, 0)
        assert sender.trim(BATCH // 2) == BATCH + BATCH // 2  # the kept batch is the oldest: it goes first
        assert outbox.spans == list(range(4 * BATCH + BATCH // 2, 5 * BATCH))
        sender.retry()
        sender.drain()
    finally:
        sender.close()
    assert outbox.spans == [] and sender.sent == BATCH + BATCH // 2


class _KeptMetrics:
    """A metric exporter keeping each export's cumulative points: (name, sorted attributes) -> value."""

    def __new__(cls):
        from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult

        class Kept(MetricExporter):
            def __init__(self):
                super().__init__(preferred_temporality={})
                self.exports: list[dict] = []

            @property
            def points(self) -> dict:
                return {key: value for export in self.exports for key, value in export.items()}

            def export(self, metrics_data, timeout_millis=10_000, **kwargs):
                points = {}
                for resource_metrics in metrics_data.resource_metrics:
                    for scope in resource_metrics.scope_metrics:
                        for metric in scope.metrics:
                            temporality = getattr(metric.data, "aggregation_temporality", AggregationTemporality.CUMULATIVE)
                            for point in metric.data.data_points:
                                if temporality is AggregationTemporality.CUMULATIVE:
                                    points[(metric.name, tuple(sorted(point.attributes.items())))] = point.value
                self.exports.append(points)
                return MetricExportResult.SUCCESS

            def force_flush(self, timeout_millis=10_000):
                return True

            def shutdown(self, timeout_millis=30_000, **kwargs):
                pass

        return Kept()


def test_the_sidecars_call_counts_are_added_per_kind_of_call_under_the_labels_they_had():
    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.live.metrics import KernelMetrics

    exported = _KeptMetrics()
    metrics = KernelMetrics(exported, Resource({}))
    for _ in range(3):
        metrics.call("k", False, False)
    metrics.call("k", True, True)
    metrics.labels = {"sglang.rank": 2}  # the calls so far keep no rank; those after carry rank 2
    metrics.call("k", True, False)
    metrics.flush()
    metrics.call("j", False, False)
    metrics.close()  # what was kept goes out with the last export
    name = (("sglang.kernel.name", "k"),)
    ranked = lambda kernel: (("sglang.kernel.name", kernel), ("sglang.rank", 2))  # noqa: E731
    assert exported.points[("sglang.kernel.calls", name)] == 4
    assert exported.points[("sglang.kernel.failures", name)] == 1
    assert exported.points[("sglang.kernel.nonfinite", name)] == 1
    assert exported.points[("sglang.kernel.calls", ranked("k"))] == 1
    assert exported.points[("sglang.kernel.failures", ranked("k"))] == 1
    assert exported.points[("sglang.kernel.calls", ranked("j"))] == 1
    # A kernel's failure and NaN/Inf series exist from its first call: an alert on their increase sees the first.
    assert exported.points[("sglang.kernel.nonfinite", ranked("k"))] == 0
    assert exported.points[("sglang.kernel.failures", ranked("j"))] == 0
    assert exported.points[("sglang.kernel.nonfinite", ranked("j"))] == 0


def test_the_nan_flags_mark_counts_its_calls_nan_once_and_no_call():
    """The NaN flags' mark (sent after the call ended and was counted)
    adds to the call's NaN/Inf series, which KernelMadeNaN pages on, and not
    to its calls; the mark in a request's trace is the same NaN, not counted;
    a mark with its call's module path counts in a series with that label."""
    from types import SimpleNamespace

    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.live.metrics import KernelMetrics

    exported = _KeptMetrics()
    metrics = KernelMetrics(exported, Resource({}))
    metrics.call("layer1", False, False)
    mark = {"sglang.kernel.nonfinite_flag": True, "sglang.kernel.nonfinite_call": "layer1"}
    metrics.count(SimpleNamespace(name="sglang.kernel.nonfinite", attributes=mark, in_flight=False))
    metrics.count(SimpleNamespace(name="sglang.kernel.nonfinite", attributes={**mark, "sglang.request.id": "r1"},
                                  in_flight=False))
    # A mark that knows its call's layer counts it under the layer too (KernelMadeNaN names it).
    metrics.count(SimpleNamespace(name="sglang.kernel.nonfinite", in_flight=False,
                                  attributes={**mark, "sglang.kernel.module": "model.layers.1.mlp"}))
    metrics.close()
    name = (("sglang.kernel.name", "layer1"),)
    assert exported.points[("sglang.kernel.calls", name)] == 1
    assert exported.points[("sglang.kernel.nonfinite", name)] == 1
    layer = (("sglang.kernel.module", "model.layers.1.mlp"), ("sglang.kernel.name", "layer1"))
    assert exported.points[("sglang.kernel.nonfinite", layer)] == 1


def test_the_sidecars_gauges_name_the_innermost_call_and_read_0_once_when_it_is_over():
    from types import SimpleNamespace

    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.live.metrics import KernelMetrics, labels_of

    exported = _KeptMetrics()
    metrics = KernelMetrics(exported, Resource({}))
    # A file's header is hostile: a label too long or of another type is left out.
    metrics.labels = labels_of({"host": "node-b", "ranks": {"rank": "2", "job": "tcp://10.0.0.1:1" + "x" * 300}})
    assert metrics.labels == {"sglang.rank": 2, "host.name": "node-b"}
    metrics.labels = labels_of({"host": "node-b", "ranks": {"rank": 2, "job": "tcp://10.0.0.1:1"}})
    call = lambda name, start, **attributes: SimpleNamespace(name=name, start_time=int(start * 1e9),  # noqa: E731
                                                             attributes={"sglang.kernel.name": name, **attributes})
    outer, inner = call("model.forward", 1), call("layer.stuck", 2)
    metrics.in_flight([outer, inner], int(14.5e9))
    metrics.provider.force_flush()
    where = (("host.name", "node-b"), ("sglang.job", "tcp://10.0.0.1:1"), ("sglang.rank", 2))
    stuck = tuple(sorted(where + (("sglang.kernel.collective", False), ("sglang.kernel.name", "layer.stuck"))))
    gauge = "sglang.kernel.in_flight.longest"
    assert {key: value for key, value in exported.exports[-1].items() if key[0] == gauge} == {(gauge, stuck): 12.5}
    waiting = call("torch.distributed.all_reduce", 13, **{"sglang.collective.op": "all_reduce"})
    metrics.in_flight([waiting], int(15e9))
    metrics.provider.force_flush()
    collective = tuple(sorted(where + (("sglang.kernel.collective", True),
                                       ("sglang.kernel.name", "torch.distributed.all_reduce"))))
    # The stuck call's series reads 0 once, so that its last value does not linger where it is served.
    assert {key: value for key, value in exported.exports[-1].items() if key[0] == gauge} == {
        (gauge, collective): 2.0, (gauge, stuck): 0}
    metrics.ended({"kind": "killed", "signal": None, "died_in": {"name": "layer.stuck", "collective": False},
                   "why": "killed", "call": "model.forward", "pages": True})
    metrics.provider.force_flush()
    metrics.provider.force_flush()
    death = "sglang.kernel.in_flight_at_death"
    assert {key: value for key, value in exported.exports[-1].items() if key[0] in (gauge, death)} == {
        (death, tuple(sorted(stuck + (("sglang.process.fatal_signal", "none"),)))): 1}
    metrics.close()


def _ended_span(name, status="OK", exception=None, **attributes):
    from sglang_otel_kernels.record.reader import RecoveredSpan

    events = [("exception", 0, {"exception.type": exception, "exception.message": "m"})] if exception else []
    return RecoveredSpan(name, 1, 0, 0, False, 1, 0, 0, status, "", attributes, events, [], 1, None, "", "", 1, False)


def _crashes(*spans, died=True, signal=""):
    """What `sglang.process.crashed` and `sglang.kernel.in_flight_at_death` say of a process whose file held
    `spans` (ended in this order), as the sidecar decides it: the spans kept as they pass, the ending the
    verdict's, the gauges rendering it."""
    import dataclasses

    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.live.ending_spans import EndingSpans
    from sglang_otel_kernels.live.metrics import KernelMetrics
    from sglang_otel_kernels.record.reader import Assembler

    exported = _KeptMetrics()
    metrics = KernelMetrics(exported, Resource({}))
    metrics.labels = {"sglang.rank": 0}
    kept = EndingSpans(Assembler())
    for number, span in enumerate(spans, 1):
        span = dataclasses.replace(span, span_id=number, start_time=number * 10**9, end_time=number * 10**9 + 1000)
        metrics.count(span)
        kept.keep(span)
    end = (len(spans) + 1) * 10**9
    metrics.ended(kept.ending("trace_1.sgltrace", {"pid": 1}, [], end, not died, end if signal else 0, signal))
    metrics.close()
    return {key: value for key, value in exported.points.items()
            if key[0] in ("sglang.process.crashed", "sglang.kernel.in_flight_at_death")}


def test_a_process_gone_outside_any_kernel_call_is_gauged_as_a_crash_with_why():
    call = lambda name, status="OK", exception=None: _ended_span(  # noqa: E731
        name, status, exception, **{"sglang.kernel.name": name})
    batch = _ended_span("sglang.forward_batch", "ERROR", "IndexError", **{"sglang.batch.size": 1})
    raised = _ended_span("sglang.process.exception", "ERROR", "AcceleratorError")
    crashed = lambda reason, kernel: {  # noqa: E731
        ("sglang.process.crashed", (("sglang.kernel.name", kernel), ("sglang.process.reason", reason),
                                    ("sglang.rank", 0))): 1}
    # Killed between kernels (the OOM killer), of a fatal signal between them, by its parent after its batch failed.
    assert _crashes(call("a"), call("b")) == crashed("killed", "b")
    assert _crashes(call("a"), signal="SIGSEGV") == crashed("SIGSEGV", "a")
    assert _crashes(call("a"), call("embedding", "ERROR", "IndexError"), batch) == crashed("IndexError", "embedding")
    # An exception no code caught, then an exit: a device error raised after its kernel call returned.
    assert _crashes(call("a"), raised, died=False) == crashed("AcceleratorError", "a")
    # An exit right after its batch failed (SGLang's scheduler returns then), and after a failed call.
    assert _crashes(call("embedding", "ERROR", "IndexError"), batch, died=False) == crashed("IndexError", "embedding")
    assert _crashes(call("a", "ERROR", "RuntimeError"), died=False) == crashed("RuntimeError", "a")
    # A failure it went on after says nothing of its end: killed later, or an exit, which is no crash.
    assert _crashes(call("a", "ERROR", "RuntimeError"), call("a")) == crashed("killed", "a")
    assert _crashes(call("a", "ERROR", "RuntimeError"), call("a"), died=False) == {}
    assert _crashes(call("a"), died=False) == {}
    # A process that made no kernel call (a server's front end) pages for nothing when killed.
    assert _crashes(_ended_span("http.request")) == {}
    # Told to stop (SGLang's shutdown request), then killed while stopping: stopped on purpose, as `report` says.
    stop = _ended_span("sglang.process.stop", **{"sglang.process.stop_reason": "ShutdownReq"})
    assert _crashes(call("a"), stop) == {}
    # A thread an exception no code caught ended stays ended: calls that went on after it make no clean exit.
    assert _crashes(call("a"), raised, call("b"), died=False) == crashed("AcceleratorError", "b")


def test_watch_gauges_the_suspects_of_live_jobs_only_and_a_suspect_gone_reads_0_once():
    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.live.metrics import JobMetrics

    exported = _KeptMetrics()
    metrics = JobMetrics(exported, Resource({}))
    ranks = lambda *states: [{"rank": n, "state": s, "host": f"node-{n}"} for n, s in enumerate(states)]  # noqa: E731
    suspect = {"rank": 1, "reason": "missing", "call": None}
    metrics.verdicts([{"job": "j", "ranks": ranks("running", "running"), "suspects": [suspect]}])
    metrics.provider.force_flush()
    key = ("sglang.job.suspect", (("host.name", "node-1"), ("reason", "missing"), ("sglang.job", "j"),
                                  ("sglang.rank", 1)))
    assert exported.exports[-1] == {key: 1}
    metrics.verdicts([{"job": "j", "ranks": ranks("died", "died"), "suspects": [suspect]}])  # killed: nobody to page for
    metrics.provider.force_flush()
    assert exported.exports[-1] == {key: 0}
    exports = len(exported.exports)
    metrics.provider.force_flush()
    assert all(key not in export for export in exported.exports[exports:])  # (nothing to export: no export)
    metrics.close()
