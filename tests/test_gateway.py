"""The two-tier layout of collector-config/gateway/, end to end with the real
binaries on loopback: 8 processes (2 "nodes" of 4 ranks, tests/
gateway_worker.py), each node's sidecars sending to its own agent
(agent.yaml), the agents routing by trace id to 2 gateways (gateway.yaml,
tail sampling), the gateways sending to Jaeger on Badger
(jaeger-badger.yaml). Every request's trace holds spans of all 8 processes,
so it reaches a gateway through both agents. Checked through Jaeger's query
API against the spans the trace files hold."""

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.error

import pytest

from backends import Jaeger, Otelcol, clean_env, ensure_built, port, wait
from sglang_otel_kernels.record.reader import read_trace_file

TESTS = os.path.dirname(os.path.abspath(__file__))
SAMPLE_PERCENT = 30
# Longer than a trace's spans take to reach a gateway on a loaded machine (each rank's
# sidecar exports on its own schedule): a trace decided before its error span arrived
# is judged clean, and the error span then follows that decision.
DECISION_WAIT_S = 10
SERVICE = "gateway-test"
RANKS_PER_NODE, NODES = 4, 2
CLEAN_PER_PHASE, FAULTS_PER_PHASE = 90, {"error": 5, "nan": 4}


def _plan(phase: int, rng: random.Random, crash: bool) -> list:
    """A phase's requests: clean ones, and faulty ones on a random rank."""
    kinds = ["clean"] * CLEAN_PER_PHASE + [k for k, n in FAULTS_PER_PHASE.items() for _ in range(n)]
    rng.shuffle(kinds)
    if crash:
        kinds.append("crash")  # last: the rank it kills runs no later request
    return [[f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01", kind,
             rng.randrange(RANKS_PER_NODE * NODES)] for kind in kinds]


