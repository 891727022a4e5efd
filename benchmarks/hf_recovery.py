"""Recovery of a Hugging Face Trainer job from a SIGKILL: CheckpointlessTrainer against Trainer's
own restart path, side by side on the same workload.

Both designs run examples/hf_trainer.py (a GPT-2 built from a config, data made in memory,
gradient accumulation 2, ``save_steps`` every K steps) on 2 ranks with the same model, data and
seed, and this script SIGKILLs rank 1 once rank 0 has ended F optimizer steps:

* checkpointless: ``checkpointless run --nproc 2 --spares 1`` and the script's
  ``CheckpointlessTrainer``; the kill waits, if need be, until the hot spare is ready (its start
  takes seconds on this machine, and a real job's fault comes long after it);
* Trainer's path: ``torchrun --nproc-per-node 2 --max-restarts 3`` with the plain ``Trainer``
  (DDP over gloo) and ``resume_from_checkpoint`` set to the newest ``checkpoint-N`` on each start.

The script's worker mode adds a Trainer callback (the example itself is unchanged): every rank
writes its pid as training begins, and rank 0 prints the wall-clock time each optimizer step
ends. Downtime is from the kill to the first step that ends after it; "back at the killed step"
is from the kill until the step that was running has ended again, which for Trainer's path
includes computing again the steps since its checkpoint. Rounds are interleaved; the ratio is
the geometric mean of the rounds' paired ratios with a bootstrap interval.

    .venv/bin/python benchmarks/hf_recovery.py                # 3 rounds, about 5 minutes on 2 cores
    .venv/bin/python benchmarks/hf_recovery.py --rounds 1     # a smoke run
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

EXAMPLE = bl.REPO / "examples" / "hf_trainer.py"
DESIGNS = ("checkpointless", "torchrun")
STEP_LINE = re.compile(r"^steptime (\d+) ([\d.]+)$", re.M)
SPARE_READY = re.compile(r"\[spare \d+\] spare \d+ ready")


# -- worker mode: the example with a step clock ----------------------------------------------------
def worker(argv: list[str]) -> None:
    """Run examples/hf_trainer.py's main() with a callback that prints when each step ends."""
    sys.argv = [str(EXAMPLE), *argv]
    sys.path.insert(0, str(EXAMPLE.parent))
    from hf_trainer import main  # type: ignore[import-not-found]
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            with open(os.environ["HF_BENCH_PIDFILE"], "a") as f:  # where the killer finds rank 1
                f.write(f"{args.process_index} {os.getpid()}\n")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                print(f"steptime {state.global_step} {time.time():.4f}", flush=True)

    main([StepClock()])


# -- the two designs ---------------------------------------------------------------------------
def example_args(a: argparse.Namespace, out_dir: Path) -> list[str]:
    return [
        "--steps", str(a.steps), "--accumulation", "2", "--batch", str(a.batch), "--seq-len", str(a.seq_len),
        "--layers", str(a.layers), "--dim", str(a.dim), "--samples", str(a.samples),
        "--save-steps", str(a.save_steps), "--output-dir", str(out_dir),
    ]  # fmt: skip


def step_ends(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in STEP_LINE.findall(text)]


def measure(steps: list[tuple[int, float]], killed_at: float) -> dict[str, Any]:
    """Downtime, time back at the killed step and steps computed again, from rank 0's step ends."""
    done = max((s for s, t in steps if t <= killed_at), default=0)  # step done + 1 was running
    after = [(s, t) for s, t in steps if t > killed_at]
    if not after:
        return {"error": "no step ended after the kill"}
    first, t_first = after[0]
    back = next((t for s, t in after if s >= done + 1), None)
    return {
        "killed_in_step": done + 1,
        "downtime_s": t_first - killed_at,
        "back_at_fault_step_s": None if back is None else back - killed_at,
        "first_step_after": first,
        "lost_steps": max(0, done - (first - 1)),
    }


def rank1_pid(pidfile: Path) -> int | None:
    """The first process that trained as rank 1 (each worker writes its rank and pid as it
    begins training; a replacement or a restarted worker writes a later line)."""
    lines = pidfile.read_text().split("\n") if pidfile.exists() else []
    pids = [int(p) for r, _, p in (line.partition(" ") for line in lines) if r == "1" and p]
    return pids[0] if pids else None


