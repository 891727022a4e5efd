"""``checkpointless status RUN_DIR``: one screen about a job, read from its run directory alone.

Everything comes from the event files (and ``/proc`` for whether a process still lives), so it
works the same on a running job, a finished one, and one whose launcher was SIGKILLed; it needs
no secret and never opens the ``secret`` file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.observe.ledger import build_ledger
from checkpointless.observe.runfiles import load_run

__all__ = [
    "HostHealthStatus",
    "JobStatus",
    "RankStatus",
    "SpareStatus",
    "build_parser",
    "build_status",
    "host_health",
    "launcher_alive",
    "main",
    "pid_alive",
    "render_status",
]


def pid_alive(pid: int) -> bool:
    """True when ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def launcher_alive(events: Sequence[Mapping[str, Any]]) -> bool:
    """The job has not ended and the launcher that wrote ``job_start`` still runs."""
    if any(e.get("event") == "job_end" for e in events):
        return False
    start = next((e for e in events if e.get("event") == "job_start"), None)
    pid = start.get("pid") if start is not None else None
    return isinstance(pid, int) and pid_alive(pid)


@dataclass(frozen=True)
class RankStatus:
    rank: int
    worker: int | None
    pid: int | None
    host: str
    state: str  # training | recovering | finished | dead | unknown
    step: int | None  # the last step it committed
    step_time_s: float | None
    generation: int | None
    last_commit_age_s: float | None


@dataclass(frozen=True)
class SpareStatus:
    worker: int
    pid: int | None
    state: str  # ready | starting | gone


@dataclass(frozen=True)
class HostHealthStatus:
    """A host's health as its agent last reported it (agent/health.py), and its quarantine."""

    host: int  # the agent's id
    address: str
    ok: bool | None  # the newest reported verdict (None: it has sent none)
    quarantine: str  # "" (admitted), health, or faults
    detail: str  # the failing checks' output, or why it is quarantined


@dataclass(frozen=True)
class JobStatus:
    run_dir: str
    job: str
    state: str  # running | recovering | finished (ok) | failed | launcher gone
    host: str
    launcher_pid: int | None
    nproc: int
    generation: int
    elapsed_s: float
    faults: int
    recoveries: int
    goodput: float
    steps_committed: int
    ranks: list[RankStatus] = field(default_factory=list)
    spares: list[SpareStatus] = field(default_factory=list)
    last_fault: str | None = None
    hosts: list[HostHealthStatus] = field(default_factory=list)  # hosts that reported health
    # data-parallel replicas (live processes holding slots): nproc at full width, fewer while
    # degraded (the last `width` event); the [slot, holder] pairs of the held slots
    width: int = 0
    held: list[list[int]] = field(default_factory=list)


