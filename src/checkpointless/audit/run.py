"""``checkpointless audit``: run a script briefly fault-free twice, then with faults, and compare
every rank's per-step fingerprints (compare.py judges; this module runs the jobs).

Each run is a ``checkpointless run`` of its own (a subprocess of this command line), with
``$CHECKPOINTLESS_AUDIT_DIR`` set so that its processes write fingerprints
(recovery/fingerprint.py) and ``$CHECKPOINTLESS_AUDIT_STEPS`` so that it ends after the first K
steps. Exit status: 0 when everything matches, 1 with a report when something differs, 2 for bad
input.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from checkpointless.audit.compare import Report, RunPrints, judge, parse_lines
from checkpointless.config import ENV
from checkpointless.errors import ConfigError

__all__ = ["AuditSettings", "choose_faults", "command", "main", "run_audit"]

KINDS = ("kill", "raise")


@dataclass(frozen=True)
class AuditSettings:
    script: Path
    script_args: tuple[str, ...]
    nproc: int = 2
    steps: int = 8
    fault_runs: int = 2
    seed: int = 0
    run_dir: Path | None = None
    timeout: float = 300.0

    def check(self) -> None:
        if not self.script.is_file():
            raise ConfigError(f"the script {str(self.script)!r} is not a file")
        if self.nproc < 2:
            raise ConfigError(f"--nproc {self.nproc} must be at least 2 (a fault needs a survivor)")
        if self.steps < 3:
            raise ConfigError(f"--steps {self.steps} must be at least 3 (faults fall in steps 2..K-1)")
        if self.fault_runs < 0:
            raise ConfigError(f"--fault-runs {self.fault_runs} must be 0 or more")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout {self.timeout} must be positive")


def choose_faults(count: int, steps: int, nproc: int, seed: int) -> list[str]:
    """``count`` faults (in the ``--inject`` syntax), one per run: a kill or an exception, at a
    step in [2, steps - 1] on a rank, drawn from ``seed`` (the same seed, the same faults)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rnd.choice(KINDS)
        out.append(f"{kind}:rank={rnd.randrange(nproc)}:step={rnd.randint(2, steps - 1)}")
    return out


def command(s: AuditSettings, where: Path, fault: str | None) -> list[str]:
    """The ``checkpointless run`` command line of one run into ``where``."""
    cmd = [
        sys.executable,
        "-m",
        "checkpointless",
        "run",
        "--nproc",
        str(s.nproc),
        "--run-dir",
        str(where / "run"),
    ]
    # a spare takes a killed rank's place; the fault-free runs need none
    cmd += ["--spares", "1" if fault else "0"]
    if fault:
        cmd += ["--inject", fault]
    # "{run}" in an argument: this run's own folder, so that no run resumes from a file (a
    # checkpoint, a snapshot) that an earlier run wrote
    cmd += [str(s.script), *(a.replace("{run}", str(where)) for a in s.script_args)]
    return cmd


def _launch(s: AuditSettings, where: Path, fault: str | None) -> int:
    """One ``checkpointless run`` of the script into ``where``; its exit code."""
    cmd = command(s, where, fault)
    env = {**os.environ, ENV.AUDIT_DIR: str(where / "fingerprints"), ENV.AUDIT_STEPS: str(s.steps)}
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "output.txt", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout=s.timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the launcher then stops its workers and spares and cleans up
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 124


def read_prints(label: str, where: Path, rc: int, fault: str | None) -> RunPrints:
    fired = fault is None or _fault_fired(where / "run" / "events.jsonl")
    run = RunPrints(label, fault, rc, fired)
    for f in sorted((where / "fingerprints").glob("fingerprints-*.jsonl")):
        for fp in parse_lines(f.read_text().splitlines()):
            run.add(fp)
    return run


def _fault_fired(events: Path) -> bool:
    if not events.is_file():
        return False
    for line in events.read_text().splitlines():
        try:
            if json.loads(line).get("event") == "fault_injected":
                return True
        except ValueError:  # a line cut short by the launcher's own end
            continue
    return False


