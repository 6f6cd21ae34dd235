"""Does the export sidecar keep up? An application makes level-3 kernel calls
as fast as it can (or at --rate) for --seconds into the default 16 MiB trace
file, with the sidecar exporting to a live local receiver; prints the calls
made per second, the records the sidecar lost to being lapped (its own
count), and the spans the receiver got against the spans the file held.

    python bench/sidecar_rate.py [--seconds 10] [--rate 50000] [--size 16M]
    python bench/sidecar_rate.py --drain 100000 [--size 64M]
    python bench/sidecar_rate.py --live 500000 [--rate 50000] [--starve 3]

The target: 50 000 level-3 calls a second for 10 s without a lost record.
One Python thread on this machine makes fewer than that at level 3, so the
rate reached is printed beside the target: the figure to read is the lost
count at the rate the application reached. On this 2-core machine the
application, the sidecar and the receiver share the cores; `--drain N` times
the sidecar alone: N level-3 calls written first (no sidecar), then the
sidecar's command (`follow`) exporting them all to the receiver, from its
start to its exit. `--starve S` adds a slow spell to a `--live` run: one busy
process per core and one more, for S seconds from 2 s into the writing.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from local_receiver import live_receiver

APP = r"""
import sys, time, torch, sglang_otel_kernels as sok
seconds, rate = float(sys.argv[1]), float(sys.argv[2])
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x)
x, w = torch.randn(4, 4096), torch.randn(4096)
calls, started = 0, time.perf_counter()
deadline = started + seconds
while True:
    now = time.perf_counter()
    if now >= deadline:
        break
    for _ in range(100):
        kernel(x, w, eps=1e-5)
    calls += 100
    ahead = calls / rate - (time.perf_counter() - started)
    if ahead > 0:
        time.sleep(ahead)
elapsed = time.perf_counter() - started
print(calls, elapsed, sok.trace_file_path(), flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=50_000.0, help="calls a second to aim at")
    parser.add_argument("--size", default="16M", help="SGLANG_KERNEL_API_TRACEFILE_SIZE")
    parser.add_argument("--drain", type=int, metavar="N", help="time the sidecar alone on N calls written first")
    parser.add_argument("--live", type=int, metavar="N",
                        help="the records of N calls written again at --rate into a live ring the sidecar follows")
    parser.add_argument("--starve", type=float, default=0.0, metavar="S",
                        help="with --live: busy processes take the cores for S seconds, 2 s into the writing")
    options = parser.parse_args()
    if options.starve and not options.live:
        parser.error("--starve goes with --live")
    with tempfile.TemporaryDirectory(prefix="sok-sidecar-") as workdir:  # its trace files: up to 512 MiB each
        if options.drain:
            return drain(options.drain, options.size, workdir)
        if options.live:
            return live(options.live, options.rate, options.size, options.starve, workdir)
        return application(options, workdir)


def application(options: argparse.Namespace, workdir: str) -> int:
    """A real application making level-3 calls with its sidecar: what it reached, and what the receiver got."""
    server, endpoint = live_receiver()
    env = _own_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=os.path.join(workdir, "trace_%i.sgltrace"),
               SGLANG_KERNEL_API_TRACEFILE_SIZE=options.size, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
               OTEL_EXPORTER_OTLP_INSECURE="true")
    try:
        # stderr is shared with the sidecar: run() returns once it has finished too.
        proc = subprocess.run([sys.executable, "-c", APP, str(options.seconds), str(options.rate)], env=env,
                              capture_output=True, text=True, timeout=options.seconds * 30 + 120)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
        calls, elapsed, _ = proc.stdout.split()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.received() < int(calls):
            time.sleep(0.2)
        received = server.received()
    finally:
        server.stop(grace=None)
    lost = re.search(r"(\d+) records were overwritten before they were read", proc.stderr)
    rate = int(calls) / float(elapsed)
    print(f"level 3, {options.size} ring: {int(calls)} calls in {float(elapsed):.1f} s = {rate:,.0f} calls/s "
          f"(target 50,000/s); sidecar lost {lost.group(1) if lost else 0} records; "
          f"receiver got {received} spans of {calls}")
    return 0


