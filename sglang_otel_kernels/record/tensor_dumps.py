"""Level 10: each call's inputs saved before it runs and its outputs after, in
SGLang's layout, so that the call that crashed can be run again offline
(`sglang-otel-kernels rerun DIR`).

One directory per call, `<dump_dir>/<YYYYmmdd_HHMMSS_mmm>_pid<pid>_<name>_call<NNNN>/`
(mode 0700), holding `inputs.pt` (a dict of detached CPU tensors keyed
`arg_0`, `kwarg_<k>`, nested `arg_1_0`), `metadata.json` and, after success,
`outputs.pt` (files 0600). The metadata says `execution_status`:
`inputs_saved` before the call, then `completed` or `exception`. Each file is
written under a temporary name and renamed, so a crash never leaves half a
JSON document or half a tensor file under the final name; `inputs.pt` is
complete before the metadata says `inputs_saved`.

Beyond SGLang's fields, the metadata holds what a re-run needs (the import path
of the function, how many positional arguments, the keyword names, each
tensor's original device) and the trace context the call ran in.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import threading
import time
from typing import Any

import torch

from .. import config as _config
from .. import files
from ..descriptions import safe_repr, safe_str
from ..notices import warn, warn_once

METADATA = "metadata.json"
MAX_METADATA_BYTES = 64 << 20
INPUTS = "inputs.pt"
OUTPUTS = "outputs.pt"
STATUS_SAVED = "inputs_saved"
STATUS_COMPLETED = "completed"
STATUS_EXCEPTION = "exception"
SKIPPED_CAPTURE = "graph capture in progress"


def import_path(func: Any) -> str | None:
    """`module:qualname` of a function (`path/to/script.py:qualname` for one
    a script run as `__main__` defined), or `torch.ops.<ns>:<op>` of a torch
    op; None when there is nothing to import it by."""
    qualified = getattr(func, "_qualified_op_name", None)  # torch.ops packets and overloads
    if isinstance(qualified, str) and "::" in qualified:
        namespace, name = qualified.split("::", 1)
        return f"torch.ops.{namespace}:{name}"
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)):
        return None
    script = getattr(getattr(func, "__code__", None), "co_filename", "")
    if module == "__main__" and script.endswith(".py") and os.path.isfile(script):
        return f"{os.path.abspath(script)}:{qualname}"  # `__main__` is no name to import it by later
    # A builtin's qualname may not lead back to it (torch.mul's is
    # `_VariableFunctionsClass.mul`); its plain name on the module may.
    name = getattr(func, "__name__", None)
    owner = sys.modules.get(module)
    if owner is not None and isinstance(name, str) and getattr(owner, name, None) is func:
        return f"{module}:{name}"
    return f"{module}:{qualname}"


def json_value(value: Any) -> Any:
    """A non-tensor, non-container argument as JSON; dtypes and devices so that
    a re-run can rebuild them, anything else as its type and repr."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, torch.dtype):
        return {"type": "torch.dtype", "value": str(value)}
    if isinstance(value, torch.device):
        return {"type": "torch.device", "value": str(value)}
    return {"type": type(value).__name__, "repr": safe_repr(value, 200)}


