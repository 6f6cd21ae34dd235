"""SGLang's real server on this machine's CPU, started through `run` as a
user starts it: `sglang-otel-kernels run -- python -m sglang.launch_server
...` in the environment .ci/sglang-env makes (SGLang 0.5.23 and its
dependencies, kept outside the checkout), serving a tiny Llama made offline
(tests/tiny_llama.py). Nothing here is a stand-in: SGLang's tokenizer,
scheduler and model runner run, and are crashed, poisoned, killed and
stopped as they are in production. The server is started for:

- an out-of-vocabulary token (IndexError in the embedding lookup; on a GPU a
  device-side assert), with SGLang's own request tracing and the package's
  export into one Collector and a real Jaeger;
- a model with +inf in one layer's weight at level 5, then SIGKILL of the
  scheduler mid-request (the OOM killer's way);
- SIGTERM to every process of the server (systemd's way), and to its
  launcher alone;
- `--tp 2`, which fails to start on the CPU;
- the scheduler frozen, resumed, then killed idle, and a server started
  again over the same directory.
"""

import concurrent.futures
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from backends import Collector, Jaeger, ensure_built, get, port, wait
from conftest import clean_env

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
EMBEDDING = "sglang.quant_method.UnquantizedEmbeddingMethod.embedding"
LINEAR = "sglang.quant_method.UnquantizedLinearMethod.apply"
FUSED = "kernels.fused_op.BaseFusedOp.forward"
POISONED = "model.layers.1.mlp.down_proj"
START_SECONDS = 420  # a first start in a new environment compiles SGLang's modules; a loaded CI machine is slow


@pytest.fixture(scope="module")
def sglang_python():
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "sglang-env")], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return os.path.join(proc.stdout.strip().splitlines()[-1], "bin", "python")


