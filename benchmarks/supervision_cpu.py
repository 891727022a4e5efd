"""The CPU that supervision itself takes: a job whose steps do no work, per process and per thread.

A training step on a host with cores to spare does not notice a launcher, heartbeats and a hot
spare; on a small machine whose ranks use every core, every millisecond of their CPU is one the
ranks lose. This runs ``checkpointless run --nproc N --spares 1`` on a script whose step only
sleeps (``--step-s``, default 0.15 s: about the FSDP 1x2 benchmark's step on 2 cores) around a
tiny tracked model, so what is left is the supervision: the launcher's loop, the workers'
bookkeeping per step (``job.steps()``, the commit, its event), their heartbeat, key-server and
control threads, gloo's own threads, the idle spare, the fork template and the reaper.

Each thread's CPU is read from ``/proc/<pid>/task/<tid>/stat`` at the start and the end of a
steady window (``--window`` seconds once the first step has committed and ``--settle`` seconds
more have passed), and reported as milliseconds of CPU per second of wall time, per role
(launcher, rank, spare, template, reaper) and per thread kind. Kernel accounting is by 10 ms
ticks, so a thread that wakes briefly and often is charged statistically: use windows of 15 s
or more, and ``--repeats`` to see the spread.

``--src DIR`` runs another checkout's ``src`` (e.g. a ``git worktree`` of an older commit) for a
side-by-side figure on the same machine in one run.

    .venv/bin/python benchmarks/supervision_cpu.py                   # ~1 min
    .venv/bin/python benchmarks/supervision_cpu.py --src /tmp/old/src --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

SCRIPT = """\
import os, time
import torch
import checkpointless as cl

job = cl.init()
model = torch.nn.Linear(8, 8)
job.track(model=model)
for step in job.steps(int(os.environ["SUP_STEPS"])):
    with step:
        time.sleep(float(os.environ["SUP_STEP_S"]))
"""


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Every thread of ``pid``: its name and its user + system ticks so far."""
    out: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        f = stat[stat.rfind(")") + 2 :].split()
        out[int(task.name)] = (name, int(f[11]) + int(f[12]))
    return out


def roles(run_dir: Path, launcher: int) -> dict[int, str]:
    """pid -> role, from the job's events (spawn and fork_server) and the process tree."""
    found: dict[int, str] = {launcher: "launcher"}
    for e in bl.read_jsonl(run_dir / "events.jsonl"):
        if e.get("event") == "fork_server":
            found[int(e["pid"])] = "template"
        elif e.get("event") == "spawn":
            found[int(e["pid"])] = "rank" if e.get("role") == "worker" else "spare"
    for pid in bl.process_tree(launcher):
        found.setdefault(pid, "reaper")
    return found


def kind(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main thread"
    return "gloo threads" if name.startswith("gloo") else "other threads"


def one_run(a: argparse.Namespace, work: Path, i: int) -> dict[str, Any]:
    run_dir = work / f"run-{i}"
    script = work / "sleepy_job.py"
    script.write_text(SCRIPT)
    steps = int((a.settle + a.window + 10.0) / a.step_s)
    env = bl.bench_env(1)
    env["PYTHONPATH"] = str(a.src)
    env.update(SUP_STEPS=str(steps), SUP_STEP_S=str(a.step_s))
    cmd = [sys.executable, "-m", "checkpointless", "run", "--nproc", str(a.nproc), "--spares", "1"]
    cmd += ["--run-dir", str(run_dir), "--port-base", str(a.port_base), "--port-range", "200", str(script)]
    with (work / f"run-{i}.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        first = run_dir / "rank-0.jsonl"  # its first line is step 0's commit
        while not (first.exists() and first.stat().st_size):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job never committed a step; see {work}/run-{i}.log")
            time.sleep(0.1)
        time.sleep(a.settle)
        who = roles(run_dir, proc.pid)
        t0 = time.monotonic()
        before = {pid: thread_ticks(pid) for pid in who}
        time.sleep(a.window)
        after = {pid: thread_ticks(pid) for pid in who}
        wall = time.monotonic() - t0
    finally:
        bl.kill_tree(proc.pid, grace=5.0)
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    per_role: dict[str, float] = {}
    per_kind: dict[str, float] = {}
    for pid, role in who.items():
        for tid, (name, ticks) in after.get(pid, {}).items():
            spent = (ticks - before.get(pid, {}).get(tid, (name, ticks))[1]) * tick_ms / wall
            per_role[role] = per_role.get(role, 0.0) + spent
            k = f"{role}: {kind(pid, tid, name)}"
            per_kind[k] = per_kind.get(k, 0.0) + spent
    return {"wall_s": round(wall, 2), "roles_ms_per_s": per_role, "threads_ms_per_s": per_kind}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=0.15)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--src", type=Path, default=bl.REPO / "src", help="the checkout's src to run")
    ap.add_argument("--port-base", type=int, default=47600)
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    a = ap.parse_args()
    if a.window < 5 or a.step_s <= 0 or a.nproc < 1 or a.repeats < 1:
        raise SystemExit("--window must be >= 5 s, --step-s > 0, --nproc and --repeats >= 1")
    info = bl.machine_info()
    with tempfile.TemporaryDirectory(prefix="cl-supervision-") as tmp:
        runs = [one_run(a, Path(tmp), i) for i in range(a.repeats)]
    keys = sorted({k for r in runs for k in r["threads_ms_per_s"]})
    total = [sum(r["roles_ms_per_s"].values()) for r in runs]
    print(f"supervision CPU, {a.nproc} ranks + 1 spare, steps of {a.step_s} s sleep, src {a.src}")
    for k in keys:
        vals = [r["threads_ms_per_s"].get(k, 0.0) for r in runs]
        print(f"  {k:32s} {statistics.median(vals):6.1f} ms/s  ({', '.join(f'{v:.1f}' for v in vals)})")
    print(f"  {'total':32s} {statistics.median(total):6.1f} ms/s  ({', '.join(f'{v:.1f}' for v in total)})")
    if a.out is not None:
        bl.write_json(a.out, {"machine": info, "args": {k: str(v) for k, v in vars(a).items()}, "runs": runs})
        print(json.dumps({"wrote": str(a.out)}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