def collect(prefix: str, value: Any, tensors: dict, metadata: dict, devices: dict, seen: set | None = None) -> None:
    """Flattens one argument as SGLang does: tensors into `tensors` under their
    path (still on their device: `to_host` copies them once they are to be
    saved), containers as `<path>__container`, other values as JSON."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:  # no data to save: what it looked like, in the metadata
            metadata[prefix] = {"type": "Tensor", "repr": f"meta tensor shape={tuple(value.shape)} dtype={value.dtype}"}
            return
        tensors[prefix] = value.detach()
        devices[prefix] = str(value.device)
        return
    if isinstance(value, (list, tuple, dict)):
        seen = set() if seen is None else seen
        if id(value) in seen:  # a container holding itself
            metadata[prefix] = {"type": type(value).__name__, "repr": "<recursive>"}
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                collect(f"{prefix}_{key}", item, tensors, metadata, devices, seen)
            metadata[prefix + "__container"] = {"type": "dict", "keys": [str(key) for key in value]}
        else:
            for index, item in enumerate(value):
                collect(f"{prefix}_{index}", item, tensors, metadata, devices, seen)
            metadata[prefix + "__container"] = {"type": type(value).__name__, "length": len(value)}
        seen.discard(id(value))
        return
    metadata[prefix] = json_value(value)


def to_host(tensors: dict) -> dict:
    """The collected tensors copied to the host (a blocking copy from a GPU)."""
    return {key: tensor.cpu() for key, tensor in tensors.items()}


def _safe_name(name: str) -> str:
    for char in "/<>\\\0":
        name = name.replace(char, "_")
    return name


def _private_file(path: str, write) -> None:
    """Writes a file readable by its owner only, under a temporary name then
    renamed: the final name never holds a partial file."""
    temporary = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    os.replace(temporary, path)


def write_metadata(directory: str, metadata: dict) -> None:
    text = json.dumps(metadata, indent=2, default=str).encode("utf-8")
    _private_file(os.path.join(directory, METADATA), lambda handle: handle.write(text))


def read_metadata(directory: str) -> dict:
    """The metadata of a dump: a regular file (a FIFO would block), bounded."""
    with os.fdopen(files.open_regular(os.path.join(directory, METADATA)), "rb") as handle:
        text = handle.read(MAX_METADATA_BYTES + 1)
    if len(text) > MAX_METADATA_BYTES:
        raise ValueError(f"larger than {MAX_METADATA_BYTES >> 20} MiB")
    value = json.loads(text.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("metadata.json does not hold a JSON object")
    return value


class Dumps:
    """This process's level-10 dumps: the settings, the counters and limits."""

    def __init__(self, cfg: _config.KernelTraceConfig) -> None:
        self.settings = (cfg.dump_dir, cfg.dump_include, cfg.dump_exclude, cfg.dump_max_bytes, cfg.dump_max_count)
        self.template, self.include, self.exclude, self.max_bytes, self.max_count = self.settings
        self.count = 0
        self.bytes = 0
        self.stopped: str | None = None  # why dumping stopped, once a limit was reached
        self._calls: dict[str, int] = {}
        self._wanted: dict[str, bool] = {}
        self._lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def wants(self, name: str) -> bool:
        wanted = self._wanted.get(name)
        if wanted is None:
            wanted = self._wanted[name] = (
                (not self.include or any(fnmatch.fnmatchcase(name, p) for p in self.include))
                and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
            )
        return wanted

    def save_inputs(self, name: str, function: str | None, self_skipped: bool, positional: tuple, kwargs: dict,
                    context: dict) -> tuple[str | None, str | None]:
        """Saves a call's inputs; returns (its directory, None) or (None, why
        not). Never raises: a failed dump must not break the kernel call."""
        try:
            if self.stopped is not None:  # past a limit: nothing is looked at, nothing copied
                return None, self.stopped
            tensors: dict = {}
            metadata: dict = {}
            devices: dict = {}
            for index, value in enumerate(positional):
                collect(f"arg_{index}", value, tensors, metadata, devices)
            for key, value in kwargs.items():
                collect(f"kwarg_{key}", value, tensors, metadata, devices)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            with self._lock:
                if self.stopped is None:
                    if self.count >= self.max_count:
                        self._stop(f"SGLANG_KERNEL_API_DUMP_MAX_COUNT={self.max_count} reached")
                    elif self.bytes + size > self.max_bytes:
                        self._stop(f"SGLANG_KERNEL_API_DUMP_MAX_BYTES={self.max_bytes} reached "
                                   f"({self.bytes} bytes dumped, this call needs {size})")
                if self.stopped is not None:
                    return None, self.stopped
                self.count += 1
                self.bytes += size
                call = self._calls[name] = self._calls.get(name, 0) + 1
            tensors = to_host(tensors)  # the copy, only for a call within the limits
            directory, stamp = self._make_directory(name, call)
            if tensors:
                _private_file(os.path.join(directory, INPUTS), lambda handle: torch.save(tensors, handle))
            write_metadata(directory, {
                "function_name": name,
                "timestamp": stamp,
                "process_id": os.getpid(),
                "execution_status": STATUS_SAVED,
                "input_metadata": metadata,
                "input_tensor_keys": list(tensors),
                "output_metadata": {},
                "output_tensor_keys": [],
                "function": function,
                "self_skipped": self_skipped,
                "positional_count": len(positional),
                "keyword_names": list(kwargs),
                "input_tensor_devices": devices,
                "input_bytes": size,
                **context,
            })
            warn_once("dump contents", f"level 10 writes the inputs and outputs of kernel calls, tensor data "
                                       f"included, under {os.path.dirname(directory)}: they may hold sensitive data")
            return directory, None
        except Exception as exc:
            reason = f"dump failed ({type(exc).__name__}: {exc})"
            warn_once("dump failed", f"{reason}; the kernel call goes on")
            return None, reason

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        warn(f"level-10 dumps stopped: {reason}; kernel calls go on, their spans say why they have no dump")

    def _make_directory(self, name: str, call: int) -> tuple[str, str]:
        root = os.path.abspath(self.template.replace("%i", str(os.getpid())))
        if not os.path.isdir(root):
            os.makedirs(root, mode=0o700, exist_ok=True)
        now = time.time()
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now)) + f"_{int(now * 1000) % 1000:03d}"
        base = os.path.join(root, f"{stamp}_pid{os.getpid()}_{_safe_name(name)}_call{call:04d}")
        directory, attempt = base, 1
        while True:
            try:
                os.mkdir(directory, 0o700)
                break
            except FileExistsError:
                attempt += 1
                directory = f"{base}_{attempt}"
        os.chmod(directory, 0o700)  # whatever the umask
        return directory, stamp

    def save_outputs(self, directory: str, result: Any, context: dict) -> bool:
        try:
            tensors: dict = {}
            metadata: dict = {}
            collect("result", result, tensors, metadata, {})
            tensors = to_host(tensors)
            if tensors:
                _private_file(os.path.join(directory, OUTPUTS), lambda handle: torch.save(tensors, handle))
            self._update(directory, execution_status=STATUS_COMPLETED, output_metadata=metadata,
                         output_tensor_keys=list(tensors), **context)
            return True
        except Exception as exc:
            warn_once("dump failed", f"saving the outputs to {directory} failed ({type(exc).__name__}: {exc})")
            return False

    def save_exception(self, directory: str, exc: BaseException, context: dict) -> None:
        try:
            self._update(directory, execution_status=STATUS_EXCEPTION,
                         exception={"type": type(exc).__name__, "message": safe_str(exc)}, **context)
        except Exception as inner:
            warn_once("dump failed", f"marking the exception in {directory} failed ({type(inner).__name__}: {inner})")

    @staticmethod
    def _update(directory: str, **changes: Any) -> None:
        metadata = read_metadata(directory)
        metadata.update(changes)
        write_metadata(directory, metadata)
