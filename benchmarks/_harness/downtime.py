"""What one fault-recovery run measured, read from its logs: shared by benchmarks/recovery.py
(DDP) and benchmarks/sharded_recovery.py (HSDP), so both report downtime the same way.

Both benchmarks launch the same two designs on the same example GPT, (a) ``checkpointless run``
and (b) ``torchrun`` with a DCP-checkpointing baseline from benchmarks/baseline/, with or without
an injected fault. This module holds what is the same for both: the run's identity (``Config``,
``RunRecord``), the readers of the per-rank commit logs, of the launcher's events and of torchrun's
own log lines (downtime from the fault to the next step completed on every rank, its phases, the
steps computed twice, the time to be back at the fault's step, the final digest), the verdict on a
run (``read_run``), the order the runs are made in and their rows in the JSON output. How the
repeats are aggregated and printed (``aggregate``, ``report_tables``) stays in recovery.py.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as bl  # the package itself, loaded before this module

__all__ = [
    "KINDS",
    "KIND_LABEL",
    "PHASES",
    "PHASE_LABEL",
    "Config",
    "RunRecord",
    "checkpointless_metrics",
    "commits",
    "common_metrics",
    "inject_spec",
    "normal_step_s",
    "rank_logs",
    "read_run",
    "run_rows",
    "schedule",
    "step_completion_times",
    "torchrun_log_times",
    "torchrun_metrics",
]

KINDS = ("raise", "kill", "hang")
KIND_LABEL = {"raise": "exception", "kill": "SIGKILL", "hang": "hang (SIGSTOP)", "none": "no fault"}
PHASES = ("detect_s", "abort_s", "rebuild_s", "transfer_s", "first_batch_s", "first_step_s", "other_s")
PHASE_LABEL = {
    "detect_s": "detect",
    "abort_s": "abort",
    "rebuild_s": "rebuild",
    "transfer_s": "state",
    "first_batch_s": "1st batch",
    "first_step_s": "1st step",
    "other_s": "other",
}


@dataclass(frozen=True)
class Config:
    key: str  # "a", "b10", ...
    design: str  # checkpointless | torchrun
    ckpt_every: int = 0

    @property
    def label(self) -> str:
        if self.design == "checkpointless":
            return "(a) checkpointless"
        return f"(b) torchrun K={self.ckpt_every}"


@dataclass
class RunRecord:
    config: Config
    kind: str
    repeat: int
    rc: int | None
    wall_s: float
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def inject_spec(a: argparse.Namespace, kind: str) -> list[str]:
    return [] if kind == "none" else ["--inject", f"{kind}:rank={a.fault_rank}:step={a.fault_step}"]


# -- reading the logs --------------------------------------------------------------------------
def rank_logs(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(run_dir.glob("rank-*.jsonl")):
        out[int(f.stem.split("-")[1])] = sorted(bl.read_jsonl(f), key=lambda e: e["time"])
    return out


def commits(logs: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    return {r: [e for e in evs if e["event"] == "commit"] for r, evs in logs.items()}


def step_completion_times(
    cm: dict[int, list[dict[str, Any]]], before: float | None = None
) -> dict[int, float]:
    """step -> time the last rank committed it (first execution only, before ``before``)."""
    out: dict[int, float] = {}
    per_rank: list[dict[int, float]] = []
    for evs in cm.values():
        first: dict[int, float] = {}
        for e in evs:
            if before is not None and e["time"] >= before:
                continue
            first.setdefault(int(e["step"]), float(e["time"]))
        per_rank.append(first)
    if not per_rank:
        return out
    for step in set.intersection(*(set(d) for d in per_rank)):
        out[step] = max(d[step] for d in per_rank)
    return out


def normal_step_s(cm: dict[int, list[dict[str, Any]]], before: float | None, skip: int = 3) -> float | None:
    """Median time between consecutive steps completed on every rank (after ``skip`` warm-up)."""
    done = step_completion_times(cm, before)
    steps = sorted(s for s in done if s >= skip)
    gaps = [done[b] - done[a] for a, b in itertools.pairwise(steps) if b == a + 1]
    return statistics.median(gaps) if gaps else None


def common_metrics(run_dir: Path, fired_at: float | None, fault_step: int) -> dict[str, Any]:
    logs = rank_logs(run_dir)
    cm = commits(logs)
    m: dict[str, Any] = {}
    all_commits = [e for evs in cm.values() for e in evs]
    if all_commits:
        step0 = [e["time"] for e in all_commits if e["step"] == min(x["step"] for x in all_commits)]
        m["span_s"] = max(e["time"] for e in all_commits) - min(step0)
        m["first_step_done"] = max(step0)
    m["batches"] = {f"{e['rank']}:{e['step']}": e.get("batch") for e in all_commits}
    m["normal_step_s"] = normal_step_s(cm, fired_at)
    digest_file = run_dir / "digest"
    m["digest"] = digest_file.read_text().strip() if digest_file.exists() else None
    if fired_at is None:
        return m
    firsts, backs, lost = [], [], []
    for evs in cm.values():
        after = [e for e in evs if e["time"] > fired_at]
        if not after:
            return {**m, "incomplete": "a rank committed no step after the fault"}
        firsts.append(after[0]["time"])
        back = [e["time"] for e in after if e["step"] == fault_step]
        backs.append(back[0] if back else None)
        before_steps = {e["step"] for e in evs if e["time"] <= fired_at}
        lost.append(len(before_steps & {e["step"] for e in after}))
    m["first_commit_after"] = max(firsts)
    m["downtime_s"] = max(firsts) - fired_at
    reached = [b for b in backs if b is not None]
    m["back_s"] = (max(reached) - fired_at) if len(reached) == len(backs) else None  # every rank got back
    m["lost_steps"] = max(lost)
    return m


def checkpointless_metrics(run_dir: Path, fault_step: int) -> dict[str, Any]:
    events = bl.read_jsonl(run_dir / "events.jsonl")
    injected = [e for e in events if e["event"] == "fault_injected"]
    fired_at = float(injected[0]["fired_at"]) if injected else None
    m = common_metrics(run_dir, fired_at, fault_step)
    m["job_end"] = next((e.get("status") for e in events if e["event"] == "job_end"), None)
    started = [e for e in events if e["event"] == "started"]
    m["start_s"] = started[0]["seconds"] if started else None
    if fired_at is None:
        return m
    faults = [e for e in events if e["event"] == "fault" and e["time"] >= fired_at - 1.0]
    recs = [e for e in events if e["event"] == "recovery" and e["time"] >= fired_at]
    m["fault_events"] = [{k: f.get(k) for k in ("kind", "rank", "detail")} for f in faults]
    assigned = [e["time"] for e in events if e["event"] == "spare_assigned" and e["time"] >= fired_at]
    m["replaced"] = bool(assigned)
    if assigned and faults:
        # ~0 when a hot spare was ready; otherwise the wait for one to finish starting
        m["spare_assign_delay_s"] = assigned[0] - faults[0]["time"]
    if not faults or not recs or "downtime_s" not in m:
        m["incomplete"] = m.get("incomplete", "no fault/recovery event after the injected fault")
        return m
    rec = recs[0]
    detect = faults[0]["time"] - fired_at
    ph = {
        "detect_s": detect,
        "abort_s": float(rec["collect_s"]),
        "rebuild_s": float(rec["rebuild_s"]),
        "transfer_s": float(rec["transfer_s"]),
        "first_batch_s": float(rec["first_batch_s"]) if "first_batch_s" in rec else None,
        "first_step_s": float(rec["first_step_s"]),
    }
    ph["other_s"] = m["downtime_s"] - sum(v for v in ph.values() if v is not None)
    m["phases"] = ph
    m["state_bytes"] = rec.get("state_bytes")
    m["launcher_downtime_s"] = rec.get("downtime_s")
    return m


_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)\s+\d+\s+\S+\]\s*(.*)$")


def torchrun_log_times(stderr: Path, year: int) -> list[tuple[float, str]]:
    """(wall time, message) of torchrun's own log lines (glog format, local time, no year)."""
    out: list[tuple[float, str]] = []
    if not stderr.exists():
        return out
    for line in stderr.read_text(errors="replace").splitlines():
        g = _GLOG.match(line)
        if g is None:
            continue
        mo, d, hh, mm, ss, frac, msg = g.groups()
        micro = int(frac[:6].ljust(6, "0"))
        t = datetime.datetime(year, int(mo), int(d), int(hh), int(mm), int(ss), micro).timestamp()
        out.append((t, msg))
    return out


