"""SGLang's logger, `sglang/kernels/kernel_api_logging.py`, from the published
wheel, downloaded when needed (`pip download --no-deps sglang`) and never
committed; used by bench/compare_sglang.py and the SGLang integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

WHEEL_MEMBER = "sglang/kernels/kernel_api_logging.py"
# pip's words when the index cannot be reached at all (as opposed to a wheel it cannot use).
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                "Network is unreachable", "Connection refused", "ConnectTimeoutError", "ReadTimeoutError",
                "No route to host", "Name or service not known")


class RegistryUnreachable(RuntimeError):
    """The package registry could not be reached."""


def fetch_sglang_logger(directory: str) -> tuple[str, str]:
    """Downloads the sglang wheel (no dependencies) into `directory` and
    extracts the logger; returns (its path, the wheel's file name)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
         "sglang", "-d", directory],
        capture_output=True, text=True, timeout=900,
    )
    wheels = [name for name in os.listdir(directory) if name.startswith("sglang-") and name.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        detail = proc.stderr.strip()[-500:]
        if any(marker in proc.stderr for marker in _UNREACHABLE):
            raise RegistryUnreachable(f"cannot reach the package registry to download sglang: {detail}")
        raise RuntimeError(f"cannot download the sglang wheel: {detail}")
    with zipfile.ZipFile(os.path.join(directory, wheels[0])) as wheel:
        wheel.extract(WHEEL_MEMBER, directory)
    return os.path.join(directory, WHEEL_MEMBER), wheels[0]