FILL = r"""
import sys, torch, sglang_otel_kernels as sok
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x)
x, w = torch.randn(4, 4096), torch.randn(4096)
for _ in range(int(sys.argv[1])):
    kernel(x, w, eps=1e-5)
print(sok.trace_file_path())
"""


def _own_env() -> dict:
    """This process's environment without the package's and OpenTelemetry's settings: each run sets its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}


def _fill(calls: int, size: str, env: dict, workdir: str) -> "str | None":
    """The path of a trace file in `workdir` of `calls` level-3 calls written by a real application, with no sidecar."""
    env = dict(env, SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_EXPORT_SIDECAR="0", SGLANG_KERNEL_API_TRACEFILE_SIZE=size,
               SGLANG_KERNEL_API_TRACEFILE=os.path.join(workdir, "trace_%i.sgltrace"))
    filled = subprocess.run([sys.executable, "-c", FILL, str(calls)], env=env, capture_output=True, text=True,
                            timeout=calls / 1000 + 300)
    if filled.returncode != 0:
        print(filled.stderr, file=sys.stderr)
        return None
    return filled.stdout.split()[-1]


def _watch(server, sidecar: subprocess.Popen, calls: int, started: float) -> tuple:
    """The receiver's count, watched until the sidecar has exited and the
    back end has what it sent: (time, count) of the first batch and of the
    last, when the sidecar exited, its output."""
    first = last = ended = None
    while True:
        got, now = server.received(), time.perf_counter()
        if got and first is None:
            first = (now, got)
        if got and (last is None or got > last[1]):
            last = (now, got)
        if ended is None and sidecar.poll() is not None:
            ended = now  # the sidecar exits once the back end took all it sent
        if (ended is not None and (got >= calls or now - ended > 30)) or now - started > calls / 100 + 300:
            break
        time.sleep(0.005)
    if ended is None:
        sidecar.kill()
    return first, last, (ended or time.perf_counter()), sidecar.communicate(timeout=60)


def _steady(first: tuple, last: tuple) -> float:
    return (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else float("nan")


def _sidecar(path: str, endpoint: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels", "follow", path, "--endpoint", endpoint],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def drain(calls: int, size: str, workdir: str) -> int:
    """The sidecar's own rate: a ring of `calls` level-3 calls exported by `follow`, timed from its start."""
    env = _own_env()
    path = _fill(calls, size, env, workdir)
    if path is None:
        return 1
    server, endpoint = live_receiver()
    try:
        started = time.perf_counter()
        sidecar = _sidecar(path, endpoint, env)
        first, last, ended, (out, err) = _watch(server, sidecar, calls, started)
        received = server.received()
    finally:
        server.stop(grace=None)
    if sidecar.returncode != 0 or first is None:
        print(err, file=sys.stderr)
        return 1
    held = re.search(r"(\d+) spans sent", out)
    seconds = ended - started
    print(f"level 3, {size} ring, the sidecar alone: {received} spans received ({held.group(1) if held else '?'} "
          f"sent: all the ring held of {calls} calls) in {seconds:.2f} s = {received / seconds:,.0f} spans/s with "
          f"its start-up and its first scan of the whole ring ({first[0] - started:.2f} s to the first batch); "
          f"after the first batch, {_steady(first, last):,.0f} spans/s (target 50,000/s)")
    return 0


