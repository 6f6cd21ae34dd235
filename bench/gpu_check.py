"""GPU checks that a CPU cannot make, in one script; it also runs on a CPU,
where the CUDA parts say that they were skipped.

    python bench/gpu_check.py

1. per-call overhead on CUDA tensors (4x4096 and 4096 bfloat16) at levels
   1, 3 and 5, text log off, trace file on, against an undecorated call;
2. the level-5 statistics pass on a large tensor (64x65536 float32): achieved
   bandwidth against a device-to-device copy of the same tensor;
3. CUDA graph capture of decorated calls at level 5: no error, statistics
   skipped with a reason, graph replay gives the right result;
4. an out-of-bounds index (device-side assert) in a child process, with and
   without CUDA_LAUNCH_BLOCKING=1: what the trace file holds after it;
5. level 10: a dumped CUDA call re-run on the device by `rerun`, and no dump
   (the span says why) for a call made during graph capture.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

CUDA = torch.cuda.is_available()


def timed(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(20):
        fn()
    if CUDA:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if CUDA:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


CHILD_OVERHEAD = r"""
import sys, time, statistics, torch, sglang_otel_kernels as sok
level, device = int(sys.argv[1]), sys.argv[2]
x = torch.randn(4, 4096, device=device, dtype=torch.bfloat16)
w = torch.randn(4096, device=device, dtype=torch.bfloat16)
kernel = lambda x, w: torch.mul(x, w)
fn = kernel if level == 0 else sok.debug_kernel_api(op_name="sglang.custom_op.mul")(kernel)
for _ in range(50): fn(x, w)
if device == "cuda": torch.cuda.synchronize()
samples = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(500): fn(x, w)
    if device == "cuda": torch.cuda.synchronize()
    samples.append((time.perf_counter() - start) / 500 * 1e6)
print(statistics.median(samples))
"""


def overhead(directory: str) -> None:
    device = "cuda" if CUDA else "cpu"
    print(f"1. per-call overhead, {device} tensors 4x4096 + 4096 bfloat16, text log off, trace file on")
    results = {}
    for level in (0, 1, 3, 5):
        env = dict(os.environ, SGLANG_KERNEL_API_LOGLEVEL=str(level), SGLANG_KERNEL_API_LOGDEST="off",
                   SGLANG_KERNEL_API_TRACEFILE=os.path.join(directory, "overhead_%i.sgltrace"))
        proc = subprocess.run([sys.executable, "-c", CHILD_OVERHEAD, str(level), device], env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            print(f"   level {level}: failed: {proc.stderr.strip()[-300:]}")
            continue
        results[level] = float(proc.stdout)
    for level, value in results.items():
        extra = "" if level == 0 or 0 not in results else f"  (+{value - results[0]:.1f} us)"
        print(f"   level {level}: {value:8.1f} us/call{extra}")


def bandwidth() -> None:
    print("2. level-5 statistics pass vs a copy, 64x65536 float32")
    from sglang_otel_kernels.describe.statistics import fill_statistics
    from sglang_otel_kernels.describe.tensors import describe_tensor

    device = "cuda" if CUDA else "cpu"
    x = torch.randn(64, 65536, device=device)
    out = torch.empty_like(x)
    copy_us = timed(lambda: out.copy_(x), 20)
    info = describe_tensor(x)
    stats_us = timed(lambda: fill_statistics([info]), 20)
    gigabytes = x.numel() * x.element_size() / 1e9
    print(f"   {device}: copy {copy_us:.0f} us ({2 * gigabytes / copy_us * 1e6:.0f} GB/s read+write), "
          f"statistics {stats_us:.0f} us ({gigabytes / stats_us * 1e6:.0f} GB/s read); stats = {info.stats}")


def recorded(**settings):
    """Spans into memory at the given settings; returns the exporter."""
    import sglang_otel_kernels as sok
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sok.configure(log_dest="off", trace_file="off", tracer_provider=provider, **settings)
    return exporter


def capture(fn, *args):
    """Warms fn up on a side stream, then captures one call in a CUDA graph;
    returns (graph, its output), or prints why the capture failed and returns None."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            output = fn(*args)
    except Exception as exc:
        print(f"   FAILED: capture raised {type(exc).__name__}: {exc}")
        return None
    return graph, output


