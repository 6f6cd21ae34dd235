"""The main job of the README: the example service takes a handful of
concurrent requests, one of which carries a token id outside the vocabulary
(the SGLang tutorial's reproducer: on the CPU the embedding kernel raises
instead of a device-side assert), and fails its whole batch. The demo then reads the crash-safe trace
file back and prints the crash report. With `crash=True` the service runs in a
child process whose kernel kills it (SIGABRT, as an illegal memory access
takes a server down), and the report is made from what the dead process left.
With an OTLP endpoint in the standard variables the same run is exported too.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .example.model import VOCAB
from .filesystems import slow_filesystem_note
from .record.reader import read_trace_file
from .recover.report import build_report, render_text

GOOD_REQUESTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
BAD_REQUEST = [12, VOCAB + 7]
# The five requests are sent at once: a window this wide batches them together
# even on a loaded machine, so the report reads as the README shows.
DEMO_WINDOW_S = 0.5


def _post(port: int, tokens: list[int]) -> tuple[str, str]:
    """(traceparent sent, outcome) for one request, as a client would send it."""
    rng = random.Random()
    traceparent = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps({"tokens": tokens}).encode(),
        headers={"traceparent": traceparent, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return traceparent, f"{response.status} {response.read().decode()}"
    except urllib.error.HTTPError as error:
        return traceparent, f"{error.code} {error.read().decode()}"
    except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
        # Killed mid-answer, the server can also leave a response cut short (IncompleteRead).
        return traceparent, f"no answer: the server died ({getattr(error, 'reason', None) or error})"


def _send_all(port: int) -> None:
    """All requests at once: the service batches them, so the failing kernel
    takes down every request of its batch, and the report names them all."""
    requests = GOOD_REQUESTS + [BAD_REQUEST]
    with ThreadPoolExecutor(len(requests)) as pool:
        outcomes = list(pool.map(lambda tokens: (tokens, *_post(port, tokens)), requests))
    for tokens, traceparent, outcome in outcomes:
        print(f"POST /generate {json.dumps({'tokens': tokens}):28s} traceparent {traceparent}\n    -> {outcome}")


def _report(path: str) -> None:
    print(f"\nCrash report from {path} (sglang-otel-kernels report {os.path.basename(path)}):\n")
    sys.stdout.write(render_text(build_report([read_trace_file(path)], last=5)))
    note = slow_filesystem_note(os.path.dirname(path))
    if note:
        print(f"\nNote: {note}")


def run(level: int = 3, crash: bool = False) -> int:
    return _run_crashing(level) if crash else _run_in_process(level)


def _run_in_process(level: int) -> int:
    from opentelemetry import trace

    from . import configure, trace_file_path
    from .example.server import start

    # SGLang's text log goes to a file here, to keep the screen for the report.
    log_path = os.path.abspath(f"sglang_kernel_api_{os.getpid()}.log")
    configure(level=level, log_dest=log_path)
    server = start(window=DEMO_WINDOW_S)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"example service on http://127.0.0.1:{server.server_address[1]}, level {level}\n")
    try:
        _send_all(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush()
    print(f"\nSGLang's text log of every call: {log_path}")
    path = trace_file_path()
    if path is None:
        print("No trace file (SGLANG_KERNEL_API_TRACEFILE=off, or it could not be created).")
        return 0
    _report(path)
    return 0


def _run_crashing(level: int) -> int:
    child = subprocess.Popen(
        [sys.executable, "-m", "sglang_otel_kernels.example.server", "--port", "0", "--crash", "--level", str(level),
         "--batch-window-ms", str(DEMO_WINDOW_S * 1000)],
        stdout=subprocess.PIPE, text=True,
    )
    line = child.stdout.readline() if child.stdout else ""
    if not line.startswith("listening on http://127.0.0.1:"):
        child.kill()
        print("the example service did not start", file=sys.stderr)
        return 2
    port = int(line.split(":")[2].split()[0])
    print(f"example service (pid {child.pid}) on http://127.0.0.1:{port}, level {level}; "
          f"an out-of-range token will kill it\n")
    try:
        _send_all(port)
        code = child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
    ended = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    print(f"\nThe service process {child.pid} ended: {ended}.")
    configured = os.environ.get("SGLANG_KERNEL_API_TRACEFILE", "sglang_kernel_trace_%i.sgltrace")
    if configured == "off":
        print("No trace file (SGLANG_KERNEL_API_TRACEFILE=off).")
        return 0
    path = os.path.abspath(configured.replace("%i", str(child.pid)))
    _report(path)
    print(_export_hint(os.path.basename(path)))
    return 0


def _export_hint(name: str) -> str:
    """What to do to see the crash in a back end, for the settings in force."""
    from .config import get_config

    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint and get_config().export_sidecar:
        return (f"\nThe export sidecar sent these spans to {endpoint}, the call in flight included: "
                "open its request trace in Jaeger (or your OTLP back end).")
    if endpoint:
        return (f"\nIn-process export loses the call in flight; to send the whole file to {endpoint}:\n"
                f"    sglang-otel-kernels replay {name}")
    return ("\nTo see these calls inside their request traces in Jaeger (or any OTLP back end), "
            "for example the local Collector of docs/backends.md:\n"
            f"    sglang-otel-kernels replay {name} --endpoint http://127.0.0.1:4317")
