"""Our text log against SGLang's own logger, differentially: the same
program runs once with SGLang 0.5.23's `kernel_api_logging` module (from its
published wheel, tests/sglang-site.txt, loaded by path: it needs only torch)
and once with ours, each in its own process (both read their settings at
import), and the logs must be the same, timestamps aside."""

import os
import subprocess
import sys

import pytest

from conftest import strip_timestamps

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from sglang_wheel import install_sglang_site  # noqa: E402

SGLANGS = ("import importlib.util\n"
           "spec = importlib.util.spec_from_file_location('sglang_kernel_api_logging', {path!r})\n"
           "logger = importlib.util.module_from_spec(spec)\n"
           "spec.loader.exec_module(logger)\n"
           "debug_kernel_api = logger.debug_kernel_api\n")
OURS = "from sglang_otel_kernels import debug_kernel_api\n"

KERNELS = """
import torch

@debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
def rmsnorm(x, weight, eps=1e-6, *, out=None):
    return x * weight

@debug_kernel_api
def topk(scores, k, names, options):
    if k > scores.shape[-1]:
        raise ValueError(f"k={k} is more than {scores.shape[-1]} scores")
    return torch.topk(scores, k)

class Layer:
    @debug_kernel_api(op_name="sglang.layer.forward")
    def forward(self, x, mask=None):
        return (x.half(), [x.int(), None], {"scale": 0.5})
"""

PROGRAMS = {
    "arguments and outputs": KERNELS + """
rmsnorm(torch.tensor([1000001., 1000002., 1000004.]), torch.ones(3), out=torch.empty(0))
topk(torch.arange(12.).reshape(3, 4).t(), 2, ["a", "b"], {"largest": True, "n": None})
try:
    topk(torch.zeros(2, 3), 5, [], {})
except ValueError:
    pass
Layer().forward(torch.tensor([[float("nan"), 1.0], [float("inf"), -2.0]]), mask=torch.ones(2, dtype=torch.bool))
""",
    "a chdir after import": KERNELS + """
import os
os.makedirs("elsewhere", exist_ok=True)
os.chdir("elsewhere")
rmsnorm(torch.ones(2), torch.ones(2))
""",
}


@pytest.fixture(scope="module")
def sglang_logger():
    site = install_sglang_site(os.path.join(TESTS, "sglang-site.txt"))
    return os.path.join(site, "sglang", "kernels", "kernel_api_logging.py")


def _run(tmp_path, name: str, prelude: str, program: str, level: int, dest: str) -> str:
    """The text log one logger wrote for `program` (its file under the folder it started in)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "program.py").write_text(prelude + program)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "OTEL_"))}
    env.update(SGLANG_KERNEL_API_LOGLEVEL=str(level), SGLANG_KERNEL_API_LOGDEST=dest,
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "program.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    written = [path for path in folder.rglob("*.txt")]
    assert len(written) == 1, (name, written)  # where SGLang writes it: beside the program, as the path read at start
    assert written[0].parent == folder, written[0]
    return strip_timestamps(written[0].read_text())


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("level, dest", [(1, "log.txt"), (3, "log_%i.txt"), (5, "missing/../log.txt")])
def test_our_text_log_is_sglangs(sglang_logger, tmp_path, program, level, dest):
    theirs = _run(tmp_path, "sglang", SGLANGS.format(path=sglang_logger), PROGRAMS[program], level, dest)
    ours = _run(tmp_path, "ours", OURS, PROGRAMS[program], level, dest)
    assert theirs.count("SGLang Kernel API Call:") >= 1
    assert ours == theirs
