"""Concurrent calls: every call gets its own span in its own thread's trace,
numbers never repeat, and text-log blocks never interleave."""

import re
import threading

import torch

import sglang_otel_kernels as sok

THREADS = 8
CALLS = 150


def test_many_threads(record, provider, tmp_path):
    log = tmp_path / "kernels.log"
    exporter = record(level=3, log_dest=str(log))
    inner = sok.debug_kernel_api(op_name="inner")(lambda x: x + 1)
    outer = sok.debug_kernel_api(op_name="outer")(lambda x: inner(x))
    tracer = provider.get_tracer("app")
    errors = []
    barrier = threading.Barrier(THREADS)

    def worker(index):
        try:
            barrier.wait()
            with tracer.start_as_current_span(f"request-{index}"):
                for _ in range(CALLS):
                    outer(torch.full((2,), float(index)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []

    spans = exporter.get_finished_spans()
    kernels = [s for s in spans if s.name in ("outer", "inner")]
    assert len(kernels) == THREADS * CALLS * 2
    seqs = sorted(s.attributes["sglang.kernel.seq"] for s in kernels)
    assert len(set(seqs)) == len(seqs)
    by_id = {s.context.span_id: s for s in spans}
    for span in kernels:
        parent = by_id[span.parent.span_id]
        if span.name == "inner":
            assert parent.name == "outer"
            parent = by_id[parent.parent.span_id]
        # Each kernel sits in the request of the thread that ran it.
        assert parent.name.startswith("request-")
        assert span.context.trace_id == parent.context.trace_id

    # Every block of the text log is whole: a call header is followed by its
    # own input section, never by another call's lines.
    text = log.read_text()
    blocks = text.split("=" * 80 + "\n")[1:]
    assert len(blocks) == THREADS * CALLS * 2
    pattern = re.compile(
        r"\[[-\d: ]+\] SGLang Kernel API Call: (outer|inner)\n"
        r"Positional input arguments:\n  arg\[0\]=Tensor\(\n(    .*\n){5}    \)\n"
        r"(Output:\n  return=Tensor\(\n(    .*\n){5}    \)\n)*$"
    )
    for block in blocks:
        assert pattern.match(block), block


def test_threads_taking_turns_record_their_own_calls_in_the_trace_file(tmp_path):
    """Into the trace file alone (the compiled core's own path, where it is
    built): a thread's call in flight while another thread records, and a
    new thread after one ended, each nest their calls in their own and are
    named as themselves."""
    from sglang_otel_kernels.record import core

    path = tmp_path / "t.sgltrace"
    sok.configure(level=1, log_dest="off", trace_file=str(path), export_sidecar=False)
    a_inside, b_done = threading.Event(), threading.Event()

    def body(x):
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()  # A's call stays in flight while B records
            assert b_done.wait(60)
        return inner(x)

    inner = sok.debug_kernel_api(op_name="inner")(lambda x: x + 1)
    outer = sok.debug_kernel_api(op_name="outer")(body)
    x = torch.ones(2)

    def run(name, before=None, after=None):
        def calls():
            outer(x)  # a thread's first call goes through Python, which names the thread in the file
            if before:
                assert before.wait(60)
            outer(x)
            if after:
                after.set()
            outer(x)
        thread = threading.Thread(target=calls, name=name)
        thread.start()
        return thread

    try:
        outer(x)
        before = core.native.recorded() if core.NATIVE else 0
        a = run("A")
        b = run("B", before=a_inside, after=b_done)
        a.join(), b.join()
        run("C").join()  # a thread made after others ended
        outer(x)
        spans = sok.read_trace_file(str(path)).spans
    finally:
        sok.configure(level=0, trace_file="off")
    if core.NATIVE:
        assert core.native.recorded() - before >= 3 * 2 * 2 + 2  # each thread's later calls and this one's in C
    by_id = {s.span_id: s for s in spans}
    threads = [s.thread_name for s in spans if s.name == "outer"]
    assert sorted(threads) == ["A"] * 3 + ["B"] * 3 + ["C"] * 3 + [threading.current_thread().name] * 2
    for span in spans:
        assert not span.in_flight
        if span.name == "inner":
            parent = by_id[span.parent_span_id]
            assert (parent.name, parent.thread_name) == ("outer", span.thread_name)
        else:
            assert span.parent_span_id not in by_id  # no call of another thread around it


def test_a_running_call_kept_by_python_keeps_its_fields_after_later_calls(tmp_path):
    """The call running on a thread, as Python reads it (the compiled core
    keeps its own object, reused by later calls when nothing else holds it):
    one kept while it ran still says which call it was once it ended and
    other calls ran, and a kernel's first call, recorded by the Python path
    inside a call the compiled core records, nests in it."""
    from sglang_otel_kernels.record import core, tracefile
    from sglang_otel_kernels.record.spans import CALL_SEQ, OUTER, SPAN_ID, START, THREAD_STATE, TRACE_ID

    path = tmp_path / "t.sgltrace"
    sok.configure(level=1, log_dest="off", trace_file=str(path), export_sidecar=False)
    kept = []

    def body(x, first_inner=False):
        kept.append(tracefile.per_thread.state[tracefile.CALL])
        return late(x) if first_inner else x + 1

    late = sok.debug_kernel_api(op_name="late")(lambda x: x * 2)
    step = sok.debug_kernel_api(op_name="step")(body)
    x = torch.ones(2)
    try:
        step(x), step(x)  # a kernel's first calls go through Python, which names it and the thread in the file
        before = core.native.recorded() if core.NATIVE else 0
        for _ in range(5):
            step(x)
        step(x, first_inner=True)  # late's first call, inside step's
        for _ in range(5):
            step(x)
        recorded = core.native.recorded() - before if core.NATIVE else None
        spans = sok.read_trace_file(str(path)).spans
    finally:
        sok.configure(level=0, trace_file="off")
    if core.NATIVE:
        assert recorded == 11  # step's later calls in C; late's one call in Python
    steps = sorted((s for s in spans if s.name == "step"), key=lambda s: s.attributes["sglang.kernel.seq"])
    assert len(steps) == len(kept) == 13
    for call, span in zip(kept, steps):
        assert len(call) == 11
        assert call[SPAN_ID] == span.span_id and call[TRACE_ID] == span.trace_id
        assert call[CALL_SEQ] == span.attributes["sglang.kernel.seq"]
        assert call[START] == span.start_time
        assert call[OUTER] is None and call[THREAD_STATE] is tracefile.per_thread.state
        assert tuple(call)[SPAN_ID] == span.span_id  # read whole, as the Python path unpacks it
    (inner,) = [s for s in spans if s.name == "late"]
    assert inner.parent_span_id == steps[7].span_id and inner.trace_id == steps[7].trace_id
    assert tracefile.per_thread.state[tracefile.CALL] is None