def torchrun_metrics(run_dir: Path, fault_step: int) -> dict[str, Any]:
    logs = rank_logs(run_dir)
    fault_ev = sorted(
        (e for evs in logs.values() for e in evs if e["event"] == "fault"), key=lambda e: e["time"]
    )
    fired_at = float(fault_ev[0]["fired_at"]) if fault_ev else None
    m = common_metrics(run_dir, fired_at, fault_step)
    saves: dict[int, list[float]] = {}
    for evs in logs.values():
        for e in evs:
            if e["event"] == "save":
                saves.setdefault((int(e["attempt"]) << 20) + int(e["step"]), []).append(float(e["seconds"]))
    m["save_s"] = [max(v) for _, v in sorted(saves.items())]
    m["attempts"] = 1 + max((int(e["attempt"]) for evs in logs.values() for e in evs), default=0)
    if fired_at is None or "downtime_s" not in m:
        return m
    attempt = int(fault_ev[0]["attempt"]) + 1
    year = time.localtime(fired_at).tm_year
    agent_lines = [
        (t, msg)
        for t, msg in torchrun_log_times(run_dir / "stderr.log", year)
        if t >= fired_at - 0.05 and ("closing signal" in msg or "failed (exitcode" in msg)
    ]
    detected = min(t for t, _ in agent_lines) if agent_lines else None
    m["torchrun_detected"] = detected is not None
    m["torchrun_messages"] = [msg[:160] for _, msg in agent_lines[:8]]

    def phase_time(name: str, agg: Any = max) -> float | None:
        ts = [
            float(e["time"])
            for evs in logs.values()
            for e in evs
            if e["event"] == "phase" and e.get("name") == name and int(e["attempt"]) == attempt
        ]
        return agg(ts) if len(ts) == len(logs) else None

    t_start = phase_time("process_start", min)
    t_import = phase_time("example_imported")
    t_pg = phase_time("pg_ready")
    t_built = phase_time("optimizer_ready")
    t_loaded = phase_time("ckpt_loaded")
    t_batch = phase_time("first_batch")
    t_first = m["first_commit_after"]
    if None in (t_start, t_import, t_pg, t_built, t_loaded, t_batch) or t_first is None:
        m["incomplete"] = m.get("incomplete", f"attempt {attempt} did not log every phase")
        return m
    assert t_start is not None and t_import is not None and t_pg is not None
    assert t_built is not None and t_loaded is not None and t_batch is not None
    det = (detected - fired_at) if detected is not None else None
    ph = {
        "detect_s": det,
        # teardown of every process (SIGTERM, 30 s grace for a stopped one), rendezvous, spawn
        "abort_s": t_start - (detected if detected is not None else fired_at),
        # new processes: interpreter + import torch, init_process_group, model + DDP + AdamW
        "rebuild_s": t_built - t_start,
        "transfer_s": t_loaded - t_built,  # torch.distributed.checkpoint load
        "first_batch_s": t_batch - t_loaded,
        "first_step_s": t_first - t_batch,
    }
    ph["other_s"] = m["downtime_s"] - sum(v for v in ph.values() if v is not None)
    m["phases"] = ph
    m["rebuild_parts"] = {
        "start_and_imports_s": t_import - t_start,
        "init_pg_s": t_pg - t_import,
        "build_s": t_built - t_pg,
    }
    loads = [
        float(e["seconds"])
        for evs in logs.values()
        for e in evs
        if e["event"] == "phase" and e.get("name") == "ckpt_loaded" and int(e["attempt"]) == attempt
    ]
    m["ckpt_load_s"] = max(loads) if loads else None
    return m


