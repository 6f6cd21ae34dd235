"""Where a silent thread waits (record/silence.py): the heartbeat's look at
each thread's call counter, and the STACK records a thread that went silent
gets; read back as hostile input."""

import threading
import time

import sglang_otel_kernels as sok
from sglang_otel_kernels.record import silence, tracefile


def _stacks(path) -> dict:
    return sok.read_trace_file(path).stacks


def parked_here(event):
    event.wait()


def test_a_thread_silent_past_the_threshold_gets_its_stack_once_and_again_when_it_moves(tmp_path):
    sok.configure(level=1, log_dest="off", trace_file=str(tmp_path / "t.sgltrace"), hang_seconds=3600)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    called, first, second, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def worker():
        kernel()
        called.set()
        parked_here(first)
        parked_here(second)  # the same function, another line: the stack changed
        done.wait()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    called.wait()
    time.sleep(0.1)  # in parked_here
    from sglang_otel_kernels.record.processor import current_writer

    watcher = silence.SilentThreads(0.5)
    now = time.time_ns()
    watcher.check(current_writer(), now)  # its count noted
    watcher.check(current_writer(), now + int(0.4e9))  # not silent long enough
    assert thread.ident not in _stacks(tmp_path / "t.sgltrace")
    watcher.check(current_writer(), now + int(0.6e9))
    written, since, frames = _stacks(tmp_path / "t.sgltrace")[thread.ident]
    assert since == now and written == now + int(0.6e9)
    names = [function for _, _, function in frames]  # innermost first: threading's waits, then ours
    assert names[0] == "wait" and names[names.index("parked_here") + 1] == "worker"
    watcher.check(current_writer(), now + int(0.8e9))  # the same stack: nothing more of it
    assert _stacks(tmp_path / "t.sgltrace")[thread.ident][0] == now + int(0.6e9)
    first.set()
    time.sleep(0.2)
    watcher.check(current_writer(), now + int(1.0e9))  # moved on, still silent: written again, same silence
    _, since_again, moved = _stacks(tmp_path / "t.sgltrace")[thread.ident]
    line = lambda stack: next(line for _, line, function in stack if function == "worker")  # noqa: E731
    assert since_again == now and line(moved) == line(frames) + 1
    second.set()
    done.set()
    thread.join()


def test_threads_without_calls_get_no_stack_and_ended_ones_are_forgotten(tmp_path):
    sok.configure(level=1, log_dest="off", trace_file=str(tmp_path / "t.sgltrace"), hang_seconds=3600)
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    from sglang_otel_kernels.record.processor import current_writer

    stop = threading.Event()
    quiet = threading.Thread(target=lambda: (tracefile.per_thread.state, stop.wait()), daemon=True)
    quiet.start()
    time.sleep(0.1)
    ended = [threading.Thread(target=lambda: tracefile.per_thread.state) for _ in range(200)]
    for thread in ended:
        thread.start()
        thread.join()
    watcher = silence.SilentThreads(0.0)
    now = time.time_ns()
    watcher.check(current_writer(), now)
    watcher.check(current_writer(), now + 1)
    stacks = _stacks(tmp_path / "t.sgltrace")
    assert quiet.ident not in stacks  # it recorded no call: nothing to say of its silence
    assert len(tracefile.thread_states) <= threading.active_count() + 64  # the ended threads' states dropped
    stop.set()


def test_a_stack_record_is_read_as_hostile_input(tmp_path):
    writer = tracefile.TraceFileWriter(str(tmp_path / "t.sgltrace"), capacity=64 * 1024)
    writer.append((tracefile.THREAD, 7, "main"))
    writer.append((tracefile.STACK, 7, 10, 5, (("a.py", 3, "f"),) * 65))  # too many frames
    writer.append((tracefile.STACK, 8, 10, 5, (("a.py", "3", "f"),)))  # a line that is no number
    writer.append((tracefile.STACK, 9, 10, 5, (("a\udcff.py", 3, "f" * 1000),)))  # bad text, long names
    contents = sok.read_trace_file(writer.path)
    assert set(contents.stacks) == {9}
    [(file, line, function)] = contents.stacks[9][2]
    assert file.encode("utf-8") and line == 3 and len(function) == 256
    assert any("malformed content" in problem for problem in contents.problems)
    writer.close()
