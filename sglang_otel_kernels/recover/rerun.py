"""Running a dumped call again (`sglang-otel-kernels rerun DUMP_DIR`): the
inputs of a level-10 dump, the function found by its import path, and a
comparison of what happens now with what the dump recorded.

The function to run is always given by the user (`--function`): a dump is
data, and the import path its metadata records is shown, never run on the
dump's word (a crafted `metadata.json` could name `os:system`). Works on
SGLang's own dumps too (same layout).

The call runs in a child process (`rerun`, which runs `rerun_here` there):
reproducing a crash is what this command is for, and a call that kills its
process must leave the parent alive to say so (`reproduced: the call died
with SIGABRT`, with the child's stderr tail).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import types
from typing import Any, Callable

import torch

from ..descriptions import safe_str
from ..record import tensor_dumps as _dumps


class DumpError(Exception):
    """The dump cannot be re-run; the message says why and what to do."""


# -- loading ------------------------------------------------------------------


# Bounds on what a (hostile) metadata.json can make this command build.
_MAX_ARGUMENTS = 4096
_MAX_ITEMS = 1 << 16


def _tensor_file(directory: str, name: str, keys: list) -> str:
    """The path of a dump's tensor file that `keys` are in, or a DumpError when it is missing."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):  # missing, or a FIFO that would block the load
        raise DumpError(f"{directory}: incomplete dump, {name} is missing (metadata lists tensors {keys[:4]})")
    return path


def _load_tensors(directory: str, name: str, keys: list) -> dict:
    if not keys:
        return {}
    path = _tensor_file(directory, name, keys)
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)  # data only: never unpickles code
    except Exception as exc:
        raise DumpError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    if not isinstance(tensors, dict) or not set(keys) <= set(tensors) or not all(
            isinstance(tensors[key], torch.Tensor) for key in keys):
        raise DumpError(f"{path}: does not hold the tensors the metadata lists")
    return tensors


