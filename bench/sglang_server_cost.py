"""What recording costs on SGLang's real server (CPU): the wall time of one
request's decode steps at level 0, in the black box (at levels 1 and 3), at
levels 1, 3 and 5, and at level 1 with the NaN flags, as ratios to level 0
measured side by side.

    python bench/sglang_server_cost.py [--starts 2] [--rounds 10] [--tokens 256] [--only SETTING] [--profile]
                                       [--against DIR] [--sliced [SECONDS]]

A server start differs from the next by more than the targets (up to 40%
here: this machine's speed drifts, and the idle scheduler spins on a
core), so every setting's server is started (through `run`), then all but
the one serving are paused (SIGSTOP to its process group: no idle
spinning), and each round sends one request to each setting in turn, in a
rotated order; a round's ratios are to level 0 in that round, seconds
apart. `--starts` repeats this with fresh servers. Prints one row per
setting: median seconds per request and per decode step, and the median
ratio to level 0 with its quartiles over all rounds, a 95% confidence
interval of that median (distribution-free: order statistics over the
rounds) and each start's own median. Rounds differ by more than the
targets, so a target is shown met by an interval under it, not by a
median; and a start differs from the next by 1 to 3% (its processes'
layout), which the rounds' interval does not cover: read it beside the
starts' medians. A second table gives the same ratios of the scheduler's
CPU time a request (its threads' schedstat run time), which leaves out the
time a VM's host took and other processes' turns on the cores: the wall
time's largest noise here; a third, every server process's CPU time (the
tokenizer's, the detokenizer's, ...). `--against DIR` (another checkout of
this package, e.g. a `git worktree` of the commit before a change) also
runs each setting but level 0 from DIR's code, as "<setting> @DIR's name",
in the same rounds: a change measured side by side, not across days.

`--sliced` measures what a request's wall time cannot resolve here (this
machine's speed drifts by 10 to 50% within seconds): each round sends
every setting's server its request at once and lets the servers run in
turn, 0.05 s each (the others paused), until all have answered, so every
setting's steps meet the same moments; each scheduler stamps its steps
(a sitecustomize, STEPS), and a setting's figure for the round is its
median step among those no pause cut. Its rows give the median step and
its ratio to level 0's, as above. A second level-0 server runs beside
them as the control ("level 0 again"): what two starts of the same code
differ by (1 to 3%, their processes' layout), which only more starts
average out. A second table gives each setting's ratio to the mean of the
two level-0 servers' steps in the same round: a reference whose start
moves it half as far.

Needs SGLang's environment (bash .ci/sglang-env) and a tiny model it makes
(tests/tiny_llama.py). With --profile, one more server per setting (those
--only names, level 0 always among them) runs its scheduler's main thread
under cProfile for the timed requests alone, and the functions that take
most of a decode step are printed: where a setting's time per step goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {  # name -> (level, environment)
    "level 0": (0, {}),
    "black box": (1, {"SGLANG_KERNEL_API_BLACKBOX": "1"}),
    "level 1": (1, {}),
    "level 3": (3, {}),
    "black box 3": (3, {"SGLANG_KERNEL_API_BLACKBOX": "1"}),  # arguments' metadata kept, no statistics
    "level 5": (5, {}),
    "NaN flags": (1, {"SGLANG_KERNEL_API_NAN_FLAGS": "1"}),  # level 1 and each call's outputs flagged on their device
    "level 0 again": (0, {}),  # --sliced's control: a second level-0 server (what a start alone differs by)
}
CONTROL = "level 0 again"
# A sitecustomize that `run`'s own start-up hook chains to: in every process
# of the server, SIGUSR1 starts a profile of the main thread (the scheduler's
# event loop), the next SIGUSR1 writes it to <dir>/<pid>.prof.
PROFILER = """
import cProfile, os, signal
_state = []
def _toggle(signum, frame):
    if _state:
        profile = _state.pop()
        profile.disable()
        profile.dump_stats(os.path.join(os.environ["SGLANG_BENCH_DIR"], f"{os.getpid()}.prof"))
    else:
        _state.append(cProfile.Profile())
        _state[0].enable()
if os.environ.get("SGLANG_BENCH_DIR"):
    signal.signal(signal.SIGUSR1, _toggle)
