"""Durable DCP checkpoints: their steady-state cost, and the downtime of a restore from one.

Part 1 (in one process, no launcher): the example GPT (bench size: dim 128, 4 layers, AdamW) runs
its training step with a checkpoint started as every step begins (the worst case, K=1) and
without, alternating blocks of steps. The checkpoint goes through the job's own path
(``collect_state``, ``CheckpointWriter.start``, the optimizer pre-hook waiting for DCP's staging);
a save due while the previous one is still being written is skipped, as in a job, so part 1 also
reports how many were taken. Each block waits for the last save to be published, so DCP's
writing, fsync and the rename are counted too. Overhead of ``--checkpoint-every K`` = extra time
per save / (K x step).

Part 2 (real jobs under the launcher, 3 ranks, ``--snapshot-every 0 --checkpoint-every 3``, rank 0 sleeping 4 s as step 3 begins): one
rank SIGKILLed (a spare receives the state from a peer) versus every rank SIGKILLed at once (every
rank loads the checkpoint from disk); the launcher's ``recovery`` event gives the downtime.

    .venv/bin/python benchmarks/checkpoint.py                  # ~2 min on a busy 2-core machine
    .venv/bin/python benchmarks/checkpoint.py --skip-downtime  # part 1 only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
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

from checkpointless.data import make_synthetic_corpus, prepare_main
from checkpointless.state.durable import CheckpointEvery, CheckpointWriter, list_checkpoints
from checkpointless.state.shm_snapshot import guarded_pointers
from checkpointless.state.snapshot import capture_rng, collect_state

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cost(steps: int, blocks: int, every: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = _gpt_module().GPT(256, 128, 4, 4, 64, 0.1)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    objects: dict[str, Any] = {"model": gpt, "optimizer": opt}
    work = Path(tempfile.mkdtemp(prefix="cl-ckptbench-"))  # on disk, not /dev/shm: what a job writes
    writer = CheckpointWriter(work / "ck", CheckpointEvery(steps=every))
    waits: list[float] = []
    opt.register_step_pre_hook(lambda *a: waits.append(writer.wait_staged(60.0)))
    x = torch.randint(0, 256, (8, 64))
    y = torch.randint(0, 256, (8, 64))
    step_no = 0
    taken = 0
    sizes: list[int] = []
    totals: list[float] = []

    def block(save: bool) -> tuple[float, float, int]:
        nonlocal step_no, taken
        t0, c0 = time.monotonic(), time.process_time()
        n = 0
        for _ in range(steps):
            step_no += 1
            if save and writer.due(step_no, time.monotonic()):
                state = collect_state(objects, step_no, capture_rng())
                n += writer.start(step_no, state, guarded_pointers([opt]))
            loss = F.cross_entropy(gpt(x).reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            info = writer.take_published()
            if info is not None:
                sizes.append(info.nbytes)
                totals.append(info.total_s)
        writer.wait_idle(60.0)
        info = writer.take_published()
        if info is not None:
            sizes.append(info.nbytes)
            totals.append(info.total_s)
        taken += n
        return (time.monotonic() - t0) / steps, (time.process_time() - c0) / steps, n

    block(False)  # warm-up
    off: list[tuple[float, float, int]] = []
    on: list[tuple[float, float, int]] = []
    for _ in range(blocks):
        off.append(block(False))
        on.append(block(True))
    writer.close(60.0)
    shutil.rmtree(work, ignore_errors=True)
    step_s = statistics.median(w for w, _, _ in off)
    per_block = statistics.median(n for _, _, n in on) or 1
    # the extra time of a block, spread over the saves it actually took
    extra = (statistics.median(w for w, _, _ in on) - step_s) * steps / per_block
    extra_cpu = (
        (statistics.median(c for _, c, _ in on) - statistics.median(c for _, c, _ in off)) * steps / per_block
    )
    return {
        "checkpoint_bytes": sizes[-1] if sizes else None,
        "step_s": step_s,
        "saves_per_block": per_block,
        "save_total_s_median": statistics.median(totals) if totals else None,
        "extra_wall_s_per_save": extra,
        "extra_cpu_s_per_save": extra_cpu,
        "optimizer_wait_s_median": statistics.median(waits) if waits else None,
        "overhead_pct": {k: 100 * max(extra, extra_cpu) / (k * step_s) for k in (10, 20, 50, 100, 500)},
    }


def _job(work: Path, corpus: Path, name: str, kill_all: bool) -> dict[str, Any]:
    run_dir = work / name
    cmd = [
        sys.executable, "-m", "checkpointless", "run", "--nproc", "3", "--spares", "3", "--run-dir", str(run_dir),
        "--snapshot-every", "0", "--checkpoint-every", "3", "--inject", "slow:rank=0:step=3:seconds=4",
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
                events = [json.loads(x) for x in ev.read_text().splitlines()]
                if 3 in list_checkpoints(run_dir / "checkpoints" / events[0]["job"]):
                    workers = [
                        int(e["pid"]) for e in events if e["event"] == "spawn" and e["role"] == "worker"
                    ]
                    for i, pid in enumerate(workers):
                        if kill_all or i == 1:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
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


def downtime() -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cl-ckptbench-jobs-"))
    make_synthetic_corpus(work / "corpus.jsonl", num_docs=400, seed=0)
    prepare_main([str(work / "corpus.jsonl"), "-o", str(work / "corpus.tokens"), "--quiet"])
    try:
        return {
            "peer (1 rank killed)": _job(work, work / "corpus.tokens", "peer", kill_all=False),
            "checkpoint (3 ranks killed)": _job(work, work / "corpus.tokens", "ckpt", kill_all=True),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each arm, alternating")
    ap.add_argument("--every", type=int, default=1, help="K inside part 1 (1: a save every step if free)")
    ap.add_argument("--skip-downtime", action="store_true")
    a = ap.parse_args()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    result["cost"] = cost(a.steps, a.blocks, a.every)
    print(json.dumps(result["cost"], indent=1), flush=True)
    if not a.skip_downtime:
        result["downtime"] = downtime()
        print(json.dumps(result["downtime"], indent=1), flush=True)
    out = REPO / "benchmarks" / "results" / "checkpoint.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
