"""The coordinator: the job's decisions, as a state machine with events in and commands out.

It owns the ranks, the generations, the recovery rounds, the spare pool, hang and stall
decisions and the fault budget. It touches no socket, process or clock: the shell around it
(``launcher/launcher.py`` for one machine) feeds it what it observed — a worker's message, a
process exit, a process-table verdict, the passing of time — and carries out the commands it
queues (:mod:`checkpointless.coordinator.state`): start or kill a process, send a message, write an
event, log a line, stop the job. The rules themselves are pure functions in
``recovery/decisions.py`` and ``launcher/policy.py``; this class applies them to its state.

A round, in brief: a fault aborts the current generation (``Abort`` to every member), dead or hung
ranks are replaced by ready spares (``Assign``), every member reports its state (``Stopped``), the
plan goes out (``Recover``), and once every rank has ``Recovered`` the new generation has formed.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from checkpointless.coordinator.downtime import recovery_fields
from checkpointless.coordinator.placement import HostView, assign_hosts, pick_spares, placement, spare_host
from checkpointless.coordinator.prefetch import slot_ranks
from checkpointless.coordinator.state import (
    Command,
    Emit,
    HostState,
    Kill,
    Log,
    Member,
    Round,
    Send,
    Spawn,
    Stop,
)
from checkpointless.coordinator.stragglers import RankTiming, StragglerRule, StragglerWatch
from checkpointless.errors import NotRecoverableError
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.policy import (
    FaultRecord,
    budget_verdict,
    first_step_limit,
    progress_limit,
    start_failure_verdict,
)
from checkpointless.peer_table import TableKeeper, compact_plan
from checkpointless.protocol import (
    Abort,
    Assign,
    Committed,
    Done,
    Fatal,
    Fired,
    Heartbeat,
    Message,
    PeerTable,
    PeerTableRequest,
    Prefetch,
    Prepare,
    Recover,
    Recovered,
    Shutdown,
    SpareReady,
    Stopped,
)
from checkpointless.recovery.decisions import (
    MemberReport,
    SpareAction,
    WorkerHealth,
    find_hung,
    plan_recovery,
    spare_policy,
)

if TYPE_CHECKING:
    from checkpointless.agent.beats import WorkerBeat

__all__ = ["Coordinator"]


class Coordinator:
    def __init__(
        self, cfg: LaunchConfig, job_id: str, rendezvous: dict[str, Any], checkpoint_dir: str = ""
    ) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.rendezvous = rendezvous
        self.checkpoint_dir = checkpoint_dir  # where durable checkpoints go ("" when they are off)
        self.procs: dict[int, Member] = {}  # live processes, by worker id
        self.ranks: dict[int, Member] = {}  # rank -> the process holding it
        self.next_worker_id = 0
        self.generation = -1
        self.round: Round | None = None
        self.fired: set[str] = set()
        self.pending: Round | None = None  # a formed round whose first step is not done everywhere
        self.first_commits: dict[int, float] = {}
        self.first_batches: dict[int, float] = {}
        self.state_bytes = 0  # a replica's state, as rank 0 last reported it
        self.stopping: str | None = None
        self.exit_code = 0
        self.recoveries: list[dict[str, Any]] = []
        self.fault_history: list[FaultRecord] = []
        self.start_failures: dict[int, int] = {}  # rank -> its processes in a row that died before joining
        self._early_spare_deaths = 0
        self._fired_at: float | None = None  # wall time the last injected fault fired
        self._last_target: int | None = None
        self._same_target = 0
        self.hosts: dict[int, HostState] = {}  # agent id -> its host (one machine: host 0 only)
        self.table = TableKeeper()  # the root-less peer table as the members hold it
        self._table_msgs: tuple[int, list[PeerTable]] = (0, [])
        self.started = False
        self._out: list[Command] = []
        rule = StragglerRule(cfg.straggler_ratio, cfg.straggler_window) if cfg.straggler_ratio else None
        self.stragglers = StragglerWatch(rule) if rule is not None else None
        self._hinted: dict[int, int] = {}  # spare worker id -> the step of its last Prefetch

    # -- the shell's interface ----------------------------------------------------------------
    def drain(self) -> list[Command]:
        out, self._out = self._out, []
        return out

    def add_host(self, host: int, address: str, remote: bool, now: float, order: int = -1) -> None:
        """An agent joined. Before the start it is counted for placement; after it, it is a spare
        host (a healed host too: it never gets its old ranks back, they have moved on)."""
        self.hosts[host] = HostState(host, address, remote, now, order)
        self._emit("host_joined", host=host, address=address, spare=self.started)
        if self.started and self.stopping is None and self.round is None:
            self._refill_spares(now)

    def on_agent_seen(self, host: int, now: float) -> None:
        h = self.hosts.get(host)
        if h is not None:
            h.last_seen = now

    def host_alive(self, host: int) -> bool:
        h = self.hosts.get(host)
        return h is not None and not h.lost

    def on_host_lost(self, host: int, why: str, now: float, wall: float) -> None:
        """An agent went away (its connection closed, or its lease ran out): every process of
        its host counts as dead, and nothing from that host is accepted again."""
        self._guarded(self._host_lost, host, why, now, wall)

    def _host_lost(self, host: int, why: str, now: float, wall: float) -> None:
        h = self.hosts.get(host)
        if h is None or h.lost:
            return
        h.lost = True
        lost = sorted(wid for wid, m in self.procs.items() if m.host == host)
        ranks = sorted(m.rank for m in self.procs.values() if m.host == host and m.rank is not None)
        self._emit("host_lost", host=host, address=h.address, why=why, ranks=ranks, processes=len(lost))
        self._log("warning", f"host {h.address} (agent {host}) lost: {why}; ranks {ranks} move to spares")
        for wid in lost:
            self._exited(wid, -9, False, f"host {h.address} lost: {why}", "", now, wall)

    def start(self, now: float) -> None:
        """Launch: the initial round, and one process per rank (spares come once it has formed)."""
        if not self.hosts:  # one machine: the embedded agent is host 0
            self.hosts[0] = HostState(0, self.cfg.host, False, now)
        agents = [(h.host, h.order) for h in self.hosts.values()]
        nodes, _spares = assign_hosts(agents, self.cfg.nnodes, self.cfg.spare_nodes)
        by_node = {node: host for host, node in nodes.items()}
        for host, node in nodes.items():
            self.hosts[host].node_rank = node
        self._emit(
            "placement",
            nodes={str(n): self.hosts[h].address for n, h in sorted(by_node.items())},
            spare_hosts=[self.hosts[h].address for h in _spares],
        )
        self.started = True
        self.round = Round(target=0, initial=True, started=now)
        for rank in range(self.cfg.nproc):
            m = self._spawn("worker", now, host=by_node[placement(rank, self.cfg.per_node).node_rank])
            assert m is not None
            m.rank = rank
            self.ranks[rank] = m

    def on_started(self, worker_id: int, store_address: str) -> None:
        m = self.procs.get(worker_id)
        if m is not None:
            m.store_address = store_address

    def on_connected(self, worker_id: int, now: float) -> bool:
        """A connection said hello as ``worker_id``; False if no such process is expected."""
        m = self.procs.get(worker_id)
        if m is None or m.connected:
            return False
        m.connected = True
        m.last_message = now
        if m.role == "worker" and m.rank is not None:
            self._assign(m, m.rank, 0, now)
        return True

    def on_beats(self, host: int, beats: list[WorkerBeat], now: float) -> None:
        """An agent's aggregated heartbeat: each entry counts as that worker's own ``Heartbeat``,
        received ``age`` seconds before ``now`` (only for processes of that agent's host)."""
        for b in beats:
            m = self.procs.get(b.worker_id)
            if m is None or m.host != host:
                continue
            at = max(now - b.age, m.last_message)
            self._apply_heartbeat(m, at, b.step, b.progress_age, b.in_collective, b.step_time, b.busy_time)

    def on_closed(self, worker_id: int) -> None:
        m = self.procs.get(worker_id)
        if m is not None:
            m.connected = False

    def on_message(self, worker_id: int, msg: Message, now: float, wall: float) -> None:
        self._guarded(self._handle, worker_id, msg, now, wall)

    def on_exit(
        self, worker_id: int, code: int, own_failure: bool, detail: str, tail: str, now: float, wall: float
    ) -> None:
        self._guarded(self._exited, worker_id, code, own_failure, detail, tail, now, wall)

    def on_verdict(self, worker_id: int, why: str, now: float) -> None:
        """The agent's process-table reading says this process must go (stopped, wedged)."""
        m = self.procs.get(worker_id)
        if m is not None and m.killed_for is None and not m.exited:
            who = f"rank {m.rank}" if m.rank is not None else f"{m.role} {m.worker_id}"
            self._log("warning", f"{who} {why}; killing it")
            self._kill(m, why)

    def tick(self, now: float, wall: float) -> None:
        """Time passed: judge hangs, move the round on, notice the end of the job."""
        self._guarded(self._tick, now, wall)

    def on_signal(self, name: str, code: int) -> None:
        self._stop(f"launcher received {name}; stopping the job", code)

    def fail(self, why: str) -> None:
        """The shell hit an error it cannot recover from (a launcher bug, a spawn that failed)."""
        self._stop(why, 1)

    def live_connected(self) -> list[int]:
        return [m.worker_id for m in self.procs.values() if m.connected and not m.exited]

    # -- plumbing -----------------------------------------------------------------------------
    def _guarded(self, fn: Any, *args: Any) -> None:
        if self.stopping is not None:
            return
        try:
            fn(*args)
        except NotRecoverableError as e:
            self._stop(str(e), 1)

    def _log(self, level: str, text: str) -> None:
        self._out.append(Log(level, text))

    def _emit(self, event: str, **fields: Any) -> None:
        self._out.append(Emit(event, fields))

    def _send(self, m: Member, msg: Message) -> None:
        if m.connected and not m.exited:
            self._out.append(Send(m.worker_id, msg))

    def _spawn(self, role: str, now: float, host: int | None = None) -> Member | None:
        """Start a process; a spare goes to a spare host (None when no live host may take one)."""
        if host is None:
            host = self._spare_host()
            if host is None:
                self._log("warning", "no live spare host left for a new spare; the job runs without it")
                return None
        wid = self.next_worker_id
        self.next_worker_id += 1
        m = Member(worker_id=wid, role=role, spawned=now, host=host)
        self.procs[wid] = m
        self._out.append(Spawn(wid, role, host))
        return m

    def _spare_host(self) -> int | None:
        # one pass over the ranks and processes, not one per host: a many-host job spawns a spare
        # host's worth of spares at once, and hosts x ranks per spawn was quadratic in the job size
        ranks = Counter(m.host for m in self.ranks.values())
        procs = Counter(m.host for m in self.procs.values())
        views = [HostView(h.host, ranks[h.host], procs[h.host]) for h in self.hosts.values() if not h.lost]
        return spare_host(views, self.cfg.per_node, single_host=self.cfg.nnodes == 1 and len(self.hosts) == 1)

    def _refill_spares(self, now: float) -> None:
        while self._idle_spares() < self.cfg.spares:
            if self._spawn("spare", now) is None:
                return

    def _kill(self, m: Member, why: str) -> None:
        if not m.exited:
            m.killed_for = why
            self._out.append(Kill(m.worker_id, why, m.host))

    def _assign(self, m: Member, rank: int, generation: int, now: float) -> None:
        m.rank = rank
        m.assigned_at = now
        where = placement(rank, self.cfg.per_node)
        self._send(
            m,
            Assign(
                rank=rank,
                world_size=self.cfg.nproc,
                generation=generation,
                faults=list(self.cfg.faults),
                fired=sorted(self.fired),
                snapshot_every=self.cfg.snapshot_every,
                checkpoint_every=str(self.cfg.checkpoint_every),
                checkpoint_dir=self.checkpoint_dir,
                local_rank=where.local_rank,
                local_world_size=where.local_world_size,
                node_rank=where.node_rank,
                divergence_check=self.cfg.divergence_check,
                buddy_copies=self.cfg.buddy_copies,
            ),
        )

    def _idle_spares(self) -> int:
        return sum(1 for m in self.procs.values() if m.role == "spare" and m.rank is None)

    # -- messages -----------------------------------------------------------------------------
    def _handle(self, worker_id: int, msg: Message, now: float, wall: float) -> None:
        m = self.procs.get(worker_id)
        if m is None:
            return
        m.last_message = now
        if isinstance(msg, Heartbeat):
            self._apply_heartbeat(
                m, now, msg.step, msg.progress_age, msg.in_collective, msg.step_time, msg.busy_time
            )
        elif isinstance(msg, PeerTableRequest):
            self._send_table(m)
        elif isinstance(msg, SpareReady):
            m.ready = True
            self._early_spare_deaths = 0
            self._emit("spare_ready", worker=m.worker_id)
            if self.state_bytes:
                self._send(m, Prepare(self.state_bytes))
        elif isinstance(msg, Fired):
            self.fired.add(msg.id)
            self._fired_at = msg.time
            self._emit("fault_injected", rank=m.rank, id=msg.id, kind=msg.kind, fired_at=msg.time)
        elif isinstance(msg, Stopped):
            self._on_stopped(m, msg, now, wall)
        elif isinstance(msg, Recovered):
            self._on_recovered(m, msg, now)
        elif isinstance(msg, Committed):
            self._on_committed(m, msg, now)
        elif isinstance(msg, Done):
            m.done = True
        elif isinstance(msg, Fatal):
            raise NotRecoverableError(f"rank {m.rank}: {msg.error}")

    @staticmethod
    def _apply_heartbeat(
        m: Member,
        at: float,
        step: int | None,
        progress_age: float | None,
        in_collective: bool,
        step_time: float | None,
        busy_time: float | None = None,
    ) -> None:
        """A heartbeat the worker sent at ``at`` (directly, or published for its agent)."""
        m.last_message = at
        m.in_collective = in_collective
        if progress_age is not None:
            m.progress_known = True
            m.last_progress = at - progress_age
        m.step = step
        if step_time is not None:
            m.step_time = step_time
        if busy_time is not None:
            m.busy_time = busy_time

    def _send_table(self, m: Member) -> None:
        """The whole peer table to one member, in chunks (peer_table.py)."""
        t = self.table
        if t.version == 0:
            return  # no plan yet: its first Recover brings the table
        if self._table_msgs[0] != t.version:  # one set of messages per version, for every member
            msgs = [
                PeerTable(t.version, t.digest, len(t.peers), c.first, c.hosts, c.runs) for c in t.chunks()
            ]
            self._table_msgs = (t.version, msgs)
        for chunk in self._table_msgs[1]:
            self._send(m, chunk)
        if m.connected and not m.exited:  # _send drops what a closed connection cannot take
            t.sent(m.worker_id)

    # -- faults -------------------------------------------------------------------------------
    def _fault(
        self,
        rank: int,
        kind: str,
        detail: str,
        replace: bool,
        now: float,
        wall: float,
        step: int | None = None,
    ) -> None:
        """Record a fault on ``rank`` and make sure a round is handling it."""
        if step is None:  # as the rank last said in a heartbeat (it could not tell us itself)
            step = self.ranks[rank].step if rank in self.ranks else None
        record: dict[str, Any] = {
            "time": wall,
            "event": "fault",
            "job": self.job_id,
            "rank": rank,
            "kind": kind,
            "detail": detail,
            "generation": self.generation,
            "step": step,
        }
        self._emit("fault", **{k: v for k, v in record.items() if k not in ("event", "job")})
        self._log("warning", f"FAULT rank {rank}: {kind} ({detail}) at step {step}")
        record["detected"] = now
        self.fault_history.append(FaultRecord(rank, kind, step, detail))
        why = budget_verdict(self.fault_history, self.cfg.fault_window, self.cfg.max_repeat_faults)
        if why is not None:
            raise NotRecoverableError(why)
        r = self.round
        if r is None or r.phase == "rebuild":
            self._begin_round(record, now)
        else:
            r.faults.append(record)
        assert self.round is not None
        if replace:
            self.round.replace.add(rank)
            self.round.reports.pop(rank, None)

    def _begin_round(self, first_fault: dict[str, Any], now: float) -> None:
        prev = self.round
        target = (prev.target if prev is not None else self.generation) + 1
        # a generation that never formed its first state sync still needs it
        initial = prev is not None and prev.initial
        r = Round(target=target, initial=initial, started=now, abort_sent=now)
        r.faults.append(first_fault)
        if prev is not None:  # a fault while a generation was forming: keep the earlier faults
            r.faults = prev.faults + r.faults
            r.started = prev.started
            r.replace = set(prev.replace)
        self.round = r
        self._flush_pending("superseded by a new fault before every rank committed a step")
        for rank, m in self.ranks.items():
            if rank not in r.replace:
                self._send(m, Abort(generation=target, reason=first_fault["detail"]))

    def _exited(
        self, worker_id: int, code: int, own_failure: bool, detail: str, tail: str, now: float, wall: float
    ) -> None:
        m = self.procs.pop(worker_id, None)
        if m is None:
            return
        m.exited = True
        m.exit_code = code
        self.table.forget(worker_id)
        m.connected = False
        if m.rank is None or self.ranks.get(m.rank) is not m:
            if m.role == "spare":
                self._spare_lost(m, code, own_failure, detail, tail, now)
            return
        if m.done:
            if code != 0:  # its work was complete: the final barrier had passed everywhere
                self._log("warning", f"rank {m.rank} exited with code {code} after finishing")
            return
        if m.killed_for is not None:
            kind = "hang"
        elif code < 0:
            kind = "killed"
        else:
            kind = "exit"
        if not m.joined and own_failure:
            self._start_failed(m.rank, detail, tail)
        self._fault(m.rank, kind, detail, True, now, wall)

    def _spare_lost(
        self, m: Member, code: int, own_failure: bool, detail: str, tail: str, now: float
    ) -> None:
        self._emit("spare_lost", worker=m.worker_id, code=code)
        if not m.ready and own_failure:
            self._early_spare_deaths += 1
        elif m.ready:
            self._early_spare_deaths = 0
        if self._early_spare_deaths >= self.cfg.max_start_failures:
            raise NotRecoverableError(
                f"{self._early_spare_deaths} spare processes in a row failed before they were ready "
                f"(last: {detail}); the script fails before or inside checkpointless.init(), so every "
                "replacement would too. Fix what its output shows" + (f":\n{tail}" if tail else "")
            )
        self._log("warning", f"spare {m.worker_id} exited (code {code}); starting another")
        self._refill_spares(now)

    def _start_failed(self, rank: int, detail: str, tail: str) -> None:
        """A process died before it ever joined as its rank: count it against a respawn loop."""
        n = self.start_failures.get(rank, 0) + 1
        self.start_failures[rank] = n
        why = start_failure_verdict(rank, n, self.cfg.max_start_failures, detail, tail)
        if why is not None:
            raise NotRecoverableError(why)

    def _check_hangs(self, now: float, wall: float) -> None:
        if any(m.killed_for and not m.exited for m in self.ranks.values()):
            return  # a culprit is being killed: its exit starts the round; judge nobody meanwhile
        health = []
        for rank, m in self.ranks.items():
            if m.exited or m.killed_for is not None or not m.connected:
                continue  # a process still starting is judged from the process table (the agent)
            progress = m.last_progress if (m.progress_known and self.round is None) else now
            # no step time yet: this process has not finished a step (its first may be compiling)
            health.append(WorkerHealth(rank, m.last_message, progress, m.in_collective, m.step_time is None))
        times = [m.step_time for m in self.ranks.values() if m.step_time is not None]
        limit = progress_limit(self.cfg.hang_timeout, self.cfg.hang_factor, times)
        r = self.round
        if r is not None and r.phase == "collect" and not r.initial:
            # a member that keeps its heartbeat but never leaves its step after the abort (a busy
            # loop) holds the round up: it is hung like a process that stopped
            for rank, m in self.ranks.items():
                waiting = rank not in r.reports and rank not in r.replace and m.connected
                if waiting and now - max(r.abort_sent, m.assigned_at) > limit:
                    why = f"did not leave its step within {limit:.1f} s of the abort"
                    self._log("warning", f"rank {rank} {why}; killing it")
                    self._kill(m, why)
                    return
        first = first_step_limit(limit, self.cfg.first_step_timeout)
        culprits, why = find_hung(health, now, self.cfg.hang_timeout, limit, first)
        if not culprits and why and self.round is None:
            # everyone waits for everyone (a lost message, a wedged link): nobody to replace,
            # but the collective will never finish; rebuild the communicator with the same ranks
            self._fault(min(h.rank for h in health), "stall", why, False, now, wall)
            return
        for rank in culprits:
            self._log("warning", f"rank {rank} is hung: {why}; killing it")
            self._kill(self.ranks[rank], why)

    # -- rounds -------------------------------------------------------------------------------
    def _on_stopped(self, m: Member, msg: Stopped, now: float, wall: float) -> None:
        rank = m.rank
        if rank is None or self.ranks.get(rank) is not m:
            return
        gen = msg.for_generation
        r = self.round
        if r is not None and r.phase == "rebuild" and gen <= r.target and msg.cause != "recovery":
            return  # a duplicate of a report this round already has
        if r is None and gen <= self.generation:
            return  # stale: about a generation that has already formed
        if r is None or r.phase == "rebuild":
            # a rank stopped by itself: that is a fault (its own exception, a failed collective
            # or a failed recovery step) unless a round already covers it
            kind = msg.cause if msg.cause in ("exception", "recovery") else "comm"
            self._fault(rank, kind, str(msg.error), False, now, wall, step=msg.step)
        r = self.round
        assert r is not None
        if gen != r.target or r.phase != "collect":
            return
        r.reports[rank] = MemberReport(
            rank,
            msg.committed_step,
            msg.valid,
            msg.snapshot_step,
            msg.checkpoint_step,
            mesh=(msg.mesh[0], msg.mesh[1]) if msg.mesh and len(msg.mesh) == 2 else None,
            copies=tuple((c[0], c[1]) for c in msg.copies if len(c) == 2),
            own_snapshots=tuple(msg.own_snapshots),
        )
        r.report_times[rank] = now

    def _advance_round(self, now: float) -> None:
        r = self.round
        if r is None or r.phase != "collect":
            return
        if r.replace:
            self._replace(r, sorted(r.replace), now)
            return
        if len(r.reports) < self.cfg.nproc:
            if now - r.started > self.cfg.recovery_timeout:
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
        plan_json = plan.to_json()
        # one Recover for every member, and of a size that does not grow with the job: the plan's
        # rank lists as ranges, the peer table as a delta (peer_table.py). A member that does not
        # hold the version the delta applies to gets the full table first, in chunks.
        rootless, t = self.rendezvous["kind"] == "rootless", self.table
        if rootless:
            t.update([self.ranks[k].store_address for k in range(self.cfg.nproc)])
        msg = Recover(
            generation=r.target,
            rendezvous=dict(self.rendezvous),
            plan=compact_plan(plan_json),
            table_version=t.version if rootless else -1,
            table_base=t.base if rootless else -1,
            table_digest=t.digest if rootless else "",
            moved_ranks=[rank for rank, _ in t.moved],
            moved_to=[address for _, address in t.moved],
        )
        for m in self.ranks.values():
            if rootless and t.needs_full(m.worker_id):
                self._send_table(m)
            elif m.connected and not m.exited:
                t.sent(m.worker_id)
            self._send(m, msg)
        r.phase = "rebuild"
        r.plan_sent = now
        self._emit("plan", generation=r.target, **plan_json)

    def _replace(self, r: Round, ranks: list[int], now: float) -> None:
        spares = [m for m in self.procs.values() if m.role == "spare" and m.rank is None]
        pool = [(m.worker_id, m.host) for m in spares if m.ready and m.connected]
        ready = [self.procs[wid] for wid in pick_spares(len(ranks), pool)]
        starting = [m for m in spares if not m.ready]
        if r.waiting_since is None:
            r.waiting_since = now
        d = spare_policy(len(pool), len(starting), len(ranks), now - r.waiting_since, self.cfg.spare_wait)
        if d.action == SpareAction.FAIL:
            raise NotRecoverableError(d.reason)
        for _ in range(d.spawn):
            self._log(
                "warning",
                f"no hot spare ready for rank(s) {ranks}; starting one (waits up to {self.cfg.spare_wait:.0f} s)",
            )
            self._spawn("spare", now)
        if d.action == SpareAction.WAIT and not ready:
            return
        for rank, spare in zip(ranks, ready, strict=False):
            old = self.ranks.get(rank)
            if old is not None:
                self._kill(old, old.killed_for or "replaced")
            self.ranks[rank] = spare
            self._assign(spare, rank, r.target, now)
            r.replace.discard(rank)  # settled once the spare reports; re-added if it dies first
            self._emit("spare_assigned", rank=rank, worker=spare.worker_id, generation=r.target)
            self._log("info", f"spare {spare.worker_id} takes rank {rank}")
            self._refill_spares(now)  # refill the pool in the background
        r.waiting_since = None

    def _on_recovered(self, m: Member, msg: Recovered, now: float) -> None:
        r = self.round
        if r is None or r.phase != "rebuild" or msg.generation != r.target or m.rank is None:
            return
        r.recovered[m.rank] = {**msg.timings, "time": now}
        m.joined = True
        self.start_failures.pop(m.rank, None)
        if len(r.recovered) < self.cfg.nproc:
            return
        self.generation = r.target
        self.round = None
        for member in self.ranks.values():
            member.last_progress = now  # the hang clock restarts with the new generation
        if r.initial:
            self._log("info", f"generation {r.target} formed in {now - r.started:.2f} s after launch")
            self._emit("started", generation=r.target, seconds=now - r.started)
            self._refill_spares(now)
            return
        self.pending = r
        self.first_commits = {}
        self.first_batches = {}

    def _on_committed(self, m: Member, msg: Committed, now: float) -> None:
        size = msg.state_bytes
        if size is not None and size > self.state_bytes:
            # spares page in room for this much state while they wait (see state/arena.py)
            self.state_bytes = size
            for spare in self.procs.values():
                if spare.role == "spare" and spare.rank is None and spare.ready:
                    self._send(spare, Prepare(size))
        pend = self.pending
        if pend is None or m.rank is None or msg.generation != self.generation:
            return
        self.first_commits[m.rank] = now
        if msg.first_batch_s is not None:
            self.first_batches[m.rank] = msg.first_batch_s
        if len(self.first_commits) < self.cfg.nproc:
            return
        self.pending = None
        self._report_recovery(pend, max(self.first_commits.values()))

    def _flush_pending(self, why: str) -> None:
        """Report a recovery whose first step never completed everywhere: every round that formed
        a generation is counted and reported, even when the job ended (or another fault came)
        before its first step did."""
        pend, self.pending = self.pending, None
        if pend is not None:
            self._report_recovery(pend, None, why)

    def _report_recovery(
        self, r: Round, first_step_done: float | None, incomplete: str | None = None
    ) -> None:
        fields, summary, used_fired = recovery_fields(
            r, first_step_done, self.first_batches, self._fired_at, incomplete
        )
        if used_fired:
            self._fired_at = None
        self._emit("recovery", **fields)
        self.recoveries.append(fields)
        self._log("info", summary)

    # -- time ---------------------------------------------------------------------------------
    def _tick(self, now: float, wall: float) -> None:
        for h in list(self.hosts.values()):
            if h.remote and not h.lost and now - h.last_seen > self.cfg.lease:
                self._host_lost(
                    h.host, f"no word from its agent for {self.cfg.lease:.1f} s (lease)", now, wall
                )
        self._check_hangs(now, wall)
        if self.stopping is None:
            self._check_stragglers(now, wall)
            self._hint_spares()
        if self.stopping is None:
            self._advance_round(now)
        if self.stopping is None:
            self._check_done()

    def _hint_spares(self) -> None:
        """Tell each idle spare on a spare host the job's step and the ranks it may take, once
        per step, so that it fills its own host's batch cache for them (data/spare_cache.py)."""
        if self.round is not None or self.cfg.nnodes < 2 or not self.ranks:
            return
        steps = [m.step for m in self.ranks.values()]
        if any(s is None for s in steps):
            return
        step = min(s for s in steps if s is not None)
        self._hinted = {w: s for w, s in self._hinted.items() if w in self.procs}  # forget the gone
        holding = {m.host for m in self.ranks.values()}
        by_host: dict[int, list[Member]] = {}
        for m in self.procs.values():
            if m.role == "spare" and m.rank is None and m.ready and m.host not in holding:
                by_host.setdefault(m.host, []).append(m)
        for spares in by_host.values():
            for i, m in enumerate(sorted(spares, key=lambda m: m.worker_id)):
                ranks = slot_ranks(i, self.cfg.per_node, self.cfg.nnodes)
                if ranks and self._hinted.get(m.worker_id) != step:
                    self._hinted[m.worker_id] = step
                    self._send(m, Prefetch(step=step, ranks=ranks, world_size=self.cfg.nproc))

    def _check_stragglers(self, now: float, wall: float) -> None:
        """Report a host whose ranks are persistently slower than the others (the rule is
        coordinator/stragglers.py); with --swap-stragglers, move its ranks to a spare host by the
        host-loss path: its workers are killed, the host is fenced, spares take the ranks."""
        watch = self.stragglers
        if watch is None:
            return
        if self.round is not None or self.pending is not None:
            watch.reset()  # the members are changing: a window must not span a recovery
            return
        timings = [RankTiming(m.host, r, m.step, m.busy_time) for r, m in self.ranks.items()]
        for v, ranks in watch.observe(timings):
            h = self.hosts[v.host]
            if not v.reported:
                self._emit("straggler_cleared", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio)
                self._log("info", f"host {h.address} (ranks {ranks}) is no longer a straggler")
                continue
            window = [round(x, 3) for x in v.window]
            self._emit("straggler", host=v.host, address=h.address, ranks=ranks, ratio=v.ratio, window=window)
            self._log(
                "warning",
                f"straggler host {h.address} (agent {v.host}, ranks {ranks}): busy {v.ratio:.2f}x the "
                f"other hosts' over the last {len(window)} steps",
            )
            if not self.cfg.swap_stragglers:
                continue
            idle = [m for m in self.procs.values() if m.role == "spare" and m.rank is None and m.ready]
            spares = [(m.worker_id, m.host) for m in idle if m.connected]
            if not h.remote or len(pick_spares(len(ranks), spares)) < len(ranks):
                self._log("warning", f"not moving ranks {ranks}: no spare host ready for all of them")
                continue
            why = f"straggler host: busy {v.ratio:.2f}x the others; its ranks move to a spare host"
            self._emit("straggler_swap", host=v.host, address=h.address, ranks=ranks)
            # Kill, not _kill: these are moved, not hung; the host-loss path counts them as killed
            for m in [m for m in self.procs.values() if m.host == v.host]:
                self._out.append(Kill(m.worker_id, why, m.host))
            self._host_lost(v.host, why, now, wall)
            return

    def _check_done(self) -> None:
        if self.round is not None or not self.ranks:
            return
        if all(m.done and m.exited for m in self.ranks.values()):
            failed = sorted(r for r, m in self.ranks.items() if m.exit_code != 0)
            if failed:
                # training finished everywhere, but the script failed after its loop (saving?)
                self._log(
                    "error",
                    f"training finished, but rank(s) {failed} failed after the loop; see their output",
                )
            self._flush_pending("the job ended before every rank committed a step after it")
            faults = len(self.fault_history)
            self._emit(
                "job_end", status="failed" if failed else "ok", recoveries=len(self.recoveries), faults=faults
            )
            self._log("info", f"job finished: {len(self.recoveries)} recoveries from {faults} faults")
            self._end("done", 1 if failed else 0)

    def _stop(self, why: str, code: int) -> None:
        if self.stopping is not None and self.exit_code:
            return
        self._flush_pending("the job stopped")
        self._log("error", why)
        self._emit(
            "job_end",
            status="failed",
            error=why,
            code=code,
            recoveries=len(self.recoveries),
            faults=len(self.fault_history),
        )
        self._end(why, code)

    def _end(self, why: str, code: int) -> None:
        self.stopping = why
        self.exit_code = code
        for m in self.procs.values():
            self._send(m, Shutdown(code=0 if code == 0 else 1, reason=why))
        self._out.append(Stop(code, why))