@pytest.fixture(scope="module")
def models(sglang_python, tmp_path_factory):
    """{"dummy": a model served with random weights, "poisoned": one whose
    POISONED weight holds +inf}."""
    root = tmp_path_factory.mktemp("models")
    made = {}
    for name, options in (("dummy", ["--dummy"]), ("poisoned", ["--poison", POISONED + ".weight"])):
        proc = subprocess.run([sglang_python, os.path.join(TESTS, "tiny_llama.py"), str(root / name), *options],
                              capture_output=True, text=True, timeout=600, env=clean_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = str(root / name)
    return made


class Server:
    """`sglang-otel-kernels run --level L -- python -m sglang.launch_server ...`
    in `directory` (its trace files land there), ready to serve."""

    def __init__(self, python: str, directory, model: str, level: int, *args: str, dummy: bool = False, **env):
        self.directory = str(directory)
        self.port = port()
        command = [python, "-m", "sglang_otel_kernels", "run", "--level", str(level), "--",
                   python, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
                   "--skip-server-warmup", "--tp", "1", "--max-total-tokens", "4096",
                   # Without it an idle scheduler polls its sockets in a loop: a core each server, taken
                   # from the tests beside it (measured: 0.99 of a core idle, 0.015 with it).
                   "--sleep-on-idle", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if dummy:
            command += ["--load-format", "dummy"]
        environment = clean_env(PYTHONPATH=ROOT, SGLANG_USE_CPU_ENGINE="1", SGLANG_KERNEL_API_LOGDEST="off",
                                SGLANG_KERNEL_API_TRACEFILE=os.path.join(self.directory, "trace_%i.sgltrace"), **env)
        self.log_path = os.path.join(self.directory, "server.log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=self.directory, env=environment, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_SECONDS
        while "The server is fired up and ready to roll!" not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"the server did not start: {self.text()[-4000:]}")
            time.sleep(0.5)

    def text(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()

    def generate(self, body: dict, headers: dict | None = None, timeout: float = 120) -> "tuple[int, dict | str]":
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            return 0, str(exc)

    def pids(self) -> dict[str, int]:
        """The server's processes by their title (`sglang::scheduler`, ...), the launcher as `launcher`."""
        found = {"launcher": self.process.pid}
        for pid in _descendants(self.process.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    title = handle.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            found.setdefault(title, pid)
        return found

    def wait_gone(self, pid: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
            assert time.monotonic() < deadline, f"process {pid} still runs: {self.text()[-2000:]}"
            time.sleep(0.2)

    def trace_files(self) -> list[str]:
        return sorted(os.path.join(self.directory, name) for name in os.listdir(self.directory)
                      if name.endswith(".sgltrace"))

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=60)
        self.log.close()


class Watch:
    """`sglang-otel-kernels watch DIRECTORY --interval 0.5 ARGS` beside a
    server, what it prints kept in a file beside the directory."""

    def __init__(self, directory, *args: str, **env: str) -> None:
        self.log_path = f"{directory}-watch.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sglang_otel_kernels", "watch", str(directory), "--interval", "0.5", *args],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env(**env))

    def text(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()

    def lines(self, words: str) -> list[str]:
        return [line for line in self.text().splitlines() if words in line]

    def said(self, what: str, words: str, timeout: float = 30) -> str:
        """The first line holding `words`, waited for (`what`, in the failure's words)."""
        return wait(what, lambda: next(iter(self.lines(words)), None), timeout=timeout, detail=self.text)

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def _descendants(pid: int) -> list[int]:
    children = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            children = [int(child) for child in handle.read().split()]
    except OSError:
        pass
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=clean_env())


def spans_of(path: str) -> list:
    from sglang_otel_kernels.record.reader import read_trace

    return read_trace(path)


@pytest.fixture
def backends(tmp_path):
    ensure_built()
    jaeger = Jaeger(tmp_path)
    collector = Collector(tmp_path, jaeger, sample_percent=100, archive=str(tmp_path / "archive" / "spans.json"))
    yield jaeger, collector
    collector.close()
    jaeger.close()


def test_out_of_vocabulary_token_names_the_batch_the_request_and_the_embedding(sglang_python, models, backends,
                                                                               tmp_path):
    """The most common crash: a token id outside the vocabulary. SGLang's
    scheduler raises IndexError in its embedding lookup, SIGQUITs its parent
    and exits; the launcher kills the rest. It pages once (ProcessCrashed),
    with SGLang's --enable-trace and no setting of this package's. The
    report names the batch, the
    request and the op, exits 1, and says how the scheduler ended; Jaeger has
    SGLang's request spans and the kernel calls in each request's trace, and
    the request that killed the server has error spans saying IndexError and
    naming the embedding."""
    jaeger, collector = backends
    server = Server(sglang_python, tmp_path, models["dummy"], 1, "--enable-trace", "--otlp-traces-endpoint",
                    collector.address, dummy=True, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200")
    watch = Watch(tmp_path)
    try:
        good_trace, bad_trace = 0x0AF7651916CD43DD8448EB211C80319C, 0x0BF7651916CD43DD8448EB211C80319D
        rejected_trace = 0x0CF7651916CD43DD8448EB211C80319E
        status, answer = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 4}, "rid": "good-1"},
                                         {"traceparent": f"00-{good_trace:032x}-b7ad6b7169203331-01"})
        assert status == 200, answer
        # Over the context length: SGLang rejects it (400) before its scheduler sees it.
        status, answer = server.generate({"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4},
                                          "rid": "too-long-1"},
                                         {"traceparent": f"00-{rejected_trace:032x}-d7ad6b7169203331-01"})
        assert status == 400, answer
        scheduler = server.pids()["sglang::scheduler"]
        watch.said("watch following the scheduler", ": no suspect: 1 ranks", timeout=60)
        # The bad token among requests sent at once: the report names the request that carried it.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            mates = [pool.submit(server.generate, {"input_ids": [5, 6, 7, 8], "rid": f"mate-{number}",
                                                   "sampling_params": {"max_new_tokens": 4}}) for number in range(3)]
            status, answer = server.generate({"input_ids": [5, 99999, 7], "sampling_params": {"max_new_tokens": 4},
                                              "rid": "bad-req-1"},
                                             {"traceparent": f"00-{bad_trace:032x}-c7ad6b7169203331-01"})
            for mate in mates:
                mate.result()
        assert status != 200
        server.wait_gone(scheduler)
        server.process.wait(timeout=60)
        assert "IndexError" in server.text()
        # watch names the culprit as the report does.
        watch.said("watch saying the failed batch", "; request bad-req-1 caused it: id 99999 (row ")
    finally:
        watch.close()
        server.close()

    # One page: with SGLang's provider exporting the kernel spans, the scheduler's sidecar read its file once
    # it had ended (`follow --ending-only`), and the Collector serves the gauge to Prometheus: ProcessCrashed's.
    def pages():
        return [line for line in collector.samples("sglang_", "PROMETHEUS_PORT") if line.endswith(" 1")
                and line.startswith(("sglang_kernel_in_flight_at_death{", "sglang_process_crashed{"))]

    [page] = wait("the crash's page in the Collector's metrics", pages, timeout=60)
    assert 'sglang_process_reason="IndexError"' in page and f'sglang_kernel_name="{EMBEDDING}"' in page, page
    assert not [line for line in collector.samples("sglang_", "PROMETHEUS_PORT")
                if line.startswith("sglang_kernel_calls_total")]  # nothing counted: the calls went out in-process
    # The scheduler's file, and with SGLang's tracing on the launcher's (its request spans).
    path = os.path.join(str(tmp_path), f"trace_{scheduler}.sgltrace")
    assert path in server.trace_files()

    text = report(*server.trace_files())
    assert text.returncode == 1, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    # The batch (the bad request, and those batched with it), then the one whose token it was.
    assert re.fullmatch(rf"rank 0's batch sglang\.forward_batch \(requests? [^)]*bad-req-1[^)]*\) failed in "
                        rf"{re.escape(EMBEDDING)} \(model\.embed_tokens\): IndexError: index out of range in self; "
                        r"request bad-req-1 caused it: id 99999 \(row \d+ of \d+\) is outside the \d+ rows of "
                        r"the embedding", lines[0]), text.stdout
    # watch said that sentence too, once the batch had failed (after the call's, which it said first).
    assert any(line.endswith(f": {lines[0]}") for line in watch.text().splitlines()), watch.text()
    # It raised, then exited (SGLang's scheduler returns after SIGQUITting its parent), or was killed.
    assert any(line.startswith(("  rank 0: ended ", "  rank 0: died ")) and " s after it raised IndexError" in line
               for line in lines), text.stdout
    assert "Failed batches (1):" in text.stdout and "  caused by request bad-req-1: id 99999" in text.stdout
    # The rejected request ended (its root span, status ERROR): nothing of it is left unfinished.
    assert "too-long" not in text.stdout, text.stdout
    assert "embedding (unquant.py:" in text.stdout and "(vocab_parallel_embedding.py:" in text.stdout
    document = json.loads(report("--json", path).stdout)
    [batch] = document["failed_batches"]
    assert "bad-req-1" in batch["request_ids"] and batch["exception"]["type"] == "IndexError"
    assert batch["culprit"]["request_ids"] == ["bad-req-1"], batch
    assert batch["failed_call"] == EMBEDDING and batch["module"] == "model.embed_tokens"
    assert [frame["function"] for frame in batch["frames"][:2]] == ["embedding", "embedding"]
    assert os.path.basename(batch["frames"][1]["file"]) == "unquant.py"
    assert document["files"][0]["after_failure"]["exception"] == "IndexError"
    # The ending the page rendered, as the report reads it from the same file.
    ending = document["files"][0]["ending"]
    assert (ending["why"], ending["call"], ending["pages"]) == ("IndexError", EMBEDDING, True), ending
    page = tmp_path / "report.html"
    assert report("--html", str(page), path).returncode == 1
    # The page's banner says what the text's first line says (one verdict).
    assert "FAILED: " + html.escape(lines[0]) in page.read_text()

    # Names: each fused op's class, each layer's module; SGLang's own names unchanged.
    spans = spans_of(path)
    classes = {s.attributes.get("sglang.kernel.op_class") for s in spans if s.name == FUSED}
    assert {"RMSNorm", "RotaryEmbedding", "SiluAndMul"} <= classes, classes
    modules = {s.attributes.get("sglang.kernel.module") for s in spans if s.name == LINEAR}
    assert {POISONED, "model.layers.0.self_attn.qkv_proj"} <= modules, modules
    norms = {s.attributes.get("sglang.kernel.module") for s in spans
             if s.attributes.get("sglang.kernel.op_class") == "RMSNorm"}
    assert {"model.layers.0.input_layernorm", "model.norm"} <= norms, norms
    recorded = {s.name for s in spans}
    assert {EMBEDDING, "srt.layers.logits_processor.LogitsProcessor.forward",
            "srt.layers.sampler.Sampler.forward"} <= recorded, recorded

    # SGLang's request traces, with the kernel calls of their batches, in Jaeger.
    def traces_there():
        services = set(get(f"{jaeger.query}/api/services")["data"] or ())
        if not {"sglang", "sglang-kernels"} & services:
            return False
        return all(_jaeger_trace(jaeger, trace_id) for trace_id in (good_trace, bad_trace))

    wait("both requests' traces in Jaeger", traces_there, timeout=120)
    good = _jaeger_trace(jaeger, good_trace)
    names = {span["operationName"] for span in good["spans"]}
    assert any(name.startswith("Req ") or " Req " in name for name in names), names  # SGLang's root span
    assert "sglang.forward_batch" in names and FUSED in names and LINEAR in names, names
    # A request alone in its batches: every batch span its kernel calls point at arrived, through the same
    # provider (the last step's too, ended once SGLang processed its results).
    present = {span["spanID"] for span in good["spans"]}
    ours = [span for span in good["spans"] if span["operationName"] == "sglang.forward_batch"
            or any(tag["key"] == "sglang.kernel.name" for tag in span["tags"])]
    orphans = [span["operationName"] for span in ours for reference in span.get("references") or ()
               if reference["refType"] == "CHILD_OF" and reference["spanID"] not in present]
    assert ours and not orphans, orphans
    # The rejected request's root span reached Jaeger, ended in an error saying why.
    rejected = wait("the rejected request's root span", lambda: _jaeger_trace(jaeger, rejected_trace), timeout=60)
    [root] = [span for span in rejected["spans"] if " Req " in f" {span['operationName']}"]
    tags = {tag["key"]: tag["value"] for tag in root["tags"]}
    assert tags.get("error") in (True, "true") and "rejected before reaching the scheduler" in str(
        tags.get("otel.status_description")), tags
    wait("the failed request's error spans", lambda: EMBEDDING in {
        span["operationName"] for span in _jaeger_trace(jaeger, bad_trace)["spans"]}, timeout=120)
    bad = _jaeger_trace(jaeger, bad_trace)
    errors = {span["operationName"]: span for span in bad["spans"]
              if any(tag["key"] == "error" and tag["value"] in (True, "true") for tag in span["tags"])}
    # Its batch span (a batch of it alone), or its request span under a batch of several.
    assert EMBEDDING in errors and {"sglang.forward_batch", "sglang.forward_batch.request"} & set(errors), sorted(errors)
    assert any(log_field["value"] == "IndexError" for log in errors[EMBEDDING]["logs"]
               for log_field in log["fields"] if log_field["key"] == "exception.type")
    # The bad request's trace says its input was the cause: its own batch's call names it, or (batched with
    # others) the copy of the call in its trace is marked.
    tags = {tag["key"]: tag["value"] for tag in errors[EMBEDDING]["tags"]}
    assert tags.get("sglang.request.culprit") in (True, "true") or "bad-req-1" in str(
        tags.get("sglang.kernel.culprit_requests")), tags

    # The Collector's archive, read as an engineer reads it after the fact: the kernel spans went out through
    # SGLang's own provider, whose resource names no process; they and the batch spans carry the scheduler's
    # pid and host.
    collector.stop()  # its file exporter writes at shutdown
    archived = report(collector.archive)
    assert archived.returncode == 1, archived.stdout + archived.stderr
    assert f": pid {scheduler} on " in archived.stdout and "pid None" not in archived.stdout, archived.stdout
    assert archived.stdout.splitlines()[0] == lines[0], archived.stdout  # the batch, as from the file
    assert "Failed batches (1):" in archived.stdout and "  caused by request bad-req-1" in archived.stdout