def _run_phase(tmp_path, phase: int, plan: list, agents: list) -> None:
    path = tmp_path / f"plan-{phase}.json"
    path.write_text(json.dumps(plan))
    workers = []
    for rank in range(RANKS_PER_NODE * NODES):
        agent = agents[rank // RANKS_PER_NODE]
        env = clean_env(OTEL_SERVICE_NAME=SERVICE, OTEL_EXPORTER_OTLP_ENDPOINT=agent.endpoint,
                        OTEL_EXPORTER_OTLP_INSECURE="true", SGLANG_KERNEL_API_LOGLEVEL="5",
                        SGLANG_KERNEL_API_LOGDEST="off",
                        SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / f"phase{phase}_rank{rank}_%i.sgltrace"))
        workers.append(subprocess.Popen([sys.executable, os.path.join(TESTS, "gateway_worker.py"), str(path), str(rank)],
                                        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode in (0, -9), err  # -9: the rank a `crash` request killed


def _abort_job(directory, agents: list) -> None:
    """4 gloo ranks (tests/rank_worker.py, 2 through each agent) whose rank 2
    aborts inside the kernel layer.boom at step 16; the others fail in the
    all-reduce it never enters. Each step is a trace of its own, and so is
    each of the two requests, each routed to either gateway: 18 traces split
    every rank over both archives but for a chance of 1 in 2**17."""
    directory.mkdir()
    rendezvous = port()
    ranks = []
    for rank in range(4):
        env = clean_env(OTEL_SERVICE_NAME="gateway-job", OTEL_EXPORTER_OTLP_ENDPOINT=agents[rank // 2].endpoint,
                        OTEL_EXPORTER_OTLP_INSECURE="true", SGLANG_KERNEL_API_LOGLEVEL="1",
                        SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_TRACEFILE=str(directory / "trace_%i.sgltrace"))
        # Each rank's stderr, which its sidecar shares, kept for a failure's message.
        with open(directory / f"rank{rank}.stderr", "w") as stderr:
            ranks.append(subprocess.Popen([sys.executable, os.path.join(TESTS, "rank_worker.py"), str(rank), "4",
                                           str(rendezvous), "abort", "20", "16"], cwd=directory, env=env,
                                          stdout=subprocess.DEVNULL, stderr=stderr))
    for process in ranks:
        process.wait(timeout=120)


def _spans_by_trace(tmp_path) -> dict[int, int]:
    """Spans per trace id in all the ranks' trace files: what Jaeger should hold of a kept trace."""
    counts: dict[int, int] = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".sgltrace"):
            for span in read_trace_file(str(tmp_path / name)).spans:
                counts[span.trace_id] = counts.get(span.trace_id, 0) + 1
    return counts


def _held(jaeger: Jaeger, trace_id: int) -> int:
    """How many spans of a trace Jaeger holds (0: none)."""
    try:
        return len(jaeger.trace(trace_id)["spans"])
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return 0
        raise


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    ensure_built()
    tmp_path = tmp_path_factory.mktemp("gateway")
    jaeger = Jaeger(tmp_path, "gateway/jaeger-badger.yaml", BADGER_DIR=str(tmp_path / "badger"))
    gateways = [Otelcol(tmp_path, f"gateway-{n}", "gateway/gateway.yaml", JAEGER_OTLP_ENDPOINT=jaeger.otlp,
                        SAMPLE_PERCENT=str(SAMPLE_PERCENT), DECISION_WAIT=f"{DECISION_WAIT_S}s",
                        ARCHIVE_PATH=str(tmp_path / f"archive-{n}" / "kernels.jsonl")) for n in (1, 2)]
    hosts = "[" + ", ".join(gateway.address for gateway in gateways) + "]"
    agents = [Otelcol(tmp_path, f"agent-{n}", "gateway/agent.yaml", GATEWAYS=hosts) for n in (1, 2)]
    rng = random.Random(26)
    plans = {1: _plan(1, rng, crash=True), 2: _plan(2, rng, crash=False), 3: _plan(3, rng, crash=False)}
    outage = {}
    unwhole = {}  # phase -> {trace id: (spans Jaeger holds, spans written)}, for a failure's message

    def whole(phase: int) -> bool:
        expected = _spans_by_trace(tmp_path)
        short = {f"{t:032x}": (_held(jaeger, t), expected[t]) for t in _trace_ids(plans[phase], clean=False)}
        unwhole[phase] = {t: n for t, n in short.items() if n[0] != n[1]}
        return not unwhole[phase]

    try:
        _run_phase(tmp_path, 1, plans[1], agents)
        wait("phase 1's faulty traces whole in Jaeger", lambda: whole(1), timeout=120, detail=unwhole)
        time.sleep(DECISION_WAIT_S + 3)  # every trace of phase 1 decided: a gateway's undecided traces die with it
        gateways[0].kill()  # a gateway lost mid-run
        _run_phase(tmp_path, 2, plans[2], agents)
        time.sleep(2)  # the sidecars' last spans reach the agents, which hold what was routed to the dead gateway
        outage["agents_while_down"] = [agent.samples("otelcol_loadbalancer_backend_outcome") for agent in agents]
        outage["dead"] = gateways[0].address
        gateways[0].start()
        _run_phase(tmp_path, 3, plans[3], agents)
        wait("phase 3's faulty traces whole in Jaeger", lambda: whole(3), timeout=120, detail=unwhole)
        _abort_job(tmp_path / "job", agents)
        time.sleep(DECISION_WAIT_S + 3)  # the clean traces' decisions, taken in the same ticks
        expected = _spans_by_trace(tmp_path)
        outage["agents_after"] = [agent.samples("otelcol_loadbalancer_backend_outcome") for agent in agents]
        outage["restarted_gateway_accepted"] = gateways[0].metrics().get("otelcol_receiver_accepted_spans", 0)
        yield {"jaeger": jaeger, "plans": plans, "expected": expected, "outage": outage, "tmp": tmp_path,
               "gateways": gateways}
    finally:
        for collector in (*agents, *gateways):
            collector.close()
        jaeger.close()


def _trace_ids(plan: list, clean: bool) -> list[int]:
    return [int(tp.split("-")[1], 16) for tp, kind, _ in plan if (kind == "clean") == clean]


def test_every_faulty_trace_is_in_jaeger_whole_with_the_spans_of_every_process(fleet):
    jaeger, expected = fleet["jaeger"], fleet["expected"]
    for phase in (1, 3):  # before the outage, and after the gateway is back
        for trace_id in _trace_ids(fleet["plans"][phase], clean=False):
            assert expected[trace_id] >= 3 * RANKS_PER_NODE * NODES - 3  # spans of all 8 processes
            assert _held(jaeger, trace_id) == expected[trace_id], f"{trace_id:032x}"
            processes = {process["serviceName"] + str(process.get("tags"))
                         for process in jaeger.trace(trace_id)["processes"].values()}
            assert len(processes) >= RANKS_PER_NODE * NODES - 1  # the crashed rank may have left before it


def test_a_clean_trace_is_kept_whole_or_not_at_all_at_the_sampled_share(fleet):
    jaeger, expected = fleet["jaeger"], fleet["expected"]
    clean = [t for phase in (1, 3) for t in _trace_ids(fleet["plans"][phase], clean=True)]
    held = {t: _held(jaeger, t) for t in clean}
    assert all(count in (0, expected[t]) for t, count in held.items()), \
        [(f"{t:032x}", count, expected[t]) for t, count in held.items() if count not in (0, expected[t])]
    kept, p = sum(1 for count in held.values() if count), SAMPLE_PERCENT / 100
    sigma = math.sqrt(len(clean) * p * (1 - p))
    assert abs(kept - len(clean) * p) <= 4 * sigma, (kept, len(clean))


def test_what_the_agents_did_while_a_gateway_was_down(fleet):
    """The agents queue what they route to a dead gateway (their sending
    queue: the exporter reports success on enqueueing, as the printed
    outcomes show) and retry it into the gateway once it is back: it accepts
    spans sent while it was down. Printed for the record (pytest -s): how the
    faulty traces sent during the outage came out. Those of one trace reach
    the restarted gateway when each agent's retry does, which may be more
    than the decision wait apart (5 s here, 30 s shipped): such a trace may be
    decided on part of its spans (docs/scale.md)."""
    jaeger, expected, outage = fleet["jaeger"], fleet["expected"], fleet["outage"]
    for n, (during, after) in enumerate(zip(outage["agents_while_down"], outage["agents_after"]), 1):
        print(f"agent {n}, gateway {outage['dead']} down: {during}; at the end: {after}")
    print(f"the restarted gateway accepted {outage['restarted_gateway_accepted']:g} spans")
    faulty = _trace_ids(fleet["plans"][2], clean=False)
    held = [_held(jaeger, t) for t in faulty]
    print(f"faulty traces sent while a gateway was down: {sum(h == expected[t] for h, t in zip(held, faulty))} whole, "
          f"{sum(0 < h < expected[t] for h, t in zip(held, faulty))} partial, {held.count(0)} absent, of {len(faulty)}")
    assert outage["restarted_gateway_accepted"] > 0
    assert not [line for lines in outage["agents_after"] for line in lines if 'success="false"' in line]


def _job_ranks(archive: str) -> set[int]:
    """The ranks of the abort job that an archive holds spans of."""
    ranks = set()
    for name in os.listdir(archive):
        with open(os.path.join(archive, name)) as lines:
            for line in lines:
                for resource_spans in json.loads(line)["resourceSpans"]:
                    attributes = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
                    if attributes["service.name"]["stringValue"] == "gateway-job":
                        ranks.add(int(attributes["sglang.rank"]["intValue"]))
    return ranks


def test_report_over_the_gateways_archives_gives_one_verdict_for_the_ranks_they_split(fleet):
    """Each gateway archives the traces routed to it, so every rank's spans
    are split over both archives: `report` puts each process back together."""
    archives = [str(fleet["tmp"] / f"archive-{n}") for n in (1, 2)]

    last = {}

    def verdict():
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *archives, "--json"],
                              capture_output=True, text=True, timeout=120)
        jobs = json.loads(proc.stdout)["cross_rank_jobs"] if proc.stdout else []
        job = [j for j in jobs if len(j["ranks"]) == 4]
        last["suspects"] = job[0]["suspects"] if job else None
        last["rank 2's stderr"] = (fleet["tmp"] / "job" / "rank2.stderr").read_text()[-3000:]
        # Rank 2's crash reaches the archives through its sidecar after its death: on a loaded machine, after the
        # other ranks' failed all_reduce (seen: a verdict of three ranks that raised, read before it came).
        return job if job and any(s["reason"] == "crashed" for s in job[0]["suspects"]) else None

    [job] = wait("the job's verdict from the archives", verdict, timeout=120, detail=last)
    # The sidecar put the signal rank 2 recorded on the call it left in flight: a crash, in the archives too.
    assert [(s["rank"], s["reason"], s["call"]) for s in job["suspects"]] == [(2, "crashed", "layer.boom")]
    split = [_job_ranks(archive) for archive in archives]
    assert split[0] & split[1], split  # the routing did split ranks
    merged = {int(rank["rank"]) for rank in job["ranks"] if rank["file"].endswith("(and 1 more file(s))")}
    assert merged == split[0] & split[1]  # one process from two files


