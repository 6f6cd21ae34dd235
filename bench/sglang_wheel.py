"""SGLang from its published wheel, fetched when needed and never committed:
its logger, `sglang/kernels/kernel_api_logging.py` (`pip download --no-deps
sglang`), for bench/compare_sglang.py and the SGLang integration tests; and a
folder holding the wheel with the light packages its server modules import
(`install_sglang_site`), for the tests on SGLang's real code."""

from __future__ import annotations

import hashlib
import os
import shutil
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


def _failure(what: str, proc: subprocess.CompletedProcess) -> RuntimeError:
    detail = proc.stderr.strip()[-500:]
    if any(marker in proc.stderr for marker in _UNREACHABLE):
        return RegistryUnreachable(f"cannot reach the package registry to {what}: {detail}")
    return RuntimeError(f"cannot {what}: {detail}")


def environments_folder() -> str:
    """Where .ci/sglang-env keeps SGLang's environment, once per machine
    (SGLANG_OTEL_ENVS, else the user's cache folder)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("SGLANG_OTEL_ENVS") or os.path.join(cache, "sglang-otel-kernels")


def install_sglang_site(requirements: str) -> str:
    """The folder (for PYTHONPATH) holding every package `requirements` pins,
    installed with --no-deps; made once per content of that list beside
    SGLang's environment, outside any checkout, and reused by every clone."""
    cache_root = environments_folder()
    with open(requirements, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:16]
    site = os.path.join(cache_root, f"sglang-site-{digest}")
    if os.path.isdir(site):
        return site
    os.makedirs(cache_root, exist_ok=True)
    partial = f"{site}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
         "--target", partial, "-r", requirements],
        capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise _failure(f"install {requirements}", proc)
    try:
        os.rename(partial, site)  # whole or not at all: a broken install is never reused
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)  # another run made it first
    return site


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
        raise _failure("download the sglang wheel", proc)
    with zipfile.ZipFile(os.path.join(directory, wheels[0])) as wheel:
        wheel.extract(WHEEL_MEMBER, directory)
    return os.path.join(directory, WHEEL_MEMBER), wheels[0]