def _jaeger_trace(jaeger: Jaeger, trace_id: int) -> "dict | None":
    found = get(f"{jaeger.query}/api/traces/{trace_id:032x}")
    return (found or {}).get("data", [None])[0] if found else None


def test_poisoned_layer_then_sigkill_mid_request(sglang_python, models, backends, tmp_path):
    """+inf in one layer's weight, served at level 5: the first NaN/Inf
    producer is that layer's call, with its module path and the request that
    hit it. Then the scheduler is SIGKILLed during a long request (the OOM
    killer's way): the report exits 1 and names the request being served and
    what was in flight (the kernel, or the batch when the kill lands between
    kernels), and the scheduler's sidecar gauges one page for it."""
    _, collector = backends
    server = Server(sglang_python, tmp_path, models["poisoned"], 5, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                    OTEL_EXPORTER_OTLP_INSECURE="true")
    try:
        status, answer = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 2}, "rid": "nan-1"})
        assert status == 200, answer
        [path] = server.trace_files()
        text = report(path)
        assert text.returncode == 3, text.stdout + text.stderr  # NaN/Inf, the process alive: no crash
        # The headline names the layer and the request, as a crash's names its call.
        assert text.stdout.startswith(f"the first NaN/Inf from finite inputs came out of {LINEAR}, module {POISONED}, "
                                      "in the rows of request nan-1 (rank 0, "), text.stdout
        first = text.stdout.split("First call that produced NaN/Inf from finite inputs:\n", 1)[1].splitlines()
        assert first[0].strip().startswith(LINEAR) and first[1].strip() == f"module {POISONED}", first
        assert any("NaN/Inf in the rows of nan-1" in line for line in first), first
        # The layer by its sizes, read from its own attributes: never its repr, on every call.
        assert "    arg0 = 'RowParallelLinear(input_size=128, output_size=64)'" in first, first
        nonfinite = json.loads(report("--json", path).stdout)["first_nonfinite_output"]
        assert nonfinite["module"] == POISONED and nonfinite["requests"]["request_ids"] == ["nan-1"]

        answers = []
        long = threading.Thread(target=lambda: answers.append(server.generate(
            {"text": "hello", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "rid": "long-1"},
            timeout=300)))
        long.start()
        # Mid-request: once the scheduler has run a few of its decode steps.
        wait("decode steps of long-1", lambda: sum(
            1 for s in spans_of(path) if s.name == "sglang.forward_batch"
            and "long-1" in (s.attributes.get("sglang.batch.request_ids") or ())) >= 3, timeout=120)
        scheduler = server.pids()["sglang::scheduler"]
        os.kill(scheduler, signal.SIGKILL)
        server.wait_gone(scheduler)
        long.join(timeout=300)
    finally:
        server.close()
    text = report(path)
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert first.startswith("rank 0 died") and "no fatal signal recorded" in first, first
    assert ("batch sglang.forward_batch: requests long-1" in text.stdout  # under the call in flight
            or "Batch running when the process died, between kernel calls:" in text.stdout
            and "serving request long-1" in text.stdout), text.stdout
    document = json.loads(report("--json", path).stdout)
    assert document["crashed"]
    [batch] = document["batches_at_death"]
    assert batch["request_ids"] == ["long-1"] and batch["state"] == "running"
    in_flight = document["in_flight"]
    assert batch["kernel_in_flight"] == bool(in_flight)
    if in_flight:  # the kill landed in a kernel: named, inside the batch of long-1
        assert in_flight[0]["requests"]["request_ids"] == ["long-1"], in_flight
        assert first.startswith(f"rank 0 died in {in_flight[0]['name']} (running "), first
    else:  # between kernels: the batch is what was in flight
        assert "while its batch sglang.forward_batch served request long-1" in first, first

    # One page (collector-config/prometheus-alerts.yaml), as the Collector serves the sidecar's gauges to
    # Prometheus: KernelProcessDied's when the kill landed in a kernel, ProcessCrashed's ("killed") between.
    def pages():
        return [line for line in collector.samples("sglang_", "PROMETHEUS_PORT") if line.endswith(" 1")
                and line.startswith(("sglang_kernel_in_flight_at_death{", "sglang_process_crashed{"))]

    [page] = wait("the kill's page in the Collector's metrics", pages, timeout=60)
    time.sleep(2)
    assert pages() == [page]
    if in_flight:
        assert page.startswith("sglang_kernel_in_flight_at_death{"), page
        assert f'sglang_kernel_name="{in_flight[0]["name"]}"' in page, page
    else:
        assert page.startswith("sglang_process_crashed{") and 'sglang_process_reason="killed"' in page, page


