"""``checkpointless report RUN_DIR``: the goodput ledger as a table, Markdown, JSON and a PNG."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.observe.compare import ONE_MACHINE, RestartEstimate, estimate_restart
from checkpointless.observe.ledger import BUCKET_LABELS, BUCKETS, Ledger, build_ledger
from checkpointless.observe.runfiles import load_run

__all__ = ["build_parser", "ledger_json", "ledger_table", "main", "write_atomic"]

_SHORT = {
    "replayed": "replay",
    "detection": "detect",
    "abort": "abort",
    "spare_wait": "spare",
    "rebuild": "rebuild",
    "transfer": "state",
    "coordination": "coord",
    "first_step": "1st step",
    "unrecovered": "open",
}


def _s(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


def _rows(ledger: Ledger) -> list[str]:
    wall = ledger.wall_s
    lines = [
        "| where the time went | seconds | share |",
        "|---|---:|---:|",
    ]
    for b in BUCKETS:
        v = ledger.totals[b]
        if v == 0 and b not in ("productive", "startup"):
            continue
        share = 100 * v / wall if wall > 0 else 0.0
        lines.append(f"| {BUCKET_LABELS[b]} | {_s(v)} | {share:.1f}% |")
    lines.append(f"| **wall time** | **{_s(wall)}** | **100%** |")
    return lines


def _fault_rows(ledger: Ledger, est: RestartEstimate | None) -> list[str]:
    cols = [b for b in _SHORT if any(f.phases.get(b, 0.0) for f in ledger.faults)]
    head = (
        "| # | generation | cause | "
        + " | ".join(_SHORT[c] for c in cols)
        + " | total | checkpoint-restart (est.) |"
    )
    lines = [head, "|" + "---|" * (5 + len(cols))]
    for i, f in enumerate(ledger.faults):
        cr = _s(est.per_fault_s[i]) if est is not None and i < len(est.per_fault_s) else "-"
        cells = " | ".join(_s(f.phases.get(c, 0.0)) for c in cols)
        lines.append(f"| {i + 1} | {f.generation} | {f.causes} | {cells} | {_s(f.total_s)} | {cr} |")
    return lines


def _summary(ledger: Ledger, est: RestartEstimate | None) -> list[str]:
    step = f"{ledger.step_time_s * 1e3:.1f} ms" if ledger.step_time_s else "unknown"
    out = [
        f"job {ledger.status}: {ledger.steps_committed} steps, {len(ledger.faults)} fault(s), "
        f"wall {_s(ledger.wall_s)} s, goodput {100 * ledger.goodput:.1f}% "
        f"(step {step}, state {ledger.state_bytes / 1e6:.1f} MB)"
    ]
    if est is not None:
        cost = sum(f.total_s for f in ledger.faults)
        out.append(
            f"the faults cost {_s(cost)} s here; checkpoint-restart would have cost about "
            f"{_s(sum(est.per_fault_s))} s for them, plus {_s(est.save_overhead_s)} s of saves every "
            f"{est.interval_steps} steps: estimated wall {_s(est.wall_s)} s, goodput {100 * est.goodput:.1f}% "
            "(an estimate from the simulator's model with this job's step time and state size)"
        )
    return out


def ledger_table(ledger: Ledger, est: RestartEstimate | None) -> str:
    """The ledger as Markdown: summary, buckets, then one row per fault."""
    parts = [*_summary(ledger, est), "", *_rows(ledger)]
    if ledger.faults:
        parts += ["", *_fault_rows(ledger, est)]
    if est is not None:
        phases = ", ".join(f"{k} {_s(v)}" for k, v in est.phases.items())
        parts += [
            "",
            f"checkpoint-restart per fault: detection, {phases}, plus half an interval of lost work "
            f"({_s(est.lost_work_s)} s)",
        ]
    return "\n".join(parts) + "\n"


def ledger_json(ledger: Ledger, est: RestartEstimate | None) -> dict[str, Any]:
    return {
        "status": ledger.status,
        "start": ledger.start,
        "end": ledger.end,
        "wall_s": ledger.wall_s,
        "goodput": ledger.goodput,
        "steps_committed": ledger.steps_committed,
        "step_time_s": ledger.step_time_s,
        "state_bytes": ledger.state_bytes,
        "totals_s": ledger.totals,
        "faults": [asdict(f) | {"total_s": f.total_s} for f in ledger.faults],
        "checkpoint_restart_estimate": asdict(est) if est is not None else None,
    }


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file in the same folder: readers never see half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="checkpointless report",
        description="Where a job's wall time went (goodput ledger), next to an estimate of what "
        "checkpoint-restart would have cost for the same faults.",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write the tables as Markdown")
    p.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the ledger as JSON ('-': stdout only)"
    )
    p.add_argument("--png", type=Path, metavar="FILE", help="timeline plot (default RUN_DIR/timeline.png)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--calibration", type=Path, help="JSON of restart costs (keys: docs/goodput.md)")
    p.add_argument(
        "--checkpoint-every", type=int, metavar="STEPS", help="interval for the estimate (default: Young's)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.checkpoint_every is not None and args.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be at least 1 step (got {args.checkpoint_every})")
        run = load_run(args.run_dir)
        if not any(e.get("event") == "job_start" for e in run.events):
            raise ConfigError(f"{args.run_dir}/events.jsonl has no job_start: the job never started")
        cal = ONE_MACHINE
        if args.calibration is not None:
            from checkpointless.simulate.calibration import load_calibration

            cal = load_calibration(args.calibration, base=ONE_MACHINE)
        ledger = build_ledger(run.events, run.commits, now=_now_if_live(run.events))
        ledger = replace(ledger, steps_committed=run.steps_committed(ledger.steps_committed))
        est = estimate_restart(ledger, cal, args.checkpoint_every)
    except ConfigError as e:
        print(f"checkpointless report: error: {e}", file=sys.stderr)
        return 2
    table = ledger_table(ledger, est)
    doc = json.dumps(ledger_json(ledger, est), indent=1) + "\n"
    if args.json is not None and str(args.json) == "-":
        sys.stdout.write(doc)
        return 0
    sys.stdout.write(table)
    if args.markdown is not None:
        write_atomic(args.markdown, ("# Goodput ledger: " + str(args.run_dir) + "\n\n" + table).encode())
    if args.json is not None:
        write_atomic(args.json, doc.encode())
    if not args.no_plot:
        from checkpointless.observe.timeline import write_timeline

        png = args.png or args.run_dir / "timeline.png"
        write_timeline(ledger, run.events, run.commits, png)
        print(f"timeline: {png}")
    return 0


def _now_if_live(events: list[dict[str, Any]]) -> float | None:
    """Charge a running job up to now; a job whose launcher is gone ends at its last record."""
    from checkpointless.observe.status import launcher_alive

    return time.time() if launcher_alive(events) else None