def build_status(
    run_dir: str,
    events: Sequence[Mapping[str, Any]],
    commits: Sequence[Mapping[str, Any]],
    now: float,
    alive: Callable[[int], bool] = pid_alive,
) -> JobStatus:
    """The status of one job at wall time ``now``; ``alive`` says whether a pid still runs."""
    start = next((e for e in events if e.get("event") == "job_start"), None)
    if start is None:
        raise ConfigError(f"{run_dir}/events.jsonl has no job_start yet: the launcher is starting or failed")
    nproc = int(start.get("nproc", 0))
    host = str(start.get("host", "?"))
    lpid = start.get("pid") if isinstance(start.get("pid"), int) else None
    ended = [e for e in events if e.get("event") == "job_end"]
    running = not ended and lpid is not None and alive(lpid)
    pids: dict[int, int] = {}
    roles: dict[int, str] = {}
    holder: dict[int, int] = {}  # rank -> worker id
    ready: set[int] = set()
    gone: set[int] = set()
    generation = -1
    width, held = nproc, []
    for e in events:
        kind = e.get("event")
        if kind == "width":
            width, held = int(e["width"]), [list(p) for p in e.get("holders") or []]
        if kind == "spawn":
            wid = int(e["worker"])
            pids[wid], roles[wid] = int(e["pid"]), str(e["role"])
            if e["role"] == "worker" and len(holder) < nproc:
                holder[len(holder)] = wid  # workers are started in rank order
        elif kind == "spare_ready":
            ready.add(int(e["worker"]))
        elif kind == "spare_assigned":
            holder[int(e["rank"])] = int(e["worker"])
        elif kind == "spare_lost":
            gone.add(int(e["worker"]))
        elif kind in ("started", "recovery"):
            generation = max(generation, int(e["generation"]))
    last: dict[int, Mapping[str, Any]] = {}
    prev: dict[int, Mapping[str, Any]] = {}
    for c in commits:
        r = int(c.get("rank", -1))
        if r in last:
            prev[r] = last[r]
        last[r] = c
    faults = [e for e in events if e.get("event") == "fault"]
    recs = [e for e in events if e.get("event") == "recovery"]
    last_rec = max((float(e["time"]) for e in recs), default=0.0)
    # a fault's generation may be absent or null (the records allow both: a fault before any
    # generation formed); either is no open round
    open_round = running and any(
        float(f["time"]) > last_rec and isinstance(g := f.get("generation"), int) and g >= 0 for f in faults
    )
    ranks = []
    for r in range(nproc):
        holder_id = holder.get(r)
        rank_pid = pids.get(holder_id) if holder_id is not None else None
        lc = last.get(r)
        before = prev.get(r)
        step_time = None
        if (
            lc is not None
            and before is not None
            and int(lc["step"]) == int(before["step"]) + 1
            and lc.get("generation") == before.get("generation")  # a gap across a recovery is no step
        ):
            step_time = float(lc["time"]) - float(before["time"])
        if ended:
            state = "finished" if ended[-1].get("status") == "ok" else "stopped"
        elif rank_pid is None or not alive(rank_pid):
            state = "dead"
        elif open_round:
            state = "recovering"
        else:
            state = "training" if running else "orphaned"
        ranks.append(
            RankStatus(
                rank=r,
                worker=holder_id,
                pid=rank_pid,
                host=host,
                state=state,
                step=int(lc["step"]) if lc is not None else None,
                step_time_s=step_time,
                generation=int(lc["generation"]) if lc is not None and "generation" in lc else None,
                last_commit_age_s=now - float(lc["time"]) if lc is not None else None,
            )
        )
    spares = []
    for wid, role in roles.items():
        if role != "spare" or wid in holder.values():
            continue
        pid = pids[wid]
        if wid in gone or ended or not alive(pid):
            continue
        spares.append(SpareStatus(wid, pid, "ready" if wid in ready else "starting"))
    if ended:
        state = "finished" if ended[-1].get("status") == "ok" else "failed"
    elif not running:
        state = "launcher gone"
    else:
        state = "recovering" if open_round else "running"
    ledger = build_ledger(events, commits, now=now if running else None)
    causes = [f for f in faults if f.get("kind") != "comm"]
    lf = causes[-1] if causes else None
    return JobStatus(
        run_dir=run_dir,
        job=str(start.get("job", "?")),
        state=state,
        host=host,
        launcher_pid=lpid,
        nproc=nproc,
        width=width,
        held=held,
        generation=generation,
        elapsed_s=ledger.wall_s,
        faults=len(causes),
        recoveries=len(recs),
        goodput=ledger.goodput,
        steps_committed=ledger.steps_committed,
        ranks=ranks,
        spares=sorted(spares, key=lambda s: s.worker),
        last_fault=f"{lf.get('kind')} on rank {lf.get('rank')} at step {lf.get('step')}" if lf else None,
        hosts=host_health(events),
    )


