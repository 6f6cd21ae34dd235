"""The README and the docs' quick starts, run as a user would run them, so
that they cannot rot: every ```python block that names a file is written to
it, every command of every ```sh block runs in one POSIX shell (`sh`), in order, in a
scratch folder (the repository's .ci, .venv, .backends and
collector-config linked into it), and each must exit as expected. What a
test machine has not (a GPU server, the network's package index) is
replaced, each replacement listed below with its reason; so is the one
command not run. A ```text block after a command block shows output:
its lines without numbers (ids, times) must be in that block's output. Also: docs/cli.md is each
subcommand's --help as it prints, and docs/trace-file-format.md's
layouts are the writer's."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from backends import ensure_built, port
from conftest import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The documents run, and the section of each that is its quick start (None: all of it).
QUICK_STARTS = {"README.md": None, "docs/sglang.md": "Quick start", "docs/crashed.md": None,
                "docs/scale.md": "A fleet, step by step", "docs/multi-gpu.md": "Walkthrough"}
# A server's stand-in: an SGLang-named kernel whose process dies inside it, as an illegal memory access kills one.
SERVER = ("import os, torch, sglang_otel_kernels as sok\n"
          "kernel = sok.debug_kernel_api(op_name='sglang.custom_op.moe_align_block_size')(lambda x: os.abort())\n"
          "kernel(torch.ones(4, dtype=torch.int32))\n")
# (text in a command, what runs instead, why)
SUBSTITUTIONS = [
    ("bash .ci/install && ", "", "CI ran `.ci/install --tests` just before the tests: the main job's demo runs"),
    ("pip install path/to/this/repository", f'pip install -q --no-deps --target "$SCRATCH/site" {ROOT}',
     "built and installed into a scratch folder, not over the environment under test"),
    (" 4 29500 stuck 0", ' 4 "$RENDEZVOUS" stuck 0', "the stand-in job's rendezvous on a free port"),
    ("python -m sglang.launch_server --model-path ... --tp 8", 'python "$SCRATCH/server.py"',
     "a server needs a GPU: a stand-in process dies (SIGABRT) inside an SGLang-named kernel"),
    ("/data/crash/", "$SCRATCH/data/crash/", "a scratch folder for /data"),
    ("/var/lib/", "$SCRATCH/var/lib/", "scratch folders for the fleet's data"),
    ("/etc/otelcol", "$SCRATCH/etc/otelcol", "a scratch folder for the fleet's certificates"),
    ("10.0.0.", "127.0.0.", "the fleet's hosts on one machine: the loopback address that ends the same"),
    ("127.0.0.1:14317", "$JAEGER_OTLP_GRPC", "Jaeger on free ports (its config reads them from the environment)"),
    ("127.0.0.1:16686", "$JAEGER_QUERY_HTTP", "the same"),
]
NOT_RUN = {"bash .ci/install --tests && .venv/bin/python -m pytest -q -n 4 --dist loadfile tests && bash .ci/compat":
           "it is this run (tests/test_cli.py pins that .ci/run runs exactly it)"}
# Commands that exit non-zero by design: `run` passes on the stand-in's SIGABRT, `report` says it found a crash.
EXITS = {"sglang-otel-kernels run --": 128 + signal.SIGABRT, "sglang-otel-kernels report ": 1}
LINKED = (".ci", ".venv", ".backends", "collector-config", "tests")


def _blocks(text: str, section: "str | None") -> list[tuple[str, str]]:
    """(language, body) of each fenced block of `text` (or of its `## section`)."""
    if section is not None:
        text = re.split(r"^## ", text.split(f"\n## {section}\n", 1)[1], flags=re.MULTILINE)[0]
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def _commands(body: str) -> list[str]:
    lines, joined = [], ""
    for line in body.splitlines():
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.strip() and not joined.lstrip().startswith("#"):
            lines.append(joined.strip())
        joined = ""
    return lines


def _expected_exit(command: str) -> int:
    return next((status for start, status in EXITS.items() if command.startswith(start)), 0)


def _script(blocks) -> tuple[str, list]:
    """The shell script of a document's command blocks: each command
    followed by a line with its exit status, each block by a marker."""
    script, commands = ["cd \"$SCRATCH\""], []
    for number, (language, body) in enumerate(blocks):
        if language != "sh":
            continue
        script.append(f"echo '::block {number}'")
        for command in _commands(body):
            if command in NOT_RUN:
                continue
            run = command
            for text, instead, _ in SUBSTITUTIONS:
                run = run.replace(text, instead)
            commands.append((command, run))
            if run.endswith("&"):  # a server the next commands talk to; its output to a file, not our pipe
                script.append(f'{run[:-1].rstrip()} > "$SCRATCH/background-{len(commands)}.log" 2>&1 &')
                continue
            script.append(run)
            script.append(f"echo \"::status {len(commands) - 1} $?\"")
    return "\n".join(script) + "\n", commands


def _scratch(tmp_path, name: str):
    scratch = tmp_path / name.replace("/", "_")
    scratch.mkdir()
    for each in LINKED:
        if os.path.exists(os.path.join(ROOT, each)):
            os.symlink(os.path.join(ROOT, each), scratch / each)
    (scratch / "server.py").write_text(SERVER)
    return scratch


def _without_numbers(text: str) -> str:
    """`text` with each word that holds a digit (a count, a time, an id, an
    address) as `#` and each run of blanks as one: what a shown output and
    a run's share."""
    return re.sub(r"[ \t]+", " ", re.sub(r"[\w.:/-]*\d[\w.:/-]*", "#", text))


