"""`report --json` against its documented schema (docs/report.schema.json,
docs/report-json.md), on reports of real processes: crashed, raised, NaN
alone, clean. The rank scenarios of tests/test_ranks.py validate every
report they make too."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from conftest import run_python
from test_report import DIES_IN_A_BATCH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "docs", "report.schema.json")) as _handle:
    SCHEMA = json.load(_handle)


def check(document: dict) -> None:
    """Raises when `document` is not what the schema documents."""
    jsonschema.Draft202012Validator(SCHEMA).validate(document)


@pytest.mark.parametrize("mode", ["crash", "raise", "nan", "clean"])
def test_reports_of_real_processes_are_what_the_schema_says(tmp_path, mode):
    script = {"crash": DIES_IN_A_BATCH.replace("sys.argv[1]", "'crash'"),
              "raise": DIES_IN_A_BATCH.replace("sys.argv[1]", "'raise'"),
              "nan": DIES_IN_A_BATCH.split("carriers =")[0],
              "clean": DIES_IN_A_BATCH.split("norm(torch.zeros(3))")[0]}[mode]
    run_python(script, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == {"crash": 1, "raise": 1, "nan": 3, "clean": 0}[mode], proc.stderr
    document = json.loads(proc.stdout)
    check(document)
    from sglang_otel_kernels.record.tracefile import FORMAT_VERSION
    from sglang_otel_kernels.recover.report import REPORT_SCHEMA

    assert document["schema"] == REPORT_SCHEMA == SCHEMA["properties"]["schema"]["const"]
    assert [file["format_version"] for file in document["files"]] == [FORMAT_VERSION]


def test_the_schema_is_strict_enough_to_catch_a_change():
    """A key the page does not document, or one of the wrong type, fails: the
    schema would tell a change of the JSON that did not raise its version."""
    document = {key: None for key in SCHEMA["required"]}
    document.update(schema=10, cross_rank_jobs=[], files=[], crashed=False, running=False, in_flight=[],
                    graph_replay_at_death=[], failed=[], last_calls=[], nonfinite_logits=[], tracebacks={}, summary={},
                    in_flight_other_spans=[], device_faults=[], skipped_processes=0, failed_batches=[],
                    batches_at_death=[], hang_seconds=60.0,
                    verdict={"kind": "clean", "headline": "no crash, no failure", "exit_status": 0, "file": None})
    check(document)
    for changed in ({"new_key": 1}, {"crashed": "yes"}, {"schema": 9}, {"verdict": {"kind": "fine"}},
                    {"nonfinite_logits": [{"request_id": "r1"}]}):
        with pytest.raises(jsonschema.ValidationError):
            check({**document, **changed})