WRITER = r"""
import sys, time
from sglang_otel_kernels.record import tracefile as fmt
from sglang_otel_kernels.record.reader import map_trace_file, read_header
source, template, capacity, rate = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
data = map_trace_file(source)
_, position, end, _ = read_header(source, data)
records, expected = [], 1  # (encoding, payload) in the order written: the source never wrapped
while position + fmt.RECORD_HEADER.size <= end:
    magic, length, sequence, crc, encoding = fmt.RECORD_HEADER.unpack_from(data, position)
    if magic != fmt.RECORD_MAGIC or sequence != expected:
        break
    start = position + fmt.RECORD_HEADER.size
    records.append((encoding, data[start : start + length]))
    expected += 1
    position = start + length + (-(fmt.RECORD_HEADER.size + length)) % fmt.ALIGN
writer = fmt.TraceFileWriter(template, capacity)
writer.write_record(*records[0])  # creates the file
print(writer.path, flush=True)
sys.stdin.readline()  # the sidecar is up
write, started = writer.write_record, time.perf_counter()
for index in range(1, len(records), 200):
    for record in records[index : index + 200]:
        write(*record)
    ahead = index / 2 / rate - (time.perf_counter() - started)
    if ahead > 0:
        time.sleep(ahead)
print(len(records) // 2, time.perf_counter() - started, time.process_time(), flush=True)
"""


def live(calls: int, rate: float, size: str, starve: float, workdir: str) -> int:
    """The sidecar following a live file: the records of `calls` real
    level-3 calls (written first) written again, as they were, into a ring
    of `size` at `rate` calls a second by a writer that does nothing else,
    the sidecar started with it; its rate, reading included, and what it
    lost; with `starve`, through a slow spell of that many seconds."""
    env = _own_env()
    source = _fill(calls, "512M", env, workdir)
    if source is None:
        return 1
    server, endpoint = live_receiver()
    capacity = int(size.rstrip("M")) << 20
    writer = subprocess.Popen([sys.executable, "-c", WRITER, source, source + ".live", str(capacity), str(rate)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = writer.stdout.readline().strip()
        children, own = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        sidecar = _sidecar(path, endpoint, env)
        time.sleep(2)  # its start-up, before the writer starts
        started = time.perf_counter()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        busy = ["sh", "-c", f"sleep 2; exec timeout {starve} {sys.executable} -c 'while 1: pass'"]
        spell = [subprocess.Popen(busy) for _ in range((os.cpu_count() or 1) + 1)] if starve else []
        written, seconds, writer_cpu = writer.stdout.readline().split()
        writer.stdin.close()
        writer.wait(timeout=60)
        for process in spell:
            process.wait(timeout=starve + 60)
        first, last, _, (out, err) = _watch(server, sidecar, int(written), started)
        received = server.received()
        # CPU seconds: the sidecar's (the children's, less the writer's), this process's (mostly the receiver).
        sidecar_cpu = _cpu(children, resource.getrusage(resource.RUSAGE_CHILDREN)) - float(writer_cpu)
        receiver_cpu = _cpu(own, resource.getrusage(resource.RUSAGE_SELF))
    finally:
        server.stop(grace=None)
    lost = re.search(r"(\d+) records were overwritten before they were read", err)
    dropped = re.search(r"(\d+) dropped", out)
    # Delivered from the writer's first record to the back end's last span: the rate the whole path kept.
    spelled = f", a {starve:g} s slow spell" if starve else ""
    print(f"level 3, a live {size} ring{spelled}: {written} calls written in {float(seconds):.2f} s = "
          f"{int(written) / float(seconds):,.0f} calls/s (aiming at {rate:,.0f}); the sidecar lost "
          f"{lost.group(1) if lost else 0} records and dropped {dropped.group(1) if dropped else '?'} spans; the "
          f"receiver got {received} spans, the last {last[0] - started - float(seconds):.2f} s after the writer's "
          f"last record: {received / (last[0] - started):,.0f} spans/s delivered (target 50,000/s, nothing lost); "
          f"CPU per span: the sidecar {sidecar_cpu / received * 1e6:.1f} us (its start-up included), the receiver "
          f"{receiver_cpu / received * 1e6:.1f} us, the writer {float(writer_cpu) / int(written) * 1e6:.1f} us")
    return 0


def _cpu(before, after) -> float:
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


if __name__ == "__main__":
    sys.exit(main())
