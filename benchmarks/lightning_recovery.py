"""Recovery of the Lightning example: CheckpointlessStrategy against Lightning's own restart path.

Both designs run examples/lightning_gpt.py on 2 ranks with the same model, data and seed, and lose
rank 1 to a SIGKILL right after step F has begun:

* checkpointless: ``checkpointless run --nproc 2 --spares 1 --inject kill:rank=1:step=F``;
* Lightning's path: ``torchrun --nproc-per-node 2 --max-restarts 3`` with ``strategy="ddp"``,
  ``ModelCheckpoint(every_n_train_steps=5, save_last=True)`` and ``fit(ckpt_path="last")`` on the
  restart; this script SIGKILLs the worker with RANK=1 when rank 0 reports F steps done.

Downtime is from the kill to the first step completed after it (rank 0's wall clock; both
processes run on this host). Lost steps are the completed steps computed again. Rounds are
interleaved (the harness's order); the ratio is the geometric mean of the rounds' paired ratios
with a bootstrap interval. Writes ``benchmarks/results/lightning_recovery.json``.

    .venv/bin/python benchmarks/lightning_recovery.py [--fault-step 42] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

EXAMPLE = bl.REPO / "examples" / "lightning_gpt.py"
DESIGNS = ("checkpointless", "torchrun")
# about 0.1 s a step on 2 cores: the fault hits seconds after the start, once the spare has started
MODEL = ["--dim", "128", "--layers", "4", "--heads", "4", "--seq-len", "64", "--global-batch", "16"]
# Lightning's gloo start-up here sometimes fails to connect its full mesh even after torchrun's
# restarts: such a run is kept as a failed run and the round's torchrun side runs again
TORCHRUN_ATTEMPTS = 3


def step_times(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in re.findall(r"steptime (\d+) ([\d.]+)", text)]


def first_step_after(
    times: list[tuple[int, float]], t0: float, ok: Callable[[int], bool]
) -> tuple[int, float] | None:
    """The first step end after t0 among the steps ``ok`` accepts (rank 0 may still report the
    step before the fault a moment after the fault fired on rank 1)."""
    later = [(s, t) for s, t in times if t > t0 and ok(s)]
    return later[0] if later else None


def job_env() -> dict[str, str]:
    """This process's environment, as the script's earlier runs had it: under the harness's
    (one thread, gloo on ``lo``, torchrun's store not shared) the workers torchrun restarted hung
    in ``init_process_group`` twice out of two here (cause not found)."""
    return dict(os.environ) | {"PYTHONUNBUFFERED": "1"}


def output(job: Path) -> str:
    logs = (job / "stdout.log", job / "stderr.log")
    return "".join(p.read_text(errors="replace") for p in logs if p.exists())


def run_checkpointless(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [bl.PYTHON, "-m", "checkpointless", "run", "--nproc", "2", "--spares", "1"]
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
    fin = bl.run_job(cmd, work / "job", timeout=a.run_timeout, env=job_env())
    if fin.rc != 0:
        return {"error": "timed out" if fin.timed_out else f"exit code {fin.rc}", "wall_s": fin.wall_s}
    events = [json.loads(x) for x in (work / "cl" / "events.jsonl").read_text().splitlines() if x.strip()]
    fired = next((e["fired_at"] for e in events if e["event"] == "fault_injected"), None)
    if fired is None:
        return {"error": "no fault_injected event", "wall_s": fin.wall_s}
    # "steptime S" means S steps done: the fault step F is done at S = F + 1
    first = first_step_after(step_times(output(work / "job")), fired, lambda s: s > a.fault_step)
    if first is None:
        return {"error": "no step completed after the fault", "wall_s": fin.wall_s}
    # a step that ended after the fault but was the fault step itself was computed once: none lost
    return {
        "downtime_s": first[1] - fired,
        "first_step_after": first[0],
        "lost_steps": 0,
        "wall_s": fin.wall_s,
    }


def rank1_worker(tag: str) -> int | None:
    """The training process with RANK=1 among this run's (the tag is in their environment)."""
    want = b"\0RANK=1\0", f"\0LIGHTNING_BENCH_RUN={tag}\0".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            environ = b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        if all(w in environ for w in want):
            return int(d.name)
    return None


def torchrun_once(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    # torchrun's default (static) rendezvous on a free port: with c10d, Lightning's restarted
    # workers hung in init_process_group here
    cmd = [bl.TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "3"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}"]
    cmd += [str(EXAMPLE), "--strategy", "ddp", "--devices", "2", "--steps", str(a.steps), *MODEL]
    cmd += ["--step-times", "--resume", "--ckpt-dir", str(work / "lt.ckpt")]
    tag = uuid.uuid4().hex
    env = job_env() | {"LIGHTNING_BENCH_RUN": tag}
    job = work / "job"
    killed: list[float] = []
    stop = threading.Event()

    def kill_when_due() -> None:
        while not stop.is_set() and not killed:
            if any(s == a.fault_step for s, _ in step_times(output(job))):
                pid = rank1_worker(tag)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(time.time())
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_when_due, daemon=True)
    watcher.start()
    try:
        fin = bl.run_job(cmd, job, timeout=a.run_timeout, env=env)
    finally:
        stop.set()
        watcher.join(timeout=5)
    if fin.rc != 0 or not killed:  # also a restart that hung until the time limit
        return {"error": f"rc {fin.rc}, killed {bool(killed)}", "wall_s": fin.wall_s}
    # after the restart, steps resume from the last checkpoint, at or before the fault step
    first = first_step_after(step_times(output(job)), killed[0], lambda s: s <= a.fault_step)
    if first is None:
        return {"error": "no step completed after the kill", "wall_s": fin.wall_s}
    done_before = a.fault_step  # steps 0..F-1 had completed (global_step F reported)
    return {
        "downtime_s": first[1] - killed[0],
        "first_step_after": first[0],
        "lost_steps": done_before - (first[0] - 1),
        "wall_s": fin.wall_s,
    }


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    designs = {
        d: {
            "downtime_s": bl.summary([r["downtime_s"] for r in ok if r["design"] == d]),
            "lost_steps": bl.summary([r["lost_steps"] for r in ok if r["design"] == d]),
            "failed": [
                f"round {r['round']}: {r['error']}" for r in runs if r["design"] == d and "error" in r
            ],
        }
        for d in DESIGNS
    }
    paired = []
    for rnd in range(a.rounds):
        pair = {r["design"]: r for r in ok if r["round"] == rnd}
        if len(pair) == 2 and pair["torchrun"]["downtime_s"] > 0:
            paired.append(pair["checkpointless"]["downtime_s"] / pair["torchrun"]["downtime_s"])
    return {"designs": designs, "ratio_downtime": bl.ratio_ci(paired), "target_ratio": 0.1}


def print_report(s: dict[str, Any]) -> None:
    rows = [
        [d, bl.fmt_spread(s["designs"][d]["downtime_s"]), bl.fmt_spread(s["designs"][d]["lost_steps"], 0)]
        for d in DESIGNS
    ]
    print(bl.table(["design", "downtime s", "steps lost"], rows))
    c = s["ratio_downtime"]
    print(
        f"ratio downtime: {bl.fmt(c['geomean'], 3)} [{bl.fmt(c['lo'], 3)}-{bl.fmt(c['hi'], 3)}], n={c['n']}"
    )
    for d in DESIGNS:
        for f in s["designs"][d]["failed"]:
            print(f"{d} failed, {f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=42)
    ap.add_argument("--rounds", type=int, default=3)
    bl.add_run_args(ap, run_timeout=240.0, out=str(bl.RESULTS / "lightning_recovery.json"))
    a = ap.parse_args()

    machine = bl.machine_info()
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    with bl.cleanup_on_exit(), tempfile.TemporaryDirectory(prefix="lightning-bench-") as tmp:
        base = Path(a.work_dir) if a.work_dir else Path(tmp)
        for r in range(a.rounds):
            for design in bl.interleaved(DESIGNS, r):
                for attempt in range(1 if design == "checkpointless" else TORCHRUN_ATTEMPTS):
                    work = base / f"{design}-{r}-{attempt}"
                    work.mkdir(parents=True, exist_ok=True)
                    row = (run_checkpointless if design == "checkpointless" else torchrun_once)(a, work)
                    runs.append({"design": design, "round": r, "attempt": attempt, **row})
                    bl.say(
                        f"round {r} {design}: " + json.dumps({k: v for k, v in row.items() if k != "wall_s"})
                    )
                    if "error" not in row:
                        break
    machine["bench_wall_s"] = time.monotonic() - t0
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    result: dict[str, Any] = {
        "benchmark": "lightning_recovery",
        "command": "python benchmarks/lightning_recovery.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": vars(a),
        "runs": runs,
        "summary": summarize(a, runs),
    }
    print_report(result["summary"])
    bl.save_result(a.out, result)
    ok = {d: any(r["design"] == d and "error" not in r for r in runs) for d in DESIGNS}
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