# -- one run's verdict, the order of runs, the JSON rows ---------------------------------------------
def read_run(
    cfg: Config,
    kind: str,
    repeat: int,
    fin: bl.Finished,
    run_dir: Path,
    *,
    fault_step: int,
    run_timeout: float,
    checkpointless_extra: Callable[[Path], dict[str, Any]] | None = None,
    kind_width: int = 15,
    logs_in_error: bool = False,
) -> RunRecord:
    """Read a finished run's logs into a record, decide whether it failed, and print its line.

    ``checkpointless_extra`` adds design-specific fields to a checkpointless run's metrics.
    ``logs_in_error`` puts the run directory into the recorded error (sharded_recovery.json has it
    there); otherwise only the printed line names it (recovery.json's errors never did).
    """
    rec = RunRecord(cfg, kind, repeat, fin.rc, fin.wall_s)
    try:
        if cfg.design == "checkpointless":
            rec.metrics = checkpointless_metrics(run_dir, fault_step)
            if checkpointless_extra is not None:
                rec.metrics.update(checkpointless_extra(run_dir))
        else:
            rec.metrics = torchrun_metrics(run_dir, fault_step)
        if rec.metrics.get("first_step_done") is not None:
            rec.metrics["launch_to_first_step_s"] = rec.metrics["first_step_done"] - fin.started
    except Exception as e:  # a broken log is a failed run, reported, not a crashed benchmark
        rec.error = f"could not read the logs: {type(e).__name__}: {e}"
    if fin.timed_out:
        rec.error = f"timed out after {run_timeout:.0f} s"
    elif fin.rc != 0:
        rec.error = rec.error or f"exit code {fin.rc}"
    elif rec.metrics.get("incomplete"):
        rec.error = str(rec.metrics["incomplete"])
    elif kind != "none" and "phases" not in rec.metrics:
        rec.error = "no recovery measured"
    where = f" (logs in {run_dir})"
    if rec.error is not None and logs_in_error:
        rec.error += where
        where = ""
    status = "ok" if rec.error is None else f"FAILED: {rec.error}{where}"
    dt = rec.metrics.get("downtime_s")
    extra = f", downtime {dt:.2f} s, lost {rec.metrics.get('lost_steps')}" if dt is not None else ""
    label = KIND_LABEL[kind]
    bl.say(f"  {cfg.label:<22} {label:<{kind_width}} #{repeat}: {fin.wall_s:6.1f} s{extra} {status}")
    return rec


def schedule(repeats: int, kinds: list[str], configs: list[Config]) -> Iterator[tuple[int, str, Config]]:
    """(repeat, kind, config) in run order: interleaved, and every other repeat in reverse, so
    every design sees the same drift in the machine's load."""
    for rep in range(repeats):
        for kind in kinds:
            for cfg in configs if rep % 2 == 0 else list(reversed(configs)):
                yield rep, kind, cfg


def run_rows(runs: list[RunRecord]) -> list[dict[str, Any]]:
    """The runs as the JSON output lists them (the per-step batch digests left out: only the
    aggregation's data-exactness check needs them)."""
    return [
        {
            "config": r.config.key,
            "design": r.config.design,
            "ckpt_every": r.config.ckpt_every,
            "kind": r.kind,
            "repeat": r.repeat,
            "rc": r.rc,
            "wall_s": round(r.wall_s, 4),
            "error": r.error,
            "metrics": {k: v for k, v in r.metrics.items() if k != "batches"},
        }
        for r in runs
    ]
