"""`make demo`: a real 4-worker + 1-spare training job, three faults of different kinds injected
and recovered in place, and the final weights compared bit for bit with a fault-free run.

    python examples/demo.py [--steps 60] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ["raise:rank=2:step=12:site=backward", "kill:rank=1:step=25", "hang:rank=3:step=40"]


def run(
    label: str, run_dir: Path, data: Path, args: argparse.Namespace, faults: list[str]
) -> tuple[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    digest_file = run_dir.with_suffix(".digest")
    digest_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "checkpointless",
        "run",
        "--nproc",
        "4",
        "--spares",
        "0" if not faults else "1",
        "--run-dir",
        str(run_dir),
        "--hang-timeout",
        str(args.hang_timeout),
    ]
    for f in faults:
        cmd += ["--inject", f]
    cmd += [
        str(ROOT / "examples" / "train_gpt.py"),
        "--steps",
        str(args.steps),
        "--dim",
        "64",
        "--layers",
        "3",
        "--heads",
        "4",
        "--seq-len",
        "64",
        "--global-batch",
        "16",
        "--data",
        str(data),
        "--digest-out",
        str(digest_file),
    ]
    print(f"\n=== {label}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, timeout=900)
    took = time.monotonic() - t0
    if rc != 0 or not digest_file.exists():
        raise SystemExit(f"demo: the {label} run failed (exit code {rc}); see {run_dir}/events.jsonl")
    return digest_file.read_text().strip(), took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--hang-timeout", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "corpus.tokens"
    if not data.exists():
        from checkpointless.data import make_synthetic_corpus, prepare_main

        make_synthetic_corpus(out / "corpus.jsonl", num_docs=3000, seed=0)
        if prepare_main([str(out / "corpus.jsonl"), "-o", str(data)]) != 0:
            return 1
    clean, t_clean = run("fault-free run", out / "clean", data, args, [])
    faulty, t_faulty = run("run with 3 faults", out / "faults", data, args, FAULTS)
    events = [json.loads(x) for x in (out / "faults" / "events.jsonl").read_text().splitlines()]
    print("\n=== recoveries")
    for e in (e for e in events if e["event"] == "recovery"):
        causes = [f for f in e["faults"] if f["kind"] != "comm"] or e["faults"]
        what = ", ".join(f"{f['kind']} on rank {f['rank']}" for f in causes)
        detect = f"detected after {e['detect_s']:.2f} s, then " if "detect_s" in e else ""
        print(
            f"  {what:<20} {detect}downtime {e['downtime_s']:.2f} s  (stop {e['collect_s']:.2f}, rebuild "
            f"{e['rebuild_s']:.3f}, state {e['transfer_s']:.3f} s for {e['state_bytes'] / 1e6:.1f} MB, "
            f"first batch {e.get('first_batch_s', 0.0) * 1e3:.1f} ms, first step {e['first_step_s']:.2f})"
        )
    print(f"\n  fault-free run: {t_clean:.1f} s   with 3 faults: {t_faulty:.1f} s")
    print(f"  final weights, fault-free : {clean}")
    print(f"  final weights, with faults: {faulty}")
    if clean != faulty:
        print("  MISMATCH: the faulted run diverged from the fault-free run")
        return 1
    print("  bitwise identical: no step lost, no sample skipped or repeated")
    # where the faulted run's wall time went, next to a checkpoint-restart estimate, plus the PNG
    from checkpointless.observe.report import main as report_main

    print("\n=== goodput ledger (checkpointless report)")
    return report_main([str(out / "faults"), "--png", str(out / "faults" / "timeline.png")])


if __name__ == "__main__":
    raise SystemExit(main())
