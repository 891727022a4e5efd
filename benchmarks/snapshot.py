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
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpointless.data import make_synthetic_corpus, prepare_main
from checkpointless.state.shm_snapshot import SnapshotWriter, guarded_pointers, snapshot_dir, snapshot_path
from checkpointless.state.snapshot import capture_rng, collect_state

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cost(steps: int, blocks: int, bar: tqdm[Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = _gpt_module().GPT(256, 128, 4, 4, 64, 0.1)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    objects: dict[str, Any] = {"model": gpt, "optimizer": opt}
    work = Path(
        tempfile.mkdtemp(prefix="cl-snapbench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    writer = SnapshotWriter(work / "snapshots", every=1)
    waits: list[float] = []
    opt.register_step_pre_hook(lambda *a: waits.append(writer.wait_copied(60.0)))
    x = torch.randint(0, 256, (8, 64))
    y = torch.randint(0, 256, (8, 64))
    step_no = 0

    def block(snap: bool) -> tuple[float, float]:
        nonlocal step_no
        t0, c0 = time.monotonic(), time.process_time()
        for _ in range(steps):
            step_no += 1
            if snap:
                writer.start(step_no, collect_state(objects, step_no, capture_rng()), guarded_pointers([opt]))
            loss = F.cross_entropy(gpt(x).reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        writer.wait_idle(60.0)
        bar.update()
        return (time.monotonic() - t0) / steps, (time.process_time() - c0) / steps

    block(False)  # warm-up
    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    for _ in range(blocks):
        off.append(block(False))
        on.append(block(True))
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
    cmd = [
        sys.executable, "-m", "checkpointless", "run", "--nproc", "3", "--spares", "3", "--run-dir", str(run_dir),
        "--snapshot-every", "2", "--inject", "slow:rank=0:step=6:seconds=4",
        str(EXAMPLE), "--steps", "12", "--dim", "128", "--layers", "4", "--heads", "4", "--seq-len", "64",
        "--global-batch", "12", "--data", str(corpus),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            ev = run_dir / "events.jsonl"
            if ev.exists() and ev.read_text().endswith("\n"):
                job = json.loads(ev.read_text().split("\n", 1)[0])["job"]
                if snapshot_path(snapshot_dir(job), 6).exists():
                    ranks = {}
                    for pid in map(int, (run_dir / "pids").read_text().split()):
                        try:
                            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                        except OSError:
                            continue
                        if b"CHECKPOINTLESS_ROLE=worker" in env:
                            ranks[len(ranks)] = pid
                    for i, pid in ranks.items():
                        if kill_all or i == 1:
                            os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.01)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    t.join(timeout=5)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rec = [e for e in events if e["event"] == "recovery"]
    keys = (
        "downtime_s",
        "collect_s",
        "rebuild_s",
        "transfer_s",
        "first_batch_s",
        "first_step_s",
        "transport",
    )
    return {"rc": proc.returncode, **({k: rec[-1].get(k) for k in keys} if rec else {"recovery": None})}


def downtime(bar: tqdm[Any]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cl-snapbench-jobs-"))
    make_synthetic_corpus(work / "corpus.jsonl", num_docs=400, seed=0)
    prepare_main([str(work / "corpus.jsonl"), "-o", str(work / "corpus.tokens"), "--quiet"])
    out = {}
    for label, name, kill_all in (
        ("peer (1 rank killed)", "peer", False),
        ("snapshot (3 ranks killed)", "snap", True),
    ):
        out[label] = _job(work, work / "corpus.tokens", name, kill_all=kill_all)
        bar.update()
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return out


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
