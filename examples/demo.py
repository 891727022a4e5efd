"""`make demo`: a real 4-worker + 1-spare training job, three faults of different kinds injected
and recovered in place, and the final weights compared bit for bit with a fault-free run.

    python examples/demo.py [--steps 120] [--hang-timeout 5] [--out runs/demo]

With ``--fsdp 2,2`` (``make demo-hsdp``) the model is sharded with torch's FSDP2 over a 2x2
(replicate, shard) mesh, the faults include the loss of a whole replica group, and each rank's
final *shards* are compared with the same rank's in the fault-free run.

Afterwards ``checkpointless report runs/demo/faults`` prints the ledger again; the timeline is
``runs/demo/faults/timeline.png``.
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
# HSDP 2x2: a raise inside FSDP's reduce-scatter, a SIGKILL, then replica group 0 (ranks 0 and 1)
# killed at once, whose shards come from group 1
HSDP_FAULTS = [
    "raise:rank=2:step=12:site=backward",
    "kill:rank=1:step=25",
    "kill:rank=0:step=40",
    "kill:rank=1:step=40",
]


NPROC = 4


def run(
    label: str, run_dir: Path, data: Path, args: argparse.Namespace, faults: list[str]
) -> tuple[dict[int, str], float]:
    """Run the job; return every rank's final-weights digest and the wall time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    # every rank writes its own digest ("{rank}" is filled in by the example): a fault that left
    # one replica different from the others must not hide behind rank 0's file
    digest_files = {r: run_dir.parent / f"{run_dir.name}.digest-{r}" for r in range(NPROC)}
    for f in digest_files.values():
        f.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "checkpointless",
        "run",
        "--nproc",
        str(NPROC),
        "--spares",
        "0" if not faults else ("2" if args.fsdp else "1"),
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
        str(run_dir.parent / f"{run_dir.name}.digest-{{rank}}"),
        *(["--fsdp", args.fsdp] if args.fsdp else []),
    ]
    print(f"\n=== {label}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        rc = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the launcher then stops its workers and spares and removes its
        # shared memory, which a killed launcher would leave to its reaper
        proc.terminate()
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        print(f"demo: the {label} run took over 900 s and was stopped", flush=True)
    took = time.monotonic() - t0
    missing = [r for r, f in digest_files.items() if not f.exists()]
    if rc != 0 or missing:
        raise SystemExit(
            f"demo: the {label} run failed (exit code {rc}; no final digest from ranks {missing}); "
            f"see {run_dir}/events.jsonl"
        )
    return {r: f.read_text().strip() for r, f in digest_files.items()}, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--hang-timeout", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo"))
    ap.add_argument("--fsdp", metavar="R,S", help="shard the model over an R x S mesh (make demo-hsdp: 2,2)")
    args = ap.parse_args()
    faults = HSDP_FAULTS if args.fsdp else FAULTS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "corpus.tokens"
    if not data.exists():
        from checkpointless.data import make_synthetic_corpus, prepare_main

        make_synthetic_corpus(out / "corpus.jsonl", num_docs=3000, seed=0)
        if prepare_main([str(out / "corpus.jsonl"), "-o", str(data)]) != 0:
            return 1
    clean, t_clean = run("fault-free run", out / "clean", data, args, [])
    faulty, t_faulty = run(f"run with {len(faults)} faults", out / "faults", data, args, faults)
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
    print(f"\n  fault-free run: {t_clean:.1f} s   with {len(faults)} faults: {t_faulty:.1f} s")
    if args.fsdp:
        return compare_shards(clean, faulty, out)
    print(f"  final weights, fault-free : {clean[0]}")
    print(f"  final weights, with faults: {faulty[0]}")
    if len(set(clean.values())) != 1:
        print(f"  MISMATCH: the fault-free run's ranks disagree with each other: {clean}")
        return 1
    wrong = sorted(r for r, d in faulty.items() if d != clean[0])
    if wrong:
        print(f"  MISMATCH: ranks {wrong} of the faulted run diverged from the fault-free run")
        return 1
    print(f"  bitwise identical on all {NPROC} ranks: no step lost, no sample skipped or repeated")
    # where the faulted run's wall time went, next to a checkpoint-restart estimate, plus the PNG
    from checkpointless.observe.report import main as report_main

    print("\n=== goodput ledger (checkpointless report)")
    return report_main([str(out / "faults"), "--png", str(out / "faults" / "timeline.png")])


def compare_shards(clean: dict[int, str], faulty: dict[int, str], out: Path) -> int:
    """Each rank's final shards against the same rank's in the fault-free run."""
    for r in sorted(clean):
        same = "same" if faulty[r] == clean[r] else "DIFFERENT"
        print(f"  rank {r} shards, fault-free {clean[r][:16]}  with faults {faulty[r][:16]}  {same}")
    wrong = sorted(r for r in clean if faulty[r] != clean[r])
    if wrong:
        print(f"  MISMATCH: the shards of ranks {wrong} diverged from the fault-free run")
        return 1
    print(f"  bitwise identical shards on all {NPROC} ranks: no step lost, no sample skipped or repeated")
    from checkpointless.observe.report import main as report_main

    print("\n=== goodput ledger (checkpointless report)")
    return report_main([str(out / "faults"), "--png", str(out / "faults" / "timeline.png")])


if __name__ == "__main__":
    raise SystemExit(main())
