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
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.model import LaunchConfig, Proc, Round
from checkpointless.launcher.reaper import cleanup_job
from checkpointless.observe.hooks import start_observers
from checkpointless.recovery.decisions import (
    MemberReport,
    SpareAction,
    WorkerHealth,
    find_hung,
    plan_recovery,
    spare_policy,
)

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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        secret_file = self.run_dir / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret)
        self.secret_file = secret_file
        self.events = EventLog(self.run_dir / "events.jsonl", job=self.job_id)
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

    def _spawn(self, role: str) -> Proc:
        wid = self.next_worker_id
        self.next_worker_id += 1
        listener = self._bind_store_port() if self.cfg.rendezvous == "rootless" else None
        port = listener.getsockname()[1] if listener is not None else 0
        env = dict(os.environ)
        env.update(
            {
                ENV.CONTROL: f"{self.server.address[0]}:{self.server.address[1]}",
                ENV.SECRET_FILE: str(self.secret_file),
                ENV.WORKER_ID: str(wid),
                ENV.ROLE: role,
                ENV.RUN_DIR: str(self.run_dir),
                ENV.JOB_ID: self.job_id,
                ENV.STORE_PORT: str(port),  # 0 when the rendezvous is not root-less
                ENV.HOST: self.cfg.host,
                "PYTHONUNBUFFERED": "1",
                # gloo reads all peers' addresses in one batched request per owner
                "GLOO_ENABLE_STORE_V2_API": "1",
            }
        )
        if listener is not None:
            env[ENV.STORE_FD] = str(listener.fileno())
        # N workers each running as many compute threads as there are cores oversubscribe the
        # machine many times over (torchrun sets 1 for the same reason); the user's value wins
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.cfg.nproc)))
        out = subprocess.DEVNULL if self.cfg.quiet_workers else None
        try:
            popen = subprocess.Popen(
                [self.cfg.python, self.cfg.script, *self.cfg.script_args],
                env=env,
                stdout=out,
                stderr=None,
                pass_fds=(listener.fileno(),) if listener is not None else (),
            )
        finally:
            if listener is not None:
                listener.close()  # the worker holds the only copy now
        with open(self.run_dir / "pids", "a") as f:
            f.write(f"{popen.pid}\n")
        p = Proc(worker_id=wid, role=role, popen=popen, store_port=port)
        self.procs[wid] = p
        self.events.emit("spawn", worker=wid, role=role, pid=popen.pid)
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
        try:  # metrics and progress only listen to the events (observe/hooks.py)
            self.observers = start_observers(
                self.run_dir, self.events, self.cfg.host, self.cfg.metrics_port, self.cfg.progress
            )
        except ConfigError:
            self.secret_file.unlink(missing_ok=True)
            raise
        self.server = ControlServer(self.cfg.host, self.cfg.control_port, self.secret)
        self.server.start()
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "checkpointless.launcher.reaper", str(self.run_dir), self.job_id],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        self.store_desc = self._make_rendezvous()
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
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            self._shutdown()
        return self.exit_code

    def _make_rendezvous(self) -> dict[str, Any]:
        if self.cfg.rendezvous == "rootless":
            return {"kind": "rootless", "timeout": self.cfg.recovery_timeout}
        import torch.distributed as dist  # only the store-based fallback pays for this import

        self._tcp_store = dist.TCPStore(self.cfg.host, 0, is_master=True, wait_for_workers=False)
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
            }
        )

    # -- faults --------------------------------------------------------------------------------
    def _fault(self, rank: int, kind: str, detail: str, replace: bool) -> None:
        """Record a fault on ``rank`` and make sure a round is handling it."""
        step = self.members[rank].step if rank in self.members else None
        record = self.events.emit(
            "fault", rank=rank, kind=kind, detail=detail, generation=self.generation, step=step
        )
        record["detected"] = time.monotonic()
        log.warning("FAULT rank %d: %s (%s) at step %s", rank, kind, detail, step)
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
        self.pending_downtime = None
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
                    self._early_spare_deaths = 0 if p.ready else self._early_spare_deaths + 1
                    if self._early_spare_deaths >= 3:
                        raise NotRecoverableError(
                            f"{self._early_spare_deaths} spare processes in a row exited (last code {code}) "
                            "before they were ready: does the script call checkpointless.init() before "
                            "anything that can fail? See the output above for its error"
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
            self._fault(p.rank, kind, detail, replace=True)

    def _check_hangs(self) -> None:
        if any(p.killed_for for p in self.members.values()):
            return  # a culprit is being killed: its exit starts the round; judge nobody meanwhile
        now = time.monotonic()
        health = []
        for rank, p in self.members.items():
            if p.popen.poll() is not None or p.killed_for is not None:
                continue
            if p.conn is None:
                # not connected yet: starting (imports take seconds) — judged by the start-up limit
                if now - p.spawned > self.cfg.start_timeout:
                    self._kill(p, f"did not connect within --start-timeout {self.cfg.start_timeout:.0f} s")
                continue
            progress = p.last_progress if (p.progress_known and self.round is None) else now
            health.append(WorkerHealth(rank, p.last_message, progress, p.in_collective))
        # A step may legitimately be slow (a big model, a busy machine): the no-progress limit grows
        # with the step times the workers report, so only a step far slower than usual is a hang.
        times = [p.step_time for p in self.members.values() if p.step_time is not None]
        progress_limit = max(self.cfg.hang_timeout, self.cfg.hang_factor * max(times, default=0.0))
        r = self.round
        if r is not None and r.phase == "collect" and not r.initial:
            # a member that keeps its heartbeat but never leaves its step after the abort (a busy
            # loop) holds the round up: it is hung like a process that stopped
            for rank, p in self.members.items():
                waiting = rank not in r.reports and rank not in r.replace and p.conn is not None
                if waiting and now - max(r.abort_sent, p.assigned_at) > progress_limit:
                    why = f"did not leave its step within {progress_limit:.1f} s of the abort"
                    log.warning("rank %d %s; killing it", rank, why)
                    self._kill(p, why)
                    return
        culprits, why = find_hung(health, now, self.cfg.hang_timeout, progress_limit)
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
            self._fault(rank, kind, str(msg.get("error")), replace=False)
        r = self.round
        assert r is not None
        if gen != r.target or r.phase != "collect":
            return
        r.reports[rank] = MemberReport(rank, int(msg["committed_step"]), bool(msg["valid"]))
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

    def _report_recovery(self, r: Round, first_step_done: float) -> None:
        t0 = min(f["detected"] for f in r.faults)
        stopped = max(r.report_times.values()) if r.report_times else r.plan_sent
        rec = r.recovered.values()
        rebuild = max(x.get("rebuild_s", 0.0) for x in rec)
        transfer = max(x.get("transfer_s", 0.0) for x in rec)
        nbytes = max(x.get("bytes", 0.0) for x in rec)
        formed = max(x["time"] for x in rec)
        # the slowest rank's wait for its first batch; the first step is what remains after it
        first_batch = max(self.first_batches.values(), default=0.0)
        phases = {
            "collect_s": round(stopped - t0, 4),
            "rebuild_s": round(rebuild, 4),
            "transfer_s": round(transfer, 4),
            "first_batch_s": round(first_batch, 4),
            "first_step_s": round(max(0.0, first_step_done - formed - first_batch), 4),
        }
        downtime = first_step_done - t0
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
            "first batch %.3fs, first step %.3fs; downtime %.3f s after detection",
            r.target,
            kinds,
            f"detected after {phases['detect_s']:.3f}s, " if "detect_s" in phases else "",
            phases["collect_s"],
            rebuild,
            transfer,
            nbytes / 1e6,
            phases["first_batch_s"],
            phases["first_step_s"],
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
            self.events.emit("job_end", status="failed" if failed else "ok", recoveries=len(self.recoveries))
            log.info("job finished: %d recoveries", len(self.recoveries))

    def _stop(self, why: str, code: int) -> None:
        if self.stopping is not None and self.exit_code:
            return
        self.stopping = why
        self.exit_code = code
        log.error("%s", why)
        self.events.emit("job_end", status="failed", error=why, code=code)

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
        self.server.stop()
        self.observers.close()
        cleanup_job(self.run_dir, self.job_id)
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
