"""The embedded operator for one machine: start workers and hot spares, watch them, recover.

One decision loop owns all state. It reads messages from the control channel, polls processes
for exits, checks for hangs, and moves the job between *generations*: every fault starts a round
that aborts the current generation, replaces dead or hung ranks with ready spares, collects each
member's report of its state, sends everyone the plan (see recovery.decisions), and waits until
the new generation has formed. What happened is printed as one line per fault and per recovery
and written as JSON lines to ``<run_dir>/events.jsonl``.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from checkpointless.config import ENV
from checkpointless.errors import ConfigError, NotRecoverableError
from checkpointless.events import EventLog, get_logger, open_private_append, setup_logging
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.forkserver import (
    ForkServer,
    ForkServerError,
    become_subreaper,
    reap_strays,
)
from checkpointless.launcher.model import LaunchConfig, Proc, ProcessHandle, Round, checkpoint_root
from checkpointless.launcher.output import OutputTail
from checkpointless.launcher.policy import (
    FaultRecord,
    Limits,
    ProcWatch,
    budget_verdict,
    progress_limit,
    start_failure_verdict,
)
from checkpointless.launcher.proctable import read_sample
from checkpointless.launcher.reaper import cleanup_job
from checkpointless.launcher.runfiles import make_run_dir, remove_early, write_secret
from checkpointless.observe.hooks import start_observers
from checkpointless.recovery.decisions import (
    MemberReport,
    SpareAction,
    WorkerHealth,
    find_hung,
    plan_recovery,
    spare_policy,
)
from checkpointless.state.durable import remove_partial

__all__ = ["LaunchConfig", "Launcher"]  # LaunchConfig re-exported for callers of this module

log = get_logger()


class Launcher:
    def __init__(self, cfg: LaunchConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.job_id = secrets.token_hex(6)
        self.secret = secrets.token_hex(32).encode()
        self._ports = self._allocate_ports(cfg.nproc + cfg.spares * 4 + 8)
        self.run_dir = cfg.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}"
        self._created_run_dir = make_run_dir(self.run_dir)
        self.secret_file = self.run_dir / "secret"
        write_secret(self.secret_file, self.secret)
        # The job's /dev/shm name gets a random part that only our processes learn, through the
        # environment (never argv, which every user can read). Set here so the reaper, cleanup_job
        # and every worker (plain mode's too) inherit it: one launcher per process.
        self.shm_key = secrets.token_hex(16)
        os.environ[ENV.SHM_KEY] = self.shm_key
        try:
            self.events = EventLog(self.run_dir / "events.jsonl", job=self.job_id)
        except BaseException:
            remove_early(self.run_dir, self._created_run_dir, self.secret_file)
            raise
        self.procs: dict[int, Proc] = {}
        self.members: dict[int, Proc] = {}  # rank -> process holding it
        self.next_worker_id = 0
        self.generation = -1
        self.round: Round | None = None
        self.fired: set[str] = set()
        self.pending_downtime: dict[str, Any] | None = None
        self.first_commits: dict[int, float] = {}
        self.first_batches: dict[int, float] = {}  # rank -> its first batch's wait after a recovery
        self.state_bytes = 0  # a replica's state, as rank 0 last reported it
        self.stopping: str | None = None
        self.exit_code = 0
        self.recoveries: list[dict[str, Any]] = []
        self._signal: int | None = None
        self._early_spare_deaths = 0  # spares that died before saying they were ready, in a row
        self._fired_at: float | None = None  # wall time the last injected fault fired
        self._last_target: int | None = None
        self._same_target = 0
        self.fault_history: list[FaultRecord] = []  # what the fault budget judges
        self.start_failures: dict[int, int] = {}  # rank -> its processes in a row that died before joining
        self._limits = Limits(hang_timeout=cfg.hang_timeout, start_timeout=cfg.start_timeout)
        self._sampled = 0.0
        self._reaped = 0.0
        self.forkserver: ForkServer | None = None

    # -- processes -----------------------------------------------------------------------------
    def _allocate_ports(self, count: int) -> list[int]:
        if self.cfg.rendezvous != "rootless":
            return [0] * count
        from checkpointless.rendezvous import allocate_ports

        return list(
            allocate_ports(base=self.cfg.port_base, count=count, host=self.cfg.host, span=self.cfg.port_range)
        )

    def _take_port(self) -> int:
        if not self._ports:
            self._ports = self._allocate_ports(8)
        return self._ports.pop(0)

    def _bind_store_port(self) -> Any:
        """Bind the next free rendezvous port now, in the launcher: the worker inherits the
        listening socket, so no other job can take the port in between, and once the worker is
        gone a connection to it is refused at once (which peers read as "that rank is dead")."""
        from checkpointless.rendezvous import open_listener

        for _ in range(self.cfg.port_range):
            port = self._take_port()
            try:
                return open_listener(self.cfg.host, port)
            except ConfigError:
                continue  # taken since we looked: try the next one
        raise ConfigError(
            f"no free rendezvous port in {self.cfg.port_base}-{self.cfg.port_base + self.cfg.port_range - 1}; "
            "choose another range with --port-base / --port-range"
        )

    def _job_env(self) -> dict[str, str]:
        """What every process of the job has in its environment (the fork template too)."""
        env = dict(os.environ)
        env.update(
            {
                ENV.CONTROL: f"{self.server.address[0]}:{self.server.address[1]}",
                ENV.SECRET_FILE: str(self.secret_file),
                ENV.RUN_DIR: str(self.run_dir),
                ENV.JOB_ID: self.job_id,
                ENV.HOST: self.cfg.host,
                ENV.SHM_KEY: self.shm_key,
                "PYTHONUNBUFFERED": "1",
                # gloo reads all peers' addresses in one batched request per owner
                "GLOO_ENABLE_STORE_V2_API": "1",
            }
        )
        # N workers each running as many compute threads as there are cores oversubscribe the
        # machine many times over (torchrun sets 1 for the same reason); the user's value wins
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.cfg.nproc)))
        return env

    def _start_fork_server(self) -> None:
        if not self.cfg.fork_server or self.cfg.plain or not become_subreaper():
            return
        out = subprocess.DEVNULL if self.cfg.quiet_workers else None
        fs = self.forkserver = ForkServer(self.cfg.python, self._job_env(), out)
        with open(open_private_append(self.run_dir / "pids"), "w") as f:
            f.write(f"{fs.popen.pid}\n")
        self.events.emit("fork_server", pid=fs.popen.pid)

    def _fork_server_ready(self, fs: ForkServer) -> bool:
        """Wait for the template's imports, judging it like any starting process: a template
        that is stopped or wedged must not hold the launch up for the whole start-up limit."""
        watch = ProcWatch(time.monotonic())
        while not fs.wait_ready(0.1):
            now = time.monotonic()
            watch.observe(read_sample(fs.popen.pid), now)
            why = "exited" if fs.popen.poll() is not None else watch.verdict(now, False, self._limits)
            if why is not None:
                log.warning("the fork server %s; starting fresh interpreters instead", why)
                fs.close()
                return False
        return True

    def _spawn(self, role: str) -> Proc:
        wid = self.next_worker_id
        self.next_worker_id += 1
        listener = self._bind_store_port() if self.cfg.rendezvous == "rootless" else None
        port = listener.getsockname()[1] if listener is not None else 0
        env = self._job_env()
        env[ENV.WORKER_ID] = str(wid)
        env[ENV.ROLE] = role
        env[ENV.STORE_PORT] = str(port)  # 0 when the rendezvous is not root-less
        argv = [self.cfg.python, self.cfg.script, *self.cfg.script_args]
        err_r, err_w = os.pipe()
        handle: ProcessHandle | None = None
        try:
            fs = self.forkserver
            if fs is not None and self._fork_server_ready(fs):
                fds = {"stderr": err_w}
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
                )
        finally:
            os.close(err_w)
            if listener is not None:
                listener.close()  # the worker holds the only copy now
        with open(open_private_append(self.run_dir / "pids"), "w") as f:
            f.write(f"{handle.pid}\n")
        p = Proc(worker_id=wid, role=role, popen=handle, store_port=port)
        p.output = OutputTail(os.fdopen(err_r, "rb"))
        self.procs[wid] = p
        self.events.emit("spawn", worker=wid, role=role, pid=handle.pid, forked=self.forkserver is not None)
        return p

    def _kill(self, p: Proc, why: str) -> None:
        if p.popen.poll() is None:
            p.killed_for = why
            try:
                p.popen.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- entry point ---------------------------------------------------------------------------
    def run(self) -> int:
        setup_logging("launcher")
        try:
            # metrics and progress only listen to the events (observe/hooks.py)
            self.observers = start_observers(
                self.run_dir, self.events, self.cfg.host, self.cfg.metrics_port, self.cfg.progress
            )
            self.server = ControlServer(self.cfg.host, self.cfg.control_port, self.secret)
            self.server.start()
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "checkpointless.launcher.reaper", str(self.run_dir), self.job_id],
                stdin=subprocess.PIPE,
                start_new_session=True,
            )
            self.store_desc = self._make_rendezvous()
            self._start_fork_server()
        except BaseException:
            self._undo_early()
            raise
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        log.info(
            "job %s: %d workers + %s running %s; run dir %s",
            self.job_id,
            self.cfg.nproc,
            "restarts on a fault (--plain)" if self.cfg.plain else f"{self.cfg.spares} spares",
            self.cfg.script,
            self.run_dir,
        )
        self.events.emit(
            "job_start",
            nproc=self.cfg.nproc,
            spares=self.cfg.spares,
            script=self.cfg.script,
            pid=os.getpid(),  # with host: lets `checkpointless status` tell a live launcher from a dead one
            host=socket.gethostname(),
        )
        try:
            if self.cfg.plain:
                from checkpointless.launcher.plain import run_plain

                self.exit_code = run_plain(self, self.cfg.max_restarts)
                self.stopping = "plain"
                return self.exit_code
            self.round = Round(target=0, initial=True, started=time.monotonic())
            for rank in range(self.cfg.nproc):
                p = self._spawn("worker")
                p.rank = rank
                self.members[rank] = p
            # spares start once generation 0 has formed: started together with the workers they
            # would compete for the same cores while everyone imports torch, delaying the job
            self._loop()
        except NotRecoverableError as e:
            self._stop(str(e), 1)
        except Exception as e:  # a launcher bug must still leave nothing behind
            self._stop(f"launcher error: {type(e).__name__}: {e}", 1)
            raise
        finally:
            # shut down under our own handlers: a second Ctrl-C must not cut the clean-up short
            self._shutdown()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
        return self.exit_code

    def _undo_early(self) -> None:
        """A launch that failed before any worker started takes back what it created."""
        observers = getattr(self, "observers", None)
        if observers is not None:
            observers.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
        if self.forkserver is not None:
            self.forkserver.close()
        reaper = getattr(self, "reaper", None)
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # the reaper cleans up and exits at end-of-file
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait(timeout=5)
        self.events.close()
        remove_early(self.run_dir, self._created_run_dir, self.secret_file)

    def _make_rendezvous(self) -> dict[str, Any]:
        if self.cfg.rendezvous == "rootless":
            return {"kind": "rootless", "timeout": self.cfg.recovery_timeout}
        import torch.distributed as dist  # only the store-based fallback pays for this import

        # The TCP store authenticates nobody, so it must at least listen on the job's interface
        # only (torch would bind every interface): bind the socket ourselves and hand it over.
        listener = socket.create_server((self.cfg.host, 0), backlog=512)
        self._tcp_store_listener = listener  # owned by us; closed with the launcher
        self._tcp_store = dist.TCPStore(
            self.cfg.host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        return {
            "kind": "tcp",
            "host": self.cfg.host,
            "port": self._tcp_store.port,
            "timeout": self.cfg.recovery_timeout,
        }

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum

    # -- the decision loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while self.stopping is None:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self._stop(f"launcher received {name}; stopping the job", 128 + self._signal)
                return
            try:
                conn, msg = self.server.inbox.get(timeout=0.02)
                self._handle(conn, msg)
                while True:
                    conn, msg = self.server.inbox.get_nowait()
                    self._handle(conn, msg)
            except queue.Empty:
                pass
            self._poll_exits()
            self._check_procs()
            if self.forkserver is not None and time.monotonic() - self._reaped > 1.0:
                self._reaped = time.monotonic()
                reap_strays(
                    {p.popen.pid for p in self.procs.values()} | {self.forkserver.popen.pid, self.reaper.pid}
                )
            self._check_hangs()
            self._advance_round()
            self._check_done()

    def _proc_of(self, conn: Connection) -> Proc | None:
        return self.procs.get(conn.worker_id) if conn.worker_id is not None else None

    def _handle(self, conn: Connection, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        now = time.monotonic()
        if kind == "hello":
            wid = int(msg["worker_id"])
            p = self.procs.get(wid)
            if p is None:
                conn.close()
                return
            conn.worker_id = wid
            p.conn = conn
            p.last_message = now
            if p.role == "worker" and p.rank is not None:
                self._assign(p, p.rank, 0)
            return
        p = self._proc_of(conn)
        if p is None:
            return
        p.last_message = now
        if kind == "heartbeat":
            p.in_collective = bool(msg.get("in_collective"))
            age = msg.get("progress_age")
            if age is not None:
                p.progress_known = True
                p.last_progress = now - float(age)
            p.step = msg.get("step")
            if msg.get("step_time") is not None:
                p.step_time = float(msg["step_time"])
        elif kind == "spare_ready":
            p.ready = True
            self._early_spare_deaths = 0
            self.events.emit("spare_ready", worker=p.worker_id)
            if self.state_bytes and p.conn is not None:
                p.conn.send({"type": "prepare", "state_bytes": self.state_bytes})
        elif kind == "fired":
            self.fired.add(str(msg["id"]))
            self._fired_at = float(msg["time"])
            self.events.emit(
                "fault_injected", rank=p.rank, id=msg["id"], kind=msg["kind"], fired_at=msg["time"]
            )
        elif kind == "stopped":
            self._on_stopped(p, msg)
        elif kind == "recovered":
            self._on_recovered(p, msg)
        elif kind == "committed":
            self._on_committed(p, msg)
        elif kind == "done":
            p.done = True
        elif kind == "fatal":
            raise NotRecoverableError(f"rank {p.rank}: {msg.get('error')}")
        elif kind == "_closed":
            p.conn = None

    def _assign(self, p: Proc, rank: int, generation: int) -> None:
        p.rank = rank
        p.assigned_at = time.monotonic()
        assert p.conn is not None
        p.conn.send(
            {
                "type": "assign",
                "rank": rank,
                "world_size": self.cfg.nproc,
                "generation": generation,
                "faults": self.cfg.faults,
                "fired": sorted(self.fired),
                "snapshot_every": self.cfg.snapshot_every,
                "checkpoint_every": self.cfg.checkpoint_every,
                "checkpoint_dir": str(checkpoint_root(self.cfg, self.run_dir, self.job_id)),
            }
        )

    # -- faults --------------------------------------------------------------------------------
    def _fault(self, rank: int, kind: str, detail: str, replace: bool, step: int | None = None) -> None:
        """Record a fault on ``rank`` and make sure a round is handling it."""
        if step is None:  # as the rank last said in a heartbeat (it could not tell us itself)
            step = self.members[rank].step if rank in self.members else None
        record = self.events.emit(
            "fault", rank=rank, kind=kind, detail=detail, generation=self.generation, step=step
        )
        record["detected"] = time.monotonic()
        log.warning("FAULT rank %d: %s (%s) at step %s", rank, kind, detail, step)
        self.fault_history.append(FaultRecord(rank, kind, step, detail))
        why = budget_verdict(self.fault_history, self.cfg.fault_window, self.cfg.max_repeat_faults)
        if why is not None:
            raise NotRecoverableError(why)
        r = self.round
        if r is None or r.phase == "rebuild":
            self._begin_round(record)
        else:
            r.faults.append(record)
        assert self.round is not None
        if replace:
            self.round.replace.add(rank)
            self.round.reports.pop(rank, None)

    def _begin_round(self, first_fault: dict[str, Any]) -> None:
        prev = self.round
        target = (prev.target if prev is not None else self.generation) + 1
        # a generation that never formed its first state sync still needs it
        initial = prev is not None and prev.initial
        r = Round(target=target, initial=initial, started=time.monotonic())
        r.faults.append(first_fault)
        if prev is not None:  # a fault while a generation was forming: keep the earlier faults
            r.faults = prev.faults + r.faults
            r.started = prev.started
            r.replace = set(prev.replace)
        self.round = r
        self._flush_pending_recovery("superseded by a new fault before every rank committed a step")
        for rank, p in self.members.items():
            if p.conn is not None and rank not in r.replace:
                p.conn.send({"type": "abort", "generation": target, "reason": first_fault["detail"]})

    def _poll_exits(self) -> None:
        for p in list(self.procs.values()):
            code = p.popen.poll()
            if code is None:
                continue
            del self.procs[p.worker_id]
            if p.rank is None or self.members.get(p.rank) is not p:
                if self.stopping is None and p.role == "spare":
                    self.events.emit("spare_lost", worker=p.worker_id, code=code)
                    if not p.ready and _own_failure(p, code):
                        self._early_spare_deaths += 1
                    elif p.ready:
                        self._early_spare_deaths = 0
                    if self._early_spare_deaths >= self.cfg.max_start_failures:
                        tail = p.output.tail() if p.output is not None else ""
                        raise NotRecoverableError(
                            f"{self._early_spare_deaths} spare processes in a row failed before they were "
                            f"ready (last: exit code {code}{', ' + p.killed_for if p.killed_for else ''}); "
                            "the script fails before or inside checkpointless.init(), so every replacement "
                            "would too. Fix what its output shows" + (f":\n{tail}" if tail else "")
                        )
                    log.warning("spare %d exited (code %s); starting another", p.worker_id, code)
                    self._spawn("spare")
                continue
            if p.done:
                if code != 0:  # its work was complete: the final barrier had passed everywhere
                    log.warning("rank %d exited with code %s after finishing", p.rank, code)
                continue
            if p.killed_for is not None:
                kind, detail = "hang", p.killed_for
            elif code < 0:
                kind, detail = "killed", f"terminated by {signal.Signals(-code).name}"
            else:
                kind, detail = "exit", f"exited with code {code}"
                cause = p.output.cause() if p.output is not None else ""
                if cause:
                    detail += f": {cause}"
            if not p.joined and self.stopping is None and _own_failure(p, code):
                self._start_failed(p, detail)
            self._fault(p.rank, kind, detail, replace=True)

    def _check_procs(self) -> None:
        """Judge every live process from the process table: a stopped one at once, one that is
        still starting by its CPU progress (see launcher/policy.py ProcWatch)."""
        now = time.monotonic()
        if now - self._sampled < 0.1:
            return
        self._sampled = now
        for p in list(self.procs.values()):
            if p.killed_for is not None or p.popen.returncode is not None:
                continue
            p.watch.observe(read_sample(p.popen.pid), now)
            why = p.watch.verdict(now, p.conn is not None, self._limits)
            if why is None:
                continue
            who = f"rank {p.rank}" if p.rank is not None else f"{p.role} {p.worker_id}"
            log.warning("%s (pid %d) %s; killing it", who, p.popen.pid, why)
            self._kill(p, why)

    def _start_failed(self, p: Proc, detail: str) -> None:
        """A process died before it ever joined as its rank: count it against a respawn loop."""
        assert p.rank is not None
        n = self.start_failures.get(p.rank, 0) + 1
        self.start_failures[p.rank] = n
        tail = p.output.tail() if p.output is not None else ""
        why = start_failure_verdict(p.rank, n, self.cfg.max_start_failures, detail, tail)
        if why is not None:
            raise NotRecoverableError(why)

    def _check_hangs(self) -> None:
        if any(p.killed_for for p in self.members.values()):
            return  # a culprit is being killed: its exit starts the round; judge nobody meanwhile
        now = time.monotonic()
        health = []
        for rank, p in self.members.items():
            if p.popen.poll() is not None or p.killed_for is not None:
                continue
            if p.conn is None:
                continue  # still starting: judged from the process table (_check_procs)
            progress = p.last_progress if (p.progress_known and self.round is None) else now
            health.append(WorkerHealth(rank, p.last_message, progress, p.in_collective))
        # A step may legitimately be slow (a big model, a busy machine): the no-progress limit grows
        # with the step times the workers report, so only a step far slower than usual is a hang.
        times = [p.step_time for p in self.members.values() if p.step_time is not None]
        limit = progress_limit(self.cfg.hang_timeout, self.cfg.hang_factor, times)
        r = self.round
        if r is not None and r.phase == "collect" and not r.initial:
            # a member that keeps its heartbeat but never leaves its step after the abort (a busy
            # loop) holds the round up: it is hung like a process that stopped
            for rank, p in self.members.items():
                waiting = rank not in r.reports and rank not in r.replace and p.conn is not None
                if waiting and now - max(r.abort_sent, p.assigned_at) > limit:
                    why = f"did not leave its step within {limit:.1f} s of the abort"
                    log.warning("rank %d %s; killing it", rank, why)
                    self._kill(p, why)
                    return
        culprits, why = find_hung(health, now, self.cfg.hang_timeout, limit)
        if not culprits and why and self.round is None:
            # everyone waits for everyone (a lost message, a wedged link): nobody to replace,
            # but the collective will never finish; rebuild the communicator with the same ranks
            self._fault(min(h.rank for h in health), "stall", why, replace=False)
            return
        for rank in culprits:
            log.warning("rank %d is hung: %s; killing it", rank, why)
            self._kill(self.members[rank], why)

    # -- rounds --------------------------------------------------------------------------------
    def _on_stopped(self, p: Proc, msg: dict[str, Any]) -> None:
        rank = p.rank
        if rank is None or self.members.get(rank) is not p:
            return
        gen = int(msg["for_generation"])
        cause = msg.get("cause")
        r = self.round
        if r is not None and r.phase == "rebuild" and gen <= r.target and cause != "recovery":
            return  # a duplicate of a report this round already has
        if r is None and gen <= self.generation:
            return  # stale: about a generation that has already formed
        if r is None or r.phase == "rebuild":
            # a rank stopped by itself: that is a fault (its own exception, a failed collective
            # or a failed recovery step) unless a round already covers it
            kind = "exception" if cause == "exception" else ("recovery" if cause == "recovery" else "comm")
            step = msg.get("step")
            self._fault(
                rank, kind, str(msg.get("error")), replace=False, step=step if isinstance(step, int) else None
            )
        r = self.round
        assert r is not None
        if gen != r.target or r.phase != "collect":
            return
        snap, ckpt = msg.get("snapshot_step"), msg.get("checkpoint_step")
        r.reports[rank] = MemberReport(
            rank,
            int(msg["committed_step"]),
            bool(msg["valid"]),
            int(snap) if snap is not None else None,
            int(ckpt) if ckpt is not None else None,
        )
        r.report_times[rank] = time.monotonic()

    def _advance_round(self) -> None:
        r = self.round
        if r is None or r.phase != "collect":
            return
        if r.replace:
            self._replace(r, sorted(r.replace))
            return
        if len(r.reports) < self.cfg.nproc:
            if time.monotonic() - r.started > self.cfg.recovery_timeout:
                missing = sorted(set(range(self.cfg.nproc)) - set(r.reports))
                raise NotRecoverableError(
                    f"generation {r.target}: ranks {missing} never reported within --recovery-timeout"
                )
            return
        plan = plan_recovery([r.reports[k] for k in sorted(r.reports)], initial=r.initial)
        # every round counts, the start-up ones too: a recovery that fails the same way each time
        # must end the job, not spin through generations
        self._same_target = self._same_target + 1 if plan.target_step == self._last_target else 1
        self._last_target = plan.target_step
        if self._same_target > self.cfg.max_step_failures + (1 if r.initial else 0):
            raise NotRecoverableError(
                f"faults keep recurring at step {plan.target_step}: {self._same_target} recoveries in a "
                "row made no progress; this looks like a bug or a bad node, not a transient fault "
                "(raise --max-step-failures to allow more)"
            )
        desc = dict(self.store_desc)
        if desc["kind"] == "rootless":
            desc["peers"] = [f"{self.cfg.host}:{self.members[k].store_port}" for k in range(self.cfg.nproc)]
        for p in self.members.values():
            if p.conn is not None:
                p.conn.send(
                    {"type": "recover", "generation": r.target, "rendezvous": desc, "plan": plan.to_json()}
                )
        r.phase = "rebuild"
        r.plan_sent = time.monotonic()
        self.events.emit("plan", generation=r.target, **plan.to_json())

    def _replace(self, r: Round, ranks: list[int]) -> None:
        ready = [
            p for p in self.procs.values() if p.role == "spare" and p.rank is None and p.ready and p.conn
        ]
        starting = [p for p in self.procs.values() if p.role == "spare" and p.rank is None and not p.ready]
        if r.waiting_since is None:
            r.waiting_since = time.monotonic()
        d = spare_policy(
            len(ready), len(starting), len(ranks), time.monotonic() - r.waiting_since, self.cfg.spare_wait
        )
        if d.action == SpareAction.FAIL:
            raise NotRecoverableError(d.reason)
        for _ in range(d.spawn):
            log.warning(
                "no hot spare ready for rank(s) %s; starting one (waits up to %.0f s)",
                ranks,
                self.cfg.spare_wait,
            )
            self._spawn("spare")
        if d.action == SpareAction.WAIT and not ready:
            return
        for rank, spare in zip(ranks, ready, strict=False):
            old = self.members.get(rank)
            if old is not None:
                self._kill(old, old.killed_for or "replaced")
            self.members[rank] = spare
            self._assign(spare, rank, r.target)
            r.replace.discard(rank)  # settled once the spare reports; re-added if it dies first
            self.events.emit("spare_assigned", rank=rank, worker=spare.worker_id, generation=r.target)
            log.info("spare %d takes rank %d", spare.worker_id, rank)
            if self._idle_spares() < self.cfg.spares:
                self._spawn("spare")  # refill the pool in the background
        r.waiting_since = None

    def _idle_spares(self) -> int:
        return sum(1 for p in self.procs.values() if p.role == "spare" and p.rank is None)

    def _on_recovered(self, p: Proc, msg: dict[str, Any]) -> None:
        r = self.round
        if r is None or r.phase != "rebuild" or int(msg["generation"]) != r.target or p.rank is None:
            return
        r.recovered[p.rank] = {**msg.get("timings", {}), "time": time.monotonic()}
        p.joined = True
        self.start_failures.pop(p.rank, None)
        if len(r.recovered) < self.cfg.nproc:
            return
        self.generation = r.target
        self.round = None
        now = time.monotonic()
        for m in self.members.values():
            m.last_progress = now  # the hang clock restarts with the new generation
        if r.initial:
            log.info("generation %d formed in %.2f s after launch", r.target, time.monotonic() - r.started)
            self.events.emit("started", generation=r.target, seconds=time.monotonic() - r.started)
            while self._idle_spares() < self.cfg.spares:
                self._spawn("spare")
            return
        self.pending_downtime = {"round": r}
        self.first_commits = {}
        self.first_batches = {}

    def _on_committed(self, p: Proc, msg: dict[str, Any]) -> None:
        size = msg.get("state_bytes")
        if isinstance(size, int) and size > self.state_bytes:
            # spares page in room for this much state while they wait (see state/arena.py)
            self.state_bytes = size
            for spare in self.procs.values():
                if spare.role == "spare" and spare.rank is None and spare.ready and spare.conn is not None:
                    spare.conn.send({"type": "prepare", "state_bytes": size})
        pend = self.pending_downtime
        if pend is None or p.rank is None or int(msg["generation"]) != self.generation:
            return
        self.first_commits[p.rank] = time.monotonic()
        batch_s = msg.get("first_batch_s")
        if isinstance(batch_s, (int, float)):
            self.first_batches[p.rank] = float(batch_s)
        if len(self.first_commits) < self.cfg.nproc:
            return
        self.pending_downtime = None
        self._report_recovery(pend["round"], max(self.first_commits.values()))

    def _flush_pending_recovery(self, why: str) -> None:
        """Report a recovery whose first step never completed everywhere: every round that
        formed a generation is counted and reported, even when the job ended (or another fault
        came) before its first step did."""
        pend, self.pending_downtime = self.pending_downtime, None
        if pend is not None:
            self._report_recovery(pend["round"], None, why)

    def _report_recovery(
        self, r: Round, first_step_done: float | None, incomplete: str | None = None
    ) -> None:
        t0 = min(f["detected"] for f in r.faults)
        stopped = max(r.report_times.values()) if r.report_times else r.plan_sent
        rec = r.recovered.values()
        rebuild = max(x.get("rebuild_s", 0.0) for x in rec)
        transfer = max(x.get("transfer_s", 0.0) for x in rec)
        nbytes = max(x.get("bytes", 0.0) for x in rec)
        formed = max(x["time"] for x in rec)
        # the slowest rank's wait for its first batch; the first step is what remains after it
        first_batch = max(self.first_batches.values(), default=0.0)
        phases: dict[str, Any] = {
            "collect_s": round(stopped - t0, 4),
            "rebuild_s": round(rebuild, 4),
            "transfer_s": round(transfer, 4),
            "first_batch_s": round(first_batch, 4),
            "first_step_s": None
            if first_step_done is None
            else round(max(0.0, first_step_done - formed - first_batch), 4),
        }
        if incomplete is not None:
            phases["incomplete"] = incomplete  # downtime then ends when the generation formed
        downtime = (formed if first_step_done is None else first_step_done) - t0
        # how long the fault went unnoticed, when we know when it happened (an injected fault)
        first_wall = min(f["time"] for f in r.faults)
        if self._fired_at is not None and 0 <= first_wall - self._fired_at < 600:
            phases["detect_s"] = round(first_wall - self._fired_at, 4)
            self._fired_at = None
        # a failed collective on a survivor is a symptom; name the causes when they are known
        causes = [f for f in r.faults if f["kind"] != "comm"] or r.faults
        kinds = ", ".join(f"{f['kind']} on rank {f['rank']}" for f in causes)
        record = self.events.emit(
            "recovery",
            generation=r.target,
            faults=[{k: v for k, v in f.items() if k != "detected"} for f in r.faults],
            downtime_s=round(downtime, 4),
            state_bytes=nbytes,
            transport=next((x["transport"] for x in rec if "transport" in x), None),
            **phases,
        )
        self.recoveries.append(record)
        log.info(
            "RECOVERED generation %d from %s: %sstop %.3fs, rebuild %.3fs, state %.3fs (%.1f MB), "
            "first batch %.3fs, first step %s; downtime %.3f s after detection",
            r.target,
            kinds,
            f"detected after {phases['detect_s']:.3f}s, " if "detect_s" in phases else "",
            phases["collect_s"],
            rebuild,
            transfer,
            nbytes / 1e6,
            phases["first_batch_s"],
            "n/a" if phases["first_step_s"] is None else f"{phases['first_step_s']:.3f}s",
            downtime,
        )

    # -- the end -------------------------------------------------------------------------------
    def _check_done(self) -> None:
        if self.round is not None or not self.members:
            return
        if all(p.done and p.popen.poll() is not None for p in self.members.values()):
            failed = sorted(r for r, p in self.members.items() if p.popen.returncode != 0)
            self.stopping = "done"
            self.exit_code = 1 if failed else 0
            if failed:
                # training finished everywhere, but the script failed after its loop (saving?)
                log.error("training finished, but rank(s) %s failed after the loop; see their output", failed)
            self._flush_pending_recovery("the job ended before every rank committed a step after it")
            faults = len(self.fault_history)
            self.events.emit(
                "job_end",
                status="failed" if failed else "ok",
                recoveries=len(self.recoveries),
                faults=faults,
            )
            log.info("job finished: %d recoveries from %d faults", len(self.recoveries), faults)

    def _stop(self, why: str, code: int) -> None:
        if self.stopping is not None and self.exit_code:
            return
        self.stopping = why
        self.exit_code = code
        self._flush_pending_recovery("the job stopped")
        log.error("%s", why)
        self.events.emit(
            "job_end",
            status="failed",
            error=why,
            code=code,
            recoveries=len(self.recoveries),
            faults=len(self.fault_history),
        )

    def _shutdown(self) -> None:
        """Stop every process we started, remove shared memory, close the watchdog."""
        for p in self.procs.values():
            if p.conn is not None and p.popen.poll() is None:
                p.conn.send(
                    {"type": "shutdown", "code": 0 if self.exit_code == 0 else 1, "reason": self.stopping}
                )
        deadline = time.monotonic() + 3.0
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=5)
        if self.forkserver is not None:
            self.forkserver.close()
        self.server.stop()
        self.observers.close()
        cleanup_job(self.run_dir, self.job_id)
        remove_partial(checkpoint_root(self.cfg, self.run_dir, self.job_id))  # checkpoints stay, .tmp go
        try:
            self.secret_file.unlink()
        except OSError:
            pass
        if self.reaper.stdin is not None:
            self.reaper.stdin.close()
        try:
            self.reaper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
        self.events.close()


# Signals that come from outside the process (an operator, a scheduler, a chaos test, the OOM
# killer): a process that dies of one did not fail by itself, and a replacement may well start.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _own_failure(p: Proc, code: int) -> bool:
    """Whether a process's death says something about the script (so a replacement would die
    the same way): an error exit, a crash signal, or our own kill for a wedge or a stop."""
    if p.killed_for is not None:
        # stopped (SIGSTOP from outside) is not the script's doing; wedged or hung is
        return p.watch.stopped_since is None
    if code > 0:
        return True
    return code < 0 and signal.Signals(-code) not in _OUTSIDE_SIGNALS