def run_audit(s: AuditSettings, say: Callable[[str], None] = print) -> Report:
    s.check()
    base = s.run_dir if s.run_dir is not None else default_run_dir()
    base.mkdir(parents=True, exist_ok=True)
    runs: list[RunPrints] = []
    plan: list[tuple[str, str | None]] = [("fault-free-1", None), ("fault-free-2", None)]
    plan += [
        (f"fault-{i + 1}", f) for i, f in enumerate(choose_faults(s.fault_runs, s.steps, s.nproc, s.seed))
    ]
    report: Report | None = None
    for i, (label, fault) in enumerate(plan):
        if i == 2:
            # the fault-free runs differ: a faulted run could not be judged, so none is run
            report = judge(runs[0], runs[1], [])
            if not report.deterministic:
                break
        say(f"audit: {label}{' (' + fault + ')' if fault else ''} ...")
        t0 = time.monotonic()
        rc = _launch(s, base / label, fault)
        runs.append(read_prints(label, base / label, rc, fault))
        say(f"audit: {label} exit {rc} in {time.monotonic() - t0:.1f} s")
    if report is None or report.deterministic:
        report = judge(runs[0], runs[1], runs[2:])
    _write_json(base / "audit.json", s, report)
    return report


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("audit-%Y%m%d-%H%M%S")


def _write_json(path: Path, s: AuditSettings, report: Report) -> None:
    doc = {
        "ok": report.ok,
        "script": str(s.script),
        "script_args": list(s.script_args),
        "nproc": s.nproc,
        "steps": s.steps,
        "seed": s.seed,
        "deterministic": report.deterministic,
        "runs": list(report.runs),
        "findings": [asdict(f) for f in report.findings],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def format_report(report: Report, run_dir: Path) -> str:
    lines = [f"{'run':<14} {'fault':<24} {'first difference':<26} cause"]
    for f in report.findings:
        where = (
            f"step {f.difference.step}, rank {f.difference.rank} ({f.difference.what})"
            if f.difference
            else "-"
        )
        lines.append(f"{f.label:<14} {f.fault or '-':<24} {where:<26} {f.cause}")
    if report.ok:
        lines = [
            f"audit: OK: {len(report.runs)} runs agree on every rank at each of the {report.steps} steps"
        ]
    elif not report.deterministic and any(f.difference is None for f in report.findings):
        lines.insert(0, "audit: FAILED: a fault-free run failed (see its output.txt under the run dir)")
    elif not report.deterministic:
        lines.insert(
            0, "audit: FAILED: not deterministic without faults (the fault-free runs already differ)"
        )
    else:
        lines.insert(0, "audit: FAILED: a faulted run differs from the fault-free run")
    lines.append(f"report: {run_dir / 'audit.json'}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> AuditSettings:
    ap = argparse.ArgumentParser(
        prog="checkpointless audit",
        description="Run SCRIPT briefly fault-free twice, then with one fault per run, and compare "
        "every rank's per-step fingerprints (gradients, parameters and optimizer state).",
    )
    ap.add_argument("--nproc", type=int, default=2, metavar="N", help="data-parallel workers (default 2)")
    ap.add_argument("--steps", type=int, default=8, metavar="K", help="steps per run (default 8)")
    ap.add_argument("--fault-runs", type=int, default=2, metavar="M", help="runs with a fault (default 2)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="picks the faults (default 0)")
    ap.add_argument("--run-dir", type=Path, metavar="D", help="where the runs and audit.json go")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per run (default 300)")
    ap.add_argument("script", type=Path, help="the training script (adopted)")
    ap.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="passed to the script, with {run} replaced by each run's own folder (for its output files)",
    )
    a = ap.parse_args(argv)
    return AuditSettings(
        a.script, tuple(a.script_args), a.nproc, a.steps, a.fault_runs, a.seed, a.run_dir, a.timeout
    )


def main(argv: list[str]) -> int:
    s = parse_args(argv)
    if s.run_dir is None:
        s = replace(s, run_dir=default_run_dir())
    try:
        report = run_audit(s)
    except ConfigError as e:
        print(f"checkpointless audit: error: {e}", file=sys.stderr)
        return 2
    assert s.run_dir is not None
    print(format_report(report, s.run_dir))
    return 0 if report.ok else 1