def graph_capture() -> None:
    print("3. CUDA graph capture at level 5")
    if not CUDA:
        print("   skipped: no CUDA device")
        return
    import sglang_otel_kernels as sok

    exporter = recorded(level=5)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.scale")(lambda x: x * 2)
    static_in = torch.ones(1024, device="cuda")
    captured = capture(kernel, static_in)
    if captured is None:
        return
    graph, static_out = captured
    static_in.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    span = exporter.get_finished_spans()[-1]
    print(f"   capture ok; replay result {'ok' if bool((static_out == 6).all()) else 'WRONG'}; "
          f"statistics during capture: {span.attributes.get('sglang.kernel.input.arg0.stats')!r}")


CHILD_ASSERT = r"""
import torch, sglang_otel_kernels as sok
embedding = sok.debug_kernel_api(op_name="sglang.custom_op.embedding")(torch.nn.functional.embedding)
table = torch.randn(32, 8, device="cuda")
for step in range(3):
    embedding(torch.tensor([[1, 2]], device="cuda"), table)
embedding(torch.tensor([[1, 99]], device="cuda"), table)  # out of bounds: device-side assert
torch.cuda.synchronize()
"""


def device_assert(directory: str) -> None:
    print("4. device-side assert in a child, and what the trace file holds")
    if not CUDA:
        print("   skipped: no CUDA device")
        return
    from sglang_otel_kernels import read_trace_file

    for blocking in ("0", "1"):
        path = os.path.join(directory, f"assert_{blocking}_%i.sgltrace")
        env = dict(os.environ, SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off",
                   SGLANG_KERNEL_API_TRACEFILE=path, CUDA_LAUNCH_BLOCKING=blocking)
        proc = subprocess.Popen([sys.executable, "-c", CHILD_ASSERT], env=env, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=300)
        contents = read_trace_file(path.replace("%i", str(proc.pid)))
        calls = [(s.name, s.status_code, s.in_flight, s.attributes.get("sglang.kernel.input.arg0.shape"))
                 for s in contents.spans]
        last_error = err.strip().splitlines()[-1] if err.strip() else ""
        print(f"   CUDA_LAUNCH_BLOCKING={blocking}: exit {proc.returncode}; {len(calls)} calls in the file; "
              f"last three {calls[-3:]}; stderr ends: {last_error[:160]}")


def level10(directory: str) -> None:
    print("5. level 10 on CUDA: a dump outside capture (re-run on the device), none during capture")
    if not CUDA:
        print("   skipped: no CUDA device")
        return
    import sglang_otel_kernels as sok
    from sglang_otel_kernels.recover.rerun import rerun

    dumps = os.path.join(directory, "dumps")
    exporter = recorded(level=10, dump_dir=dumps)
    mul = sok.debug_kernel_api(op_name="sglang.custom_op.mul10")(torch.mul)
    mul(torch.ones(1024, device="cuda"), 2.0)
    [dumped] = os.listdir(dumps)
    report = rerun(os.path.join(dumps, dumped), function="torch:mul")  # rerun runs only what it is told
    print(f"   dumped {dumped}; rerun: {report['verdict']}; notes {report['notes']}")
    captured = capture(mul, torch.ones(1024, device="cuda"), 2.0)
    if captured is None:
        return
    captured[0].replay()
    torch.cuda.synchronize()
    span = exporter.get_finished_spans()[-1]
    print(f"   capture ok; dumps now {len(os.listdir(dumps))} (2 expected: none during capture); "
          f"span says {span.attributes.get('sglang.kernel.dump_skipped')!r}")


def main() -> int:
    print(f"torch {torch.__version__}, CUDA {'available: ' + torch.cuda.get_device_name() if CUDA else 'not available'}")
    directory = tempfile.mkdtemp(prefix="sok-gpu-check-")
    overhead(directory)
    bandwidth()
    graph_capture()
    device_assert(directory)
    level10(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
