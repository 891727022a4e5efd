"""Host health checks: what an agent runs on its host before the coordinator may use it, and
again every ``--health-interval`` seconds (scheduled by :mod:`~checkpointless.agent.health_watch`).

A check gives a :class:`CheckResult` (its name, whether it passed, a detail for the operator and
the seconds it took); one run of every check is a :class:`HostHealth`. Each check runs against a
monotonic deadline (``--health-timeout``): one that does not finish in time fails with a detail
saying so, and never holds the agent up. The checks:

* ``memory``: 64 MiB can be allocated and every page written and read back;
* ``room:/dev/shm`` and ``room:run_dir``: each has ``--health-min-free-gib`` free (the job's
  batches, snapshots and peer tables live in the first, its logs and events in the second);
* ``collective`` and ``cuda_matmul`` (``--health-builtins all``), in a child process
  (:mod:`~checkpointless.agent.health_probe`) so that torch and a CUDA context never live in the
  agent itself, and so that a wedged driver call can be killed;
* ``nvml`` (``all``, where nvidia-ml-py is importable): no new ECC or XID errors since the agent
  started and no retired pages pending (:mod:`~checkpointless.agent.health_nvml`);
* ``--health-check CMD``: a shell command passes by exiting 0, its output is the detail;
  ``--health-check py:MODULE:FUNCTION``: a function passes by returning True (raising, or
  returning anything else, fails); it runs in the child process, for the same reasons.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from checkpointless.protocol import HealthReport
from checkpointless.settings import JobSettings

__all__ = [
    "DETAIL_CHARS",
    "CheckResult",
    "HealthConfig",
    "HostHealth",
    "NvmlCheck",
    "check_memory",
    "check_room",
    "parse_probe_output",
    "run_checks",
    "run_command",
    "run_probe",
    "with_deadline",
]

DETAIL_CHARS = 1000  # a check's detail is cut to its last this many characters (a report stays small)
_MEMORY_BYTES = 64 << 20
_PAGE = 4096
_GIB = 1 << 30


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome."""

    name: str
    ok: bool
    detail: str
    seconds: float


@dataclass(frozen=True)
class HostHealth:
    """One run of every check on a host, finished at ``finished`` (the agent's monotonic clock)."""

    results: tuple[CheckResult, ...]
    finished: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def failing(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def summary(self) -> str:
        """The failing checks with their details ("" when every check passed)."""
        return "; ".join(f"{r.name}: {r.detail}" for r in self.failing())

    def report(self, now: float) -> HealthReport:
        """As the agent sends it at monotonic time ``now``."""
        return HealthReport(
            ok=self.ok,
            age=max(0.0, now - self.finished),
            names=[r.name for r in self.results],
            passed=[r.ok for r in self.results],
            details=[r.detail for r in self.results],
            seconds=[round(r.seconds, 3) for r in self.results],
        )


@dataclass(frozen=True)
class HealthConfig:
    """What the checks need: the job's health settings and this host's paths."""

    run_dir: Path
    shm_dir: Path = Path("/dev/shm")
    checks: tuple[str, ...] = ()  # --health-check values
    builtins: str = "all"  # all | basic | off
    interval: float = 60.0
    timeout: float = 30.0
    min_free_bytes: int = _GIB
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)  # the child process's environment ({}: ours)

    @classmethod
    def from_job(cls, job: JobSettings, run_dir: Path, env: dict[str, str]) -> HealthConfig:
        return cls(
            run_dir=run_dir,
            shm_dir=Path(env.get("CHECKPOINTLESS_SHM_DIR", "/dev/shm")),
            checks=tuple(job.health_check),
            builtins=job.health_builtins,
            interval=job.health_interval,
            timeout=job.health_timeout,
            min_free_bytes=int(job.health_min_free_gib * _GIB),
            env=dict(env),
        )


class NvmlCheck(Protocol):
    def check(self) -> CheckResult: ...


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= DETAIL_CHARS else "..." + text[-DETAIL_CHARS:]


