"""Control-plane scale: the real coordinator driven by thousands of simulated ranks, and a model.

The coordinator (``coordinator/coordinator.py``) is a pure state machine, so this drives it with
no process or socket: H hosts of P ranks plus spare hosts, through

1. start-up: agents join, generation 0 is placed, every rank connects (``Assign``), reports
   ``Stopped``, the plan goes out (``Recover``), every rank reports ``Recovered``, the spares
   start and report ready;
2. steady state: heartbeats from every member, as the workers send them (one each 0.25 s), and
   the shell's ``tick`` (the launcher calls it once per loop pass): CPU time per heartbeat, the
   heartbeats/s one core absorbs, the cost of one tick;
3. a fault round: one host is lost. Coordinator CPU time from ``on_host_lost`` to the ``Recover``
   commands (aborts, spare assignment, every member's ``Stopped``, the plan), and how many
   commands the round produced;
4. the wire for one heartbeat: ``protocol.encode`` + ``wire.encode_frame`` (the worker's side,
   sealed with the c2s key) and ``FrameDecoder.feed`` + ``protocol.decode`` (the coordinator's);
   and for one agent's ``AgentHeartbeat`` carrying its 8 workers' beats (``protocol/beats.py``):
   the frame path, ``beats_of``, and ``Coordinator.on_beats`` per row;
5. the largest control frame of each message type the coordinator sent (start-up and the fault
   round, ``PeerTable`` chunks included), sealed as the launcher seals it, against the worker's
   ``MAX_CONTROL_HEADER``.

Every figure is process CPU time (``time.process_time``): the machine is shared, so wall time
would measure the neighbours. Medians over ``--repeats``. Then a model for 10k hosts x 8 ranks
from the per-event costs, with the heartbeat interval as its parameter.

Run: ``python benchmarks/control_plane.py`` (about a minute on 2 cores, 1k-80k ranks; ``--hosts
4 --repeats 1 --no-write`` for a smoke run). Writes benchmarks/results/control_plane.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import queue
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from checkpointless.coordinator import Coordinator, HostTable, Send, Spawn
from checkpointless.launcher.control import Connection
from checkpointless.launcher.model import LaunchConfig
from checkpointless.protocol import (
    AgentHeartbeat,
    Heartbeat,
    Message,
    PeerTable,
    Recover,
    Recovered,
    SpareReady,
    Stopped,
    decode,
    encode,
)
from checkpointless.protocol.beats import WorkerBeat, beats_message, beats_of
from checkpointless.protocol.control_channel import (
    CLIENT_NONCE_FIELD,
    MAX_CONTROL_HEADER,
    NONCE_FIELD,
    SEQ_FIELD,
)
from checkpointless.wire import FrameDecoder, FrameTooLarge, derive_key, encode_frame

__all__ = ["RunResult", "WireCost", "main", "model", "run_once", "wire_cost"]

RESULTS = Path(__file__).resolve().parent / "results"
HEARTBEAT_S = 0.25  # the workers' heartbeat interval (Heartbeat's docstring in protocol/worker_link.py)
AGENT_BEAT_S = 0.5  # an agent's heartbeat, which carries its workers' beats (agent/remote.py)
MODEL_HOSTS = (1000, 2500, 5000, 10000)
TICKS_PER_S = 50  # the launcher's loop waits at most 0.02 s on its inbox, then ticks


@dataclass
class RunResult:
    """One simulated job: sizes, and the coordinator's CPU seconds per phase."""

    hosts: int
    per_host: int
    spare_hosts: int
    ranks: int
    startup_s: float  # connect + Stopped + plan + Recovered for every rank, spares ready
    plan0_s: float  # the tick that turns generation 0's reports into Recover commands
    heartbeat_us: float  # per heartbeat handled by on_message
    heartbeats_per_core_s: float
    tick_ms: float  # one tick in the steady state (hang judgement walks every rank)
    fault_round_s: float  # on_host_lost .. Recover commands, coordinator CPU only
    fault_host_lost_s: float  # on_host_lost itself (the aborts)
    fault_assign_s: float  # the tick that assigns the ready spares
    fault_reports_s: float  # every member's Stopped
    fault_plan_s: float  # the tick that produces the Recover commands
    fault_commands: int  # commands the round produced, host lost .. plan
    fault_recover_sends: int
    recover_frame_bytes: int  # one Recover on the wire (the fault round's: a delta of 8 ranks)
    recover_seal_ms: float  # protocol.encode + wire.encode_frame of one Recover
    recover_fits_control_cap: bool  # a worker accepts it (header <= MAX_CONTROL_HEADER)
    beat_row_us: float  # Coordinator.on_beats, per worker row (8 rows per call, one per host)
    largest_frames: dict[str, int]  # message type -> its largest sealed frame, bytes
    all_fit_control_cap: bool  # every frame sent fits the worker's MAX_CONTROL_HEADER
    table_chunks: int  # PeerTable chunks in the full table (what a new member receives)
    table_bytes: int = 0  # the whole table of generation 0 as sealed frames
    startup_tables_to_hosts: int = 0  # whole tables sent at start-up to hosts' agents ...
    startup_tables_to_members: int = 0  # ... and to single members


