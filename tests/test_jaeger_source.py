"""`report --jaeger`'s reading of Jaeger's query API as hostile input, from
a real HTTP server on loopback answering what it is told to (the real Jaeger
is in tests/test_ranks.py)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_otel_kernels.recover.jaeger_source import jaeger_base, parse_duration, parse_time, read_jaeger
from sglang_otel_kernels.record.reader import TraceFileError


class _Answers:
    """`body` to every request, or the body of the first path prefix of a dict that a request's path starts with."""

    def __init__(self, body: "bytes | dict[str, bytes]", status: int = 200) -> None:
        self.body, self.status, self.paths = body, status, []
        answers = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                answers.paths.append(self.path)
                body = answers.body if isinstance(answers.body, bytes) else next(
                    (text for prefix, text in answers.body.items() if self.path.startswith(prefix)), b"{}")
                self.send_response(answers.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _trace(*spans, process_tags=None) -> dict:
    tags = process_tags or [{"key": "process.pid", "type": "int64", "value": 42},
                            {"key": "host.name", "type": "string", "value": "node-1"},
                            {"key": "sglang.rank", "type": "int64", "value": 2}]
    return {"traceID": "ab" * 16, "spans": list(spans), "processes": {"p1": {"serviceName": "s", "tags": tags}}}


GOOD = {"traceID": "ab" * 16, "spanID": "12" * 8, "operationName": "layer.stuck", "processID": "p1",
        "startTime": 1_700_000_000_000_000, "duration": 2_000_000, "references": [],
        "tags": [{"key": "sglang.kernel.name", "type": "string", "value": "layer.stuck"},
                 {"key": "sglang.kernel.in_flight", "type": "bool", "value": True},
                 {"key": "sglang.kernel.input.arg0.shape", "type": "string", "value": "[4,8]"},
                 {"key": "otel.status_code", "type": "string", "value": "ERROR"},
                 {"key": "thread.id", "type": "int64", "value": 7}],
        "logs": [{"timestamp": 1_700_000_000_500_000, "fields": [{"key": "event", "type": "string", "value": "x"}]}]}


@pytest.fixture
def answers():
    made = []
    yield lambda body, status=200: made.append(_Answers(body, status)) or made[-1]
    for server in made:
        server.close()


def test_spans_of_each_process_become_one_contents_and_malformed_ones_are_counted(answers):
    bad_spans = [dict(GOOD, spanID="zz"), dict(GOOD, startTime="soon"), dict(GOOD, processID="nobody"), "not a span",
                 dict(GOOD, spanID="34" * 8, tags=[{"key": "k", "type": "int64", "value": "not a number"}])]
    body = json.dumps({"data": [_trace(GOOD, *bad_spans), "not a trace"]}).encode()
    server = answers(body)
    [contents] = read_jaeger(server.url, "s", 1_699_996_500.0, 1_700_000_100.0, limit=7)
    assert "service=s" in server.paths[0] and "limit=7" in server.paths[0]
    assert "start=1699996500000000" in server.paths[0] and "end=1700000100000000" in server.paths[0]
    spans = {span.span_id: span for span in contents.spans}
    stuck = spans[0x12 * 0x0101010101010101]
    assert stuck.in_flight and stuck.end_time is None and stuck.status_code == "ERROR" and stuck.thread_id == 7
    assert stuck.attributes["sglang.kernel.input.arg0.shape"] == (4, 8)  # Jaeger's JSON text of an array
    assert "otel.status_code" not in stuck.attributes and stuck.events[0][0] == "x"
    assert spans[0x34 * 0x0101010101010101].attributes == {}  # a tag Jaeger would not write is left out
    assert contents.metadata["pid"] == 42 and contents.metadata["ranks"] == {"rank": 2}
    assert contents.last_time == 1_700_000_002_000_000_000  # the in-flight call's exported end: its last sign of life
    assert not contents.exited and contents.problems == ["5 malformed trace(s) or span(s) left out"]


def test_a_process_whose_calls_in_flight_are_hung_calls_early_exports_reads_as_live(answers):
    """The sidecar exports a hung call while its process lives (tagged
    sglang.kernel.hung) and a call of its own in flight only when the
    process died: Jaeger's spans tell a hanging process from a dead one."""
    hung = dict(GOOD, tags=[*GOOD["tags"], {"key": "sglang.kernel.hung", "type": "bool", "value": True}])
    other = [{"key": "process.pid", "type": "int64", "value": 43}, {"key": "host.name", "type": "string", "value": "n"}]
    ended = dict(GOOD, spanID="56" * 8, processID="p2", tags=GOOD["tags"][:1])
    elsewhere = {"p2": {"serviceName": "s", "tags": other}}
    traces = [_trace(hung), dict(_trace(ended), traceID="cd" * 16, processes=elsewhere)]
    by_pid = {contents.metadata["pid"]: contents for contents in
              read_jaeger(answers(json.dumps({"data": traces}).encode()).url, "s", 0, 60)}
    assert by_pid[42].live and not by_pid[42].exited
    assert by_pid[43].exited and not by_pid[43].live
    own = dict(GOOD, spanID="78" * 8)
    [dead] = read_jaeger(answers(json.dumps({"data": [_trace(own, hung)]}).encode()).url, "s", 0, 60)
    assert not dead.live and not dead.exited  # one call in flight that is no hung call's export: it died


@pytest.mark.parametrize("body, status, said", [
    (b"<html>not json</html>", 200, "is not JSON"), (b'{"data": 5}', 200, "holds no traces"),
    (b"{}", 503, "Jaeger answered 503"), (b"x" * 16, 200, "is not JSON")])
def test_an_answer_that_is_not_traces_is_one_clear_error(answers, body, status, said):
    server = answers(body, status)
    with pytest.raises(TraceFileError, match=said):
        read_jaeger(server.url, "s", 0, 60)


def test_the_command_line_says_one_line_and_exits_2(answers):
    server = answers(b"garbage")
    for options in (["--jaeger", server.url, "--service", "s"], ["--jaeger", server.url],
                    ["--jaeger", server.url, "--service", "s", "--since", "soon"], []):
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *options], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (options, proc.stderr)