@pytest.mark.parametrize("inputs", [False, True], ids=["outputs", "inputs"])
def test_poisoned_layer_named_by_the_nan_flags_at_level_1(sglang_python, models, backends, tmp_path, inputs):
    """The same poisoned layer served at level 1 with the NaN flags
    (SGLANG_KERNEL_API_NAN_FLAGS=1) instead of level 5: no statistics, no
    synchronisation, and still the layer's call, its module path and the
    request whose rows it made non-finite, from the trace file; the mark
    back ends see names the layer, and so does the NaN/Inf counter the
    Collector serves to Prometheus (the KernelMadeNaN ticket's labels). With
    SGLANG_SANITIZE_NAN_LOGITS the request is served a healthy 200 from
    logits it turned from NaN/Inf into numbers: its trace says so. With
    the linear ops' arguments flagged too, the NaN is seen going into the
    layer's call through its weight (the layer, its first argument), not
    coming out of finite inputs."""
    _, collector = backends
    asked = {"SGLANG_KERNEL_API_NAN_FLAGS_INPUTS": "sglang.quant_method.*"} if inputs else {}
    server = Server(sglang_python, tmp_path, models["poisoned"], 1, SGLANG_KERNEL_API_NAN_FLAGS="1", **asked,
                    SGLANG_SANITIZE_NAN_LOGITS="1", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_METRIC_EXPORT_INTERVAL="1000")
    try:
        status, answer = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 2}, "rid": "nan-1"})
        assert status == 200, answer
        [path] = server.trace_files()
        text = report(path)
        marks = [span for span in spans_of(path) if span.name == "sglang.kernel.nonfinite"]
        # Under the flagged call of each step: the layer, its module path, the request whose rows it made NaN/Inf.
        assert {(mark.attributes.get("sglang.kernel.nonfinite_call"), mark.attributes.get("sglang.kernel.module"),
                 mark.attributes.get("sglang.kernel.nonfinite_requests")) for mark in marks
                if not mark.attributes.get("sglang.request.nonfinite_logits")} == {(LINEAR, POISONED, ("nan-1",))}
        # The logits it was sampled from: NaN/Inf in its row, before SGLang sanitized them.
        assert any(mark.attributes.get("sglang.request.nonfinite_logits") is True
                   and mark.attributes.get("sglang.request.id") == "nan-1"
                   and mark.attributes.get("sglang.kernel.nonfinite_call") == "sglang.sampler.logits"
                   for mark in marks), [mark.attributes for mark in marks]

        def counted():
            return [line for line in collector.samples("sglang_kernel_nonfinite", "PROMETHEUS_PORT")
                    if f'sglang_kernel_module="{POISONED}"' in line and f'sglang_kernel_name="{LINEAR}"' in line
                    and not line.endswith(" 0")] or None

        wait("the layer's NaN/Inf counted in the Collector", counted, timeout=60)
    finally:
        server.close()
    assert text.returncode == 3, text.stdout + text.stderr
    said = f"go into {LINEAR} through input.arg0, from before it" if inputs else f"come out of {LINEAR}"
    assert text.stdout.startswith(f"the NaN flags saw the first NaN/Inf {said}, module {POISONED}, "
                                  "in the rows of request nan-1 (rank 0, "), text.stdout
    document = json.loads(report("--json", path).stdout)
    nonfinite = document["first_nonfinite_output"]
    assert nonfinite["nonfinite_seen_by"] == "flags" and nonfinite["module"] == POISONED
    assert nonfinite["requests"]["request_ids"] == ["nan-1"] and nonfinite["outputs"] == {}
    assert nonfinite["nonfinite_inputs"] == (["input.arg0"] if inputs else None)
    assert {mark["request_id"] for mark in document["nonfinite_logits"]} == {"nan-1"}


