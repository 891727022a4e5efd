"""The coordinator: the job's decisions, as a state machine with events in and commands out.

It owns the ranks, the generations, the recovery rounds, the spare pool, hang and stall
decisions and the fault budget. It touches no socket, process or clock: the shell around it
(``launcher/launcher.py`` for one machine, its loop in ``launcher/loop.py``) feeds it what it
observed — a worker's message, a process exit, a process-table verdict, the passing of time — and
carries out the commands it queues (:mod:`checkpointless.coordinator.state`): start or kill a
process, send a message, write an event, log a line, stop the job. The rules themselves are pure
functions in ``coordinator/rules/``.

This class is a façade over components, each owning its own state and given its collaborators
explicitly: :class:`Members` (hosts, processes, ranks), :class:`Outbox` (the commands out),
:class:`FaultLedger` (faults, budgets, recoveries), :class:`SparePool`, :class:`TableDelivery`
(the peer table), :class:`Rounds` (the generation and its recovery round), :class:`Losses`
(exits, lost hosts, hangs), :class:`StragglerMoves`, :class:`MessageRouter` (the workers'
messages) and :class:`JobEnd` (the job's end: finished everywhere, or stopped). It routes the
shell's events to them.

A round, in brief: a fault aborts the current generation (``Abort`` to every member), dead or hung
ranks are replaced by ready spares (``Assign``), every member reports its state (``Stopped``), the
plan goes out (``Recover``), and once every rank has ``Recovered`` the new generation has formed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointless.coordinator.ending import JobEnd
from checkpointless.coordinator.health import HostQuarantine
from checkpointless.coordinator.holders import SlotHolders
from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.losses import Losses
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.messages import MessageRouter, apply_heartbeat
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rounds import Rounds
from checkpointless.coordinator.rules.placement import assign_hosts, placement
from checkpointless.coordinator.rules.stragglers import StragglerRule, StragglerWatch
from checkpointless.coordinator.spares import SparePool
from checkpointless.coordinator.state import Command, HostState, Member, Round
from checkpointless.coordinator.tables import TableDelivery
from checkpointless.coordinator.watch import StragglerMoves
from checkpointless.errors import NotRecoverableError
from checkpointless.protocol import HealthReport, Message
from checkpointless.settings import JobSettings as LaunchConfig

if TYPE_CHECKING:
    from checkpointless.protocol.beats import WorkerBeat

__all__ = ["JUDGE_EVERY_S", "Coordinator"]

JUDGE_EVERY_S = 0.25  # how often hangs are judged and spares hinted (seconds of the shell's clock)
# A process that ended itself (an exit code, not a signal) while connected waits this long at most
# for its connection's end: the process table can show the exit before the connection's last frames
# have been read, and those decide what the exit was (a Done: a finished rank, not a fault; a Fatal:
# the job's end, not a recovery). The worker closes its copy of the socket in forked children, so
# the connection ends with the process; the grace covers anything else holding it open.
EXIT_GRACE_S = 1.0


class Coordinator:
    def __init__(
        self, cfg: LaunchConfig, job_id: str, rendezvous: dict[str, Any], checkpoint_dir: str = ""
    ) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.rendezvous = rendezvous
        self.checkpoint_dir = checkpoint_dir  # where durable checkpoints go ("" when they are off)
        self.started = False
        self.outbox = Outbox()
        self.members = Members(self.outbox)
        self.ledger = FaultLedger(cfg, self.outbox)
        self.health = HostQuarantine(cfg, self.members, self.outbox)  # health-gated admission
        # degraded mode: the lost slots survivors hold (holders.py), which the rounds keep and
        # the spare pool starts spares for
        holders = SlotHolders()
        self.spares = SparePool(cfg, self.members, self.outbox, self.health, holders)
        self.tables = TableDelivery(self.members, self.outbox)
        self.rounds = Rounds(
            cfg,
            job_id,
            rendezvous,
            checkpoint_dir,
            self.members,
            self.outbox,
            self.ledger,
            self.spares,
            self.tables,
            holders,
        )
        self.ending = JobEnd(self.members, self.outbox, self.ledger, self.rounds)
        self.losses = Losses(
            cfg, self.members, self.outbox, self.ledger, self.spares, self.tables, self.rounds
        )
        self.router = MessageRouter(self.members, self.outbox, self.ledger, self.tables, self.rounds)
        rule = StragglerRule(cfg.straggler_ratio, cfg.straggler_window) if cfg.straggler_ratio else None
        self.stragglers = StragglerWatch(rule) if rule is not None else None
        self.moves = (
            StragglerMoves(cfg, self.stragglers, self.members, self.outbox, self.losses)
            if self.stragglers is not None
            else None
        )
        self._judged_at = float("-inf")  # when hangs were last judged (and spares hinted)
        # worker id -> (deadline, the exit's arguments): exits waiting for their connection's end
        self._held_exits: dict[int, tuple[float, tuple[Any, ...]]] = {}

    # -- the components' state, as the shell and the tests read it ---------------------------
    @property
    def stopping(self) -> str | None:
        """Why the job is ending (None while it runs)."""
        return self.ending.stopping

    @property
    def exit_code(self) -> int:
        return self.ending.exit_code

    @property
    def procs(self) -> dict[int, Member]:
        return self.members.procs

    @property
    def ranks(self) -> dict[int, Member]:
        return self.members.ranks

    @property
    def hosts(self) -> dict[int, HostState]:
        return self.members.hosts

    @property
    def next_worker_id(self) -> int:
        return self.members.next_worker_id

    @next_worker_id.setter
    def next_worker_id(self, value: int) -> None:
        self.members.next_worker_id = value

    @property
    def generation(self) -> int:
        return self.rounds.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self.rounds.generation = value

    @property
    def round(self) -> Round | None:
        return self.rounds.round

    @round.setter
    def round(self, value: Round | None) -> None:
        self.rounds.round = value

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return self.ledger.recoveries

    # -- the shell's interface ----------------------------------------------------------------
    def drain(self) -> list[Command]:
        return self.outbox.drain()

    def add_host(self, host: int, address: str, remote: bool, now: float, order: int = -1) -> None:
        """An agent joined. Before the start it is counted for placement; after it, it is a spare
        host (a healed host too: it never gets its old ranks back, they have moved on)."""
        self.hosts[host] = HostState(host, address, remote, now, order)
        self.outbox.emit("host_joined", host=host, address=address, spare=self.started)
        if self.started and self.stopping is None:
            if self.round is None:
                self.spares.refill(now)
            else:
                # not while the round places spares of its own; once it has formed (the pool may
                # have had no host to refill onto until this one came)
                self.rounds.refill_after_round = True

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
        self._guarded(self.losses.host_lost, host, why, now, wall)

    def on_host_health(self, host: int, msg: HealthReport, now: float) -> None:
        """An agent's health report (coordinator/health.py): a host quarantined or re-admitted
        moves the spare pool (spares of a quarantined host do not count towards --spares)."""
        if (
            self.health.on_report(host, msg, now)
            and self.started
            and self.stopping is None
            and self.round is None
        ):
            self.spares.refill(now)

    def start(self, now: float) -> None:
        """Launch: the initial round, and one process per rank (spares come once it has formed)."""
        if not self.hosts:  # one machine: the embedded agent is host 0
            self.hosts[0] = HostState(0, self.cfg.host, False, now)
        # a host quarantined already (its first checks failed) is placed last, without its order
        # hint: a spare host if enough others joined. An agent lost before the start is not
        # placed at all: on a loaded machine an agent whose welcome came late hangs up and joins
        # again as a new agent with the same --node-order, which is the same host, not a clash.
        live = [h for h in self.hosts.values() if not h.lost]
        agents = [(h.host, h.order) for h in live if not self.health.quarantined(h.host)]
        agents += [(h.host, -1) for h in live if self.health.quarantined(h.host)]
        nodes, _spares = assign_hosts(agents, self.cfg.nnodes, self.cfg.spare_nodes)
        by_node = {node: host for host, node in nodes.items()}
        for host, node in nodes.items():
            self.hosts[host].node_rank = node
        self.outbox.emit(
            "placement",
            nodes={str(n): self.hosts[h].address for n, h in sorted(by_node.items())},
            spare_hosts=[self.hosts[h].address for h in _spares],
        )
        self.started = True
        self.round = Round(target=0, initial=True, started=now)
        for rank in range(self.cfg.nproc):
            m = self.members.spawn("worker", now, by_node[placement(rank, self.cfg.per_node).node_rank])
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
        m.connected = m.greeted = True
        m.last_message = now
        if m.role == "worker" and m.rank is not None:
            self.rounds.assign(m, m.rank, 0, now, initial=True)
        return True

    def awaits_late_hello(self, worker_id: int) -> bool:
        """Whether ``worker_id`` is a spare that was still starting at a coordinator failover,
        kept by the rebuild (rules/rebuild.py): its hello comes after the takeover, as a reconnect."""
        m = self.procs.get(worker_id)
        return (
            m is not None
            and m.role == "spare"
            and m.rank is None
            and not m.connected
            and not m.exited
            and m.killed_for is None
        )

    def on_beats(self, host: int, beats: list[WorkerBeat], now: float) -> None:
        """An agent's aggregated heartbeat: each entry counts as that worker's own ``Heartbeat``,
        received ``age`` seconds before ``now`` (only for processes of that agent's host)."""
        for b in beats:
            m = self.procs.get(b.worker_id)
            if m is None or m.host != host:
                continue
            at = max(now - b.age, m.last_message)
            apply_heartbeat(m, at, b.step, b.progress_age, b.in_collective, b.step_time, b.busy_time)

    def on_closed(self, worker_id: int) -> None:
        """The worker's control connection ended: every frame it sent has been handled."""
        m = self.procs.get(worker_id)
        if m is not None:
            m.connected = False
        held = self._held_exits.pop(worker_id, None)
        if held is not None:
            self._guarded(self.losses.process_exited, *held[1])

    def on_message(self, worker_id: int, msg: Message, now: float, wall: float) -> None:
        self._guarded(self.router.handle, worker_id, msg, now, wall)

    def on_exit(
        self, worker_id: int, code: int, own_failure: bool, detail: str, tail: str, now: float, wall: float
    ) -> None:
        args = (worker_id, code, own_failure, detail, tail, now, wall)
        m = self.procs.get(worker_id)
        if code >= 0 and m is not None and m.connected and not m.done:
            # Its last frames may still be unread: decide once its connection has ended (or the
            # grace ran out). A killed process (a signal) had no last words: no wait for it.
            self._held_exits[worker_id] = (now + EXIT_GRACE_S, args)
            return
        self._guarded(self.losses.process_exited, *args)

    def on_verdict(self, worker_id: int, why: str, now: float) -> None:
        """The agent's process-table reading says this process must go (stopped, wedged)."""
        m = self.procs.get(worker_id)
        if m is not None and m.killed_for is None and not m.exited:
            who = f"rank {m.rank}" if m.rank is not None else f"{m.role} {m.worker_id}"
            self.outbox.log("warning", f"{who} {why}; killing it")
            self.outbox.kill(m, why)

    def tick(self, now: float, wall: float) -> None:
        """Time passed: judge hangs, move the round on, notice the end of the job."""
        self._guarded(self._tick, now, wall)

    def on_signal(self, name: str, code: int) -> None:
        self.ending.stop(f"launcher received {name}; stopping the job", code)

    def fail(self, why: str) -> None:
        """The shell hit an error it cannot recover from (a launcher bug, a spawn that failed)."""
        self.ending.stop(why, 1)

    def settled(self) -> bool:
        """Nothing in flight: started, no round, no exit waiting for its connection's end. O(1):
        the shell asks on every loop turn, and a walk of every member would cost milliseconds a
        turn at tens of thousands of ranks. (A spare that dies while it starts has no connection
        to wake the loop; waitpid sees it on the next turn, 0.1 s at most.)"""
        return self.started and self.round is None and not self._held_exits

    def live_connected(self) -> list[int]:
        return self.members.live_connected()

    # -- plumbing -----------------------------------------------------------------------------
    def _guarded(self, fn: Any, *args: Any) -> None:
        if self.stopping is not None:
            return
        try:
            fn(*args)
        except NotRecoverableError as e:
            # a job that fails while hosts sit in quarantine (the only spare host, say) says so
            note = self.health.note()
            self.ending.stop(f"{e}; {note}" if note else str(e), 1)

    def _tick(self, now: float, wall: float) -> None:
        for wid, (deadline, args) in list(self._held_exits.items()):
            if now >= deadline:  # its connection outlived it (a forked child holds the socket)
                del self._held_exits[wid]
                self.losses.process_exited(*args)
        for h in list(self.hosts.values()):
            if h.remote and not h.lost and now - h.last_seen > self.cfg.lease:
                why = f"no word from its agent for {self.cfg.lease:.1f} s (lease)"
                self.losses.host_lost(h.host, why, now, wall)
        # Judging hangs and hinting spares walk every rank; the shell ticks up to 50 times a second,
        # and at 80k ranks one walk costs ~50-130 ms. Hang limits are seconds long, and a hint
        # covers the next steps, so doing either a quarter second late costs nothing.
        walk = now - self._judged_at >= JUDGE_EVERY_S
        if walk:
            self._judged_at = now
            self.losses.check_hangs(now, wall)
        if self.stopping is None:
            if self.moves is not None:  # samples every step: not rate-limited (off by default)
                self.moves.check(
                    now, wall, self.round is not None or self.rounds.first_steps.round is not None
                )
            if walk and self.round is None:
                self.spares.hint()
        if self.stopping is None:
            # faults count against their hosts before the round hands any rank to a spare
            self.health.note_faults(self.ledger.history, self.ranks)
            self.rounds.advance(now, wall)
        if self.stopping is None:
            self.ending.check_done()