def test_jaeger_on_badger_keeps_its_traces_across_a_restart_and_searches_error_true(fleet):
    jaeger, expected = fleet["jaeger"], fleet["expected"]
    faulty = _trace_ids(fleet["plans"][1], clean=False) + _trace_ids(fleet["plans"][3], clean=False)
    jaeger.stop()
    jaeger.start()
    assert all(_held(jaeger, t) == expected[t] for t in faulty)
    errors = [int(tp.split("-")[1], 16) for phase in (1, 3) for tp, kind, _ in fleet["plans"][phase]
              if kind in ("error", "crash")]
    found = jaeger.search(SERVICE, {"error": "true"})
    assert set(errors) <= found, len(set(errors) - found)


def _send_through(agent: Otelcol, count: int) -> set[int]:
    """`count` traces of one span each sent to `agent` over OTLP/gRPC from this process; their ids."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("tiers")
    spans = []
    for number in range(count):
        span = tracer.start_span(f"call {number}")
        span.end()
        spans.append(span)
    exporter = OTLPSpanExporter(endpoint=agent.endpoint, insecure=True, timeout=10)
    try:
        assert exporter.export(spans).name == "SUCCESS"
    finally:
        exporter.shutdown()
    return {span.get_span_context().trace_id for span in spans}


def _archived(gateway: Otelcol) -> set[int]:
    """The trace ids a gateway archived (stopping it first: the file exporter flushes at shutdown)."""
    gateway.stop()
    found = set()
    with open(gateway.env["ARCHIVE_PATH"]) as archive:
        for line in archive:
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    found.update(int(span["traceId"], 16) for span in scope["spans"])
    return found


@pytest.fixture
def certificate(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(tmp_path / "cert.pem"), "-days", "2", "-subj", "/CN=gateway",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True,
                   timeout=60)
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


@pytest.mark.parametrize("resolver", ["static", "dns"])
def test_agents_reach_a_gateway_over_tls_by_a_static_list_or_by_dns(tmp_path, certificate, resolver):
    """The gateway with gateway-tls.yaml, the agent with GATEWAY_TLS_INSECURE=false and the CA; the
    gateways named by GATEWAYS, or found by GATEWAYS_DNS (agent-dns.yaml). Neither logs a deprecated name."""
    ensure_built()
    cert, key = certificate
    gateway = Otelcol(tmp_path, "gateway", ["gateway/gateway.yaml", "gateway/gateway-tls.yaml"],
                      TLS_CERT_FILE=cert, TLS_KEY_FILE=key, JAEGER_OTLP_ENDPOINT=f"127.0.0.1:{port()}",
                      ARCHIVE_PATH=str(tmp_path / "archive" / "gateway.jsonl"))
    by = ({"GATEWAYS": f"[{gateway.address}]"} if resolver == "static" else
          {"GATEWAYS_DNS": "localhost", "GATEWAY_PORT": str(gateway.grpc)})
    agent = Otelcol(tmp_path, "agent", ["gateway/agent.yaml"] + (["gateway/agent-dns.yaml"] if resolver == "dns" else []),
                    GATEWAY_TLS_INSECURE="false", GATEWAY_TLS_CA_FILE=cert, **by)
    try:
        time.sleep(1 if resolver == "static" else 6)  # the DNS resolver's first answer
        sent = _send_through(agent, 20)
        agent.stop()  # flushes its queue to the gateway
        assert _archived(gateway) == sent
    finally:
        agent.close()
        gateway.close()
    for log in ("agent", "gateway"):
        text = (tmp_path / f"{log}.log").read_text()
        assert "deprecated" not in text, text[-2000:]


def test_an_agent_without_the_gateways_ca_delivers_nothing_and_counts_it(tmp_path, certificate):
    ensure_built()
    cert, key = certificate
    gateway = Otelcol(tmp_path, "gateway", ["gateway/gateway.yaml", "gateway/gateway-tls.yaml"],
                      TLS_CERT_FILE=cert, TLS_KEY_FILE=key, JAEGER_OTLP_ENDPOINT=f"127.0.0.1:{port()}",
                      ARCHIVE_PATH=str(tmp_path / "archive" / "gateway.jsonl"))
    agent = Otelcol(tmp_path, "agent", "gateway/agent.yaml", GATEWAY_TLS_INSECURE="false",
                    GATEWAYS=f"[{gateway.address}]")
    try:
        _send_through(agent, 5)
        wait("the agent's failed sends", lambda: "x509" in (tmp_path / "agent.log").read_text()
             or "certificate" in (tmp_path / "agent.log").read_text(), timeout=60)
    finally:
        agent.kill()
        gateway.close()
    assert not os.path.exists(gateway.env["ARCHIVE_PATH"]) or _lines(gateway.env["ARCHIVE_PATH"]) == 0


def _lines(path: str) -> int:
    with open(path) as handle:
        return sum(1 for _ in handle)


def test_the_agent_sends_the_authorization_header_it_is_given(tmp_path):
    """A gateway stand-in that keeps each export's gRPC metadata: what a proxy in front of the gateways sees."""
    from otlp_receivers import GrpcReceiver

    ensure_built()
    receiver = GrpcReceiver()
    agent = Otelcol(tmp_path, "agent", "gateway/agent.yaml", GATEWAYS=f"[127.0.0.1:{receiver.port}]",
                    GATEWAY_AUTHORIZATION="Bearer t0k3n")
    try:
        sent = _send_through(agent, 3)
        receiver.wait_for(lambda spans: {span["trace_id"] for span in spans} == sent)
    finally:
        agent.close()
        receiver.stop()
    assert receiver.metadata and all(headers.get("authorization") == "Bearer t0k3n" for headers in receiver.metadata)


def test_the_single_collector_starts_with_current_component_names(tmp_path):
    ensure_built()
    collector = Otelcol(tmp_path, "single", "otel-collector.yaml", JAEGER_OTLP_ENDPOINT=f"127.0.0.1:{port()}",
                        ARCHIVE_PATH=str(tmp_path / "archive" / "kernels.jsonl"))
    collector.close()
    text = (tmp_path / "single.log").read_text()
    assert "Everything is ready" in text and "deprecated" not in text, text[-2000:]