"""
# --sliced's: the scheduler stamps each entry into Scheduler.run_batch, once
# a step (two stamps apart: one whole step, whatever wraps it); SIGUSR1
# writes the stamps since the last time to <dir>/<pid>.steps.
STEPS = """
import os, signal, time
if os.environ.get("SGLANG_BENCH_DIR"):
    from sglang_otel_kernels.capture.import_hooks import when_imported
    _stamps = []
    def _write(signum, frame):
        path = os.path.join(os.environ["SGLANG_BENCH_DIR"], f"{os.getpid()}.steps")
        with open(path + ".part", "w") as out:
            out.write(" ".join(map(str, _stamps)))
        os.replace(path + ".part", path)
        _stamps.clear()
    def _stamped(module):
        original = module.Scheduler.run_batch
        def run_batch(*args, _clock=time.perf_counter_ns, _stamp=_stamps.append, **kwargs):
            _stamp(_clock())
            return original(*args, **kwargs)
        module.Scheduler.run_batch = run_batch
        signal.signal(signal.SIGUSR1, _write)
    when_imported("sglang.srt.managers.scheduler", _stamped)
"""


AGAINST: dict[str, str] = {}  # --against: its name in the settings' names, and its path


def setting_of(name: str) -> tuple[int, dict, str]:
    """(level, environment, the package's checkout) of a setting's name, `--against`'s too."""
    setting, _, against = name.partition(" @")
    return (*SETTINGS[setting], AGAINST[against] if against else ROOT)


def environment_python() -> str:
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "sglang-env")], capture_output=True, text=True,
                          check=True)
    return os.path.join(proc.stdout.strip().splitlines()[-1], "bin", "python")