def _jaeger_has_the_crash(query: str) -> bool:
    """The README's search (service sglang, tag sglang.kernel.in_flight=true) finds the crash, on the in-memory Jaeger."""
    url = f"{query}/api/traces?service=sglang&limit=20&lookback=1h&" + urllib.parse.urlencode(
        {"tags": json.dumps({"sglang.kernel.in_flight": "true"})})
    with urllib.request.urlopen(url, timeout=10) as response:
        traces = json.loads(response.read())["data"] or []
    return any(span["operationName"] == "sglang.custom_op.embedding"
               and {"key": "sglang.kernel.in_flight", "type": "bool", "value": True} in span["tags"]
               for trace in traces for span in trace["spans"])


@pytest.mark.parametrize("document", sorted(QUICK_STARTS))
def test_every_command_and_code_block_of_the_quick_starts_runs(document, tmp_path):
    ensure_built()
    text = open(os.path.join(ROOT, document)).read()
    blocks = _blocks(text, QUICK_STARTS[document])
    scratch = _scratch(tmp_path, document)
    for language, body in blocks:
        if language == "python":
            name = re.match(r"# (\S+\.py)\n", body)
            assert name, f"{document}: a python block names its file in its first line:\n{body}"
            (scratch / name.group(1)).write_text(body)
    script, commands = _script(blocks)
    assert commands, f"{document}: no command found"
    env = clean_env("JAEGER_")
    query = f"127.0.0.1:{port()}"
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"], SCRATCH=str(scratch), RENDEZVOUS=str(port()),
               JAEGER_OTLP_GRPC=f"127.0.0.1:{port()}", JAEGER_QUERY_HTTP=query, JAEGER_QUERY_GRPC=f"127.0.0.1:{port()}")
    shell = subprocess.Popen(["sh", "-c", script], cwd=scratch, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = shell.communicate(timeout=900)
        if document == "README.md":  # its Jaeger steps: the crash trace in Jaeger
            deadline = time.monotonic() + 30
            while not _jaeger_has_the_crash(f"http://{query}"):
                assert time.monotonic() < deadline, f"{document}: the crash trace did not reach Jaeger\n{output[-3000:]}"
                time.sleep(0.5)
    finally:
        try:
            os.killpg(shell.pid, signal.SIGTERM)  # what a command left running (Jaeger)
        except ProcessLookupError:
            pass
    statuses = dict(re.findall(r"^::status (\d+) (\d+)$", output, flags=re.MULTILINE))
    for index, (command, run) in enumerate(commands):
        if run.endswith("&"):
            continue
        assert str(index) in statuses, f"{document}: `{command}` never ran\n{output[-3000:]}"
        assert int(statuses[str(index)]) == _expected_exit(command), \
            f"{document}: `{command}` (run as `{run}`) exited {statuses[str(index)]}\n{output[-3000:]}"
    shown = {number: body for number, (language, body) in enumerate(blocks) if language == "text"}
    parts = dict(re.findall(r"^::block (\d+)\n(.*?)(?=^::block |\Z)", output, flags=re.MULTILINE | re.DOTALL))
    for number, body in shown.items():
        if str(number - 1) in parts:  # output shown after a command block: each line, any number in it (ids, times)
            printed = _without_numbers(parts[str(number - 1)])
            for line in body.splitlines():
                if line != "...":
                    assert _without_numbers(line) in printed, \
                        f"{document}: `{line}` is not in the output it shows:\n{parts[str(number - 1)][-3000:]}"


def test_the_substitutions_and_exceptions_still_match_the_documents():
    """A replacement or exception whose text left the documents is dead:
    the documents changed, and this list must say how they run now."""
    texts = "\n".join(open(os.path.join(ROOT, document)).read() for document in QUICK_STARTS)
    for text, _, why in SUBSTITUTIONS:
        assert text in texts, f"no document has {text!r} any more ({why})"
    for command in [*NOT_RUN, *EXITS]:
        assert command in texts, command


def test_the_cli_page_is_each_subcommands_help():
    page = open(os.path.join(ROOT, "docs", "cli.md")).read()
    shown = re.findall(r"^```text\n(.*?)\n```$", page, flags=re.MULTILINE | re.DOTALL)
    env = dict(os.environ, COLUMNS="100")
    commands = [[]] + [[name] for name in ("demo", "report", "replay", "export", "rerun", "follow", "watch", "run")]
    helps = [subprocess.run([sys.executable, "-m", "sglang_otel_kernels", *command, "--help"], env=env,
                            capture_output=True, text=True, timeout=60).stdout.rstrip() for command in commands]
    assert shown == helps


def test_the_format_page_gives_the_writers_layouts_and_constants():
    from sglang_otel_kernels.record import tracefile as fmt

    page = open(os.path.join(ROOT, "docs", "trace-file-format.md")).read()
    assert f"# The trace file format (version {fmt.FORMAT_VERSION})" in page
    assert f"`HEADER_SIZE` = {fmt.HEADER_SIZE}" in page and f"`0x{fmt.RECORD_MAGIC:08X}`" in page
    assert fmt.MAGIC.decode() in page and fmt.RECORD_HEADER.size == 24 and fmt.HEADER_PREFIX.format == "<8sIIQIQ"
    for encoding, name in ((1, "COMPACT_END"), (4, "SPAN_START"), (5, "KERNEL_SPAN")):
        assert getattr(fmt, "ENCODING_" + name) == encoding and f"| {encoding} | {name} `{getattr(fmt, name).format}`" in page
    assert (fmt.ENCODING_KERNEL_START, fmt.ENCODING_KERNEL_END) == (2, 3)
    assert fmt.ENCODING_ATTRIBUTED_END == 6 and f"| 6 | ATTRIBUTED_END `{fmt.COMPACT_END.format}`" in page
    assert f"KERNEL_START `{fmt.KERNEL_START.format}` / KERNEL_END `{fmt.KERNEL_END.format}`" in page
    for flag in ("SAMPLED", "REMOTE_PARENT", "LINKS", "PARENT_SAMPLED", "INLINE_NAME", "BLACKBOX", "COLLECTIVE",
                 "GRAPH_REPLAY"):
        assert f"| {getattr(fmt, 'FLAG_' + flag)} | FLAG_{flag} |" in page, flag
    for kind in (fmt.SYMBOL, fmt.THREAD, fmt.TABLE, fmt.END, fmt.CALL_END, fmt.ATTRIBUTES, fmt.IDENTITY, fmt.GRAPH,
                 fmt.MODE, fmt.EXIT, fmt.FAILURE, fmt.STACK):
        assert f"| `{kind}` |" in page, kind
    flat = page.replace("\n", " ")
    assert f"the low {fmt.REPLAY_SHIFT}" in flat and f"version {fmt.MARSHAL_VERSION}" in flat
    listed = re.findall(r"`([^`]+)`", flat.split("as a tuple in the order ")[1].split("(None")[0])
    assert [name if name.startswith("sglang.") else "sglang.collective" + name for name in listed] == \
        list(fmt.COLLECTIVE_FIELDS)


def test_walkthroughs_stop_processes_by_pid_or_group_never_by_name():
    """`pkill -f NAME` kills every process whose command line holds NAME: on a shared
    serving node, other users' jobs too."""
    for path in ["README.md", *(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")))]:
        if path.endswith(".md"):
            text = open(os.path.join(ROOT, path)).read()
            assert not re.search(r"\b(pkill|killall)\b", text), path