def with_deadline(name: str, fn: Callable[[], tuple[bool, str]], timeout: float) -> CheckResult:
    """Run ``fn`` (passed, detail) on a thread of its own and wait at most ``timeout`` seconds:
    a check that blocks (a hung NFS mount under the run directory) fails, and its thread is left
    to finish on its own (a daemon: it never keeps the agent from exiting)."""
    start = time.monotonic()
    out: list[tuple[bool, str]] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # a check that raises has failed, with the reason
            out.append((False, f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, daemon=True, name=f"cl-health-{name}")
    t.start()
    t.join(timeout)
    took = time.monotonic() - start
    if not out:
        return CheckResult(name, False, f"did not finish within {timeout:g} s (--health-timeout)", took)
    ok, detail = out[0]
    return CheckResult(name, ok, _clip(detail), took)


def check_memory(nbytes: int = _MEMORY_BYTES) -> tuple[bool, str]:
    """Allocate ``nbytes``, write every page and read them back: an overcommitted host fails here
    (or its OOM killer acts on this process) rather than in a spare that takes a rank."""
    buf = bytearray(nbytes)
    for i in range(0, nbytes, _PAGE):
        buf[i] = (i // _PAGE) & 0xFF
    bad = sum(1 for i in range(0, nbytes, _PAGE) if buf[i] != (i // _PAGE) & 0xFF)
    if bad:
        return False, f"{bad} of {nbytes // _PAGE} pages read back wrong"
    return True, f"{nbytes >> 20} MiB allocated and written"


def check_room(path: Path, min_free: int, what: str) -> tuple[bool, str]:
    """``path`` exists and has ``min_free`` bytes free."""
    import shutil

    if not path.is_dir():
        return False, f"{what} {path} is not a directory on this host"
    free = shutil.disk_usage(path).free
    have = f"{free / _GIB:.2f} GiB free in {path}"
    if free < min_free:
        return False, f"only {have}, below {min_free / _GIB:g} GiB (--health-min-free-gib)"
    return True, have


def run_command(cmd: str, timeout: float, env: dict[str, str] | None = None) -> CheckResult:
    """A ``--health-check`` shell command: it passes by exiting 0, its output is the detail. It
    runs in a session of its own, so that a command that overruns is killed with its children."""
    start = time.monotonic()
    name = f"command:{cmd if len(cmd) <= 200 else cmd[:197] + '...'}"  # a report stays small
    try:
        p = subprocess.Popen(
            cmd,
            shell=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env or None,
        )
    except OSError as e:
        return CheckResult(name, False, f"could not start: {e}", time.monotonic() - start)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        return CheckResult(
            name, False, f"did not finish within {timeout:g} s (--health-timeout)", time.monotonic() - start
        )
    text = _clip(out.decode(errors="replace"))
    detail = f"exit {p.returncode}" + (f": {text}" if text else "")
    return CheckResult(name, p.returncode == 0, detail, time.monotonic() - start)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    p.communicate()


def probe_checks(cfg: HealthConfig) -> list[str]:
    """The names of the checks the child process runs for ``cfg``, in its order."""
    names = ["collective", "cuda_matmul"] if cfg.builtins == "all" else []
    return names + [f"entry:{c[3:]}" for c in cfg.checks if c.startswith("py:")]


def parse_probe_output(out: str, expected: Sequence[str], why_missing: str) -> list[CheckResult]:
    """The child's JSON lines as results; each expected check it did not report fails with
    ``why_missing`` (it was killed, or crashed)."""
    got: dict[str, CheckResult] = {}
    for line in out.splitlines():
        try:
            d = json.loads(line)
            r = CheckResult(str(d["name"]), bool(d["ok"]), _clip(str(d["detail"])), float(d["seconds"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line the check's own code printed
        got[r.name] = r
    return [got.get(n) or CheckResult(n, False, why_missing, 0.0) for n in expected]


def run_probe(cfg: HealthConfig) -> list[CheckResult]:
    """The checks that need torch or user code, in one child process (health_probe.py): each has
    ``--health-timeout`` there, and the child is killed once all of them could have run out."""
    expected = probe_checks(cfg)
    if not expected:
        return []
    argv = [cfg.python, "-m", "checkpointless.agent.health_probe", "--timeout", str(cfg.timeout)]
    if cfg.builtins == "all":
        argv.append("--builtins")
    for c in cfg.checks:
        if c.startswith("py:"):
            argv += ["--entry", c[3:]]
    # starting the interpreter and importing torch come on top of the checks' own time
    limit = cfg.timeout * (len(expected) + 1)
    start = time.monotonic()
    try:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=cfg.env or None,
        )
    except OSError as e:
        return [CheckResult(n, False, f"could not start the probe process: {e}", 0.0) for n in expected]
    try:
        out, err = p.communicate(timeout=limit)
        why = f"the probe process exited with code {p.returncode}: {_clip(err.decode(errors='replace'))}"
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, why = (
            b"",
            f"the probe process did not finish within {time.monotonic() - start:.0f} s and was killed",
        )
    return parse_probe_output(out.decode(errors="replace"), expected, why)


def run_checks(
    cfg: HealthConfig, nvml: NvmlCheck | None = None, clock: Callable[[], float] = time.monotonic
) -> HostHealth:
    """Every check ``cfg`` asks for, one after the other (``nvml``: the agent's NVML watch)."""
    results: list[CheckResult] = []
    if cfg.builtins != "off":
        results.append(with_deadline("memory", check_memory, cfg.timeout))
        for name, what, path in (
            ("room:/dev/shm", "shared memory", cfg.shm_dir),
            ("room:run_dir", "run directory", cfg.run_dir),
        ):
            room = functools.partial(check_room, path, cfg.min_free_bytes, what)
            results.append(with_deadline(name, room, cfg.timeout))
    if cfg.builtins == "all" and nvml is not None:
        results.append(nvml.check())
    results += run_probe(cfg)
    for c in cfg.checks:
        if not c.startswith("py:"):
            results.append(run_command(c, cfg.timeout, cfg.env))
    return HostHealth(tuple(results), clock())