def tiny_model(python: str, scratch: str) -> str:
    """The tests' tiny model (dummy weights) made under `scratch`; its folder."""
    model = os.path.join(scratch, "model")
    subprocess.run([python, os.path.join(ROOT, "tests", "tiny_llama.py"), model, "--dummy"], check=True,
                   capture_output=True)
    return model


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(python: str, model: str, level: int, extra: dict, directory: str,
          hook: str | None = None, root: str = ROOT) -> tuple[subprocess.Popen, int]:
    """A server of `level` (and `extra` environment) from `root`'s code, its
    files in `directory`; `hook`: a directory of a sitecustomize (PROFILER, STEPS)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    if hook:
        env["SGLANG_BENCH_DIR"] = directory
    env.update(PYTHONPATH=os.pathsep.join([root, *([hook] if hook else [])]), SGLANG_USE_CPU_ENGINE="1", SGLANG_KERNEL_API_LOGLEVEL=str(level),
               SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_TRACEFILE=os.path.join(directory, "trace_%i.sgltrace"),
               **extra)
    command = [python, "-m", "sglang_otel_kernels", "run", "--", python, "-m", "sglang.launch_server",
               "--model-path", model, "--load-format", "dummy", "--device", "cpu", "--skip-server-warmup",
               "--tp", "1", "--max-total-tokens", "4096", "--host", "127.0.0.1", "--port", str(port)]
    log = open(os.path.join(directory, "server.log"), "w")
    process = subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        with open(log.name, errors="replace") as handle:
            if "ready to roll" in handle.read():
                return process, port
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start; see {log.name}")
        time.sleep(0.5)


def generate(port: int, tokens: int) -> float:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        completion = json.loads(answer.read())["meta_info"]["completion_tokens"]
    assert completion == tokens, completion
    return time.perf_counter() - began


def stop(process: subprocess.Popen) -> None:
    """As systemd stops a service: SIGTERM to every process, then SIGKILL what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process `pid` so far, in ns (the kernel's
    schedstat: without the time the VM's host took, or other processes ran)."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/schedstat") as handle:
                total += int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total


def server_pids(process: subprocess.Popen) -> dict[int, bytes]:
    """Every process of a server (its session): pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == process.pid:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        found[int(entry)] = handle.read()
            except OSError:
                continue
    return found


def scheduler_pid(process: subprocess.Popen) -> int:
    for pid, command in server_pids(process).items():
        if command.startswith(b"sglang::scheduler"):
            return pid
    raise SystemExit("no scheduler process found")


def setting_directory(scratch: str, kind: str, name: str, number: int = 0) -> str:
    """A new directory for one server of setting `name` (its files, its trace file, its hook's output)."""
    directory = os.path.join(scratch, f"{kind}-{name.replace(' ', '-').replace('@', '')}-{number}")
    os.makedirs(directory)
    return directory


def hook_directory(scratch: str, name: str, code: str) -> str:
    """A directory under `scratch` holding `code` as its sitecustomize."""
    hook = os.path.join(scratch, name)
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as out:
        out.write(code)
    return hook


def profile(python: str, model: str, name: str, scratch: str, requests: int, tokens: int) -> None:
    """The scheduler's main thread under cProfile for `requests` timed requests: the functions that
    take most of a decode step, by their own time and with what they call."""
    level, extra, root = setting_of(name)
    directory = setting_directory(scratch, "profile", name)
    process, port = start(python, model, level, extra, directory, hook_directory(scratch, "profiler", PROFILER), root)
    try:
        generate(port, tokens)
        pid = scheduler_pid(process)
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        for _ in range(requests):
            generate(port, tokens)
        os.kill(pid, signal.SIGUSR1)
        path = os.path.join(directory, f"{pid}.prof")
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
    finally:
        stop(process)
    stats = pstats.Stats(path)
    steps = requests * tokens
    ours = sum(row[2] for key, row in stats.stats.items() if "sglang_otel_kernels" in key[0])
    print(f"\n{name}: {stats.total_tt / steps * 1000:.2f} ms a decode step in the scheduler's main thread "
          f"under cProfile; this package's own functions {ours / steps * 1000:.3f} ms of it (their own time)")
    stats.sort_stats("tottime").print_stats(15)
    print(f"{name}: this package's functions by the time they took with what they called")
    stats.sort_stats("cumulative").print_stats("sglang_otel_kernels", 15)


def pause(process: subprocess.Popen, paused: bool) -> None:
    """Every process of a server stopped (SIGSTOP: no idle spinning beside the one measured) or resumed."""
    os.killpg(process.pid, signal.SIGSTOP if paused else signal.SIGCONT)


def start_all(python: str, model: str, names: list, scratch: str, kind: str, number: int, tokens: int,
              servers: dict, hook: str | None = None) -> dict[str, str]:
    """Every setting's server started into `servers` (name -> (process, port)),
    given one warm-up request (the first request's compile and allocations),
    then paused; returns each one's directory."""
    directories = {}
    for name in names:
        level, extra, root = setting_of(name)
        directories[name] = setting_directory(scratch, kind, name, number)
        servers[name] = start(python, model, level, extra, directories[name], hook, root)
        generate(servers[name][1], tokens)
        pause(servers[name][0], True)
    return directories


def stop_all(servers: dict) -> None:
    """Every server (name -> (process, port)) resumed, then stopped."""
    for process, _ in servers.values():
        pause(process, False)
        stop(process)


def measure(python: str, model: str, names: list, scratch: str, number: int, rounds: int, tokens: int,
            times: dict, ratios: dict, cpu_ratios: dict, total_ratios: dict) -> None:
    """One start of every setting's server, then `rounds` rounds of one request each, side by side."""
    servers: dict = {}
    try:
        start_all(python, model, names, scratch, "side-by-side", number, tokens, servers)
        schedulers = {name: scheduler_pid(process) for name, (process, _) in servers.items()}
        everyone = {name: list(server_pids(process)) for name, (process, _) in servers.items()}
        for round_number in range(rounds):
            shift = round_number % len(names)
            taken, cpu, total = {}, {}, {}
            for name in names[shift:] + names[:shift]:
                process, port = servers[name]
                pause(process, False)
                try:
                    began, all_began = cpu_ns(schedulers[name]), sum(map(cpu_ns, everyone[name]))
                    taken[name] = generate(port, tokens)
                    cpu[name] = cpu_ns(schedulers[name]) - began
                    total[name] = sum(map(cpu_ns, everyone[name])) - all_began
                finally:
                    pause(process, True)
            for name in names:
                times[name].append(taken[name])
                ratios[name].append(taken[name] / taken["level 0"])
                cpu_ratios[name].append(cpu[name] / cpu["level 0"])
                total_ratios[name].append(total[name] / total["level 0"])
            print(f"start {number + 1} round {round_number + 1}: " + ", ".join(
                f"{name} {taken[name]:.3f} s" for name in names), file=sys.stderr, flush=True)
    finally:
        stop_all(servers)


def hook_output(directory: str, pid: int, suffix: str, signum: int) -> str:
    """What a hook of the scheduler `pid` writes to <directory>/<pid><suffix> when
    sent `signum` (it writes a part file, then renames it); the server must be running."""
    path = os.path.join(directory, f"{pid}{suffix}")
    if os.path.exists(path):
        os.remove(path)
    os.kill(pid, signum)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"the scheduler {pid} wrote no {suffix} file; see {directory}/server.log")
        time.sleep(0.01)
    with open(path) as handle:
        return handle.read()


def step_stamps(directory: str, pid: int) -> list[int]:
    """The scheduler's step stamps (STEPS) since the last call, in ns."""
    return [int(stamp) for stamp in hook_output(directory, pid, ".steps", signal.SIGUSR1).split()]


def running_steps(stamps: list[int], paused: list[tuple[int, int]]) -> list[float]:
    """The steps (us) between consecutive stamps that no pause of the server
    overlapped (`paused`: windows (paused at, resumed at) that hold each
    real pause, taken before SIGSTOP and after SIGCONT)."""
    return [(after - before) / 1000 for before, after in zip(stamps, stamps[1:])
            if not any(before < resumed and after > stopped for stopped, resumed in paused)]


def measure_sliced(python: str, model: str, names: list, scratch: str, number: int, rounds: int, tokens: int,
                   slice_s: float, steps: dict, ratios: dict) -> None:
    """One start of every setting's server; each round sends one request to
    each at once and lets them run in turn, `slice_s` each (the others
    paused), so that every setting meets the machine's speed of the same
    moments; a setting's figure is its median step between pauses."""
    servers: dict = {}
    try:
        directories = start_all(python, model, names, scratch, "sliced", number, tokens, servers,
                                hook_directory(scratch, "steps", STEPS))
        schedulers = {name: scheduler_pid(process) for name, (process, _) in servers.items()}

        def stamps(name: str) -> list[int]:
            pause(servers[name][0], False)
            try:
                return step_stamps(directories[name], schedulers[name])
            finally:
                pause(servers[name][0], True)

        for round_number in range(rounds):
            paused: dict[str, list[list[int]]] = {}
            for name in names:  # stamps from the round alone
                stamps(name)
                paused[name] = [[time.perf_counter_ns(), 0]]
            failures: list[BaseException] = []

            def request(port: int) -> None:
                try:
                    generate(port, tokens)
                except BaseException as exc:  # told after the round: the slices go on for the others
                    failures.append(exc)

            clients = {name: threading.Thread(target=request, args=(servers[name][1],), daemon=True) for name in names}
            for client in clients.values():
                client.start()
            turn = round_number
            while any(client.is_alive() for client in clients.values()):
                name = names[turn % len(names)]
                turn += 1
                if not clients[name].is_alive():
                    continue
                pause(servers[name][0], False)
                paused[name][-1][1] = time.perf_counter_ns()
                time.sleep(slice_s)
                paused[name].append([time.perf_counter_ns(), 0])
                pause(servers[name][0], True)
            if failures:
                raise failures[0]
            medians = {}
            for name in names:
                windows = [(stopped, resumed or 1 << 62) for stopped, resumed in paused[name]]
                medians[name] = statistics.median(running_steps(stamps(name), windows))
            for name in names:
                steps[name].append(medians[name])
                ratios[name].append(medians[name] / medians["level 0"])
            print(f"start {number + 1} round {round_number + 1}: " + ", ".join(
                f"{name} {medians[name] / 1000:.3f} ms" for name in names), file=sys.stderr, flush=True)
    finally:
        stop_all(servers)


def median_interval(values: list, confidence: float = 0.95) -> "tuple[float, float] | None":
    """A distribution-free confidence interval for the median of `values`: the
    order statistics a Binomial(n, 1/2) count falls between with at least
    `confidence` (None below the 6 values 95% needs). Rounds of one server
    differ by more than the targets, so a target is shown met only by an
    interval that lies under it, not by a median."""
    ordered, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k <= n // 2 and tail + math.comb(n, k) / 2 ** n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def ratio_header(against: str = "level 0") -> str:
    """The ratio columns' heading (ratio_columns), against `against`."""
    return f"{'x ' + against:>10s} {'quartiles':>12s} {'rounds 95% CI':>14s}  medians by start"


def ratio_columns(name: str, ratios: list, rounds: int) -> str:
    """A setting's ratios to level 0: median, quartiles, the median's 95% interval, each start's median."""
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    interval = median_interval(ratios) if name != "level 0" else None
    starts = ", ".join(f"{statistics.median(ratios[i:i + rounds]):.3f}" for i in range(0, len(ratios), rounds))
    return (f"{statistics.median(ratios):10.3f} {low:5.3f}-{high:5.3f} "
            f"{'' if interval is None else f'{interval[0]:.3f}-{interval[1]:.3f}':>14s}  {starts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2, help="fresh servers this many times (0: no timing)")
    parser.add_argument("--rounds", type=int, default=10, help="requests per setting per start (after one warm-up)")
    parser.add_argument("--tokens", type=int, default=256, help="decode steps per request")
    parser.add_argument("--only", action="append", choices=sorted(SETTINGS), help="settings to measure (all)")
    parser.add_argument("--against", metavar="DIR",
                        help="also run each setting but level 0 from this checkout's code, in the same rounds")
    parser.add_argument("--profile", action="store_true",
                        help="then profile the scheduler in each setting measured (--starts 0: profile only)")
    parser.add_argument("--sliced", type=float, metavar="SECONDS", nargs="?", const=0.05,
                        help="time each setting's steps with all requests in flight at once, each server running "
                             "in turn this long (0.05 s), beside a second level-0 server as the control")
    options = parser.parse_args()
    python = environment_python()
    names = options.only or [name for name in SETTINGS if name != CONTROL]
    if "level 0" not in names:
        names.insert(0, "level 0")
    if options.sliced is not None:
        if options.sliced <= 0:
            raise SystemExit("--sliced: the slice must be more than 0 seconds")
        if CONTROL not in names:
            names.insert(1, CONTROL)
    if options.against:
        against = os.path.abspath(options.against)
        if not os.path.isfile(os.path.join(against, "sglang_otel_kernels", "__init__.py")):
            raise SystemExit(f"--against {options.against}: no sglang_otel_kernels package there")
        AGAINST[os.path.basename(against)] = against
        names += [f"{name} @{os.path.basename(against)}" for name in names if name not in ("level 0", CONTROL)]
    with tempfile.TemporaryDirectory() as scratch:
        model = tiny_model(python, scratch)
        width = max(map(len, names))
        if options.sliced is not None:
            sliced(python, model, names, scratch, options, width)
        else:
            side_by_side(python, model, names, scratch, options, width)
        if options.profile:
            for name in (name for name in names if name != CONTROL):  # the control runs level 0's code
                profile(python, model, name, scratch, options.rounds, options.tokens)


def sliced(python: str, model: str, names: list, scratch: str, options: argparse.Namespace, width: int) -> None:
    steps: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for number in range(options.starts):
        measure_sliced(python, model, names, scratch, number, options.rounds, options.tokens, options.sliced, steps,
                       ratios)
    if not options.starts:
        return
    print(f"{'setting':{width}s} {'ms/step':>8s} {ratio_header()}")
    for name in names:
        print(f"{name:{width}s} {statistics.median(steps[name]) / 1000:8.3f} "
              f"{ratio_columns(name, ratios[name], options.rounds)}", flush=True)
    # The rounds' steps line up across settings: each against both level-0 servers of its round.
    print(f"\nagainst the mean of both level-0 servers' steps in each round (level 0 and {CONTROL}):")
    print(f"{'setting':{width}s} {'ms/step':>8s} {ratio_header('both')}")
    references = [(first + second) / 2 for first, second in zip(steps["level 0"], steps[CONTROL])]
    for name in (name for name in names if name != "level 0"):
        both = [step / reference for step, reference in zip(steps[name], references)]
        print(f"{name:{width}s} {statistics.median(steps[name]) / 1000:8.3f} "
              f"{ratio_columns(name, both, options.rounds)}", flush=True)


def side_by_side(python: str, model: str, names: list, scratch: str, options: argparse.Namespace, width: int) -> None:
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in names}
    total_ratios: dict[str, list[float]] = {name: [] for name in names}
    for number in range(options.starts):
        measure(python, model, names, scratch, number, options.rounds, options.tokens, times, ratios, cpu_ratios,
                total_ratios)
    if not options.starts:
        return
    print(f"{'setting':{width}s} {'s/request':>10s} {'ms/step':>8s} {ratio_header()}")
    for name in names:
        median = statistics.median(times[name])
        print(f"{name:{width}s} {median:10.3f} {1000 * median / options.tokens:8.2f} "
              f"{ratio_columns(name, ratios[name], options.rounds)}", flush=True)
    for title, values in (("the scheduler's CPU time a request (all its threads; a VM's stolen time and other "
                           "processes' turns left out)", cpu_ratios),
                          ("every server process's CPU time a request", total_ratios)):
        print(f"\n{title}\n{'setting':{width}s} {ratio_header()}")
        for name in names:
            print(f"{name:{width}s} {ratio_columns(name, values[name], options.rounds)}", flush=True)


if __name__ == "__main__":
    main()
