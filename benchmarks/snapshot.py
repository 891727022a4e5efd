"""Shared-memory snapshots: their steady-state cost, and the downtime of a restore from one.

Part 1 (in one process, no launcher): the example GPT (bench size: dim 128, 4 layers, AdamW) runs
its training step with a snapshot started as every step begins (the worst case, K=1) and without,
alternating blocks of steps. The snapshot goes through the job's own path (``collect_state``,
``SnapshotWriter.start``, the optimizer pre-hook waiting for the copy), and each block waits for
the last snapshot to be published, so the background hashing and renaming are counted too. Wall
time and process CPU time (which includes the writer thread) per snapshot give the cost; divided
by K steps it is the steady-state overhead of ``--snapshot-every K``.

Part 2 (real jobs under the launcher, 3 ranks): one rank SIGKILLed (a spare receives the state
from a peer) versus every rank SIGKILLed at once (every rank loads the snapshot); the launcher's
``recovery`` event gives the downtime and its phases.

    .venv/bin/python benchmarks/snapshot.py                  # ~2 min on a busy 2-core machine
    .venv/bin/python benchmarks/snapshot.py --skip-downtime  # part 1 only (~20 s)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import statebench as sb

from checkpointless.state.shm_dir import snapshot_path
from checkpointless.state.shm_snapshot import SnapshotWriter
from checkpointless.state.snapshot import capture_rng, collect_state
from checkpointless.state.staging import guarded_pointers

__all__ = ["main"]

REPO = sb.REPO


def cost(steps: int, blocks: int, bar: tqdm[Any]) -> dict[str, Any]:
    m = sb.bench_model()
    work = Path(
        tempfile.mkdtemp(prefix="cl-snapbench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    writer = SnapshotWriter(work / "snapshots", every=1)
    waits: list[float] = []
    m.opt.register_step_pre_hook(lambda *a: waits.append(writer.wait_copied(60.0)))
    step_no = 0

    def block(snap: bool) -> tuple[float, float]:
        def one_step() -> None:
            nonlocal step_no
            step_no += 1
            if snap:
                writer.start(
                    step_no, collect_state(m.objects, step_no, capture_rng()), guarded_pointers([m.opt])
                )
            m.step()

        def settle() -> None:
            writer.wait_idle(60.0)
            bar.update()

        return sb.timed_steps(steps, one_step, settle)

    off, on = sb.alternate(blocks, block)
    info = writer.take_published()
    for f in (work / "snapshots").iterdir():
        f.unlink()
    (work / "snapshots").rmdir()
    work.rmdir()
    step_s = statistics.median(w for w, _ in off)
    extra = statistics.median(w for w, _ in on) - step_s
    extra_cpu = statistics.median(c for _, c in on) - statistics.median(c for _, c in off)
    return {
        "state_file_bytes": info.nbytes if info else None,
        "step_s": step_s,
        "extra_wall_s_per_snapshot": extra,
        "extra_cpu_s_per_snapshot": extra_cpu,
        "optimizer_wait_s_median": statistics.median(waits) if waits else None,
        "overhead_pct": {k: 100 * max(extra, extra_cpu) / (k * step_s) for k in (1, 5, 10, 20, 50)},
    }


def _job(work: Path, corpus: Path, name: str, kill_all: bool) -> dict[str, Any]:
    run_dir = work / name
    launcher_args = ["--snapshot-every", "2", "--inject", "slow:rank=0:step=6:seconds=4"]

    def workers_once_saved(text: str) -> list[int] | None:
        events = [json.loads(x) for x in text.splitlines()]
        # the job's private shared-memory directory (its name is keyed by the launcher's secret)
        shm = next((e["shm"] for e in events if e["event"] == "job_start"), None)
        if shm is None or not snapshot_path(Path(shm) / "snapshots", 6).exists():
            return None  # the kill waits for the step-6 snapshot to be published
        # the workers from the launcher's spawn events (the fork server starts them, so the pid
        # file's processes no longer are the workers; spares spawn with another role)
        return [int(e["pid"]) for e in events if e["event"] == "spawn" and e["role"] == "worker"]

    cmd = sb.job_command(run_dir, corpus, launcher_args)
    return sb.run_killed_job(run_dir, cmd, workers_once_saved, kill_all)


def downtime(bar: tqdm[Any]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cl-snapbench-jobs-"))
    try:
        corpus = sb.prepare_corpus(work)
        out = {}
        for label, name, kill_all in (
            ("peer (1 rank killed)", "peer", False),
            ("snapshot (3 ranks killed)", "snap", True),
        ):
            out[label] = _job(work, corpus, name, kill_all=kill_all)
            bar.update()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each arm, alternating")
    ap.add_argument("--skip-downtime", action="store_true")
    a = ap.parse_args()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    # a bar over the timed blocks and the jobs, on stderr and only on a terminal; stdout is unchanged
    total = 2 * a.blocks + 1 + (0 if a.skip_downtime else 2)
    with tqdm(total=total, desc="snapshot", unit="part", disable=None, leave=False) as bar:
        result["cost"] = cost(a.steps, a.blocks, bar)
        with tqdm.external_write_mode():
            print(json.dumps(result["cost"], indent=1), flush=True)
        if not a.skip_downtime:
            result["downtime"] = downtime(bar)
    if "downtime" in result:
        print(json.dumps(result["downtime"], indent=1), flush=True)
    out = REPO / "benchmarks" / "results" / "snapshot.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
