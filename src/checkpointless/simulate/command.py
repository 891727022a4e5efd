"""Command line of the goodput simulation: ``checkpointless simulate`` / ``python -m ...simulate``."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import load_calibration
from checkpointless.simulate.capacity import CapacityPolicy, DegradedDesign, NoSparePolicy
from checkpointless.simulate.des import SimConfig
from checkpointless.simulate.failures import BAD_REPAIR_FRACTION
from checkpointless.simulate.models import IntervalRule
from checkpointless.simulate.render import (
    breakdown_table,
    headline,
    render_markdown,
    scale_table,
    sensitivity_table,
    sweep_table,
    to_json,
    write_plot,
)
from checkpointless.simulate.report import DEFAULT_GPUS, full_mesh, run_report, store_based
from checkpointless.simulate.topology import JobShape

__all__ = ["MAX_DAYS", "MAX_GPUS", "MAX_SEEDS", "build_parser", "main"]

# Bounds on a study's size: beyond them a typo would run for hours (or forever) before printing anything.
MAX_DAYS = 3650.0
MAX_SEEDS = 10_000
MAX_GPUS = 1 << 20


def _gpu_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of GPU counts; e.g. 16,256,2304") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one GPU count")
    return values


def _path(text: str) -> Path:
    # Path("") is ".", which would silently mean the current directory
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; name a file or directory")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="checkpointless simulate",
        description="Simulate training goodput under faults: checkpoint-restart versus checkpointless, "
        "and what a checkpointless job does when its spare hosts run out.",
    )
    p.add_argument(
        "--gpus",
        type=_gpu_list,
        nargs="+",
        default=[list(DEFAULT_GPUS)],
        help="job sizes, comma- or space-separated (default: 16 ... 16384); each a multiple of 16",
    )
    p.add_argument(
        "--focus-gpus",
        type=int,
        default=JobShape().gpus,
        help="size for the breakdown and sensitivity tables",
    )
    p.add_argument(
        "--days", type=float, default=60.0, help="simulated wall time per run (default %(default)s)"
    )
    p.add_argument(
        "--seeds",
        "--repeats",
        dest="seeds",
        type=int,
        default=10,
        help="runs per point, seeds 0..n-1 (default %(default)s)",
    )
    p.add_argument(
        "--calibration", type=_path, help="JSON file of measured costs (keys: see docs/goodput.md)"
    )
    p.add_argument("--interval", choices=[r.value for r in IntervalRule], default=IntervalRule.YOUNG.value)
    g = p.add_argument_group("the chosen policy (the launcher's flags of the same names)")
    g.add_argument(
        "--no-spare-policy",
        "--when-no-spare",
        dest="no_spare_policy",
        choices=[v.value for v in NoSparePolicy],
        default=NoSparePolicy.WAIT.value,
        help="a host is lost and no spare host is ready: go on at once with fewer replicas and grow "
        "back (shrink), wait up to --spare-wait then shrink (wait, the launcher's default), or wait "
        "up to --spare-wait then fail (fail, the launcher before degraded mode)",
    )
    g.add_argument(
        "--degraded-design",
        choices=[v.value for v in DegradedDesign],
        default=DegradedDesign.BITWISE.value,
        help="how survivors train a dropped replica's micro-batches: bitwise (this repository's "
        "design: a held slot is a whole extra pass, the measured step) or split (the issue's ideal, "
        "full / remaining width; not built)",
    )
    g.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewer data-parallel replicas at work than this fails the job (default %(default)s)",
    )
    g.add_argument(
        "--spare-wait",
        type=float,
        default=60.0,
        help="seconds to wait for a host before the job shrinks (wait) or fails (fail) "
        "(default %(default)s; inf: no limit)",
    )
    g.add_argument(
        "--health-check",
        choices=["on", "off"],
        default="on",
        help="on: a repaired host that fails its check is quarantined, never promoted (default on)",
    )
    g.add_argument(
        "--rendezvous",
        choices=["rootless", "rootless-full", "tcp"],
        default="rootless",
        help="how a checkpointless job's communicator is rebuilt and, after a fallback, started "
        "again: rootless (the launcher's default: gloo connects lazily, a rank reads its "
        "collectives' peers' keys), rootless-full (CHECKPOINTLESS_GLOO_CONNECT=full: every rank "
        "reads all N keys, as rendezvous_scale.json measured it) or tcp (one store, O(N): the "
        "launcher's --rendezvous tcp, this study's default until session 32)",
    )
    m = p.add_argument_group("hosts and repairs")
    m.add_argument(
        "--replica-gpus",
        type=int,
        default=JobShape().dp_replica_gpus,
        help="GPUs of one data-parallel replica, the unit a shrink drops (default %(default)s: TP 8 x PP 16)",
    )
    m.add_argument(
        "--repair-hours",
        type=float,
        default=JobShape().replace_s / 3600,
        help="hours until a lost host is back as a spare (default %(default)g)",
    )
    m.add_argument(
        "--bad-repair-fraction",
        type=float,
        default=BAD_REPAIR_FRACTION,
        help="share of repairs that come back faulty (default %(default)g, an assumption)",
    )
    p.add_argument("--out", type=_path, help="write goodput.json, goodput.md and goodput.png here")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument(
        "--no-sensitivity", action="store_true", help="skip the what-if and repair-time tables (faster)"
    )
    p.add_argument("--label", help=argparse.SUPPRESS)  # the command a report should name
    return p


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> str:
    return (
        f"{_cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}"
    )


def _check_path_parent(flag: str, path: Path) -> None:
    """The nearest existing part of ``path`` must be a directory (it is created later, if missing)."""
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"{flag} {str(path)!r} is under {str(parent)!r}, which is a file; choose another path"
        )


def _check_args(args: argparse.Namespace) -> None:
    """Refuse values that cannot work before the (possibly long) study starts and before any file is written."""
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise ConfigError(f"--seeds {args.seeds} must be from 1 to {MAX_SEEDS}")
    if not (math.isfinite(args.days) and 0 < args.days <= MAX_DAYS):
        raise ConfigError(f"--days {args.days} must be a number of days > 0 and <= {MAX_DAYS}; e.g. 60")
    for n in [*(n for group in args.gpus for n in group), args.focus_gpus]:
        if n > MAX_GPUS:
            raise ConfigError(f"{n} GPUs is more than the {MAX_GPUS:,} this model is meant for; give fewer")
    if args.min_replicas < 1:
        raise ConfigError(f"--min-replicas {args.min_replicas} must be >= 1")
    if math.isnan(args.spare_wait) or args.spare_wait < 0:
        raise ConfigError(f"--spare-wait {args.spare_wait} must be >= 0 seconds (inf: no limit)")
    if not (math.isfinite(args.repair_hours) and args.repair_hours > 0):
        raise ConfigError(f"--repair-hours {args.repair_hours} must be a number of hours > 0; e.g. 1")
    if not 0.0 <= args.bad_repair_fraction < 1.0:
        raise ConfigError(f"--bad-repair-fraction {args.bad_repair_fraction} must lie in [0, 1); e.g. 0.05")
    cal = args.calibration
    if cal is not None:
        if cal.is_dir():
            raise ConfigError(f"--calibration {str(cal)!r} is not a file; pass a JSON file of measured costs")
        if cal.exists() and not os.access(cal, os.R_OK):
            raise ConfigError(f"--calibration {str(cal)!r} is not readable; check its permissions")
    out = args.out
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {str(out)!r} exists and is not a directory; choose another path")
        _check_path_parent("--out", out)


def main(argv: list[str] | None = None) -> int:
    """Run the study, print the tables, write the files under ``--out``; 0 on success, 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        capacity = CapacityPolicy(
            NoSparePolicy(args.no_spare_policy),
            spare_wait_s=args.spare_wait,
            min_replicas=args.min_replicas,
            health_check=args.health_check == "on",
            design=DegradedDesign(args.degraded_design),
        )
        base = SimConfig(days=args.days, interval_rule=IntervalRule(args.interval), capacity=capacity)
        base = replace(
            base,
            shape=replace(base.shape, dp_replica_gpus=args.replica_gpus, replace_s=args.repair_hours * 3600),
            failures=replace(base.failures, bad_repair_fraction=args.bad_repair_fraction),
        )
        if args.rendezvous == "tcp":
            base = store_based(base)
        elif args.rendezvous == "rootless-full":
            base = full_mesh(base)
        if args.calibration is not None:
            base = replace(base, cal=load_calibration(args.calibration, base.cal))
        gpus = sorted({n for group in args.gpus for n in group})
        for n in [*gpus, args.focus_gpus]:
            replace(base.shape, gpus=n)  # validates the size before any long run
        t0 = time.perf_counter()
        rep = run_report(base, gpus, args.focus_gpus, range(args.seeds), not args.no_sensitivity)
        runtime = time.perf_counter() - t0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    given = argv if argv is not None else sys.argv[1:]
    command = args.label or " ".join(["python -m checkpointless.simulate", *given])
    print(headline(rep), "\n")
    print(sweep_table(rep), "\n")
    print(breakdown_table(rep), "\n")
    if rep.sensitivity:
        print(sensitivity_table(rep), "\n")
    if rep.scale:
        print(scale_table(rep), "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        machine = _machine()
        data = to_json(rep, command, machine, runtime)
        data["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        (args.out / "goodput.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "goodput.md").write_text(render_markdown(rep, command, machine, runtime))
        if not args.no_plot:
            write_plot(rep, args.out / "goodput.png")
        print(f"wrote {args.out}/goodput.json, goodput.md" + ("" if args.no_plot else ", goodput.png"))
    return 0
