"""Helpers shared by the recovery, overhead and transfer benchmarks.

Child processes: every command runs with a wall-clock limit, and the whole process tree it grew
(torchrun puts its workers in sessions of their own, the checkpointless launcher a reaper) is
killed on a timeout, on an error and on Ctrl-C, so a benchmark never leaves processes behind.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
RESULTS = BENCH / "results"
EXAMPLE = REPO / "examples" / "train_gpt.py"
BASELINE = BENCH / "baseline" / "train_ddp_ckpt.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


# -- processes ---------------------------------------------------------------------------------
_LIVE: set[int] = set()  # pids of commands started here and not yet reaped


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces: split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (whatever session they moved to)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM the tree (so a launcher can clean up), then SIGKILL whatever is left."""
    tree = process_tree(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if not any(_alive(p) for p in tree):
            return
        time.sleep(0.05)
    for p in set(tree) | set(process_tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().decode(errors="replace")
    except OSError:
        return False
    return state[state.rfind(")") + 2 :][:1] != "Z"


def kill_all_started() -> None:
    for pid in list(_LIVE):
        kill_tree(pid, grace=2.0)
        _LIVE.discard(pid)


@dataclass
class Finished:
    rc: int | None  # None: killed at the time limit
    wall_s: float
    started: float  # wall clock (time.time()) at launch
    timed_out: bool
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # (wall time, tree CPU s)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


class CpuSampler:
    """Cumulative CPU time of a process tree, sampled from /proc on a thread (processes that
    exited keep the last value seen, so the total never goes down)."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid = pid
        self.every = every
        self.samples: list[tuple[float, float]] = []
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in process_tree(self.pid):
                c = _cpu_seconds(p)
                if c is not None:
                    self._seen[p] = max(c, self._seen.get(p, 0.0))
            self.samples.append((time.time(), sum(self._seen.values())))
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def cpu_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """Tree CPU seconds at wall time ``t``, interpolated between samples."""
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def run_command(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    stdout: Path | None = None,
    stderr: Path | None = None,
    cwd: Path = REPO,
    sample_cpu: bool = False,
) -> Finished:
    """Run ``cmd`` to completion or ``timeout``; its process tree never outlives this call."""
    out = open(stdout, "wb") if stdout else subprocess.DEVNULL  # noqa: SIM115 - closed below
    err = open(stderr, "wb") if stderr else subprocess.DEVNULL  # noqa: SIM115 - closed below
    started = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=env, stdout=out, stderr=err, cwd=cwd, start_new_session=True)
    _LIVE.add(proc.pid)
    sampler = CpuSampler(proc.pid) if sample_cpu else None
    timed_out = False
    try:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        wall = time.monotonic() - t0
    finally:
        samples = sampler.stop() if sampler is not None else []
        # on a timeout, an exception or Ctrl-C: take down everything the command started
        kill_tree(proc.pid, grace=5.0 if timed_out else 2.0)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(proc.pid)
        for f in (out, err):
            if f is not subprocess.DEVNULL:
                f.close()  # type: ignore[union-attr]
    return Finished(None if timed_out else proc.returncode, wall, started, timed_out, samples)


# -- progress ----------------------------------------------------------------------------------
def run_bar(total: int, desc: str, unit: str = "run") -> tqdm[Any]:
    """A bar over a benchmark's runs, on stderr and only when stderr is a terminal (tqdm's
    ``disable=None``), so logs and the results files are exactly what they were without it."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False, dynamic_ncols=True)


def say(line: str) -> None:
    """Print a result line to stdout without tearing the bar: tqdm lifts it off the terminal first."""
    with tqdm.external_write_mode():
        print(line, flush=True)


@contextmanager
def cleanup_on_exit() -> Iterator[None]:
    """Turn SIGTERM into an exception like Ctrl-C, and kill every started tree on the way out."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        kill_all_started()
        signal.signal(signal.SIGTERM, old)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_env(threads: int = 1) -> dict[str, str]:
    """Environment for every training process of both designs (same threads, loopback only)."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # torchrun restarts fail without it (2.13)
            "GLOO_SOCKET_IFNAME": "lo",
        }
    )
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- the example's command line ----------------------------------------------------------------
def example_batch_args(global_batch: int, nproc: int) -> list[str]:
    """The example took ``--batch`` (per rank) and now takes ``--global-batch``; ask it which."""
    text = EXAMPLE.read_text()
    if '"--global-batch"' in text:
        return ["--global-batch", str(global_batch)]
    if global_batch % nproc:
        raise SystemExit(f"global batch {global_batch} is not divisible by {nproc} ranks")
    return ["--batch", str(global_batch // nproc)]


# -- logs --------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return out


# -- statistics --------------------------------------------------------------------------------
def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Median with its spread (min, max) over the repeats that produced a value."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "values": [round(x, 4) for x in xs],
    }


def ratio_ci(ratios: Sequence[float], level: float = 0.95, resamples: int = 10_000) -> dict[str, Any]:
    """Geometric mean of paired ratios (one per round: design / baseline, run next to each other)
    with a percentile-bootstrap confidence interval.

    Why a bootstrap: the round ratios on a shared machine are skewed by load bursts, so an interval
    from a normal or t model would be wrong in an unknown direction; resampling the rounds assumes
    only that they are independent. The seed is fixed so that the same runs give the same interval.
    Why paired and geometric: each ratio already cancels the load both runs of a round saw, and
    ratios compose by multiplication (1.1 and 1/1.1 average to parity)."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if len(logs) < 3:
        return {
            "n": len(logs),
            "geomean": math.exp(statistics.fmean(logs)) if logs else None,
            "lo": None,
            "hi": None,
        }
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return {
        "n": len(logs),
        "level": level,
        "geomean": math.exp(statistics.fmean(logs)),
        "lo": math.exp(means[int(tail * resamples)]),
        "hi": math.exp(means[min(resamples - 1, int((1.0 - tail) * resamples))]),
    }


def verdict(ci: dict[str, Any], target_pct: float) -> str:
    """'met' when the whole interval is within the target, 'NOT met' when all of it is over, and
    'undecided' when the interval straddles it: the runs cannot tell at this machine's noise."""
    if ci["lo"] is None:
        return "undecided (fewer than 3 rounds)"
    limit = 1.0 + target_pct / 100
    if ci["hi"] <= limit:
        return "met"
    if ci["lo"] > limit:
        return "NOT met"
    return "undecided"


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def fmt_spread(s: dict[str, Any], nd: int = 2) -> str:
    if s["median"] is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], nd)
    return f"{fmt(s['median'], nd)} [{fmt(s['min'], nd)}-{fmt(s['max'], nd)}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table whose columns line up on screen too."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


# -- provenance --------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import torch  # only for the version string

    commit = None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        commit = head.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_gib": mem_gb,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "git": commit,
    }


def load_note(start: Sequence[float], end: Sequence[float]) -> str:
    return (
        f"load average (1/5/15 min) {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at the start, "
        f"{end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at the end; the machine is shared with other work"
    )


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
