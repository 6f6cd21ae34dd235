"""SGLang's own logger against ours, side by side, on the same inputs and the
same text-log destination, in one run.

    python bench/compare_sglang.py [--sample 0.5] [--seconds 4] [--warmup 1]

SGLang's logger is `sglang/kernels/kernel_api_logging.py` from the published
wheel, downloaded now (`pip download --no-deps sglang`) into a temporary
folder and loaded by path (it needs only torch); it is never copied into this
repository. Every configuration runs in its own process, because both loggers
read their settings at import:

  sglang      SGLang's logger, text log to a file
  text-only   ours, text log to a file, OTEL_SDK_DISABLED=true, trace file off
  full        ours, default settings: text log + span + trace file + OTLP
              to a local gRPC receiver, exported by the sidecar that follows
              the trace file (its work shares the machine's cores with the
              timed loop)
  no-text     ours, SGLANG_KERNEL_API_LOGDEST=off: span + trace file + OTLP
  *-inprocess full and no-text with SGLANG_KERNEL_API_EXPORT_SIDECAR=0: the
              OTLP export by a batch exporter in the process
  app         no text, in an application that installed its own
              TracerProvider with a batch OTLP exporter (as SGLang's
              --enable-trace does): kernel spans handed to its exporter
  app-sidecar the same with SGLANG_KERNEL_API_EXPORT_SIDECAR=kernels: kernel
              spans exported by the sidecar instead

on small tensors as a decode step has (4x4096 and 4096 float32) at levels
1, 3 and 5, plus a bare call and a bare OpenTelemetry span; and at level 5 on
a large tensor (64x65536, the kernel returning nothing), where the cost of
the statistics (level 5 minus level 3) is compared with one `torch.aminmax`
pass over it.

Per-call microseconds are the median of samples of `--sample` seconds of
calls each, taken for `--seconds` after a warm-up of `--warmup` seconds of
calls. This machine slows down now and then for a few hundred
milliseconds: a median of samples spread over seconds is not moved by one
such spell, where a few repeats of 10 ms each were. Each sample is long
enough to hold the in-process exporter's batches (one per 512 spans), so
that their cost is in every sample, not dropped by the median. The warm-up
shows the steady state, the sidecar started and exporting on the other
core, rather than its start-up, which `bench/export_cost.py` measures from
the first call. A sidecar exports what its application left after that
exits: the next configuration starts once none runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from local_receiver import live_receiver
from sglang_wheel import fetch_sglang_logger


CHILD = r"""
import importlib.util, os, statistics, sys, time
mode, level, size, sample, seconds, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
warmup = float(sys.argv[7])
chunk = 50 if size == "small" else 1  # calls between looks at the clock
import torch
torch.set_num_threads(1)
if size == "small":
    args = (torch.randn(4, 4096), torch.randn(4096))
else:
    args = (torch.randn(64, 65536),)

def kernel(*tensors, eps=1e-6):
    # Large: no result, so the statistics measured are those of one tensor.
    return tensors[0] if size == "small" else None

