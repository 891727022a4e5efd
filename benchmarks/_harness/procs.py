"""Starting the benchmarks' jobs: commands with a time limit, their CPU, and their clean-up.

Child processes: every command runs with a wall-clock limit, and the whole process tree it grew
(torchrun puts its workers in sessions of their own, the checkpointless launcher a reaper) is
killed on a timeout, on an error and on Ctrl-C, so a benchmark never leaves processes behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .cpu import CpuAccount, process_tree

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
RESULTS = BENCH / "results"
EXAMPLE = REPO / "examples" / "train_gpt.py"
BASELINE = BENCH / "baseline" / "train_ddp_ckpt.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


# -- processes ---------------------------------------------------------------------------------
_LIVE: set[int] = set()  # pids of commands started here and not yet reaped


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
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # (wall time, run's CPU s)
    cpu_method: str = ""  # "cgroup-v2", "cgroup-v1" or "proc-tree" (see cpu.py)
    cpu_error: str | None = None  # why the CPU figures are not to be used, if they are not


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
    """Run ``cmd`` to completion or ``timeout``; no process it started outlives this call.

    With ``sample_cpu`` the CPU of every process the command started, whatever forked it, is
    sampled (``cpu.CpuAccount``: the run's own cgroup where one can be made); a measurement that
    cannot be trusted comes back as ``cpu_error``, which callers must treat as a failed run."""
    out = open(stdout, "wb") if stdout else subprocess.DEVNULL  # noqa: SIM115 - closed below
    err = open(stderr, "wb") if stderr else subprocess.DEVNULL  # noqa: SIM115 - closed below
    acct = CpuAccount() if sample_cpu else None
    started = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdout=out,
        stderr=err,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=acct.enter if acct is not None else None,
    )
    _LIVE.add(proc.pid)
    if acct is not None:
        acct.start(proc.pid)
    timed_out = False
    try:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        wall = time.monotonic() - t0
    finally:
        # on a timeout, an exception or Ctrl-C: take down everything the command started
        kill_tree(proc.pid, grace=5.0 if timed_out else 2.0)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        samples = acct.stop() if acct is not None else []  # also kills what left the tree
        _LIVE.discard(proc.pid)
        for f in (out, err):
            if f is not subprocess.DEVNULL:
                f.close()  # type: ignore[union-attr]
    return Finished(
        None if timed_out else proc.returncode,
        wall,
        started,
        timed_out,
        samples,
        acct.method if acct is not None else "",
        acct.error if acct is not None else None,
    )


def run_job(
    cmd: Sequence[str], run_dir: Path, *, timeout: float, env: dict[str, str], sample_cpu: bool = False
) -> Finished:
    """One job of a benchmark: its command line kept in ``run_dir/command``, its output in
    ``run_dir/stdout.log`` and ``stderr.log``, and ``run_command``'s limits and CPU account."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command").write_text(shlex.join(cmd) + "\n")
    return run_command(
        cmd,
        timeout=timeout,
        env=env,
        stdout=run_dir / "stdout.log",
        stderr=run_dir / "stderr.log",
        sample_cpu=sample_cpu,
    )


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