def run_killed(
    a: argparse.Namespace, work: Path, cmd: list[str], ready: Callable[[str], bool]
) -> dict[str, Any]:
    """Run ``cmd``; SIGKILL rank 1 once rank 0 has ended F steps and ``ready(the job's output)``."""
    job = work / "job"
    job.mkdir(parents=True, exist_ok=True)
    killed: list[float] = []
    stop = threading.Event()

    def output() -> str:
        logs = (job / "stdout.log", job / "stderr.log")
        return "".join(p.read_text(errors="replace") for p in logs if p.exists())

    def kill_when_due() -> None:
        while not stop.is_set() and not killed:
            text = output()
            if any(s >= a.fault_step for s, _ in step_ends(text)) and ready(text):
                pid = rank1_pid(work / "pids")
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(time.time())
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_when_due, daemon=True)
    watcher.start()
    try:
        fin = bl.run_job(cmd, job, timeout=a.run_timeout, env=env(work / "pids"))
    finally:
        stop.set()
        watcher.join(timeout=5)
    if fin.rc != 0 or not killed:
        return {"error": f"rc {fin.rc}, killed {bool(killed)}", "wall_s": fin.wall_s}
    return {**measure(step_ends(output()), killed[0]), "wall_s": fin.wall_s}


def run_checkpointless(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        bl.PYTHON, "-m", "checkpointless", "run", "--nproc", "2", "--spares", "1",
        "--run-dir", str(work / "run"), "--port-base", str(40000 + os.getpid() % 100 * 200),
        "--port-range", "200", str(Path(__file__).resolve()), "--worker", *example_args(a, work / "out"),
    ]  # fmt: skip
    return run_killed(a, work, cmd, ready=lambda text: SPARE_READY.search(text) is not None)


def run_torchrun(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        bl.TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}",
        str(Path(__file__).resolve()), "--worker", "--trainer", "plain", "--resume", "last",
        *example_args(a, work / "out"),
    ]  # fmt: skip
    return run_killed(a, work, cmd, ready=lambda text: True)


def env(pidfile: Path) -> dict[str, str]:
    e = bl.bench_env(threads=1)
    e.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    e["HF_BENCH_PIDFILE"] = str(pidfile)
    return e


# -- the benchmark -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--fault-step", type=int, default=100)
    ap.add_argument("--save-steps", type=int, default=40, help="Trainer's checkpoint interval K")
    ap.add_argument("--batch", type=int, default=4, help="per rank and micro-batch")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", type=int, default=1024)
    bl.add_run_args(ap, run_timeout=240.0, out=str(bl.RESULTS / "hf_recovery.json"))
    a = ap.parse_args()

    machine = bl.machine_info()
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    with bl.cleanup_on_exit(), tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        base = Path(a.work_dir) if a.work_dir else Path(tmp)
        for r in range(a.rounds):
            for design in bl.interleaved(DESIGNS, r):
                work = base / f"{design}-{r}"
                work.mkdir(parents=True, exist_ok=True)
                row = (run_checkpointless if design == "checkpointless" else run_torchrun)(a, work)
                runs.append({"design": design, "round": r, **row})
                bl.say(f"round {r} {design}: " + json.dumps({k: v for k, v in row.items() if k != "wall_s"}))
    machine["bench_wall_s"] = time.monotonic() - t0
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    result = {
        "benchmark": "hf_recovery",
        "command": "python benchmarks/hf_recovery.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": vars(a),
        "runs": runs,
        "summary": summarize(a, runs),
    }
    print_report(result["summary"])
    bl.save_result(a.out, result)


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    designs = {
        d: {
            "downtime_s": bl.summary([r["downtime_s"] for r in ok if r["design"] == d]),
            "back_at_fault_step_s": bl.summary([r["back_at_fault_step_s"] for r in ok if r["design"] == d]),
            "lost_steps": bl.summary([r["lost_steps"] for r in ok if r["design"] == d]),
            "failed": [
                f"round {r['round']}: {r['error']}" for r in runs if r["design"] == d and "error" in r
            ],
        }
        for d in DESIGNS
    }
    paired: dict[str, list[float]] = {"downtime": [], "back_at_fault_step": []}
    for rnd in range(a.rounds):
        pair = {r["design"]: r for r in ok if r["round"] == rnd}
        if len(pair) == 2:
            for key in paired:
                x, y = pair["checkpointless"][f"{key}_s"], pair["torchrun"][f"{key}_s"]
                if x and y:
                    paired[key].append(x / y)
    ratios = {k: bl.ratio_ci(v) for k, v in paired.items()}
    return {"designs": designs, "ratios": ratios, "target_ratio": 0.1}


def print_report(s: dict[str, Any]) -> None:
    rows = [
        [
            d,
            bl.fmt_spread(s["designs"][d]["downtime_s"]),
            bl.fmt_spread(s["designs"][d]["back_at_fault_step_s"]),
            bl.fmt_spread(s["designs"][d]["lost_steps"], 0),
        ]
        for d in DESIGNS
    ]
    print(bl.table(["design", "downtime s", "back at F s", "steps lost"], rows))
    for key, c in s["ratios"].items():
        print(
            f"ratio {key}: {bl.fmt(c['geomean'], 3)} [{bl.fmt(c['lo'], 3)}-{bl.fmt(c['hi'], 3)}], n={c['n']}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