fn = kernel
if mode == "sglang":
    spec = importlib.util.spec_from_file_location("sglang_kernel_api_logging", os.environ["SGLANG_LOGGER_PATH"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.debug_kernel_api(kernel)
elif mode.startswith(("text-only", "full", "no-text", "app")):
    if mode.startswith("app"):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
    import sglang_otel_kernels as sok
    fn = sok.debug_kernel_api(kernel)
elif mode == "span":
    from opentelemetry.sdk.trace import TracerProvider
    tracer = TracerProvider().get_tracer("bench")
    def fn(*a, **kw):
        with tracer.start_as_current_span("kernel"):
            return kernel(*a, **kw)
elif mode == "aminmax":
    def fn(*a, **kw):
        return torch.aminmax(a[0])
warm_until = time.perf_counter() + warmup
while time.perf_counter() < warm_until:
    fn(*args, eps=1e-5)
text_log = os.path.join(workdir, "text.log")


def empty_text_log():  # the log must not grow across samples
    if os.path.exists(text_log):
        os.truncate(text_log, 0)


empty_text_log()
samples = []
timed_until = time.perf_counter() + seconds
while time.perf_counter() < timed_until or len(samples) < 5:
    start = now = time.perf_counter()
    calls = 0
    while now - start < sample:
        for _ in range(chunk):
            fn(*args, eps=1e-5)
        calls += chunk
        now = time.perf_counter()
    samples.append((now - start) / calls * 1e6)
    empty_text_log()
print(statistics.median(samples))
os._exit(0)  # skip the exporter's flush at exit: not part of a call's cost
"""


def environment(mode: str, level: int, workdir: str, logger: str, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    text_log = os.path.join(workdir, "text.log")
    env.update(SGLANG_LOGGER_PATH=logger, SGLANG_KERNEL_API_LOGLEVEL=str(level), SGLANG_KERNEL_API_LOGDEST=text_log,
               SGLANG_KERNEL_API_TRACEFILE=os.path.join(workdir, "trace_%i.sgltrace"))
    if mode == "text-only":
        env.update(OTEL_SDK_DISABLED="true", SGLANG_KERNEL_API_TRACEFILE="off")
    if mode.startswith(("full", "no-text", "app")):
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
    if mode.startswith(("no-text", "app")):
        env["SGLANG_KERNEL_API_LOGDEST"] = "off"
    if mode == "app-sidecar":
        env["SGLANG_KERNEL_API_EXPORT_SIDECAR"] = "kernels"
    if mode.endswith("-inprocess"):
        env["SGLANG_KERNEL_API_EXPORT_SIDECAR"] = "0"
    return env


def wait_for_sidecars(workdir: str, timeout: float = 120.0) -> None:
    """A sidecar goes on exporting what its application left after that exits:
    the next configuration is timed once none runs, alone on the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True).stdout.split():
            return
        time.sleep(0.1)
    raise RuntimeError(f"a sidecar of {workdir} still runs after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=float, default=0.5, help="seconds of calls per sample")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of samples per configuration")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of calls before the samples")
    options = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="sok-compare-")
    try:
        logger, wheel = fetch_sglang_logger(workdir)
    except RuntimeError as exc:
        print(f"compare_sglang: {exc}", file=sys.stderr)
        return 2
    server, endpoint = live_receiver()

    def measure(mode: str, level: int, size: str = "small") -> float:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(level), size, str(options.sample), str(options.seconds), workdir,
             str(options.warmup)],
            env=environment(mode, level, workdir, logger, endpoint), capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} level {level} {size}: {proc.stderr.strip()[-800:]}")
        wait_for_sidecars(workdir)
        return float(proc.stdout)

    try:
        bare, span = measure("bare", 0), measure("span", 0)
        rows = {}
        for level in (1, 3, 5):
            rows[level] = {mode: measure(mode, level)
                           for mode in ("sglang", "text-only", "full", "full-inprocess", "no-text", "no-text-inprocess",
                                        "app", "app-sidecar")}
        large = {
            "sglang L5": measure("sglang", 5, "large"),
            "text-only L5": measure("text-only", 5, "large"),
            "text-only L3": measure("text-only", 3, "large"),
            "aminmax": measure("aminmax", 0, "large"),
        }
    finally:
        server.stop(grace=None)

    targets = {("text-only", 1): 0.25, ("text-only", 3): 0.25, ("text-only", 5): 0.25,
               ("full", 1): 0.25, ("full", 3): 0.15, ("full", 5): 0.1, ("no-text", 1): 0.1}
    print(f"SGLang logger from {wheel}; python {sys.version.split()[0]}; small tensors 4x4096 + 4096 float32, "
          f"medians of {options.sample:g} s samples over {options.seconds:g} s after {options.warmup:g} s of warm-up; bare call {bare:.2f} us, "
          f"bare OTel span {span:.2f} us")
    print(f"{'level':>5s} {'configuration':12s} {'us/call':>9s} {'vs SGLang':>10s} {'target':>7s} {'met':>4s}")
    for level, measured in rows.items():
        for mode, value in measured.items():
            ratio = value / measured["sglang"]
            target = targets.get((mode, level))
            verdict = "" if target is None else ("yes" if ratio <= target else "NO")
            print(f"{level:5d} {mode:12s} {value:9.2f} {ratio:9.3f}x {'' if target is None else f'<={target}':>7s} "
                  f"{verdict:>4s}")
    stats_cost = large["text-only L5"] - large["text-only L3"]
    print(f"large tensor 64x65536 float32: SGLang L5 {large['sglang L5']:.0f} us, ours L5 {large['text-only L5']:.0f} us "
          f"({large['text-only L5'] / large['sglang L5']:.3f}x); our statistics {stats_cost:.0f} us = "
          f"{stats_cost / large['aminmax']:.2f}x one aminmax pass ({large['aminmax']:.0f} us; target <= 1.3x: "
          f"{'yes' if stats_cost <= 1.3 * large['aminmax'] else 'NO'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