def _from_json(prefix: str, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    if kind == "torch.dtype":
        dtype = getattr(torch, str(value.get("value", "")).removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    elif kind == "torch.device":
        try:
            return torch.device(value.get("value"))
        except (RuntimeError, TypeError, ValueError):
            raise DumpError(f"argument {prefix}: {value.get('value')!r} is not a device") from None
    raise DumpError(f"argument {prefix} was a {kind} and the dump holds only its repr ({value.get('repr')!r}), "
                    "so it cannot be rebuilt; pass --function a wrapper that supplies it")


def _rebuild(prefix: str, tensors: dict, metadata: dict, depth: int = 0) -> Any:
    if prefix in tensors:
        return tensors[prefix]
    container = metadata.get(prefix + "__container")
    if isinstance(container, dict) and depth < 8:
        if container.get("type") == "dict":
            return {key: _rebuild(f"{prefix}_{key}", tensors, metadata, depth + 1)
                    for key in _texts(container.get("keys", []), f"{prefix}__container keys")}
        length = container.get("length", 0)
        if not isinstance(length, int) or not 0 <= length <= _MAX_ITEMS:
            raise DumpError(f"metadata.json: {prefix}__container has a bad length {length!r}")
        items = [_rebuild(f"{prefix}_{i}", tensors, metadata, depth + 1) for i in range(length)]
        return items if container.get("type") == "list" else tuple(items)
    if prefix in metadata:
        return _from_json(prefix, metadata[prefix])
    raise DumpError(f"argument {prefix} is not in the dump")


def _texts(value: Any, what: str) -> list:
    """A list of strings from the metadata, or a one-line error."""
    if not isinstance(value, list) or len(value) > _MAX_ITEMS or not all(isinstance(v, str) for v in value):
        raise DumpError(f"metadata.json: {what} is not a list of names")
    return value


def _mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise DumpError(f"metadata.json: {what} is not an object")
    return value


def _top_level(keys: set, marker: str) -> list:
    """Top-level argument paths (`arg_0`, `kwarg_eps`) among flattened keys, for
    dumps without our counts (SGLang's): a path inside a container is not one."""
    paths = {key.removesuffix("__container") for key in keys if key.startswith(marker)}
    containers = {key.removesuffix("__container") for key in keys if key.endswith("__container")}
    return [p for p in paths if not any(p != c and p.startswith(c + "_") for c in containers)]


def read_dump_metadata(directory: str) -> dict:
    """A dump's metadata.json, or a DumpError saying why there is none."""
    if not os.path.isdir(directory):
        raise DumpError(f"{directory}: not a directory (a dump is one call's directory)" if os.path.exists(directory)
                        else f"{directory}: no such dump directory")
    try:
        metadata = _dumps.read_metadata(directory)
    except FileNotFoundError:
        raise DumpError(f"{directory}: incomplete dump, no {_dumps.METADATA} "
                        "(the process ended before the inputs were saved)") from None
    except (OSError, ValueError) as exc:
        raise DumpError(f"{directory}: {_dumps.METADATA} cannot be read ({exc})") from None
    return metadata


def load_call(directory: str, device: str | None = None, notes: list | None = None) -> tuple[dict, list, dict, dict]:
    """(metadata, positional arguments, keyword arguments, saved output
    tensors); input tensors on their recorded device or `device` (what could
    not be placed is said in `notes`). metadata.json is hostile input: a
    field of the wrong type or size is a DumpError naming it."""
    metadata = read_dump_metadata(directory)
    tensors = _load_tensors(directory, _dumps.INPUTS, _texts(metadata.get("input_tensor_keys") or [], "input_tensor_keys"))
    devices = _mapping(metadata.get("input_tensor_devices") or {}, "input_tensor_devices")
    tensors = _placed(tensors, devices, device, [] if notes is None else notes)
    values = _mapping(metadata.get("input_metadata") or {}, "input_metadata")
    keys = set(tensors) | set(values)
    count = metadata.get("positional_count")
    if count is None:
        try:
            count = 1 + max((int(p.split("_")[1]) for p in _top_level(keys, "arg_")), default=-1)
        except ValueError:
            raise DumpError("metadata.json: an argument key is not arg_<number>") from None
    if not isinstance(count, int) or not 0 <= count <= _MAX_ARGUMENTS:
        raise DumpError(f"metadata.json: positional_count {count!r} is not a count of arguments")
    names = metadata.get("keyword_names")
    names = (sorted(p.removeprefix("kwarg_") for p in _top_level(keys, "kwarg_")) if names is None
             else _texts(names, "keyword_names"))
    positional = [_rebuild(f"arg_{i}", tensors, values) for i in range(count)]
    keyword = {name: _rebuild(f"kwarg_{name}", tensors, values) for name in names}
    outputs = {}
    if metadata.get("execution_status") == _dumps.STATUS_COMPLETED:
        outputs = _load_tensors(directory, _dumps.OUTPUTS,
                                _texts(metadata.get("output_tensor_keys") or [], "output_tensor_keys"))
    return metadata, positional, keyword, outputs


def _placed(tensors: dict, devices: dict, override: str | None, notes: list) -> dict:
    """The input tensors back on the device each was on (or `override`), when
    it is here; the dump is flat, so no walk of the arguments is needed."""
    placed = {}
    for key, tensor in tensors.items():
        target = override or devices.get(key, "cpu")
        try:
            placed[key] = tensor.to(target)
        except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
            notes.append(f"{key} stays on the CPU: {target} is not available here ({type(exc).__name__})")
            placed[key] = tensor
    return placed


# -- finding the function -------------------------------------------------------


def resolve(path: str) -> Callable[..., Any]:
    """`package.module:qualname`, `path/to/file.py:qualname` or `torch.ops.<ns>:<op>`;
    a function our decorator wrapped is unwrapped, so the re-run records nothing."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise DumpError(f"function {path!r}: expected module:qualname")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise DumpError(f"function {path!r} was defined inside a function and cannot be imported; "
                        "pass --function module:name of an importable one")
    if module_name.startswith("torch.ops."):
        namespace = module_name.removeprefix("torch.ops.")
        try:
            return getattr(getattr(torch.ops, namespace), qualname)
        except (AttributeError, RuntimeError):
            raise DumpError(f"torch.ops.{namespace}.{qualname} is not registered in this process; pass "
                            "--function the Python function (or a module that registers the op)") from None
    if module_name == "__main__":
        raise DumpError(f"function {path!r} was defined in a script run as __main__; "
                        f"pass --function path/to/script.py:{qualname} (the script that defined it)")
    try:
        if module_name.endswith(".py"):
            module = load_definitions(module_name)
        else:
            # As `python -m` would: a module in the working directory is
            # found even from the installed console script.
            added = os.getcwd() not in sys.path
            if added:
                sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(module_name)
            finally:
                if added:
                    sys.path.remove(os.getcwd())
    except Exception as exc:
        raise DumpError(f"cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    target: Any = module
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise DumpError(f"{module_name} has no {qualname}") from None
    if not callable(target):
        raise DumpError(f"{path} is not callable")
    return inspect.unwrap(target)


def _runs_on_load(statement: ast.stmt) -> bool:
    """Whether a script's top-level statement runs when `rerun` loads the
    script for a function: imports, definitions and assignments (what a
    function may need) do; bare calls, loops, `with` blocks and the
    `if __name__ == "__main__":` block (what the script does) do not."""
    if isinstance(statement, ast.If):
        test = statement.test
        return not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                    and test.left.id == "__name__")
    return isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Try))


def load_definitions(path: str) -> types.ModuleType:
    """A script as a module holding its definitions, without what it does
    (`_runs_on_load`); its directory is importable, as when it runs."""
    with open(path, "rb") as handle:
        tree = ast.parse(handle.read(), filename=path)
    tree.body = [statement for statement in tree.body if _runs_on_load(statement)]
    module = types.ModuleType("_sok_rerun_target")
    module.__file__ = os.path.abspath(path)
    sys.modules[module.__name__] = module  # dataclasses and pickling look their module up
    directory = os.path.dirname(module.__file__)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    exec(compile(tree, path, "exec"), module.__dict__)  # the user named this script (--function)
    return module


# -- comparing --------------------------------------------------------------------


def _nonfinite(tensor: torch.Tensor) -> tuple[int, int]:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0, 0
    return int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())


def compare_tensor(key: str, now: torch.Tensor, saved: torch.Tensor | None, rtol: float, atol: float) -> dict:
    now = now.detach().cpu()
    entry: dict = {"key": key, "shape": list(now.shape), "dtype": str(now.dtype)}
    entry["nan"], entry["inf"] = _nonfinite(now)
    if saved is None:
        entry.update(match=None, reason="no saved output to compare with")
        return entry
    entry["saved_nan"], entry["saved_inf"] = _nonfinite(saved)
    if now.shape != saved.shape or now.dtype != saved.dtype:
        entry.update(match=False, reason=f"saved {list(saved.shape)} {saved.dtype}")
        return entry
    wide = torch.complex128 if now.is_complex() else torch.float64
    a, b = now.to(wide), saved.to(wide)
    both = torch.isfinite(a) & torch.isfinite(b)
    difference = (a - b).abs()[both]
    entry["max_abs_diff"] = float(difference.max()) if difference.numel() else 0.0
    scale = b.abs()[both].clamp_min(torch.finfo(torch.float64).tiny)
    entry["max_rel_diff"] = float((difference / scale).max()) if difference.numel() else 0.0
    entry["match"] = bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    if not entry["match"]:
        entry["reason"] = "values differ beyond rtol/atol"
    return entry


def _needs_function(directory: str, metadata: dict, function: str | None) -> None:
    """A DumpError saying what to pass when --function is missing."""
    if function is not None:
        return
    # A dump is data: what it names is shown, and runs only on the user's word.
    named = metadata.get("function")
    if metadata.get("self_skipped"):
        raise DumpError(f"{metadata.get('function_name')} was called as a method and its object was not saved; "
                        "pass --function a function taking the same arguments")
    if isinstance(named, str) and named:
        module, _, qualname = named.partition(":")
        if module == "__main__":  # an older dump: the script that defined it is not recorded
            raise DumpError(f"the dump names the function {named!r}, defined in a script run as __main__; say "
                            f"which script: sglang-otel-kernels rerun {directory} --function path/to/script.py:{qualname}")
        raise DumpError(f"the dump names the function {named!r}; a dump's metadata never chooses code to run, "
                        f"so say it: sglang-otel-kernels rerun {directory} --function {_shown_path(named)}")
    raise DumpError(f"{directory}: the dump does not say where its function is (an SGLang dump?); "
                    "pass --function module:qualname")


def _shown_path(function: str) -> str:
    """`script.py:name` relative to the working directory when the script is under it."""
    module, _, qualname = function.rpartition(":")
    if not module.endswith(".py") or not os.path.isabs(module):
        return function
    relative = os.path.relpath(module)
    return f"{relative}:{qualname}" if not relative.startswith(os.pardir) else function


def _header(directory: str, metadata: dict, function: str) -> dict:
    status = metadata.get("execution_status")
    exception = metadata.get("exception")
    recorded = {"status": status, "exception": exception if isinstance(exception, dict) else None}
    return {"dump": os.path.abspath(directory), "name": metadata.get("function_name"), "function": function,
            "recorded": recorded, "notes": [], "outputs": []}


STDERR_TAIL = 20  # lines of a dead child's stderr shown
_CHILD = "from sglang_otel_kernels.recover.rerun import child_main; child_main()"


def rerun(directory: str, function: str | None = None, device: str | None = None,
          rtol: float = 1e-5, atol: float = 1e-8, on_start: Callable[[dict], None] | None = None) -> dict:
    """Re-runs the call in `directory` in a child process; returns the report
    (see `render`). `on_start(report)` sees the dump's part before the call runs."""
    metadata = read_dump_metadata(directory)
    inputs = _texts(metadata.get("input_tensor_keys") or [], "input_tensor_keys")
    if inputs:
        _tensor_file(directory, _dumps.INPUTS, inputs)  # an incomplete dump is said before anything else
    _needs_function(directory, metadata, function)
    report = _header(directory, metadata, function)
    if on_start is not None:
        on_start(report)
    request = {"directory": directory, "function": function, "device": device, "rtol": rtol, "atol": atol,
               "sys_path": sys.path}
    # The child records nothing: the re-run is not a kernel call of this job.
    env = {**os.environ, "SGLANG_KERNEL_API_LOGLEVEL": "0"}
    with tempfile.TemporaryDirectory(prefix="sok-rerun-") as scratch:
        paths = [os.path.join(scratch, name) for name in ("request.json", "result.json", "stderr")]
        with open(paths[0], "w", encoding="utf-8") as handle:
            json.dump(request, handle)
        with open(paths[2], "w+b") as stderr:
            child = subprocess.run([sys.executable, "-c", _CHILD, paths[0], paths[1]], env=env, stderr=stderr)
            stderr.seek(0)
            errors = stderr.read().decode("utf-8", "replace")
        try:
            with open(paths[1], encoding="utf-8") as handle:
                result = json.load(handle)
        except (OSError, ValueError):
            result = None
    if result is not None and "error" in result:
        raise DumpError(result["error"])
    if result is not None:
        sys.stderr.write(errors)  # the call's own warnings, as if it ran here
        report.update(result)
        return report
    return _died(report, child.returncode, errors)


def _died(report: dict, returncode: int, errors: str) -> dict:
    """The report of a call whose process died before it could say how it went."""
    how = (f"{signal.Signals(-returncode).name}" if returncode < 0 and -returncode in signal.valid_signals()
           else f"exit status {returncode}")
    tail = errors.rstrip().splitlines()[-STDERR_TAIL:]
    cuda = next((line.strip() for line in reversed(tail) if "CUDA error" in line or "device-side assert" in line
                 or "illegal memory access" in line), None)
    report["rerun"] = {"status": "died", "how": how, "returncode": returncode, "cuda_error": cuda,
                       "stderr_tail": tail}
    report["died"] = True
    died = f"the call died with {how}" + (f" ({cuda})" if cuda else "")
    recorded = report["recorded"]
    if recorded["status"] == _dumps.STATUS_SAVED:
        report["reproduced"], report["verdict"] = True, f"reproduced: {died}"
    elif recorded["status"] == _dumps.STATUS_EXCEPTION:
        report["reproduced"] = False
        report["verdict"] = f"differs: {died}, the dump recorded {(recorded['exception'] or {}).get('type')}"
    else:
        report["reproduced"], report["verdict"] = False, f"differs: {died}, the original call completed"
    return report


def child_main() -> None:
    """The child `rerun` starts: runs the call, writes what happened as JSON."""
    import faulthandler

    faulthandler.enable()  # a fatal signal leaves the Python stack in the stderr tail
    request_path, result_path = sys.argv[1:3]
    with open(request_path, encoding="utf-8") as handle:
        request = json.load(handle)
    sys.path[:] = request.pop("sys_path")
    try:
        result = rerun_here(**request)
    except DumpError as exc:
        result = {"error": str(exc)}
    with open(result_path + ".part", "w", encoding="utf-8") as handle:
        json.dump(result, handle, default=repr)
    os.replace(result_path + ".part", result_path)


def rerun_here(directory: str, function: str, device: str | None = None,
               rtol: float = 1e-5, atol: float = 1e-8) -> dict:
    """Re-runs the call in `directory` in this process; returns the report."""
    notes: list = []
    metadata, positional, keyword, saved = load_call(directory, device, notes)
    target = resolve(function)
    report = _header(directory, metadata, function)
    report["notes"] = notes
    status, recorded = metadata.get("execution_status"), report["recorded"]
    try:
        result = target(*positional, **keyword)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # an asynchronous error (a device-side assert) belongs to this call
        tensors: dict = {}
        values: dict = {}
        _dumps.collect("result", result, tensors, values, {})
        tensors = _dumps.to_host(tensors)  # with --device, where a late device error would surface
    except Exception as exc:
        report["rerun"] = {"status": "exception", "type": type(exc).__name__, "message": safe_str(exc),
                           "traceback": traceback.format_exc()}
        expected = (recorded["exception"] or {}).get("type")
        if status == _dumps.STATUS_EXCEPTION:
            report["reproduced"] = expected == type(exc).__name__
            report["verdict"] = (f"reproduced: raised the recorded {expected}" if report["reproduced"]
                                 else f"differs: raised {type(exc).__name__}, the dump recorded {expected}")
        elif status == _dumps.STATUS_SAVED:
            report["reproduced"] = True
            report["verdict"] = f"reproduced a failure: raised {type(exc).__name__} (the original call never finished)"
        else:
            report["reproduced"] = False
            report["verdict"] = f"differs: raised {type(exc).__name__}, the original call completed"
        return report
    report["rerun"] = {"status": "completed"}
    entries = [compare_tensor(key, tensor, saved.get(key) if saved else None, rtol, atol)
               for key, tensor in tensors.items()]
    report["outputs"] = entries
    nonfinite = sum(e["nan"] + e["inf"] for e in entries)
    if status == _dumps.STATUS_COMPLETED:
        missing = set(metadata.get("output_tensor_keys") or []) - set(tensors)
        values_match = values == (metadata.get("output_metadata") or {})
        report["reproduced"] = not missing and values_match and all(e["match"] for e in entries)
        if report["reproduced"]:
            report["verdict"] = "reproduced: the outputs match the saved ones"
        else:
            why = [f"{e['key']}: {e.get('reason')}" for e in entries if not e["match"]]
            why += [f"{key}: missing now" for key in sorted(missing)]
            if not values_match:
                why.append("non-tensor outputs differ")
            report["verdict"] = "differs: " + "; ".join(why)
    elif status == _dumps.STATUS_EXCEPTION:
        report["reproduced"] = False
        report["verdict"] = f"differs: completed, the dump recorded {(recorded['exception'] or {}).get('type')}"
    else:
        report["reproduced"] = nonfinite > 0
        report["verdict"] = ("reproduced a failure: the outputs hold NaN/Inf" if nonfinite else
                             "not reproduced: the call completed (the original never finished)")
    return report


def render_header(report: dict) -> str:
    """The dump's part of the report: what ran, what was recorded."""
    recorded = report["recorded"]
    lines = [f"dump:      {report['dump']}", f"kernel:    {report['name']}  ({report['function']})"]
    if recorded["status"] == _dumps.STATUS_EXCEPTION and recorded.get("exception"):
        lines.append(f"recorded:  exception {recorded['exception'].get('type')}: {recorded['exception'].get('message')}")
    elif recorded["status"] == _dumps.STATUS_SAVED:
        lines.append("recorded:  inputs_saved (the process ended during the call)")
    else:
        lines.append(f"recorded:  {recorded['status']}")
    return "\n".join(lines) + "\n"


def render(report: dict) -> str:
    """What the re-run did, below `render_header`'s lines."""
    lines = []
    outcome = report["rerun"]
    if outcome["status"] == "exception":
        lines.append(f"re-run:    raised {outcome['type']}: {outcome['message']}")
    elif outcome["status"] == "died":
        lines.append(f"re-run:    the process died ({outcome['how']}); its stderr ended with:")
        lines += [f"  | {line}" for line in outcome["stderr_tail"]] or ["  | (nothing)"]
    else:
        lines.append("re-run:    completed")
    for entry in report["outputs"]:
        text = f"  {entry['key']}: {entry['shape']} {entry['dtype']} nan={entry['nan']} inf={entry['inf']}"
        if "max_abs_diff" in entry:
            text += f" max_abs_diff={_number(entry['max_abs_diff'])} max_rel_diff={_number(entry['max_rel_diff'])}"
        if entry.get("match") is not None:
            text += " match" if entry["match"] else f" MISMATCH ({entry.get('reason')})"
        lines.append(text)
    lines += [f"note:      {note}" for note in report["notes"]]
    lines.append(f"verdict:   {report['verdict']}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"