def test_sigkill_mid_request_with_sglangs_own_tracing_reaches_jaeger_and_pages(sglang_python, models, backends,
                                                                               tmp_path):
    """SGLang's --enable-trace and nothing of this package's but the level:
    SGLang's provider exports the spans, the kernel calls' included, and the
    scheduler's sidecar reads its file only once it has ended (`follow
    --ending-only`). SIGKILL mid-request: the request's trace in Jaeger gets
    what was in flight, the batch (and the kernel call, when the kill landed
    in one), and one page."""
    jaeger, collector = backends
    server = Server(sglang_python, tmp_path, models["dummy"], 1, "--enable-trace", "--otlp-traces-endpoint",
                    collector.address, dummy=True, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200")
    trace_id = 0x0CF7651916CD43DD8448EB211C80319E
    watch = Watch(tmp_path)
    try:
        watch.said("watch following the scheduler", ": no suspect: 1 ranks", timeout=60)
        long = threading.Thread(target=lambda: server.generate(
            {"text": "hello", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "rid": "long-1"},
            {"traceparent": f"00-{trace_id:032x}-d7ad6b7169203331-01"}, timeout=300))
        long.start()
        scheduler = server.pids()["sglang::scheduler"]
        path = os.path.join(str(tmp_path), f"trace_{scheduler}.sgltrace")
        wait("decode steps of long-1", lambda: os.path.exists(path) and sum(
            1 for s in spans_of(path) if s.name == "sglang.forward_batch") >= 5, timeout=120)
        os.kill(scheduler, signal.SIGKILL)
        server.wait_gone(scheduler)
        # watch announces the death wherever the kill landed: in a kernel call, or between two (the batch).
        death = watch.said("watch saying the death", ": rank 0 died ")
        assert "long-1" in death, death
        long.join(timeout=300)
    finally:
        watch.close()
        server.close()
    in_flight = json.loads(report("--json", path).stdout)["in_flight"]

    def pages():
        return [line for line in collector.samples("sglang_", "PROMETHEUS_PORT") if line.endswith(" 1")
                and line.startswith(("sglang_kernel_in_flight_at_death{", "sglang_process_crashed{"))]

    [page] = wait("the kill's page in the Collector's metrics", pages, timeout=60)
    if in_flight:
        assert page.startswith("sglang_kernel_in_flight_at_death{"), page
        assert f'sglang_kernel_name="{in_flight[0]["name"]}"' in page, page
    else:
        assert page.startswith("sglang_process_crashed{") and 'sglang_process_reason="killed"' in page, page

    def cut_short():
        spans = (_jaeger_trace(jaeger, trace_id) or {}).get("spans", [])
        return {span["operationName"] for span in spans
                if any(tag["key"] == "sglang.kernel.in_flight" and tag["value"] is True for tag in span["tags"])}

    # The request's root span too ("Req <rid>", SGLang's, left open in the launcher's file): its sidecar
    # is out of the process tree SGLang's cleanup kills, and exports it once the launcher is gone.
    names = wait("the spans in flight at the kill, the request's root among them, in the request's trace",
                 lambda: (lambda found: found if "sglang.forward_batch" in found and
                          any("Req " in name for name in found) else None)(cut_short()), timeout=120)
    assert not in_flight or in_flight[-1]["name"] in names, (names, in_flight)


def test_a_request_asking_more_top_logprobs_than_the_vocabulary_has_is_named_among_its_batch(sglang_python, models,
                                                                                             tmp_path):
    """The sampler's crash: one request of a batch asks for 500 top logprobs
    of the tiny model's vocabulary; torch's topk fails the batch in
    SGLang's Sampler.forward and the scheduler exits. The report names the
    batch, the sampler and, apart from its mates, that request."""
    server = Server(sglang_python, tmp_path, models["dummy"], 1, dummy=True)
    try:
        scheduler = server.pids()["sglang::scheduler"]
        asked = [({"input_ids": [5, 6, 7, 8], "rid": f"mate-{number}", "return_logprob": True,
                   "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 4}}) for number in range(3)]
        asked.append({"input_ids": [5, 6, 7], "rid": "greedy-1", "return_logprob": True, "top_logprobs_num": 500,
                      "sampling_params": {"max_new_tokens": 4}})
        with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(server.generate, asked))
        assert answers[-1][0] != 200, answers[-1]
        server.wait_gone(scheduler)
    finally:
        server.close()
    text = report(str(tmp_path))
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert re.fullmatch(r"rank 0's batch sglang\.forward_batch \(requests? [^)]*greedy-1[^)]*\) failed in "
                        r"srt\.layers\.sampler\.Sampler\.forward \(sampler\): RuntimeError: selected index k out of "
                        r"range; request greedy-1 caused it: top_logprobs_num 500 \(row \d+ of \d+\) is more than the "
                        r"\d+ tokens of the vocabulary", first), text.stdout


def test_tp2_on_the_cpu_fails_to_start_and_the_report_says_where(sglang_python, models, tmp_path):
    """`--tp 2` does not run on the CPU in SGLang 0.5.23: each rank's
    Scheduler(...) fails in PyNcclCommunicator. Both rank files are
    identified, and the verdict names the failed start and where it failed;
    a rank killed by the launcher before it failed reads as cut short in its
    start."""
    command = [sglang_python, "-m", "sglang_otel_kernels", "run", "--level", "1", "--", sglang_python, "-m",
               "sglang.launch_server", "--model-path", models["dummy"], "--load-format", "dummy", "--device", "cpu",
               "--skip-server-warmup", "--tp", "2", "--max-total-tokens", "4096", "--host", "127.0.0.1",
               "--port", str(port())]
    # One core a rank, so that SGLang's one-rank-per-NUMA-node check lets both ranks start.
    environment = clean_env(PYTHONPATH=ROOT, SGLANG_USE_CPU_ENGINE="1", SGLANG_KERNEL_API_LOGDEST="off",
                            SGLANG_CPU_OMP_THREADS_BIND="0|1",
                            SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    proc = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=START_SECONDS, start_new_session=True)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    paths = sorted(str(path) for path in tmp_path.glob("*.sgltrace"))
    assert len(paths) == 2, (paths, proc.stderr[-3000:])
    text = report(*paths)
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert "engine init sglang.scheduler.init failed in" in first and "pynccl.py" in first, first
    assert first.endswith("ValueError: Expected a cuda device, but got: cpu"), first
    document = json.loads(report("--json", *paths).stdout)
    assert sorted(rank["rank"] for rank in document["cross_rank"]["ranks"]) == [0, 1]
    # Each rank's start failed, or was still running when SGLang's launcher, told of the first failure, killed
    # the ranks (so seen on a loaded machine: rank 1 killed before it reached PyNcclCommunicator).
    failed = {batch["rank"]: batch["stage"] for batch in document["failed_batches"]}
    cut_short = {batch["rank"]: batch["stage"] for batch in document["batches_at_death"]}
    assert failed and set(failed.values()) == {"init"}, document["failed_batches"]
    assert {**cut_short, **failed} == {0: "init", 1: "init"}, (failed, cut_short)


@pytest.mark.parametrize("whom", ["every process", "the launcher"])
def test_server_stopped_with_sigterm_reads_as_stopped(sglang_python, models, tmp_path, whom):
    """SIGTERM to every process of the server, as systemd stops a service, or
    to its launcher alone, which drains and sends its scheduler SGLang's
    ShutdownReq: every file reads as stopped (the SIGTERM it recorded, or
    what told it to stop), none as dead, and the report exits 0."""
    server = Server(sglang_python, tmp_path, models["dummy"], 1, dummy=True)
    try:
        status, answer = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 4}, "rid": "ok-1"})
        assert status == 200, answer
        processes = server.pids()
        scheduler = processes["sglang::scheduler"]
        for pid in processes.values() if whom == "every process" else [processes["launcher"]]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        server.wait_gone(scheduler)
        server.process.wait(timeout=120)
    finally:
        server.close()
    paths = server.trace_files()
    text = report(*paths)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "rank 0: stopped (" in text.stdout, text.stdout
    assert "died" not in text.stdout and "CRASHED" not in text.stdout, text.stdout
    document = json.loads(report("--json", *paths).stdout)
    assert not document["crashed"]
    states = {info["pid"]: (info["state"], info["stop_reason"], info["fatal_signal"]) for info in document["files"]}
    assert states[scheduler][0] == "stopped", states
    if whom == "the launcher":  # SGLang drained, then told its scheduler to stop, which exited
        assert states[scheduler][1] == "SGLang's ShutdownReq from its launcher", states
        assert "rank 0: stopped (told to stop: SGLang's ShutdownReq from its launcher)" in text.stdout, text.stdout
        assert states[processes["launcher"]] == ("stopped", "SIGTERM, taken by SGLang's handler", None), states
    assert all(state == "stopped" for state, _, _ in states.values()), states


