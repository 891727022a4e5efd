"""The CPU time of every process a benchmark run started, whatever forked it.

A design's CPU per step is its whole job's CPU: the launcher, its fork template and reaper, the
ranks, the spares, torchrun's agent. Walking the process tree from the command's pid misses
whatever leaves the tree: a process whose parent exited is re-parented to init (or to a
subreaper outside the tree), and one that forks and exits between two samples is never seen.
Such a run once read 0.0 ms of CPU per step for one design and 1.6 ms against 25-28 ms for the
others (issue 35). So:

* **cgroup** (the robust way, used where this process may create cgroups: as root, with cgroup v2
  or v1's ``cpuacct``): the command is put into a cgroup of its own before it runs
  (``preexec_fn``), every process it forks is born there whatever its parent, and the cgroup's
  counter (``cpu.stat`` ``usage_usec``; v1 ``cpuacct.usage``) includes processes that have
  already exited. The cgroup is also how the run is killed at the end: nothing escapes it.
* **proc-tree** (elsewhere): the tree from /proc, sampled; a process keeps the last CPU seen
  while it was in the tree; the end point is at least the command's ``RUSAGE_CHILDREN``. It
  misses what leaves the tree, so its results say ``cpu_method: proc-tree``.

Either way a measurement that cannot be trusted is an error (``CpuAccount.error``), never a data
point: a run with no CPU counted, or a cgroup that counted less than the reaped processes alone.
``CHECKPOINTLESS_BENCH_CPU=proc`` forces the fallback (to compare the two).
"""

from __future__ import annotations

import itertools
import os
import resource
import signal
import threading
import time
from pathlib import Path

__all__ = ["CpuAccount", "cgroup_base", "cpu_at", "process_tree"]

_TICK = os.sysconf("SC_CLK_TCK")
_COUNTER = itertools.count()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces: split after the last ')'
    return stat[stat.rfind(")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None and len(fields) > 1:
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


def cpu_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """CPU seconds at wall time ``t``, interpolated between samples."""
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cgroup_base() -> tuple[Path, str] | None:
    """Where a cgroup for one run can be made: (this process's own cgroup directory, "v2" or
    "v1"), or None when there is none this process may write to."""
    if os.environ.get("CHECKPOINTLESS_BENCH_CPU") == "proc":
        return None
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = [m.split()[1] for m in mounts if m.split()[2:3] == ["cgroup2"]]
    v1 = [
        m.split()[1] for m in mounts if m.split()[2:3] == ["cgroup"] and "cpuacct" in m.split()[3].split(",")
    ]
    candidates: list[tuple[Path, str]] = []
    for line in own:
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and v2:
            candidates.append((Path(v2[0] + path), "v2"))
        elif "cpuacct" in ctrls.split(",") and v1:
            candidates.append((Path(v1[0] + path), "v1"))
    for base, kind in sorted(candidates, key=lambda c: c[1] != "v2"):
        probe = base / f"cl-bench-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            continue
        return base, kind
    return None


class CpuAccount:
    """Cumulative CPU seconds of one command's processes, sampled every ``every`` s on a thread.

    Use: ``acct = CpuAccount(); Popen(..., preexec_fn=acct.enter)``, then ``acct.start(pid)``,
    and once the command is over ``acct.stop()`` (kills what is left of it, takes the last
    sample); ``samples`` holds (wall time, CPU seconds) and ``error`` says why the figures
    cannot be used, if they cannot."""

    def __init__(self, every: float = 0.2) -> None:
        self.every = every
        self.samples: list[tuple[float, float]] = []
        self.error: str | None = None
        self._pid = 0
        self._ru0 = _children_cpu()
        self._seen: dict[tuple[int, str], float] = {}  # (pid, start time) -> CPU s, proc-tree mode
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        base = cgroup_base()
        self.method = "proc-tree" if base is None else f"cgroup-{base[1]}"
        self._cg: Path | None = None
        if base is not None:
            self._cg = base[0] / f"cl-bench-{os.getpid()}-{next(_COUNTER)}"
            self._cg.mkdir()
        # opened here, written in the child: preexec_fn must not allocate much between fork and exec
        self._procs_path = str(self._cg / "cgroup.procs") if self._cg else ""

    def enter(self) -> None:
        """``preexec_fn``: move the forked child into the run's cgroup before it execs."""
        if self._procs_path:
            fd = os.open(self._procs_path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def start(self, pid: int) -> None:
        self._pid = pid
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-account")
        self._thread.start()

    # -- reading ---------------------------------------------------------------------------------
    def _cgroup_cpu(self) -> float:
        assert self._cg is not None
        if self.method == "cgroup-v2":
            for line in (self._cg / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            raise OSError("no usage_usec in cpu.stat")
        return int((self._cg / "cpuacct.usage").read_text()) / 1e9

    def _tree_cpu(self) -> float:
        for p in process_tree(self._pid):
            fields = _stat_fields(p)
            if fields is not None and len(fields) > 19:
                key = (p, fields[19])  # start time: a reused pid is another process
                self._seen[key] = max(self._seen.get(key, 0.0), (int(fields[11]) + int(fields[12])) / _TICK)
        return sum(self._seen.values())

    def read(self) -> float:
        return self._cgroup_cpu() if self._cg is not None else self._tree_cpu()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), self.read()))
            except OSError as e:
                self.error = f"CPU not readable ({self.method}): {e}"
                return
            self._stop.wait(self.every)

    # -- the end ---------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Every live process of the run (cgroup mode), else the tree under the command."""
        if self._cg is None:
            return process_tree(self._pid) if self._pid else []
        try:
            return [int(x) for x in (self._cg / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self, grace: float = 0.0) -> None:
        """SIGTERM (when ``grace``) then SIGKILL every process left in the run's cgroup."""
        if self._cg is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if sig == signal.SIGTERM and not grace:
                continue
            for p in self.pids():
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait
            while self.pids() and time.monotonic() < end:
                time.sleep(0.05)

    def stop(self) -> list[tuple[float, float]]:
        """Stop sampling, take the last sample, remove the cgroup, and judge the measurement."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.error is None:
            try:
                total = self.read()
            except OSError as e:
                self.error = f"CPU not readable ({self.method}): {e}"
                total = 0.0
            reaped = _children_cpu() - self._ru0  # the command and the descendants it waited for
            if self._cg is None:
                total = max(total, reaped)
            elif total < 0.95 * reaped - 0.05:
                self.error = (
                    f"the cgroup counted {total:.2f} s of CPU, less than the reaped processes' {reaped:.2f} s"
                )
            if total <= 0.0:
                self.error = f"no CPU counted for the run ({self.method})"
            self.samples.append((time.time(), total))
        if self._cg is not None:
            self.kill_all()
            for _ in range(100):
                try:
                    self._cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        return self.samples