def host_health(events: Sequence[Mapping[str, Any]]) -> list[HostHealthStatus]:
    """Each live host's health and quarantine, from the coordinator's ``host_health``,
    ``host_quarantined`` and ``host_readmitted`` events (coordinator/health.py)."""
    hosts: dict[int, HostHealthStatus] = {}
    for e in events:
        kind = e.get("event")
        if kind not in ("host_health", "host_quarantined", "host_readmitted", "host_lost"):
            continue
        host = int(e.get("host", -1))
        if kind == "host_lost":
            hosts.pop(host, None)
            continue
        old = hosts.get(host) or HostHealthStatus(host, str(e.get("address", "?")), None, "", "")
        if kind == "host_health":
            ok = bool(e.get("ok"))
            hosts[host] = replace(
                old, ok=ok, detail=old.detail if old.quarantine else str(e.get("detail", ""))
            )
        elif kind == "host_quarantined":
            hosts[host] = replace(old, quarantine=str(e.get("reason", "?")), detail=str(e.get("detail", "")))
        else:
            hosts[host] = replace(old, quarantine="", detail="")
    return [hosts[h] for h in sorted(hosts)]


def _fmt(x: float | None, scale: float = 1.0, unit: str = "") -> str:
    return "-" if x is None else f"{x * scale:.1f}{unit}"


def render_status(st: JobStatus) -> str:
    lines = [
        f"job {st.job}  {st.state.upper()}  host {st.host}  launcher pid {st.launcher_pid}  run dir {st.run_dir}",
        f"generation {st.generation}  steps {st.steps_committed}  elapsed {st.elapsed_s:.1f} s  "
        f"faults {st.faults}  recoveries {st.recoveries}  goodput {100 * st.goodput:.1f}%",
    ]
    if st.width and st.width < st.nproc:
        lines.append(
            f"DEGRADED: {st.width} of {st.nproc} replicas; held slots (slot, holder rank): {st.held}"
        )
    if st.last_fault:
        lines.append(f"last fault: {st.last_fault}")
    lines += [
        "",
        f"{'rank':>4} {'worker':>6} {'pid':>8} {'host':<16} {'state':<10} {'step':>6} {'step ms':>8} {'gen':>4} {'age s':>7}",
    ]
    for r in st.ranks:
        lines.append(
            f"{r.rank:>4} {r.worker if r.worker is not None else '-':>6} {r.pid or '-':>8} {r.host[:16]:<16} "
            f"{r.state:<10} {r.step if r.step is not None else '-':>6} {_fmt(r.step_time_s, 1e3):>8} "
            f"{r.generation if r.generation is not None else '-':>4} {_fmt(r.last_commit_age_s):>7}"
        )
    pool = ", ".join(f"worker {s.worker} (pid {s.pid}) {s.state}" for s in st.spares) or "none"
    lines += ["", f"spares: {pool}"]
    if st.hosts:
        quarantined = [h for h in st.hosts if h.quarantine]
        lines += [
            "",
            f"host health: {len(st.hosts) - len(quarantined)} admitted, {len(quarantined)} quarantined",
        ]
        for h in st.hosts:
            state = f"QUARANTINED ({h.quarantine})" if h.quarantine else "passing" if h.ok else "failing"
            lines.append(f"  {h.address} (agent {h.host}) {state}" + (f": {h.detail}" if h.detail else ""))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="checkpointless status", description="One screen about a job, read from its run directory."
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="print the same as one JSON object")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until the job ends or Ctrl-C",
    )
    return p


def snapshot(run_dir: Path) -> JobStatus:
    run = load_run(run_dir)
    st = build_status(str(run_dir), run.events, run.commits, time.time())
    return replace(st, steps_committed=run.steps_committed(st.steps_committed))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.watch is not None and args.watch <= 0:
            raise ConfigError(f"--watch needs a positive number of seconds (got {args.watch})")
        st = snapshot(args.run_dir)
        while True:
            if args.json:
                print(json.dumps(asdict(st)), flush=True)
            else:
                if args.watch is not None and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place on a terminal
                sys.stdout.write(render_status(st))
                sys.stdout.flush()
            if args.watch is None or st.state not in ("running", "recovering"):
                return 0
            time.sleep(args.watch)
            st = snapshot(args.run_dir)
    except ConfigError as e:
        print(f"checkpointless status: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
