"""A Lightning replacement's catch-up: the seek against the re-read of the DataLoader, by fault step.

examples/lightning_gpt.py runs on 2 ranks with 1 spare, ``checkpointless run --inject
kill:rank=1:step=F``, with ``CheckpointlessStrategy(catch_up="seek")`` and with
``catch_up="reread"`` (the walk through Lightning's loop from batch 0 that the seek replaces),
for each F in ``--fault-steps``. The replacement logs how long it took from holding the received
state to beginning step F's training ("caught up with step F in X s (Y s CPU)": wall clock, and
its process's CPU time, which other work on a shared machine leaves nearly as it is), and prints
how many samples it read against the batches it trained. Both ways, every F, in each round (interleaved).

Issue 38's target: the seek's catch-up at step 2,000 within 2x of that at step 20.

    .venv/bin/python benchmarks/lightning_catch_up.py [--fault-steps 20,2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

EXAMPLE = bl.REPO / "examples" / "lightning_gpt.py"
WAYS = ("seek", "reread")
# a small model: the job has to reach step 2,000 before the fault, on 2 shared cores
MODEL = ["--dim", "16", "--layers", "1", "--heads", "1", "--seq-len", "8", "--global-batch", "16"]
CAUGHT_UP = re.compile(r"caught up with step (\d+) in ([\d.]+) s \(([\d.]+) s CPU\)")
HOW = re.compile(r"Lightning's loop catches up from \d+ (by seeking|by re-reading)")
READS = re.compile(r"reads rank=1 samples=(\d+) trained=(\d+)x(\d+)")


def output(job: Path) -> str:
    logs = (job / "stdout.log", job / "stderr.log")
    return "".join(p.read_text(errors="replace") for p in logs if p.exists())


def run_once(a: argparse.Namespace, way: str, fault_step: int, work: Path) -> dict[str, Any]:
    cmd = [bl.PYTHON, "-m", "checkpointless", "run", "--nproc", "2", "--spares", "1"]
    cmd += ["--run-dir", str(work / "cl"), "--inject", f"kill:rank=1:step={fault_step}"]
    cmd += [str(EXAMPLE), "--steps", str(fault_step + a.after), *MODEL, "--catch-up", way, "--print-reads"]
    fin = bl.run_job(
        cmd, work / "job", timeout=a.run_timeout, env=dict(os.environ) | {"PYTHONUNBUFFERED": "1"}
    )
    text = output(work / "job")
    if fin.rc != 0:
        return {"error": "timed out" if fin.timed_out else f"exit code {fin.rc}", "wall_s": fin.wall_s}
    caught, how, reads = CAUGHT_UP.search(text), HOW.search(text), READS.search(text)
    if caught is None or how is None or reads is None:
        return {"error": "no catch-up line from the replacement", "wall_s": fin.wall_s}
    samples, trained, per_batch = (int(x) for x in reads.groups())
    return {
        "catch_up_s": float(caught.group(2)),
        "catch_up_cpu_s": float(caught.group(3)),
        "joined_at": int(caught.group(1)),
        "how": how.group(1),
        "samples_read": samples,
        "samples_trained": trained * per_batch,
        "wall_s": fin.wall_s,
    }


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"ways": {}}
    for way in WAYS:
        by_step: dict[str, Any] = {}
        for f in a.steps_list:
            mine = [r for r in ok if r["way"] == way and r["fault_step"] == f]
            by_step[str(f)] = {
                "catch_up_s": bl.summary([r["catch_up_s"] for r in mine]),
                "catch_up_cpu_s": bl.summary([r["catch_up_cpu_s"] for r in mine]),
                "samples_read": bl.summary([r["samples_read"] for r in mine]),
                "samples_trained": bl.summary([r["samples_trained"] for r in mine]),
                "failed": [
                    r["error"] for r in runs if "error" in r and r["way"] == way and r["fault_step"] == f
                ],
            }
        out["ways"][way] = by_step
    lo, hi = str(min(a.steps_list)), str(max(a.steps_list))
    seek, reread = out["ways"]["seek"], out["ways"]["reread"]

    def med(way: dict[str, Any], f: str, key: str) -> float | None:
        value = way[f][key].get("median")
        return None if value is None else float(value)

    for key, suffix in (("catch_up_s", ""), ("catch_up_cpu_s", "_cpu")):
        seek_lo, seek_hi, reread_hi = med(seek, lo, key), med(seek, hi, key), med(reread, hi, key)
        if seek_lo and seek_hi:
            out[f"seek_high_over_low{suffix}"] = seek_hi / seek_lo
            out[f"target_within_2x{suffix}"] = seek_hi / seek_lo <= 2.0
        if seek_hi and reread_hi:
            out[f"reread_over_seek_at_high{suffix}"] = reread_hi / seek_hi
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault-steps", default="20,2000", help="comma-separated fault steps")
    ap.add_argument("--after", type=int, default=4, help="steps trained after the fault step")
    ap.add_argument("--rounds", type=int, default=2)
    bl.add_run_args(ap, run_timeout=600.0, out=str(bl.RESULTS / "lightning_catch_up.json"))
    a = ap.parse_args()
    a.steps_list = [int(s) for s in a.fault_steps.split(",")]

    machine = bl.machine_info()
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    with bl.cleanup_on_exit(), tempfile.TemporaryDirectory(prefix="lightning-catch-up-") as tmp:
        base = Path(a.work_dir) if a.work_dir else Path(tmp)
        for r in range(a.rounds):
            for f in a.steps_list:
                for way in bl.interleaved(WAYS, r):
                    work = base / f"{way}-{f}-{r}"
                    work.mkdir(parents=True, exist_ok=True)
                    row = run_once(a, way, f, work)
                    runs.append({"way": way, "fault_step": f, "round": r, **row})
                    bl.say(f"round {r} {way} step {f}: " + json.dumps(row))
    machine["bench_wall_s"] = time.monotonic() - t0
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    params = {k: v for k, v in vars(a).items() if k != "steps_list"}
    result: dict[str, Any] = {
        "benchmark": "lightning_catch_up",
        "command": "python benchmarks/lightning_catch_up.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": params | {"model": MODEL},
        "runs": runs,
        "summary": summarize(a, runs),
    }
    print(json.dumps(result["summary"], indent=2))
    bl.save_result(a.out, result)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