def test_frozen_then_killed_idle_then_restarted_over_the_same_directory(sglang_python, models, backends, tmp_path):
    """What an on-call engineer meets most, each read the same by the text,
    the JSON, the exit status, `watch` (and its spans in Jaeger), `report
    --jaeger` and the files copied off the node: the scheduler frozen
    (SIGSTOP) is a hang on its one rank, and healthy again once it resumes;
    killed idle (the OOM killer, seconds after its last request returned
    200) it died serving no request; a new server started over the directory
    leads the report, the old death dated behind it. With SGLang's
    --enable-trace, as docs/sglang.md sets it up."""
    jaeger, collector = backends

    def verdict(*args: str, where: "str | None" = str(tmp_path)) -> "tuple[int, str, dict]":
        args += (where,) if where else ()
        text, document = report(*args), report("--json", *args)
        assert document.stdout, document.stderr
        found = json.loads(document.stdout)["verdict"]
        assert text.returncode == document.returncode == found["exit_status"], (text.stdout, found)
        return text.returncode, text.stdout.splitlines()[0], found

    def verdict_spans(reason: str) -> list:
        found = get(f"{jaeger.query}/api/traces?service=sglang&operation=sglang.verdict&limit=50&lookback=1h")
        return [span for trace in (found or {}).get("data") or () for span in trace["spans"]
                if {"key": "sglang.verdict.reason", "type": "string", "value": reason} in span["tags"]]

    server = Server(sglang_python, tmp_path, models["dummy"], 1, "--enable-trace", "--otlp-traces-endpoint",
                    collector.address, dummy=True, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200")
    # Its metrics exported every second: the hang's gauge is seen while the hang lasts.
    watch = Watch(tmp_path, "--hang-seconds", "6", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                  OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_METRIC_EXPORT_INTERVAL="1000")

    try:
        done_trace = 0x0DF7651916CD43DD8448EB211C80319F
        status, answer = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 4},
                                          "rid": "done-ok-1"},
                                         {"traceparent": f"00-{done_trace:032x}-e7ad6b7169203331-01"})
        assert status == 200, answer
        scheduler = server.pids()["sglang::scheduler"]
        watch.said("watch following the live files", ": no suspect: 1 ranks", timeout=60)
        os.kill(scheduler, signal.SIGSTOP)
        time.sleep(8)  # past the 5 s that make a heartbeat stale, and the threshold below
        status, first, found = verdict("--hang-seconds", "6")
        assert status == 1 and found["kind"] == "hung", first
        assert first.startswith("rank 0 is frozen: its heartbeat stopped at "), first
        # watch says it, and its ERROR span reaches Jaeger while the hang lasts.
        watch.said("watch saying the hang", ": rank 0 is frozen: its heartbeat stopped at ")
        wait("the hang's verdict span in Jaeger", lambda: verdict_spans("hung"), timeout=60)
        # The gauge a page fires on, as the Collector serves it to Prometheus (0 once the hang is over).
        gauge = 'sglang_job_suspect{'
        wait("the hang's gauge", lambda: [line for line in collector.samples("sglang_", "PROMETHEUS_PORT")
                                          if line.startswith(gauge) and 'reason="hung"' in line
                                          and line.endswith(" 1")], timeout=30)
        os.kill(scheduler, signal.SIGCONT)
        resumed = wait("the scheduler's heartbeat back", lambda: (lambda seen: seen if seen[0] == 0 else None)(
            verdict("--hang-seconds", "6")), timeout=60)
        assert resumed[2]["kind"] == "clean" and resumed[1].startswith("no suspect: 1 ranks (1 running)"), resumed
        wait("the hang's gauge back to 0", lambda: [line for line in collector.samples("sglang_", "PROMETHEUS_PORT")
                                                    if line.startswith(gauge) and 'reason="hung"' in line
                                                    and line.endswith(" 0")], timeout=30)
        wait("watch and Jaeger saying the hang ended", lambda: verdict_spans("none") and len(
            watch.lines(": no suspect: 1 ranks")) >= 2, timeout=60, detail=watch.text)
        time.sleep(3)  # idle since the request returned
        os.kill(scheduler, signal.SIGKILL)
        server.wait_gone(scheduler)
        # A death between kernel calls (here, idle) is announced, naming no request.
        death = watch.said("watch saying the death", "with no kernel call or batch running")
        assert ": rank 0 died at " in death and "done-ok-1" not in death, death
        # Its sidecar tells the back end how the scheduler ended before the launcher is killed.
        wait("the death span in Jaeger", lambda: get(
            f"{jaeger.query}/api/traces?service=sglang&operation=sglang.process.death&limit=5&lookback=1h")["data"],
             timeout=60)
        # The request that succeeded before it is not blamed: nothing in its trace is an error.
        done = _jaeger_trace(jaeger, done_trace)
        assert done and not [span["operationName"] for span in done["spans"]
                             if {"key": "error", "type": "bool", "value": True} in span["tags"]], done
    finally:
        watch.close()
        server.close()
    status, first, found = verdict()
    assert status == 1 and found["kind"] == "died", first
    assert first.startswith("rank 0 died at ") and "with no kernel call or batch running" in first, first
    assert "done-ok-1" not in first, first
    document = json.loads(report("--json", str(tmp_path)).stdout)
    assert document["batches_at_death"] == [] and not document["crashed"], document["batches_at_death"]
    assert not any(span["name"] == "sglang.forward_batch" for span in document["in_flight_other_spans"])
    # The back end read as the files are: the same kind, the same exit status.
    status_there, first_there, found_there = verdict("--jaeger", jaeger.query, "--service", "sglang", where=None)
    assert (status_there, found_there["kind"]) == (1, "died"), first_there
    assert first_there.startswith("rank 0 died ") and "done-ok-1" not in first_there, first_there
    # Copied off the node (cp without -p; a tar, its times to the second): the same verdict.
    copied, unpacked = tmp_path.parent / f"{tmp_path.name}-cp", tmp_path.parent / f"{tmp_path.name}-tar"
    copied.mkdir()
    unpacked.mkdir()
    for name in os.listdir(tmp_path):
        if name.startswith("trace_"):
            shutil.copy(tmp_path / name, copied / name)
    subprocess.run(["tar", "-C", str(tmp_path), "-cf", str(unpacked / "files.tar"), "--format=ustar",
                    *[name for name in os.listdir(tmp_path) if name.startswith("trace_")]], check=True)
    subprocess.run(["tar", "-C", str(unpacked), "-xf", str(unpacked / "files.tar")], check=True)
    os.remove(unpacked / "files.tar")
    for where in (copied, unpacked):
        assert verdict(where=str(where)) == (status, first, {**found, "file": found["file"].replace(
            str(tmp_path), str(where))}), where

    again = Server(sglang_python, tmp_path, models["dummy"], 1, dummy=True)
    try:
        status, first, found = verdict()
        assert status == 1 and found["kind"] == "died", first
        assert " running; another process, gone since 20" in first and ": rank 0 died at " in first, first
    finally:
        again.close()
