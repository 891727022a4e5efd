"""The agent: one per host. It starts, watches and signals that host's workers and spares.

What it owns: the processes (forked from the template in ``launcher/forkserver.py``, or fresh
interpreters), their rendezvous ports (bound here, handed to the process), their stderr (passed
through and remembered, for the cause of a failure), the process table readings that judge a
stopped or wedged process, and the ``pids`` file the reaper cleans up from. What it does not do
is decide: it reports exits and verdicts as :class:`ProcExit` and :class:`ProcVerdict`, and
carries out the coordinator's ``Spawn`` and ``Kill`` commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from checkpointless.config import ENV
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger, open_private_append
from checkpointless.launcher.forkserver import (
    ForkedProcess,
    ForkServer,
    ForkServerError,
    become_subreaper,
    reap_strays,
    take_preforked,
)
from checkpointless.launcher.output import OutputTail, worker_log
from checkpointless.launcher.policy import Limits, ProcWatch
from checkpointless.launcher.proctable import read_sample
from checkpointless.protocol import SUCCESSION_ENV, PeerTable, Succession, succession_to_env
from checkpointless.protocol.beats import BEAT_ENV, BeatReader, WorkerBeat, make_beat_dir
from checkpointless.protocol.tables import TABLE_ENV, TableFiles
from checkpointless.settings import JobSettings

__all__ = ["Agent", "AgentConfig", "ProcExit", "ProcVerdict", "ProcessHandle"]

log = get_logger()
T = TypeVar("T")

# a fresh interpreter, or a fork of the template that has already imported torch
ProcessHandle = subprocess.Popen[bytes] | ForkedProcess

# Signals that come from outside the process (an operator, a scheduler, a chaos test, the OOM
# killer): a process that dies of one did not fail by itself, and a replacement may well start.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@dataclass(frozen=True)
class AgentConfig:
    """What the agent needs to start processes on its host."""

    python: str
    script: str
    script_args: list[str]
    host: str  # the interface this host's processes listen on and advertise
    run_dir: Path
    nproc: int  # ranks in the job (sets the default thread count)
    rendezvous: str  # rootless | tcp
    port_base: int
    port_range: int
    limits: Limits
    quiet_workers: bool = False
    fork_server: bool = True

    @classmethod
    def from_job(cls, job: JobSettings, *, python: str, host: str, run_dir: Path, nproc: int) -> AgentConfig:
        """The job's settings, with what differs per host: the interpreter, the address, the run
        directory as this host sees it, and how many ranks the thread count is sized for."""
        return cls(
            python=python,
            script=job.script,
            script_args=list(job.script_args),
            host=host,
            run_dir=run_dir,
            nproc=nproc,
            rendezvous=job.rendezvous,
            port_base=job.port_base,
            port_range=job.port_range,
            limits=Limits.of(job),
            quiet_workers=job.quiet_workers,
            fork_server=job.fork_server,
        )


@dataclass(frozen=True)
class ProcExit:
    """A process of this host ended."""

    worker_id: int
    code: int
    own_failure: bool  # its death says something about the script (a replacement would die too)
    detail: str  # what happened, with the last error line it printed
    tail: str  # its last output lines


@dataclass(frozen=True)
class ProcVerdict:
    """The process table says a live process must go (stopped, or wedged while starting)."""

    worker_id: int
    pid: int
    why: str


@dataclass
class _Proc:
    worker_id: int
    role: str
    handle: ProcessHandle
    output: OutputTail
    store_port: int
    connected: bool = False
    killed_for: str | None = None
    watch: ProcWatch = field(default_factory=lambda: ProcWatch(time.monotonic()))


class Agent:
    """The processes of one host."""

    def __init__(self, cfg: AgentConfig, env: dict[str, str], events: Any) -> None:
        self.cfg = cfg
        self._env = env  # the job's variables: every process of this host gets them
        self._events = events
        self.procs: dict[int, _Proc] = {}
        # workers that left after finishing their loop: worker id -> (rank, exit code), for the
        # vote if the coordinator is lost before it has ended the job (coordinator/rules/rebuild.py)
        self.finished: dict[int, tuple[int, int]] = {}
        self._ports = self._allocate_ports(cfg.nproc * 2 + 8)
        self.forkserver: ForkServer | None = None
        self._sampled = 0.0
        self._reaped = 0.0
        # the workers' heartbeat records (protocol/beats.py) and this host's peer tables (protocol/tables.py)
        self.beats = self._in_job_shm(
            env,
            lambda d: BeatReader(make_beat_dir(d / "beats")),
            "workers heartbeat over their own connections",
        )
        self.tables = self._in_job_shm(
            env, lambda d: TableFiles(d / "peers"), "workers get the peer table over their own connections"
        )
        # the newest succession heard (agent/remote.py sets it): every process started from now
        # on gets it, so that one still starting when the coordinator is lost can reconnect
        self.succession: Succession | None = None

    @staticmethod
    def _in_job_shm(env: dict[str, str], make: Callable[[Path], T], without: str) -> T | None:
        """``make`` of the job's private shared-memory directory (heartbeat records, peer tables),
        or None when the job has none or it cannot be used there (``without`` says what then)."""
        job = env.get(ENV.JOB_ID)
        if not job:
            return None
        from checkpointless.launcher.reaper import job_shm_dir

        try:
            return make(job_shm_dir(job))
        except OSError as e:
            log.warning("%s: %s", without, e)
            return None

    def on_table_chunk(self, msg: PeerTable) -> None:
        """A chunk of the peer table the coordinator sends this host's workers through us."""
        if self.tables is not None:
            self.tables.on_chunk(msg)

    def read_beats(self, now: float) -> list[WorkerBeat]:
        """Heartbeats this host's processes published since the last call (any one thread)."""
        return self.beats.read(list(self.procs), now) if self.beats is not None else []

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the fork template (its imports run while the rest of the launch goes on)."""
        if not self.cfg.fork_server or not become_subreaper():
            return
        out = subprocess.DEVNULL if self.cfg.quiet_workers else None
        fs = self.forkserver = take_preforked() or ForkServer(self.cfg.python, self._env, out)
        self._record_pid(fs.popen.pid)
        self._events.emit("fork_server", pid=fs.popen.pid)

    def close(self, grace: float = 3.0) -> None:
        """Wait up to ``grace`` seconds for every process to exit, then kill what is left."""
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.handle.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.handle.kill()
                p.handle.wait(timeout=5)
        if self.forkserver is not None:
            self.forkserver.close()

    def set_control(self, address: str) -> None:
        """The coordinator moved (failover): processes started from now on connect there."""
        self._env[ENV.CONTROL] = address

    # -- ports --------------------------------------------------------------------------------
    def _allocate_ports(self, count: int) -> list[int]:
        if self.cfg.rendezvous != "rootless":
            return [0] * count
        from checkpointless.rendezvous import allocate_ports

        return list(
            allocate_ports(base=self.cfg.port_base, count=count, host=self.cfg.host, span=self.cfg.port_range)
        )

    def bind_store_port(self) -> Any:
        """Bind the next free rendezvous port now, here: the process inherits the listening
        socket, so no other job can take the port in between, and once the process is gone a
        connection to it is refused at once (which peers read as "that rank is dead")."""
        from checkpointless.rendezvous import open_listener

        for _ in range(self.cfg.port_range):
            if not self._ports:
                self._ports = self._allocate_ports(8)
            port = self._ports.pop(0)
            try:
                return open_listener(self.cfg.host, port)
            except ConfigError:
                continue  # taken since we looked: try the next one
        raise ConfigError(
            f"no free rendezvous port in {self.cfg.port_base}-{self.cfg.port_base + self.cfg.port_range - 1}; "
            "choose another range with --port-base / --port-range"
        )

    # -- commands -----------------------------------------------------------------------------
    def spawn(self, worker_id: int, role: str) -> str:
        """Start a worker or spare; return the address of its key server ("" without one)."""
        listener = self.bind_store_port() if self.cfg.rendezvous == "rootless" else None
        port = listener.getsockname()[1] if listener is not None else 0
        env = dict(self._env)
        env[ENV.WORKER_ID] = str(worker_id)
        env[ENV.ROLE] = role
        env[ENV.STORE_PORT] = str(port)  # 0 when the rendezvous is not root-less
        if self.beats is not None:
            env[BEAT_ENV] = str(self.beats.path(worker_id))
        if self.tables is not None:
            env[TABLE_ENV] = str(self.tables.directory)
        if self.succession is not None:
            env[SUCCESSION_ENV] = succession_to_env(self.succession)
        argv = [self.cfg.python, self.cfg.script, *self.cfg.script_args]
        err_r, err_w = os.pipe()
        out_w: int | None = None
        handle: ProcessHandle | None = None
        try:
            fs = self.forkserver
            if fs is not None and self._fork_server_ready(fs):
                # the worker's stdout is passed, not left to the template's own: a template
                # forked from this process (prefork) has ours, whatever --quiet-workers says
                out_w = os.open(os.devnull, os.O_WRONLY) if self.cfg.quiet_workers else os.dup(1)
                fds = {"stdout": out_w, "stderr": err_w}
                if listener is not None:
                    fds[ENV.STORE_FD] = listener.fileno()
                try:
                    handle = fs.spawn(argv, env, os.getcwd(), fds)
                except ForkServerError as e:
                    log.warning("fork server failed (%s); starting fresh interpreters from now on", e)
                    self.forkserver = None
            elif fs is not None:
                self.forkserver = None
            if handle is None:
                if listener is not None:
                    env[ENV.STORE_FD] = str(listener.fileno())
                handle = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.DEVNULL if self.cfg.quiet_workers else None,
                    stderr=err_w,
                    pass_fds=(listener.fileno(),) if listener is not None else (),
                    start_new_session=True,  # see the fork server's worker (forkserver.py)
                )
        finally:
            os.close(err_w)
            if out_w is not None:
                os.close(out_w)
            if listener is not None:
                listener.close()  # the process holds the only copy now
        self._record_pid(handle.pid)
        output = OutputTail(os.fdopen(err_r, "rb"), log=worker_log(self.cfg.run_dir, worker_id))
        self.procs[worker_id] = _Proc(worker_id, role, handle, output, port)
        self._events.emit(
            "spawn", worker=worker_id, role=role, pid=handle.pid, forked=self.forkserver is not None
        )
        return f"{self.cfg.host}:{port}" if port else ""

    def kill(self, worker_id: int, why: str) -> None:
        p = self.procs.get(worker_id)
        if p is not None and p.handle.poll() is None:
            p.killed_for = why
            p.handle.send_signal(signal.SIGKILL)

    def mark_connected(self, worker_id: int) -> None:
        p = self.procs.get(worker_id)
        if p is not None:
            p.connected = True

    def signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            p.handle.send_signal(sig)

    # -- observation --------------------------------------------------------------------------
    def poll(self, now: float) -> list[ProcExit | ProcVerdict]:
        """Exits since the last poll, then (every 0.1 s) process-table verdicts."""
        out: list[ProcExit | ProcVerdict] = []
        for p in list(self.procs.values()):
            code = p.handle.poll()
            if code is None:
                continue
            del self.procs[p.worker_id]
            if self.beats is not None:
                rank = self.beats.finished_rank(p.worker_id) if p.role == "worker" else None
                if rank is not None:
                    self.finished[p.worker_id] = (rank, code)
                self.beats.path(p.worker_id).unlink(missing_ok=True)
            out.append(self._exit_of(p, code))
        if now - self._sampled >= 0.1:
            self._sampled = now
            for p in self.procs.values():
                if p.killed_for is not None or p.handle.returncode is not None:
                    continue
                p.watch.observe(read_sample(p.handle.pid), now)
                why = p.watch.verdict(now, p.connected, self.cfg.limits)
                if why is not None:
                    out.append(ProcVerdict(p.worker_id, p.handle.pid, why))
        if self.forkserver is not None and now - self._reaped > 1.0:
            self._reaped = now
            reap_strays({p.handle.pid for p in self.procs.values()} | {self.forkserver.popen.pid})
        return out

    def _exit_of(self, p: _Proc, code: int) -> ProcExit:
        if p.killed_for is not None:
            detail = p.killed_for
        elif code < 0:
            detail = f"terminated by {signal.Signals(-code).name}"
        else:
            detail = f"exited with code {code}"
            cause = p.output.cause()
            if cause:
                detail += f": {cause}"
        if p.killed_for is not None:
            # stopped (SIGSTOP from outside) is not the script's doing; wedged or hung is
            own = p.watch.stopped_since is None
        else:
            own = code > 0 or (code < 0 and signal.Signals(-code) not in _OUTSIDE_SIGNALS)
        return ProcExit(p.worker_id, code, own, detail, p.output.tail() if own else "")

    def pids(self) -> set[int]:
        return {p.handle.pid for p in self.procs.values()}

    # -- helpers ------------------------------------------------------------------------------
    def _record_pid(self, pid: int) -> None:
        with open(open_private_append(self.cfg.run_dir / "pids"), "w") as f:
            f.write(f"{pid}\n")

    def _fork_server_ready(self, fs: ForkServer) -> bool:
        """Wait for the template's imports, judging it like any starting process: a template
        that is stopped or wedged must not hold the launch up for the whole start-up limit."""
        watch = ProcWatch(time.monotonic())
        while not fs.wait_ready(0.1):
            now = time.monotonic()
            watch.observe(read_sample(fs.popen.pid), now)
            why = "exited" if fs.popen.poll() is not None else watch.verdict(now, False, self.cfg.limits)
            if why is not None:
                log.warning("the fork server %s; starting fresh interpreters instead", why)
                fs.close()
                return False
        return True