def test_durations():
    assert [parse_duration(text) for text in ("90s", "30m", "2h", "1.5d")] == [90, 1800, 7200, 129600]
    for text in ("", "5", "0h", "-1h", "1w", "h"):
        with pytest.raises(ValueError):
            parse_duration(text)


def test_times_are_durations_ago_or_absolute_in_local_time_unless_zoned():
    import datetime

    now = 1_700_000_000.0
    assert parse_time("30m", now) == now - 1800
    assert parse_time("2023-11-14T22:13:20Z", now) == 1_700_000_000.0
    assert parse_time("2023-11-14 22:13:20+00:00", now) == 1_700_000_000.0
    assert parse_time("2023-11-14 22:13", now) == datetime.datetime(2023, 11, 14, 22, 13).timestamp()  # local
    for text in ("soon", "", "2023-13-40 25:00", "yesterday"):
        with pytest.raises(ValueError, match="not a duration .* or a time"):
            parse_time(text, now)


@pytest.mark.parametrize("url, base, service", [
    ("http://127.0.0.1:16686", "http://127.0.0.1:16686", None),
    ("127.0.0.1:16686/", "http://127.0.0.1:16686", None),
    ("http://j:16686/search?service=sglang&lookback=1h&tags=%7B%7D", "http://j:16686", "sglang"),
    ("https://ops.example/jaeger/search?service=a%20b", "https://ops.example/jaeger", "a b"),
    ("http://j:16686/trace/0af7651916cd43dd8448eb211c80319c?uiFind=x", "http://j:16686", None),
    ("http://j:16686/api/traces?service=s", "http://j:16686", None)])
def test_any_address_of_jaegers_ui_gives_its_api_base(url, base, service):
    assert jaeger_base(url) == (base, service)


def test_a_service_without_spans_lists_the_services_jaeger_has_and_a_quiet_window_says_so(answers):
    server = answers({"/api/traces": b'{"data": []}', "/api/services": b'{"data": ["sglang", "jaeger", "watch"]}'})
    with pytest.raises(TraceFileError, match=r"holds no spans of the service 'sglng'; its services: jaeger, sglang, "
                                             r"watch \(--service\)"):
        read_jaeger(server.url + "/search?service=sglng", "sglng", 0, 60)
    assert server.paths[0].startswith("/api/traces?service=sglng")  # the search page's URL, as the base
    with pytest.raises(TraceFileError, match=r"holds no trace of 'sglang' from 1970-01-01 .* to 1970-01-01 .* "
                                             r"\(--since, --until\)"):
        read_jaeger(server.url, "sglang", 0, 60)


def test_report_takes_the_service_from_a_search_pages_url_and_an_absolute_since(answers):
    server = answers({"/api/traces": b'{"data": []}', "/api/services": b'{"data": ["ranks"]}'})
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger",
                           server.url + "/search?service=ranks&lookback=1h", "--since", "2026-12-03 06:30",
                           "--until", "2026-12-03T07:30Z"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "holds no trace of 'ranks' from 2026-12-03" in proc.stderr, proc.stderr
    query = server.paths[0]
    assert "service=ranks" in query and "end=1796283000000000" in query, query
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger", server.url, "--service",
                           "ranks", "--since", "10m", "--until", "20m"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--since (10m) is not before --until (20m)" in proc.stderr, proc.stderr


def test_a_process_read_from_jaeger_is_named_by_its_pid_and_host(answers):
    server = answers({"/api/traces": json.dumps({"data": [_trace(GOOD)]}).encode()})
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger", server.url, "--service", "s"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "(rank 2, pid 42 on node-1; thread" in proc.stdout, proc.stdout
    assert "pid 42, 42" not in proc.stdout