def _config(hosts: int, per_host: int, spare_hosts: int) -> LaunchConfig:
    # LaunchConfig.validate() caps one *machine* at 1024 processes; a many-host job is the
    # coordinator's business only, so the config is built without it (as the tests do)
    return LaunchConfig(
        script="train.py",
        nproc=hosts * per_host,
        spares=spare_hosts * per_host,
        nnodes=hosts,
        nproc_per_node=per_host,
        spare_nodes=spare_hosts,
        local_agent=False,
        hang_timeout=1e6,  # no rank is judged hung: this measures the bookkeeping, not verdicts
        lease=1e6,
    )


class _Shell:
    """Plays the launcher: gives spawned processes an address, counts what comes out."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self.now = 100.0
        self.sent: dict[int, Message] = {}  # distinct messages sent (sized after the timings)
        # whole peer tables sent: to a host's agent (protocol/tables.py) and to single members
        self.tables = {"hosts": 0, "members": 0}

    def flush(self) -> list[Any]:
        out = self.c.drain()
        for cmd in out:
            if isinstance(cmd, Send):
                self.sent.setdefault(id(cmd.message), cmd.message)
                if isinstance(cmd.message, PeerTable) and cmd.message.first == 0:
                    self.tables["members"] += 1
            if isinstance(cmd, HostTable):
                self.tables["hosts"] += 1
                for m in cmd.chunks:
                    self.sent.setdefault(id(m), m)
            if isinstance(cmd, Spawn):
                self.c.on_started(
                    cmd.worker_id, f"10.0.{cmd.host // 256}.{cmd.host % 256}:{30000 + cmd.worker_id}"
                )
        return out

    def msg(self, wid: int, m: Message) -> None:
        self.c.on_message(wid, m, self.now, 1e9 + self.now)

    def tick(self) -> list[Any]:
        self.now += 0.01
        self.c.tick(self.now, 1e9 + self.now)
        return self.flush()


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def run_once(hosts: int, per_host: int = 8, spare_hosts: int = 2, heartbeat_rounds: int = 4) -> RunResult:
    cfg = _config(hosts, per_host, spare_hosts)
    c = Coordinator(cfg, "bench", {"kind": "rootless", "timeout": 60})
    sh = _Shell(c)
    nproc = cfg.nproc

    def startup() -> float:
        for host in range(hosts + spare_hosts):
            c.add_host(host, f"10.0.{host // 256}.{host % 256}", True, sh.now, host)
        c.start(sh.now)
        sh.flush()
        for wid in range(nproc):
            assert c.on_connected(wid, sh.now)
        sh.flush()
        for rank in range(nproc):
            sh.msg(
                c.ranks[rank].worker_id,
                Stopped(for_generation=0, committed_step=0, valid=True, cause="start"),
            )
        sh.flush()
        plan_s, out = _cpu(sh.tick)
        assert sum(isinstance(x, Send) and isinstance(x.message, Recover) for x in out) == nproc
        for rank in range(nproc):
            sh.msg(c.ranks[rank].worker_id, Recovered(generation=0))
        spawns = [x for x in sh.flush() if isinstance(x, Spawn)]
        assert c.generation == 0 and len(spawns) == cfg.spares, (c.generation, len(spawns))
        for s in spawns:
            assert c.on_connected(s.worker_id, sh.now)
            sh.msg(s.worker_id, SpareReady())
        sh.flush()
        return plan_s

    startup_s, plan0_s = _cpu(startup)
    startup_tables = dict(sh.tables)

    members = list(c.procs)
    beat = Heartbeat(step=10, progress_age=0.05, in_collective=True, step_time=0.3)

    def heartbeats() -> None:
        for _ in range(heartbeat_rounds):
            for wid in members:
                c.on_message(wid, beat, sh.now, 1e9 + sh.now)
            sh.now += HEARTBEAT_S

    hb_s, _ = _cpu(heartbeats)
    by_host: dict[int, list[WorkerBeat]] = {}
    for wid in members:
        by_host.setdefault(c.procs[wid].host, []).append(WorkerBeat(wid, 0.1, 10, 0.05, True, 0.3))

    def agent_beats() -> None:
        for _ in range(heartbeat_rounds):
            for host, rows in by_host.items():
                c.on_beats(host, rows, sh.now)
            sh.now += AGENT_BEAT_S

    rows_s, _ = _cpu(agent_beats)
    ticks = 50  # half a second of the shell: two hang judgements among plain ticks
    tick_s, _ = _cpu(lambda: [sh.tick() for _ in range(ticks)])
    heartbeat_us = hb_s / (heartbeat_rounds * len(members)) * 1e6

    # the fault: the last rank host goes away; its ranks move to one spare host
    lost_host = hosts - 1
    lost_s, out = _cpu(lambda: (c.on_host_lost(lost_host, "bench", sh.now, 1e9), sh.flush())[1])
    commands = len(out)
    assign_s, out = _cpu(sh.tick)
    commands += len(out)
    target = c.round.target if c.round is not None else -1

    def reports() -> list[Any]:
        for rank in range(nproc):
            m = c.ranks[rank]
            valid = m.host != lost_host and m.role == "worker"
            sh.msg(
                m.worker_id, Stopped(for_generation=target, committed_step=10 if valid else -1, valid=valid)
            )
        return sh.flush()

    reports_s, out = _cpu(reports)
    commands += len(out)
    plan_s, out = _cpu(sh.tick)
    commands += len(out)
    recovers = [x.message for x in out if isinstance(x, Send) and isinstance(x.message, Recover)]
    recover = len(recovers)
    assert recover == nproc, f"the fault round did not plan: {recover} Recover of {nproc}"
    # the launcher encodes and seals each member's Recover itself: N frames, each naming N peers
    s2c = derive_key(b"bench-secret", "control/s2c")

    def seal() -> bytes:
        for _ in range(4):
            encode_frame(s2c, encode(recovers[0]))
        return encode_frame(s2c, encode(recovers[0]))

    seal_s, frame = _cpu(seal)
    fits = _fits(s2c, frame)
    m_version = max((m.version for m in sh.sent.values() if isinstance(m, PeerTable)), default=-1)
    largest: dict[str, int] = {}
    counted: dict[str, int] = {}
    for m in sh.sent.values():
        # Assigns differ per member only in their digits: size a sample of each type's messages
        if counted.get(m.TYPE, 0) >= 2000 and m.TYPE != "peer_table":
            continue
        counted[m.TYPE] = counted.get(m.TYPE, 0) + 1
        # as Connection.send seals it: the worker's nonce and a sequence number ride along
        size = len(encode_frame(s2c, {**encode(m), NONCE_FIELD: "n" * 32, SEQ_FIELD: 10**9}))
        largest[m.TYPE] = max(largest.get(m.TYPE, 0), size)
    return RunResult(
        hosts=hosts,
        per_host=per_host,
        spare_hosts=spare_hosts,
        ranks=nproc,
        startup_s=startup_s,
        plan0_s=plan0_s,
        heartbeat_us=heartbeat_us,
        heartbeats_per_core_s=1e6 / heartbeat_us,
        tick_ms=tick_s / ticks * 1e3,
        fault_round_s=lost_s + assign_s + reports_s + plan_s,
        fault_host_lost_s=lost_s,
        fault_assign_s=assign_s,
        fault_reports_s=reports_s,
        fault_plan_s=plan_s,
        fault_commands=commands,
        fault_recover_sends=recover,
        recover_frame_bytes=len(frame),
        recover_seal_ms=seal_s / 5 * 1e3,
        recover_fits_control_cap=fits,
        beat_row_us=rows_s / (heartbeat_rounds * len(members)) * 1e6,
        largest_frames=dict(sorted(largest.items())),
        all_fit_control_cap=max(largest.values()) <= MAX_CONTROL_HEADER,
        table_chunks=sum(1 for m in sh.sent.values() if isinstance(m, PeerTable) and m.version == m_version),
        table_bytes=sum(
            len(encode_frame(s2c, {**encode(m), NONCE_FIELD: "n" * 32, SEQ_FIELD: 10**9}))
            for m in sh.sent.values()
            if isinstance(m, PeerTable) and m.version == 1
        ),
        startup_tables_to_hosts=startup_tables["hosts"],
        startup_tables_to_members=startup_tables["members"],
    )


def _fits(key: bytes, frame: bytes) -> bool:
    try:  # the worker reads its control frames with MAX_CONTROL_HEADER as the header cap
        FrameDecoder(key, max_header=MAX_CONTROL_HEADER).feed(frame)
        return True
    except FrameTooLarge:
        return False


@dataclass
class WireCost:
    """Microseconds for one heartbeat on the control channel, each side."""

    frame_bytes: int
    worker_encode_seal_us: float  # protocol.encode + the nonce/sequence fields + HMAC seal (c2s key)
    coordinator_verify_decode_us: float  # Connection: FrameDecoder.feed + accept_frame + protocol.decode
    inbox_us: float  # the reader thread's queue.put + the loop's queue.get (the launcher's inbox)
    # one agent's AgentHeartbeat carrying its 8 workers' beats (protocol/beats.py): verify, JSON and
    # protocol.decode once, beats_of for the rows
    aggregated_frame_bytes: int
    aggregated_verify_decode_us: float


def wire_cost(n: int = 20000) -> WireCost:
    """The launcher's own per-message path (launcher/control.py), minus the socket read."""
    secret = b"bench-secret"
    a, b = socket.socketpair()
    try:
        conn = Connection(a, secret)  # the launcher's end of one worker's connection
        key = derive_key(secret, "control/c2s")
        beat = Heartbeat(step=123456, progress_age=0.0123, in_collective=True, step_time=0.3141)

        def seal() -> list[bytes]:
            # as ControlClient.send frames it: the launcher's nonce, a sequence number, and on
            # the first frame the worker's own nonce
            first = {CLIENT_NONCE_FIELD: "c" * 32}
            return [
                encode_frame(
                    key,
                    {**encode(beat), NONCE_FIELD: conn.nonce, SEQ_FIELD: i + 1, **(first if i == 0 else {})},
                )
                for i in range(n)
            ]

        seal_s, frames = _cpu(seal)

        def verify() -> None:
            for f in frames:
                ((header, _),) = conn.decoder.feed(f)
                decode(conn.accept_frame(header))

        verify_s, _ = _cpu(verify)
        inbox: queue.Queue[tuple[Connection, bytes]] = queue.Queue()

        def through_inbox() -> None:
            for f in frames:
                inbox.put((conn, f))
                inbox.get_nowait()

        inbox_s, _ = _cpu(through_inbox)
        agent_conn = Connection(b, secret)  # an agent's connection: its own nonce and sequence
        rows = [WorkerBeat(w, 0.12, 123456, 0.0123, True, 0.3141) for w in range(8)]
        agent_beat = encode(beats_message(rows, 1.7e9))
        agg_frames = [
            encode_frame(
                key,
                {
                    **agent_beat,
                    NONCE_FIELD: agent_conn.nonce,
                    SEQ_FIELD: i + 1,
                    **({CLIENT_NONCE_FIELD: "a" * 32} if i == 0 else {}),
                },
            )
            for i in range(n // 8)
        ]
        agg = agg_frames[1]

        def aggregated() -> None:
            for f in agg_frames:
                ((header, _),) = agent_conn.decoder.feed(f)
                msg = decode(agent_conn.accept_frame(header))
                assert isinstance(msg, AgentHeartbeat)
                beats_of(msg)

        agg_s, _ = _cpu(aggregated)
    finally:
        a.close()
        b.close()
    return WireCost(
        len(frames[1]),
        seal_s / n * 1e6,
        verify_s / n * 1e6,
        inbox_s / n * 1e6,
        len(agg),
        agg_s / (n // 8) * 1e6,
    )


def _slope(xs: list[float], ys: list[float]) -> float:
    """The exponent k of y ~ x^k, least squares on log-log (1: linear, 2: quadratic)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else 0.0


def model(
    medians: list[RunResult],
    wire: WireCost,
    hosts: int = 10000,
    per_host: int = 8,
    intervals: tuple[float, ...] = (0.25, 0.5, 1.0),
) -> dict[str, Any]:
    """The control plane at ``hosts`` x ``per_host`` ranks, from the measured per-event costs.

    Heartbeats: core-seconds per second of the launcher's loop, per heartbeat interval, for one
    frame per rank (before: every worker heartbeats the coordinator) and one frame per host (now:
    the agent's ``AgentHeartbeat`` carries its workers' rows); and at 1k-10k hosts, before (0.25 s
    per worker) against after (one agent frame per 0.5 s). Ticks: the hang judgement per tick,
    extrapolated along its measured exponent, at the launcher's tick rate. A fault round: the
    coordinator's planning CPU along its exponent, plus the wire side the launcher pays for it:
    one Recover per member (a delta: its size does not grow with the job).
    """
    big = max(medians, key=lambda r: r.ranks)
    xs = [float(r.ranks) for r in medians]
    ranks = hosts * per_host
    scale = ranks / big.ranks
    per_frame_us = wire.coordinator_verify_decode_us + wire.inbox_us
    tick_k = _slope(xs, [r.tick_ms for r in medians])
    tick_s = big.tick_ms * 1e-3 * scale**tick_k
    round_k = _slope(xs, [r.fault_round_s for r in medians])
    startup_k = _slope(xs, [r.startup_s for r in medians])
    # a Recover grows by one peer address per rank: bytes = fixed + per_rank * ranks
    small = min(medians, key=lambda r: r.ranks)
    if big.ranks > small.ranks:
        per_rank_b = (big.recover_frame_bytes - small.recover_frame_bytes) / (big.ranks - small.ranks)
    else:  # one size measured: charge the whole frame to the ranks (an upper bound)
        per_rank_b = big.recover_frame_bytes / big.ranks
    per_rank_b = max(0.0, per_rank_b)  # a delta Recover: flat, up to measurement noise
    recover_b = big.recover_frame_bytes + per_rank_b * (ranks - big.ranks)
    seal_per_b = big.recover_seal_ms * 1e-3 / big.recover_frame_bytes

    def one_core_load(n: float, interval: float) -> float:
        # the reader thread and the loop share one interpreter (the GIL): one core in all
        tick = big.tick_ms * 1e-3 * (n / big.ranks) ** tick_k * TICKS_PER_S
        return n / interval * (per_frame_us + big.heartbeat_us) * 1e-6 + tick

    def max_ranks(interval: float) -> int:
        lo, hi = 1.0, 1e8
        while hi - lo > 1:  # the load grows with n: bisect for where it reaches one core
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if one_core_load(mid, interval) <= 1.0 else (lo, mid)
        return int(lo)

    rows = []
    for interval in intervals:
        hb_per_s = ranks / interval
        bookkeeping = hb_per_s * big.heartbeat_us * 1e-6  # on_message's body: once per rank
        rows.append(
            {
                "interval_s": interval,
                "heartbeats_per_s": hb_per_s,
                "direct_core_s_per_s": hb_per_s * per_frame_us * 1e-6 + bookkeeping,
                "aggregated_core_s_per_s": _aggregated_load(hosts, per_host, interval, big, wire),
                "tick_core_s_per_s": tick_s * TICKS_PER_S,
                "max_ranks_one_core": max_ranks(interval),
            }
        )
    return {
        "hosts": hosts,
        "per_host": per_host,
        "ranks": ranks,
        "measured_at_ranks": big.ranks,
        "coordinator_us_per_heartbeat": big.heartbeat_us,
        "launcher_us_per_frame": per_frame_us,
        "ticks_per_s": TICKS_PER_S,
        "tick_exponent": tick_k,
        "tick_s": tick_s,
        "fault_round_exponent": round_k,
        "fault_round_coordinator_s": big.fault_round_s * scale**round_k,
        "startup_exponent": startup_k,
        "startup_coordinator_s": big.startup_s * scale**startup_k,
        "recover_bytes_per_rank": per_rank_b,
        "recover_frame_bytes": recover_b,
        "recover_round_bytes": recover_b * ranks,
        "recover_round_seal_core_s": recover_b * seal_per_b * ranks,
        # None: the Recover no longer grows with the job (a delta), so no size is too large
        "max_ranks_recover_fits_control_cap": int(
            (MAX_CONTROL_HEADER - (big.recover_frame_bytes - per_rank_b * big.ranks)) / per_rank_b
        )
        if per_rank_b > 1.0
        else None,
        "per_interval": rows,
        "heartbeat_load": [
            {
                "hosts": h,
                "ranks": h * per_host,
                "before_frames_per_s": h * per_host / HEARTBEAT_S,
                "before_core_s_per_s": h * per_host / HEARTBEAT_S * (per_frame_us + big.heartbeat_us) * 1e-6,
                "after_frames_per_s": h / AGENT_BEAT_S,
                "after_core_s_per_s": _aggregated_load(h, per_host, AGENT_BEAT_S, big, wire),
            }
            for h in MODEL_HOSTS
        ],
    }


def _aggregated_load(hosts: int, per_host: int, interval: float, big: RunResult, wire: WireCost) -> float:
    """Core-s/s of agent heartbeats: one frame per host per interval (the frame path for 8 rows,
    scaled to ``per_host``), plus ``on_beats`` per row."""
    frame_us = (wire.aggregated_verify_decode_us * per_host / 8) + wire.inbox_us
    return hosts / interval * (frame_us + per_host * big.beat_row_us) * 1e-6


def _median(runs: list[RunResult]) -> RunResult:
    first = asdict(runs[0])
    out: dict[str, Any] = {}
    for k, v in first.items():
        vals = [getattr(r, k) for r in runs]
        out[k] = statistics.median(vals) if isinstance(v, float) else v
    return RunResult(**out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, nargs="+", default=[125, 250, 500, 1000, 2500, 10000])
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--spare-hosts", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    p.add_argument("--out", type=Path, default=RESULTS / "control_plane.json")
    a = p.parse_args(argv)
    bad = [h for h in a.hosts if h < 2]
    if bad or a.per_host < 1 or a.spare_hosts < 1 or a.repeats < 1:
        p.error(
            f"--hosts {a.hosts} (each at least 2: one is lost), --per-host {a.per_host}, --spare-hosts "
            f"{a.spare_hosts} and --repeats {a.repeats} must be at least 1"
        )
    medians = []
    for hosts in a.hosts:
        runs = [run_once(hosts, a.per_host, a.spare_hosts) for _ in range(a.repeats)]
        m = _median(runs)
        medians.append(m)
        print(
            f"{m.ranks:6d} ranks: start-up {m.startup_s:7.3f} s, heartbeat {m.heartbeat_us:5.1f} us "
            f"({m.heartbeats_per_core_s:,.0f}/s/core), tick {m.tick_ms:7.2f} ms, fault round "
            f"{m.fault_round_s:7.3f} s (lost {m.fault_host_lost_s:.3f}, assign {m.fault_assign_s:.3f}, "
            f"reports {m.fault_reports_s:.3f}, plan {m.fault_plan_s:.3f}; {m.fault_commands} commands); "
            f"one Recover {m.recover_frame_bytes / 1e3:.1f} kB, sealed in {m.recover_seal_ms:.2f} ms; "
            f"per agent row {m.beat_row_us:.2f} us; full table {m.table_chunks} chunks, "
            f"{m.table_bytes / 1e3:.1f} kB, at start-up to {m.startup_tables_to_hosts} hosts + "
            f"{m.startup_tables_to_members} members "
            f"({(m.startup_tables_to_hosts + m.startup_tables_to_members) * m.table_bytes / 1e9:.2f} GB); "
            "largest frames "
            + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in m.largest_frames.items())
            + ("" if m.all_fit_control_cap else " -- OVER THE CAP"),
            flush=True,
        )
    wire = _median_wire([wire_cost() for _ in range(a.repeats)])
    print(
        f"wire: {wire.frame_bytes} B frame, worker encode+seal {wire.worker_encode_seal_us:.1f} us, "
        f"launcher verify+decode {wire.coordinator_verify_decode_us:.1f} us + inbox {wire.inbox_us:.1f} us; "
        f"an AgentHeartbeat of 8 rows, {wire.aggregated_frame_bytes} B: {wire.aggregated_verify_decode_us:.1f} us"
    )
    mod = model(medians, wire)
    for row in mod["heartbeat_load"]:
        print(
            f"heartbeats at {row['hosts']:,} hosts: before {row['before_frames_per_s']:,.0f} frames/s = "
            f"{row['before_core_s_per_s']:.2f} cores; after {row['after_frames_per_s']:,.0f} frames/s = "
            f"{row['after_core_s_per_s']:.3f} cores"
        )
    for row in mod["per_interval"]:
        print(
            f"model {mod['ranks']} ranks, heartbeat every {row['interval_s']} s: "
            f"{row['heartbeats_per_s']:,.0f}/s = {row['direct_core_s_per_s']:.2f} cores one frame per rank, "
            f"{row['aggregated_core_s_per_s']:.2f} one per host; ticks {row['tick_core_s_per_s']:.2f} cores; "
            f"one core (heartbeats + ticks) holds {row['max_ranks_one_core']:,} ranks"
        )
    print(
        f"model fault round at {mod['ranks']} ranks: coordinator {mod['fault_round_coordinator_s']:.2f} s "
        f"(exponent {mod['fault_round_exponent']:.2f}); {mod['ranks']} Recover frames of "
        f"{mod['recover_frame_bytes'] / 1e6:.1f} MB = {mod['recover_round_bytes'] / 1e9:.0f} GB, "
        f"{mod['recover_round_seal_core_s']:.1f} core-s to seal; a Recover fits the worker's "
        f"{MAX_CONTROL_HEADER >> 10} KiB header cap up to "
        f"{mod['max_ranks_recover_fits_control_cap'] or 'any number of'} ranks"
    )
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        "command": "python benchmarks/control_plane.py " + " ".join(argv or []),
        "repeats": a.repeats,
        "runs": [asdict(m) for m in medians],
        "wire": asdict(wire),
        "model": mod,
    }
    if not a.no_write:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(a.out)  # never a half-written results file
    return result


def _median_wire(ws: list[WireCost]) -> WireCost:
    return WireCost(
        ws[0].frame_bytes,
        statistics.median(w.worker_encode_seal_us for w in ws),
        statistics.median(w.coordinator_verify_decode_us for w in ws),
        statistics.median(w.inbox_us for w in ws),
        ws[0].aggregated_frame_bytes,
        statistics.median(w.aggregated_verify_decode_us for w in ws),
    )


if __name__ == "__main__":
    main()
