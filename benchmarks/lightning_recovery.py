"""Recovery of the Lightning example: CheckpointlessStrategy against Lightning's own restart path.

Both designs run examples/lightning_gpt.py on 2 ranks with the same model, data and seed, and lose
rank 1 to a SIGKILL right after step F has begun:

* checkpointless: ``checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=F``;
* Lightning's path: ``torchrun --nproc-per-node 2 --max-restarts 3`` with ``strategy="ddp"``,
  ``ModelCheckpoint(every_n_train_steps=5, save_last=True)`` and ``fit(ckpt_path="last")`` on the
  restart; this script SIGKILLs the worker with RANK=1 when rank 0 reports F steps done.

Downtime is from the kill to the first step completed after it (rank 0's wall clock; both
processes run on this host). Lost steps are the completed steps computed again. Medians of --repeats:

    .venv/bin/python benchmarks/lightning_recovery.py [--fault-step 42] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_gpt.py"
# about 0.1 s a step on 2 cores: the fault hits seconds after the start, once the spare has started
MODEL = ["--dim", "128", "--layers", "4", "--heads", "4", "--seq-len", "64", "--global-batch", "16"]


def step_times(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in re.findall(r"steptime (\d+) ([\d.]+)", text)]


def first_step_after(
    times: list[tuple[int, float]], t0: float, ok: Callable[[int], bool]
) -> tuple[int, float]:
    """The first step end after t0 among the steps ``ok`` accepts (rank 0 may still report the
    step before the fault a moment after the fault fired on rank 1)."""
    later = [(s, t) for s, t in times if t > t0 and ok(s)]
    if not later:
        raise SystemExit("no step completed after the fault")
    return later[0]


def checkpointless(a: argparse.Namespace, work: Path) -> dict[str, float | int]:
    cmd = [sys.executable, "-m", "checkpointless", "run", "--nproc", "2", "--spares", "1"]
    cmd += ["--run-dir", str(work / "cl"), "--inject", f"kill:rank=1:step={a.fault_step}"]
    cmd += [
        str(EXAMPLE),
        "--steps",
        str(a.steps),
        *MODEL,
        "--step-times",
        "--ckpt-dir",
        str(work / "cl.ckpt"),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"checkpointless run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    events = [json.loads(x) for x in (work / "cl" / "events.jsonl").read_text().splitlines() if x.strip()]
    fired = next(e["fired_at"] for e in events if e["event"] == "fault_injected")
    # "steptime S" means S steps done: the fault step F is done at S = F + 1
    step, t = first_step_after(step_times(out.stdout + out.stderr), fired, lambda s: s > a.fault_step)
    # a step that ended after the fault but was the fault step itself was computed once: none lost
    return {"downtime_s": t - fired, "first_step_after": step, "lost_steps": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank1_child(parent: int) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().split()
            if int(stat[3]) == parent and b"\0RANK=1\0" in b"\0" + (d / "environ").read_bytes():
                return int(d.name)
        except OSError:
            continue
    return None


def lightning_restart(a: argparse.Namespace, work: Path) -> dict[str, float | int]:
    torchrun = Path(sys.executable).with_name("torchrun")
    # torchrun's default (static) rendezvous on a free port: with c10d, Lightning's restarted
    # workers hung in init_process_group here
    cmd = [str(torchrun), "--nproc-per-node", "2", "--max-restarts", "3"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += [str(EXAMPLE), "--strategy", "ddp", "--devices", "2", "--steps", str(a.steps), *MODEL]
    cmd += ["--step-times", "--resume", "--ckpt-dir", str(work / "lt.ckpt")]
    work.mkdir(parents=True, exist_ok=True)
    log = work / "torchrun.out"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    killed_at = None
    deadline = time.monotonic() + 180  # a restart that hangs counts as failed
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if killed_at is None and any(s == a.fault_step for s, _ in step_times(text)):
                pid = rank1_child(proc.pid)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
            time.sleep(0.02)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # killed below, and reported as a failed run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    if proc.returncode or killed_at is None:  # also a run killed at the deadline
        raise SystemExit(f"torchrun run failed (rc {proc.returncode}, killed {killed_at}):\n{text[-3000:]}")
    # after the restart, steps resume from the last checkpoint, at or before the fault step
    step, t = first_step_after(step_times(text), killed_at, lambda s: s <= a.fault_step)
    done_before = a.fault_step  # steps 0..F-1 had completed (global_step F reported)
    return {"downtime_s": t - killed_at, "first_step_after": step, "lost_steps": done_before - (step - 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=42)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows: dict[str, list[dict[str, float | int]]] = {"checkpointless": [], "torchrun+ckpt": []}
    failed = 0
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="lightning-bench-") as tmp:
            rows["checkpointless"].append(checkpointless(a, Path(tmp)))
            for attempt in range(3):
                # Lightning's gloo start-up here sometimes fails to connect its full mesh even
                # after torchrun's restarts; such a run is counted and run again
                try:
                    rows["torchrun+ckpt"].append(lightning_restart(a, Path(tmp) / f"t{attempt}"))
                    break
                except SystemExit as e:
                    failed += 1
                    print(f"torchrun run failed outright ({str(e).splitlines()[0]}); again", flush=True)
            else:
                raise SystemExit("torchrun failed 3 times in a row")
        print(
            f"repeat {i}: " + ", ".join(f"{k} {v[-1]['downtime_s']:.2f} s" for k, v in rows.items()),
            flush=True,
        )
    med = {k: statistics.median(float(r["downtime_s"]) for r in v) for k, v in rows.items()}
    for k, v in rows.items():
        spread = ", ".join(f"{float(r['downtime_s']):.2f}" for r in v)
        print(f"{k:15s} downtime median {med[k]:.2f} s [{spread}]  lost steps {[r['lost_steps'] for r in v]}")
    print(
        f"ratio {med['checkpointless'] / med['torchrun+ckpt']:.3f}; torchrun runs that failed outright: {failed}"
    )


if __name__ == "__main__":
    main()
